"""How many host threads preprocessing starts: the cores the process may run on (its affinity), and no
more than its cgroup's CPU quota (a Kubernetes CPU limit), read from cgroup v2 or v1 files. Here the
files are written under a temporary folder standing in for /sys/fs/cgroup and /proc/self/cgroup."""

import os
import shutil
from pathlib import Path

import pytest

from backends.preprocess import host_threads
from backends.preprocess.host_threads import available_cores, cgroup_cpu_quota


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)


@pytest.fixture
def many_cores(monkeypatch):
    """A process allowed 64 cores, so that the quota, not this machine, decides."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))


def test_the_smallest_v2_quota_of_the_cgroup_and_those_above_counts_rounded_up(tmp_path, many_cores):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    _write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")  # none on the container itself
    _write(root / "kubepods/pod1/cpu.max", "350000 100000\n")  # 3.5 CPUs on the pod
    _write(root / "kubepods/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(3.5) and available_cores(root, proc) == 4
    _write(root / "kubepods/pod1/ctr/cpu.max", "150000 100000\n")  # a smaller one below: it counts
    assert cgroup_cpu_quota(root, proc) == pytest.approx(1.5) and available_cores(root, proc) == 2
    _write(root / "kubepods/pod1/ctr/cpu.max", "500000 100000\n")  # a larger one below: the pod's counts
    _write(root / "kubepods/cpu.max", "250000 100000\n")  # and a smaller one further up
    assert cgroup_cpu_quota(root, proc) == pytest.approx(2.5) and available_cores(root, proc) == 3


def test_a_namespaced_container_reads_the_top_and_no_quota_leaves_the_affinity(tmp_path, many_cores):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/\n")
    _write(root / "cpu.max", "100000 100000\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(1.0) and available_cores(root, proc) == 1
    _write(root / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, proc) is None and available_cores(root, proc) == 64


def test_a_path_that_leaves_the_namespace_is_not_followed(tmp_path, many_cores):
    root, proc = tmp_path / "mnt" / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/..\n")
    _write(root / "cpu.max", "100000 100000\n")  # the namespace's own top: not this process's cgroup
    _write(root.parent / "cpu.max", "100000 100000\n")  # outside the mount
    assert cgroup_cpu_quota(root, proc) is None and available_cores(root, proc) == 64


def test_v1_quotas_under_each_mount_name_and_up_the_tree(tmp_path, many_cores):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    for mount in ("cpu,cpuacct", "cpuacct,cpu", "cpu"):
        shutil.rmtree(root, ignore_errors=True)  # one mount name at a time
        _write(proc, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\nbroken line\n")
        _write(root / mount / "docker/abc/cpu.cfs_quota_us", "-1\n")  # none on the container
        _write(root / mount / "docker/abc/cpu.cfs_period_us", "100000\n")
        _write(root / mount / "docker/cpu.cfs_quota_us", "200000\n")  # 2 CPUs one level up
        _write(root / mount / "docker/cpu.cfs_period_us", "100000\n")
        assert cgroup_cpu_quota(root, proc) == pytest.approx(2.0), mount
        assert available_cores(root, proc) == 2
    _write(root / "cpu/docker/cpu.cfs_quota_us", "garbage\n")
    assert cgroup_cpu_quota(root, proc) is None


def test_what_cannot_be_read_gives_no_quota_and_never_raises(tmp_path, many_cores, monkeypatch):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    assert cgroup_cpu_quota(root, tmp_path / "missing") is None
    assert available_cores(root, tmp_path / "missing") == 64
    _write(proc, b"0::/caf\xe9\n")  # a cgroup name that is not UTF-8
    _write(root / "cpu.max", "100000 100000\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(1.0)  # read with the name replaced; the top still counts
    _write(proc, "4:cpu,cpuacct:/x\n")

    def refused(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_dir", refused)  # a cgroup folder we may not search
    assert cgroup_cpu_quota(root, proc) is None and available_cores(root, proc) == 64
    assert host_threads.THREADS == min(8, host_threads.CORES)  # Pillow's threads: the cores read once, up to 8
