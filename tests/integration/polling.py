"""Our metrics reach the server from each stub's sender thread, up to ModelMetrics.FLUSH_S after the
request: a test that reads them waits for the value instead of reading once."""

import time


def eventually(read, check, timeout_s: float = 10.0, every_s: float = 0.05):
    """read() until check(value) holds; returns that value, or the last one read after timeout_s
    (the caller's assertion then shows it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if check(value) or time.monotonic() > deadline:
            return value
        time.sleep(every_s)
