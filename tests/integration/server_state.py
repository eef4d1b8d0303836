"""What integration tests read back from the server: a model's inference count from Triton's statistics,
and values that arrive late. Our metrics reach the server from each stub's sender thread, up to
ModelMetrics.FLUSH_S after the request: a test that reads them waits for the value instead of reading once."""

import time

import tritonclient.grpc as grpcclient


def inference_count(server, model: str) -> int:
    """Requests `model` has executed (Triton counts the ones its backend answered with an error too)."""
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        s = c.get_inference_statistics(model, as_json=True)["model_stats"][0]
    finally:
        c.close()
    return int(s.get("inference_count", 0))


def eventually(read, check, timeout_s: float = 10.0, every_s: float = 0.05):
    """read() until check(value) holds; returns that value, or the last one read after timeout_s
    (the caller's assertion then shows it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if check(value) or time.monotonic() > deadline:
            return value
        time.sleep(every_s)
