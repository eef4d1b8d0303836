"""One real tritonserver per test session, on free loopback ports, serving the CPU rendering."""

import pytest

from backends.deploy.repository import Deployment
from backends.deploy.launcher import BUILD, deployment_server
from clients import tracing
from server_state import down, restarts, unexplained_restarts, wait_ready


@pytest.fixture(scope="session")
def server():
    # A batching window (the default is none): on 2 busy cores, concurrent requests reach the
    # encoder tens of milliseconds apart, and the batching tests need them to meet.
    # A trace file, as the launcher's --trace-file gives one: tracing stays off until test_tracing turns it on.
    trace = BUILD / "trace-test" / "trace.json"
    tracing.clear(trace)
    srv = deployment_server(Deployment(device="cpu", batch_delay_us=50_000), "test", trace_file=trace)
    with srv:
        yield srv


@pytest.fixture(autouse=True)
def _shared_server_serving(request):
    """Each test that uses the shared server starts with it serving (an earlier test may have left it
    restarting) and fails if the server restarted while it ran, save for the known 2.51 crash
    (server_state.unexplained_restarts): a crash or a killed stub must not pass unseen because the
    supervisor healed it. A server that does not come back fails the tests after it at once."""
    if "server" not in request.fixturenames:
        yield
        return
    if down:
        pytest.fail(f"the shared server did not come back earlier ({down[0]})")
    server = request.getfixturevalue("server")
    if not wait_ready(server):
        down.append(f"before {request.node.nodeid}")
        pytest.fail("the shared server is not serving")
    before = restarts(server)
    yield
    what = unexplained_restarts(server, before)
    assert what is None, f"tritonserver restarted during this test: {what}"
