"""Holds Linux's CPU wake-up latency limit (0 us unless told otherwise) for as long as it runs.

A server stub sleeps while the encoder runs (about 20 ms a request) and then has a few milliseconds of
Python to do; a core waking from a deep idle state, with cold caches, does that work slower. Writing a
32-bit limit in microseconds to /dev/cpu_dma_latency and keeping the file open is the kernel's PM QoS
interface for this (what tuned's latency-performance profile does): the CPU idle governor then avoids
states that take longer to leave; the limit ends when the file closes. It costs idle power on every
core. Needs write access to the device file (root, or a container given it). Where the kernel has no
idle driver (a VM's guest may have none) there is no governor to read the limit.

    python -m backends.deploy.cpu_latency            # hold until interrupted
    python -m backends.deploy.cpu_latency --check    # say whether this machine allows it, then exit

The launcher holds it for the server's lifetime with --cpu-latency-us 0 (KIMI_CPU_LATENCY_US=0).
Measured on the H200 machine (a VM without a guest idle driver, so the effect there is unexplained):
bench/results/h200-2026-12-01-sixth.md#cpu-wake-up-latency.
"""

import argparse
import os
import signal
import struct
import sys

DEVICE = "/dev/cpu_dma_latency"
MAX_US = 2**31 - 1  # the kernel reads a signed 32-bit value


def _checked(value: int) -> int:
    if not 0 <= value <= MAX_US:
        raise ValueError(f"a CPU wake-up latency limit is 0 to {MAX_US} microseconds, got {value}")
    return value


def limit(text: str) -> int:
    """A limit given as text (a flag or KIMI_CPU_LATENCY_US): whole microseconds, 0 to MAX_US."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"a CPU wake-up latency limit is whole microseconds, got {text!r}") from None
    return _checked(value)


def hold(limit_us: int = 0, path: str = DEVICE) -> int:
    """Opens the device, writes the limit and returns the open descriptor (close it to release)."""
    packed = struct.pack("i", _checked(limit_us))  # refused before anything is opened
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, packed)
    except OSError:
        os.close(fd)
        raise
    return fd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-us", type=limit, default=0)
    ap.add_argument("--check", action="store_true", help="hold for an instant, report, exit")
    args = ap.parse_args(argv)
    try:
        fd = hold(args.limit_us)
    except OSError as exc:
        print(f"cpu_latency: cannot hold {DEVICE}: {exc}", file=sys.stderr)
        return 1
    if args.check:
        print(f"cpu_latency: this machine lets us hold {DEVICE} (released again)", flush=True)
    else:
        print(f"cpu_latency: holding {DEVICE} at {args.limit_us} us", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
