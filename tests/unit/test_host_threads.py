"""How many host threads preprocessing starts: the cores the process may run on (its affinity), and no
more than its cgroup's CPU quota (a Kubernetes CPU limit), read from cgroup v2 or v1 files. Here the
files are written under a temporary folder standing in for /sys/fs/cgroup and /proc/self/cgroup."""

import os

import pytest

from backends.preprocess.host_threads import available_cores, cgroup_cpu_quota


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v2_quota_is_read_for_the_processs_cgroup_and_the_ones_above(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/kubepods/pod1/ctr\n")
    _write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")  # none on the container itself
    _write(root / "kubepods/pod1/cpu.max", "350000 100000\n")  # 3.5 CPUs on the pod
    _write(root / "kubepods/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(3.5)
    affinity = len(os.sched_getaffinity(0))
    assert available_cores(root, proc) == min(affinity, 4)  # rounded up


def test_a_namespaced_container_reads_the_top_and_no_quota_means_none(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "0::/\n")
    _write(root / "cpu.max", "100000 100000\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(1.0) and available_cores(root, proc) == 1
    _write(root / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, proc) is None
    assert available_cores(root, proc) == len(os.sched_getaffinity(0))


def test_a_v1_quota_and_what_cannot_be_read(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc-cgroup"
    _write(proc, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\nbroken line\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "200000\n")
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(root, proc) == pytest.approx(2.0)
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")  # no quota
    assert cgroup_cpu_quota(root, proc) is None
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "garbage\n")
    assert cgroup_cpu_quota(root, proc) is None
    assert cgroup_cpu_quota(root, tmp_path / "missing") is None
    assert available_cores(root, tmp_path / "missing") == len(os.sched_getaffinity(0))
