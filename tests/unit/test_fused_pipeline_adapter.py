"""FusedModel with its pipeline on, without a server: the adapter's three stages (`_accept` in execute,
`_launch` and `_finish` on the worker) around a real FusedStep on the CPU, a stand-in for pb_utils and
requests whose response senders record what they are sent. Every request gets exactly one answer:
through its sender (FINAL) once handed to the worker, from execute otherwise."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backends.config import DEMO_CONFIG
from backends.serving.pipeline import Pipeline, Streams
from backends.serving.steps import FusedStep
from backends.weights.seeded import seeded_model
from clients.samples import encode, photo_like
from contract import IMAGE_EMBEDS, IMAGES, INPUT_IDS, chat_prompt_ids
from fake_pb_utils import FINAL, triton_models_against_stand_in

@pytest.fixture(scope="module")
def triton_models():
    with triton_models_against_stand_in() as module:
        yield module


class Sender:
    def __init__(self, cancelled=False):
        self.sent, self.cancelled = [], cancelled

    def send(self, response, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


class Request:
    def __init__(self, ids, images, outputs=(IMAGE_EMBEDS, "EXPANDED_IDS"), cancelled_at_worker=False):
        self.ids, self.images, self.outputs = np.asarray(ids), images, list(outputs)
        self.sender = Sender(cancelled_at_worker)

    def requested_output_names(self):
        return self.outputs

    def is_cancelled(self):
        return False

    def get_response_sender(self):
        return self.sender


def _inputs(request):
    def numpy(name, optional=False):
        return request.ids if name == INPUT_IDS else None

    return SimpleNamespace(request=request, numpy=numpy, shape_outputs=lambda out: out,
                           bytes_list=lambda name, optional=False: request.images if name == IMAGES else None)


@pytest.fixture(scope="module")
def step():
    return FusedStep(DEMO_CONFIG, seeded_model(DEMO_CONFIG.encoder))


@pytest.fixture
def model(triton_models, step):
    m = triton_models.FusedModel.__new__(triton_models.FusedModel)
    m.name, m.step, m.forwarded, m.pipelined = "kimi_k25_vision_fused", step, [], True
    m.metrics = SimpleNamespace(decodes=lambda counts: None, preprocessed=lambda images, patches: None,
                                failure=lambda exc: None, phases=lambda seconds: None, step_time=lambda s: None)
    m.inputs = _inputs
    m.gpu_lock, m.streams, m._next_lane = threading.Lock(), Streams(torch.device("cpu")), 0
    m.pipeline = Pipeline(m._launch, m._finish, in_flight=2)
    yield m
    m.pipeline.close()


def blobs():
    return [encode(photo_like(320, 240, seed=5), "JPEG", quality=90)]


def test_a_request_handed_to_the_worker_is_answered_once_through_its_sender(model, step):
    ids = chat_prompt_ids(1, text_ids=[3, 4])
    requests = [Request(ids, blobs()) for _ in range(3)]
    assert model._execute(requests[:2]) == [None, None]  # handed over: answered later
    assert model._execute(requests[2:]) == [None]
    model.pipeline.close()
    whole = step(np.asarray(ids), blobs())
    for r in requests:
        (response, flags), = r.sender.sent
        assert flags == FINAL and response.error is None
        np.testing.assert_array_equal(response.outputs[IMAGE_EMBEDS], whole[IMAGE_EMBEDS].numpy())
        np.testing.assert_array_equal(response.outputs["EXPANDED_IDS"], whole["EXPANDED_IDS"])


def test_without_image_embeds_execute_answers_itself(model):
    r = Request(chat_prompt_ids(1), blobs(), outputs=("EXPANDED_IDS",))
    (response,) = model._execute([r])
    assert response is not None and response.error is None and IMAGE_EMBEDS not in response.outputs
    model.pipeline.close()
    assert r.sender.sent == []


def test_a_request_cancelled_before_its_forward_gets_its_error_through_the_sender(model):
    r = Request(chat_prompt_ids(1), blobs(), cancelled_at_worker=True)
    assert model._execute([r]) == [None]
    model.pipeline.close()
    (response, flags), = r.sender.sent
    assert flags == FINAL and response.error.code == "cancelled" and "before the encoder ran" in response.error.message


def test_a_bad_request_is_answered_by_execute_and_the_next_one_is_served(model):
    bad, good = Request(chat_prompt_ids(2), blobs()), Request(chat_prompt_ids(1), blobs())
    responses = model._execute([bad, good])
    assert responses[0].error.code == "invalid" and "placeholder" in responses[0].error.message
    assert responses[1] is None
    model.pipeline.close()
    assert bad.sender.sent == [] and len(good.sender.sent) == 1 and good.sender.sent[0][0].error is None


def test_after_close_a_request_is_refused_by_execute(model):
    model.pipeline.close()
    r = Request(chat_prompt_ids(1), blobs())
    (response,) = model._execute([r])
    assert response.error.code == "internal" and "closed" in response.error.message
    assert r.sender.sent == []


def test_setup_reads_the_pipeline_and_its_lanes_from_the_config(triton_models, monkeypatch):
    """The rendered parameters `pipeline` and `encoder_lanes`: lanes apply to a GPU pipeline only (on the
    CPU one), the worker keeps lanes + 1 jobs in flight, a lane count below one is refused by name."""
    from backends.serving.steps import ModelSettings

    monkeypatch.setattr(triton_models, "_load_encoder", lambda settings, config: seeded_model(DEMO_CONFIG.encoder))

    def made(pipeline: str, lanes: str):
        m = triton_models.FusedModel.__new__(triton_models.FusedModel)
        m.name, m.settings = "kimi_k25_vision_fused", ModelSettings(device="cpu", vision=DEMO_CONFIG)
        m.config = {"parameters": {"pipeline": {"string_value": pipeline}, "encoder_lanes": {"string_value": lanes}}}
        m.setup()
        return m

    on = made("yes", "2")
    try:
        assert on.pipelined and on.streams.lanes == 1 and len(on.step.encoders) == 1
        assert on.pipeline._in_flight == 2
        # The watchdog runs on a GPU only (a CPU forward of a large request can take minutes).
        assert not any(t.name == "kimi_k25_vision_fused-encoder-watchdog" for t in threading.enumerate())
    finally:
        on.pipeline.close()
    off = made("no", "2")
    assert not off.pipelined and not hasattr(off, "pipeline") and len(off.step.encoders) == 1
    with pytest.raises(ValueError, match="encoder_lanes"):
        made("yes", "0")


def test_a_stalled_pipeline_is_logged_with_every_threads_stack(model, caplog, capfd):
    """The watchdog's report (FusedModel._stalled): an ERROR naming the instance and what stalled, then
    every thread's stack on stderr, which the server's log receives from the stub."""
    model.instance_name = "kimi_k25_vision_fused_0_1"
    with caplog.at_level("ERROR", logger="kimi_vision"):
        model._stalled(31.0, "3 request(s) handed over and none launched or answered")
    assert any("kimi_k25_vision_fused (kimi_k25_vision_fused_0_1): 3 request(s) handed over" in r.getMessage()
               and "for 31 s" in r.getMessage() for r in caplog.records)
    err = capfd.readouterr().err
    assert "Thread 0x" in err and "test_a_stalled_pipeline_is_logged" in err  # this thread's own frame
