"""The Python-backend stub's environment: which packages the stub imports, and refusing numpy >= 2.

Why this module exists (docs/triton_runtime.md#the-python-stub-and-numpy-2): the tritonserver 2.51
stub embeds Python with -E, so it ignores PYTHONPATH, and it takes sys.prefix, hence its
site-packages, from the `python3` first on PATH. Its pybind11 also predates numpy 2's ABI: under
numpy >= 2 a BYTES input arrives as filler bytes and the stub aborts, and outputs built from numpy
arrive empty. So the launcher gives the stub a bare virtualenv of its own, first on the server's PATH,
whose .pth file lists exactly what the stub must see, and refuses to start when that would still
import numpy >= 2 - a clear error at start beats a crash, or zeros, at the first request.

On a host whose own Python has numpy 2 (the GPU machine), put a folder holding numpy < 2 in
KIMI_STUB_SITE (`pip install --target DIR 'numpy<2'`): it goes first on the stub's path.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def stub_paths() -> list[str]:
    """What the stub's Python must see, in order: KIMI_STUB_SITE (e.g. a folder with numpy < 2 on a host
    whose own numpy is 2.x), this repository (for `backends` and `contract`), our PYTHONPATH (e.g. an
    optional flash-attn install), then our interpreter's site-packages."""
    # Absolute paths only: site.py reads a relative .pth entry relative to the env's site-packages.
    paths = [os.environ.get("KIMI_STUB_SITE", ""), str(REPO_ROOT)]
    paths += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    paths = [str(Path(p).resolve()) for p in paths if p]
    paths += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    return list(dict.fromkeys(p for p in paths if p))


def prepare_stub_env(root: Path) -> Path:
    """A bare virtualenv whose site-packages holds one .pth file listing `stub_paths()`; returns its bin/.

    One env per distinct path list (root/<hash>): servers started with different KIMI_STUB_SITE or
    PYTHONPATH never rewrite each other's .pth while their stubs are still starting.
    """
    paths = stub_paths()
    dest = root / hashlib.sha1("\n".join(paths).encode()).hexdigest()[:12]
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Servers may start side by side (several processes): one at a time builds the env, so that none
    # sees a half-made one (venv writes pyvenv.cfg before bin/python3) or has it cleared under it. An
    # env made by another interpreter (a Python upgrade) is rebuilt.
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cfg = dest / "pyvenv.cfg"
        site = dest / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        current = cfg.exists() and ("version = %d.%d.%d" % sys.version_info[:3]) in cfg.read_text().splitlines()
        if not (current and (dest / "bin" / "python3").exists() and (site / "kimi_vision.pth").exists()):
            venv.create(dest, with_pip=False, symlinks=True, clear=True)
            site.mkdir(parents=True, exist_ok=True)
            (site / "kimi_vision.pth").write_text("\n".join(paths) + "\n")
    return dest / "bin"


def stub_numpy_version(bin_dir: Path) -> str:
    """The numpy version the stub will import (its interpreter, -E like the stub)."""
    out = subprocess.run([str(bin_dir / "python3"), "-E", "-c", "import numpy; print(numpy.__version__)"],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"the Python stub's environment cannot import numpy:\n{out.stderr[-2000:]}")
    return out.stdout.strip()


def check_stub_numpy(version: str) -> None:
    """Refuse to start the 2.51 server when its stub would run under numpy >= 2."""
    if int(version.split(".")[0]) >= 2:
        raise RuntimeError(
            f"the tritonserver Python stub would import numpy {version}; the bundled Triton 2.51 stub corrupts "
            f"tensors under numpy >= 2. Install numpy<2 in this environment (requirements.txt pins it), or put a "
            f"folder holding numpy<2 in KIMI_STUB_SITE (pip install --target DIR 'numpy<2').")


def stub_bin(root: Path) -> Path:
    """The stub env's bin/ for the server's PATH, checked (docs/triton_runtime.md#the-python-stub-and-numpy-2)."""
    bin_dir = prepare_stub_env(root)
    check_stub_numpy(stub_numpy_version(bin_dir))
    return bin_dir
