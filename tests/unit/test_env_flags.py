"""On/off settings from the environment read one way (backends.config.env_flag): KIMI_GPU_JPEG=false
used to leave GPU decoding on (only "0" turned it off), while KIMI_MPS took 1/true/yes/on. Whole numbers
likewise (env_int): a bad count used to stop the launcher with int()'s bare traceback."""

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


@pytest.mark.parametrize("name", ["KIMI_ENCODER_INSTANCES", "KIMI_PREPROCESS_INSTANCES"])
def test_a_bad_count_stops_the_launcher_with_one_line(monkeypatch, name):
    from backends.deploy.launcher import build_parser

    monkeypatch.setenv(name, "2.5")
    with pytest.raises(SystemExit, match=f"{name}='2.5'"):
        build_parser()
    monkeypatch.setenv(name, "3")
    args = build_parser().parse_args([])
    assert {"KIMI_ENCODER_INSTANCES": args.encoder_instances,
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
