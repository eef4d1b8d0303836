"""The strict scan check that a JPEG passes before the GPU decodes it (scan_check.c says what it refuses
and why: docs/jpeg_decoding.md#damaged-scans).

The C file is compiled with the host's C compiler (`CC`, else `cc`) into a cache folder
(`KIMI_BUILD_CACHE`, else a per-user folder under the system's temporary folder, which must be ours
alone), named by a hash of its source, the compiler, the flags and the machine; each process loads it
once with ctypes. `check` answers one file on the calling thread; `Checks` starts a request's files
with one call on the C library's own threads, which never take the GIL, and hands out their verdicts
as they are asked for. Without a compiler `ScanCheckUnavailable` is raised: the GPU route then stays
off and Pillow decodes every JPEG.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

from backends.folders import own_private_folder
from backends.preprocess import host_threads

SOURCE = Path(__file__).with_name("scan_check.c")
# -ffp-contract=off: the float bounds round the same wherever they are inlined (the one-thread check and
# the threads' walk must agree).
_FLAGS = ("-O2", "-shared", "-fPIC", "-pthread", "-ffp-contract=off")
# THREADS: threads one large scan is checked on (scan_check.c gives each at least 16 KB of scan), and
# the threads a batch of checks runs on; the C library's pool of threads is started on first use and
# kept. Every core this process may run on (host_threads.CORES: its affinity and its cgroup's CPU
# quota), up to 16: unlike Pillow's decode threads (host_threads) these never take the GIL, and a check
# is the longest part of preprocessing a large JPEG, or of eight small ones.
MAX_THREADS = 16  # scan_check.c's MAX_THREADS


def _threads() -> int:
    return min(MAX_THREADS, host_threads.CORES)


THREADS = _threads()

# The C function's answers (0: the GPU route may take the image).
REASONS = {
    1: "scan_structure",
    2: "scan_unsupported",
    3: "scan_bad_code",
    4: "scan_overrun",
    5: "scan_short",
    6: "scan_extra_bytes",
    7: "scan_restart",
    8: "scan_range",
}


class ScanCheckUnavailable(RuntimeError):
    pass


_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_PATH: Path | None = None


def cache_dir() -> Path:
    configured = os.environ.get("KIMI_BUILD_CACHE")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / f"kimi-vision-{os.getuid()}"


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc")) or ["cc"]


def compile_library(source: Path, out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """`source` (scan_check.c, or a copy of it a tool changed) built as the served library is, with
    `extra_flags` after ours (a later -O wins)."""
    compiler = _compiler()
    try:
        done = subprocess.run([*compiler, *_FLAGS, *extra_flags, "-o", str(out), str(source), "-lm"],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise ScanCheckUnavailable(f"{compiler[0]} took more than 300 s to build {source.name}") from None
    if done.returncode != 0:
        raise ScanCheckUnavailable(f"{compiler[0]} could not build {source.name}: {done.stderr.strip()[-500:]}")


def load(path: Path) -> ctypes.CDLL:
    """A built library, its functions typed."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise ScanCheckUnavailable(str(exc)) from None
    lib.kimi_scan_check.argtypes = (ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64)
    lib.kimi_scan_check.restype = ctypes.c_int
    lib.kimi_scan_walks.restype = lib.kimi_scan_fallbacks.restype = ctypes.c_long
    lib.kimi_scan_batch_start.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p),
                                          ctypes.POINTER(ctypes.c_size_t), ctypes.c_int, ctypes.c_uint64)
    lib.kimi_scan_batch_start.restype = ctypes.c_void_p
    lib.kimi_scan_batch_wait.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.kimi_scan_batch_wait.restype = ctypes.c_int
    lib.kimi_scan_batch_drop.argtypes = lib.kimi_scan_batch_state.argtypes = lib.kimi_scan_batch_wait.argtypes
    lib.kimi_scan_batch_drop.restype = lib.kimi_scan_batch_state.restype = ctypes.c_int
    lib.kimi_scan_batch_free.argtypes = lib.kimi_scan_batch_release.argtypes = (ctypes.c_void_p,)
    lib.kimi_scan_batch_free.restype = None
    lib.kimi_scan_batch_release.restype = ctypes.c_int
    return lib


def _build() -> Path:
    source = SOURCE.read_bytes()
    compiler = _compiler()
    tag = hashlib.sha256(source + " ".join([*compiler, *_FLAGS, platform.machine()]).encode()).hexdigest()[:16]
    folder = cache_dir()
    if "KIMI_BUILD_CACHE" not in os.environ:  # the default lies in the shared temporary folder
        try:
            own_private_folder(folder)
        except OSError as exc:
            raise ScanCheckUnavailable(f"{exc}; set KIMI_BUILD_CACHE to a folder of ours") from None
    target = folder / f"scan_check-{tag}.so"
    if target.exists():
        return target
    if shutil.which(compiler[0]) is None:
        raise ScanCheckUnavailable(f"no C compiler ({compiler[0]!r}) to build {SOURCE.name}")
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a private name, then renamed: model instances starting together never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        compile_library(SOURCE, Path(partial))
        os.chmod(partial, 0o755)  # mkstemp made it ours alone; other users of a shared cache load it too
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def library() -> ctypes.CDLL:
    """The compiled check, built on first use (its path: library_path())."""
    global _LIB, _PATH
    if _LIB is not None:  # every check asks: no lock once loaded
        return _LIB
    with _LOCK:
        if _LIB is None:
            path = _build()
            _LIB, _PATH = load(path), path
    return _LIB


def library_path() -> Path:
    """Where the loaded library was built (loads it first)."""
    library()
    return _PATH


def reason_for(code: int) -> str | None:
    """The C function's answer as check() gives it: None (the GPU route may take the image) or a reason."""
    return None if code == 0 else REASONS.get(code, f"scan_{code}")


def check(blob: bytes, threads: int = THREADS, max_pixels: int = 0) -> str | None:
    """None if the GPU decode of this JPEG must equal Pillow's (a well-formed baseline scan within
    range), else the reason it goes to Pillow. The answer does not depend on `threads`. `max_pixels`
    (0: none) refuses a larger image from its header, before its scan is read."""
    data = bytes(blob)
    return reason_for(library().kimi_scan_check(data, len(data), threads, max_pixels))


class CheckDropped(RuntimeError):
    """A verdict asked for after its check was dropped, or after the batch was closed."""


_QUEUED, _RUNNING, _DROPPED, _NO_SUCH = -1, -2, -3, -4  # scan_check.c's states of a batch's check


class Checks:
    """The checks of several JPEGs, queued at once on the C library's threads and running while the
    caller goes on; `pending(i)` is file i's verdict to come (result/cancel/done, as a future). The
    bytes stay referenced here until the batch is freed. close() drops the checks not started and
    waits for those running (and for calls of other threads). A batch collected unclosed waits for
    nothing: if checks still run (a request that failed, or whose images went to Pillow), it is kept
    aside with its bytes and freed once they end (swept when the next batch starts, or at exit)."""

    def __init__(self, blobs: Sequence, threads: int = THREADS, max_pixels: int = 0, lib: ctypes.CDLL | None = None):
        sweep_retired()
        lib = lib or library()  # `lib`: a build of a tool's own (load()), else the served one
        self._lib = lib
        data = [bytes(b) for b in blobs]  # bytes as they are; anything else copied once
        n = self._n = len(data)
        if n == 0:
            raise ValueError("no files to check")
        self._cond = threading.Condition()
        self._calls, self._closed = 0, False  # calls into the batch now; close() waits for them
        handle = lib.kimi_scan_batch_start(n, (ctypes.c_char_p * n)(*data),
                                           (ctypes.c_size_t * n)(*map(len, data)), threads, max_pixels)
        if not handle:
            raise MemoryError("the scan checks could not be queued")
        self._handle, fin = handle, None
        try:
            fin = weakref.finalize(self, _release_batch, lib, handle, data)
            fin.atexit = False  # at exit _close_all closes it, waiting for other threads' calls
            self._free = fin
            _OPEN.add(self)
        except BaseException:  # e.g. an interrupt here: the threads must be done with `data` first
            if fin is None or fin.detach() is not None:
                lib.kimi_scan_batch_free(handle)
            raise

    def _call(self, fn, i: int) -> int:
        if not 0 <= i < self._n:
            raise IndexError(f"no file {i} in a batch of {self._n}")
        with self._cond:
            if self._closed:
                raise CheckDropped("the checks were closed")
            self._calls += 1
        try:
            return fn(self._handle, i)
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    def verdict(self, i: int) -> str | None:
        """File i's verdict (check()'s answer), waiting for it; a check not yet started runs here."""
        code = self._call(self._lib.kimi_scan_batch_wait, i)
        if code == _DROPPED:
            raise CheckDropped(f"the check of file {i} was dropped")
        return reason_for(code)

    def drop(self, i: int) -> bool:
        """Gives up file i's check if it has not started; True if it will never run."""
        try:
            return bool(self._call(self._lib.kimi_scan_batch_drop, i))
        except CheckDropped:
            return True

    def done(self, i: int) -> bool:
        """Whether file i's check has answered or was dropped (nothing waited for)."""
        return self._call(self._lib.kimi_scan_batch_state, i) not in (_QUEUED, _RUNNING)

    def running(self, i: int) -> bool:
        """Whether file i's check runs now."""
        return self._call(self._lib.kimi_scan_batch_state, i) == _RUNNING

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._calls:
                self._cond.wait()
        _OPEN.discard(self)
        info = self._free.detach()  # holds the bytes until the batch is freed
        if info is not None:
            self._lib.kimi_scan_batch_free(self._handle)
        del info

    def pending(self, i: int) -> "Pending":
        return Pending(self, i)


# Batches collected while checks ran, with their bytes. A deque: the finalizer may run inside a
# collection that a sweep itself set off, on the same thread, so it must append without a lock; a
# sweep takes each entry out and puts back those still running (one owner at a time, no lock).
_RETIRED: collections.deque = collections.deque()
_OPEN: weakref.WeakSet = weakref.WeakSet()  # batches not yet freed (closed at exit)
_EXITING = False


def _release_batch(lib: ctypes.CDLL, handle: int, data: list[bytes]) -> None:
    """A collected batch: freed now if none of its checks runs, else kept aside with `data` (the bytes
    those checks read) until they end."""
    if lib.kimi_scan_batch_release(handle):
        _RETIRED.append((lib, handle, data))
        if _EXITING:  # the exit hook may have emptied the deque before this append
            _drain(wait=True)


def _drain(wait: bool) -> None:
    for _ in range(len(_RETIRED)):
        try:
            lib, handle, data = _RETIRED.popleft()
        except IndexError:
            return
        if wait:
            lib.kimi_scan_batch_free(handle)
        elif lib.kimi_scan_batch_release(handle):
            _RETIRED.append((lib, handle, data))


def sweep_retired() -> int:
    """Frees the kept-aside batches whose checks have ended; how many are still kept."""
    _drain(wait=False)
    return len(_RETIRED)


@atexit.register
def _close_all() -> None:
    """At exit: every open batch closed (waiting for its running checks and for calls of other threads)
    and every kept-aside one freed the same way; a batch released from now on is freed at once."""
    global _EXITING
    _EXITING = True
    for checks in list(_OPEN):
        checks.close()
    _drain(wait=True)


def _after_fork_in_child() -> None:
    """A child has only the forking thread: no other thread holds a batch's lock or is inside a call."""
    for checks in list(_OPEN):
        checks._cond = threading.Condition()
        checks._calls = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


class Pending:
    """One file's verdict to come, as a future offers it (result, cancel, done)."""

    __slots__ = ("checks", "index")

    def __init__(self, checks: Checks, index: int):
        self.checks, self.index = checks, index

    def result(self) -> str | None:
        return self.checks.verdict(self.index)

    def cancel(self) -> bool:
        return self.checks.drop(self.index)

    def done(self) -> bool:
        return self.checks.done(self.index)


def parallel_counts() -> tuple[int, int]:
    """(scans checked on several threads, times the threads could not be used) since the start."""
    return library().kimi_scan_walks(), library().kimi_scan_fallbacks()
