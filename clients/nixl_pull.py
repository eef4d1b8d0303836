"""The consumer's side of the NIXL hand-off: READ a request's embeddings from the vision server into this
process's own memory (a torch tensor on its GPU, or a numpy array), from another host or this one.

    client = KimiVisionClient("vision-host:8001")
    result = client.infer(input_ids, images, nixl=True)     # a descriptor instead of IMAGE_EMBEDS
    puller = NixlPuller()                                    # one per process: its NIXL agent (UCX)
    embeds = puller.pull(result, device="cuda:0")            # torch [rows, hidden] on this GPU; the server frees them

The server keeps the rows until this READ's notification reaches it or the descriptor's lifetime ends
(docs/llm_handoff.md#pulling-the-embeddings-with-nixl); `release` gives them up unread. Needs NIXL
(nixl-cu12 or nixl-cu13 from PyPI: each runs without a GPU too) and numpy; torch only for GPU buffers.
UCX picks its transports itself (CUDA IPC between GPUs of one host, RDMA where there is a NIC, else TCP);
UCX_TLS and UCX_NET_DEVICES steer it, on both sides.
"""

from __future__ import annotations

import os
import secrets
import threading
import time

import numpy as np

from contract.nixl_descriptor import NixlDescriptor, decode, load_nixl_api

# A READ is not started this close to the end of the rows' lifetime: the server may free and reuse the
# slot when it ends, and a read still under way then would copy another request's rows.
EXPIRY_MARGIN_S = 0.5
_NUMPY_DTYPES = {"FP32": np.float32, "BF16": np.uint16, "FP16": np.float16}  # BF16: its bit patterns


class NixlExpired(RuntimeError):
    """The descriptor's lifetime is over (or nearly): the server frees its rows, so they are not read."""


def _torch_dtype(dtype: str):
    import torch

    return {"FP32": torch.float32, "BF16": torch.bfloat16, "FP16": torch.float16}[dtype]


def _buffer(array) -> tuple[int, int, int, str]:
    """(address, bytes, device, NIXL memory kind) of a contiguous numpy array or torch tensor."""
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("the buffer must be C-contiguous")
        return array.ctypes.data, array.nbytes, 0, "DRAM"
    if not array.is_contiguous():
        raise ValueError("the buffer must be contiguous")
    on_gpu = array.device.type == "cuda"
    return (array.data_ptr(), array.numel() * array.element_size(), (array.device.index or 0) if on_gpu else 0,
            "VRAM" if on_gpu else "DRAM")


class NixlPuller:
    """This process's NIXL agent, and the vision servers' agents it has met (each met once)."""

    def __init__(self, name: str | None = None, *, backends=("UCX",)):
        api = load_nixl_api()
        self.name = name or f"kimi-consumer-{os.getpid()}-{secrets.token_hex(4)}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=list(backends)))
        self._remote: dict[str, bytes] = {}  # server agent name -> the metadata it was added with
        self._registered: list[tuple[int, int, object]] = []  # (address, bytes, registration) kept by register()
        self._lock = threading.Lock()  # the agent is made without thread sync: one call into it at a time

    def register(self, buffer) -> None:
        """Register a buffer once (a large numpy array or torch tensor the LLM keeps), so that pulls `into`
        any part of it register nothing per call."""
        addr, nbytes, _, _ = _buffer(buffer)
        with self._lock:
            self._registered.append((addr, nbytes, self._register(buffer)))

    def _register(self, buffer):
        # As (address, bytes, device, "") always: NIXL would take an N x 3 numpy array for a descriptor list.
        addr, nbytes, dev, mem = _buffer(buffer)
        return self.agent.register_memory([(addr, nbytes, dev, "")], mem)

    def _covered(self, addr: int, nbytes: int) -> bool:
        return any(a <= addr and addr + nbytes <= a + n for a, n, _ in self._registered)

    def _remote_agent(self, d: NixlDescriptor) -> str:
        if self._remote.get(d.agent) != d.metadata:
            if d.agent in self._remote:  # the same name with new metadata: forget the old first
                self.agent.remove_remote_agent(d.agent)
            self.agent.add_remote_agent(d.metadata)
            self._remote[d.agent] = d.metadata
        return d.agent

    def pull(self, descriptor, out=None, *, device: str = "cpu", sent_unix_s: float | None = None,
             timeout_s: float = 30.0):
        """The rows `descriptor` names (a VisionResult from infer(nixl=True), the descriptor's bytes or a
        NixlDescriptor), read into `out` (a contiguous numpy array or torch tensor at least as large,
        filled from its start) or into a new buffer on `device` ("cpu": numpy, BF16 as uint16 bit patterns;
        "cuda:N": a torch tensor). Returns (rows, hidden) over that memory; the server frees its copy.

        sent_unix_s: when the request was sent (a VisionResult carries it): the read is then refused from
        sent + lifetime on, whatever the two hosts' clocks say; without it the server's expiry time is
        trusted. NixlExpired where the lifetime is (nearly) over: nothing is read."""
        if sent_unix_s is None:
            sent_unix_s = getattr(descriptor, "sent_unix_s", None)
        d = self._descriptor(descriptor)
        deadline_ms = d.expires_unix_ms if sent_unix_s is None else min(d.expires_unix_ms, sent_unix_s * 1000 + d.lifetime_ms)
        if d.nbytes and time.time() * 1000 > deadline_ms - EXPIRY_MARGIN_S * 1000:
            raise NixlExpired(f"the descriptor's lifetime ({d.lifetime_ms} ms) is over or nearly: its rows are freed "
                              f"on the server; send the request again")
        view = self._destination(d, out, device)
        if not d.nbytes:
            return view
        addr, _, dev, mem = _buffer(view)
        with self._lock:
            reg = None if self._covered(addr, d.nbytes) else self._register(view)
            try:
                remote = self._remote_agent(d)
                local = self.agent.get_xfer_descs([(addr, d.nbytes, dev)], mem)
                source = self.agent.get_xfer_descs([(d.addr, d.nbytes, d.device)], d.mem)
                # The notification goes with the READ: the server gets it once the rows have left.
                handle = self.agent.initialize_xfer("READ", local, source, remote, d.notification())
                try:
                    self._wait(handle, timeout_s)
                finally:
                    handle.release()
            finally:
                if reg is not None:
                    self.agent.deregister_memory(reg)
        return view

    def _wait(self, handle, timeout_s: float) -> None:
        state = self.agent.transfer(handle)
        deadline, pause = time.monotonic() + timeout_s, 0.0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError(f"the NIXL READ did not finish in {timeout_s} s")
            if pause:
                time.sleep(pause)
            pause = min(pause * 2 or 1e-5, 1e-3)  # spin briefly first: most reads finish in well under a millisecond
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"the NIXL READ failed ({state})")

    @staticmethod
    def _descriptor(descriptor) -> NixlDescriptor:
        if isinstance(descriptor, NixlDescriptor):
            return descriptor
        raw = getattr(descriptor, "nixl_descriptor", descriptor)
        if raw is None:
            raise ValueError("no NIXL descriptor: make the request with infer(..., nixl=True)")
        return decode(raw)

    @staticmethod
    def _destination(d: NixlDescriptor, out, device: str):
        if out is None:
            if device == "cpu":
                return np.empty(d.shape, dtype=_NUMPY_DTYPES[d.dtype])
            import torch

            return torch.empty(d.shape, dtype=_torch_dtype(d.dtype), device=device)
        _, nbytes, _, _ = _buffer(out)
        if nbytes < d.nbytes:
            raise ValueError(f"the buffer holds {nbytes} bytes, the rows are {d.nbytes}")
        if isinstance(out, np.ndarray):
            return out.reshape(-1).view(np.uint8)[:d.nbytes].view(_NUMPY_DTYPES[d.dtype]).reshape(d.shape)
        import torch

        return out.reshape(-1).view(torch.uint8)[:d.nbytes].view(_torch_dtype(d.dtype)).view(d.shape)

    def release(self, descriptor) -> None:
        """Give the rows up unread: the server frees them now instead of at the end of their lifetime."""
        d = self._descriptor(descriptor)
        if d.nbytes:
            with self._lock:
                self.agent.send_notif(self._remote_agent(d), d.notification())

    def close(self) -> None:
        with self._lock:
            for _, _, reg in self._registered:
                self.agent.deregister_memory(reg)
            self._registered = []
            for name in self._remote:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
            self._remote = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
