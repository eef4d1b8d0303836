"""Our metrics on the metrics port, and a Grafana dashboard that charts only metrics the server exports."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from backends.deploy.supervisor import scrape_text
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like
from server_state import eventually

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kimi-vision-triton.json"
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "clamp_min", "le", "model", "kind", "reason", "instance",
                "path"}


def _exported(server) -> set[str]:
    text = scrape_text(server.metrics_url)
    names = set(re.findall(r"^# TYPE (\S+)", text, re.M)) | set(re.findall(r"^([a-zA-Z_:][\w:]*)[{ ]", text, re.M))
    return names


def test_our_metrics_count_images_patches_rejections_and_step_times(server):
    client = KimiVisionClient(server.grpc_url)
    client.infer(chat_prompt_ids(1), [encode(photo_like(100, 60, seed=1), "PNG")])
    with pytest.raises(InferenceServerException):
        client.infer(np.array([1, 2], np.int64), [encode(photo_like(10, 10), "PNG")])  # 1:1 mismatch
    client.close()
    expected = [r'kimi_vision_images_total\{model="kimi_preprocess"\} [1-9]',
                r'kimi_vision_patches_total\{model="kimi_preprocess"\} [1-9]',
                r'kimi_vision_rejections_total\{model="kimi_preprocess",reason="placeholder_mismatch"\} [1-9]',
                r'kimi_vision_step_seconds_count\{model="moonvit3d"\} [1-9]',
                r'kimi_vision_decodes_total\{model="kimi_preprocess",path="pillow",reason="no_gpu"\} [1-9]']

    # sent from the stubs' sender threads
    got = eventually(lambda: scrape_text(server.metrics_url), lambda t: all(re.search(e, t) for e in expected))
    for e in expected:
        assert re.search(e, got), e


def test_dashboard_references_only_exported_metrics(server):
    test_our_metrics_count_images_patches_rejections_and_step_times(server)  # every family has samples now
    # A scrape of tritonserver that times out leaves only our families in the answer: read until its are there.
    exported = eventually(lambda: _exported(server), lambda names: "nv_inference_count" in names)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs
    used = set()
    for expr in exprs:
        expr = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]|\b\d+(\.\d+)?(e-?\d+)?\b', "", expr)
        used |= {w for w in re.findall(r"[a-zA-Z_:][\w:]*", expr) if w not in PROMQL_WORDS}
    missing = sorted(name for name in used if name not in exported)
    assert used and missing == [], f"the dashboard charts metrics the server does not export: {missing}"
