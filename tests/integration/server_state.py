"""What integration tests read back from the server: a model's inference count from Triton's statistics,
and values that arrive late. Our metrics reach the server from each stub's sender thread, up to
ModelMetrics.FLUSH_S after the request: a test that reads them waits for the value instead of reading once."""

import time

import tritonclient.grpc as grpcclient


def counts(server, model: str) -> tuple[int, int]:
    """(inferences, executions) of `model` from Triton's statistics: requests executed (Triton counts the
    ones its backend answered with an error too) and the backend calls (batches) that ran them. The
    Python backend reports them after sending its responses, so they can lag the client's answer."""
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        s = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
    finally:
        c.close()
    return int(s.get("inference_count", 0)), int(s.get("execution_count", 0))


def inference_count(server, model: str) -> int:
    return counts(server, model)[0]


def eventually(read, check, timeout_s: float = 10.0, every_s: float = 0.05):
    """read() until check(value) holds; returns that value, or the last one read after timeout_s
    (the caller's assertion then shows it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if check(value) or time.monotonic() > deadline:
            return value
        time.sleep(every_s)
