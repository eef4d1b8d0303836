"""IMAGES refused by their byte lengths before the Python stub copies them out of shared memory.

tritonserver reads a request whole and copies each BYTES input into the model instance's shared-memory
region before our code runs (no gRPC size flag exists; docs/triton_runtime.md#request-size). The 2.51
stub then unpacks the input, still before `execute`: its `PbTensor` hands the serialized tensor (4-byte
length, then the bytes, per element) to `triton_python_backend_utils.deserialize_bytes_tensor`, which
copies every element into a Python bytes object, and reshapes the result to the tensor's shape
(python_backend r24.10, src/pb_tensor.cc). So a request of 1 GB of garbage costs the stub another 1 GB
before `execute` can refuse it.

`install` wraps that function in the stub: it reads the elements' lengths first (at most max_images + 1
of them; no byte of an image is copied) and, for a tensor over the limits (backends/preprocess/media.py
image_bytes_error), returns a stand-in of the tensor's shape whose every element is one `Refused`,
instead of the bytes. `refusal` tells the adapter's input reader (triton_models._Inputs.bytes_list) the
request's error, which it answers like any other (INVALID_ARG, naming the limit and the request's
value). A tensor within the limits is unpacked by the original function, as before.
"""

from __future__ import annotations

import struct

import numpy as np

from backends.config import Limits
from backends.errors import RequestError
from backends.preprocess.media import image_bytes_error, image_count_error

_LENGTH = struct.Struct("<I")


class Refused:
    """Every element of a BYTES input refused by its lengths. `error(count)`: the request's error, given
    the tensor's element count (known only to the stub, from the shape it reshapes to), a new one each
    time: an error raised keeps its traceback, whose frames hold the request's input tensor, so one kept
    here would make a cycle that keeps the tensor's shared memory until Python's cycle collector runs
    (seen: the region grew by every refused request's IMAGES)."""

    def __init__(self, error):
        self._error = error

    def error(self, count: int) -> RequestError:
        made = self._error(count)
        return RequestError(str(made), made.reason)  # noqa: the made one is never raised

    def reshape(self, *shape) -> np.ndarray:
        """What the stub asks of the unpacked tensor: its shape. A read-only view of this one object,
        whatever the element count (no array of that many references is made)."""
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        one = np.empty((), dtype=object)
        one[()] = self
        return np.broadcast_to(one, tuple(int(d) for d in shape))


def lengths(encoded, most: int) -> list[int] | None:
    """The element lengths of a serialized BYTES tensor, from their 4-byte prefixes alone; None once
    there are more than `most` elements (the rest is not walked). ValueError for one that runs past the
    end (tritonserver checks BYTES inputs before they get here: not expected)."""
    sizes, offset, end = [], 0, len(encoded)
    while offset < end:
        if len(sizes) == most:
            return None
        (n,) = _LENGTH.unpack_from(encoded, offset)
        offset += _LENGTH.size + n
        if offset > end:
            raise ValueError(f"BYTES element {len(sizes)} of {n} bytes runs past the tensor's end")
        sizes.append(n)
    return sizes


def checked_unpacker(original, limits: Limits):
    """`original` (the stub's deserialize_bytes_tensor) behind the byte limits."""

    def deserialize_bytes_tensor(encoded_tensor):
        try:
            sizes = lengths(encoded_tensor, limits.max_images)
        except (struct.error, TypeError, ValueError):
            return original(encoded_tensor)  # not what we expect: the original says what is wrong
        if sizes is None:  # more entries than max_images: named with the tensor's own count
            return Refused(lambda count: image_count_error(count, limits))
        error = image_bytes_error(sizes, limits)
        if error is not None:
            return Refused(lambda count: error)
        return original(encoded_tensor)

    deserialize_bytes_tensor.__wrapped__ = original
    return deserialize_bytes_tensor


def install(pb_utils, limits: Limits) -> bool:
    """Put the byte limits in front of the stub's BYTES unpacking (one model instance per stub process,
    so one set of limits). False where this triton_python_backend_utils has no such function."""
    current = getattr(pb_utils, "deserialize_bytes_tensor", None)
    if current is None:
        return False
    pb_utils.deserialize_bytes_tensor = checked_unpacker(getattr(current, "__wrapped__", current), limits)
    return True


def refusal(array: np.ndarray) -> RequestError | None:
    """The request's error if the stub refused this unpacked BYTES input, else None."""
    if array.size and isinstance(array.flat[0], Refused):
        return array.flat[0].error(int(array.size))
    return None
