"""Our encoder + loader against transformers' native Kimi-K2.5 implementation (the numeric oracle).

A tiny random `Kimi_K25Model` is saved with `save_pretrained`, loaded by our loader, and both run one
packed forward over images of several grids (equal to and different from the 8x8 pos-emb grid, so the
bicubic resize is exercised) and video chunks of 2, 3 and 4 frames.

Weights are re-drawn at "trained-like" scale (unit-variance activations, q/k gain 2) rather than
transformers' std 0.02 init: with tiny weights attention is almost uniform and a wrong RoPE or
position embedding would hide under the tolerance. `test_oracle_is_sensitive` checks that it does not.
"""

from __future__ import annotations

import json

import pytest
import torch

# The oracle is pinned (requirements.txt): a missing one is a broken install, not a reason to skip.
import transformers  # noqa: E402,F401
import transformers.models.kimi_k25 as kimi  # noqa: E402

from safetensors.torch import save_file  # noqa: E402

from backends.checkpoint.weights import load_vision_model, unpermute_rope_rows  # noqa: E402
from backends.config import EncoderConfig  # noqa: E402
from oracles.random_checkpoint import write_checkpoint  # noqa: E402
from oracles import transformers_kimi as hf_oracle  # noqa: E402
from oracles.transformers_kimi import hf_config, hf_config_from, load_checkpoint_into_hf, reinit_, rel_err  # noqa: E402

TOL = 1e-5
HEADS = 4
# (t, h, w): (1,8,8) equals the pos-emb grid; the others resize it; t>1 are video chunks.
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 10, 4), (2, 6, 8), (3, 4, 4), (4, 8, 10)]


def tiny_config():
    return hf_config(hidden=64, layers=2, heads=HEADS, intermediate=128, pos_emb=8, text_hidden=96)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = kimi.Kimi_K25Model(tiny_config()).eval()
    reinit_(model.vision_tower, 1)
    reinit_(model.mm_projector, 2)
    return model


@pytest.fixture(scope="module")
def inputs():
    gen = torch.Generator().manual_seed(3)
    n = sum(t * h * w for t, h, w in GRIDS)
    return torch.randn(n, 3, 14, 14, generator=gen), torch.tensor(GRIDS)


@pytest.fixture(scope="module")
def reference(hf_model, inputs):
    pixels, grids = inputs
    with torch.no_grad():
        per_media = hf_model.get_image_features(pixels, grids).pooler_output
    assert [x.shape[0] for x in per_media] == [h * w // 4 for _, h, w in GRIDS]
    return torch.cat(per_media)


def test_save_pretrained_base_model(hf_model, inputs, reference, tmp_path):
    """Layout written by `Kimi_K25Model.save_pretrained` (vision_tower.blocks.N.{norm1,norm2,wqkv,...})."""
    hf_model.save_pretrained(tmp_path)
    model, cfg = load_vision_model(tmp_path)
    assert cfg.encoder.num_layers == 2 and cfg.encoder.text_hidden_size == 96
    assert model.dtype == torch.float32
    out = model(*inputs[:1], inputs[1].tolist())
    assert out.shape == reference.shape
    assert rel_err(out, reference) <= TOL


def test_save_pretrained_conditional_generation(hf_model, inputs, reference, tmp_path):
    """`Kimi_K25ForConditionalGeneration.save_pretrained` writes a mix (original block names, but
    `vision_tower.encoder.patch_embed.proj` and `model.mm_projector.pre_norm`)."""
    cg = kimi.Kimi_K25ForConditionalGeneration(tiny_config())
    cg.model.load_state_dict(hf_model.state_dict())
    cg.save_pretrained(tmp_path)
    model, _ = load_vision_model(tmp_path)
    assert rel_err(model(inputs[0], inputs[1].tolist()), reference) <= TOL


def test_in_memory_state_dict_layout(hf_model, inputs, reference, tmp_path):
    """transformers' in-memory names (split, rope-permuted q/k), with a `model.` prefix as in
    Kimi_K25ForConditionalGeneration."""
    state = {f"model.{k}": v.contiguous() for k, v in hf_model.state_dict().items()
             if k.startswith(("vision_tower.", "mm_projector."))}
    assert any(".attn.q_proj." in k for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    hf_model.config.save_pretrained(tmp_path)
    model, _ = load_vision_model(tmp_path)
    assert rel_err(model(inputs[0], inputs[1].tolist()), reference) <= TOL


def test_oracle_is_sensitive(hf_model, inputs, reference, tmp_path, monkeypatch):
    """Negative control: dropping RoPE or the time embedding must break the tolerance by far."""
    from backends.encoder import moonvit3d

    hf_model.save_pretrained(tmp_path)
    model, _ = load_vision_model(tmp_path)
    pixels, grids = inputs
    with monkeypatch.context() as m:
        m.setattr(moonvit3d.Kernels, "rope", lambda self, q, k: (q, k))
        no_rope = model(pixels, grids.tolist())
    assert rel_err(no_rope, reference) > 1e3 * TOL
    model.vision_tower.patch_embed.pos_emb.time_weight.zero_()
    assert rel_err(model(pixels, grids.tolist()), reference) > 1e3 * TOL


def test_unpermute_inverts_transformers_permute_for_rope():
    from transformers.core_model_loading import PermuteForRope

    cfg = tiny_config()
    w = torch.randn(64, 64)
    b = torch.randn(64)
    op = PermuteForRope(subconfig_key="vision_config")
    assert torch.equal(unpermute_rope_rows(op._permute_for_rope(w, cfg), HEADS), w)
    assert torch.equal(unpermute_rope_rows(op._permute_for_rope(b, cfg), HEADS), b)
    assert not torch.equal(op._permute_for_rope(w, cfg), w)


def test_saved_config_is_read(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    _, cfg = load_vision_model(tmp_path)
    enc = cfg.encoder
    assert (enc.hidden_size, enc.num_heads, enc.intermediate_size) == (64, HEADS, 128)
    assert (enc.init_pos_emb_height, enc.init_pos_emb_width, enc.init_pos_emb_time) == (8, 8, 4)
    assert cfg.tokens.media_pad == saved["image_token_id"]


def test_permute_rope_rows_inverts_the_loaders_unpermute():
    w, b = torch.randn(64, 32), torch.randn(64)
    assert torch.equal(unpermute_rope_rows(hf_oracle.permute_rope_rows(w, HEADS), HEADS), w)
    assert torch.equal(hf_oracle.permute_rope_rows(unpermute_rope_rows(b, HEADS), HEADS), b)


def test_save_pretrained_weights_go_back_into_transformers_unchanged(hf_model, tmp_path):
    """save_pretrained -> our loader's mapping run backwards -> a fresh transformers model: equal weights."""
    hf_model.save_pretrained(tmp_path)
    torch.manual_seed(5)
    fresh = kimi.Kimi_K25Model(tiny_config()).eval()
    load_checkpoint_into_hf(fresh, tmp_path)
    want = dict(hf_model.named_parameters())
    for name, p in fresh.named_parameters():
        if name.startswith(("vision_tower.", "mm_projector.")):
            assert torch.equal(p, want[name]), name


def test_checkpoint_we_serve_runs_the_same_in_transformers(tmp_path, monkeypatch):
    """The e2e benchmark's reference: the original-layout checkpoint tritonserver serves, loaded into
    transformers' model, gives our encoder's output (fp32); without the RoPE re-permutation it does not."""
    enc = EncoderConfig(hidden_size=64, num_layers=2, num_heads=HEADS, intermediate_size=128, init_pos_emb_height=8,
                        init_pos_emb_width=8, text_hidden_size=96)
    write_checkpoint(tmp_path, enc, std=0.2)
    ours, cfg = load_vision_model(tmp_path)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), 3, 14, 14, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    model = kimi.Kimi_K25Model(hf_config_from(cfg.encoder)).eval()
    load_checkpoint_into_hf(model, tmp_path)
    expected = ours(pixels, GRIDS)
    assert rel_err(hf_oracle.hf_image_features(model, pixels, torch.tensor(GRIDS)), expected) <= TOL
    monkeypatch.setattr(hf_oracle, "permute_rope_rows", lambda t, heads: t)
    load_checkpoint_into_hf(model, tmp_path)
    assert rel_err(hf_oracle.hf_image_features(model, pixels, torch.tensor(GRIDS)), expected) > 1e3 * TOL
