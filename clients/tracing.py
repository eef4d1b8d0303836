"""Where one request's time goes inside tritonserver, from the server's own trace (docs/triton_runtime.md#request-traces).

A server started with a trace file (the launcher's --trace-file) traces nothing until tracing is turned
on through its trace API. `Tracer.trace(n)` turns it on for the next n requests, each written to a
file of its own (`<trace file>.<k>`), and off again; `Tracer.read()` waits for those files and returns
one `RequestTrace` per request.

What tritonserver 2.51 writes (level TIMESTAMPS, trace mode "triton"): a flat JSON list of records,
`{"id", "model_name", "model_version"[, "parent_id"]}` when a trace starts, then one `{"id",
"timestamps": [{"name", "ns"}]}` per event. The ensemble's trace is the request's root; each composing
model's trace names the root as `parent_id` and gets REQUEST_START, QUEUE_START, COMPUTE_START,
COMPUTE_INPUT_END (inputs handed to the Python stub), COMPUTE_OUTPUT_START (the stub's answer is back),
COMPUTE_END and REQUEST_END. The front end's events (GRPC_WAITREAD_END when the request has been read,
INFER_RESPONSE_COMPLETE, GRPC_SEND_START / GRPC_SEND_END; HTTP_RECV_END, HTTP_SEND_END over HTTP) are
on the root. Times are steady_clock nanoseconds, CLOCK_MONOTONIC on Linux, the clock of
`time.monotonic_ns()`: a client on the same host places its own send and receive on the same axis.

`spans` cuts one request into consecutive stretches along the models that run one after another,
so that they add up to the client's wall time exactly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

RECEIVED = ("GRPC_WAITREAD_END", "HTTP_RECV_END")  # the front end has read the request
SENT = ("GRPC_SEND_END", "HTTP_SEND_END")  # the front end has written the response


class TraceError(RuntimeError):
    pass


@dataclass
class ModelTrace:
    """One model's part of a request: its events, name -> ns (the first of each name)."""
    id: int
    model: str = ""
    parent: int = 0  # 0: the request's root (the model the client asked, here the ensemble)
    events: dict[str, int] = field(default_factory=dict)

    def at(self, *names: str) -> int:
        """The time of the first of `names` this trace has."""
        for name in names:
            if name in self.events:
                return self.events[name]
        raise TraceError(f"{self.model or self.id}: no {' or '.join(names)} event (has {', '.join(self.events)})")


@dataclass
class RequestTrace:
    root: ModelTrace
    steps: dict[str, ModelTrace]  # composing model -> its trace (each ran once for the request)


def parse(records: list[dict]) -> dict[int, ModelTrace]:
    """Trace records (the contents of one or more trace files, in any order) -> id -> ModelTrace."""
    traces: dict[int, ModelTrace] = {}
    for rec in records:
        t = traces.setdefault(int(rec["id"]), ModelTrace(int(rec["id"])))
        if "model_name" in rec:
            t.model = rec["model_name"]
            t.parent = int(rec.get("parent_id", 0))
        for ev in rec.get("timestamps", ()):
            t.events.setdefault(ev["name"], int(ev["ns"]))
    return traces


def requests(traces: dict[int, ModelTrace]) -> list[RequestTrace]:
    """Group model traces by request (root), in the order the requests started."""
    roots = {i: t for i, t in traces.items() if not t.parent}
    steps: dict[int, dict[str, ModelTrace]] = {i: {} for i in roots}
    for t in traces.values():
        if t.parent:
            if t.parent not in steps:
                raise TraceError(f"trace {t.id} ({t.model}) names parent {t.parent}, which is not in the files read")
            if t.model in steps[t.parent]:
                raise TraceError(f"{t.model} ran twice for request trace {t.parent}")
            steps[t.parent][t.model] = t
    out = [RequestTrace(root, steps[i]) for i, root in roots.items()]
    return sorted(out, key=lambda r: r.root.events.get("REQUEST_START", 0))


def spans(req: RequestTrace, path: list[str], sent_ns: int | None = None,
          received_ns: int | None = None) -> list[tuple[str, float]]:
    """Consecutive stretches (label, ms) of one request along `path`, the composing models that run one
    after another (models beside them, such as kimi_placeholder beside the encoder, are left out: see
    `off_path`). With the client's own send and receive times (time.monotonic_ns()) the stretches run
    from the send to the receive and add up to the client's wall time.

    A step hands on when its stub's answer is back (COMPUTE_OUTPUT_START): the Python backend sends the
    response then, the ensemble issues the next step's request (its REQUEST_START) at once, and the
    step's own COMPUTE_END comes later, beside the next step. So the cut points per step are
    REQUEST_START, COMPUTE_START, COMPUTE_INPUT_END and COMPUTE_OUTPUT_START."""
    root = req.root
    points: list[tuple[str, int]] = []
    if sent_ns is not None:
        points.append(("client", sent_ns))
    points += [("read", root.at(*RECEIVED)), ("ensemble", root.at("REQUEST_START"))]
    for model in path:
        if model not in req.steps:
            raise TraceError(f"no trace of {model} in request trace {root.id} (has {', '.join(req.steps)})")
        t = req.steps[model]
        points += [(f"{model} request", t.at("REQUEST_START")), (f"{model} start", t.at("COMPUTE_START")),
                   (f"{model} inputs", t.at("COMPUTE_INPUT_END")), (f"{model} answer", t.at("COMPUTE_OUTPUT_START"))]
    points.append(("response", root.at("INFER_RESPONSE_COMPLETE")))
    # The front end's send-end can come after the client already has the bytes: with the client's
    # receive time, that one stretch runs from the complete response to the client's hands.
    points.append(("client", received_ns) if received_ns is not None else ("sent", root.at(*SENT)))
    return [(_label(a, b), (tb - ta) / 1e6) for (a, ta), (b, tb) in zip(points, points[1:])]


def _label(a: str, b: str) -> str:
    """The stretch from point a to point b, named for what happens in it."""
    fixed = {
        ("client", "read"): "client sends, front end reads the request",
        ("read", "ensemble"): "front end -> ensemble",
        ("response", "sent"): "response written to the client",
        ("response", "client"): "response written to, and unpacked by, the client",
    }
    if (a, b) in fixed:
        return fixed[(a, b)]
    model, _, what = b.rpartition(" ")
    before = a.rpartition(" ")[0]
    if what == "request":
        return f"ensemble issues {model}'s request" if a == "ensemble" else f"{before}'s answer -> {model}'s request (ensemble)"
    if what == "start":
        return f"{model}: queue, until its execute starts"
    if what == "inputs":
        return f"{model}: inputs to its stub"
    if what == "answer":
        return stub_label(model)
    if b == "response":
        return f"{before}'s answer -> the ensemble's response complete"
    return f"{a} -> {b}"


def stub_label(model: str) -> str:
    """The name spans() gives `model`'s stretch in its stub."""
    return f"{model}: in its stub, until its answer is back"


def off_path(req: RequestTrace, path: list[str]) -> dict[str, float]:
    """Models beside the path: how long (ms) each one's answer came before the path's last model's
    (negative: after it, so it held the response up)."""
    end = req.steps[path[-1]].at("COMPUTE_OUTPUT_START")
    return {m: (end - t.at("COMPUTE_OUTPUT_START")) / 1e6 for m, t in req.steps.items() if m not in path}


def clear(trace_file: Path) -> None:
    """Remove what an earlier server wrote to `trace_file` (the file and its `<file>.<n>`), before a
    server that will write there starts: its traces then stand alone in the folder."""
    trace_file = Path(trace_file)
    for old in [trace_file, *numbered(trace_file)]:
        old.unlink(missing_ok=True)


def numbered(trace_file: Path) -> list[Path]:
    """The files a server writes for `trace_file`, one per traced request: `<file>.<n>`."""
    trace_file = Path(trace_file)
    return [p for p in trace_file.parent.glob(trace_file.name + ".*") if p.suffix[1:].isdigit()]


class Tracer:
    """Turns a server's tracing on for a few requests and reads what it wrote. `client`: a tritonclient
    InferenceServerClient (gRPC or HTTP) of a server started with `trace_file`; `headers`: the admin
    key's header where the trace API is restricted (the launcher's --admin-key)."""

    def __init__(self, client, trace_file: Path, headers: dict | None = None):
        if trace_file is None:
            raise TraceError("the server was started without a trace file (launcher --trace-file): nothing to read")
        self.client, self.file, self.headers = client, Path(trace_file), headers
        self._before: dict[Path, tuple[int, int]] = {}
        self._count = 0

    def _files(self) -> dict[Path, tuple[int, int]]:
        """The trace files there now, each with its modification time and size: a restarted server
        numbers its files from 0 again and writes over the old ones, so a name alone does not tell a
        new trace from an old one."""
        out = {}
        for p in numbered(self.file):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out[p] = (st.st_mtime_ns, st.st_size)
        return out

    def _new(self) -> list[Path]:
        return [p for p, stamp in self._files().items() if self._before.get(p) != stamp]

    def trace(self, count: int) -> None:
        """Trace the next `count` requests, each into a file of its own."""
        self._before, self._count = self._files(), count
        self.client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1",
                                                    "trace_count": str(count), "log_frequency": "1"},
                                          headers=self.headers)

    def stop(self) -> None:
        self.client.update_trace_settings(settings={"trace_level": ["OFF"]}, headers=self.headers)

    def read(self, timeout_s: float = 10.0) -> list[RequestTrace]:
        """The traced requests, once their files are written (the server writes a request's trace when
        it lets the request go, just after the client has its answer)."""
        deadline = time.monotonic() + timeout_s
        while len(new := self._new()) < self._count:
            if time.monotonic() > deadline:
                raise TraceError(f"{len(new)} of {self._count} traced requests written to {self.file}.* "
                                 f"after {timeout_s:.0f} s")
            time.sleep(0.05)
        records = []
        for path in sorted(new, key=lambda p: int(p.suffix[1:])):
            records += self._load(path, deadline)
        return requests(parse(records))

    @staticmethod
    def _load(path: Path, deadline: float) -> list[dict]:
        while True:  # the server may still be writing it
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                if time.monotonic() > deadline:
                    raise TraceError(f"{path} is not complete JSON") from None
                time.sleep(0.05)
