"""JupyterHub spawner: the user's Jupyter server as a systemd unit on a notebook host.

Built on batchspawner's ``BatchSpawnerBase`` (submit / query / cancel), but it talks to the
notebook host's gpuhub-agent API instead of running shell commands. Works around batchspawner
1.3.0's quirks (see docs/architecture.md): ``ip`` is a class default; ``PATH`` is passed explicitly.
"""

from __future__ import annotations

import asyncio
import hashlib
import html
import re
from collections.abc import Callable
from urllib.parse import quote, urlparse

from batchspawner import BatchSpawnerBase, JobStatus
from tornado import web
from traitlets import Bool, Dict, List, Unicode, default

from gpuhub.platform.config import ConfigError, read_secret
from gpuhub.platform.http_client import ApiClientError, call_json
from gpuhub.platform.quota_text import usage_line

DEFAULT_PROFILES = [
    {"name": "cpu", "display": "CPU only", "gpus": 0},
    {"name": "gpu1", "display": "1 GPU per cell", "gpus": 1},
]


def kernel_args(profile: dict, others: list[str]) -> list[str]:
    """jupyterhub-singleuser arguments that make a profile's server offer its own kernel, the
    replicated gpuhub-<profile> (also the default for a new notebook, CPU profile included), and
    only ``others`` besides: JupyterLab's launcher then lists what this profile runs, not every
    profile's kernels."""
    own = f"gpuhub-{profile['name']}"
    allowed = [own, *(k for k in others if k != own)]
    return [f"--MappingKernelManager.default_kernel_name={own}",
            *(f"--KernelSpecManager.allowed_kernelspecs={k}" for k in allowed)]


# Jupyter Server leaves Nagle's algorithm on for kernel websockets: about 40 ms more per cell
# (gpuhub/server/websocket.py). jupyter_client adds ipykernel's own "python3" kernelspec, debugger
# included, wherever no python3 kernelspec file exists: a site that hid the plain kernel
# (gpuhub_kernelspecs_keep_python3: false) would offer it all the same (gpuhub/kernel/refusals.py).
SERVER_ARGS = ["--ServerApp.kernel_websocket_connection_class=gpuhub.server.websocket.NoDelayChannelsConnection",
               "--KernelSpecManager.ensure_native_kernel=False"]


async def least_loaded_agent(urls: list[str], token_for: Callable[[str], str]) -> str:
    """The notebook host whose agent runs the fewest units now (ties: the first listed); hosts
    whose agent does not answer are passed over. ``token_for(url)``: that agent's token. Raises
    RuntimeError when none answers."""
    async def load(i: int, url: str) -> tuple[int, int, str] | None:
        try:
            _, node = await call_json("GET", f"{url}/api/v1/node", token_for(url), timeout=10)
        except (ApiClientError, ConfigError):
            return None
        return int(node.get("units") or 0), i, url

    # all at once: a host that does not answer costs one timeout, not one per host before it
    loads = [x for x in await asyncio.gather(*(load(i, u) for i, u in enumerate(urls))) if x is not None]
    if not loads:
        raise RuntimeError(f"no notebook host answers ({', '.join(urls)}): ask your admin")
    return min(loads)[2]


def unit_name_for(user: str, server: str) -> str:
    raw = f"{user}-{server}" if server else user
    safe = re.sub(r"[^a-z0-9_.-]", "-", raw.lower()).strip("-.") or "user"
    if safe != raw:  # keep names unique when sanitising changed them
        safe = f"{safe}-{hashlib.sha256(raw.encode()).hexdigest()[:6]}"
    return f"gpuhub-server-{safe}"


class GpuhubSpawner(BatchSpawnerBase):
    # batchspawner reads ip from the class default on start (config is ignored there).
    ip = Unicode("0.0.0.0")

    agent_url = Unicode("http://127.0.0.1:8601", config=True,
                        help="The notebook host's gpuhub-agent (one host; agent_urls lists several)")
    agent_urls = List(Unicode(), config=True,
                      help="Every notebook host's gpuhub-agent: a new server goes to the one running the fewest "
                           "units. Empty: agent_url only.")
    job_agent = Unicode("", help="The agent that runs this server's unit (kept in the spawner's state)")
    serves_tls = Bool(False, help="The agent started the server with a certificate (it serves https)")
    agent_token_file = Unicode("/etc/gpuhub/secrets/agent.token", config=True,
                               help="The token of the agents agent_token_files does not list")
    agent_token_files = Dict(Unicode(), config=True,
                             help="{agent URL: file of that agent's own token} (each host's agent has its own)")
    venv = Unicode("/opt/gpuhub/venv", config=True)
    profiles = List(Dict(), config=True, help="[{name, display, gpus}] offered on the spawn form")
    server_args = List(Unicode(), config=True, help="Extra arguments for jupyterhub-singleuser")
    scheduler_url = Unicode("", config=True,
                            help="gpuhub-scheduler's URL, for the user's GPU quota on the spawn page; empty: no line")
    scheduler_token_file = Unicode("/etc/gpuhub/secrets/scheduler.token", config=True)
    other_kernelspecs = List(Unicode(), ["python3"], config=True,
                             help="Kernelspecs every profile offers besides its own gpuhub-<profile>: by default "
                                  "ipykernel's plain python3 on the notebook host, where the kernelspecs role keeps it")

    @default("profiles")
    def _default_profiles(self):
        return list(DEFAULT_PROFILES)

    @default("batchspawner_singleuser_cmd")
    def _default_bs_cmd(self):
        return f"{self.venv}/bin/batchspawner-singleuser"

    @default("cmd")
    def _default_cmd(self):
        return [f"{self.venv}/bin/jupyterhub-singleuser"]

    @default("default_url")
    def _default_default_url(self):
        return "/lab"

    @default("apply_user_options")
    def _default_apply_user_options(self):
        # JupyterHub asks what the form's options do before the spawn (else it warns that they
        # are unhandled): the profile is read at start, so an unknown one is refused here, at once.
        def check_profile(spawner: GpuhubSpawner, user_options: dict) -> None:
            try:
                spawner.profile()
            except ValueError as exc:  # a profile that is not offered: the user sees which are
                raise web.HTTPError(400, "%s", str(exc)) from None
        return check_profile

    # --- the profile form ----------------------------------------------------
    def _options_form_default(self):
        rows = []
        for i, p in enumerate(self.profiles):
            checked = " checked" if i == 0 else ""
            name, label = html.escape(str(p["name"])), html.escape(str(p.get("display", p["name"])))
            about = p.get("description")
            note = f'<br><small class="text-muted">{html.escape(str(about))}</small>' if about else ""
            rows.append(f'<div class="radio"><label><input type="radio" name="profile" value="{name}"{checked}> '
                        f"{label}{note}</label></div>")
        return "<p>Kernels get their GPUs only while a cell runs.</p>" + "\n".join(rows)

    async def get_options_form(self):
        """The profile form, with the user's GPU quota this week above it when any limit applies."""
        form = await super().get_options_form()
        line = await self.quota_line()
        return f'<p class="gpuhub-quota">{html.escape(line)}</p>' + form if line else form

    async def quota_line(self) -> str:
        """``GPU-hours this week: 3.2 of 30 (resets …)`` from the scheduler; "" without limits, or
        when the scheduler cannot say (the form must open all the same)."""
        if not self.scheduler_url:
            return ""
        try:
            _, status = await call_json("GET", f"{self.scheduler_url.rstrip('/')}/api/v1/quota/"
                                        f"{quote(self.user.name, safe='')}",
                                        read_secret(self.scheduler_token_file, "scheduler"), timeout=5)
            return usage_line(status) if status.get("limits") else ""
        except (ApiClientError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.log.warning("no GPU quota line for %s: %s", self.user.name, exc)
            return ""

    def options_from_form(self, formdata):
        return {"profile": formdata.get("profile", [self.profiles[0]["name"]])[0]}

    def profile(self) -> dict:
        wanted = (self.user_options or {}).get("profile") or self.profiles[0]["name"]
        for p in self.profiles:
            if p["name"] == wanted:
                return p
        names = ", ".join(p["name"] for p in self.profiles)
        raise ValueError(f"unknown profile {wanted!r}; choose one of: {names}")

    async def start(self):
        """batchspawner's start, answered with a URL: https when the agent gave the server its host's
        servers' certificate (the proxy then reaches it over TLS, the hub checks it is up the same way)."""
        ip, port = await super().start()
        host = f"[{ip}]" if ":" in ip else ip
        return f"{'https' if self.serves_tls else 'http'}://{host}:{int(port)}"

    # --- batchspawner's three verbs, through the agent -------------------------
    def _token(self, agent: str) -> str:
        """The token of the agent at URL ``agent``."""
        return read_secret(self.agent_token_files.get(agent, self.agent_token_file), f"agent {agent}")

    async def submit_batch_script(self):
        profile = self.profile()
        env = self.get_env()
        env["PATH"] = f"{self.venv}/bin:/usr/local/bin:/usr/bin:/bin"
        env["GPUHUB_PROFILE"] = str(profile["name"])
        env["GPUHUB_MAX_GPUS"] = str(int(profile.get("gpus", 0)))
        argv = [self.batchspawner_singleuser_cmd, *self.cmd, *self.get_args(), *SERVER_ARGS, *self.server_args,
                *kernel_args(profile, list(self.other_kernelspecs))]
        name = unit_name_for(self.user.name, self.name)
        agent = await least_loaded_agent(list(self.agent_urls), self._token) if self.agent_urls else self.agent_url
        try:
            _, unit = await call_json("POST", f"{agent}/api/v1/units", self._token(agent), {
                "name": name, "kind": "server", "user": self.user.name, "argv": argv, "env": env,
            }, timeout=60)
        except ApiClientError as exc:
            raise RuntimeError(f"the notebook host could not start your server: {exc.message}") from None
        self.job_id, self.job_agent = name, agent
        self.serves_tls = bool(isinstance(unit, dict) and unit.get("tls"))
        self.log.info("started %s for %s with profile %s on %s", name, self.user.name, profile["name"],
                      urlparse(agent).hostname)
        return self.job_id

    async def query_job_status(self):
        if not self.job_id:
            self.job_status = ""
            return JobStatus.NOTFOUND
        try:
            _, unit = await call_json("GET", f"{self._job_agent}/api/v1/units/{self.job_id}",
                                      self._token(self._job_agent), timeout=10)
            self.job_status = unit.get("state", "")
        except ApiClientError as exc:
            self.job_status = "gone" if exc.status == 404 else "unknown"
        if self.job_status == "active":
            return JobStatus.RUNNING
        if self.job_status == "activating":
            return JobStatus.PENDING
        if self.job_status == "unknown":
            return JobStatus.UNKNOWN
        return JobStatus.NOTFOUND

    async def cancel_batch_job(self):
        if not self.job_id:
            return
        try:
            await call_json("DELETE", f"{self._job_agent}/api/v1/units/{self.job_id}", self._token(self._job_agent),
                            timeout=30)
        except ApiClientError as exc:
            self.log.warning("stopping %s failed: %s", self.job_id, exc)

    def state_ispending(self):
        return self.job_status == "activating"

    def state_isrunning(self):
        return self.job_status == "active"

    def state_isunknown(self):
        return self.job_status == "unknown"

    def state_gethost(self):
        return urlparse(self._job_agent).hostname

    @property
    def _job_agent(self) -> str:
        return self.job_agent or self.agent_url  # servers started before agent_urls existed: agent_url

    # The chosen notebook host outlives a hub restart: JupyterHub keeps the spawner's state.
    def get_state(self):
        state = super().get_state()
        if self.job_agent:
            state["job_agent"] = self.job_agent
        return state

    def load_state(self, state):
        super().load_state(state)
        self.job_agent = state.get("job_agent", "")

    def clear_state(self):
        super().clear_state()
        self.job_agent = ""
