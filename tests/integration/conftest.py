"""One real tritonserver per test session, on free loopback ports, serving the CPU rendering."""

import pytest

from backends.deploy.repository import Deployment, render_repository
from backends.deploy.server import BUILD, TritonServer, free_port


@pytest.fixture(scope="session")
def server():
    repo = render_repository(Deployment(device="cpu"), BUILD / "model_repository-test")
    srv = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       log_path=BUILD / "tritonserver-test.log")
    with srv:
        yield srv
