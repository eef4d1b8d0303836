"""The shared-memory region sizes lab/bench/perf.py gives perf_analyzer: one request's bytes per ensemble
output, for the deployment that serves it (rows from the resize rule, width from the checkpoint
config, BF16 on GPU and FP32 on CPU)."""

import json

import numpy as np
import pytest
import torch

from backends.config import DEMO_CONFIG
from backends.deploy.repository import Deployment, model_configs
from contract import ENSEMBLE
from backends.preprocess import Preprocessor
from backends.checkpoint.seeded import seeded_model
from lab.bench.perf import output_byte_sizes, request_images
from clients.kimi_client import chat_prompt_ids


def test_sizes_equal_the_outputs_of_the_cpu_pipeline():
    images = request_images("sample")
    ids = chat_prompt_ids(len(images))
    sizes = output_byte_sizes(Deployment(), ids, images)
    assert set(sizes) == {o.name for o in model_configs(Deployment())[ENSEMBLE].output}
    pixels, grids, _ = Preprocessor(DEMO_CONFIG.media)(images)
    with torch.no_grad():
        embeds = seeded_model(DEMO_CONFIG.encoder)(pixels, grids)
    assert sizes["IMAGE_EMBEDS"] == embeds.numel() * 4 == 502 * 256 * 4  # README: (502, 256) float32
    assert sizes["GRID_THWS"] == grids.astype(np.int64).nbytes
    assert sizes["IMAGE_TOKEN_COUNTS"] == len(images) * 8
    assert sizes["EXPANDED_IDS"] == (len(ids) - len(images) + embeds.shape[0]) * 8


@pytest.mark.parametrize("text_hidden", [7168, 4096])
def test_embedding_size_follows_the_checkpoint_config_and_the_device_dtype(tmp_path, text_hidden):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": text_hidden}}))
    images = request_images("1024")  # not resized, padded to 1036^2: 74^2 patches, 37^2 tokens after the 2x2 merge
    ids = chat_prompt_ids(1)
    gpu = output_byte_sizes(Deployment(device="gpu", checkpoint=str(tmp_path)), ids, images)
    cpu = output_byte_sizes(Deployment(device="cpu", checkpoint=str(tmp_path)), ids, images)
    assert gpu["IMAGE_EMBEDS"] == 37 * 37 * text_hidden * 2  # 1369 x 7168 BF16 = 19.6 MB, as on the H200
    assert cpu["IMAGE_EMBEDS"] == 2 * gpu["IMAGE_EMBEDS"]
    assert max(gpu.values()) == gpu["IMAGE_EMBEDS"]


@pytest.mark.parametrize("bad,says", [(["--concurrency", "1,x"], "--concurrency takes"), (["--images", "2048px"], "--images must"),
                                      (["--ensembles", "plain,fast"], "--ensembles takes")])
def test_a_run_refused_on_its_arguments_starts_no_mps_daemon(monkeypatch, tmp_path, bad, says):
    """--mps starts a daemon; a run that its own arguments (or a missing perf_analyzer) refuse must stop
    before that, not leave a daemon to clean up."""
    from lab.bench import perf

    started = []
    monkeypatch.setattr(perf.mps, "start", lambda *a, **k: started.append(a))
    monkeypatch.setattr(perf, "resolve_device", lambda device: "gpu")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "perf_analyzer").write_text("")
    with pytest.raises(SystemExit, match=says):
        perf.main(["--mps", "--perf-dir", str(tmp_path), "--shared-memory", "none", *bad])
    assert started == []
    with pytest.raises(SystemExit, match="not found"):  # no perf_analyzer
        perf.main(["--mps", "--perf-dir", str(tmp_path / "nowhere"), "--shared-memory", "none"])
    assert started == []


def test_perf_analyzers_input_file_carries_the_images_in_the_bytes_layout(tmp_path):
    """IMAGES as base64 of the serialized BYTES tensor: each element's 4-byte little-endian length, then
    its bytes; read back here by hand. MEDIA_FRAMES as zeros only when asked for."""
    import base64
    import json

    from lab.bench.perf import write_input_data

    images = [b"\xff\xd8first\xff\xd9", b"", b"x" * 300]
    doc = json.loads(write_input_data(tmp_path / "in.json", images, media_frames=True).read_text())
    (request,) = doc["data"]
    raw, got = base64.b64decode(request["IMAGES"]["b64"]), []
    while raw:
        n = int.from_bytes(raw[:4], "little")
        got.append(raw[4:4 + n])
        raw = raw[4 + n:]
    assert got == images and request["IMAGES"]["shape"] == [3]
    assert request["MEDIA_FRAMES"] == {"content": [0, 0, 0], "shape": [3]}
    assert "MEDIA_FRAMES" not in json.loads(write_input_data(tmp_path / "b.json", images).read_text())["data"][0]
