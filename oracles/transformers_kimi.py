"""transformers' native Kimi-K2.5 model as the numeric oracle (tests and benchmarks share this).

`hf_config` builds a `Kimi_K25Config` of any vision size with the smallest deepseek_v3 text model that
constructs (only its hidden_size, the projector output, matters). `reinit_` draws trained-like weights:
with transformers' std 0.02 init attention is almost uniform and a wrong RoPE or position embedding
would hide under a tolerance. `load_ours` moves the same weights into our model through
`save_pretrained` + our loader, i.e. through the layout real users have on disk;
`load_checkpoint_into_hf` goes the other way (a checkpoint our server serves -> transformers' model).
"""

from __future__ import annotations

import math
import re
import tempfile

import torch


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


def load_ours(model, device="cpu", dtype=None):
    """Our KimiVisionModel with the same weights, through save_pretrained and our loader."""
    from backends.weights.checkpoint import load_vision_model

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        ours, _ = load_vision_model(tmp, device=device, dtype=dtype)
    return ours


def hf_config_from(enc, attn: str = "sdpa"):
    """`hf_config` for one of our EncoderConfigs (a checkpoint's), refusing what `hf_config` cannot say."""
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


def permute_rope_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Our (= the original checkpoint's) q/k rows -> transformers' rotate-half order: per head, the
    complex pair (2j, 2j+1) goes to rows (j, Dh/2 + j). Inverse of the loader's `unpermute_rope_rows`."""
    half = t.shape[0] // num_heads // 2
    return t.reshape(num_heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def load_checkpoint_into_hf(model, checkpoint_dir) -> None:
    """Copy a checkpoint's vision tower + projector (any layout our loader reads) into transformers'
    `Kimi_K25Model` in place, so that transformers runs exactly the weights our server serves.

    Our loader's name mapping is run backwards: each of transformers' parameters is named the way our
    loader would name it, and q/k/v are cut from our fused `wqkv` (q and k re-permuted for
    rotate-half RoPE). Every checkpoint tensor must be used (wqkv three times), with the parameter's shape.
    """
    from backends.weights.checkpoint import VISION_PREFIXES, canonical_name, detect_block_naming, read_vision_tensors, to_canonical

    heads = model.config.vision_config.num_attention_heads
    stored, _ = read_vision_tensors(checkpoint_dir)
    ours, _ = to_canonical(stored, heads)
    params = {k: p for k, p in model.named_parameters() if k.startswith(VISION_PREFIXES)}
    naming = detect_block_naming(params)
    split = re.compile(r"^(.+)\.attn\.([qkv])_proj\.(weight|bias)$")
    used = set()
    with torch.no_grad():
        for key, param in params.items():
            name = canonical_name(key, naming)
            m = split.match(name)
            if m:
                name = f"{m.group(1)}.wqkv.{m.group(3)}"
                if name not in ours:
                    raise KeyError(f"transformers' {key} needs {name}, which {checkpoint_dir} does not hold")
                q, k, v = ours[name].chunk(3)
                value = {"q": permute_rope_rows(q, heads), "k": permute_rope_rows(k, heads), "v": v}[m.group(2)]
            elif name in ours:
                value = ours[name]
            else:
                raise KeyError(f"transformers' {key} (our name {name}) is not in {checkpoint_dir}")
            if value.shape != param.shape:
                raise ValueError(f"{key}: checkpoint tensor {name} has shape {list(value.shape)}, "
                                 f"transformers expects {list(param.shape)}")
            param.copy_(value)
            used.add(name)
    if set(ours) - used:
        raise ValueError(f"checkpoint tensors with no transformers parameter: {sorted(set(ours) - used)[:5]}")


def hf_image_features(model, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
    """(sum tokens, text_hidden): transformers' per-media outputs concatenated in media order."""
    with torch.inference_mode():
        out = model.get_image_features(pixel_values, image_grid_thw=grid_thws)
    return torch.cat(list(out.pooler_output))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, in float64."""
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max())
