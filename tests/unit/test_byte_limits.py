"""Byte limits on IMAGES (max_image_bytes, max_request_bytes), refused from the lengths alone, and the
allocator and tritonserver flags the launcher adds for memory that returns (#37 item 6). The same
through a real server: tests/integration/test_request_bytes.py."""

import io
import types

import numpy as np
import pytest
from PIL import Image
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from backends.config import DEMO_CONFIG, Limits, image_bytes_bound
from backends.deploy import allocator as heap
from backends.deploy.launcher import Ports, TritonInstall, tritonserver_command
from backends.deploy.repository import HTTP_INPUT_SLACK_BYTES, Deployment
from backends.errors import RequestError
from backends.preprocess.media import check_image_bytes, image_bytes_error
from backends.serving import bytes_inputs
from backends.serving.settings import ModelSettings
from backends.serving.steps import PlaceholderStep, PreprocessStep
from contract import chat_prompt_ids

SMALL = Limits(max_images=4, max_image_bytes=100, max_request_bytes=250)


def _jpeg(size=(32, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 10)).save(buf, "JPEG")
    return buf.getvalue()


def test_the_byte_limits_default_from_the_pixel_limit():
    limits = Limits()
    # 8-bit RGB at the pixel limit stored uncompressed, plus 1 MiB of header: 538 MB, per image and per request.
    assert limits.max_image_bytes == image_bytes_bound(179_000_000) == 3 * 179_000_000 + (1 << 20) == 538_048_576
    assert limits.max_request_bytes == limits.max_image_bytes
    assert Limits(max_image_pixels=1000).max_image_bytes == 3000 + (1 << 20)
    assert Limits(max_image_bytes=10).max_request_bytes == 10
    assert Limits(max_image_bytes=10, max_request_bytes=30).max_request_bytes == 30
    with pytest.raises(ValueError, match="max_request_bytes must be at least 1, got 0"):
        Limits(max_request_bytes=0)


def test_the_byte_limits_travel_as_model_config_parameters():
    params = ModelSettings(limits=SMALL).parameters()
    assert params["max_image_bytes"] == "100" and params["max_request_bytes"] == "250"
    assert ModelSettings.from_parameters(params).limits == SMALL
    # A repository written by hand without them: derived from its own pixel limit.
    hand = {k: v for k, v in params.items() if k not in ("max_image_bytes", "max_request_bytes")}
    hand["max_image_pixels"] = "1000"
    assert ModelSettings.from_parameters(hand).limits.max_image_bytes == image_bytes_bound(1000)


def test_each_violation_is_named_with_the_requests_own_value_count_then_image_then_total():
    assert image_bytes_error([100, 100], SMALL) is None
    error = image_bytes_error([5] * 5, SMALL)
    assert str(error) == "5 images in one request exceeds the limit max_images=4" and error.reason == "image_count_limit"
    error = image_bytes_error([10, 101, 500], SMALL)
    assert str(error) == "image 1: 101 bytes exceeds the limit max_image_bytes=100" and error.reason == "image_bytes_limit"
    error = image_bytes_error([100, 100, 51], SMALL)
    assert str(error) == ("the request's 3 images are 251 bytes in all, exceeding the limit max_request_bytes=250")
    assert error.reason == "request_bytes_limit"
    with pytest.raises(RequestError, match="image 0: 101 bytes"):
        check_image_bytes([memoryview(b"x" * 101)], SMALL)


def test_the_steps_refuse_by_bytes_before_reading_hashing_or_checking_the_prompt():
    garbage = b"\0" * 101  # not an image: a byte limit is what must be named, not the decode
    pre = PreprocessStep(DEMO_CONFIG, SMALL, cache_context=b"ctx", held=lambda key: False)
    with pytest.raises(RequestError, match="image 0: 101 bytes exceeds the limit max_image_bytes=100"):
        pre([garbage], input_ids=chat_prompt_ids(1))
    with pytest.raises(RequestError, match="max_image_bytes"):
        pre.keys([garbage])  # no byte hashed beyond the limits
    with pytest.raises(RequestError, match="max_request_bytes=250"):
        pre([b"\0" * 90] * 3, input_ids=chat_prompt_ids(2))  # the prompt is wrong too: bytes come first
    place = PlaceholderStep(DEMO_CONFIG, SMALL)
    with pytest.raises(RequestError, match="max_image_bytes=100"):
        place(np.asarray(chat_prompt_ids(1)), [garbage])
    # Within the limits the images are read as before.
    jpeg = _jpeg()
    roomy = Limits(max_image_bytes=len(jpeg), max_request_bytes=2 * len(jpeg))
    assert len(PreprocessStep(DEMO_CONFIG, roomy)([jpeg, jpeg])["IMAGE_TOKEN_COUNTS"]) == 2


def _serialized(blobs) -> np.ndarray:
    """A BYTES tensor as the stub hands it to deserialize_bytes_tensor: uint8, each length before its bytes."""
    return np.frombuffer(serialize_byte_tensor(np.array(blobs, dtype=object)).item(), dtype=np.uint8)


def test_the_stubs_unpacking_copies_nothing_of_a_tensor_over_the_limits():
    calls = []

    def original(encoded):
        calls.append(len(encoded))
        return deserialize_bytes_tensor(encoded)

    unpack = bytes_inputs.checked_unpacker(original, SMALL)
    # Within the limits: the original unpacks, and the stub reshapes as usual.
    ok = unpack(_serialized([b"a" * 100, b"b" * 3])).reshape([2])
    assert [bytes(x) for x in ok] == [b"a" * 100, b"b" * 3] and bytes_inputs.refusal(ok) is None and calls
    calls.clear()
    # Over: a stand-in of the tensor's shape (plain or batched), nothing copied, the error named.
    for dims in ([3], [1, 3]):
        refused = unpack(_serialized([b"a", b"b" * 101, b"c"])).reshape(dims)
        assert refused.shape == tuple(dims) and not refused.flags.writeable
        error = bytes_inputs.refusal(refused)
        assert str(error) == "image 1: 101 bytes exceeds the limit max_image_bytes=100" and error.reason == "image_bytes_limit"
        assert bytes_inputs.refusal(refused) is not error  # a new one each time (never a kept, raised one)
    refused = unpack(_serialized([b"x" * 90] * 3)).reshape([3])
    assert "the request's 3 images are 270 bytes in all" in str(bytes_inputs.refusal(refused))
    # More entries than max_images: the walk stops there, and the error names the tensor's own count.
    refused = unpack(_serialized([b""] * 1000)).reshape([1000])
    assert str(bytes_inputs.refusal(refused)) == "1000 images in one request exceeds the limit max_images=4"
    assert calls == []
    # An empty tensor and a malformed one are the original's to judge.
    assert unpack(np.zeros(0, np.uint8)).reshape([0]).size == 0
    with pytest.raises(Exception):
        unpack(np.frombuffer(b"\x05\x00\x00\x00ab", np.uint8))
    assert len(calls) == 2


def test_install_wraps_the_stubs_function_once():
    module = types.SimpleNamespace(deserialize_bytes_tensor=deserialize_bytes_tensor)
    assert bytes_inputs.install(module, SMALL) and bytes_inputs.install(module, Limits())
    assert module.deserialize_bytes_tensor.__wrapped__ is deserialize_bytes_tensor
    assert not bytes_inputs.install(types.SimpleNamespace(), SMALL)


def test_the_allocator_is_jemalloc_where_there_is_one_and_says_so(monkeypatch):
    off = heap.find("glibc")
    assert off.library == "" and off.env({}) == {} and off.note().startswith("memory allocator: glibc malloc (KIMI_MALLOC=glibc)")
    with pytest.raises(ValueError, match="KIMI_MALLOC='/nonexistent/libjemalloc.so.2': not a library"):
        heap.find("/nonexistent/libjemalloc.so.2")
    jemalloc = heap.Allocator("jemalloc", "/x/libjemalloc.so.2")
    env = jemalloc.env({"LD_PRELOAD": "/y/other.so"})
    assert env == {"LD_PRELOAD": "/x/libjemalloc.so.2 /y/other.so", "MALLOC_CONF": heap.JEMALLOC_CONF}
    assert "MALLOC_CONF" not in jemalloc.env({"MALLOC_CONF": "narenas:2"})  # the operator's stays
    found = heap.find("")
    if not any(p.is_file() for p in heap.jemalloc_candidates()):
        assert found.name == "glibc" and "no libjemalloc" in found.note()
    else:  # make setup puts one in the virtualenv where the system has none
        assert found.name == "jemalloc" and heap.preloads(found.library)
        assert found.note().startswith(f"memory allocator: jemalloc ({found.library}) preloaded for tritonserver")


def test_the_command_line_pools_no_grpc_requests_and_sizes_http_where_the_server_can(tmp_path):
    old = TritonInstall(tmp_path / "missing", tmp_path)  # like 2.51: no --http-max-input-size
    cmd = tritonserver_command(old, "/repo", Ports(), cuda_pools={}, http_max_input_bytes=1000)
    assert "--grpc-infer-allocation-pool-size=0" in cmd and not any("http-max-input-size" in a for a in cmd)
    newer = tmp_path / "tritonserver"
    newer.write_text("#!/bin/sh\necho '  --http-max-input-size <integer>'\nexit 1\n")
    newer.chmod(0o755)
    cmd = tritonserver_command(TritonInstall(newer, tmp_path), "/repo", Ports(), cuda_pools={}, http_max_input_bytes=1000)
    assert "--http-max-input-size=1000" in cmd
    assert Deployment(limits=SMALL).http_max_input_bytes() == 250 + HTTP_INPUT_SLACK_BYTES


def test_the_shm_ceiling_counts_the_encoded_images_the_regions_can_hold():
    cpu = Deployment(limits=SMALL)  # 1 preprocessing instance (two requests' IMAGES), moonvit3d's batch of 8
    assert cpu.images_shm_bytes() == (2 * 1 + 1 * 8) * 250
    gpu = Deployment(device="gpu", gpus=2, limits=SMALL)  # 2 preprocessing instances per GPU
    assert gpu.images_shm_bytes() == 2 * (2 * 2 + 1 * 8) * 250 and gpu.shm_ceiling_bytes() == 0
