"""The heap allocator tritonserver and its Python stubs run with: jemalloc, preloaded, where there is one.

Why (docs/operations.md#memory): with glibc's malloc, a peak of large requests leaves the server's heap
where the peak took it. Triton's documentation recommends preloading tcmalloc or jemalloc for such growth
(its user guide, model_management.md); both ship in NGC's image. Measured on our CPU server, four
256 MB requests of garbage, two at a time, then 3 s idle: the server process kept +366 MiB with glibc,
+1.7 GiB with tcmalloc-minimal 2.10 (TCMALLOC_RELEASE_RATE=200) and +3 MiB with jemalloc 5.3 and
MALLOC_CONF below (a background thread returns freed pages after a second). So jemalloc, or glibc's.

Where it is looked for, first found wins:
- KIMI_MALLOC: a library path to preload instead, or `glibc` (or off, none, 0) to preload nothing;
- the system's libjemalloc (NGC's image; Debian's libjemalloc2);
- `<sys.prefix>/lib/jemalloc/libjemalloc.so.2`, where `make setup` unpacks Debian's libjemalloc2 when
  the system has none (no root needed: `apt-get download`).
MALLOC_CONF is left as the operator set it, if set.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Return freed pages to the system within about a second, from a background thread (jemalloc's default
# waits 10 s and only while the process keeps allocating, which an idle server does not).
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"
_OFF = ("glibc", "off", "none", "0", "no", "false")


@dataclass(frozen=True)
class Allocator:
    name: str  # "jemalloc", "glibc" or the preloaded library's file name
    library: str = ""  # what LD_PRELOAD gets; empty: nothing (glibc's malloc)
    why: str = ""  # for glibc: why nothing is preloaded

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The variables to add to `base` (the server's environment, which its stubs inherit)."""
        if not self.library:
            return {}
        preload = [self.library, *(p for p in base.get("LD_PRELOAD", "").replace(":", " ").split() if p != self.library)]
        out = {"LD_PRELOAD": " ".join(preload)}
        if self.name == "jemalloc" and not base.get("MALLOC_CONF"):
            out["MALLOC_CONF"] = JEMALLOC_CONF
        return out

    def note(self, base: dict[str, str] | None = None) -> str:
        """The launcher's one line on it."""
        if not self.library:
            return (f"memory allocator: glibc malloc ({self.why}); heap memory may stay at the peak of large "
                    "requests: install libjemalloc2 (docs/operations.md#memory)")
        conf = self.env(base if base is not None else dict(os.environ)).get("MALLOC_CONF") or os.environ.get("MALLOC_CONF", "")
        return (f"memory allocator: {self.name} ({self.library}) preloaded for tritonserver and its stubs"
                + (f", MALLOC_CONF={conf}" if conf else ""))


def _multiarch() -> str:
    return sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"


def jemalloc_candidates() -> list[Path]:
    arch = _multiarch()
    return [Path(f"/usr/lib/{arch}/libjemalloc.so.2"), Path(f"/usr/lib/{arch}/libjemalloc.so"),
            Path("/usr/local/lib/libjemalloc.so.2"), Path("/usr/lib64/libjemalloc.so.2"),
            bundled_jemalloc()]


def bundled_jemalloc() -> Path:
    """Where `make setup` unpacks Debian's libjemalloc2 into the virtualenv."""
    return Path(sys.prefix) / "lib" / "jemalloc" / "libjemalloc.so.2"


def preloads(library: str) -> bool:
    """Whether the dynamic loader takes `library` as a preload (right architecture, loadable): the
    loader only warns and carries on without it otherwise."""
    try:
        out = subprocess.run(["/bin/true"], env={**os.environ, "LD_PRELOAD": library}, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "cannot be preloaded" not in out.stderr


def find(setting: str | None = None) -> Allocator:
    """The allocator for this host (module docstring). A KIMI_MALLOC that names no loadable library raises,
    naming it."""
    setting = (os.environ.get("KIMI_MALLOC", "") if setting is None else setting).strip()
    if setting.lower() in _OFF:
        return Allocator("glibc", why="KIMI_MALLOC=" + setting)
    if setting:
        if not Path(setting).is_file() or not preloads(setting):
            raise ValueError(f"KIMI_MALLOC={setting!r}: not a library that can be preloaded (or glibc to preload none)")
        name = "jemalloc" if "jemalloc" in Path(setting).name else Path(setting).name
        return Allocator(name, setting)
    for path in jemalloc_candidates():
        if path.is_file() and preloads(str(path)):
            return Allocator("jemalloc", str(path))
    return Allocator("glibc", why="no libjemalloc found on this host")
