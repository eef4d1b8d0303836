"""FusedStep (kimi_k25_vision_fused's logic) without a server: the ensemble's answer from pieces that do
not share its code path (the preprocessor and the model called directly, the ids expanded by a plain
loop), its checks before any image is read, the answer without IMAGE_EMBEDS (no encoder, the same
refusals), its cancel checks; and the adapter's wiring of those checks to the request."""

import re

import numpy as np
import pytest
import torch

from backends.config import DEMO_CONFIG
from backends.errors import RequestCancelled, RequestError
from backends.preprocess import Preprocessor
from backends.serving.steps import FusedStep
from backends.weights.seeded import seeded_model
from clients.samples import encode, photo_like, text_card
from contract import EXPANDED_IDS, GRID_THWS, IMAGE_EMBEDS, IMAGE_TOKEN_COUNTS, MEDIA_PAD, PIXEL_VALUES, chat_prompt_ids


@pytest.fixture(scope="module")
def step():
    return FusedStep(DEMO_CONFIG, seeded_model(DEMO_CONFIG.encoder))


def blobs():
    return [encode(photo_like(640, 480, seed=1), "JPEG", quality=90), encode(text_card(300, 200), "PNG")]


def loop_expand(ids, counts):
    out, i = [], 0
    for tok in ids:
        if tok == MEDIA_PAD:
            out += [MEDIA_PAD] * counts[i]
            i += 1
        else:
            out.append(tok)
    return out


def test_the_answer_equals_the_pieces(step):
    images, ids = blobs(), chat_prompt_ids(2, text_ids=[7, 8])
    out = step(np.asarray(ids), images)
    pv, grids, plans = Preprocessor(DEMO_CONFIG.media)(images)
    counts = [m.plan.num_tokens for m in plans]
    embeds = seeded_model(DEMO_CONFIG.encoder)(pv, grids)
    assert out[IMAGE_TOKEN_COUNTS].tolist() == counts and out[GRID_THWS].tolist() == grids.tolist()
    assert out[EXPANDED_IDS].tolist() == loop_expand(ids, counts)
    assert torch.equal(out[IMAGE_EMBEDS], embeds)


def test_without_embeds_the_encoder_does_not_run_and_the_rest_is_the_same(step, monkeypatch):
    images, ids = blobs(), chat_prompt_ids(2)
    full = step(np.asarray(ids), images)

    def refuse(*a, **k):
        raise AssertionError("the encoder ran although IMAGE_EMBEDS was not asked for")

    monkeypatch.setattr(step.encoder, "run_batch", refuse)
    part = step(np.asarray(ids), images, embeds=False, cancelled_now=lambda: True)  # not asked either
    assert IMAGE_EMBEDS not in part
    for name in (EXPANDED_IDS, GRID_THWS, IMAGE_TOKEN_COUNTS):
        assert np.array_equal(part[name], full[name]), name


def test_without_embeds_a_file_that_does_not_decode_is_still_refused(step):
    """The ensemble runs kimi_preprocess for every subset of its outputs: a PNG whose header reads but
    whose data is cut short fails there, and so it must here."""
    cut = encode(photo_like(64, 48, seed=3), "PNG")
    cut = cut[: len(cut) // 2]
    with pytest.raises(RequestError, match="image 0: decoding failed"):
        step(np.asarray(chat_prompt_ids(1)), [cut], embeds=False)


def test_a_broken_prompt_is_refused_before_any_image_is_read(step, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("an image was read before the prompt was checked")

    monkeypatch.setattr(type(step.pre), "__call__", refuse)
    with pytest.raises(RequestError, match=re.escape("has 1 <|media_pad|> placeholder token(s) (id 163605) but 2 image")):
        step(np.asarray(chat_prompt_ids(1)), [b"garbage", b"more garbage"])


def test_a_client_that_gave_up_during_preprocessing_costs_no_encoder_time(step, monkeypatch):
    """Between media the throttled question (`cancelled`), before the encoder the direct one
    (`cancelled_now`, asked once): a request cancelled after its last image stops there."""
    between, before = [], []

    def refuse(*a, **k):
        raise AssertionError("the encoder ran for a cancelled request")

    monkeypatch.setattr(step.encoder, "run_batch", refuse)
    with pytest.raises(RequestCancelled, match="before the encoder ran"):
        step(np.asarray(chat_prompt_ids(2)), blobs(), cancelled=lambda: between.append(1) or False,
             cancelled_now=lambda: before.append(1) or True)
    assert len(between) == 2 and len(before) == 1


def test_the_adapter_asks_the_server_directly_before_the_encoder(monkeypatch):
    """FusedModel hands the step a throttled question for between the media (not asked within its first
    20 ms) and the request's own is_cancelled for before the encoder (asked at once)."""
    from fake_pb_utils import triton_models_against_stand_in

    with triton_models_against_stand_in() as triton_models:
        # the throttle's window far longer than the test: its first question is never asked
        monkeypatch.setattr(triton_models, "CANCEL_CHECK_S", 3600.0)
        _adapter_wiring(triton_models)


def _adapter_wiring(triton_models):
    from types import SimpleNamespace

    got = {}

    class Step:
        pre = SimpleNamespace(decode_stats={})

        def prepare(self, ids, images, frames, cancelled=None):
            got["cancelled"] = cancelled
            return {GRID_THWS: np.zeros((0, 3), np.int64), PIXEL_VALUES: torch.zeros(0, 3, 14, 14)}

        def encode(self, out, cancelled_now=None):
            got["cancelled_now"] = cancelled_now
            return out

    class Request:
        asked = 0

        def is_cancelled(self):
            Request.asked += 1
            return True

        def requested_output_names(self):
            return ["IMAGE_EMBEDS", "EXPANDED_IDS"]

    model = triton_models.FusedModel.__new__(triton_models.FusedModel)
    model.step = Step()
    model.metrics = SimpleNamespace(decodes=lambda counts: None, preprocessed=lambda images, patches: None)
    inputs = SimpleNamespace(request=Request(), bytes_list=lambda name: [],
                             numpy=lambda name, optional=False: np.array([1, 2]) if name == "INPUT_IDS" else None)
    model.respond(inputs)
    assert "cancelled_now" in got  # IMAGE_EMBEDS asked for: the encoder's half runs
    assert got["cancelled"]() is False and Request.asked == 0  # throttled: not asked so soon
    assert got["cancelled_now"]() is True and Request.asked == 1  # the server is asked
