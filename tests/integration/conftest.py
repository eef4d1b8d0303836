"""One real tritonserver per test session, on free loopback ports, serving the CPU rendering."""

import pytest

from backends.deploy.repository import Deployment, render_repository
from backends.deploy.server import BUILD, TritonServer, free_port


@pytest.fixture(scope="session")
def server():
    # A longer batching window than the 2 ms default: on 2 busy cores, concurrent requests reach the
    # encoder tens of milliseconds apart, and the batching tests need them to meet.
    repo = render_repository(Deployment(device="cpu", batch_delay_us=50_000), BUILD / "model_repository-test")
    srv = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       log_path=BUILD / "tritonserver-test.log")
    with srv:
        yield srv
