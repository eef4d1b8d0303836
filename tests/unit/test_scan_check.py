"""The strict scan check (backends/preprocess/scan_check.c) that every JPEG passes before the GPU decodes
it: well-formed files pass, each kind of damage is refused with its reason, and whatever Pillow refuses
to decode is refused too (Pillow raising is libjpeg-turbo's own verdict that the file is broken)."""

import io
import os

import numpy as np
import pytest
from PIL import Image

from backends.preprocess import scan_check
from backends.preprocess.jpeg_gpu import self_check_images
from clients.samples import encode, photo_like
from oracles.jpeg_corpus import corpus, damaged, header_segments, pillow_only, scan_start, sos_offset


def _with_quant(blob: bytes, scale: int) -> bytes:
    """The file with every quantizer of every DQT table multiplied by `scale` (the scan unchanged)."""
    out = bytearray(blob)
    for i, marker, length in header_segments(blob):
        if marker == 0xDB:
            for t in range(i + 4, i + 2 + length, 65):
                out[t + 1:t + 65] = bytes(min(255, v * scale) for v in out[t + 1:t + 65])
    return bytes(out)


def test_every_well_formed_file_passes():
    files = [(label, blob) for label, blob in corpus()]
    files += [(f"self-check {k}", b) for k, b in enumerate(self_check_images())]
    for q in (30, 75, 95, 100):
        files.append((f"448 photo q{q}", encode(photo_like(448, 448, seed=q), "JPEG", quality=q)))
    verdicts = {label: scan_check.check(blob) for label, blob in files}
    assert {label: why for label, why in verdicts.items() if why is not None} == {}


def test_what_the_gpu_route_does_not_take_is_refused_as_unsupported():
    for label, blob, _ in pillow_only():  # progressive, CMYK (4 components)
        assert scan_check.check(blob) == "scan_unsupported", label


def test_large_coefficients_that_still_clamp_pass_and_those_that_would_wrap_are_refused():
    """A black/white checkerboard at quality 100 has coefficients whose cheap bound exceeds the limit:
    the exact IDCT decides, and its outputs (0 and 255) are in range. The same scan with quantizers
    four times larger would reach about 4 x 128 = 512 past the centre, where libjpeg-turbo's range-limit
    table wraps instead of clamping: refused."""
    board = ((np.indices((64, 64)).sum(0) % 2) * 255).astype(np.uint8)
    blob = encode(board, "JPEG", quality=100)
    assert scan_check.check(blob) is None
    assert scan_check.check(_with_quant(blob, 4)) == "scan_range"
    assert scan_check.check(_with_quant(blob, 255)) == "scan_range"  # coefficient x quantizer past 16 bits


@pytest.fixture(scope="module")
def photo_jpeg():
    return encode(photo_like(96, 64, seed=3), "JPEG", quality=90)


def test_damage_is_refused_with_its_reason(photo_jpeg):
    start = scan_start(photo_jpeg)
    end = len(photo_jpeg) - 2
    cases = [
        # the scan cut short, the end marker kept: the decoder would run into it and read zeros
        ("scan_short", photo_jpeg[:start + (end - start) // 2] + b"\xff\xd9"),
        # bytes left over between the last block and the end marker
        ("scan_extra_bytes", photo_jpeg[:end] + b"\x12\x34" + photo_jpeg[end:]),
        # sixteen one-bits open the scan: no code of the standard luminance DC table starts with nine
        ("scan_bad_code", photo_jpeg[:start] + b"\xff\x00\xff\x00" + photo_jpeg[start:]),
        # a (hollow) DHT segment after the scan, where only the end marker may come
        ("scan_structure", photo_jpeg[:end] + b"\xff\xc4\x00\x02" + photo_jpeg[end:]),
        # trailing bytes after the end marker
        ("scan_structure", photo_jpeg + b"\x00"),
    ]
    for want, blob in cases:
        assert scan_check.check(blob) == want, want


def test_restart_markers_out_of_order_are_refused():
    blob = encode(photo_like(96, 64, seed=4), "JPEG", quality=90, restart_marker_blocks=2)
    assert scan_check.check(blob) is None
    first = blob.index(b"\xff\xd0", scan_start(blob))
    assert scan_check.check(blob[:first] + b"\xff\xd1" + blob[first + 2:]) == "scan_restart"
    # one restart marker missing: the next interval's data stands where the marker should
    assert scan_check.check(blob[:first] + blob[first + 2:]) == "scan_extra_bytes"


def test_whatever_pillow_refuses_is_refused():
    """Random damage inside the scan. Where Pillow (libjpeg-turbo) raises, the check must refuse, or the
    GPU would answer pixels where the reference answers an error. Damage that leaves a well-formed scan
    (a stretch inside one block: both decoders read the same coefficients) may pass; whether the GPU
    then equals Pillow is tests/gpu/test_jpeg_decode.py's damaged-scan test, on files damaged the same
    ways (oracles/jpeg_corpus.damaged)."""
    refused = pillow_raised = 0
    for seed, quality in enumerate((40, 65, 80, 95)):
        base = encode(photo_like(120, 80, seed=seed), "JPEG", quality=quality, subsampling=seed % 3)
        for label, blob in damaged(base, seed, 150):
            verdict = scan_check.check(blob)
            try:
                Image.open(io.BytesIO(blob)).convert("RGB")
            except Exception:  # noqa: BLE001 - whatever Pillow raises
                pillow_raised += 1
                assert verdict is not None, f"seed {seed}, {label}: Pillow raised, the check passed the file"
            refused += verdict is not None
    assert pillow_raised > 0  # the property above was put to the test
    assert refused > 120, refused  # and much damage is caught before the decoders diverge


def test_without_a_compiler_the_check_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_BUILD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(scan_check.ScanCheckUnavailable, match="no C compiler"):
        scan_check._build()
    assert list(tmp_path.iterdir()) == []


def test_the_library_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_BUILD_CACHE", str(tmp_path))
    first = scan_check._build()
    assert first.parent == tmp_path and first.name.startswith("scan_check-")
    stamp = first.stat().st_mtime_ns
    assert scan_check._build() == first and first.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left behind


def test_a_large_scan_gets_the_same_verdict_on_several_threads():
    """A scan of at least 16 KB per thread is split among threads that decode speculatively from their
    chunk's start and merge where they meet the true path: the verdict must be the one-thread one,
    on well-formed files and on damaged ones (damage near a chunk boundary included)."""
    base = encode(photo_like(1600, 1200, seed=11), "JPEG", quality=90)
    gray = encode(photo_like(1600, 1200, seed=12), "JPEG", quality=95)
    gray = encode(Image.open(io.BytesIO(gray)).convert("L"), "JPEG", quality=95)
    assert len(base) > 16 * 16384 and len(gray) > 16 * 16384  # room for 16 threads
    files = [("4:2:0", base), ("gray", gray)] + damaged(base, 5, 45) + damaged(gray, 6, 15)
    start = scan_start(base)
    for t in (2, 4, 8, 16):  # a stretch dropped right at each chunk boundary (of 2, 4, 8 and 16 threads)
        for k in range(1, t):
            cut = start + (len(base) - start) * k // t
            files.append((f"dropped at {k}/{t}", base[:cut - 3] + base[cut + 2:]))
    verdicts = {}
    walks, fallbacks = scan_check.parallel_counts()
    for label, blob in files:
        one = scan_check.check(blob, threads=1)
        for threads in (2, 3, 4, 8, 16):
            assert scan_check.check(blob, threads=threads) == one, (label, threads)
        verdicts[label] = one
    assert verdicts["4:2:0"] is None and verdicts["gray"] is None
    assert sum(v is not None for v in verdicts.values()) > 20  # damage was caught on many threads too
    now_walks, now_fallbacks = scan_check.parallel_counts()
    assert now_walks - walks > 2 * len(files) and now_fallbacks == fallbacks  # the threads answered


def test_the_default_cache_must_be_ours_alone(monkeypatch, tmp_path):
    """Under a shared temporary folder someone else could have made the cache folder first (or a link
    there) and left a library in it: a folder of another user, or a link, is refused; one of ours is
    made ours alone (0700) again; what we build is readable by others (a cache shared on purpose,
    KIMI_BUILD_CACHE, serves other users)."""
    import os
    import tempfile

    monkeypatch.delenv("KIMI_BUILD_CACHE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = tmp_path / f"kimi-vision-{os.getuid()}"
    (tmp_path / "elsewhere").mkdir()
    folder.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(scan_check.ScanCheckUnavailable, match="is not a folder"):
        scan_check._build()
    folder.unlink()
    folder.mkdir()
    folder.chmod(0o777)
    owner = os.stat(folder).st_uid
    with monkeypatch.context() as m:
        m.setattr(os, "geteuid", lambda: owner + 1)
        with pytest.raises(scan_check.ScanCheckUnavailable, match="belongs to another user"):
            scan_check._build()
    built = scan_check._build()
    assert folder.stat().st_mode & 0o777 == 0o700
    assert built.parent == folder and built.stat().st_mode & 0o777 == 0o755


def _before_scan(blob: bytes, segment: bytes) -> bytes:
    sos = sos_offset(blob)
    return blob[:sos] + segment + blob[sos:]


@pytest.mark.parametrize("count", [3, 255])
def test_an_overfull_huffman_table_is_refused(photo_jpeg, count):
    """A DC table with more 1-bit codes than there are (libjpeg-turbo refuses it): refused before its
    codes are laid out in the lookup table, which they would overrun."""
    symbols = bytes(k % 12 for k in range(count))
    body = bytes([0x00]) + bytes([count]) + bytes(15) + symbols  # class 0 (DC), table 0
    dht = b"\xff\xc4" + (2 + len(body)).to_bytes(2, "big") + body
    assert scan_check.check(_before_scan(photo_jpeg, dht)) == "scan_structure"


def test_sides_above_libjpegs_limit_are_refused(photo_jpeg):
    sof = next(i for i, marker, _ in header_segments(photo_jpeg) if marker == 0xC0)
    wide = bytearray(photo_jpeg)
    wide[sof + 7:sof + 9] = (65535).to_bytes(2, "big")  # SOF0: length, precision, height, then width
    with pytest.raises(OSError):  # "broken data stream": libjpeg-turbo refuses the size
        Image.open(io.BytesIO(bytes(wide))).convert("RGB")
    assert scan_check.check(bytes(wide)) == "scan_unsupported"


def test_an_image_above_the_pixel_limit_is_refused_from_its_header(photo_jpeg):
    """A check started before the request's own size check (Preprocessor.start of a request) must not
    decode a decompression bomb's scan: max_pixels refuses it from the frame header."""
    assert scan_check.check(photo_jpeg, max_pixels=96 * 64) is None
    assert scan_check.check(photo_jpeg, max_pixels=96 * 64 - 1) == "scan_unsupported"


def _batch_files() -> list[bytes]:
    """Small and large files, well-formed and damaged, and a PNG: what a request's batch may hold."""
    big = encode(photo_like(1600, 1200, seed=21), "JPEG", quality=90)  # checked on several threads
    small = [encode(photo_like(64 + 8 * k, 48, seed=k), "JPEG", quality=60 + 5 * k, subsampling=k % 3) for k in range(6)]
    files = [big, *small, encode(photo_like(40, 30, seed=3), "PNG")]
    return files + [blob for _, blob in damaged(big, 7, 6) + damaged(small[0], 8, 6)]


def test_a_batch_gives_each_file_the_one_by_one_verdict_in_any_order():
    """scan_check.Checks queues a request's files at once on the C library's threads; each verdict, asked
    for in any order, is what check() answers for that file alone."""
    files = _batch_files()
    expected = [scan_check.check(b) for b in files]
    assert expected[0] is None and sum(v is not None for v in expected) >= 4  # both kinds present
    rng = np.random.default_rng(0)
    for threads in (1, 3, 8):
        checks = scan_check.Checks(files, threads)
        order = rng.permutation(len(files)).tolist()
        assert {k: checks.verdict(k) for k in order} == dict(enumerate(expected)), threads
        assert checks.pending(0).result() is None  # asked again: the same answer
        checks.close()
        with pytest.raises(scan_check.CheckDropped):
            checks.verdict(0)


def test_batches_from_several_threads_at_once_all_finish_with_the_right_verdicts():
    """Requests of several model threads share the C library's pool: batches queued at once from 4
    Python threads, some with checks dropped, some never closed, all get their verdicts (none hangs).
    A drop that took effect (True) means the check never ran; one too late leaves the right verdict."""
    import threading
    import time

    files = _batch_files()
    expected = [scan_check.check(b) for b in files]
    wrong, errors, drops = [], [], []

    def requests(seed: int):
        rng = np.random.default_rng(seed)
        try:
            for n in range(6):
                checks = scan_check.Checks(files, int(rng.integers(1, 9)))
                dropped = {k for k in rng.choice(len(files), size=4, replace=False).tolist() if checks.drop(k)}
                drops.append(len(dropped))
                for k in rng.permutation(len(files)).tolist():
                    try:
                        got = checks.verdict(k)
                    except scan_check.CheckDropped:
                        if k not in dropped:
                            wrong.append((seed, n, k, "dropped"))
                        continue
                    if got != expected[k] or k in dropped:
                        wrong.append((seed, n, k, got))
                if n % 2:
                    checks.close()  # else freed when collected, the dropped ones never run
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=requests, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300  # a guard against a hang, not a time limit on the checks
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a batch never finished"
    assert errors == [] and wrong == []
    assert len(drops) == 24


def test_a_batchs_checks_run_without_being_asked_for():
    """The C library's threads run the checks while the caller does something else: every file of a
    batch is answered without a verdict being asked for (verdict() would run a queued check on the
    asking thread, so it could not tell)."""
    import time

    files = _batch_files()
    checks = scan_check.Checks(files)
    deadline = time.monotonic() + 120  # a guard against a hang
    while not all(checks.done(k) for k in range(len(files))) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(checks.done(k) for k in range(len(files)))
    assert [checks.verdict(k) for k in range(len(files))] == [scan_check.check(b) for b in files]
    with pytest.raises(IndexError):
        checks.verdict(len(files))


def test_close_waits_for_a_verdict_asked_on_another_thread():
    import threading

    big = _batch_files()[0]
    checks = scan_check.Checks([big] * 4, 1)
    answers = []

    def ask():
        try:
            answers.append(checks.verdict(3))
        except scan_check.CheckDropped:  # close() came first: also an answer
            answers.append("closed")

    import time

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    deadline = time.monotonic() + 120  # a guard against a hang
    while checks._calls == 0 and not answers and time.monotonic() < deadline:  # the asker is inside its call
        time.sleep(0.0002)
    checks.close()  # must wait for the asker's call to return: it gets its verdict, not "closed"
    asker.join(timeout=120)
    assert not asker.is_alive() and answers == [None]
    with pytest.raises(scan_check.CheckDropped):
        checks.verdict(0)
    assert checks.drop(0) is True


def test_a_child_forked_while_checks_run_answers_them_itself():
    """After a fork the child has none of the pool's threads: its unanswered checks (queued, or running
    in the parent) are run by the thread that asks, with the same verdicts."""
    import os
    import time
    import warnings

    files = _batch_files()
    expected = [scan_check.check(b) for b in files]
    checks = scan_check.Checks(files, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the point of the test
        pid = os.fork()
    if pid == 0:  # the child: answer, then leave without running the parent's pytest machinery
        ok = [checks.verdict(k) for k in range(len(files))] == expected
        checks.close()
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120  # a guard against a hung child
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child never answered its checks")
    assert os.waitstatus_to_exitcode(status) == 0
    assert [checks.verdict(k) for k in range(len(files))] == expected  # the parent's are untouched


def test_a_batch_dropped_while_its_checks_run_is_freed_after_them():
    """A request that fails drops its checks: those not started never run, those running finish before
    the batch is freed (the bytes stay referenced until then); the library goes on answering."""
    import gc

    import time

    files = _batch_files()
    for _ in range(5):
        checks = scan_check.Checks(files, 2)
        for k in range(0, len(files), 2):
            checks.drop(k)
        del checks
        gc.collect()
    deadline = time.monotonic() + 120  # a guard against a hang
    while scan_check.sweep_retired() and time.monotonic() < deadline:  # those kept aside end and are freed
        time.sleep(0.01)
    assert scan_check.sweep_retired() == 0
    assert scan_check.check(files[0]) is None


def test_an_empty_batch_is_refused():
    with pytest.raises(ValueError):
        scan_check.Checks([])


def test_a_batch_collected_while_its_checks_run_is_kept_aside_then_freed():
    """A request that ends (or fails) with checks still running does not wait for them: its batch is
    kept aside with the bytes they read, and freed once they end."""
    import time

    big = encode(photo_like(3000, 2000, seed=4), "JPEG", quality=95)  # tens of ms on one thread
    deadline = time.monotonic() + 120  # a guard against a hang
    while scan_check.sweep_retired() and time.monotonic() < deadline:  # none left by earlier tests
        time.sleep(0.01)
    checks = scan_check.Checks([big] * 3, 1)
    while not checks.running(0) and time.monotonic() < deadline:  # a worker has taken the first check
        time.sleep(0.0002)
    assert checks.running(0)
    del checks  # the queued checks are dropped; the running one is not waited for
    assert scan_check.sweep_retired() == 1  # kept aside
    while scan_check.sweep_retired() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scan_check.sweep_retired() == 0
    assert scan_check.check(big) is None


def test_a_process_that_exits_with_checks_running_and_a_thread_waiting_exits_cleanly():
    """At exit every open batch is closed (waiting for its running checks and for the call of a thread
    still waiting for a verdict) before the bytes go."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = (
        "import threading\n"
        "from backends.preprocess import scan_check\n"
        "from clients.samples import encode, photo_like\n"
        "big = encode(photo_like(2000, 1500, seed=4), 'JPEG', quality=95)\n"
        "kept = scan_check.Checks([big] * 4, 1)\n"
        "threading.Thread(target=kept.verdict, args=(3,), daemon=True).start()\n"
        "collected = scan_check.Checks([big] * 2, 1)\n"
        "del collected\n"
        "print('exiting')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "exiting", done.stderr[-2000:]


def test_a_decoded_images_dropped_check_sends_it_to_pillow_under_its_own_reason():
    from backends.preprocess.jpeg_gpu import GpuJpegDecoder

    files = _batch_files()[1:3]
    checks = scan_check.Checks(files)
    pending = {0: checks.pending(0), 1: checks.pending(1)}
    checks.close()  # as if something dropped them before settle
    assert GpuJpegDecoder.settle(pending) == {0: "scan_check_dropped", 1: "scan_check_dropped"}


def test_the_thread_count_comes_from_the_affinity_and_the_cgroup_quota(monkeypatch):
    """Every core the process may run on, up to 16."""
    from backends.preprocess import host_threads

    monkeypatch.setattr(host_threads, "CORES", 40)  # a host with more cores than 16
    assert scan_check._threads() == 16
    monkeypatch.setattr(host_threads, "CORES", 3)  # e.g. a container given three
    assert scan_check._threads() == 3
    if hasattr(os, "sched_getaffinity"):  # within the affinity (and the cgroup's quota, where one is set)
        assert 1 <= host_threads.available_cores() <= len(os.sched_getaffinity(0))


def _answered_unasked(checks: scan_check.Checks, n: int) -> bool:
    """Whether the pool's threads answer all n checks without a verdict being asked for (verdict() would
    run a queued check on the asking thread, which a missed wake-up would not stop)."""
    import time

    deadline = time.monotonic() + 60  # a guard against a hang: a missed wake-up leaves checks queued
    while not all(checks.done(k) for k in range(n)) and time.monotonic() < deadline:
        time.sleep(0.002)
    return all(checks.done(k) for k in range(n))


def test_queued_checks_wake_the_pools_threads_one_per_job():
    """Queued checks wake idle workers one signal per job (scan_check.c's wake_workers, not a broadcast):
    no job may be left without a thread. After a batch that grew the pool to many workers, single checks,
    a batch larger than the pool, and large scans split into tracks are all answered by the pool's
    threads without being asked for, each as check() answers it. (A missed wake-up fails this; a
    broadcast would pass it too.)"""
    blobs = [encode(photo_like(96 + 8 * k, 64, seed=k), "JPEG", quality=90) for k in range(20)]
    wide = scan_check.Checks(blobs, threads=16)
    assert _answered_unasked(wide, len(blobs))
    assert [wide.verdict(i) for i in range(len(blobs))] == [None] * len(blobs)
    wide.close()
    for blob in blobs[:5]:
        one = scan_check.Checks([blob], threads=16)
        assert _answered_unasked(one, 1) and one.verdict(0) is None
        one.close()
    large = encode(photo_like(1024, 768, seed=9), "JPEG", quality=95)  # a scan split into tracks
    assert len(large) >= 4 * 16 * 1024
    files = [*blobs, large, *(b for _, b in damaged(blobs[0], seed=3, count=12)), large]
    want = [scan_check.check(b, threads=1) for b in files]
    assert any(w is not None for w in want)  # some of the damage is refused
    walks = scan_check.parallel_counts()[0]
    mixed = scan_check.Checks(files, threads=4)
    assert _answered_unasked(mixed, len(files))
    assert [mixed.verdict(i) for i in range(len(want))] == want
    mixed.close()
    assert scan_check.parallel_counts()[0] >= walks + 2  # both large scans went the threaded way (tracks queued)
