"""On/off settings from the environment read one way (backends.config.env_flag): KIMI_GPU_JPEG=false
used to leave GPU decoding on (only "0" turned it off), while KIMI_MPS took 1/true/yes/on. Whole numbers
likewise (env_int): a bad KIMI_FUSED_LANES used to stop the launcher with int()'s bare traceback."""

from pathlib import Path

import pytest
import torch
from PIL import Image

from backends.config import env_flag, env_int
from backends.preprocess.jpeg_gpu import GpuJpegDecoder


@pytest.mark.parametrize("value,want", [("1", True), ("true", True), ("Yes", True), (" on ", True),
                                        ("0", False), ("false", False), ("NO", False), ("off", False)])
def test_words_for_on_and_off(monkeypatch, value, want):
    monkeypatch.setenv("KIMI_SOME_FLAG", value)
    assert env_flag("KIMI_SOME_FLAG", not want) is want


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch, default):
    monkeypatch.delenv("KIMI_SOME_FLAG", raising=False)
    assert env_flag("KIMI_SOME_FLAG", default) is default
    monkeypatch.setenv("KIMI_SOME_FLAG", "  ")
    assert env_flag("KIMI_SOME_FLAG", default) is default


def test_anything_else_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("KIMI_SOME_FLAG", "disabled")
    with pytest.raises(ValueError, match="KIMI_SOME_FLAG='disabled'"):
        env_flag("KIMI_SOME_FLAG", True)


def test_whole_numbers_unset_set_and_refused_by_name(monkeypatch):
    monkeypatch.delenv("KIMI_SOME_COUNT", raising=False)
    assert env_int("KIMI_SOME_COUNT", 3) == 3
    monkeypatch.setenv("KIMI_SOME_COUNT", " 7 ")
    assert env_int("KIMI_SOME_COUNT", 3) == 7
    monkeypatch.setenv("KIMI_SOME_COUNT", "two")
    with pytest.raises(ValueError, match="KIMI_SOME_COUNT='two': expected a whole number"):
        env_int("KIMI_SOME_COUNT", 3)


@pytest.mark.parametrize("name", ["KIMI_FUSED_LANES", "KIMI_ENCODER_INSTANCES", "KIMI_PREPROCESS_INSTANCES"])
def test_a_bad_count_stops_the_launcher_with_one_line(monkeypatch, name):
    from backends.deploy.launcher import build_parser

    monkeypatch.setenv(name, "2.5")
    with pytest.raises(SystemExit, match=f"{name}='2.5'"):
        build_parser()
    monkeypatch.setenv(name, "3")
    args = build_parser().parse_args([])
    assert {"KIMI_FUSED_LANES": args.fused_lanes, "KIMI_ENCODER_INSTANCES": args.encoder_instances,
            "KIMI_PREPROCESS_INSTANCES": args.preprocess_instances}[name] == 3


def test_kimi_gpu_jpeg_false_turns_gpu_decoding_off(monkeypatch):
    monkeypatch.setenv("KIMI_GPU_JPEG", "false")
    decoder = GpuJpegDecoder(torch.device("cpu"))
    assert not decoder.enabled and decoder.off_reason == "turned off (KIMI_GPU_JPEG, or gpu_jpeg=False)"
    assert decoder.reason(Image.new("RGB", (4, 4))) == "not_jpeg"


def test_a_bad_kimi_mps_stops_the_launcher_with_one_line(monkeypatch):
    from backends.deploy.launcher import build_parser

    monkeypatch.setenv("KIMI_MPS", "maybe")
    with pytest.raises(SystemExit, match="KIMI_MPS='maybe'"):
        build_parser()


def test_kimi_fused_renders_the_fused_model_and_a_bad_word_stops_the_launcher(monkeypatch):
    from backends.deploy.launcher import build_parser

    monkeypatch.delenv("KIMI_FUSED", raising=False)
    assert build_parser().parse_args([]).fused is False
    monkeypatch.setenv("KIMI_FUSED", "yes")
    assert build_parser().parse_args([]).fused is True
    assert build_parser().parse_args(["--no-fused"]).fused is False
    monkeypatch.setenv("KIMI_FUSED", "maybe")
    with pytest.raises(SystemExit, match="KIMI_FUSED='maybe'"):
        build_parser()


def test_kimi_profile_torch_is_read_only_when_profiling(monkeypatch):
    from backends.serving.profiling import ExecuteProfiler

    monkeypatch.setenv("KIMI_PROFILE_TORCH", "maybe")
    monkeypatch.delenv("KIMI_PROFILE_DIR", raising=False)
    assert ExecuteProfiler("m").torch is True  # not profiling: the word is never read
    monkeypatch.setenv("KIMI_PROFILE_DIR", "/tmp/profile")
    with pytest.raises(ValueError, match="KIMI_PROFILE_TORCH"):
        ExecuteProfiler("m")


@pytest.mark.parametrize("value,handle", [("", "HeaderOnly"), ("on", "HeaderOnly"), ("off", "JpegImageFile")])
def test_kimi_jpeg_header_chooses_who_reads_headers(value, handle):
    """KIMI_JPEG_HEADER, read once as the process imports the decode module (a stub takes it from the
    server's environment): a plain JPEG's handle comes from our header reader unless it says off."""
    import os
    import subprocess
    import sys

    code = ("import io; from PIL import Image; from backends.preprocess.decode import open_image\n"
            "buf = io.BytesIO(); Image.new('RGB', (8, 8)).save(buf, 'JPEG')\n"
            "print(type(open_image(buf.getvalue(), 0, 10**6)).__name__)")
    env = {**os.environ, "KIMI_JPEG_HEADER": value}
    root = Path(__file__).resolve().parents[2]  # `backends` importable wherever pytest was started
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == handle
