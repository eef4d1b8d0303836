"""The one place for the settings every step agrees on: token ids, the media (resize) rule, the encoder
shape, and the per-request limits.

Values default to the released Kimi-K2.5 checkpoint (docs/kimi_k25.md#media-config, #token-ids,
#encoder). A checkpoint directory overrides them through `load_checkpoint_config`, which reads both
the original config names (`vt_*`, `media_placeholder_token_id`) and what transformers writes
(`vision_config.hidden_size`, `image_token_id`, `text_config.hidden_size`). The model repository
carries the resolved `VisionConfig` as JSON (`to_json` / `from_json`), so that model instances never
parse the checkpoint's files again.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import contract

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """An on/off setting from the environment, read the same way everywhere: 1, true, yes or on; 0,
    false, no or off (any case); unset or empty gives `default`. Anything else raises, naming it, rather
    than being taken as one or the other."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def env_int(name: str, default: int) -> int:
    """A whole-number setting from the environment: unset or empty gives `default`; anything that is
    not an integer raises, naming the variable (a bare int() would say only "invalid literal")."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r}: expected a whole number") from None


@dataclass(frozen=True)
class TokenIds:
    """Special-token ids the vision path needs. `media_pad` is the one placeholder per image."""

    media_pad: int = contract.MEDIA_PAD
    media_begin: int = contract.MEDIA_BEGIN
    media_content: int = contract.MEDIA_CONTENT
    media_end: int = contract.MEDIA_END


@dataclass(frozen=True)
class MediaConfig:
    """The checkpoint processor's `media_proc_cfg` (preprocessor_config.json)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 16384
    patch_limit_on_one_side: int = 512
    in_patch_limit_each_frame: int = 4096
    temporal_merge_kernel_size: int = 4
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def pad_multiple(self) -> int:
        """Resized images are zero-padded bottom/right up to a multiple of this many pixels."""
        return self.patch_size * self.merge_kernel_size


@dataclass(frozen=True)
class EncoderConfig:
    """MoonViT3d tower + patch-merger projector. Names follow the checkpoint's vision config."""

    patch_size: int = 14
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 4304
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    rope_max_height: int = 512
    rope_max_width: int = 512
    text_hidden_size: int = 7168
    layer_norm_eps: float = 1e-5
    projector_ln_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_tokens(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            # 2-D RoPE gives a quarter of each head to (x, y) frequency pairs.
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 4 for 2-D RoPE")


@dataclass(frozen=True)
class VisionConfig:
    """Everything the three backends need to agree on."""

    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    tokens: TokenIds = field(default_factory=TokenIds)
    torch_dtype: str = "bfloat16"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "VisionConfig":
        d = json.loads(text)
        enc = dict(d["encoder"], merge_kernel_size=tuple(d["encoder"]["merge_kernel_size"]))
        media = {k: tuple(v) if isinstance(v, list) else v for k, v in d["media"].items()}
        return cls(encoder=EncoderConfig(**enc), media=MediaConfig(**media), tokens=TokenIds(**d["tokens"]),
                   torch_dtype=d["torch_dtype"])


@dataclass(frozen=True)
class Limits:
    """Per-request limits (model config parameters). Every violation is a RequestError naming the limit
    and the request's own value."""

    max_images: int = 64  # IMAGES entries (frames count one each)
    max_patches: int = 16384 * 8
    max_image_pixels: int = 179_000_000  # Pillow's own hard bomb limit (2 x MAX_IMAGE_PIXELS)


# The embedded default: the real K2.5 preprocessing rule and token ids with a tiny MoonViT3d
# (2 layers, 64 wide) so that `make run` and the tests finish in seconds on 2 CPU cores.
# Its weights are seeded random (backends/weights/seeded.py): a pipeline demo, not a trained model.
DEMO_CONFIG = VisionConfig(
    encoder=EncoderConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=160, text_hidden_size=256),
    torch_dtype="float32",
)


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


def load_checkpoint_config(checkpoint_dir: str | Path) -> VisionConfig:
    """Read `config.json` (required) and `preprocessor_config.json` (optional) from a checkpoint dir.
    Parsed once per directory and process."""
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
