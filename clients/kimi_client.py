"""A small client for the `kimi_k25_vision` ensemble over gRPC or HTTP, with optional shared memory.

    client = KimiVisionClient("127.0.0.1:8001", protocol="grpc")
    result = client.infer(input_ids, [open("a.jpg", "rb").read()])
    result.image_embeds  # (sum of IMAGE_TOKEN_COUNTS, text_hidden), rows in prompt order

Shared memory: `shm="system"` puts the images and IMAGE_EMBEDS in POSIX shared-memory regions registered
with the server (same host); `shm="cuda"` writes IMAGE_EMBEDS straight into a CUDA buffer this process
owns (the co-located LLM reads it without a host copy) and is available where a GPU is. Both take their
regions from the client's pool: registered at the first request, grown on demand, reused by the next
ones, released by `close()`;
`infer_into(CudaOutputRegion(client, capacity), ...)` keeps one such buffer registered across requests,
and `images_region=ImagesRegion(client)` does the same for the encoded images on the way in (`infer`
takes it too): a co-located client then sends no image bytes through gRPC or HTTP.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import contract
from contract import MEDIA_PAD, OUTPUTS  # noqa: F401 - MEDIA_PAD re-exported for callers

MODEL = contract.ENSEMBLE
BATCHED_MODEL = contract.BATCHED_ENSEMBLE
# Outputs that need the images' headers only (kimi_placeholder answers them without decoding).
HEADER_OUTPUTS = (contract.EXPANDED_IDS, contract.IMAGE_TOKEN_COUNTS)


@dataclass
class VisionResult:
    """What came back; an output the request did not ask for is None."""

    expanded_ids: np.ndarray | None  # (L',) int64
    # (tokens, text_hidden): float32 (BF16 widened exactly) by default; with the client's
    # embeds_dtype="bf16", a BF16 output comes as uint16 holding the BF16 bit patterns (no widening,
    # half the bytes; embeds_torch() views it as torch.bfloat16). None from infer_into.
    image_embeds: np.ndarray | None
    grid_thws: np.ndarray | None  # (M, 3) int64
    token_counts: np.ndarray | None  # (M,) int64
    cuda_embeds: object = None  # torch tensor on the GPU with shm="cuda" and from infer_into
    # infer(nixl=True): IMAGE_EMBEDS_NIXL's bytes, for clients/nixl_pull.py (image_embeds is None), and when
    # the request was sent (the read is refused from then + the descriptor's lifetime on).
    nixl_descriptor: bytes | None = None
    sent_unix_s: float | None = None

    def embeds_float32(self) -> np.ndarray:
        """image_embeds as float32 (BF16 bit patterns widened exactly)."""
        e = self.image_embeds
        if e.dtype == np.uint16:
            return (e.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(e, dtype=np.float32)

    def embeds_torch(self):
        """image_embeds as a torch tensor without a copy: torch.bfloat16 for BF16 bit patterns (uint16),
        else the array's own dtype. From the gRPC/HTTP response it is a read-only view of the response's
        bytes (torch warns once): .clone() it before writing into it."""
        import torch

        t = torch.from_numpy(np.ascontiguousarray(self.image_embeds))
        return t.view(torch.bfloat16) if self.image_embeds.dtype == np.uint16 else t

    def checksum(self) -> str:
        """sha256 prefix over the embeddings' float32 bytes: equal results give equal checksums."""
        return hashlib.sha256(np.ascontiguousarray(self.embeds_float32()).tobytes()).hexdigest()[:16]

    def summary(self) -> str:
        lines = []
        if self.expanded_ids is not None:
            lines.append(f"expanded length: {self.expanded_ids.shape[0]} ids")
        if self.grid_thws is not None and self.token_counts is not None:
            for i, (grid, n) in enumerate(zip(self.grid_thws.tolist(), self.token_counts.tolist())):
                kind = "image" if grid[0] == 1 else f"video chunk ({grid[0]} frames)"
                lines.append(f"media {i} ({kind}): grid_thw {tuple(grid)} -> {n} tokens")
        if self.image_embeds is not None:
            e = self.embeds_float32()
            lines.append(f"image embeds: shape {tuple(e.shape)} {e.dtype}, sum {float(e.sum(dtype=np.float64)):.6f}, "
                         f"sha256 {self.checksum()}")
        return "\n".join(lines)


def chat_prompt_ids(num_images: int, text_ids: Sequence[int] = (1, 2, 3)) -> np.ndarray:
    """contract.chat_prompt_ids as an int64 array."""
    return np.asarray(contract.chat_prompt_ids(num_images, text_ids), dtype=np.int64)


def _bytes_tensor(images: Sequence[bytes]) -> np.ndarray:
    return np.array(list(images), dtype=np.object_).reshape(-1)


# tritonserver answers an unregister that comes right after an infer that used the region with "it is
# currently in use" about one time in ten (the response still holds it for a moment): retry, for this
# long, and never leave a region registered silently (docs/triton_runtime.md#known-server-limitations).
UNREGISTER_RETRY_S = 10.0


class KimiVisionClient:
    def __init__(self, url: str, protocol: str = "grpc", model: str | None = None, batched: bool = False,
                 admin_key: str = "", embeds_dtype: str = "float32"):
        """batched=True talks to kimi_k25_vision_batched (cross-request batching on the server). Requests
        for EXPANDED_IDS and/or IMAGE_TOKEN_COUNTS alone go to kimi_placeholder(_batched), which reads
        only the images' headers, unless `model` names the model to ask.
        admin_key "<header>=<value>": the key of a server whose shared-memory API is restricted
        (`--admin-key` of the launcher); sent as that HTTP header, or over gRPC as the metadata
        `triton-grpc-protocol-<header>`, which is how tritonserver reads it there.
        embeds_dtype: how a BF16 IMAGE_EMBEDS (the GPU deployment's) comes back on the host: "float32"
        (widened exactly; twice the bytes) or "bf16" (uint16 arrays of the BF16 bit patterns, taken from
        the response without a copy; VisionResult.embeds_torch() gives torch.bfloat16). FP32 outputs
        (the CPU deployment's) are float32 either way."""
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
        if embeds_dtype not in ("float32", "bf16"):
            raise ValueError(f"embeds_dtype must be 'float32' or 'bf16', got {embeds_dtype!r}")
        self.embeds_dtype = embeds_dtype
        self.url, self.protocol, self.batched = url, protocol, batched
        # Shared-memory regions kept across requests (infer with shm="system" / "cuda"), released by close().
        self._pool: dict[str, list] = {"system": [], "cuda": []}
        self._pool_lock = threading.Lock()
        self._embeds_row: int | None = None  # bytes per IMAGE_EMBEDS row, from the model config once
        self.model = model or (BATCHED_MODEL if batched else MODEL)
        # Ids and counts alone go to kimi_placeholder (headers only) unless a model was named.
        self.header_model = None if model else (contract.PLACEHOLDER_BATCHED if batched else contract.PLACEHOLDER)
        self.headers = {}
        if admin_key:
            header, _, value = admin_key.partition("=")
            # gRPC metadata keys are lower case (HTTP headers are case-insensitive anyway).
            header = header.strip().lower()
            self.headers[header if protocol == "http" else f"triton-grpc-protocol-{header}"] = value
        if protocol == "grpc":
            import tritonclient.grpc as tc
        else:
            import tritonclient.http as tc
        self.tc = tc
        self.client = tc.InferenceServerClient(url)

    def close(self):
        """Release the pooled shared-memory regions (unregistered, removed), then the connection."""
        try:
            with self._pool_lock:  # an item is a region, or a tuple of them (shm="system": images, embeddings)
                pooled = [r for items in self._pool.values() for item in items
                          for r in (item if isinstance(item, tuple) else (item,))]
                self._pool = {"system": [], "cuda": []}
            errors = []
            for region in pooled:
                try:
                    region.close()
                except Exception as exc:  # noqa: BLE001 - release the rest
                    errors.append(exc)
            if errors:
                raise errors[0]
        finally:
            self.client.close()

    @contextlib.contextmanager
    def _pooled(self, kind: str, make):
        """A region (or regions) of `kind` from this client's pool, made by `make()` when none is free, and
        back into the pool afterwards: a client that sends many requests through shared memory registers
        its regions once. One request at a time holds a pooled region; concurrent requests on one client
        each get their own."""
        with self._pool_lock:
            item = self._pool[kind].pop() if self._pool[kind] else None
        if item is None:
            item = make()
        try:
            yield item
        finally:
            with self._pool_lock:
                self._pool[kind].append(item)

    @contextlib.contextmanager
    def explained(self):
        """The server's error, with what to do about it where the message alone would leave a user guessing
        (a restricted API, a model name, the other protocol's port); the same exception type."""
        from tritonclient.utils import InferenceServerException

        try:
            yield
        except InferenceServerException as exc:
            hint = self._hint(exc.message() or str(exc))
            if hint is None:
                raise
            raise InferenceServerException(f"{exc.message()}; {hint}", exc.status(), exc.debug_details()) from None

    def _hint(self, message: str) -> str | None:
        if "is restricted, expecting header" in message and not self.headers:
            return ("the server guards this API with a key: KimiVisionClient(url, admin_key='<header>=<value>'), "
                    "the CLI's --admin-key or KIMI_ADMIN_KEY (the launcher's --admin-key)")
        if "unknown model" in message.lower():
            return (f"this client asks '{self.model}'; the service's ensembles are {contract.ENSEMBLE} and "
                    f"{contract.BATCHED_ENSEMBLE} (KimiVisionClient(url, batched=True))")
        if any(s in message for s in ("Socket closed", "failed to connect", "Connection refused", "Broken pipe",
                                       "Connection reset")):
            port, other = ("gRPC", "HTTP") if self.protocol == "grpc" else ("HTTP", "gRPC")
            return (f"is {self.url} the server's {port} port? (by default 8001 is gRPC and 8000 HTTP; "
                    f"protocol='{other.lower()}' for the other)")
        return None

    def infer(self, input_ids, images: Sequence[bytes], *, media_frames: Sequence[int] | None = None,
              shm: str = "none", output_capacity: int = 256 << 20, timeout_s: float | None = None,
              outputs: Sequence[str] = OUTPUTS, images_region: "ImagesRegion | None" = None,
              nixl: bool = False) -> VisionResult:
        """One request through the ensemble (ids and counts alone: through kimi_placeholder).

        media_frames: None when every image is a still image; else one entry per media in prompt
        order, 0 for an image and t (1..4) for a video chunk whose t frames are the next t images.
        outputs: the ensemble outputs to ask for (any non-empty subset of contract.OUTPUTS); the
        others come back as None and the server skips the steps only they need. Ids and counts alone
        are asked of kimi_placeholder, which reads only the images' headers.
        output_capacity bounds IMAGE_EMBEDS in the shared-memory modes, in bytes (256 MiB: ~9k FP32 rows
        of the real model's 7168); embeds_bytes gives a request's exact need, at the cost of one more
        request (to kimi_placeholder, with the images' bytes). timeout_s applies to gRPC (a deadline: the
        server drops the request's remaining work); an HTTP client's timeouts are set on
        tritonclient.http.InferenceServerClient.
        images_region: an ImagesRegion (registered once) to carry the images instead of the request body,
        with shm "none" or "cuda" (shm "system" puts the images into a region of its own, from the
        client's pool, and refuses one).
        nixl: instead of IMAGE_EMBEDS, a descriptor of where the server holds them (`nixl_descriptor`), for
        a consumer to READ with NIXL (clients/nixl_pull.py), on this host or another; with shm "none".
        """
        ids, blobs, frames = _request_arrays(input_ids, images, media_frames)
        wanted = _check_outputs(outputs)
        if nixl:
            if shm != "none" or contract.IMAGE_EMBEDS not in wanted:
                raise ValueError('nixl=True hands IMAGE_EMBEDS over by NIXL: ask for IMAGE_EMBEDS, with shm="none"')
            return self._infer_nixl(ids, blobs, frames, timeout_s, wanted, images_region)
        if shm == "none":
            return self._infer_plain(ids, blobs, frames, timeout_s, wanted, images_region)
        if shm == "system":
            if images_region is not None:
                raise ValueError('shm="system" puts the images into a region of its own (from the client\'s pool): '
                                 'pass images_region with shm="none" or "cuda"')
            return self._infer_system_shm(ids, blobs, frames, output_capacity, timeout_s, wanted)
        if shm == "cuda":
            return self._infer_cuda_shm(ids, blobs, frames, output_capacity, timeout_s, wanted, images_region)
        raise ValueError(f"shm must be 'none', 'system' or 'cuda', got {shm!r}")

    def infer_into(self, region: "CudaOutputRegion", input_ids, images: Sequence[bytes], *,
                   media_frames: Sequence[int] | None = None, timeout_s: float | None = None,
                   outputs: Sequence[str] = OUTPUTS, images_region: "ImagesRegion | None" = None) -> VisionResult:
        """One request whose IMAGE_EMBEDS the server writes into `region`, a CUDA buffer registered once
        (what a co-located LLM does: no allocation, registration or copy per request). The result's
        `cuda_embeds` is a view into the region, valid until the next request into it; `image_embeds`
        is None (nothing is copied to the host). With `images_region` the images go in through that
        registered host region instead of the request body."""
        ids, blobs, frames = _request_arrays(input_ids, images, media_frames)
        return self._infer_into(region, ids, blobs, frames, timeout_s, _check_outputs(outputs), images_region)

    def embeds_bytes(self, input_ids, images: Sequence[bytes], *, media_frames: Sequence[int] | None = None,
                     timeout_s: float | None = None) -> int:
        """Bytes this request's IMAGE_EMBEDS will take: its token counts (asked of kimi_placeholder,
        which reads only the images' headers; of `model` itself for a client made with one) times the
        row width and element size the model config gives. What a shared-memory region for it needs; a
        request the server refuses raises here already."""
        counts = self.infer(input_ids, images, media_frames=media_frames, outputs=[contract.IMAGE_TOKEN_COUNTS],
                            timeout_s=timeout_s).token_counts
        if self._embeds_row is None:
            config = self.client.get_model_config(self.model, as_json=True, **self._h()) if self.protocol == "grpc" \
                else self.client.get_model_config(self.model, **self._h())
            config = config.get("config", config)
            (out,) = [o for o in config["output"] if o["name"] == contract.IMAGE_EMBEDS]
            width = int(out["dims"][-1])
            self._embeds_row = width * contract.DTYPE_BYTES[out["data_type"]]
        return int(np.sum(counts)) * self._embeds_row

    def _shape(self, array: np.ndarray) -> list[int]:
        return ([1] if self.batched else []) + list(array.shape)

    def _batch(self, array: np.ndarray) -> np.ndarray:
        return array[None] if self.batched else array

    def _output(self, result, name: str) -> np.ndarray:
        array = result.as_numpy(name)
        if array.dtype.name == "bfloat16":
            # tritonclient returns BF16 as ml_dtypes.bfloat16 (a view of the response), which
            # torch.from_numpy and much else refuse: its bits as uint16 (no copy), or widened exactly.
            array = array.view(np.uint16) if self.embeds_dtype == "bf16" else array.astype(np.float32)
        return array[0] if self.batched else array

    def _result(self, r, wanted, **given) -> VisionResult:
        fields = {contract.EXPANDED_IDS: "expanded_ids", contract.IMAGE_EMBEDS: "image_embeds",
                  contract.GRID_THWS: "grid_thws", contract.IMAGE_TOKEN_COUNTS: "token_counts"}
        values = {field: (self._output(r, name) if name in wanted else None) for name, field in fields.items()}
        values.update(given)
        return VisionResult(**values)

    def _inputs(self, ids, blobs):
        a = self.tc.InferInput(contract.INPUT_IDS, self._shape(ids), "INT64")
        b = self.tc.InferInput(contract.IMAGES, self._shape(blobs), "BYTES")
        return a, b

    def _filled(self, ids, blobs, images_region: "ImagesRegion | None"):
        """INPUT_IDS and IMAGES with their data: the images in the request body, or written into
        `images_region` (a request without images has nothing to put there)."""
        a, b = self._inputs(ids, blobs)
        a.set_data_from_numpy(self._batch(ids))
        if images_region is None or not blobs.size:
            b.set_data_from_numpy(self._batch(blobs))
        else:
            if images_region.client is not self:
                raise ValueError("images_region belongs to another client (it is registered with that client's server)")
            size = images_region.write(blobs)  # first: a request that does not fit replaces the region (and its name)
            b.set_shared_memory(images_region.name, size)
        return a, b

    def _call(self, inputs, frames, outputs, timeout_s, parameters=None):
        if frames is not None:
            f = self.tc.InferInput(contract.MEDIA_FRAMES, self._shape(frames), "INT64")
            f.set_data_from_numpy(self._batch(frames))
            inputs = [*inputs, f]
        kwargs = {"client_timeout": timeout_s} if (timeout_s and self.protocol == "grpc") else {}
        parameters = dict(parameters or {})
        if timeout_s:  # every step sees when we stop waiting, and stops then (contract.DEADLINE_PARAMETER)
            parameters[contract.DEADLINE_PARAMETER] = int((time.time() + timeout_s) * 1000)
        if parameters:
            kwargs["parameters"] = parameters
        if self.headers:
            # A copy: tritonclient.http writes a request's Inference-Header-Content-Length into the dict it
            # is given (and sets none when every input is in shared memory): a stale length would cut
            # the next request's JSON short.
            kwargs["headers"] = dict(self.headers)
        with self.explained():
            return self.client.infer(self._model_for([o.name() for o in outputs]), inputs, outputs=outputs, **kwargs)

    def _model_for(self, wanted: Sequence[str]) -> str:
        """Ids and counts alone come from kimi_placeholder, which reads only the images' headers; in the
        ensemble they come after preprocessing (which checks the prompt, then decodes). A client made
        with an explicit `model` always asks that model."""
        if self.header_model is not None and set(wanted) <= set(HEADER_OUTPUTS):
            return self.header_model
        return self.model

    def _requested(self, wanted):
        return [self.tc.InferRequestedOutput(n) for n in wanted]

    def _infer_plain(self, ids, blobs, frames, timeout_s, wanted, images_region=None):
        a, b = self._filled(ids, blobs, images_region)
        r = self._call([a, b], frames, self._requested(wanted), timeout_s)
        return self._result(r, wanted)

    def _infer_nixl(self, ids, blobs, frames, timeout_s, wanted, images_region=None):
        """IMAGE_EMBEDS_NIXL in place of IMAGE_EMBEDS: the request parameter asks the encoder for it
        (contract.NIXL_PARAMETER), and the rows stay on the server until a consumer reads them."""
        a, b = self._filled(ids, blobs, images_region)
        others = [n for n in wanted if n != contract.IMAGE_EMBEDS]
        sent = time.time()
        r = self._call([a, b], frames, self._requested([*others, contract.IMAGE_EMBEDS_NIXL]), timeout_s,
                       {contract.NIXL_PARAMETER: True})
        raw = r.as_numpy(contract.IMAGE_EMBEDS_NIXL)
        if raw is None:  # a server that predates the output, or whose encoder left it out
            raise RuntimeError(f"the server sent no {contract.IMAGE_EMBEDS_NIXL}: it does not hand out NIXL descriptors")
        raw = raw[0] if self.batched else raw
        return self._result(r, others, image_embeds=None, nixl_descriptor=raw.tobytes(), sent_unix_s=sent)

    def _system_pair(self, capacity: int):
        """The images region and the output region, made together; the first is released if the second
        cannot be registered, so a failed registration leaves nothing behind on the server."""
        images = ImagesRegion(self)
        try:
            return images, SystemOutputRegion(self, capacity)
        except BaseException:
            images.close()
            raise

    def _infer_system_shm(self, ids, blobs, frames, capacity, timeout_s, wanted):
        """The images and IMAGE_EMBEDS through two POSIX regions of this client's pool (registered once,
        grown on demand), the embeddings copied out of their region."""
        with self._pooled("system", lambda: self._system_pair(capacity)) as (images, out):
            a, b = self._filled(ids, blobs, images)
            requested = self._requested(wanted)
            if contract.IMAGE_EMBEDS in wanted:
                out.grow_to(capacity)
                requested[wanted.index(contract.IMAGE_EMBEDS)].set_shared_memory(out.name, capacity)
            r = self._call([a, b], frames, requested, timeout_s)
            embeds = out.read(r, self.batched, self.embeds_dtype) if contract.IMAGE_EMBEDS in wanted else None
            return self._result(r, [n for n in wanted if n != contract.IMAGE_EMBEDS], image_embeds=embeds)

    def _infer_cuda_shm(self, ids, blobs, frames, capacity, timeout_s, wanted, images_region=None):
        if contract.IMAGE_EMBEDS not in wanted:  # nothing would go into the region
            return self._infer_plain(ids, blobs, frames, timeout_s, wanted, images_region)
        with self._pooled("cuda", lambda: CudaOutputRegion(self, capacity)) as region:
            region.grow_to(capacity)
            result = self._infer_into(region, ids, blobs, frames, timeout_s, wanted, images_region)
            embeds_gpu = result.cuda_embeds.clone()  # one device-to-device copy: the region is written again
            import torch

            if embeds_gpu.dtype == torch.bfloat16 and self.embeds_dtype == "bf16":
                host = embeds_gpu.view(torch.int16).cpu().numpy().view(np.uint16)
            else:
                host = embeds_gpu.float().cpu().numpy()
            result.cuda_embeds, result.image_embeds = embeds_gpu, host
            return result

    def _infer_into(self, region: "CudaOutputRegion", ids, blobs, frames, timeout_s, wanted,
                    images_region=None) -> VisionResult:
        a, b = self._filled(ids, blobs, images_region)
        requested = self._requested(wanted)
        if contract.IMAGE_EMBEDS in wanted:
            requested[wanted.index(contract.IMAGE_EMBEDS)].set_shared_memory(region.name, region.capacity)
        r = self._call([a, b], frames, requested, timeout_s)
        embeds = None
        if contract.IMAGE_EMBEDS in wanted:
            embeds = region.embeds(r)
            embeds = embeds[0] if self.batched else embeds
        return self._result(r, [n for n in wanted if n != contract.IMAGE_EMBEDS], image_embeds=None, cuda_embeds=embeds)

    def _h(self) -> dict:
        return {"headers": dict(self.headers)} if self.headers else {}  # a copy, as in _call

    def unregister(self, name: str, kind: str) -> None:
        """Unregister a shared-memory region, retrying while the server still holds it; raises if it
        is still registered after UNREGISTER_RETRY_S."""
        call = (self.client.unregister_system_shared_memory if kind == "system"
                else self.client.unregister_cuda_shared_memory)
        deadline, delay = time.monotonic() + UNREGISTER_RETRY_S, 0.005
        while True:
            try:
                call(name, **self._h())
                return
            except Exception as exc:  # noqa: BLE001 - only "in use" is worth waiting for
                if "in use" not in str(exc) or time.monotonic() > deadline:
                    raise RuntimeError(f"could not unregister {kind} shared-memory region {name}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


class _PosixRegion:
    """A POSIX shared-memory region of this process, registered with the server (same host) and kept
    across requests; `grow_to` replaces it with one large enough (twice as large at least), the larger
    one made first so that a failure leaves this one as it was. Close it when done: that unregisters it
    (retrying while the server still holds it) and removes it."""

    prefix = "kimi_region"

    def __init__(self, client: KimiVisionClient, capacity: int):
        import tritonclient.utils.shared_memory as shm

        self.client, self._shm = client, shm
        self.handle, self.name, self.capacity = self._create(max(capacity, 1))

    def _create(self, capacity: int) -> tuple:
        """A new region, registered: (handle, name, capacity)."""
        name = f"{self.prefix}_{uuid.uuid4().hex[:12]}"
        handle = self._shm.create_shared_memory_region(name, f"/{name}", capacity)
        try:
            with self.client.explained():
                self.client.client.register_system_shared_memory(name, f"/{name}", capacity, **self.client._h())
        except Exception:
            self._shm.destroy_shared_memory_region(handle)
            raise
        return handle, name, capacity

    def grow_to(self, size: int) -> None:
        if self.handle is None:
            raise ValueError(f"shared-memory region {self.name} is closed")
        if size > self.capacity:
            new = self._create(max(size, 2 * self.capacity))
            old_handle, old_name = self.handle, self.name
            self.handle, self.name, self.capacity = new
            self._release(old_handle, old_name)

    def _release(self, handle, name: str) -> None:
        try:
            self.client.unregister(name, "system")
        finally:
            self._shm.destroy_shared_memory_region(handle)

    def close(self) -> None:
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        self._release(handle, self.name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ImagesRegion(_PosixRegion):
    """A POSIX shared-memory region of this process for the encoded images of a request, registered with
    the server once (same host) and rewritten by each request: the image bytes then travel by one copy
    into shared memory, not through the request body (on the H200 host: 1.4-2.2 ms
    less end to end for one 1.3 MB JPEG; for smaller requests the gain was within the run-to-run spread;
    docs/findings.md#images-through-shared-memory).

    One request at a time per region (the server reads it during the request; `infer` and `infer_into`
    return after the server is done with it). A request larger than the region replaces it with one
    twice as large or as large as the request needs. Close it when done.
    """

    prefix = "kimi_images"

    def __init__(self, client: KimiVisionClient, capacity: int = 4 << 20):
        super().__init__(client, capacity)

    def write(self, blobs: np.ndarray) -> int:
        """The images as the server reads BYTES (a 4-byte little-endian length before each), written at
        the region's start, each image's bytes copied once; returns their size in bytes."""
        if self.handle is None:
            raise ValueError(f"images region {self.name} is closed")
        parts, size = _byte_tensor_parts(blobs)
        self.grow_to(size)
        if parts:
            self._shm.set_shared_memory_region(self.handle, parts)
        return size


class SystemOutputRegion(_PosixRegion):
    """A POSIX shared-memory region of this process for IMAGE_EMBEDS, registered once and written by each
    request (`infer(shm="system")` keeps one per client in its pool)."""

    prefix = "kimi_out"

    def read(self, result, batched: bool, embeds_dtype: str = "float32") -> np.ndarray:
        """IMAGE_EMBEDS of `result`, copied out of the region (the next request writes it again)."""
        shape, datatype = _output_meta(result, contract.IMAGE_EMBEDS)
        embeds = _read_embeds(self._shm.get_contents_as_numpy(self.handle, np.uint8, [self.capacity]), shape, datatype,
                              embeds_dtype)
        return embeds[0] if batched else embeds


class CudaOutputRegion:
    """A CUDA buffer of this process for IMAGE_EMBEDS, registered with the server (CUDA IPC, same host).

    `KimiVisionClient.infer_into` reuses one across requests; `infer(shm="cuda")` takes one from the
    client's pool (registered once, grown on demand).
    Close it when done: that unregisters it (retrying while the server still holds it) and frees the
    buffer.
    """

    def __init__(self, client: KimiVisionClient, capacity: int, device_id: int = 0):
        import torch
        import tritonclient.utils.cuda_shared_memory as cudashm

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA shared memory needs a CUDA GPU on the client's host")
        self.client, self.device_id, self._cudashm = client, device_id, cudashm
        self._create(capacity)

    def _create(self, capacity: int) -> None:
        import torch

        cudashm, client = self._cudashm, self.client
        self.capacity, self.name = capacity, f"kimi_cuda_out_{uuid.uuid4().hex[:12]}"
        self.handle = cudashm.create_shared_memory_region(self.name, capacity, self.device_id)
        try:
            with client.explained():
                client.client.register_cuda_shared_memory(self.name, cudashm.get_raw_handle(self.handle),
                                                          self.device_id, capacity, **client._h())
        except Exception:
            cudashm.destroy_shared_memory_region(self.handle)
            raise
        try:  # the whole region as bytes, zero-copy through DLPack
            self.bytes = torch.from_dlpack(cudashm.as_shared_memory_tensor(self.handle, "UINT8", [capacity]))
        except Exception:
            self.close()
            raise

    def grow_to(self, capacity: int) -> None:
        """A region at least `capacity` bytes large: this one, or a new one in its place."""
        if capacity > self.capacity:
            self.close()
            self._create(capacity)

    def embeds(self, result):
        """IMAGE_EMBEDS of `result` as a torch view into the region (its shape and dtype)."""
        import torch

        shape, datatype = _output_meta(result, contract.IMAGE_EMBEDS)
        dtype = {"BF16": torch.bfloat16, "FP32": torch.float32, "FP16": torch.float16}[datatype]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self.bytes[:nbytes].view(dtype).view(*shape)

    def close(self) -> None:
        try:
            self.client.unregister(self.name, "cuda")
        finally:
            self._cudashm.destroy_shared_memory_region(self.handle)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _byte_tensor_parts(blobs: np.ndarray) -> tuple[list[np.ndarray], int]:
    """A BYTES tensor's layout in shared memory (what tritonclient's serialize_byte_tensor builds: each
    element's 4-byte little-endian length, then its bytes) as arrays to copy one after another, without
    joining them into one buffer first; and their size in bytes."""
    parts, size = [], 0
    for blob in blobs.reshape(-1):
        data = np.frombuffer(blob.encode("utf-8") if isinstance(blob, str) else blob, dtype=np.uint8)
        parts += [np.array([data.size], dtype="<u4"), data]
        size += 4 + data.size
    return parts, size


def _check_outputs(outputs: Sequence[str]) -> list[str]:
    wanted = [o for o in OUTPUTS if o in set(outputs)]
    unknown = set(outputs) - set(OUTPUTS)
    if unknown or not wanted:
        raise ValueError(f"outputs must be a non-empty subset of {list(OUTPUTS)}, got {list(outputs)}")
    return wanted


def _request_arrays(input_ids, images: Sequence[bytes], media_frames):
    """The request's tensors as the server takes them: int64 ids, a BYTES array, optional int64 frames."""
    ids = np.ascontiguousarray(np.asarray(input_ids, dtype=np.int64).reshape(-1))
    frames = None if media_frames is None else np.asarray(media_frames, dtype=np.int64).reshape(-1)
    return ids, _bytes_tensor(images), frames


def _output_meta(result, name: str) -> tuple[list[int], str]:
    """(shape, datatype) of an output; gRPC returns a protobuf, HTTP a dict."""
    meta = result.get_output(name)
    if isinstance(meta, dict):
        return list(meta["shape"]), meta["datatype"]
    return list(meta.shape), meta.datatype


def _read_embeds(raw: np.ndarray, shape: list[int], datatype: str, embeds_dtype: str = "float32") -> np.ndarray:
    """The embeddings out of a region's bytes, copied once (float32, or BF16 bit patterns as uint16)."""
    count = int(np.prod(shape))
    if datatype == "FP32":
        return raw[: count * 4].view(np.float32).reshape(shape).copy()
    if datatype == "BF16" and embeds_dtype == "bf16":
        return raw[: count * 2].view(np.uint16).reshape(shape).copy()
    if datatype == "BF16":
        # bfloat16 is the top half of a float32.
        halves = raw[: count * 2].view(np.uint16).astype(np.uint32) << 16
        return halves.view(np.float32).reshape(shape)
    raise ValueError(f"unexpected IMAGE_EMBEDS datatype {datatype}")
