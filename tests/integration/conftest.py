"""One real tritonserver per test session, on free loopback ports, serving the CPU rendering."""

import pytest

from backends.deploy.repository import Deployment
from backends.deploy.launcher import deployment_server
from server_state import wait_ready


@pytest.fixture(scope="session")
def server():
    # A batching window (the default is none): on 2 busy cores, concurrent requests reach the
    # encoder tens of milliseconds apart, and the batching tests need them to meet.
    srv = deployment_server(Deployment(device="cpu", batch_delay_us=50_000), "test")
    with srv:
        yield srv


@pytest.fixture(autouse=True)
def _shared_server_serving(request):
    """Each test that uses the shared server starts with it serving: an earlier test may have left it
    restarting (tritonserver 2.51 can crash as a cancelled request ends; server_state.py), and a test
    that begins meanwhile would fail for that test's sake. Cheap while it is serving."""
    if "server" in request.fixturenames:
        assert wait_ready(request.getfixturevalue("server"), timeout_s=600), "the shared server is not serving"
