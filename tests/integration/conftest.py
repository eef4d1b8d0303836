"""One real tritonserver per test session, on free loopback ports, serving the CPU rendering."""

import pytest

from backends.deploy.repository import Deployment
from backends.deploy.launcher import deployment_server


@pytest.fixture(scope="session")
def server():
    # A batching window (the default is none): on 2 busy cores, concurrent requests reach the
    # encoder tens of milliseconds apart, and the batching tests need them to meet.
    srv = deployment_server(Deployment(device="cpu", batch_delay_us=50_000), "test")
    with srv:
        yield srv
