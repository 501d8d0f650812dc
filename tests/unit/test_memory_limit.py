"""gpuhub.kernel.memory_limit: reading a process's memory limit and its kills in both cgroup layouts."""

from __future__ import annotations

from pathlib import Path

from gpuhub.kernel import memory_limit

UNIT = "/system.slice/gpuhub-kernel-k-r0.service"


def cgroup(root: Path, where: str, files: dict[str, str]) -> None:
    d = root / where / UNIT.lstrip("/")
    d.mkdir(parents=True)
    for name, text in files.items():
        (d / name).write_text(text)


def test_cgroup_v2_as_on_debian_12(tmp_path):
    cgroup(tmp_path, "", {"memory.max": "2147483648\n",
                          "memory.events": "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n"})
    proc = f"0::{UNIT}\n"
    assert memory_limit.limit_bytes(tmp_path, proc) == 2 << 30
    assert memory_limit.oom_counts(tmp_path, proc) == memory_limit.OomCounts(limit_hits=1, kills=1)


def test_cgroup_v1_memory_controller_of_a_hybrid_host_wins_over_the_unified_tree(tmp_path):
    cgroup(tmp_path, "memory", {"memory.limit_in_bytes": "536870912\n", "memory.failcnt": "17\n",  # not used
                                "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"})
    cgroup(tmp_path, "unified", {})  # the unified tree of a hybrid host has no memory controller
    proc = f"12:pids:{UNIT}\n4:memory:{UNIT}\n1:name=systemd:{UNIT}\n0::{UNIT}\n"
    assert memory_limit.limit_bytes(tmp_path, proc) == 512 << 20
    assert memory_limit.oom_counts(tmp_path, proc) == memory_limit.OomCounts(limit_hits=None, kills=3)
    assert memory_limit.describe(512 << 20) == "512 MiB" and memory_limit.describe(2 << 30) == "2.0 GiB"


def test_no_limit_and_nothing_readable_answer_none(tmp_path):
    cgroup(tmp_path, "", {"memory.max": "max\n"})
    assert memory_limit.limit_bytes(tmp_path, f"0::{UNIT}\n") is None
    assert memory_limit.oom_counts(tmp_path, f"0::{UNIT}\n") is None  # no memory.events
    assert memory_limit.limit_bytes(tmp_path / "nowhere", f"0::{UNIT}\n") is None
    assert memory_limit.oom_counts(tmp_path, "garbage") is None
    bad = tmp_path / "bad"  # never raises into a cell's error report: undecodable or odd digits
    cgroup(bad, "", {"memory.max": "\u00b2\n"})
    (bad / UNIT.lstrip("/") / "memory.events").write_bytes(b"oom \xff\noom_kill 1\n")
    assert memory_limit.limit_bytes(bad, f"0::{UNIT}\n") is None
    assert memory_limit.oom_counts(bad, f"0::{UNIT}\n") is None


def test_a_kill_is_named_by_what_ran_out(monkeypatch):
    monkeypatch.setattr(memory_limit, "limit_bytes", lambda: 2 << 30)
    before = memory_limit.OomCounts(limit_hits=4, kills=1)
    # this cgroup's own limit reached, and a process killed: the limit did it
    assert memory_limit.killed_by(before, memory_limit.OomCounts(5, 2)) == (
        "out of memory, this kernel's processes reached their limit of 2.0 GiB")
    # killed without this cgroup reaching its limit: the server (or a parent slice) ran out
    assert memory_limit.killed_by(before, memory_limit.OomCounts(4, 2)) == (
        "out of memory, the server ran out (this kernel's limit was not reached)")
    # cgroup v1 cannot tell the two apart
    v1 = memory_limit.OomCounts(limit_hits=None, kills=1)
    assert memory_limit.killed_by(v1, memory_limit.OomCounts(None, 2)) == (
        "out of memory (this kernel's limit is 2.0 GiB, or the server ran out)")
    monkeypatch.setattr(memory_limit, "limit_bytes", lambda: None)
    assert memory_limit.killed_by(v1, memory_limit.OomCounts(None, 2)) == "out of memory"
    # no kill counted (a SIGKILL from someone else), or nothing known: nothing said
    assert memory_limit.killed_by(before, memory_limit.OomCounts(9, 1)) == ""
    assert memory_limit.killed_by(None, memory_limit.OomCounts(5, 2)) == ""
    assert memory_limit.killed_by(before, None) == ""


def test_this_process_can_be_asked():
    counts = memory_limit.oom_counts()
    assert counts is None or counts.kills >= 0
    limit = memory_limit.limit_bytes()
    assert limit is None or limit > 0
