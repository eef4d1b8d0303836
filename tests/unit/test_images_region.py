"""ImagesRegion without a server: a region that cannot grow (the server refuses the larger one) stays as
it was and usable, and closing it removes it (POSIX shared memory outlives the process otherwise)."""

import contextlib
import os

import numpy as np
import pytest

from clients.kimi_client import ImagesRegion


class _Server:
    def __init__(self):
        self.registered, self.refuse = set(), False

    def register_system_shared_memory(self, name, key, size):
        if self.refuse:
            raise RuntimeError("refused")
        self.registered.add(name)


class _Client:
    """The parts of KimiVisionClient an ImagesRegion uses."""

    def __init__(self):
        self.client = _Server()

    def _h(self):
        return {}

    def explained(self):  # KimiVisionClient adds hints to the server's errors; none here
        return contextlib.nullcontext()

    def unregister(self, name, kind):
        assert kind == "system"
        self.client.registered.remove(name)


def _blobs(*sizes):
    return np.array([bytes([i % 251]) * n for i, n in enumerate(sizes)], dtype=np.object_)


def test_the_region_holds_the_bytes_tritonclient_would_send():
    """The images are written piece by piece; the region must hold what serialize_byte_tensor builds."""
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import serialize_byte_tensor

    blobs = _blobs(10, 0, 300)
    with ImagesRegion(_Client(), capacity=16) as region:  # grows on the way
        size = region.write(blobs)
        expected = serialize_byte_tensor(blobs).item()
        assert size == len(expected)
        assert shm.get_contents_as_numpy(region.handle, np.uint8, [size]).tobytes() == expected


def test_a_refused_growth_leaves_the_region_as_it_was_and_close_removes_it():
    client = _Client()
    region = ImagesRegion(client, capacity=64)
    try:
        _refused_growth(client, region)
    finally:
        region.close()


def _refused_growth(client, region):
    name = region.name
    assert os.path.exists(f"/dev/shm/{name}") and client.client.registered == {name}
    assert region.write(_blobs(10, 20)) == 10 + 20 + 8  # a 4-byte length before each image
    client.client.refuse = True
    with pytest.raises(RuntimeError, match="refused"):
        region.write(_blobs(100))
    assert (region.name, region.capacity) == (name, 64) and client.client.registered == {name}
    assert region.write(_blobs(30)) == 34  # still usable
    client.client.refuse = False
    assert region.write(_blobs(100)) == 104
    assert region.name != name and region.capacity == 128 and client.client.registered == {region.name}
    assert not os.path.exists(f"/dev/shm/{name}")  # the smaller one is gone
    grown = region.name
    region.close()
    region.close()  # twice is fine
    assert client.client.registered == set() and not os.path.exists(f"/dev/shm/{grown}")
    with pytest.raises(ValueError, match="is closed"):
        region.write(_blobs(1))
