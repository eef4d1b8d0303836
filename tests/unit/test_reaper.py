"""The reaper's bookkeeping (backends/deploy/reaper.py): what is still announced when the launcher's
pipe ends is killed and removed; what the launcher stopped itself is left alone."""

import subprocess

from backends.deploy.reaper import reap, watch


def test_what_is_still_announced_at_the_end_is_what_gets_reaped():
    groups, prefixes, folders = watch(["group 10\n", "shm kimi_a_\n", "group 11\n", "shm kimi_b_\n", "forget 10\n",
                                       "dir /tmp/repo\n"])
    assert groups == {11} and prefixes == {"kimi_a_", "kimi_b_"} and folders == {"/tmp/repo"}


def test_reap_kills_the_group_and_removes_its_regions(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    (tmp_path / "kimi_x_1").write_text("")
    (tmp_path / "kimi_x_2").write_text("")
    (tmp_path / "other").write_text("")
    (tmp_path / "repo" / "m").mkdir(parents=True)
    reap({sleeper.pid}, {"kimi_x_"}, {str(tmp_path / "repo")}, shm=tmp_path)
    assert sleeper.wait(timeout=5) == -9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]
