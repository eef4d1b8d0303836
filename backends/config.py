"""The one place for the settings every step agrees on: token ids, the media (resize) rule, the encoder
shape, and the per-request limits.

Values default to the released Kimi-K2.5 checkpoint (docs/kimi_k25.md#media-config, #token-ids,
#encoder). A checkpoint directory overrides them (backends/checkpoint/config.py parses its files). The
model repository carries the resolved `VisionConfig` as JSON (`to_json` / `from_json`), so that model
instances never parse the checkpoint's files again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

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


# Header, metadata (EXIF, ICC profile, XMP) and row padding an honest encoder may add to an image's pixels.
IMAGE_HEADER_SLACK_BYTES = 1 << 20


def image_bytes_bound(max_pixels: int) -> int:
    """The most bytes an honest encoded image of `max_pixels` pixels takes: its 8-bit RGB pixels stored
    uncompressed (BMP, TIFF, PPM: 3 bytes a pixel; JPEG, PNG and WebP compress them) plus header slack.
    179 M pixels (max_image_pixels) give 538 MB."""
    return 3 * max_pixels + IMAGE_HEADER_SLACK_BYTES


@dataclass(frozen=True)
class Limits:
    """Per-request limits (model config parameters). Every violation is a RequestError naming the limit
    and the request's own value.

    The byte limits are checked before any image byte is copied or read (docs/operations.md#memory);
    left at None they are derived from `max_image_pixels`: `max_image_bytes` is the largest an honest
    image of that many pixels can be (image_bytes_bound), and `max_request_bytes` the same figure, so
    that one such image fits a request alone and any mix of smaller ones up to that total does
    (64 photos of 8 MB)."""

    max_images: int = 64  # IMAGES entries (frames count one each)
    max_patches: int = 16384 * 8
    max_image_pixels: int = 179_000_000  # Pillow's own hard bomb limit (2 x MAX_IMAGE_PIXELS)
    max_image_bytes: int | None = None  # one IMAGES entry; None: image_bytes_bound(max_image_pixels)
    max_request_bytes: int | None = None  # all IMAGES entries of a request together; None: max_image_bytes

    def __post_init__(self):
        if self.max_image_bytes is None:
            object.__setattr__(self, "max_image_bytes", image_bytes_bound(self.max_image_pixels))
        if self.max_request_bytes is None:
            object.__setattr__(self, "max_request_bytes", self.max_image_bytes)
        for name in ("max_images", "max_patches", "max_image_pixels", "max_image_bytes", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


# The embedded default: the real K2.5 preprocessing rule and token ids with a tiny MoonViT3d
# (2 layers, 64 wide) so that `make run` and the tests finish in seconds on 2 CPU cores.
# Its weights are seeded random (backends/checkpoint/seeded.py): a pipeline demo, not a trained model.
DEMO_CONFIG = VisionConfig(
    encoder=EncoderConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=160, text_hidden_size=256),
    torch_dtype="float32",
)
