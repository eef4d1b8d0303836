"""The stub's environment: which packages tritonserver's Python stub sees, and the numpy<2 guard.

The stub runs its embedded Python with -E (PYTHONPATH ignored) and takes site-packages from the
`python3` first on PATH; these tests run that interpreter the same way.
"""

import subprocess

import pytest

from backends.deploy import launcher, stub_env


def _fake_numpy(root, version):
    pkg = root / "numpy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return root


def test_stub_env_puts_kimi_stub_site_first_and_finds_backends(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_STUB_SITE", str(_fake_numpy(tmp_path / "site", "1.99.0")))
    bin_dir = stub_env.prepare_stub_env(tmp_path / "env")
    out = subprocess.run([str(bin_dir / "python3"), "-E", "-c",
                          "import numpy, backends, sys; print(numpy.__version__); print(backends.__file__)"],
                         capture_output=True, text=True, check=True, cwd=tmp_path)
    version, backends_file = out.stdout.split()
    assert version == "1.99.0"  # KIMI_STUB_SITE wins over our own numpy
    assert backends_file.startswith(str(stub_env.REPO_ROOT))  # found without relying on the working directory
    assert stub_env.stub_numpy_version(bin_dir) == "1.99.0"


def test_stub_env_without_override_sees_our_numpy(tmp_path, monkeypatch):
    import numpy

    monkeypatch.delenv("KIMI_STUB_SITE", raising=False)
    assert stub_env.stub_numpy_version(stub_env.prepare_stub_env(tmp_path / "env")) == numpy.__version__


def test_numpy_2_in_the_stub_is_refused_with_a_clear_error():
    stub_env.check_stub_numpy("1.26.4")
    with pytest.raises(RuntimeError, match=r"numpy 2\.5\.0.*numpy<2.*KIMI_STUB_SITE"):
        stub_env.check_stub_numpy("2.5.0")


def test_server_start_refuses_a_numpy_2_stub(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_STUB_SITE", str(_fake_numpy(tmp_path / "site", "2.1.0")))
    monkeypatch.setattr(launcher, "STUB_ENV", tmp_path / "env")
    srv = launcher.TritonServer(tmp_path / "repo", log_path=tmp_path / "log.txt")
    with pytest.raises(RuntimeError, match="numpy 2.1.0"):
        srv.start()
    assert srv.proc is None  # nothing was started


def test_a_half_made_stub_env_is_rebuilt(tmp_path, monkeypatch):
    # venv writes pyvenv.cfg before bin/python3: a start interrupted (or raced) in between must not stick.
    monkeypatch.delenv("KIMI_STUB_SITE", raising=False)
    env = stub_env.prepare_stub_env(tmp_path / "envs").parent
    (env / "bin" / "python3").unlink()
    bin_dir = stub_env.prepare_stub_env(tmp_path / "envs")
    assert bin_dir.parent == env and (bin_dir / "python3").exists()
    stub_env.stub_numpy_version(bin_dir)


def test_servers_with_different_stub_paths_get_different_envs(tmp_path, monkeypatch):
    # A server's stubs read the .pth while their models load: another server must not rewrite it then.
    monkeypatch.setenv("KIMI_STUB_SITE", str(_fake_numpy(tmp_path / "a", "1.97.0")))
    first = stub_env.prepare_stub_env(tmp_path / "envs")
    monkeypatch.setenv("KIMI_STUB_SITE", str(_fake_numpy(tmp_path / "b", "1.96.0")))
    second = stub_env.prepare_stub_env(tmp_path / "envs")
    assert first != second
    assert stub_env.stub_numpy_version(first) == "1.97.0" and stub_env.stub_numpy_version(second) == "1.96.0"


def test_a_relative_kimi_stub_site_is_made_absolute(tmp_path, monkeypatch):
    # site.py would read a relative .pth entry relative to the env's site-packages, not our directory.
    _fake_numpy(tmp_path / "site", "1.98.0")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KIMI_STUB_SITE", "site")
    assert stub_env.stub_numpy_version(stub_env.prepare_stub_env(tmp_path / "env")) == "1.98.0"
