"""The checkpoint loader on the ORIGINAL layout: sharded index, shard selection, dtype, error messages,
and the `<|media_pad|>` tokenizer check. No transformers needed (its layouts: test_encoder_oracle.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

import backends.checkpoint.weights as loader
from backends.config import EncoderConfig
from backends.checkpoint.seeded import init_random_
from backends.encoder.moonvit3d import KimiVisionModel

# Non-square pos-emb (6 high, 8 wide) so a height/width swap in config parsing fails the shape check.
ENC = EncoderConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, init_pos_emb_height=6,
                    init_pos_emb_width=8, init_pos_emb_time=4, text_hidden_size=96)
GRIDS = [(1, 4, 6), (1, 6, 8), (2, 6, 4), (4, 4, 4)]
LM_SHARD = "model-00001-of-00003.safetensors"
PROJ_SHARD = "model-00002-of-00003.safetensors"
TOWER_SHARD = "model-00003-of-00003.safetensors"


def original_config(media_pad: int = 163605) -> dict:
    """config.json as the released checkpoint spells it (vt_* names, media_placeholder_token_id)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "media_placeholder_token_id": media_pad,
        "text_config": {"hidden_size": ENC.text_hidden_size, "model_type": "kimi_k2"},
        "vision_config": {
            "patch_size": ENC.patch_size, "init_pos_emb_height": ENC.init_pos_emb_height,
            "init_pos_emb_width": ENC.init_pos_emb_width, "init_pos_emb_time": ENC.init_pos_emb_time,
            "vt_hidden_size": ENC.hidden_size, "vt_num_hidden_layers": ENC.num_layers,
            "vt_num_attention_heads": ENC.num_heads, "vt_intermediate_size": ENC.intermediate_size,
            "merge_kernel_size": list(ENC.merge_kernel_size), "text_hidden_size": ENC.text_hidden_size,
            "mm_hidden_size": ENC.hidden_size,
        },
        "torch_dtype": "bfloat16",
    }


@pytest.fixture(scope="module")
def ours() -> KimiVisionModel:
    return init_random_(KimiVisionModel(ENC), seed=7, std=0.2).eval()


def write_sharded(root, state: dict[str, torch.Tensor], config: dict | None = None) -> None:
    """Original layout, 3 shards: a fake language-model shard, the projector, the tower, plus index."""
    root.mkdir(parents=True, exist_ok=True)
    shards = {
        LM_SHARD: {"language_model.model.embed_tokens.weight": torch.randn(32, 96)},
        PROJ_SHARD: {k: v for k, v in state.items() if k.startswith("mm_projector.")},
        TOWER_SHARD: {k: v for k, v in state.items() if not k.startswith("mm_projector.")},
    }
    weight_map = {}
    for fname, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / fname))
        weight_map.update({k: fname for k in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(config or original_config()))


def inputs():
    gen = torch.Generator().manual_seed(5)
    n = sum(t * h * w for t, h, w in GRIDS)
    return torch.randn(n, 3, 14, 14, generator=gen)


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """File names that the loader passes to safe_open."""
    calls: list[str] = []
    real = loader.safe_open

    def recording(path, *args, **kwargs):
        calls.append(str(path).rsplit("/", 1)[-1])
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", recording)
    return calls


def test_original_layout_sharded_bit_exact(ours, tmp_path, opened):
    write_sharded(tmp_path, ours.state_dict())
    assert loader.vision_shards(tmp_path).keys() == {PROJ_SHARD, TOWER_SHARD}
    assert opened == []  # the index alone decides
    model, cfg = loader.load_vision_model(tmp_path)
    assert LM_SHARD not in opened and set(opened) == {PROJ_SHARD, TOWER_SHARD}
    assert cfg.encoder == ENC
    assert model.dtype == torch.float32
    pixels = inputs()
    assert torch.equal(model(pixels, GRIDS), ours(pixels, GRIDS))


def test_model_prefix_and_single_file(ours, tmp_path, opened):
    """`model.`-prefixed original names in one unindexed file load the same."""
    save_file({f"model.{k}": v for k, v in ours.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(original_config()))
    model, _ = loader.load_vision_model(tmp_path)
    pixels = inputs()
    assert torch.equal(model(pixels, GRIDS), ours(pixels, GRIDS))


def test_bf16_checkpoint_upcasts_on_cpu(ours, tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()}
    write_sharded(tmp_path, state)
    model, _ = loader.load_vision_model(tmp_path)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    w = model.vision_tower.encoder.blocks[1].wqkv.weight
    assert torch.equal(w, state["vision_tower.encoder.blocks.1.wqkv.weight"].float())
    kept, _ = loader.load_vision_model(tmp_path, dtype=torch.bfloat16)
    assert kept.dtype == torch.bfloat16
    # The sincos time table stays fp32 whatever the weights' dtype.
    assert kept.vision_tower.patch_embed.pos_emb.time_weight.dtype == torch.float32


def test_pick_dtype():
    bf16, f32 = torch.bfloat16, torch.float32
    assert loader.pick_dtype(torch.device("cpu"), [bf16, bf16], None) == f32
    assert loader.pick_dtype(torch.device("cuda"), [bf16, bf16, f32], None) == bf16
    assert loader.pick_dtype(torch.device("cuda"), [bf16], torch.float16) == torch.float16


def _load_with(ours, tmp_path, edit):
    state = dict(ours.state_dict())
    edit(state)
    write_sharded(tmp_path, state)
    with pytest.raises(ValueError) as err:
        loader.load_vision_model(tmp_path)
    return str(err.value)


def test_missing_tensor(ours, tmp_path):
    msg = _load_with(ours, tmp_path, lambda s: s.pop("vision_tower.encoder.blocks.1.wo.bias"))
    assert "missing tensor vision_tower.encoder.blocks.1.wo.bias" in msg
    assert "expected shape [64]" in msg


def test_unexpected_tensor(ours, tmp_path):
    def add(state):
        state["vision_tower.encoder.blocks.2.norm0.weight"] = torch.ones(64)

    msg = _load_with(ours, tmp_path, add)
    assert "unexpected tensor vision_tower.encoder.blocks.2.norm0.weight" in msg
    assert "found shape [64]" in msg


def test_wrong_shape(ours, tmp_path):
    def swap(state):
        state["vision_tower.patch_embed.pos_emb.weight"] = torch.zeros(8, 6, 64)

    msg = _load_with(ours, tmp_path, swap)
    assert "vision_tower.patch_embed.pos_emb.weight" in msg
    assert "expected [6, 8, 64]" in msg and "found [8, 6, 64]" in msg


def test_wrong_shape_names_stored_key(tmp_path):
    """For a renamed layout the message gives both our name and the stored name."""
    state = {"vision_tower.blocks.0.mlp.fc2.weight": torch.zeros(64, 100)}
    found, source = loader.to_canonical(state, num_heads=4)
    with pytest.raises(ValueError) as err:
        loader.check_tensors(found, {"vision_tower.encoder.blocks.0.mlp.fc1.weight": (64, 128)}, source)
    msg = str(err.value)
    assert "vision_tower.encoder.blocks.0.mlp.fc1.weight (stored as vision_tower.blocks.0.mlp.fc2.weight)" in msg
    assert "expected [64, 128], found [64, 100]" in msg


def test_block_naming_detection():
    original = ["vision_tower.encoder.blocks.0.norm0.weight", "vision_tower.encoder.blocks.0.norm1.weight"]
    hf_saved = ["vision_tower.blocks.0.norm1.weight", "vision_tower.blocks.0.norm2.weight"]
    hf_memory = ["model.vision_tower.layers.0.norm1.weight", "model.vision_tower.layers.0.attn.q_proj.weight"]
    assert loader.detect_block_naming(original) == "original"
    assert loader.detect_block_naming(hf_saved) == "transformers"
    assert loader.detect_block_naming(hf_memory) == "transformers"
    with pytest.raises(ValueError, match="mixes"):
        loader.detect_block_naming(original + hf_saved)
    # norm1 means the second norm in the original layout and the first in transformers'.
    assert loader.canonical_name(original[1], "original") == "vision_tower.encoder.blocks.0.norm1.weight"
    assert loader.canonical_name(hf_saved[0], "transformers") == "vision_tower.encoder.blocks.0.norm0.weight"
    assert loader.canonical_name("mm_projector.out_proj.bias", "transformers") == "mm_projector.proj.2.bias"


def test_tokenizer_media_pad_mismatch_warns(ours, tmp_path):
    write_sharded(tmp_path, ours.state_dict())
    decoder = {"163602": {"content": "<|media_pad|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    with pytest.warns(UserWarning, match=r"<\|media_pad\|> to id 163602.*config.json says 163605"):
        _, cfg = loader.load_vision_model(tmp_path)
    assert cfg.tokens.media_pad == 163605  # the config's id is kept


def test_tokenizer_json_mismatch_warns(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 163602, "content": "<|media_pad|>"}]}))
    with pytest.warns(UserWarning, match="tokenizer.json"):
        msgs = loader.check_placeholder_id(tmp_path, 163605)
    assert len(msgs) == 1 and "163602" in msgs[0] and "163605" in msgs[0]


def test_tokenizer_agreeing_is_silent(tmp_path):
    decoder = {"163605": {"content": "<|media_pad|>"}, "163602": {"content": "<|media_begin|>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.check_placeholder_id(tmp_path, 163605) == []
    assert loader.tokenizer_media_pad_ids(tmp_path) == {"tokenizer_config.json": 163605}


def test_model_settings_without_rendered_config_read_the_checkpoint(tmp_path):
    """A model repository written by hand (no vision_config parameter) serves the checkpoint's own
    config, never the demo's: here a different placeholder id and hidden size."""
    from backends.config import DEMO_CONFIG
    from backends.serving.settings import ModelSettings

    (tmp_path / "config.json").write_text(json.dumps(original_config(media_pad=170000)))
    got = ModelSettings.from_parameters({"checkpoint": str(tmp_path)}).vision
    assert got.tokens.media_pad == 170000 and got.encoder.hidden_size == ENC.hidden_size
    assert got != DEMO_CONFIG
    assert ModelSettings.from_parameters({}).vision == DEMO_CONFIG
    rendered = ModelSettings.from_parameters({"checkpoint": str(tmp_path), "vision_config": DEMO_CONFIG.to_json()})
    assert rendered.vision == DEMO_CONFIG  # the renderer's resolved config wins
