"""The serving topology, declared once: which models the repository holds, how each ensemble wires its
steps, which batching twin stands for which model, and which model the autoscaler watches.

The renderer (backends/deploy/repository.py) writes the configs from it, the validator checks a
repository holds exactly these models, and the tests hold the Grafana dashboard and the Kubernetes
autoscaling rule to it. Plain data: no Triton, protobuf or torch imports.

Each ensemble runs preprocessing first: it checks the prompt's 1:1 rule before reading any image, so a
bad request fails there alone. Then the encoder and the id expansion side by side: the expansion only
multiplies placeholders by counts already checked, so it cannot fail with the encoder (tritonserver
2.51 never answers a request whose parallel steps both fail; docs/triton_runtime.md#known-server-limitations).
No ensemble output feeds a later step: a step that needs one reads its _FORWARD copy (an internal
tensor in lower case), so that a client may ask for any subset of the outputs.

The embedding cache (backends/cache): the ensemble hands preprocessing the prompt a second time, under a
name that tells it an encoder follows (a direct caller gets every media's pixels); preprocessing sends the
encoder each media's key and which media it left undecoded because the encoder holds their rows; the encoder also gets the request's IMAGES, from
which it preprocesses such a media itself should its rows be gone by then (evicted meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import (BATCHED_ENSEMBLE, ENCODER, ENCODER_FOLLOWS, ENSEMBLE, EXPANDED_IDS, FORWARD_SUFFIX, GRID_THWS,
                      IMAGE_EMBEDS, IMAGE_EMBEDS_NIXL,
                      IMAGE_TOKEN_COUNTS, IMAGES, INPUT_IDS, MEDIA_CACHED, MEDIA_FRAMES, MEDIA_KEYS, PIXEL_VALUES,
                      PLACEHOLDER, PLACEHOLDER_BATCHED, PREPROCESS, PREPROCESS_BATCHED)

# The Python models and what each does (the adapter class its model.py names, backends/serving/triton_models.py).
ADAPTERS = {PLACEHOLDER: "PlaceholderModel", PREPROCESS: "PreprocessModel", ENCODER: "EncoderModel"}
# Batching twins: every model of a batching ensemble must batch, so the batched ensemble has its own
# placeholder and preprocessing models, rendered from the same source and running the same code. The
# encoder batches for both ensembles (Triton gives a non-batching ensemble's requests a batch dimension of 1).
TWINS = {PLACEHOLDER_BATCHED: PLACEHOLDER, PREPROCESS_BATCHED: PREPROCESS}
# The model whose queue the Kubernetes autoscaler reads (deploy/k8s/prometheus-adapter): the encoder is
# the request's cost, so requests wait there when a pod is short of GPU.
AUTOSCALE_MODEL = ENCODER


@dataclass(frozen=True)
class Ensemble:
    name: str
    batched: bool  # clients send [1, ...] tensors and the server batches requests across clients
    preprocess: str
    placeholder: str
    encoder: str = ENCODER

    @property
    def models(self) -> tuple[str, ...]:
        return self.preprocess, self.encoder, self.placeholder

    def steps(self) -> list[dict]:
        """The ensemble's steps in Triton's terms (model, input map, output map), in the order they start."""
        grids, counts = GRID_THWS, IMAGE_TOKEN_COUNTS
        return [
            {"model_name": self.preprocess, "model_version": -1,
             "input_map": {IMAGES: IMAGES, MEDIA_FRAMES: MEDIA_FRAMES, INPUT_IDS: INPUT_IDS, ENCODER_FOLLOWS: INPUT_IDS},
             "output_map": {PIXEL_VALUES: "pixel_values", grids: grids, grids + FORWARD_SUFFIX: "grid_thws",
                            counts: counts, counts + FORWARD_SUFFIX: "image_token_counts",
                            MEDIA_KEYS: "media_keys", MEDIA_CACHED: "media_cached"}},
            {"model_name": self.encoder, "model_version": -1,
             "input_map": {PIXEL_VALUES: "pixel_values", grids: "grid_thws", MEDIA_KEYS: "media_keys",
                           MEDIA_CACHED: "media_cached", IMAGES: IMAGES, MEDIA_FRAMES: MEDIA_FRAMES},
             "output_map": {IMAGE_EMBEDS: IMAGE_EMBEDS, IMAGE_EMBEDS_NIXL: IMAGE_EMBEDS_NIXL}},
            {"model_name": self.placeholder, "model_version": -1,
             "input_map": {INPUT_IDS: INPUT_IDS, counts: "image_token_counts"},
             "output_map": {EXPANDED_IDS: EXPANDED_IDS}},
        ]


ENSEMBLES = (Ensemble(ENSEMBLE, batched=False, preprocess=PREPROCESS, placeholder=PLACEHOLDER),
             Ensemble(BATCHED_ENSEMBLE, batched=True, preprocess=PREPROCESS_BATCHED, placeholder=PLACEHOLDER_BATCHED))
PYTHON_MODELS = (*ADAPTERS, *TWINS)
MODELS = (*PYTHON_MODELS, *(e.name for e in ENSEMBLES))


def base_model(name: str) -> str:
    """The model whose code `name` runs: itself, or the model it is the batching twin of."""
    return TWINS.get(name, name)


def batching(name: str) -> bool:
    """Whether a Python model takes a batch dimension: the encoder and the twins."""
    return name == ENCODER or name in TWINS
