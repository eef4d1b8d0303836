"""Load the vision tower + projector of a Kimi-K2.5 checkpoint into `KimiVisionModel`.

Only the safetensors shards that hold `vision_tower.*` / `mm_projector.*` tensors are opened (the
index's weight_map decides), and only those tensors are read: the ~600 GB language model is never
touched. Three weight layouts are accepted and mapped to our (= the original checkpoint's) names:

- original (`vision_tower.encoder.blocks.N.{norm0,wqkv,wo,norm1,mlp.fc0,mlp.fc1}`, `mm_projector.proj.{0,2}`):
  identity;
- what transformers' `save_pretrained` writes. For `Kimi_K25Model` (transformers 5.24):
  `vision_tower.blocks.N.{norm1,norm2,wqkv,attn.proj,mlp.fc1,mlp.fc2}`, `vision_tower.final_layernorm`,
  `vision_tower.patch_embed.pos_emb.position_embeddings`, `mm_projector.{pre_norm,in_proj,out_proj}`.
  For `Kimi_K25ForConditionalGeneration` a mix: original block names but
  `vision_tower.encoder.patch_embed.proj.*` and `model.mm_projector.pre_norm.*`;
- transformers' in-memory state_dict (`vision_tower.layers.N.attn.{q,k,v}_proj`, q/k rows permuted for
  rotate-half RoPE): q/k/v are un-permuted and fused back into `wqkv`.

Name collision to keep in mind: in the original layout `norm1` / `mlp.fc1` are the block's SECOND norm
and linear; in transformers' layout they are the FIRST. The block naming is therefore detected once
for the whole checkpoint (`detect_block_naming`) before any block key is renamed.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from backends.checkpoint.config import load_config
from backends.config import EncoderConfig, VisionConfig
from backends.encoder.moonvit3d import KimiVisionModel, PosEmbDivided, sincos_time_table

logger = logging.getLogger(__name__)

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
INDEX_NAME = "model.safetensors.index.json"

# Derived buffers some exporters persist; they are recomputed, never loaded.
_IGNORED_SUFFIXES = ("pos_emb.time_weight", "pos_emb.time_position_embeddings",
                     "rotary_emb.inv_freq", "rotary_emb.original_inv_freq")

_ORIGINAL_BLOCK_MARKERS = (".norm0.", ".mlp.fc0.", ".wo.")
_TRANSFORMERS_BLOCK_MARKERS = (".norm2.", ".mlp.fc2.", ".attn.")


# --------------------------------------------------------------------------------------------------
# Which keys and which files
# --------------------------------------------------------------------------------------------------

def strip_model_prefix(key: str) -> str:
    """`model.vision_tower.x` -> `vision_tower.x`; other keys unchanged."""
    while key.startswith("model."):
        key = key[len("model."):]
    return key


def is_vision_key(key: str) -> bool:
    """True for tower / projector tensors, with or without a leading `model.`."""
    return strip_model_prefix(key).startswith(VISION_PREFIXES)


def _index_path(root: Path) -> Path | None:
    path = root / INDEX_NAME
    if path.is_file():
        return path
    others = sorted(root.glob("*.safetensors.index.json"))
    if len(others) > 1:
        raise ValueError(f"checkpoint {root} has several safetensors indexes {[p.name for p in others]}; "
                         f"expected one {INDEX_NAME}")
    return others[0] if others else None


def vision_shards(checkpoint_dir: str | Path) -> dict[str, list[str]]:
    """Shard file name -> the vision keys (as stored) it holds, in sorted order.

    With an index, decided from its weight_map alone (no shard is opened). Without one, every
    `*.safetensors` file's header is read (safetensors headers only list names, no tensor data).
    """
    root = Path(checkpoint_dir)
    index = _index_path(root)
    shards: dict[str, list[str]] = {}
    if index is not None:
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        for key, fname in weight_map.items():
            if is_vision_key(key):
                shards.setdefault(fname, []).append(key)
        for fname in shards:
            if not (root / fname).is_file():
                raise FileNotFoundError(f"{index.name} maps vision tensors to {fname}, which is not in {root}")
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"checkpoint {root} has no *.safetensors file")
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                keys = [k for k in f.keys() if is_vision_key(k)]
            if keys:
                shards[path.name] = keys
    if not shards:
        raise ValueError(f"checkpoint {root} holds no vision_tower.* / mm_projector.* tensors")
    return {fname: sorted(keys) for fname, keys in sorted(shards.items())}


def read_vision_tensors(checkpoint_dir: str | Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Read the vision tensors as stored (CPU, stored dtype, stored names).

    Returns (tensors, opened_files). Only the shards from `vision_shards` are opened, memory-mapped
    by safe_open, and only the listed keys are materialised.
    """
    root = Path(checkpoint_dir)
    tensors: dict[str, torch.Tensor] = {}
    opened: list[str] = []
    for fname, keys in vision_shards(root).items():
        opened.append(fname)
        with safe_open(str(root / fname), framework="pt", device="cpu") as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise ValueError(f"index maps tensor {key} to {fname}, but that shard does not contain it")
                if key in tensors:
                    raise ValueError(f"tensor {key} is stored twice (second copy in {fname})")
                tensors[key] = f.get_tensor(key)
    return tensors, opened


# --------------------------------------------------------------------------------------------------
# Layout detection and renaming (pure functions on names / tensors)
# --------------------------------------------------------------------------------------------------

_BLOCK_RE = re.compile(r"^vision_tower\.(?:encoder\.)?(?:blocks|layers)\.(\d+)\.(.+)$")


def _container_name(key: str) -> str:
    """Normalise everything outside a block's inner names: prefixes, `encoder.`, `layers`/`blocks`,
    pos-emb and projector names. Block-internal names are left for `_block_inner_name`."""
    key = strip_model_prefix(key)
    m = _BLOCK_RE.match(key)
    if m:
        return f"vision_tower.encoder.blocks.{m.group(1)}.{m.group(2)}"
    rules = (
        (r"^vision_tower\.(?:encoder\.)?final_layernorm\.", "vision_tower.encoder.final_layernorm."),
        (r"^vision_tower\.(?:encoder\.)?patch_embed\.proj\.", "vision_tower.patch_embed.proj."),
        (r"^vision_tower\.(?:encoder\.)?patch_embed\.pos_emb\.(?:weight|position_embeddings)$",
         "vision_tower.patch_embed.pos_emb.weight"),
        (r"^mm_projector\.(?:in_proj|proj\.0)\.", "mm_projector.proj.0."),
        (r"^mm_projector\.(?:out_proj|proj\.2)\.", "mm_projector.proj.2."),
    )
    for pattern, repl in rules:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    return key


def detect_block_naming(keys) -> str:
    """'original' (norm0/norm1, mlp.fc0/fc1, wo) or 'transformers' (norm1/norm2, mlp.fc1/fc2, attn.*).

    Decided from markers that exist in only one layout, because `norm1` and `mlp.fc1` exist in both
    with different meanings. A checkpoint with markers of both raises ValueError.
    """
    block_keys = [k for k in (_container_name(k) for k in keys) if k.startswith("vision_tower.encoder.blocks.")]
    original = sorted(k for k in block_keys if any(m in k for m in _ORIGINAL_BLOCK_MARKERS))
    hf = sorted(k for k in block_keys if any(m in k for m in _TRANSFORMERS_BLOCK_MARKERS))
    if original and hf:
        raise ValueError(f"checkpoint mixes original block names (e.g. {original[0]}) with transformers "
                         f"block names (e.g. {hf[0]}); cannot tell which norm1/mlp.fc1 is meant")
    return "transformers" if hf else "original"


# transformers block name -> original block name (only applied when the naming is 'transformers').
_HF_BLOCK_RENAMES = {
    "norm1.": "norm0.",
    "norm2.": "norm1.",
    "mlp.fc1.": "mlp.fc0.",
    "mlp.fc2.": "mlp.fc1.",
    "attn.proj.": "wo.",
}


def canonical_name(key: str, block_naming: str) -> str:
    """Stored key -> our parameter name. `attn.{q,k,v}_proj` keys come back unchanged in their
    block (`...blocks.N.attn.q_proj.weight`): they are fused by `fuse_split_qkv`."""
    key = _container_name(key)
    m = _BLOCK_RE.match(key)
    if not m or block_naming != "transformers":
        return key
    layer, inner = m.groups()
    for old, new in _HF_BLOCK_RENAMES.items():
        if inner.startswith(old):
            inner = new + inner[len(old):]
            break
    return f"vision_tower.encoder.blocks.{layer}.{inner}"


def unpermute_rope_rows(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo transformers' PermuteForRope on q/k rows.

    t: (H*Dh, in) weight or (H*Dh,) bias. Per head, transformers stores the original row 2j+c at
    c*Dh/2 + j (real parts first, then imaginary parts: rotate-half). The original keeps the complex
    pairs adjacent, so row c*Dh/2 + j goes back to 2j + c. Same dtype/shape out.
    """
    rows = t.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot un-permute q/k with {rows} rows for {num_heads} heads")
    half = rows // num_heads // 2
    return t.reshape(num_heads, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def fuse_split_qkv(tensors: dict[str, torch.Tensor], num_heads: int) -> dict[str, torch.Tensor]:
    """Replace `blocks.N.attn.{q,k,v}_proj.{weight,bias}` with `blocks.N.wqkv.{weight,bias}` =
    cat([unpermute(q), unpermute(k), v], dim 0), i.e. [q | k | v] rows, head-major within each.
    Other keys pass through. Raises ValueError if a block has only some of q/k/v."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str], dict[str, tuple[str, torch.Tensor]]] = {}
    split_re = re.compile(r"^(vision_tower\.encoder\.blocks\.\d+)\.attn\.([qkv])_proj\.(weight|bias)$")
    for name, t in tensors.items():
        m = split_re.match(name)
        if m:
            groups.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = (name, t)
        else:
            out[name] = t
    for (block, kind), parts in sorted(groups.items()):
        missing = [f"{block}.attn.{p}_proj.{kind}" for p in "qkv" if p not in parts]
        if missing:
            raise ValueError(f"missing tensor {missing[0]}: split q/k/v projections must all be present "
                             f"to build {block}.wqkv.{kind}")
        shapes = {p: tuple(parts[p][1].shape) for p in "qkv"}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"{block}.attn.q/k/v_proj.{kind} have different shapes {shapes}")
        q, k, v = (parts[p][1] for p in "qkv")
        out[f"{block}.wqkv.{kind}"] = torch.cat(
            [unpermute_rope_rows(q, num_heads), unpermute_rope_rows(k, num_heads), v], dim=0)
    return out


def to_canonical(tensors: dict[str, torch.Tensor], num_heads: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Stored {key: tensor} -> ({our name: tensor}, {our name: stored key}) for error messages.

    Derived buffers in `_IGNORED_SUFFIXES` are dropped. Two stored keys mapping to one name raise.
    """
    naming = detect_block_naming(tensors)
    renamed: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for key, t in tensors.items():
        if strip_model_prefix(key).endswith(_IGNORED_SUFFIXES):
            continue
        name = canonical_name(key, naming)
        if name in renamed:
            raise ValueError(f"tensors {source[name]} and {key} both map to {name}")
        renamed[name], source[name] = t, key
    fused = fuse_split_qkv(renamed, num_heads)
    for name in fused:
        if name not in source:  # a fused wqkv: name its q source for messages
            q_key = name.replace(".wqkv.", ".attn.q_proj.")
            source[name] = source.get(q_key, name).replace(".attn.q_proj.", ".attn.{q,k,v}_proj.")
    return fused, source


def expected_shapes(cfg: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter names -> shapes, from a meta-device model (allocates nothing)."""
    with torch.device("meta"):
        model = KimiVisionModel(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_tensors(found: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                  source: dict[str, str] | None = None, where: str = "checkpoint") -> None:
    """Raise one ValueError listing every missing, unexpected or mis-shaped tensor (with shapes).

    found: our name -> tensor; expected: our name -> shape; source: our name -> stored key."""
    source = source or {}

    def label(name):
        src = source.get(name, name)
        return name if src == name else f"{name} (stored as {src})"

    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name}: expected shape {list(shape)}, found none")
        elif tuple(found[name].shape) != shape:
            problems.append(f"tensor {label(name)} has wrong shape: expected {list(shape)}, "
                            f"found {list(found[name].shape)}")
    for name in sorted(set(found) - set(expected)):
        problems.append(f"unexpected tensor {label(name)}: found shape {list(found[name].shape)}, "
                        f"expected none (the model has no such parameter)")
    if problems:
        raise ValueError(f"{where} does not match its vision config:\n  " + "\n  ".join(problems))


# --------------------------------------------------------------------------------------------------
# Placeholder token id check
# --------------------------------------------------------------------------------------------------

MEDIA_PAD = "<|media_pad|>"


def tokenizer_media_pad_ids(checkpoint_dir: str | Path) -> dict[str, int]:
    """File name -> the id it gives `<|media_pad|>`, for each tokenizer file that names it.

    Looks at tokenizer_config.json `added_tokens_decoder` (what the tiktoken-based K2.5 tokenizer
    uses: its `tiktoken.model` holds no special tokens) and tokenizer.json `added_tokens` / `model.vocab`.
    """
    root = Path(checkpoint_dir)
    found: dict[str, int] = {}
    cfg_path = root / "tokenizer_config.json"
    if cfg_path.is_file():
        decoder = json.loads(cfg_path.read_text()).get("added_tokens_decoder") or {}
        for tid, entry in decoder.items():
            content = entry.get("content") if isinstance(entry, dict) else entry
            if content == MEDIA_PAD:
                found[cfg_path.name] = int(tid)
    tok_path = root / "tokenizer.json"
    if tok_path.is_file():
        tok = json.loads(tok_path.read_text())
        for entry in tok.get("added_tokens") or []:
            if entry.get("content") == MEDIA_PAD:
                found[tok_path.name] = int(entry["id"])
        vocab = (tok.get("model") or {}).get("vocab")
        if tok_path.name not in found and isinstance(vocab, dict) and MEDIA_PAD in vocab:
            found[tok_path.name] = int(vocab[MEDIA_PAD])
    return found


def check_placeholder_id(checkpoint_dir: str | Path, config_id: int) -> list[str]:
    """Warn (warnings + logging) for every tokenizer file whose `<|media_pad|>` id differs from the
    config's. Returns the messages. The config's id is kept: the known failure (vLLM #39344) is a
    slow->fast tokenizer conversion that compacts id gaps and maps `<|media_pad|>` to 163602."""
    messages = []
    for fname, tid in tokenizer_media_pad_ids(checkpoint_dir).items():
        if tid != config_id:
            msg = (f"PLACEHOLDER TOKEN ID MISMATCH: {fname} maps {MEDIA_PAD} to id {tid}, but config.json says "
                   f"{config_id}. Keeping the config's {config_id}; a tokenizer that emits {tid} will produce "
                   f"prompts with no image placeholders (known slow->fast conversion bug, vLLM #39344).")
            logger.warning(msg)
            warnings.warn(msg, stacklevel=3)
            messages.append(msg)
    return messages


# --------------------------------------------------------------------------------------------------
# Model construction
# --------------------------------------------------------------------------------------------------

def pick_dtype(device: torch.device, stored: list[torch.dtype], requested: torch.dtype | None) -> torch.dtype:
    """requested if given; else float32 on CPU (bf16 matmuls are slow and inexact there) and the
    most common stored dtype elsewhere (bf16 checkpoints stay bf16 on GPU)."""
    if requested is not None:
        return requested
    if device.type == "cpu" or not stored:
        return torch.float32
    return Counter(stored).most_common(1)[0][0]


def _materialise_buffers(model: KimiVisionModel, device: torch.device) -> None:
    """Recompute the non-persistent buffers of a meta-built model (fp32, as the reference keeps them)."""
    for module in model.modules():
        if isinstance(module, PosEmbDivided):
            n_frames, dim = module.time_weight.shape
            module.time_weight = sincos_time_table(dim, n_frames).to(device)
    left = [name for name, b in model.named_buffers() if b.is_meta]
    if left:  # a new buffer in the model needs a line above
        raise RuntimeError(f"loader does not know how to build buffers {left}")


def build_model(cfg: EncoderConfig, state: dict[str, torch.Tensor], device, dtype: torch.dtype) -> KimiVisionModel:
    """KimiVisionModel with `state` (our names, already checked) cast to dtype on device, eval mode,
    no grad. Built on the meta device, so no random init is paid for and nothing is allocated twice."""
    device = torch.device(device)
    with torch.device("meta"):
        model = KimiVisionModel(cfg)
    params = {name: t.to(device=device, dtype=dtype).contiguous() for name, t in state.items()}
    model.load_state_dict(params, strict=True, assign=True)
    _materialise_buffers(model, device)
    return model.eval().requires_grad_(False)


def load_vision_model(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                      dtype: torch.dtype | None = None,
                      config: VisionConfig | None = None) -> tuple[KimiVisionModel, VisionConfig]:
    """Read config + vision weights from a checkpoint directory and build the model.

    dtype None: float32 on CPU, the checkpoint's dtype on other devices. `config`: the checkpoint's
    config if the caller has it already (a served model reads it from its model config). Raises
    ValueError naming the tensor and both shapes on any missing / unexpected / mis-shaped tensor.
    """
    cfg = config or load_config(checkpoint_dir)
    check_placeholder_id(checkpoint_dir, cfg.tokens.media_pad)
    stored, _ = read_vision_tensors(checkpoint_dir)
    state, source = to_canonical(stored, cfg.encoder.num_heads)
    check_tensors(state, expected_shapes(cfg.encoder), source, where=f"checkpoint {checkpoint_dir}")
    device = torch.device(device)
    target = pick_dtype(device, [t.dtype for t in stored.values()], dtype)
    return build_model(cfg.encoder, state, device, target), cfg
