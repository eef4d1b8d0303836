"""Write a random Kimi-K2.5-sized vision checkpoint in the original layout (config.json with `vt_*`
names, bf16 safetensors, sharded with an index, plus a language-model shard the loader must skip).

For tests and benchmarks through tritonserver (`--checkpoint`): real shapes, seeded random weights.

    python -m oracles.random_checkpoint /tmp/kimi-random [--layers 27]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from backends.config import EncoderConfig
from backends.encoder.moonvit3d import KimiVisionModel
from backends.weights.seeded import init_random_


def write_checkpoint(out: Path, cfg: EncoderConfig = EncoderConfig(), dtype=torch.bfloat16, std: float = 0.02) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model = init_random_(KimiVisionModel(cfg), std=std)
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    tower = {k: v for k, v in state.items() if k.startswith("vision_tower.")}
    projector = {k: v for k, v in state.items() if k.startswith("mm_projector.")}
    shards = {"model-00001-of-00003.safetensors": {"language_model.model.embed_tokens.weight": torch.zeros(8, 8, dtype=dtype)},
              "model-00002-of-00003.safetensors": projector, "model-00003-of-00003.safetensors": tower}
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(out / name))
        weight_map.update({k: name for k in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
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
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=27)
    args = ap.parse_args(argv)
    print(write_checkpoint(args.out, EncoderConfig(num_layers=args.layers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
