"""The service's contract, shared by the server and its clients: token ids, model names, tensor names.

Standard library only, so that a client imports it without torch, Pillow or the server's packages.
The model configs are rendered with these names (backends/deploy/repository.py); a client can import
them without the server's packages (docs/kimi_k25.md#token-ids for the ids).
"""

from __future__ import annotations

# Special tokens of the released Kimi-K2.5 tokenizer. `<|media_pad|>` is the one placeholder per image
# (or video chunk); a checkpoint's config.json may name another id, which the server then uses.
MEDIA_PAD = 163605
MEDIA_BEGIN = 163602
MEDIA_CONTENT = 163603
MEDIA_END = 163604

# Model names in the repository.
ENSEMBLE = "kimi_k25_vision"
# The same pipeline with a batch dimension of 1 in front of every tensor: the server batches such
# requests across clients so that their images share one encoder forward.
BATCHED_ENSEMBLE = "kimi_k25_vision_batched"
PLACEHOLDER = "kimi_placeholder"
PREPROCESS = "kimi_preprocess"
ENCODER = "moonvit3d"
# Batching twins of the first two steps for the batched ensemble (every model of a batching ensemble
# must batch); they run the same code as their base models.
PLACEHOLDER_BATCHED = "kimi_placeholder_batched"
PREPROCESS_BATCHED = "kimi_preprocess_batched"

# Ensemble inputs and outputs (names, Triton datatypes, dims without a batch dimension).
INPUT_IDS, IMAGES, MEDIA_FRAMES = "INPUT_IDS", "IMAGES", "MEDIA_FRAMES"
EXPANDED_IDS, IMAGE_EMBEDS, GRID_THWS, IMAGE_TOKEN_COUNTS = "EXPANDED_IDS", "IMAGE_EMBEDS", "GRID_THWS", "IMAGE_TOKEN_COUNTS"
# Between the steps.
PIXEL_VALUES = "PIXEL_VALUES"
# Each media's cache key (UINT8 [M, 32]) and whether preprocessing left its pixels out because the encoder
# holds its rows (BOOL [M]); backends/cache.
MEDIA_KEYS, MEDIA_CACHED = "MEDIA_KEYS", "MEDIA_CACHED"
# The prompt once more, under this name: sent only by the ensembles, it tells kimi_preprocess that an
# encoder follows it, so that it may leave out the media the encoder holds. A direct caller, who wants
# every media's pixels, sends INPUT_IDS alone.
ENCODER_FOLLOWS = "INPUT_IDS_ENCODER_FOLLOWS"
# A step output that is also an ensemble output is emitted twice, once under this suffix for the next
# step: tritonserver 2.51 prunes steps wrongly when a client asks for a subset of the outputs and an
# ensemble output also feeds a later step (docs/triton_runtime.md#known-server-limitations).
FORWARD_SUFFIX = "_FORWARD"

OUTPUTS = (EXPANDED_IDS, IMAGE_EMBEDS, GRID_THWS, IMAGE_TOKEN_COUNTS)
# The embeddings by NIXL instead of in the response (contract/nixl_descriptor.py, docs/llm_handoff.md): a
# request with this parameter set to true gets, in IMAGE_EMBEDS_NIXL (UINT8 [-1]), a small descriptor of
# where the encoder holds its rows for the consumer to READ, and no IMAGE_EMBEDS. A parameter, not the
# output alone, because an ensemble asks its step for every output it maps whatever the client asked for
# (seen on 2.51), so the encoder cannot tell from the outputs which one the client wants.
IMAGE_EMBEDS_NIXL = "IMAGE_EMBEDS_NIXL"
NIXL_PARAMETER = "kimi_embeds_nixl"
# A request parameter (an integer, milliseconds since the Unix epoch): when the client stops waiting. Every
# step sees it (tritonserver hands a request's parameters to an ensemble's steps), so a step already
# running stops between images once it has passed, which a gRPC deadline alone does not make it do
# inside an ensemble (docs/triton_runtime.md#known-server-limitations). KimiVisionClient sends it with
# its timeout_s.
DEADLINE_PARAMETER = "kimi_deadline_unix_ms"

# Bytes per element of the model configs' data types (what a shared-memory region is sized with).
DTYPE_BYTES = {"TYPE_INT64": 8, "TYPE_FP32": 4, "TYPE_BF16": 2, "TYPE_FP16": 2, "TYPE_UINT8": 1}


def chat_prompt_ids(num_media: int, text_ids=(1, 2, 3)) -> list[int]:
    """A minimal prompt: each media as <|media_begin|> <|media_content|> <|media_pad|> <|media_end|>,
    then some text ids. Real clients send their tokenizer's ids with one <|media_pad|> per media."""
    ids: list[int] = []
    for _ in range(num_media):
        ids += [MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END]
    return ids + list(text_ids)
