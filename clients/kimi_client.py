"""A small client for the `kimi_k25_vision` ensemble over gRPC or HTTP, with optional shared memory.

    client = KimiVisionClient("127.0.0.1:8001", protocol="grpc")
    result = client.infer(input_ids, [open("a.jpg", "rb").read()])
    result.image_embeds  # (sum of IMAGE_TOKEN_COUNTS, text_hidden), rows in prompt order

Shared memory: `shm="system"` puts the inputs and IMAGE_EMBEDS in a POSIX shared-memory region
registered with the server (same host); `shm="cuda"` writes IMAGE_EMBEDS straight into a CUDA buffer
this process owns (the co-located LLM reads it without a host copy) and is available where a GPU is;
`infer_into(CudaOutputRegion(client, capacity), ...)` keeps one such buffer registered across requests.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import contract
from contract import MEDIA_PAD, OUTPUTS  # noqa: F401 - MEDIA_PAD re-exported for callers

MODEL = contract.ENSEMBLE
BATCHED_MODEL = contract.BATCHED_ENSEMBLE


@dataclass
class VisionResult:
    expanded_ids: np.ndarray  # (L',) int64
    image_embeds: np.ndarray | None  # (tokens, text_hidden) float32 (BF16 widened); None from infer_into
    grid_thws: np.ndarray  # (M, 3) int64
    token_counts: np.ndarray  # (M,) int64
    cuda_embeds: object = None  # torch tensor on the GPU with shm="cuda" and from infer_into

    def checksum(self) -> str:
        """sha256 prefix over the embeddings' float32 bytes: equal results give equal checksums."""
        return hashlib.sha256(np.ascontiguousarray(self.image_embeds, dtype=np.float32).tobytes()).hexdigest()[:16]

    def summary(self) -> str:
        lines = [f"expanded length: {self.expanded_ids.shape[0]} ids"]
        for i, (grid, n) in enumerate(zip(self.grid_thws.tolist(), self.token_counts.tolist())):
            kind = "image" if grid[0] == 1 else f"video chunk ({grid[0]} frames)"
            lines.append(f"media {i} ({kind}): grid_thw {tuple(grid)} -> {n} tokens")
        e = self.image_embeds
        lines.append(f"image embeds: shape {tuple(e.shape)} {e.dtype}, sum {float(e.sum(dtype=np.float64)):.6f}, "
                     f"sha256 {self.checksum()}")
        return "\n".join(lines)


def chat_prompt_ids(num_images: int, text_ids: Sequence[int] = (1, 2, 3)) -> np.ndarray:
    """contract.chat_prompt_ids as an int64 array."""
    return np.asarray(contract.chat_prompt_ids(num_images, text_ids), dtype=np.int64)


def _bytes_tensor(images: Sequence[bytes]) -> np.ndarray:
    return np.array(list(images), dtype=np.object_).reshape(-1)


class KimiVisionClient:
    def __init__(self, url: str, protocol: str = "grpc", model: str | None = None, batched: bool = False):
        """batched=True talks to kimi_k25_vision_batched (cross-request batching on the server)."""
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
        self.protocol, self.batched = protocol, batched
        self.model = model or (BATCHED_MODEL if batched else MODEL)
        if protocol == "grpc":
            import tritonclient.grpc as tc
        else:
            import tritonclient.http as tc
        self.tc = tc
        self.client = tc.InferenceServerClient(url)

    def close(self):
        self.client.close()

    def infer(self, input_ids, images: Sequence[bytes], *, media_frames: Sequence[int] | None = None,
              shm: str = "none", output_capacity: int = 256 << 20, timeout_s: float | None = None) -> VisionResult:
        """One request through the ensemble.

        media_frames: None when every image is a still image; else one entry per media in prompt
        order, 0 for an image and t (1..4) for a video chunk whose t frames are the next t images.
        output_capacity bounds IMAGE_EMBEDS in the shared-memory modes (256 MiB: ~9k FP32 rows of the
        real model's 7168; raise it for larger requests). timeout_s applies to gRPC; an HTTP client's
        timeouts are set on tritonclient.http.InferenceServerClient.
        """
        ids, blobs, frames = _request_arrays(input_ids, images, media_frames)
        if shm == "none":
            return self._infer_plain(ids, blobs, frames, timeout_s)
        if shm == "system":
            return self._infer_system_shm(ids, blobs, frames, output_capacity, timeout_s)
        if shm == "cuda":
            return self._infer_cuda_shm(ids, blobs, frames, output_capacity, timeout_s)
        raise ValueError(f"shm must be 'none', 'system' or 'cuda', got {shm!r}")

    def infer_into(self, region: "CudaOutputRegion", input_ids, images: Sequence[bytes], *,
                   media_frames: Sequence[int] | None = None, timeout_s: float | None = None) -> VisionResult:
        """One request whose IMAGE_EMBEDS the server writes into `region`, a CUDA buffer registered once
        (what a co-located LLM does: no allocation, registration or copy per request). The result's
        `cuda_embeds` is a view into the region, valid until the next request into it; `image_embeds`
        is None (nothing is copied to the host)."""
        ids, blobs, frames = _request_arrays(input_ids, images, media_frames)
        return self._infer_into(region, ids, blobs, frames, timeout_s)

    def _shape(self, array: np.ndarray) -> list[int]:
        return ([1] if self.batched else []) + list(array.shape)

    def _batch(self, array: np.ndarray) -> np.ndarray:
        return array[None] if self.batched else array

    def _output(self, result, name: str) -> np.ndarray:
        array = result.as_numpy(name)
        if array.dtype.name == "bfloat16":
            # tritonclient returns BF16 as ml_dtypes.bfloat16, which torch.from_numpy and much else
            # refuse; widen exactly to float32, as the shared-memory paths do.
            array = array.astype(np.float32)
        return array[0] if self.batched else array

    def _inputs(self, ids, blobs):
        a = self.tc.InferInput("INPUT_IDS", self._shape(ids), "INT64")
        b = self.tc.InferInput("IMAGES", self._shape(blobs), "BYTES")
        return a, b

    def _call(self, inputs, frames, outputs, timeout_s):
        if frames is not None:
            f = self.tc.InferInput("MEDIA_FRAMES", self._shape(frames), "INT64")
            f.set_data_from_numpy(self._batch(frames))
            inputs = [*inputs, f]
        kwargs = {"client_timeout": timeout_s} if (timeout_s and self.protocol == "grpc") else {}
        return self.client.infer(self.model, inputs, outputs=outputs, **kwargs)

    def _infer_plain(self, ids, blobs, frames, timeout_s):
        a, b = self._inputs(ids, blobs)
        a.set_data_from_numpy(self._batch(ids))
        b.set_data_from_numpy(self._batch(blobs))
        outputs = [self.tc.InferRequestedOutput(n) for n in OUTPUTS]
        r = self._call([a, b], frames, outputs, timeout_s)
        return VisionResult(*(self._output(r, n) for n in OUTPUTS))

    def _infer_system_shm(self, ids, blobs, frames, capacity, timeout_s):
        import tritonclient.utils.shared_memory as shm
        from tritonclient.utils import serialize_byte_tensor

        tag = uuid.uuid4().hex[:12]
        serialized = serialize_byte_tensor(blobs)
        serialized = serialized.item() if serialized.size else b""
        in_size = ids.nbytes + len(serialized)
        regions = []
        try:
            in_name, out_name = f"kimi_in_{tag}", f"kimi_out_{tag}"
            h_in = shm.create_shared_memory_region(in_name, f"/{in_name}", max(in_size, 1))
            regions.append((in_name, h_in))
            h_out = shm.create_shared_memory_region(out_name, f"/{out_name}", capacity)
            regions.append((out_name, h_out))
            shm.set_shared_memory_region(h_in, [ids])
            if serialized:
                shm.set_shared_memory_region(h_in, [np.frombuffer(serialized, dtype=np.uint8)], offset=ids.nbytes)
            self.client.register_system_shared_memory(in_name, f"/{in_name}", max(in_size, 1))
            self.client.register_system_shared_memory(out_name, f"/{out_name}", capacity)
            a, b = self._inputs(ids, blobs)
            a.set_shared_memory(in_name, ids.nbytes)
            if serialized:
                b.set_shared_memory(in_name, len(serialized), offset=ids.nbytes)
            else:
                b.set_data_from_numpy(self._batch(blobs))
            outputs = [self.tc.InferRequestedOutput(n) for n in OUTPUTS]
            outputs[1].set_shared_memory(out_name, capacity)
            r = self._call([a, b], frames, outputs, timeout_s)
            shape, datatype = _output_meta(r, "IMAGE_EMBEDS")
            embeds = _read_embeds(shm.get_contents_as_numpy(h_out, np.uint8, [capacity]), shape, datatype)
            return VisionResult(self._output(r, "EXPANDED_IDS"), embeds[0] if self.batched else embeds,
                                self._output(r, "GRID_THWS"), self._output(r, "IMAGE_TOKEN_COUNTS"))
        finally:
            for name, handle in regions:  # each step on its own: one failure must not leak the rest
                try:
                    self.client.unregister_system_shared_memory(name)
                except Exception:  # noqa: BLE001 - best effort cleanup
                    pass
                try:
                    shm.destroy_shared_memory_region(handle)
                except Exception:  # noqa: BLE001
                    pass

    def _infer_cuda_shm(self, ids, blobs, frames, capacity, timeout_s):
        region = CudaOutputRegion(self, capacity)
        try:
            result = self._infer_into(region, ids, blobs, frames, timeout_s)
            embeds_gpu = result.cuda_embeds.clone()  # one device-to-device copy: outlives the region
            result.cuda_embeds, result.image_embeds = embeds_gpu, embeds_gpu.float().cpu().numpy()
            return result
        finally:
            region.close()

    def _infer_into(self, region: "CudaOutputRegion", ids, blobs, frames, timeout_s) -> VisionResult:
        a, b = self._inputs(ids, blobs)
        a.set_data_from_numpy(self._batch(ids))
        b.set_data_from_numpy(self._batch(blobs))
        outputs = [self.tc.InferRequestedOutput(n) for n in OUTPUTS]
        outputs[OUTPUTS.index("IMAGE_EMBEDS")].set_shared_memory(region.name, region.capacity)
        r = self._call([a, b], frames, outputs, timeout_s)
        embeds = region.embeds(r)
        return VisionResult(self._output(r, "EXPANDED_IDS"), None, self._output(r, "GRID_THWS"),
                            self._output(r, "IMAGE_TOKEN_COUNTS"), cuda_embeds=embeds[0] if self.batched else embeds)


class CudaOutputRegion:
    """A CUDA buffer of this process for IMAGE_EMBEDS, registered with the server (CUDA IPC, same host).

    `KimiVisionClient.infer_into` reuses one across requests; `infer(shm="cuda")` makes one per call.
    Close it when done: that unregisters it and frees the buffer.
    """

    def __init__(self, client: KimiVisionClient, capacity: int, device_id: int = 0):
        import torch
        import tritonclient.utils.cuda_shared_memory as cudashm

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA shared memory needs a CUDA GPU on the client's host")
        self.client, self.capacity, self._cudashm = client, capacity, cudashm
        self.name = f"kimi_cuda_out_{uuid.uuid4().hex[:12]}"
        self.handle = cudashm.create_shared_memory_region(self.name, capacity, device_id)
        try:
            client.client.register_cuda_shared_memory(self.name, cudashm.get_raw_handle(self.handle), device_id,
                                                      capacity)
        except Exception:
            cudashm.destroy_shared_memory_region(self.handle)
            raise
        # The whole region as bytes, zero-copy through DLPack.
        self.bytes = torch.from_dlpack(cudashm.as_shared_memory_tensor(self.handle, "UINT8", [capacity]))

    def embeds(self, result):
        """IMAGE_EMBEDS of `result` as a torch view into the region (its shape and dtype)."""
        import torch

        shape, datatype = _output_meta(result, "IMAGE_EMBEDS")
        dtype = {"BF16": torch.bfloat16, "FP32": torch.float32, "FP16": torch.float16}[datatype]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self.bytes[:nbytes].view(dtype).view(*shape)

    def close(self) -> None:
        try:
            self.client.client.unregister_cuda_shared_memory(self.name)
        except Exception:  # noqa: BLE001 - best effort: the buffer is freed either way
            pass
        self._cudashm.destroy_shared_memory_region(self.handle)


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


def _read_embeds(raw: np.ndarray, shape: list[int], datatype: str) -> np.ndarray:
    count = int(np.prod(shape))
    if datatype == "FP32":
        return raw[: count * 4].view(np.float32).reshape(shape).copy()
    if datatype == "BF16":
        # bfloat16 is the top half of a float32.
        halves = raw[: count * 2].view(np.uint16).astype(np.uint32) << 16
        return halves.view(np.float32).reshape(shape)
    raise ValueError(f"unexpected IMAGE_EMBEDS datatype {datatype}")
