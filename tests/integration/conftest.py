"""One real tritonserver per test session, on free loopback ports, serving the CPU rendering."""

import pytest

from backends.deploy.repository import Deployment
from backends.deploy.launcher import deployment_server
from server_state import restarts, tolerated_exits, wait_ready


@pytest.fixture(scope="session")
def server():
    # A batching window (the default is none): on 2 busy cores, concurrent requests reach the
    # encoder tens of milliseconds apart, and the batching tests need them to meet.
    srv = deployment_server(Deployment(device="cpu", batch_delay_us=50_000), "test")
    with srv:
        yield srv


_down: list[str] = []  # the test before which the shared server did not come back


@pytest.fixture(autouse=True)
def _shared_server_serving(request):
    """Each test that uses the shared server starts with it serving (an earlier test may have left it
    restarting; tritonserver 2.51 can crash as a cancelled request ends, server_state.py) and fails if
    the server restarted while it ran, unless upstream_crash_tolerated explained it: a crash or a killed
    stub must not pass unseen because the supervisor healed it. A server that does not come back fails
    the rest at once instead of each waiting."""
    if "server" not in request.fixturenames:
        yield
        return
    if _down:
        pytest.fail(f"the shared server did not come back before {_down[0]}")
    server = request.getfixturevalue("server")
    if not wait_ready(server):
        _down.append(request.node.nodeid)
        pytest.fail("the shared server is not serving")
    before, explained = restarts(server), tolerated_exits(server)
    yield
    unexplained = restarts(server) - before - (tolerated_exits(server) - explained)
    assert unexplained == 0, (f"tritonserver restarted {unexplained} time(s) during this test; the supervisor "
                              f"kept the log of the server that went: {server.log_path.with_suffix('.previous.log')}")
