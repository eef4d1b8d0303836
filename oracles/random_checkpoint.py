"""Write a random Kimi-K2.5-sized vision checkpoint in the original layout (config.json with `vt_*`
names, bf16 safetensors, sharded with an index, plus a language-model shard the loader must skip).

For tests and benchmarks through tritonserver (`--checkpoint`): real shapes, seeded random weights.
Tensor names and shapes come from the published layout (docs/kimi_k25.md#checkpoint-layouts), not
from our model, so a renamed or reshaped parameter in our encoder cannot follow into the fixture.

    python -m oracles.random_checkpoint /tmp/kimi-random [--layers 27]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 20260130


@dataclass(frozen=True)
class VisionShape:
    """The released vision config (docs/kimi_k25.md#vision-config-values). Any object with these
    attributes will do (our EncoderConfig has them)."""

    patch_size: int = 14
    hidden_size: int = 1152
    num_layers: int = 27
    num_heads: int = 16
    intermediate_size: int = 4304
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    text_hidden_size: int = 7168


def original_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Original name -> shape, the table of docs/kimi_k25.md#checkpoint-layouts for any size.

    D hidden, I MLP, p patch, M = D * merged patches. `pos_emb.time_weight` is a derived buffer and
    is not stored."""
    d, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    merged = d * cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1]
    norm = lambda prefix: {f"{prefix}.weight": (d,), f"{prefix}.bias": (d,)}  # noqa: E731
    linear = lambda prefix, n_out, n_in: {f"{prefix}.weight": (n_out, n_in), f"{prefix}.bias": (n_out,)}  # noqa: E731
    shapes = {"vision_tower.patch_embed.proj.weight": (d, 3, p, p), "vision_tower.patch_embed.proj.bias": (d,),
              "vision_tower.patch_embed.pos_emb.weight": (cfg.init_pos_emb_height, cfg.init_pos_emb_width, d)}
    for n in range(cfg.num_layers):
        block = f"vision_tower.encoder.blocks.{n}"
        shapes |= norm(f"{block}.norm0") | linear(f"{block}.wqkv", 3 * d, d) | linear(f"{block}.wo", d, d)
        shapes |= norm(f"{block}.norm1") | linear(f"{block}.mlp.fc0", i, d) | linear(f"{block}.mlp.fc1", d, i)
    shapes |= norm("vision_tower.encoder.final_layernorm") | norm("mm_projector.pre_norm")
    shapes |= linear("mm_projector.proj.0", merged, merged) | linear("mm_projector.proj.2", cfg.text_hidden_size, merged)
    return shapes


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int = SEED, std: float = 0.02) -> dict[str, torch.Tensor]:
    """float32 tensors from one CPU generator, drawn in name order so every machine gets the same bits.
    LayerNorm scales are 1 + N(0, std) (a zero scale would erase the signal), all else N(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        t = torch.randn(shapes[name], generator=gen, dtype=torch.float32) * std
        if "norm" in name and name.endswith(".weight"):
            t += 1.0
        out[name] = t
    return out


def original_config(cfg) -> dict:
    """config.json as the released checkpoint spells it (`vt_*` names, `media_placeholder_token_id`)."""
    return {
        "model_type": "kimi_k25", "media_placeholder_token_id": 163605, "torch_dtype": "bfloat16",
        "vision_config": {
            "patch_size": cfg.patch_size, "vt_hidden_size": cfg.hidden_size, "vt_num_hidden_layers": cfg.num_layers,
            "vt_num_attention_heads": cfg.num_heads, "vt_intermediate_size": cfg.intermediate_size,
            "init_pos_emb_height": cfg.init_pos_emb_height, "init_pos_emb_width": cfg.init_pos_emb_width,
            "init_pos_emb_time": cfg.init_pos_emb_time, "merge_kernel_size": list(cfg.merge_kernel_size),
            "text_hidden_size": cfg.text_hidden_size, "mm_hidden_size": cfg.hidden_size,
        },
        "text_config": {"hidden_size": cfg.text_hidden_size},
    }


def write_checkpoint(out: Path, cfg=VisionShape(), dtype=torch.bfloat16, std: float = 0.02) -> Path:
    """Shards as the release splits them: a language-model shard first (a loader must not need it),
    then the projector, then the tower, with an index. config.json is written last, so its presence
    means the checkpoint is complete (lab/gpu.sh relies on that)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype).contiguous() for k, v in random_tensors(original_shapes(cfg), std=std).items()}
    shards = {"model-00001-of-00003.safetensors": {"language_model.model.embed_tokens.weight": torch.zeros(8, 8, dtype=dtype)},
              "model-00002-of-00003.safetensors": {k: v for k, v in state.items() if k.startswith("mm_projector.")},
              "model-00003-of-00003.safetensors": {k: v for k, v in state.items() if k.startswith("vision_tower.")}}
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(out / name))
        weight_map.update({k: name for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(original_config(cfg), indent=1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=27)
    args = ap.parse_args(argv)
    print(write_checkpoint(args.out, dataclasses.replace(VisionShape(), num_layers=args.layers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
