"""The CPU wake-up latency hold (backends/deploy/cpu_latency.py) and the launcher's --cpu-latency-us. A
plain file stands in for /dev/cpu_dma_latency: what matters is the 32-bit value written and that the
descriptor stays open until released."""

import os
import struct

import pytest

from backends.deploy import cpu_latency
from backends.deploy.launcher import build_parser, hold_cpu_latency


def test_hold_writes_the_limit_as_a_32_bit_integer_and_keeps_the_file_open(tmp_path):
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    fd = cpu_latency.hold(25, str(dev))
    try:
        os.fstat(fd)  # still open: the kernel keeps the limit only while it is
        assert dev.read_bytes() == struct.pack("i", 25)
    finally:
        os.close(fd)


def test_launcher_leaves_the_limit_alone_unless_asked(monkeypatch):
    monkeypatch.delenv("KIMI_CPU_LATENCY_US", raising=False)
    assert build_parser().parse_args([]).cpu_latency_us is None
    assert hold_cpu_latency(None) is None
    monkeypatch.setenv("KIMI_CPU_LATENCY_US", "0")
    assert build_parser().parse_args([]).cpu_latency_us == 0


def test_launcher_serves_on_with_a_warning_where_the_limit_cannot_be_held(tmp_path, capsys):
    assert hold_cpu_latency(0, str(tmp_path / "absent" / "cpu_dma_latency")) is None
    out = capsys.readouterr().out
    assert "cannot hold" in out and "serving without it" in out


def test_launcher_holds_the_limit_it_was_given(tmp_path):
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    fd = hold_cpu_latency(0, str(dev))
    try:
        assert fd is not None and dev.read_bytes() == struct.pack("i", 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", ["abc", "-1", str(2**31), "1.5"])
def test_a_limit_that_is_not_0_to_2_31_minus_1_microseconds_is_a_usage_error(bad, monkeypatch, capsys):
    monkeypatch.setenv("KIMI_CPU_LATENCY_US", bad)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([])
    assert exc.value.code == 2 and "--cpu-latency-us" in capsys.readouterr().err
    monkeypatch.delenv("KIMI_CPU_LATENCY_US")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cpu-latency-us", bad])


def test_hold_refuses_a_bad_limit_before_opening_anything(tmp_path, monkeypatch):
    opened, real_open = [], os.open
    monkeypatch.setattr(cpu_latency.os, "open", lambda *a, **k: opened.append(a) or real_open(*a, **k))
    dev = tmp_path / "cpu_dma_latency"
    dev.write_bytes(b"")
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match="microseconds"):
            cpu_latency.hold(bad, str(dev))
    assert opened == [] and dev.read_bytes() == b""
