"""Answer a batch after `execute` has returned: the encoder's GPU work overlaps the next request.

In tritonserver 2.51 a Python model that returns its responses from `execute` keeps its instance busy
until the GPU outputs are copied out: the server asks the stub for the output buffers only after
`execute` returns, and that copy waits for the encoder's kernels. Meanwhile the next request cannot
enter the stub, so the GPU idles for that request's input transfer and host work (about 2 ms per
request at 1024^2, docs/triton_runtime.md#answering-after-execute-returns).

Since 24.06 a model in default (non-decoupled) mode may instead send each request's one response
through `request.get_response_sender()` and return None for it. `Responder` is the thread that does
so: `execute` launches the work, hands over a `wait` (e.g. a CUDA event's synchronize) and one send
per request, and returns; the thread waits, then sends. `max_pending` bounds how many handed-over
batches may wait at once, so a busy server queues requests in Triton (where the dynamic batcher
and the queue policy see them), not here.

Pure Python: the unit tests drive it with plain callables, the integration tests through
tritonserver (where every moonvit3d response goes this way).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger("kimi_vision")

# A send gets the exception of the batch's wait (None when the outputs are ready) and must answer
# its request either way: with the outputs, or with an error naming what failed.
Send = Callable[[BaseException | None], None]


class Responder:
    def __init__(self, max_pending: int = 1, name: str = "responder", on_start: Callable[[], None] | None = None):
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self._queue: queue.Queue = queue.Queue()
        self._room = threading.BoundedSemaphore(max_pending)
        self._closed = False
        self._lock = threading.Lock()
        self._on_start = on_start
        self.sent = 0
        self.failed_sends = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, wait: Callable[[], None] | None, sends: Sequence[Send]) -> None:
        """Queue one batch; blocks while `max_pending` batches are still waiting or sending."""
        with self._lock:
            if self._closed:
                raise RuntimeError("responder is closed")
        self._room.acquire()
        self._queue.put((wait, list(sends)))

    def close(self, timeout: float | None = 60.0) -> None:
        """Answer everything already submitted, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("responder: batches still unanswered after %.0f s at close", timeout)

    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception:  # noqa: BLE001 - the sends below still run; they report their own errors
                log.exception("responder: start-up hook failed")
        while True:
            item = self._queue.get()
            if item is None:
                return
            wait, sends = item
            error: BaseException | None = None
            if wait is not None:
                try:
                    wait()
                except BaseException as exc:  # noqa: BLE001 - reported to every request of the batch
                    log.error("responder: waiting for a batch failed: %s: %s", type(exc).__name__, exc)
                    error = exc
            for send in sends:
                try:
                    send(error)
                    self.sent += 1
                except Exception:  # noqa: BLE001 - one request's failed send must not stop the others
                    self.failed_sends += 1
                    log.exception("responder: sending a response failed")
            del sends, wait, item  # the outputs are freed before the next batch is admitted
            self._room.release()
