"""``gpuhub local-kernel`` as a user runs it, in a terminal of its own: ready only once the kernel
answers; a replica's start error is printed and ends it; Ctrl-C leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from jupyter_client import BlockingKernelClient

from gpuhub.dev.cluster import is_unit_process
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a daemon's zombie waits for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def processes_using(path: Path) -> dict[int, str]:
    """Running processes whose command line names something under ``path`` (the daemons' configs,
    the replicas' connection files): pid -> command line."""
    found = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(path) in cmdline and running(int(proc.name)):
                found[int(proc.name)] = cmdline
    return found


class LocalKernel:
    """``gpuhub local-kernel`` in a new session (its own process group, as a shell's job is)."""

    def __init__(self, tmp: Path, *args: str, pythonpath: tuple[str, ...] = ()) -> None:
        self.out, self.err = tmp / "local-kernel.out", tmp / "local-kernel.err"
        self.connection_file = tmp / "kernel.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*pythonpath, str(ROOT), env.get("PYTHONPATH", "")) if p)
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuhub.admin.cli", "local-kernel", "--connection-file",
                 str(self.connection_file), "--workdir", str(tmp / "work"), *args],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=tmp, env=env, start_new_session=True)

    def stderr(self) -> str:
        return self.err.read_text()

    def ready(self, timeout: float = 120) -> dict:
        line = wait_for(lambda: self.out.read_text().strip() or self.proc.poll() is not None, timeout=timeout,
                        what="local-kernel's ready line")
        assert isinstance(line, str), f"local-kernel exited {self.proc.returncode}:\n{self.stderr()}"
        return json.loads(line)

    def close(self, workdir: Path) -> None:
        """Stop it if a test failed early, and kill whatever it left (a failed test must not leave
        processes on a shared machine)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        for pid in processes_using(workdir):
            try:
                os.killpg(pid, signal.SIGKILL) if is_unit_process(pid) else os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def assert_everything_stopped(lk: LocalKernel, ready: dict, workdir: Path) -> None:
    """local-kernel has ended: no replica, agent or scheduler it started runs, and the connection
    file it wrote is gone (as a kernel manager removes the file it wrote)."""
    started = [*ready["agents"], ready["scheduler"], *(r["pid"] for r in ready["replicas"])]
    # local-kernel waited for its daemons; replicas lead sessions of their own, so check each.
    wait_for(lambda: not any(running(p) for p in started), timeout=30,
             what="every replica, agent and scheduler process to be gone")
    assert processes_using(workdir) == {}
    assert "local kernel stopped" in lk.stderr()
    assert not lk.connection_file.exists()


def test_ctrl_c_to_the_process_group_stops_every_replica_and_daemon(tmp_path):
    lk = LocalKernel(tmp_path, "--replicas", "3")
    try:
        ready = lk.ready()
        kc = BlockingKernelClient()
        kc.load_connection_file(ready["connection_file"])
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=30)  # it was ready before it said so
        finally:
            kc.stop_channels()
        replicas = [r["pid"] for r in ready["replicas"]]
        assert len(replicas) == 3 and all(is_unit_process(p) for p in replicas)
        # What a terminal does on Ctrl-C: SIGINT to every process of the foreground group.
        os.killpg(lk.proc.pid, signal.SIGINT)
        assert lk.proc.wait(60) == 0, lk.stderr()
        assert_everything_stopped(lk, ready, tmp_path / "work")
    finally:
        lk.close(tmp_path / "work")


def test_a_kernel_its_client_shuts_down_ends_local_kernel_and_everything_it_started(tmp_path):
    lk = LocalKernel(tmp_path, "--replicas", "3")
    try:
        ready = lk.ready()
        kc = BlockingKernelClient()
        kc.load_connection_file(ready["connection_file"])
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=30)
            kc.shutdown()  # what `exit` in jupyter console sends
        finally:
            kc.stop_channels()
        assert lk.proc.wait(120) == 0, lk.stderr()
        assert "the kernel was shut down by its client" in lk.stderr()
        assert_everything_stopped(lk, ready, tmp_path / "work")
    finally:
        lk.close(tmp_path / "work")


def test_a_replica_that_cannot_start_is_reported_and_everything_stops(tmp_path):
    broken = tmp_path / "broken" / "pysyncobj"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('simulated: pysyncobj needs cryptography')\n")
    lk = LocalKernel(tmp_path, "--replicas", "3", "--start-timeout", "60", pythonpath=(str(broken.parent),))
    try:
        assert lk.proc.wait(90) == 1
        err = lk.stderr()
        assert "gpuhub local-kernel: the kernel did not start" in err
        assert "ImportError: simulated: pysyncobj needs cryptography" in err
        assert "waiting for the kernel to answer" in err and "local kernel stopped" in err
        assert lk.out.read_text() == ""  # no ready line, no connection file
        assert not lk.connection_file.exists()
        # every replica and daemon it started is gone (it waits for them before it exits)
        assert processes_using(tmp_path / "work") == {}
    finally:
        lk.close(tmp_path / "work")


def test_a_kernel_that_never_answers_ends_at_the_start_timeout_with_each_replicas_log(tmp_path):
    stuck = tmp_path / "stuck" / "pysyncobj"
    stuck.mkdir(parents=True)
    (stuck / "__init__.py").write_text("import sys, threading\n"
                                       "print('replica stuck importing pysyncobj', file=sys.stderr, flush=True)\n"
                                       "threading.Event().wait()\n")
    lk = LocalKernel(tmp_path, "--replicas", "2", "--start-timeout", "10", pythonpath=(str(stuck.parent),))
    try:
        assert lk.proc.wait(90) == 1
        err = lk.stderr()
        assert "the kernel did not answer within 10 s" in err
        assert err.count("replica stuck importing pysyncobj") == 2  # the end of each replica's log
        assert "still waiting for the kernel to answer" in err  # progress while it waited
        assert lk.out.read_text() == "" and processes_using(tmp_path / "work") == {}
    finally:
        lk.close(tmp_path / "work")
