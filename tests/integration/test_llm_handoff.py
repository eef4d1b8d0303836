"""The hand-off to a co-located LLM, end to end (docs/llm_handoff.md).

A tiny random Kimi-K2.5 (transformers' `Kimi_K25ForConditionalGeneration`: our tiny MoonViT3d + projector
and a one-layer deepseek_v3 text model with the real vocabulary size, fp32, trained-like weights) is
saved with `save_pretrained`; our real tritonserver serves that directory. One request with two images
gives EXPANDED_IDS and IMAGE_EMBEDS, and the logits of

  (a) transformers' own multimodal forward: input_ids = EXPANDED_IDS, pixel_values / image_grid_thw =
      the checkpoint processor's pixels (our `kimi_preprocess`, checked equal to an independent
      restatement), transformers' vision tower and projector, `masked_scatter` at image_token_id;
  (b) the hand-off: the text model's embedding of EXPANDED_IDS with the rows where id == <|media_pad|>
      replaced by IMAGE_EMBEDS in order, then the language model and lm_head on those inputs_embeds;

must agree. (a) and (b) share the language model, so what is compared is our embeddings and where they
land; swapping the two images' blocks must move the logits by far more than the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import transformers.models.kimi_k25 as kimi  # noqa: E402 - pinned oracle: never skipped

import tritonclient.grpc as grpcclient  # noqa: E402
from transformers.modeling_outputs import BaseModelOutputWithPooling  # noqa: E402

import contract  # noqa: E402
import contract.nixl_descriptor  # noqa: E402
from backends.deploy.launcher import deployment_server  # noqa: E402
from backends.deploy.repository import Deployment  # noqa: E402
from clients.kimi_client import KimiVisionClient, chat_prompt_ids  # noqa: E402
from clients.samples import encode, photo_like, text_card  # noqa: E402
from oracles.checkpoint_processor import reference_pixels  # noqa: E402
from oracles.transformers_kimi import hf_config, hf_image_features, reinit_, rel_err  # noqa: E402

# Logits of the tiny model are O(1) (max |logit| ~6). (a) runs transformers' encoder, (b) ours: the
# embeddings agree to ~2e-6 relative (tests/unit/test_encoder_oracle.py bounds it at 1e-5), and one fp32
# decoder layer + lm_head carry that into the logits as ~2e-5 absolute (seen: 2.2e-5). atol = rtol = 1e-4
# leaves about 5x headroom for BLAS differences across machines and is still 1000x below what a misplaced
# block or a wrong row order does (test_handoff_is_sensitive_to_placement: ~8).
ATOL = RTOL = 1e-4
VOCAB = 163_840  # Kimi-K2.5's: <|media_pad|> (163605) and the media_begin/content/end ids are real rows
TEXT_HIDDEN = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model): a Kimi_K25ForConditionalGeneration saved with save_pretrained."""
    cfg = hf_config(hidden=64, layers=2, heads=4, intermediate=128, pos_emb=8, text_hidden=TEXT_HIDDEN)
    cfg.text_config.vocab_size = VOCAB
    torch.manual_seed(0)
    model = kimi.Kimi_K25ForConditionalGeneration(cfg).eval()
    reinit_(model.model.vision_tower, 1)
    reinit_(model.model.mm_projector, 2)
    reinit_(model.model.language_model, 3)  # lm_head is tied to embed_tokens (tie_word_embeddings)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    path = tmp_path_factory.mktemp("kimi_k25_tiny")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def served(checkpoint):
    """What the server answers for a two-image chat prompt, plus kimi_preprocess's pixels for the images."""
    path, model = checkpoint
    dep = Deployment(device="cpu", checkpoint=str(path))
    # The server's placeholder is the saved config's image_token_id, which transformers' forward uses.
    assert dep.vision.tokens.media_pad == model.config.image_token_id == contract.MEDIA_PAD
    assert dep.vision.encoder.text_hidden_size == TEXT_HIDDEN
    blobs = [encode(photo_like(260, 180, seed=7), "JPEG"), encode(text_card(), "PNG")]
    prompt = chat_prompt_ids(2, text_ids=(11, 12, 13, 14))
    prompt = np.concatenate([[5, 6], prompt[:4], [7, 8, 9], prompt[4:]])  # text before, between, after
    # UCX over TCP for the NIXL pull, as between two hosts without RDMA.
    with deployment_server(dep, "llm-handoff", env={"UCX_TLS": "tcp"}) as server:
        client = KimiVisionClient(server.grpc_url)
        result = client.infer(prompt, blobs)
        nixl_result, nixl_embeds = _pulled(client, prompt, blobs)
        client.close()
        raw = grpcclient.InferenceServerClient(server.grpc_url)
        images = grpcclient.InferInput(contract.IMAGES, [len(blobs)], "BYTES")
        images.set_data_from_numpy(np.array(blobs, dtype=np.object_))
        pre = raw.infer(contract.PREPROCESS, [images])
        raw.close()
    return dict(prompt=prompt, blobs=blobs, result=result, media=dep.vision.media, nixl_result=nixl_result,
                nixl_embeds=nixl_embeds,
                pixel_values=np.array(pre.as_numpy(contract.PIXEL_VALUES)),  # writable copies for torch
                grid_thws=np.array(pre.as_numpy(contract.GRID_THWS)))


def _pulled(client, prompt, blobs):
    """The same request with a NIXL descriptor, and the rows read with clients/nixl_pull.py by this process
    (not the server's): (None, None) where NIXL is not installed."""
    try:
        contract.nixl_descriptor.load_nixl_api()
    except ImportError:
        return None, None
    from clients.nixl_pull import NixlPuller

    with pytest.MonkeyPatch.context() as env:
        env.setenv("UCX_TLS", "tcp")
        result = client.infer(prompt, blobs, nixl=True)
        with NixlPuller() as puller:
            return result, puller.pull(result)


def plain_expansion(prompt, counts, pad):
    out, k = [], 0
    for tok in prompt.tolist():
        if tok == pad:
            out += [pad] * counts[k]
            k += 1
        else:
            out.append(tok)
    assert k == len(counts)
    return out


def handoff_inputs_embeds(embed_tokens, expanded_ids, image_embeds, media_pad):
    """What a co-located LLM does: embed EXPANDED_IDS, overwrite the <|media_pad|> rows with
    IMAGE_EMBEDS in order. (1, L, hidden)."""
    ids = torch.tensor(expanded_ids, dtype=torch.long)[None]
    x = embed_tokens(ids)
    mask = ids == media_pad
    assert int(mask.sum()) == image_embeds.shape[0]
    x[mask] = image_embeds.to(x.dtype)  # boolean-mask assignment fills rows in (row-major =) prompt order
    return x


def handoff_logits(model, expanded_ids, image_embeds):
    lm = model.model.language_model
    x = handoff_inputs_embeds(lm.get_input_embeddings(), expanded_ids, image_embeds, model.config.image_token_id)
    return model.lm_head(lm(inputs_embeds=x).last_hidden_state)


def transformers_logits(model, expanded_ids, pixel_values, grid_thws):
    return model(input_ids=torch.tensor(expanded_ids, dtype=torch.long)[None],
                 pixel_values=torch.as_tensor(pixel_values), image_grid_thw=torch.as_tensor(grid_thws)).logits


@pytest.fixture(scope="module")
def reference_logits(checkpoint, served):
    """(a): transformers' multimodal forward on the expanded ids and the checkpoint processor's pixels."""
    with torch.inference_mode():
        return transformers_logits(checkpoint[1], served["result"].expanded_ids, served["pixel_values"],
                                   served["grid_thws"])


def test_expanded_ids_and_embeds_rows_follow_the_counts(served):
    r, pad = served["result"], contract.MEDIA_PAD
    counts = r.token_counts.tolist()
    assert r.expanded_ids.dtype == np.int64 and r.image_embeds.dtype == np.float32  # FP32 on the CPU deployment
    assert r.expanded_ids.tolist() == plain_expansion(served["prompt"], counts, pad)
    assert int((r.expanded_ids == pad).sum()) == r.image_embeds.shape[0] == sum(counts)
    assert r.image_embeds.shape[1] == TEXT_HIDDEN
    assert counts == [h * w // 4 for _, h, w in r.grid_thws.tolist()] and min(counts) > 0


def test_preprocess_pixels_are_the_checkpoint_processors(served):
    refs = [reference_pixels(blob, served["media"]) for blob in served["blobs"]]
    assert served["grid_thws"].tolist() == [grid for _, grid in refs] == served["result"].grid_thws.tolist()
    assert np.array_equal(served["pixel_values"], np.concatenate([pv for pv, _ in refs]))


def test_handoff_logits_equal_transformers_multimodal_forward(checkpoint, served, reference_logits):
    _, model = checkpoint
    r = served["result"]
    embeds = torch.tensor(r.image_embeds)
    with torch.inference_mode():
        # Our IMAGE_EMBEDS are transformers' image features of the same pixels (the per-image
        # concatenation in media order) ...
        hf_feats = hf_image_features(model.model, torch.from_numpy(served["pixel_values"]),
                                     torch.from_numpy(served["grid_thws"]))
        embeds_err = rel_err(embeds, hf_feats)
        assert embeds_err <= 1e-5
        # ... and the hand-off gives transformers' multimodal logits.
        ref = reference_logits
        got = handoff_logits(model, r.expanded_ids, embeds)
        # transformers' own merge accepts precomputed features too (mm_encoder_outputs): same scatter.
        via_hf_merge = model(input_ids=torch.tensor(r.expanded_ids)[None],
                             mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=(embeds,))}).logits
    torch.testing.assert_close(via_hf_merge, got, atol=0, rtol=0)
    assert got.shape == ref.shape == (1, r.expanded_ids.shape[0], VOCAB)
    diff = float((got - ref).abs().max())
    print(f"\nIMAGE_EMBEDS vs transformers' features: rel err {embeds_err:.2e}; max |logits(hand-off) - "
          f"logits(transformers)| = {diff:.3e} (max |logits| {float(ref.abs().max()):.2f})")
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=RTOL)


def test_handoff_through_a_nixl_pull_gives_the_same_logits(checkpoint, served, reference_logits):
    """The rows an LLM READs with NIXL (docs/llm_handoff.md#pulling-the-embeddings-with-nixl) are the
    response's IMAGE_EMBEDS bit for bit, so the hand-off's logits are the same logits."""
    if served["nixl_embeds"] is None:
        pytest.skip("NIXL is not installed")
    _, model = checkpoint
    r, n = served["result"], served["nixl_result"]
    pulled = served["nixl_embeds"]
    assert n.image_embeds is None and np.array_equal(pulled, r.image_embeds)
    assert n.expanded_ids.tolist() == r.expanded_ids.tolist()
    with torch.inference_mode():
        got = handoff_logits(model, n.expanded_ids, torch.from_numpy(pulled))
        direct = handoff_logits(model, r.expanded_ids, torch.tensor(r.image_embeds))
    torch.testing.assert_close(got, direct, atol=0, rtol=0)
    torch.testing.assert_close(got, reference_logits, atol=ATOL, rtol=RTOL)


def test_handoff_is_sensitive_to_placement(checkpoint, served, reference_logits):
    """Negative control: the comparison above cannot pass with the images' blocks swapped, nor with one
    image's rows in the wrong order."""
    _, model = checkpoint
    r, ref = served["result"], reference_logits
    n0 = int(r.token_counts[0])
    embeds = torch.tensor(r.image_embeds)
    first = int(np.argmax(r.expanded_ids == contract.MEDIA_PAD))  # the first image's first row
    for what, wrong_embeds in (("swapped image blocks", torch.cat([embeds[n0:], embeds[:n0]])),
                               ("first image's rows reversed", torch.cat([embeds[:n0].flip(0), embeds[n0:]]))):
        with torch.inference_mode():
            wrong = handoff_logits(model, r.expanded_ids, wrong_embeds)
        # Causal: the positions before the first image do not see it ...
        torch.testing.assert_close(wrong[0, :first], ref[0, :first], atol=ATOL, rtol=RTOL)
        moved = float((wrong - ref).abs().max())
        print(f"\n{what}: max |logits - reference| = {moved:.3f}")
        assert moved > 1000 * ATOL, what  # ... and the ones from there on move by far more than the tolerance
