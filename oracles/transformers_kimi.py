"""transformers' native Kimi-K2.5 model as the numeric oracle (tests and benchmarks share this).

`hf_config` builds a `Kimi_K25Config` of any vision size with the smallest deepseek_v3 text model that
constructs (only its hidden_size, the projector output, matters). `reinit_` draws trained-like weights:
with transformers' std 0.02 init attention is almost uniform and a wrong RoPE or position embedding
would hide under a tolerance. `load_checkpoint_into_hf` puts a checkpoint directory (the original
layout our server serves, or what `Kimi_K25Model.save_pretrained` writes) into transformers' model with
this module's own name mapping and safetensors reading, restated from docs/kimi_k25.md#checkpoint-layouts
and transformers' module names. Nothing here imports our code: the model under test is built by the
tests themselves, so a slip in our loader cannot be copied into its reference.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open


def hf_config(*, hidden=64, layers=2, heads=4, intermediate=128, pos_emb=8, text_hidden=96, attn="sdpa"):
    from transformers.models import kimi_k25 as kimi

    vision = dict(patch_size=14, pos_emb_height=pos_emb, pos_emb_width=pos_emb, pos_emb_time=4,
                  num_attention_heads=heads, num_hidden_layers=layers, hidden_size=hidden,
                  intermediate_size=intermediate, merge_kernel_size=[2, 2])
    text = dict(model_type="deepseek_v3", hidden_size=text_hidden, num_hidden_layers=1, vocab_size=128,
                intermediate_size=64, moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1, first_k_dense_replace=1,
                q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    cfg = kimi.Kimi_K25Config(vision_config=vision, text_config=text, projection_hidden_size=hidden)
    cfg._attn_implementation = attn
    return cfg


def reinit_(model: torch.nn.Module, seed: int) -> None:
    """Norms 1+0.1N / 0.1N, pos-emb N(0,1), matrices N(0,1/fan_in) (q/k x2), biases 0.1N. In place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif "position_embeddings" in name:
                p.copy_(noise)
            elif p.ndim >= 2:
                gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(noise * gain / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * noise)


def hf_model(cfg, seed: int = 0):
    """A random `Kimi_K25Model` (fp32, CPU, eval) with trained-like vision and projector weights."""
    from transformers.models import kimi_k25 as kimi

    torch.manual_seed(seed)
    model = kimi.Kimi_K25Model(cfg).eval()
    reinit_(model.vision_tower, seed + 1)
    reinit_(model.mm_projector, seed + 2)
    return model


def hf_config_from(enc, attn: str = "sdpa"):
    """`hf_config` for an encoder config (any object with EncoderConfig's attributes, e.g. a
    checkpoint's), refusing what `hf_config` cannot say."""
    # What hf_config leaves at transformers' defaults (RoPE theta 10000, norm eps 1e-5) must match too,
    # or the reference would silently run a different model.
    fixed = {"patch_size": (enc.patch_size, 14), "merge_kernel_size": (tuple(enc.merge_kernel_size), (2, 2)),
             "init_pos_emb_time": (enc.init_pos_emb_time, 4),
             "init_pos_emb_width": (enc.init_pos_emb_width, enc.init_pos_emb_height),
             "rope_theta": (enc.rope_theta, 10000.0), "layer_norm_eps": (enc.layer_norm_eps, 1e-5),
             "projector_ln_eps": (enc.projector_ln_eps, 1e-5)}
    wrong = {k: got for k, (got, want) in fixed.items() if got != want}
    if wrong:
        raise ValueError(f"hf_config builds patch 14, merge 2x2, pos-emb time 4, a square pos-emb grid, RoPE "
                         f"theta 10000 and norm eps 1e-5; this encoder has {wrong}")
    return hf_config(hidden=enc.hidden_size, layers=enc.num_layers, heads=enc.num_heads,
                     intermediate=enc.intermediate_size, pos_emb=enc.init_pos_emb_height,
                     text_hidden=enc.text_hidden_size, attn=attn)


# --------------------------------------------------------------------------------------------------
# Checkpoint -> transformers' Kimi_K25Model (docs/kimi_k25.md#checkpoint-layouts)
# --------------------------------------------------------------------------------------------------

VISION_PREFIXES = ("vision_tower.", "mm_projector.")

# Original block name -> transformers' (Kimi_K25 `vision_tower.layers.N.*`). `norm1` and `mlp.fc1`
# appear on both sides with different meanings, so each name is renamed once, by whole-name lookup.
_ORIGINAL_BLOCK = {"norm0": "norm1", "norm1": "norm2", "wo": "attn.proj", "mlp.fc0": "mlp.fc1", "mlp.fc1": "mlp.fc2"}
# Original names outside the blocks -> transformers'.
_ORIGINAL_MODULE = {
    "vision_tower.encoder.final_layernorm": "vision_tower.final_layernorm",
    "mm_projector.proj.0": "mm_projector.in_proj",
    "mm_projector.proj.2": "mm_projector.out_proj",
}
_ORIGINAL_LEAF = {"vision_tower.patch_embed.pos_emb.weight": "vision_tower.patch_embed.pos_emb.position_embeddings"}

_ORIGINAL_BLOCK_RE = re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.(.+)\.(weight|bias)$")
# What Kimi_K25Model.save_pretrained writes: transformers' block names under `blocks`, wqkv still fused
# and in the original row order.
_SAVED_BLOCK_RE = re.compile(r"^vision_tower\.blocks\.(\d+)\.(.+)\.(weight|bias)$")


def read_vision_tensors(checkpoint_dir) -> dict[str, torch.Tensor]:
    """Stored name -> tensor (CPU, stored dtype) for every `vision_tower.*` / `mm_projector.*` tensor.

    With `model.safetensors.index.json` only the shards its weight_map names for vision tensors are
    opened (a real checkpoint's language model is ~600 GB); without one, every `*.safetensors` file.
    """
    root = Path(checkpoint_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for k, f in weight_map.items() if k.startswith(VISION_PREFIXES)})
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(str(root / fname), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.startswith(VISION_PREFIXES):
                    if key in tensors:
                        raise ValueError(f"{key} is stored twice in {checkpoint_dir}")
                    tensors[key] = f.get_tensor(key)
    if not tensors:
        raise ValueError(f"{checkpoint_dir} holds no vision_tower.* / mm_projector.* tensors")
    return tensors


def hf_name(key: str) -> str:
    """A stored name -> transformers' parameter name; a fused `wqkv` comes back as `...attn.wqkv.*`
    for `to_hf_state` to split.

    Original names are renamed by the tables above (an unknown one inside a block raises). Anything else is taken to be transformers' own name
    already (save_pretrained keeps them outside the blocks) and passes through: `load_checkpoint_into_hf`
    refuses a name the model does not have. No original name outside the blocks equals a transformers
    name of another meaning (`patch_embed.proj`, `mm_projector.pre_norm` mean the same on both sides).
    """
    if key in _ORIGINAL_LEAF:
        return _ORIGINAL_LEAF[key]
    m = _ORIGINAL_BLOCK_RE.match(key)
    if m:
        layer, inner, leaf = m.groups()
        if inner != "wqkv" and inner not in _ORIGINAL_BLOCK:
            raise KeyError(f"{key}: {inner} is not a block tensor of the original layout")
        inner = "attn.wqkv" if inner == "wqkv" else _ORIGINAL_BLOCK[inner]
        return f"vision_tower.layers.{layer}.{inner}.{leaf}"
    m = _SAVED_BLOCK_RE.match(key)
    if m:
        layer, inner, leaf = m.groups()
        inner = "attn.wqkv" if inner == "wqkv" else inner
        return f"vision_tower.layers.{layer}.{inner}.{leaf}"
    module, _, leaf = key.rpartition(".")
    return f"{_ORIGINAL_MODULE.get(module, module)}.{leaf}"


def permute_rope_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The original checkpoint's q/k rows -> transformers' rotate-half order (its `PermuteForRope`):
    per head, the complex pair (2j, 2j+1) goes to rows (j, Dh/2 + j). t: (H*Dh, in) or (H*Dh,)."""
    half = t.shape[0] // num_heads // 2
    return t.reshape(num_heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def split_wqkv(t: torch.Tensor, num_heads: int) -> dict[str, torch.Tensor]:
    """A fused (3*H*Dh, in) / (3*H*Dh,) wqkv -> {"q_proj", "k_proj", "v_proj"}: rows [q | k | v]
    (docs/kimi_k25.md#blocks-attention-merge-projector), q and k re-ordered for rotate-half RoPE."""
    q, k, v = t.chunk(3)
    return {"q_proj": permute_rope_rows(q, num_heads), "k_proj": permute_rope_rows(k, num_heads), "v_proj": v}


def to_hf_state(stored: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """Stored {name: tensor} -> {transformers' parameter name: tensor}. Two stored names for one
    parameter raise, so two layouts mixed in one directory cannot pass silently."""
    out: dict[str, torch.Tensor] = {}
    for key, t in stored.items():
        name = hf_name(key)
        parts = {name: t}
        if ".attn.wqkv." in name:
            parts = {name.replace(".wqkv.", f".{proj}."): part for proj, part in split_wqkv(t, num_heads).items()}
        for target, part in parts.items():
            if target in out:
                raise ValueError(f"two stored tensors map to transformers' {target} (one is {key})")
            out[target] = part
    return out


def load_checkpoint_into_hf(model, checkpoint_dir) -> None:
    """Copy a checkpoint's vision tower + projector into transformers' `Kimi_K25Model` in place, so that
    transformers runs exactly the weights our server serves.

    Every vision parameter of the model must be filled and every stored tensor used, each with the
    parameter's shape; anything else raises, naming the tensor.
    """
    heads = model.config.vision_config.num_attention_heads
    state = to_hf_state(read_vision_tensors(checkpoint_dir), heads)
    params = {k: p for k, p in model.named_parameters() if k.startswith(VISION_PREFIXES)}
    missing, unused = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unused:
        raise ValueError(f"{checkpoint_dir} does not fit transformers' model: missing {missing[:5]}, "
                         f"no parameter for {unused[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            if state[name].shape != param.shape:
                raise ValueError(f"{name}: checkpoint has shape {list(state[name].shape)}, "
                                 f"transformers expects {list(param.shape)}")
            param.copy_(state[name])


def hf_image_features(model, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
    """(sum tokens, text_hidden): transformers' per-media outputs concatenated in media order."""
    with torch.inference_mode():
        out = model.get_image_features(pixel_values, image_grid_thw=grid_thws)
    return torch.cat(list(out.pooler_output))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, in float64."""
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max())
