"""The NIXL hand-off's pure parts, without a server: the descriptor's bytes, the arena's slots (budget,
lifetime, reader's notification), the request parameter, the settings that carry the budget, and the
encoder side's export against a stand-in NIXL agent. Last, one real READ between two agents of this
process (skipped where NIXL is not installed)."""

import ctypes
import random

import numpy as np
import pytest
import torch

from backends.deploy.repository import Deployment, model_configs
from backends.errors import RequestError
from backends.nixl_export import arena as arena_module
from backends.nixl_export.arena import NixlExport, nixl_requested
from backends.nixl_export.slots import ALIGN, SlotTable
from backends.serving.metrics import ModelMetrics
from backends.serving.settings import ModelSettings
from contract import NIXL_PARAMETER
from contract.nixl_descriptor import (NOTIFY_PREFIX, NixlDescriptor, decode, encode, load_nixl_api, notification,
                                      notified_id)
from fake_pb_utils import FakePbUtils


def _descriptor(**kw):
    fields = dict(agent="kimi-moonvit3d_0_0-1-ab", metadata=b"\x00md\xff" * 40, mem="DRAM", device=0, addr=140000000000,
                  nbytes=18 * 256 * 4, shape=(18, 256), dtype="FP32", id=12345, lifetime_ms=30000,
                  expires_unix_ms=1_800_000_000_000)
    return NixlDescriptor(**{**fields, **kw})


# The descriptor (contract/nixl_descriptor.py)

def test_a_descriptor_survives_its_bytes_whole():
    d = _descriptor()
    data = encode(d)
    assert data[:4] == b"KNX1" and len(data) < 400  # the metadata and a small header: not the rows
    assert decode(data) == d
    assert decode(np.frombuffer(data, np.uint8)) == d  # as IMAGE_EMBEDS_NIXL arrives
    assert decode(encode(_descriptor(mem="VRAM", device=3, dtype="BF16", nbytes=18 * 256 * 2))).device == 3


@pytest.mark.parametrize("data, words", [
    (b"", "0 bytes"), (b"JUNKJUNK", "not a NIXL descriptor"), (b"KNX1\xff\x00\x00\x00{}", "cut short"),
    (b"KNX1\x02\x00\x00\x00{}", "bad NIXL descriptor header"), (b"KNX1\x03\x00\x00\x00{x}", "bad NIXL descriptor header"),
])
def test_anything_else_is_refused_naming_what_is_wrong(data, words):
    with pytest.raises(ValueError, match=words):
        decode(data)


@pytest.mark.parametrize("kw, words", [
    (dict(mem="HBM"), "mem"), (dict(dtype="INT8"), "dtype"), (dict(nbytes=5), "does not match"),
    (dict(shape=(1, 2, 3)), "shape"), (dict(addr=-1), "negative"),
])
def test_an_inconsistent_descriptor_is_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        _descriptor(**kw)


def test_the_notification_names_the_descriptor_and_nothing_else_frees_a_slot():
    assert notification(77) == NOTIFY_PREFIX + b"77" == _descriptor(id=77).notification()
    assert notified_id(notification(77)) == 77
    assert notified_id(b"hello") is None and notified_id(NOTIFY_PREFIX + b"7x") is None


# The slots (backends/nixl_export/slots.py)

def test_slots_are_aligned_first_fit_and_freed_by_their_reader():
    t = SlotTable(4 * ALIGN, lifetime_s=10)
    a, b = t.take(10, now=0), t.take(ALIGN + 1, now=0)
    assert (a.offset, b.offset) == (0, ALIGN) and a.id != b.id and 0 not in (a.id, b.id)
    assert (t.outstanding, t.held_bytes) == (2, 10 + ALIGN + 1)
    assert t.release(a.id) == a and t.release(a.id) is None  # read twice: the second frees nothing
    assert t.take(ALIGN, now=1).offset == 0  # a's place again
    assert t.take(ALIGN, now=1).offset == 3 * ALIGN
    assert t.released == 1 and t.expired == 0


def test_a_full_arena_refuses_naming_the_budget_until_a_slot_is_read_or_expires():
    t = SlotTable(2 * ALIGN, lifetime_s=5)
    first = t.take(2 * ALIGN, now=0)
    with pytest.raises(RequestError, match=r"no room for the request's 1 bytes .*nixl_bytes=512.*1 descriptor\(s\) "
                                           r"not yet read hold 512 bytes, the next expires in 4.0 s") as exc:
        t.take(1, now=1)
    assert exc.value.reason == "nixl_budget"
    assert t.take(1, now=5).offset == 0  # the first one's lifetime ended: freed unread
    assert t.expired == 1 and t.release(first.id) is None
    with pytest.raises(RequestError, match=r"embeddings are 513 bytes, more than the NIXL arena holds \(nixl_bytes=512\)"):
        t.take(2 * ALIGN + 1, now=5)


def test_slots_never_overlap_and_the_bookkeeping_adds_up():
    rng = random.Random(0)
    t = SlotTable(64 * ALIGN, lifetime_s=3)
    live = {}
    for step in range(3000):
        now = step * 0.01
        if live and rng.random() < 0.3:
            live.pop(t.release(rng.choice(list(live))).id)
        try:
            s = t.take(rng.randint(1, 6 * ALIGN), now)
            live[s.id] = s
        except RequestError:
            pass
        t.expire(now)  # take() frees the ended ones too, before it looks for room
        live = {i: s for i, s in live.items() if s.expires > now}
        spans = sorted((s.offset, s.end) for s in live.values())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and (not spans or spans[-1][1] <= t.capacity)
        assert t.outstanding == len(live) and t.held_bytes == sum(s.nbytes for s in live.values())
    assert t.released > 100 and t.expired > 10  # both ways out taken, many times


# The request parameter and the settings

@pytest.mark.parametrize("value, wanted", [(None, False), (True, True), (1, True), ("true", True), ("ON", True),
                                           (False, False), (0, False), ("no", False)])
def test_the_parameter_asks_for_a_descriptor(value, wanted):
    assert nixl_requested({} if value is None else {NIXL_PARAMETER: value}) is wanted


@pytest.mark.parametrize("value", ["maybe", 2, [1]])
def test_a_bad_parameter_is_the_requests_error(value):
    with pytest.raises(RequestError, match=NIXL_PARAMETER):
        nixl_requested({NIXL_PARAMETER: value})


def test_the_budget_and_lifetime_reach_the_encoders_parameters():
    assert Deployment().nixl_bytes == 256 << 20 and Deployment(device="gpu").nixl_bytes == 1 << 30
    params = {k: v.string_value for k, v in model_configs(Deployment(nixl_bytes=0, nixl_lifetime_ms=1500))["moonvit3d"].parameters.items()}
    settings = ModelSettings.from_parameters(params)
    assert (settings.nixl_bytes, settings.nixl_lifetime_ms) == (0, 1500)
    assert ModelSettings.from_parameters({}).nixl_bytes == 0  # a hand-written repository: off
    with pytest.raises(ValueError, match="nixl_bytes"):
        Deployment(nixl_bytes=-1)


# The encoder's side against a stand-in agent (what backends/nixl_export/arena.py asks of NIXL)

class _FakeAgent:
    def __init__(self, name, conf):
        self.name, self.notifs, self.registered = name, {}, []

    def register_memory(self, tensor):
        self.registered.append(tensor)
        return "reg"

    def deregister_memory(self, reg):
        self.registered.clear()

    def get_agent_metadata(self):
        return b"metadata of " + self.name.encode()

    def get_new_notifs(self):
        notifs, self.notifs = self.notifs, {}
        return notifs


class _FakeApi:
    nixl_agent = _FakeAgent

    @staticmethod
    def nixl_agent_config(backends):
        return backends


def _read(d: NixlDescriptor) -> np.ndarray:
    """What a READ of the descriptor would copy, straight from this process's memory."""
    raw = (ctypes.c_uint8 * d.nbytes).from_address(d.addr)
    return np.frombuffer(bytes(raw), dtype=np.float32).reshape(d.shape)


def test_the_export_copies_rows_into_its_arena_and_frees_them_on_notification_or_expiry(monkeypatch):
    monkeypatch.setattr(arena_module, "load_nixl_api", lambda: _FakeApi)
    now = [0.0]
    ex = NixlExport(4096, lifetime_s=2, device="cpu", name="moonvit3d_0_0", clock=lambda: now[0])
    assert ex.arena_bytes == 0 and ex._agent is None  # nothing until a request asks
    rows = [torch.randn(3, 64), torch.randn(2, 64), torch.empty(0, 64)]
    out = ex.export(rows)
    ds = [decode(b) for b in out]
    assert ex.arena_bytes == 4096 and ds[0].metadata == b"metadata of " + ex.name.encode()
    for d, r in zip(ds, rows):
        assert (d.shape, d.dtype, d.mem, d.nbytes) == (tuple(r.shape), "FP32", "DRAM", r.numel() * 4)
    np.testing.assert_array_equal(_read(ds[0]), rows[0].numpy())
    np.testing.assert_array_equal(_read(ds[1]), rows[1].numpy())
    assert ds[2].id == 0 and ds[2].nbytes == 0  # no rows: nothing held, nothing to read
    assert ex.counts() == {"outstanding": 2, "bytes": 5 * 64 * 4, "reads": 0, "expired": 0}
    ex._agent.notifs = {"consumer": [notification(ds[0].id), b"unrelated"]}
    (err,) = ex.export([torch.randn(16, 64)])  # polls first: ds[0] is freed, still no room for 4 KiB
    assert isinstance(err, RequestError) and "nixl_bytes=4096" in str(err)
    assert ex.counts() == {"outstanding": 1, "bytes": 2 * 64 * 4, "reads": 1, "expired": 0}
    now[0] = 2.0
    ex._poll()
    assert ex.counts() == {"outstanding": 0, "bytes": 0, "reads": 1, "expired": 1}
    ex.close()
    assert ex._agent is None


def test_an_export_that_cannot_start_fails_each_request_with_the_reason(monkeypatch):
    def missing():
        raise ImportError("NIXL is not installed (pip install nixl-cu12 ...)")

    monkeypatch.setattr(arena_module, "load_nixl_api", missing)
    ex = NixlExport(4096, lifetime_s=2, device="cpu", name="m")
    for _ in range(2):  # said once in the log, to every request
        errors = ex.export([torch.randn(1, 4), torch.randn(1, 4)])
        assert all(isinstance(e, RequestError) and "cannot hand out NIXL descriptors: ImportError: NIXL is not installed"
                   in str(e) for e in errors)


def test_the_exports_counts_go_out_as_gauges_and_counters(monkeypatch):
    monkeypatch.setattr(arena_module, "load_nixl_api", lambda: _FakeApi)
    pb = FakePbUtils()
    m = ModelMetrics(pb, "moonvit3d", flush_s=3600, instance="moonvit3d_0_0")
    ex = NixlExport(4096, lifetime_s=2, device="cpu", name="m", clock=lambda: 0.0)
    m.watch_nixl(ex)
    m.flush()  # at load: the gauges exist at 0
    assert {(f, v) for kind, f, _, v in pb.sent if kind == "set"} == {("kimi_vision_nixl_descriptors", 0),
                                                                       ("kimi_vision_nixl_bytes", 0)}
    (d,) = ex.export([torch.randn(2, 8)])
    ex._agent.notifs = {"c": [decode(d).notification()]}
    ex.export([torch.randn(1, 8)])
    m.flush()
    sets = {f: v for kind, f, _, v in pb.sent if kind == "set"}
    incs = [(f, v) for kind, f, _, v in pb.sent if kind == "inc"]
    assert sets == {"kimi_vision_nixl_descriptors": 1, "kimi_vision_nixl_bytes": 32} and incs == [("kimi_vision_nixl_reads_total", 1)]
    m.close()
    ex.close()


# One real READ between two agents of this process (the consumer's helper against the export)

def test_a_real_read_over_ucx_gives_the_rows_and_frees_the_slot(monkeypatch):
    try:
        load_nixl_api()
    except ImportError as exc:
        pytest.skip(f"NIXL is not installed: {exc}")
    monkeypatch.setenv("UCX_TLS", "tcp")
    from clients.nixl_pull import NixlExpired, NixlPuller

    ex = NixlExport(1 << 20, lifetime_s=30, device="cpu", name="unit")
    rows = torch.randn(5, 32)
    with NixlPuller() as puller:
        (raw,) = ex.export([rows])
        got = puller.pull(raw)
        np.testing.assert_array_equal(got, rows.numpy())
        out = np.zeros(1000, np.float32)
        puller.register(out)  # registered once; the pull writes into its start
        (raw,) = ex.export([rows * 2])
        view = puller.pull(raw, out)
        np.testing.assert_array_equal(out[:160].reshape(5, 32), (rows * 2).numpy())
        assert view.shape == (5, 32) and np.shares_memory(view, out)
        (raw,) = ex.export([rows])
        puller.release(raw)  # given up unread
        stale = decode(ex.export([rows])[0])
        with pytest.raises(NixlExpired):
            puller.pull(stale, sent_unix_s=0)  # sent long ago: the lifetime is over
        puller.release(stale)
        _wait(lambda: ex.counts()["outstanding"] == 0)
        assert ex.counts()["reads"] == 4
    ex.close()


def _wait(condition, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()
