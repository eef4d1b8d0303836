"""Our metrics, registered with tritonserver from inside each model's stub (pb_utils.MetricFamily) and
served on the metrics port next to Triton's own (the supervisor relays them; deploy/grafana/ charts
them).

- kimi_vision_stub_failures_total{model,kind}: requests our code answered with an error. Private: the
  supervisor folds it into kimi_vision_request_failures_total with the failures our code never sees.
- kimi_vision_rejections_total{model,reason}: bad requests by what was wrong (RequestError.reason).
- kimi_vision_images_total{model}, kimi_vision_patches_total{model}: images and patches preprocessed
  (rate() gives images/s and patches/s).
- kimi_vision_decodes_total{model,path,reason}: images decoded on the GPU, or by Pillow and why.
- kimi_vision_step_seconds{model}: histogram of the time our code spends on a request in each model
  (host time: on a GPU, kernels still running when a step returns finish in Triton's compute output).
- kimi_vision_cache_hits_total{model}, kimi_vision_cache_misses_total{model},
  kimi_vision_cache_evictions_total{model} (media looked up in the embedding cache, and blocks evicted
  to stay in its budget) and the gauge kimi_vision_cache_bytes{model,instance} (the rows it holds), from
  each encoder instance whose cache is on (backends/cache/store.py).

- kimi_vision_nixl_descriptors{model,instance} and kimi_vision_nixl_bytes{model,instance} (gauges: descriptors
  handed out and not yet read or expired, and their rows' bytes in the encoder instance's NIXL arena),
  kimi_vision_nixl_reads_total{model} and kimi_vision_nixl_expired_total{model} (slots freed by their
  reader's notification, and freed unread when their lifetime ended; backends/nixl_export), from each
  encoder instance once a request has asked it for a descriptor.

- kimi_vision_cuda_memory_bytes{model,instance,kind}: on a GPU instance, torch's caching allocator in
  that stub: `allocated` (tensors alive) and `reserved` (held from the driver), set about once a second;
  in moonvit3d also `cached`, the part of `allocated` our bounded caches keep (CUDA graphs' buffers,
  per-grid tables), which grows towards its bounds as new shapes arrive. Allocated minus cached that
  keeps growing is a leak; reserved that grows while allocated does not is the allocator's cache.

They reach the server from a sender thread, at most ModelMetrics.FLUSH_S after the request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from backends.errors import RequestCancelled, RequestError

log = logging.getLogger("kimi_vision")

# Step times waiting for the sender, at most (normally a few dozen: it sends every FLUSH_S). Only a
# sender that cannot send reaches it; then further step times are dropped, never the requests.
MAX_PENDING_OBSERVATIONS = 100_000
STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


def allocator_gauges(stats: dict) -> dict[str, float]:
    """{"allocated", "reserved"} bytes from torch.cuda.memory_stats_as_nested_dict: one read of the
    allocator's counters (memory_allocated and memory_reserved each flatten all of them). Empty stats
    (no CUDA context yet) read as zeros; other missing keys raise, never a silent zero."""
    if not stats:
        return {"allocated": 0.0, "reserved": 0.0}
    return {"allocated": float(stats["allocated_bytes"]["all"]["current"]),
            "reserved": float(stats["reserved_bytes"]["all"]["current"])}


def failure_kind(exc: Exception) -> str:
    if isinstance(exc, RequestError):
        return "invalid_input"
    return "cancelled" if isinstance(exc, RequestCancelled) else "internal"


def _key(family: str, labels: dict) -> tuple:
    """A local sum's key: the metric family and its labels in a fixed order."""
    return family, tuple(sorted(labels.items()))


class ModelMetrics:
    """One model instance's metrics, sent to the server off the request path.

    Each metric update is a blocking round trip from the stub to the server (pb_utils), several per
    request: on the request path they delay every response. So the request path only adds to local
    sums (and notes step times); a daemon thread sends them every FLUSH_S, and `close` sends the rest.
    Counters then cost one round trip per label set per FLUSH_S; each step time still costs one, in the
    thread (which holds the GIL while it waits, docs/triton_runtime.md#host-time-per-step).
    The exported values lag by at most about FLUSH_S, and a stub killed outright loses at most that
    much of its counts (the supervisor counts its death). Every method swallows metric errors: a
    metrics hiccup must never cost a response."""

    FLUSH_S = 0.2
    MEMORY_EVERY_S = 1.0
    CLOSE_WAIT_S = 5.0  # how long close waits for a busy sender, twice at most

    def __init__(self, pb_utils, model: str, flush_s: float | None = None, instance: str = "",
                 memory: Callable[[], dict[str, float]] | None = None):
        """memory, if given (GPU instances): returns {"allocated": bytes, "reserved": bytes} and, for the
        encoder, "cached"; the sender sets the gauges from it every MEMORY_EVERY_S."""
        self.model, self.instance, self.memory = model, instance, memory
        self._memory_sent: dict[str, float] = {}
        self._memory_at = float("-inf")
        self.flush_s = self.FLUSH_S if flush_s is None else flush_s
        self._metrics: dict = {}
        self._families = {}
        self._lock = threading.Lock()  # the sums and observations
        self._sending = threading.Lock()  # one flush at a time (the metric objects are created there)
        self._sums: dict = defaultdict(float)  # (family, labels) -> increment not yet sent
        self._observed: list[float] = []  # step times not yet sent
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched: list = []  # (source, counters, gauges, last sent): the cache, the NIXL export
        kinds = pb_utils.MetricFamily
        for name, kind, description in (
            ("kimi_vision_stub_failures_total", kinds.COUNTER, "Requests our code answered with an error, by model and kind"),
            ("kimi_vision_rejections_total", kinds.COUNTER, "Bad requests refused with INVALID_ARG, by model and reason"),
            ("kimi_vision_images_total", kinds.COUNTER, "Images (video frames count one each) preprocessed"),
            ("kimi_vision_patches_total", kinds.COUNTER, "Patches (14 x 14 pixels) preprocessed"),
            ("kimi_vision_decodes_total", kinds.COUNTER, "Images decoded, by path (gpu, pillow) and why Pillow"),
            ("kimi_vision_step_seconds", getattr(kinds, "HISTOGRAM", None), "Time our code spends on a request, by model"),
            ("kimi_vision_cache_hits_total", kinds.COUNTER, "Media whose embedding rows the cache held"),
            ("kimi_vision_cache_misses_total", kinds.COUNTER, "Media looked up in the embedding cache and encoded"),
            ("kimi_vision_cache_evictions_total", kinds.COUNTER, "Row blocks evicted from the embedding cache"),
            ("kimi_vision_cache_bytes", kinds.GAUGE, "Bytes of embedding rows the cache holds, per encoder instance"),
            ("kimi_vision_nixl_descriptors", kinds.GAUGE, "NIXL descriptors handed out and not yet read or expired"),
            ("kimi_vision_nixl_bytes", kinds.GAUGE, "Bytes of rows waiting in the NIXL arena, per encoder instance"),
            ("kimi_vision_nixl_reads_total", kinds.COUNTER, "NIXL descriptors whose reader notified (slot freed)"),
            ("kimi_vision_nixl_expired_total", kinds.COUNTER, "NIXL descriptors freed unread at the end of their lifetime"),
            ("kimi_vision_cuda_memory_bytes", kinds.GAUGE if memory is not None else None,
             "CUDA memory of torch's caching allocator in one GPU model instance: allocated, reserved, cached"),
        ):
            if kind is None:
                continue
            try:
                self._families[name] = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            except Exception:  # noqa: BLE001 - metrics are optional
                log.warning("%s: metric family %s unavailable", model, name, exc_info=True)
        if memory is not None:
            self._started()  # the memory gauges show from load on, before any request

    # The request path: local sums only.

    def _add(self, family: str, value: float, **labels) -> None:
        if value:
            with self._lock:
                self._sums[_key(family, labels)] += value
            self._started()

    def failure(self, exc: Exception) -> None:
        self._add("kimi_vision_stub_failures_total", 1, kind=failure_kind(exc))
        if isinstance(exc, RequestError):
            self._add("kimi_vision_rejections_total", 1, reason=exc.reason)

    def preprocessed(self, images: int, patches: int) -> None:
        self._add("kimi_vision_images_total", images)
        self._add("kimi_vision_patches_total", patches)

    def decodes(self, counts: dict) -> None:
        for (path, reason), n in counts.items():
            self._add("kimi_vision_decodes_total", n, path=path, reason=reason or "-")

    def watch_cache(self, cache) -> None:
        """Send an embedding cache's counts (backends/cache/store.py) with every flush: the counters as
        they grew, the bytes held as a gauge. None: nothing to watch."""
        self._watch(cache, {kind: f"kimi_vision_cache_{kind}_total" for kind in ("hits", "misses", "evictions")},
                    {"bytes": "kimi_vision_cache_bytes"})

    def watch_nixl(self, export) -> None:
        """Send a NIXL export's counts (backends/nixl_export/arena.py `counts()`) with every flush, from the
        first one on: the gauges as they are, the counters as they grew."""
        self._watch(export, {"reads": "kimi_vision_nixl_reads_total", "expired": "kimi_vision_nixl_expired_total"},
                    {"outstanding": "kimi_vision_nixl_descriptors", "bytes": "kimi_vision_nixl_bytes"})

    def _watch(self, source, counters: dict[str, str], gauges: dict[str, str]) -> None:
        """Send `source.counts()` with every flush: `counters` (kind -> family) as they grew since the last
        send, `gauges` (kind -> family, labelled with the instance) when they changed. None: nothing."""
        if source is None:
            return
        sent = {**{kind: 0 for kind in counters}, **{kind: -1 for kind in gauges}}
        self._watched.append((source, counters, gauges, sent))
        self._started()

    def _send_watched(self) -> None:
        for source, counters, gauges, sent in list(self._watched):
            try:
                self._send_counts(source.counts(), counters, gauges, sent)
            except Exception:  # noqa: BLE001 - one source's failure must not stop the others
                log.exception("%s: could not send the counts of %s", self.model, type(source).__name__)

    def _send_counts(self, now: dict, counters: dict[str, str], gauges: dict[str, str], sent: dict) -> None:
        for kind, family in counters.items():
            # Made at the first flush, at 0: the series exist before the first count.
            metric = self._metric(family, ())
            grown = now[kind] - sent[kind]
            if grown > 0:
                if metric is not None:
                    metric.increment(grown)
                sent[kind] = now[kind]
        for kind, family in gauges.items():
            if now[kind] != sent[kind]:
                metric = self._metric(family, (("instance", self.instance),))
                if metric is not None:
                    metric.set(now[kind])
                sent[kind] = now[kind]

    def step_time(self, seconds: float) -> None:
        with self._lock:
            if len(self._observed) < MAX_PENDING_OBSERVATIONS:  # a stalled sender must not grow memory
                self._observed.append(seconds)
        self._started()

    # The sender.

    def _started(self) -> None:
        if self._thread is not None or self._closed.is_set():
            return
        with self._lock:
            if self._thread is not None:
                return
            thread = threading.Thread(target=self._run, name=f"kimi-metrics-{self.model}", daemon=True)
            try:
                thread.start()
            except Exception:  # noqa: BLE001 - e.g. no thread to be had: tried again on the next request
                log.exception("%s: could not start the metrics sender", self.model)
                return
            self._thread = thread

    def _run(self) -> None:
        while not self._closed.wait(self.flush_s):
            self.flush()
            if self.memory is not None and time.monotonic() - self._memory_at >= self.MEMORY_EVERY_S:
                self._memory_at = time.monotonic()
                self.send_memory()

    def send_memory(self) -> None:
        """Set the CUDA memory gauges (those that changed since they were last set)."""
        try:
            values = self.memory()
            with self._sending:
                for kind, value in values.items():
                    if self._memory_sent.get(kind) != value:
                        metric = self._metric("kimi_vision_cuda_memory_bytes", (("instance", self.instance), ("kind", kind)))
                        if metric is not None:
                            metric.set(value)
                        self._memory_sent[kind] = value
        except Exception:  # noqa: BLE001
            log.exception("%s: could not set the CUDA memory gauges", self.model)

    def _metric(self, family: str, labels: tuple):
        key = (family, labels)
        metric = self._metrics.get(key)
        if metric is None and family in self._families:
            extra = {"buckets": STEP_BUCKETS} if family == "kimi_vision_step_seconds" else {}
            metric = self._metrics[key] = self._families[family].Metric(labels={"model": self.model, **dict(labels)}, **extra)
        return metric

    def flush(self) -> None:
        """Send what the request path has summed since the last flush (the sender thread calls it)."""
        with self._sending:
            self._flush()

    def _flush(self) -> None:
        with self._lock:
            sums, self._sums = self._sums, defaultdict(float)
            observed, self._observed = self._observed, []
        for (family, labels), value in sums.items():
            try:
                metric = self._metric(family, labels)
                if metric is not None:
                    metric.increment(value)
            except Exception:  # noqa: BLE001
                log.exception("%s: could not count %s", self.model, family)
        self._send_watched()
        if observed:
            try:
                metric = self._metric("kimi_vision_step_seconds", ())
                if metric is not None:
                    for seconds in observed:
                        metric.observe(seconds)
            except Exception:  # noqa: BLE001
                log.exception("%s: could not observe the step time", self.model)

    def close(self) -> None:
        """Stop the sender and send the rest (the model's finalize)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=self.CLOSE_WAIT_S)
        # A sender stuck in a round trip to the server holds _sending: unloading must not wait on it.
        if not self._sending.acquire(timeout=self.CLOSE_WAIT_S):
            log.warning("%s: the metrics sender is still busy; counts not yet sent are dropped", self.model)
            return
        try:
            self._flush()
        finally:
            self._sending.release()
