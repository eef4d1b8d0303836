"""A checkpoint's config files -> VisionConfig, in one place.

Reads both the original config names (`vt_*`, `media_placeholder_token_id`) and what transformers
writes (`vision_config.hidden_size`, `image_token_id`, `text_config.hidden_size`), and the optional
`preprocessor_config.json` (`media_proc_cfg`: resize limits, mean/std); docs/kimi_k25.md#vision-config-values.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from backends.config import DEMO_CONFIG, EncoderConfig, MediaConfig, TokenIds, VisionConfig


def _pick(d: dict, *names, default=None):
    for name in names:
        if name in d and d[name] is not None:
            return d[name]
    return default


def parse_config_json(cfg: dict, preprocessor: dict | None = None) -> VisionConfig:
    """Build a VisionConfig from a checkpoint's config.json (and preprocessor_config.json) dicts."""
    vc = cfg.get("vision_config") or {}
    tc = cfg.get("text_config") or {}
    base = EncoderConfig()
    merge = _pick(vc, "merge_kernel_size", default=list(base.merge_kernel_size))
    if isinstance(merge, int):
        merge = [merge, merge]
    rope = vc.get("rope_parameters") or {}
    encoder = EncoderConfig(
        patch_size=int(_pick(vc, "patch_size", default=base.patch_size)),
        hidden_size=int(_pick(vc, "vt_hidden_size", "hidden_size", default=base.hidden_size)),
        num_layers=int(_pick(vc, "vt_num_hidden_layers", "num_hidden_layers", default=base.num_layers)),
        num_heads=int(_pick(vc, "vt_num_attention_heads", "num_attention_heads", default=base.num_heads)),
        intermediate_size=int(_pick(vc, "vt_intermediate_size", "intermediate_size", default=base.intermediate_size)),
        init_pos_emb_height=int(_pick(vc, "init_pos_emb_height", "pos_emb_height", default=base.init_pos_emb_height)),
        init_pos_emb_width=int(_pick(vc, "init_pos_emb_width", "pos_emb_width", default=base.init_pos_emb_width)),
        init_pos_emb_time=int(_pick(vc, "init_pos_emb_time", "pos_emb_time", default=base.init_pos_emb_time)),
        merge_kernel_size=(int(merge[0]), int(merge[1])),
        rope_theta=float(_pick(rope, "rope_theta", default=base.rope_theta)),
        text_hidden_size=int(_pick(vc, "text_hidden_size", default=_pick(tc, "hidden_size", default=base.text_hidden_size))),
        projector_ln_eps=float(_pick(vc, "projector_ln_eps", default=_pick(cfg, "projection_layer_norm_eps", default=1e-5))),
    )
    tokens = TokenIds(
        media_pad=int(_pick(cfg, "media_placeholder_token_id", "image_token_id", default=TokenIds.media_pad)),
    )
    media = MediaConfig(patch_size=encoder.patch_size, merge_kernel_size=encoder.merge_kernel_size[0])
    if preprocessor:
        proc = preprocessor.get("media_proc_cfg", preprocessor)
        overrides = {}
        for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side",
                    "in_patch_limit_each_frame", "temporal_merge_kernel_size"):
            if proc.get(key) is not None:
                value = proc[key]
                overrides[key] = int(value[0] if isinstance(value, (list, tuple)) else value)
        for key in ("image_mean", "image_std"):
            if proc.get(key) is not None:
                overrides[key] = tuple(float(v) for v in proc[key])
        media = dataclasses.replace(media, **overrides)
    dtype = str(_pick(cfg, "torch_dtype", "dtype", default=_pick(vc, "torch_dtype", default="bfloat16")))
    return VisionConfig(encoder=encoder, media=media, tokens=tokens, torch_dtype=dtype)


def load_config(checkpoint_dir: str | Path) -> VisionConfig:
    """The checkpoint's VisionConfig: `config.json` (required) and `preprocessor_config.json` (optional)
    of the directory, parsed once per directory and process; the embedded demo's for an empty path."""
    if not str(checkpoint_dir):
        return DEMO_CONFIG
    return _load_checkpoint_config(str(Path(checkpoint_dir).resolve()))


@functools.lru_cache(maxsize=8)
def _load_checkpoint_config(checkpoint_dir: str) -> VisionConfig:
    root = Path(checkpoint_dir)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"checkpoint {root} has no config.json")
    cfg = json.loads(config_path.read_text())
    pre_path = root / "preprocessor_config.json"
    preprocessor = json.loads(pre_path.read_text()) if pre_path.is_file() else None
    return parse_config_json(cfg, preprocessor)
