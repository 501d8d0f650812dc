"""Start, stop and list units (kernel replicas, user notebook servers) as the user, never root.

``SystemdRunner`` is the real thing: transient units through ``systemd-run`` with limits,
``NoNewPrivileges`` and a 0400 environment file for secrets (docs/architecture.md D6). ``ProcessRunner`` runs
plain child processes, for trying gpuhub on one machine and for fast tests; it is never used by the
Ansible roles.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from gpuhub.platform.accounts import AccountError, notebook_account
from gpuhub.platform.exit_status import DISK_FULL_EXIT

log = logging.getLogger(__name__)

UNIT_NAME = re.compile(r"^gpuhub-(kernel|server)-[a-z0-9][a-z0-9_.-]{0,120}$")
# The end of a unit's log that the agent reads back: enough for a traceback's last lines.
LOG_TAIL_BYTES = 64 * 1024


class UnitError(RuntimeError):
    """Starting/stopping a unit failed; the message is for the API client."""


class UnitConflict(UnitError):
    """A start names a unit that runs already for another user or with other settings (409)."""


@dataclass
class UnitSpec:
    name: str
    kind: str  # "kernel" | "server"
    user: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    memory_max: str = ""
    cpu_quota: str = ""
    files: dict[str, str] = field(default_factory=dict)  # private files the unit reads, by name
    # DeviceAllow= entries under DevicePolicy=closed (gpuhub/agent/device_gate.py); None: systemd's default
    devices: tuple[str, ...] | None = None


@dataclass
class UnitStatus:
    name: str
    active: bool
    state: str  # active | activating | inactive | failed | gone
    main_pid: int | None
    user: str | None
    restarts: int = 0  # times systemd started it again after it failed (Restart=on-failure)


# Every kernel and server unit (docs/security.md): other users' processes and homes out of sight, no
# setuid files, the system and kernel knobs read-only, and the system calls no notebook needs and
# kernel exploits like (setting clocks, modules, mounts, swap, raw I/O, obsolete and emulation calls)
# answered EPERM. Devices are not closed here (PrivateDevices would hide /dev/nvidia*, ProtectClock
# would add a DeviceAllow= that closes every other device even under device_policy "open"): a
# unit's device list is the grant's business (gpuhub/agent/device_gate.py).
USER_UNIT_HARDENING = (
    "ProtectSystem=full",
    "ProtectHome=tmpfs",
    "ProtectProc=invisible",
    "RestrictSUIDSGID=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectHostname=yes",
    "RestrictRealtime=yes",
    "LockPersonality=yes",
    "SystemCallArchitectures=native",
    "SystemCallFilter=~@clock @cpu-emulation @module @mount @obsolete @raw-io @reboot @swap",
    "SystemCallErrorNumber=EPERM",
)


def under(path: str, parent: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), os.path.abspath(parent)]) == os.path.abspath(parent)


def lookup_user(name: str, min_uid: int) -> pwd.struct_passwd:
    try:
        return notebook_account(name, min_uid)
    except AccountError as exc:
        raise UnitError(str(exc)) from None


def write_private(path: Path, content: str, uid: int, gid: int, mode: int = 0o400) -> None:
    """Write a file only its owner can read, atomically, without a moment where others could.

    Safe in a directory the unit's user owns (peers.json is rewritten while the unit runs): the
    temporary file has a fresh random name and is created with O_EXCL|O_NOFOLLOW, so a symlink the
    user planted is never followed, and ownership and mode are set on the open file, not a path.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content.encode())
            f.flush()
            os.fchown(f.fileno(), uid, gid)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def env_file_text(env: dict[str, str]) -> str:
    lines = []
    for k, v in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise UnitError(f"invalid environment variable name {k!r}")
        if "\n" in v:
            raise UnitError(f"environment variable {k} contains a newline")
        escaped = v.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{k}="{escaped}"')
    return "\n".join(lines) + "\n"


class SystemdRunner:
    backend = "systemd"

    def __init__(self, runtime_dir: str, min_uid: int) -> None:
        self.runtime_dir = Path(runtime_dir)
        self.min_uid = min_uid

    def unit_dir(self, name: str) -> Path:
        return self.runtime_dir / "units" / name

    async def _run(self, *argv: str, check: bool = True) -> str:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        out, err = await proc.communicate()
        if check and proc.returncode != 0:
            raise UnitError(f"{argv[0]} {argv[1]} failed: {err.decode().strip() or out.decode().strip()}")
        return out.decode()

    def _traversable_units_dir(self) -> None:
        # Users must pass through to their own unit directory; the daemon's umask (0077) would
        # otherwise make these 0700. Listing stays root-only (0711).
        for d in (self.runtime_dir, self.runtime_dir / "units"):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o711)

    def user_dir(self, path: Path, user: str, traverse: tuple[Path, ...] = ()) -> None:
        """Create ``path`` for the unit's user alone (0700, owned by the user). The root-owned
        directories in ``traverse`` (``path``'s parents) become 0711: the user passes, cannot list."""
        pw = lookup_user(user, self.min_uid)
        for d in traverse:
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o711)
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, pw.pw_uid, pw.pw_gid)
        os.chmod(path, 0o700)

    def write_user_file(self, path: Path, content: str, user: str, mode: int = 0o600) -> None:
        """Atomically (re)write a file the unit's user owns (e.g. its peers.json)."""
        pw = lookup_user(user, self.min_uid)
        write_private(path, content, pw.pw_uid, pw.pw_gid, mode)

    async def start(self, spec: UnitSpec) -> UnitStatus:
        pw = lookup_user(spec.user, self.min_uid)
        env_text = env_file_text(spec.env)  # refuse a bad environment before creating anything
        self._traversable_units_dir()
        udir = self.unit_dir(spec.name)
        udir.mkdir(parents=True, exist_ok=True)
        os.chown(udir, pw.pw_uid, pw.pw_gid)
        os.chmod(udir, 0o700)
        for fname, content in spec.files.items():
            write_private(udir / fname, content, pw.pw_uid, pw.pw_gid)
        # The environment file is read by PID 1 (root), so it stays root-owned 0400.
        env_path = self.runtime_dir / "units" / f"{spec.name}.env"
        write_private(env_path, env_text, 0, 0)
        # In a thread: the user's directory may be on a network filesystem that can hang the event loop.
        cwd = spec.cwd if spec.cwd and await asyncio.to_thread(os.path.isdir, spec.cwd) else pw.pw_dir
        if under(cwd, "/home") and not under(cwd, pw.pw_dir):
            cwd = pw.pw_dir  # another user's home is out of sight in the unit (ProtectHome below)
        props = [
            f"EnvironmentFile={env_path}",
            "NoNewPrivileges=yes",
            "PrivateTmp=yes",
            "KillMode=control-group",
            # The OOM killer ending one process of the unit (a GPU cell's process, a plain kernel in
            # a server) must not stop the rest (systemd's default, OOMPolicy=stop, on cgroup v2): the
            # replica or the server reports that death itself (gpuhub/kernel/memory_limit.py).
            "OOMPolicy=continue",
            "TimeoutStopSec=15",
            f"Description=gpuhub {spec.kind} for {spec.user}",
            *USER_UNIT_HARDENING,
            f"BindPaths={pw.pw_dir}",  # the user's own home, back in the empty /home of ProtectHome
        ]
        if spec.kind == "kernel":
            # A crashed replica (OOM kill, a segfault in user code) comes back in place and catches
            # up from its journal and peers; after 3 crashes in a minute it stays failed and the
            # scheduler replaces it elsewhere (Scheduler.why_lost). `systemctl stop` never restarts.
            props += ["Restart=on-failure", "RestartSec=2", "StartLimitIntervalSec=60", "StartLimitBurst=3",
                      # a full disk: restarting would only meet it again (gpuhub/replication/journal_space.py)
                      f"RestartPreventExitStatus={DISK_FULL_EXIT}"]
        if spec.devices is not None:
            props += ["DevicePolicy=closed", *(f"DeviceAllow={d}" for d in spec.devices)]
        if spec.memory_max:
            props.append(f"MemoryMax={spec.memory_max}")
        if spec.cpu_quota:
            props.append(f"CPUQuota={spec.cpu_quota}")
        argv = ["systemd-run", "--unit", spec.name, "--uid", str(pw.pw_uid), "--gid", str(pw.pw_gid),
                "--working-directory", cwd, "--slice", f"gpuhub-{spec.kind}s.slice", "--quiet"]
        for p in props:
            argv += ["-p", p]
        argv += ["--", *spec.argv]
        await self._run(*argv)
        return await self.status(spec.name)

    async def set_devices(self, name: str, devices: tuple[str, ...]) -> None:
        """Replace the running unit's device allow-list (``DeviceAllow=`` alone empties it first)."""
        await self._run("systemctl", "set-property", "--runtime", f"{name}.service", "DevicePolicy=closed",
                        "DeviceAllow=", *(f"DeviceAllow={d}" for d in devices))

    async def status(self, name: str) -> UnitStatus:
        out = await self._run(
            "systemctl", "show", name, "--property=ActiveState,MainPID,User,LoadState,NRestarts", check=False
        )
        props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        if props.get("LoadState") in (None, "not-found"):
            return UnitStatus(name, False, "gone", None, None)
        state = props.get("ActiveState", "inactive")
        pid = int(props.get("MainPID", "0") or 0) or None
        restarts = props.get("NRestarts", "")
        restarts = int(restarts) if restarts.isdigit() else 0
        return UnitStatus(name, state in ("active", "activating", "reloading"), state, pid, props.get("User") or None,
                          restarts)

    async def log_tail(self, name: str, lines: int) -> str:
        """The last ``lines`` lines of the unit's journal (its stdout and stderr, systemd's notes)."""
        out = await self._run("journalctl", f"--unit={name}.service", f"--lines={int(lines)}", "--output=cat",
                              "--no-pager", "--quiet", check=False)
        return "\n".join(out.splitlines()[-lines:])

    async def list(self) -> list[str]:
        out = await self._run(
            "systemctl", "list-units", "--all", "--no-legend", "--plain", "gpuhub-kernel-*", "gpuhub-server-*",
            check=False,
        )
        return [line.split()[0].removesuffix(".service") for line in out.splitlines() if line.strip()]

    async def stop(self, name: str) -> None:
        await self._run("systemctl", "stop", f"{name}.service", check=False)
        await self._run("systemctl", "reset-failed", f"{name}.service", check=False)
        self.cleanup_files(name)

    def cleanup_files(self, name: str) -> None:
        (self.runtime_dir / "units" / f"{name}.env").unlink(missing_ok=True)
        # rmtree does not follow symlinks; the unit's user may have left anything in its directory.
        shutil.rmtree(self.unit_dir(name), ignore_errors=True)

    def read_env(self, name: str) -> dict[str, str]:
        """Recover a unit's environment (its lease token) after an agent restart."""
        env = {}
        try:
            text = (self.runtime_dir / "units" / f"{name}.env").read_text()
        except FileNotFoundError:
            return env
        for line in text.splitlines():
            k, _, v = line.partition("=")
            if v.startswith('"') and v.endswith('"'):
                v = v[1:-1].replace('\\"', '"').replace("\\\\", "\\")
            env[k] = v
        return env


class ProcessRunner(SystemdRunner):
    """Development backend: units are child processes of the agent, run as the agent's own user."""

    backend = "process"

    def __init__(self, runtime_dir: str, min_uid: int) -> None:
        super().__init__(runtime_dir, min_uid)
        self._procs: dict[str, subprocess.Popen] = {}

    @staticmethod
    def _me(user: str) -> pwd.struct_passwd:
        me = pwd.getpwuid(os.getuid())
        if user != me.pw_name:
            raise UnitError(f"the process backend runs units as {me.pw_name!r} only, not {user!r}")
        return me

    def user_dir(self, path: Path, user: str, traverse: tuple[Path, ...] = ()) -> None:
        self._me(user)
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path, 0o700)

    def write_user_file(self, path: Path, content: str, user: str, mode: int = 0o600) -> None:
        me = self._me(user)
        write_private(path, content, me.pw_uid, me.pw_gid, mode)

    async def set_devices(self, name: str, devices: tuple[str, ...]) -> None:
        raise UnitError("the process backend runs units as the agent's processes: it cannot limit their devices")

    async def start(self, spec: UnitSpec) -> UnitStatus:
        me = self._me(spec.user)
        env_text = env_file_text(spec.env)
        udir = self.unit_dir(spec.name)
        udir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for fname, content in spec.files.items():
            write_private(udir / fname, content, me.pw_uid, me.pw_gid)
        # Like systemd's: the agent reads it back after a restart (lease token, replica id).
        write_private(self.runtime_dir / "units" / f"{spec.name}.env", env_text, me.pw_uid, me.pw_gid)
        # SSL_CERT_FILE: the trust store the agent was given stands for the host's (/etc/ssl/certs,
        # which systemd units read) so that a unit's calls to an agent on TLS verify as they would there.
        # XDG_CACHE_HOME: the user's caches (jedi's, matplotlib's) are where the agent's caller keeps them.
        keep = ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV", "GPUHUB_LOG_LEVEL", "SSL_CERT_FILE",
                "XDG_CACHE_HOME")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update(spec.env)
        # Not in a thread: with no await before the process is registered, concurrent starts cannot
        # interleave (Agent.start_unit picks ports before and records the unit after); the dev backend's
        # directories are local.
        cwd = spec.cwd if spec.cwd and os.path.isdir(spec.cwd) else me.pw_dir  # noqa: ASYNC240
        # Outside the unit's directory, so it outlives the unit as the journal would.
        log_path = self.log_path(spec.name)
        log_path.parent.mkdir(exist_ok=True, mode=0o700)
        # A local file, and Popen returns once the child is forked: neither waits long.
        with open(log_path, "ab") as logf:  # noqa: ASYNC230
            proc = subprocess.Popen(  # noqa: ASYNC220
                spec.argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs[spec.name] = proc
        (udir / "pid").write_text(str(proc.pid))
        return await self.status(spec.name)

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.unit_dir(name) / "pid").read_text())
        except (FileNotFoundError, ValueError):
            return None

    async def status(self, name: str) -> UnitStatus:
        me = pwd.getpwuid(os.getuid()).pw_name
        proc = self._procs.get(name)
        if proc is not None:
            code = proc.poll()
            if code is None:
                return UnitStatus(name, True, "active", proc.pid, me)
            if self._pid(name) in (proc.pid, None):
                return UnitStatus(name, False, "inactive" if code == 0 else "failed", None, None)
            # else its pid file names another process: the unit was started again as systemd's
            # Restart= would (tests stand in for it), so that process is the unit now
        pid = self._pid(name)  # a unit started before this agent restarted, or started again
        if pid is not None:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:  # noqa: ASYNC230 - procfs, answered from memory
                    if f.read().split(")")[-1].split()[0] != "Z":
                        return UnitStatus(name, True, "active", pid, me)
            except (ProcessLookupError, FileNotFoundError):
                pass
        return UnitStatus(name, False, "gone", None, None)

    def log_path(self, name: str) -> Path:
        return self.runtime_dir / "logs" / f"{name}.log"

    async def log_tail(self, name: str, lines: int) -> str:
        """The last ``lines`` lines of the unit's output (stdout and stderr, like its journal)."""
        try:
            with open(self.log_path(name), "rb") as f:  # noqa: ASYNC230 - a local file, at most 64 KiB read
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - LOG_TAIL_BYTES))
                data = f.read()
        except FileNotFoundError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    async def list(self) -> list[str]:
        udir = self.runtime_dir / "units"
        names = {p.parent.name for p in udir.glob("*/pid")} if udir.is_dir() else set()
        return sorted(names | set(self._procs))

    async def stop(self, name: str) -> None:
        st = await self.status(name)
        self._procs.pop(name, None)
        if st.active and st.main_pid:
            try:
                os.killpg(st.main_pid, signal.SIGTERM)
                for _ in range(50):
                    os.kill(st.main_pid, 0)
                    with open(f"/proc/{st.main_pid}/stat") as f:  # noqa: ASYNC230 - procfs, answered from memory
                        if f.read().split(")")[-1].split()[0] == "Z":
                            break
                    await asyncio.sleep(0.1)
                else:
                    os.killpg(st.main_pid, signal.SIGKILL)
            except (ProcessLookupError, FileNotFoundError):
                pass
        self.cleanup_files(name)


def make_runner(backend: str, runtime_dir: str, min_uid: int) -> SystemdRunner:
    return (ProcessRunner if backend == "process" else SystemdRunner)(runtime_dir, min_uid)
