"""Only what should be reachable is: behind --admin-key the shared-memory API answers only requests
carrying the key (inference stays open), and the rendered repository is writable by its owner only."""

import os
import stat

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from backends.deploy.launcher import Ports, TritonInstall, deployment_server, tritonserver_command
from backends.deploy.repository import Deployment, render_repository
from clients.kimi_client import KimiVisionClient, chat_prompt_ids
from clients.samples import encode, photo_like

KEY = "kimi-admin=not-a-real-secret"


@pytest.fixture(scope="module")
def locked_server():
    from backends.deploy.launcher import BUILD
    from clients import tracing

    trace = BUILD / "trace-admin-key" / "trace.json"
    tracing.clear(trace)
    with deployment_server(Deployment(), "admin-key", admin_key=KEY, trace_file=trace) as srv:
        yield srv


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_shared_memory_needs_the_key_and_inference_does_not(locked_server, protocol):
    url = locked_server.grpc_url if protocol == "grpc" else locked_server.http_url
    blobs = [encode(photo_like(96, 64, seed=3), "PNG")]
    anonymous = KimiVisionClient(url, protocol=protocol)
    admin = KimiVisionClient(url, protocol=protocol, admin_key=KEY)
    try:
        plain = anonymous.infer(chat_prompt_ids(1), blobs)  # inference is not restricted
        with pytest.raises(InferenceServerException, match="is restricted, expecting header"):
            anonymous.infer(chat_prompt_ids(1), blobs, shm="system")
        via_shm = admin.infer(chat_prompt_ids(1), blobs, shm="system")
        np.testing.assert_array_equal(via_shm.image_embeds, plain.image_embeds)
    finally:
        anonymous.close()
        admin.close()  # releases its pooled regions, with the key
    watcher = KimiVisionClient(url, protocol=protocol, admin_key=KEY)
    try:
        status = watcher.client.get_system_shared_memory_status(**watcher._h())
        assert list(status if isinstance(status, list) else status.regions) == []  # nothing left registered
    finally:
        watcher.close()


def test_the_command_line_client_sends_the_key(locked_server, tmp_path, capsys, monkeypatch):
    from clients import infer

    image = tmp_path / "a.png"
    image.write_bytes(encode(photo_like(96, 64, seed=3), "PNG"))
    args = ["--image", str(image), "--url", locked_server.grpc_url, "--shm", "system"]
    monkeypatch.delenv("KIMI_ADMIN_KEY", raising=False)
    assert infer.main(args) == 1 and "request failed:" in capsys.readouterr().err  # no key: refused
    assert infer.main([*args, "--admin-key", KEY, "--output-capacity-mib", "8"]) == 0
    assert "image embeds: shape" in capsys.readouterr().out
    monkeypatch.setenv("KIMI_ADMIN_KEY", KEY)
    assert infer.main(args) == 0


def test_the_key_restricts_the_admin_apis_over_both_protocols():
    cmd = tritonserver_command(TritonInstall("/bin/tritonserver", "/backends"), "/repo", Ports(),
                               cuda_pools={}, admin_key=KEY)
    assert f"--http-restricted-api=shared-memory,logging,trace:{KEY}" in cmd
    assert f"--grpc-restricted-protocol=shared-memory,logging,trace:{KEY}" in cmd
    assert "--model-control-mode=explicit" in cmd  # reloads by the supervisor, behind a key of its own
    # Loading runs code: the admin key, which clients hold for shared memory, never opens it.
    assert not any(c.startswith("--http-restricted-api=model-repository") and c.endswith(KEY) for c in cmd)
    assert sum(c.startswith("--http-restricted-api=model-repository:kimi-reload=") for c in cmd) == 1


def test_without_a_key_the_model_repository_api_is_the_supervisors_alone():
    """Explicit model control lets the supervisor reload a model whose stub died; the API is never open:
    it asks for a key of the launcher's own (or nobody's, where no key was given)."""
    inst = TritonInstall("/bin/tritonserver", "/backends")
    for kwargs in ({"reload_key": "kimi-reload=abc"}, {}):
        cmd = tritonserver_command(inst, "/repo", Ports(), cuda_pools={}, **kwargs)
        http = [c for c in cmd if c.startswith("--http-restricted-api=model-repository:kimi-reload=")]
        grpc = [c for c in cmd if c.startswith("--grpc-restricted-protocol=model-repository:kimi-reload=")]
        assert len(http) == 1 and len(grpc) == 1, cmd
        if kwargs:
            assert http[0].endswith(":kimi-reload=abc") and grpc[0].endswith(":kimi-reload=abc")


def test_a_load_without_the_key_is_refused(server):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{server.http_url}/v2/repository/models/moonvit3d/load", data=b"{}",
                                     method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert "restricted" in refused.value.read().decode()


def test_rendered_repository_is_writable_by_its_owner_only(tmp_path):
    old = os.umask(0)  # even a permissive umask
    try:
        repo = render_repository(Deployment(), tmp_path / "repo")
    finally:
        os.umask(old)
    for path in [repo, *repo.rglob("*")]:
        mode = path.stat().st_mode
        assert not mode & (stat.S_IWGRP | stat.S_IWOTH), f"{path} is writable by others ({oct(mode)})"


def test_an_http_client_with_the_key_sends_a_shared_memory_request_after_a_plain_one(locked_server):
    """tritonclient.http writes the JSON header length of a request with binary data into the headers
    dict it is handed, and sets none for a request whose inputs are all in shared memory. A client that
    handed it its own dict sent the plain request's length with the shared-memory one, whose JSON the
    server then cut short ("failed to parse the request JSON buffer")."""
    admin = KimiVisionClient(locked_server.http_url, protocol="http", admin_key=KEY)
    blobs = [encode(photo_like(64, 48, seed=1), "PNG")]
    try:
        plain = admin.infer(chat_prompt_ids(1), blobs)
        via_shm = admin.infer(chat_prompt_ids(1), blobs, shm="system", output_capacity=8 << 20)
        np.testing.assert_array_equal(via_shm.image_embeds, plain.image_embeds)
    finally:
        admin.close()


def test_the_trace_api_needs_the_key_which_the_tracer_sends(locked_server):
    """Tracing is one of the restricted APIs: a Tracer without the key is refused, one given the admin
    client's header turns tracing on, and the traced request comes back from the server's file."""
    from clients.tracing import Tracer

    admin = KimiVisionClient(locked_server.grpc_url, admin_key=KEY)
    try:
        with pytest.raises(InferenceServerException, match="is restricted, expecting header"):
            Tracer(admin.client, locked_server.trace_file).trace(1)
        tracer = Tracer(admin.client, locked_server.trace_file, headers=admin._h()["headers"])
        tracer.trace(1)
        try:
            admin.infer(chat_prompt_ids(1), [encode(photo_like(96, 64, seed=4), "PNG")])
            traced = tracer.read()
        finally:
            tracer.stop()
        assert len(traced) == 1 and traced[0].root.model == "kimi_k25_vision"
    finally:
        admin.close()


def test_a_refusal_for_want_of_the_key_says_how_to_give_it(locked_server):
    client = KimiVisionClient(locked_server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="admin_key=.*--admin-key"):
            client.infer(chat_prompt_ids(1), [encode(photo_like(32, 32, seed=4), "PNG")], shm="system")
    finally:
        client.close()
