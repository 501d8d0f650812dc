"""End to end, as a user and an admin would see it: JupyterHub login over HTTPS, a 1-GPU server,
a gpuhub kernel driven over the kernel websocket, the agents' books, systemd, and Prometheus.

Needs a deployed local cluster (scripts/cluster.sh up/deploy NAME; GPUHUB_CLUSTER=NAME).
Traffic goes only to the cluster containers' own addresses.
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import subprocess
import threading
import time
import uuid
from urllib.parse import urlparse

import pytest
import requests
import websocket

from gpuhub.kernel.wait_notice import notice_text
from tests.cluster.conftest import CONTAINERS_CONF

pytestmark = pytest.mark.cluster

SPAWN_TIMEOUT_S = 180
KERNEL_TIMEOUT_S = 180


def http_session(cluster) -> requests.Session:
    """Straight to the cluster's own addresses (no proxies from the environment); HTTPS verified
    against the hub's certificate (the environment's CA bundle variables would override it)."""
    s = requests.Session()
    s.trust_env = False
    s.verify = cluster.ca_file
    return s


class HubUser:
    """One user of the hub, with a browser-like session (cookies, _xsrf) and an API token."""

    def __init__(self, cluster, name: str):
        self.cluster, self.name = cluster, name
        self.base = cluster.hub_url
        self.s = http_session(cluster)
        self.token: str | None = None

    # --- login through the form, like a browser ---------------------------------------------------
    def login(self) -> None:
        page = self.s.get(f"{self.base}/hub/login", timeout=30)
        assert page.status_code == 200, page.text[:500]
        m = re.search(r'name="_xsrf"\s+value="([^"]+)"', page.text)
        xsrf = m.group(1) if m else self.s.cookies.get("_xsrf", "")
        r = self.s.post(
            f"{self.base}/hub/login",
            data={"username": self.name, "password": self.cluster.passwords[self.name], "_xsrf": xsrf},
            allow_redirects=False,
            timeout=30,
        )
        assert r.status_code in (302, 303), f"login as {self.name} failed: {r.status_code} {r.text[:500]}"
        # An API token for the rest (the hub and the user's server accept it).
        r = self.s.post(
            f"{self.base}/hub/api/users/{self.name}/tokens",
            json={"note": "gpuhub e2e test", "expires_in": 3600},
            headers={"X-XSRFToken": self.s.cookies.get("_xsrf", xsrf), "Referer": f"{self.base}/hub/"},
            timeout=30,
        )
        assert r.status_code in (200, 201), f"token for {self.name}: {r.status_code} {r.text[:500]}"
        self.token = r.json()["token"]

    def api(self, method: str, path: str, **kw) -> requests.Response:
        headers = {"Authorization": f"token {self.token}"}
        return self.s.request(method, f"{self.base}{path}", headers=headers, timeout=60, **kw)

    # --- the user's server ------------------------------------------------------------------------
    def _server_path(self, server: str) -> str:  # "" is the default server, else a named one
        return f"/hub/api/users/{self.name}/servers/{server}" if server else f"/hub/api/users/{self.name}/server"

    def start_server(self, profile: str, server: str = "") -> None:
        user = self.api("GET", f"/hub/api/users/{self.name}").json()
        if user.get("servers", {}).get(server, {}).get("ready"):
            self.stop_server(server)
        r = self.api("POST", self._server_path(server), json={"profile": profile})
        assert r.status_code in (201, 202), f"spawn for {self.name}: {r.status_code} {r.text[:500]}"
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while time.monotonic() < deadline:
            state = self.api("GET", f"/hub/api/users/{self.name}").json().get("servers", {}).get(server)
            if state and state.get("ready"):
                return
            if not state:
                pytest.fail(f"{self.name}'s server {server!r} stopped while starting (see journalctl -u jupyterhub)")
            time.sleep(1)
        pytest.fail(f"{self.name}'s server {server!r} was not ready after {SPAWN_TIMEOUT_S} s")

    def stop_server(self, server: str = "") -> None:
        self.api("DELETE", self._server_path(server), json={"remove": bool(server)})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server not in self.api("GET", f"/hub/api/users/{self.name}").json().get("servers", {}):
                return
            time.sleep(1)

    def start_kernel(self, kernelspec: str) -> str:
        r = self.api("POST", f"/user/{self.name}/api/kernels", json={"name": kernelspec})
        assert r.status_code == 201, f"kernel {kernelspec} for {self.name}: {r.status_code} {r.text[:800]}"
        return r.json()["id"]

    def kernel(self, kernel_id: str) -> KernelChannel:
        return KernelChannel(self, kernel_id)


class KernelChannel:
    """The Jupyter kernel websocket (/api/kernels/<id>/channels), as JupyterLab uses it."""

    def __init__(self, user: HubUser, kernel_id: str):
        url = f"wss://{user.cluster.hub}/user/{user.name}/api/kernels/{kernel_id}/channels"
        self.ws = websocket.create_connection(
            url,
            header=[f"Authorization: token {user.token}"],
            sslopt={"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": user.cluster.ca_file},
            timeout=KERNEL_TIMEOUT_S,
            http_no_proxy=[user.cluster.hub],
        )
        self.session = uuid.uuid4().hex

    def close(self) -> None:
        self.ws.close()

    def send_execute(self, code: str) -> str:
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "username": "e2e", "session": self.session, "msg_type": "execute_request",
                       "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }))
        return msg_id

    def collect(self, msg_id: str, timeout: float = KERNEL_TIMEOUT_S) -> dict:
        """Outputs of one request until its execute_reply and the kernel is idle again."""
        out = {"stdout": "", "stderr": "", "reply": None, "statuses": [], "notices": [], "other": []}
        idle = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (out["reply"] and idle):
            self.ws.settimeout(max(1.0, deadline - time.monotonic()))
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["header"]["msg_type"], msg.get("content", {})
            if (notice := notice_text(kind, content)) is not None:  # the kernel's "waiting for a GPU"
                out["notices"].append(notice)
            elif kind == "stream":
                out[content.get("name", "stdout")] += content.get("text", "")
            elif kind == "execute_reply":
                out["reply"] = content
            elif kind == "status":
                out["statuses"].append(content.get("execution_state"))
                idle = content.get("execution_state") == "idle"
            elif kind == "error":
                out["stderr"] += "\n".join(content.get("traceback", []))
            else:
                out["other"].append(msg)
        assert out["reply"] is not None, f"no execute_reply within {timeout} s: {out}"
        return out

    def run(self, code: str, timeout: float = KERNEL_TIMEOUT_S) -> dict:
        out = self.collect(self.send_execute(code), timeout)
        assert out["reply"].get("status") == "ok", f"cell failed: {out['stderr'] or out['reply']}"
        return out


WHERE = "import os, socket; print(socket.gethostname(), os.environ.get('CUDA_VISIBLE_DEVICES', ''), flush=True)"


def node_info(cluster, node: str) -> dict:
    r = http_session(cluster).get(f"{cluster.agent_url(node)}/api/v1/node",
                     headers=cluster.agent_auth(node), timeout=10)
    r.raise_for_status()
    return r.json()


def wait_for(predicate, timeout: float, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


@pytest.fixture(scope="module")
def alice(cluster):
    user = HubUser(cluster, "alice")
    user.login()
    user.start_server("gpu1")
    yield user
    user.stop_server()


@pytest.fixture(scope="module")
def alice_kernel(alice):
    kid = alice.start_kernel("gpuhub-gpu1")
    channel = alice.kernel(kid)
    yield kid, channel
    channel.close()
    alice.api("DELETE", f"/user/alice/api/kernels/{kid}")


def test_login_page_is_served_over_https(cluster):
    r = http_session(cluster).get(f"{cluster.hub_url}/hub/login", timeout=30)
    assert r.status_code == 200 and "JupyterHub" in r.text


def test_wrong_password_is_refused(cluster):
    s = http_session(cluster)
    page = s.get(f"{cluster.hub_url}/hub/login", timeout=30)
    m = re.search(r'name="_xsrf"\s+value="([^"]+)"', page.text)
    r = s.post(f"{cluster.hub_url}/hub/login", allow_redirects=False, timeout=30,
               data={"username": "alice", "password": "not-the-password", "_xsrf": m.group(1) if m else ""})
    assert r.status_code not in (302, 303)


def test_the_server_offers_its_profiles_kernel_only(alice):
    """JupyterLab's launcher lists what the server's profile runs: its own replicated kernel (the
    default for a new notebook) and the plain python3 the kernelspecs role keeps, not every
    profile's gpuhub kernels."""
    specs = alice.api("GET", "/user/alice/api/kernelspecs").json()
    assert specs["default"] == "gpuhub-gpu1"
    assert set(specs["kernelspecs"]) == {"gpuhub-gpu1", "python3"}, sorted(specs["kernelspecs"])


def test_users_servers_call_the_hub_api_over_tls_with_a_certificate_of_the_cluster_ca(cluster, alice):
    """A server's token never crosses the network in clear: its hub API URL is the proxy's TLS port
    (Spawner.hub_connect_url, roles/gpuhub_hub), whose certificate the cluster CA issued, so the
    server verifies it with the host's trust store. The spawn itself went through it: batchspawner's
    singleuser posts its port to the hub's API before the hub counts the server as started."""
    found = {}
    for host in cluster.groups["notebook_hosts"]:
        props = unit_props(cluster, host, "gpuhub-server-alice.service", "ActiveState", "MainPID")
        if props.get("ActiveState") == "active":
            found[host] = props["MainPID"]
    ((host, pid),) = found.items()
    raw = cluster.exec(host, "cat", f"/proc/{pid}/environ")
    env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
    assert env["JUPYTERHUB_API_URL"] == f"https://{cluster.hub}:443/hub/api", env["JUPYTERHUB_API_URL"]
    assert env["REQUESTS_CA_BUNDLE"] == "/etc/ssl/certs/ca-certificates.crt"
    hub = cluster.groups["hub"][0]
    issuer = cluster.exec(hub, "openssl", "x509", "-noout", "-issuer", "-in", "/etc/gpuhub/tls/hub.crt")
    assert "gpuhub cluster CA" in issuer, issuer
    # From the server's host, with nothing but the host's trust store: the certificate and its name check.
    cluster.exec(host, "python3", "-c", "import ssl, socket; ctx = ssl.create_default_context(); "
                 f"ctx.wrap_socket(socket.create_connection(({cluster.hub!r}, 443), 10), "
                 f"server_hostname={cluster.hub!r}).close()")


def test_the_proxy_reaches_users_servers_over_tls_with_a_certificate_of_the_cluster_ca(cluster, alice):
    """Users' cookies and notebooks cross the cluster network encrypted: the proxy's route to
    alice's server is https, the server answers only TLS, with its host's servers' certificate
    (cluster CA, the host's address), and her copy of its key is hers alone."""
    hub = cluster.groups["hub"][0]
    routes = json.loads(cluster.exec(hub, "sh", "-c", "set -a && . /etc/gpuhub/secrets/proxy.env && python3 -c '"
                                     "import os, urllib.request as u; print(u.urlopen(u.Request("
                                     "\"http://127.0.0.1:8001/api/routes\", headers={\"Authorization\": "
                                     "\"token \" + os.environ[\"CONFIGPROXY_AUTH_TOKEN\"]})).read().decode())'"))
    target = next(r["target"] for path, r in routes.items() if path.startswith("/user/alice"))
    url = urlparse(target)
    assert url.scheme == "https", routes
    r = http_session(cluster).get(f"{target}/user/alice/api", timeout=10)  # verified against the cluster CA
    assert r.status_code == 200 and "version" in r.json(), r.text[:300]
    with pytest.raises(requests.ConnectionError):
        http_session(cluster).get(f"http://{url.hostname}:{url.port}/user/alice/api", timeout=10)
    host = cluster.groups["notebook_hosts"][0]
    key = cluster.exec(host, "sh", "-c", "stat -c '%U %a' /run/gpuhub/units/gpuhub-server-alice/server-tls.key")
    assert key.split() == ["alice", "400"], key


def test_the_hubs_plain_api_port_listens_on_loopback_only(cluster, alice):
    """With the servers on the proxy's TLS port, nothing off the hub host needs the plain-HTTP API
    port: it listens on 127.0.0.1 (the proxy, the scheduler and the hub's services use it there),
    and Prometheus scrapes the hub through the proxy (the scrape test checks that it answers)."""
    hub = cluster.groups["hub"][0]
    probe = ("import socket, sys\n"
             "try:\n    socket.create_connection((sys.argv[1], 8081), 5).close(); print('open')\n"
             "except OSError as e:\n    print(type(e).__name__)")
    for host in [hub, *cluster.groups["notebook_hosts"], *cluster.groups["gpu_nodes"]]:
        assert cluster.exec(host, "python3", "-c", probe, cluster.hub).strip() == "ConnectionRefusedError", host
    assert cluster.exec(hub, "python3", "-c", probe, "127.0.0.1").strip() == "open"
    config = cluster.exec(cluster.groups["monitoring"][0], "cat", "/etc/prometheus/prometheus.yml")
    job = config.split("job_name: jupyterhub", 1)[1].split("job_name:", 1)[0]
    assert f'"targets": ["{cluster.hub}:443"]' in job and '"__scheme__": "https"' in job, job


def test_a_named_cpu_server_beside_the_default_one(cluster, alice):
    """A second server of the same user, with the CPU profile (its description is on the form):
    its default kernel is the replicated CPU kernel, not the notebook host's plain python3."""
    if "second" in alice.api("GET", "/hub/api/users/alice").json().get("servers", {}):
        alice.stop_server("second")  # left by an earlier run against this cluster
    form = alice.s.get(f"{alice.base}/hub/spawn/alice/second", timeout=30).text
    assert "numpy, pandas, matplotlib: no GPU" in form, form[:2000]
    alice.start_server("cpu", server="second")
    try:
        specs = alice.api("GET", "/user/alice/second/api/kernelspecs").json()
        assert specs["default"] == "gpuhub-cpu" and set(specs["kernelspecs"]) == {"gpuhub-cpu", "python3"}
        # the plain kernel runs without ipykernel's debugger (gpuhub/kernel/plain.py)
        assert "--IPKernelApp.kernel_class=gpuhub.kernel.plain.PlainKernel" in \
            specs["kernelspecs"]["python3"]["spec"]["argv"], specs["kernelspecs"]["python3"]
        units = cluster.exec(cluster.groups["notebook_hosts"][0], "systemctl", "list-units", "--plain",
                             "--no-legend", "gpuhub-server-alice*")
        assert "gpuhub-server-alice-second" in units and "gpuhub-server-alice.service" in units, units
    finally:
        alice.stop_server("second")


def test_cell_sees_exactly_a_fake_gpu_of_its_node(cluster, alice_kernel):
    _, channel = alice_kernel
    out = channel.run(WHERE)
    host, visible = out["stdout"].split()[:2]
    assert host in cluster.groups["gpu_nodes"], f"kernel ran on {host}, not a GPU node"
    uuids = {g["uuid"] for g in node_info(cluster, host)["gpus"]}
    assert visible in uuids, f"CUDA_VISIBLE_DEVICES={visible!r} is not one of {host}'s GPUs {sorted(uuids)}"


def test_the_inventorys_extra_packages_are_in_every_kernel(alice_kernel):
    """The test inventory adds numpy, pandas and matplotlib (gpuhub_python_extra_requirements): a
    DataFrame made in one GPU cell is there, whole, in the next, and a plot reaches the notebook."""
    _, channel = alice_kernel
    channel.run("import numpy as np, pandas as pd\ndf = pd.DataFrame({'k': list('abab'), 'v': np.arange(4.0)})")
    out = channel.run("print(df.groupby('k')['v'].sum().to_dict())")
    assert out["stdout"].strip() == "{'a': 2.0, 'b': 4.0}", out
    out = channel.run("import matplotlib.pyplot as plt\nplt.plot(df['v'])\nplt.show()")
    images = [m["content"]["data"]["image/png"] for m in out["other"]
              if m["header"]["msg_type"] == "display_data" and "image/png" in m["content"].get("data", {})]
    assert len(images) == 1 and base64.b64decode(images[0]).startswith(b"\x89PNG"), out
    # Packages come from the admin: %pip install says so (the release is root's) and runs nothing.
    out = channel.run("%pip install tqdm")
    assert "%pip install changes nothing here" in out["stderr"] and "Collecting" not in out["stdout"], out


def test_gpu_is_committed_only_while_a_cell_runs(cluster, alice_kernel):
    _, channel = alice_kernel
    host = channel.run(WHERE)["stdout"].split()[0]
    assert wait_for(lambda: node_info(cluster, host)["committed"] == 0, 15), "GPU still committed after the cell"

    msg_id = channel.send_execute(WHERE + "\nimport time; time.sleep(5)")
    busy = wait_for(lambda: (n := node_info(cluster, host))["committed"] >= 1 and n, 5)
    assert busy, f"{host}'s agent never reported a committed GPU while the cell slept"
    out = channel.collect(msg_id)
    assert out["reply"]["status"] == "ok"
    visible = out["stdout"].split()[1]
    by_index = {g["index"]: g["uuid"] for g in busy["gpus"]}
    leased = {by_index[g] if isinstance(g, int) else g.get("uuid", by_index.get(g.get("index")))
              for lease in busy["leases"] for g in lease.get("gpus", [])}
    assert visible in leased, f"the cell saw {visible}, but the agent's leases were {busy['leases']}"
    assert wait_for(lambda: node_info(cluster, host)["committed"] == 0, 15), "GPU not released after the cell"


def test_a_gpu_cell_past_the_kernels_memory_limit_is_told_it_ran_out_of_memory(cluster, alice_kernel):
    """The kernel unit's MemoryMax= (2G on the test cluster) kills a GPU cell's process that goes past
    it: the user reads that it ran out of memory and what the limit is, not only a signal number,
    the namespace is as it was, and no replica was stopped for it."""
    kid, channel = alice_kernel
    channel.run("kept = 1")
    units = kernel_units(cluster, kid)
    assert len(units) == 3 and all(u["OOMPolicy"] == "continue" for u in units.values()), units
    out = channel.collect(channel.send_execute("lost = b'x' * (3 << 30)"))
    reply = out["reply"]
    assert reply["status"] == "error" and reply["ename"] == "CellProcessDied", out
    # cgroup v2 names the limit; v1 (the podman test cluster's memory controller) cannot tell it
    # from the server running out, and says both
    assert ("out of memory, this kernel's processes reached their limit of 2.0 GiB" in reply["evalue"]
            or "out of memory (this kernel's limit is 2.0 GiB, or the server ran out)" in reply["evalue"]), reply
    assert channel.run("print(kept, 'lost' in dir())")["stdout"].split() == ["1", "False"]
    assert kernel_units(cluster, kid) == units  # no replica was stopped or restarted (OOMPolicy=continue)


def kernel_units(cluster, kernel_id: str) -> dict[tuple[str, str], dict[str, str]]:
    """(node, unit) → OOMPolicy, NRestarts and MainPID of each of a kernel's replica units."""
    found = {}
    for node in cluster.groups["gpu_nodes"]:
        listed = cluster.exec(node, "systemctl", "list-units", "--plain", "--no-legend", f"gpuhub-kernel-{kernel_id}-*")
        for unit in (line.split()[0] for line in listed.splitlines() if line.strip()):
            shown = cluster.exec(node, "systemctl", "show", "-p", "OOMPolicy", "-p", "NRestarts", "-p", "MainPID", unit)
            found[(node, unit)] = dict(line.split("=", 1) for line in shown.split())
    return found


def test_files_saved_in_jupyterlab_are_the_kernels_files_on_the_gpu_servers(cluster, alice):
    """One /home on every host (a site's NFS; the test cluster's shared volume): a notebook opened in
    a folder, as JupyterLab opens it (a session), starts its kernel's replicas on the GPU servers in
    that folder; they read what the user uploaded there, and what a cell writes shows in the file
    browser."""
    folder = f"project-{uuid.uuid4().hex[:8]}"
    contents = f"/user/alice/api/contents/{folder}"
    assert alice.api("PUT", contents, json={"type": "directory"}).status_code == 201
    r = alice.api("PUT", f"{contents}/data.csv", json={"type": "file", "format": "text", "content": "a,b\n1,2\n3,4\n"})
    assert r.status_code == 201, r.text[:300]
    r = alice.api("POST", "/user/alice/api/sessions", json={
        "path": f"{folder}/analysis.ipynb", "type": "notebook", "name": "analysis.ipynb",
        "kernel": {"name": "gpuhub-gpu1"}})
    assert r.status_code == 201, r.text[:800]
    session = r.json()
    channel = alice.kernel(session["kernel"]["id"])
    try:
        out = channel.run("import os, pandas, socket\ndf = pandas.read_csv('data.csv')\n"
                          "df.assign(c=df.a * df.b).to_csv('products.csv', index=False)\n"
                          "print(socket.gethostname(), os.getcwd(), int(df.b.sum()))")
        host, cwd, total = out["stdout"].split()
        assert host in cluster.groups["gpu_nodes"], out
        assert (cwd, total) == (f"/home/alice/{folder}", "6"), out
        assert "does not exist on node" not in out["stderr"], out
        r = alice.api("GET", f"{contents}/products.csv", params={"content": "1", "format": "text", "type": "file"})
        assert r.status_code == 200 and r.json()["content"] == "a,b,c\n1,2,2\n3,4,12\n", r.text[:300]
    finally:
        channel.close()
        alice.api("DELETE", f"/user/alice/api/sessions/{session['id']}")
        for name in ("products.csv", "data.csv", ""):
            alice.api("DELETE", f"{contents}/{name}".rstrip("/"))


def test_kernel_unit_runs_as_the_user_on_a_gpu_node(cluster, alice_kernel):
    _kid, channel = alice_kernel
    host = channel.run(WHERE)["stdout"].split()[0]
    r = http_session(cluster).get(f"{cluster.agent_url(host)}/api/v1/units",
                     headers=cluster.agent_auth(host), timeout=10)
    r.raise_for_status()
    units = [u for u in r.json()["units"] if u.get("kind") == "kernel" and u.get("user") == "alice"]
    assert units, f"{host}'s agent lists no kernel unit of alice: {r.json()}"
    for unit in units:
        props = dict(
            line.split("=", 1)
            for line in cluster.exec(host, "systemctl", "show", unit["name"], "-p",
                                     "User,ActiveState,MainPID,RestartPreventExitStatus").splitlines() if "=" in line
        )
        assert props["ActiveState"] == "active", props
        assert props["RestartPreventExitStatus"] == "74", props  # a full disk: stopped for good, not restarted
        alice_uid = cluster.exec(host, "id", "-u", "alice").strip()
        assert props["User"] in ("alice", alice_uid), props
        owner = cluster.exec(host, "ps", "-o", "user=", "-p", props["MainPID"]).strip()
        assert owner == "alice" and owner != "root", f"{unit['name']} runs as {owner}"


def test_a_cell_sees_neither_other_users_processes_nor_their_homes(cluster, alice_kernel):
    """The kernel unit's hardening (gpuhub/agent/units.py USER_UNIT_HARDENING): /home holds only the
    user's own home, other users' processes (root's PID 1 among them) are invisible in /proc,
    nothing setuid can be made, and the system calls of the filter are refused: adjtimex, which
    only reads the clock's state here and which alice may call outside the unit, gives EPERM."""
    _kid, channel = alice_kernel
    out = channel.run(READS_CLOCK_STATE + "\nimport os, json; print(json.dumps([sorted(os.listdir('/home')), "
                      "os.path.exists('/proc/1'), os.access('/usr/bin', os.W_OK), clock_state()]))")
    homes, sees_pid1, writes_usr, clock = json.loads(out["stdout"].strip().splitlines()[-1])
    assert homes == ["alice"], homes
    assert not sees_pid1 and not writes_usr
    assert clock == "EPERM", clock
    host = channel.run(WHERE)["stdout"].split()[0]
    outside = cluster.exec(host, "setpriv", "--reuid=alice", "--regid=alice", "--init-groups", "python3", "-c",
                           READS_CLOCK_STATE + "\nprint(clock_state())")
    assert outside.strip() == "ok", outside


READS_CLOCK_STATE = """
def clock_state():
    import ctypes, errno
    libc = ctypes.CDLL(None, use_errno=True)
    timex = ctypes.create_string_buffer(512)  # modes 0: read only, open to any user
    return "ok" if libc.adjtimex(timex) >= 0 else errno.errorcode[ctypes.get_errno()]
"""


# Opens every fake GPU's node (scripts/cluster.sh: major 242, which no driver serves): ENXIO where
# the unit's cgroup lets it through, EPERM where it refuses.
OPEN_FAKE_GPUS = ('import errno,glob,json,os\nr={}\nfor p in sorted(glob.glob("/dev/gpuhub-fake-gpu*")):\n'
                  ' try: os.close(os.open(p,os.O_RDWR)); r[p]="opened"\n'
                  ' except OSError as e: r[p]=errno.errorcode[e.errno]\nprint(json.dumps(r))')


def opens_in_unit(cluster, node: str, unit: str, user: str) -> dict[str, str]:
    """What a process of ``user`` in ``unit``'s cgroup may open, as a terminal of its server or a
    thread of its kernel would."""
    cgroup = unit_props(cluster, node, unit, "ControlGroup")["ControlGroup"]
    assert cgroup, f"{unit} has no cgroup on {node}"
    out = cluster.exec(node, "sh", "-c", f'echo $$ > /sys/fs/cgroup/devices{cgroup}/cgroup.procs && '
                       f'exec setpriv --reuid="$(id -u {user})" --regid="$(id -g {user})" --init-groups '
                       f"python3 -c '{OPEN_FAKE_GPUS}'")
    return json.loads(out.strip().splitlines()[-1])


def test_a_cell_opens_only_its_granted_gpu_and_nothing_opens_one_outside_a_grant(cluster, alice, alice_kernel):
    """Device access per grant (gpuhub/agent/device_gate.py): CUDA_VISIBLE_DEVICES is only a promise,
    so the kernel's cgroup lets a cell open its granted GPU's node and no other; between cells only
    while the cell's process lingers on its lease (kept for the next cell), and once another kernel
    takes that GPU (the agent kills the idle process: it is the kernel's replica's child) none; the
    user's server never opens one."""
    kid, channel = alice_kernel
    out = channel.run("import os, socket; print(socket.gethostname(), os.environ['CUDA_VISIBLE_DEVICES'])\n"
                      + OPEN_FAKE_GPUS)
    host, visible = out["stdout"].split()[:2]
    opened = json.loads(out["stdout"].strip().splitlines()[-1])
    gpus = node_info(cluster, host)["gpus"]
    granted = next(g["index"] for g in gpus if g["uuid"] == visible)
    assert opened == {f"/dev/gpuhub-fake-gpu{g['index']}": "ENXIO" if g["index"] == granted else "EPERM"
                      for g in gpus}, (visible, opened)

    assert wait_for(lambda: node_info(cluster, host)["committed"] == 0, 15), "GPU still committed after the cell"
    unit = replica_units(cluster, kid)[host]["name"]
    lingering = wait_for(lambda: [le for le in node_info(cluster, host)["leases"]
                                  if le["holder"] == unit and le["lingering_pid"]], 15)
    assert lingering, node_info(cluster, host)["leases"]
    assert unit_props(cluster, host, unit, "DeviceAllow")["DeviceAllow"] == f"/dev/gpuhub-fake-gpu{granted} rw"
    hog = hold_every_gpu(cluster, host)  # takes the lingering GPU back at once
    try:
        assert not [le for le in node_info(cluster, host)["leases"] if le["holder"] == unit]
        state = cluster.exec(host, "sh", "-c", f"grep ^State: /proc/{lingering[0]['lingering_pid']}/status || true")
        assert not state.strip() or "zombie" in state, f"the lingering process outlived its lease: {state}"
    finally:
        let_go(cluster, host, hog)
    # systemctl show leaves out an empty DeviceAllow=
    assert wait_for(lambda: "gpuhub-fake-gpu" not in unit_props(cluster, host, unit, "DeviceAllow").get(
        "DeviceAllow", ""), 15), unit_props(cluster, host, unit, "DeviceAllow")
    assert unit_props(cluster, host, unit, "DevicePolicy")["DevicePolicy"] == "closed"
    assert set(opens_in_unit(cluster, host, unit, "alice").values()) == {"EPERM"}
    notebook_host = cluster.groups["notebook_hosts"][0]  # where the test cluster's servers run
    assert set(opens_in_unit(cluster, notebook_host, "gpuhub-server-alice", "alice").values()) == {"EPERM"}


def test_every_daemon_runs_in_the_shared_sandbox_and_only_the_agent_keeps_the_gpus(cluster):
    """roles/systemd_hardening's drop-in, as systemd applies it on every host: the daemons run (or,
    for the certificate metric's one-shot, ran) in it; the agent alone sees the host's devices and
    has no device allow-list (ProtectClock would make one, closing /dev/nvidia* to NVML)."""
    everywhere = sorted(cluster.hosts)
    units = {"gpuhub-scheduler.service": cluster.groups["hub"], "jupyterhub.service": cluster.groups["hub"],
             "configurable-http-proxy.service": cluster.groups["hub"],
             "gpuhub-agent.service": cluster.groups["gpu_nodes"],
             "prometheus.service": cluster.groups["monitoring"],
             "prometheus-alertmanager.service": cluster.groups["monitoring"],
             "prometheus-node-exporter.service": everywhere, "gpuhub-cert-metrics.service": everywhere}
    keys = ("DropInPaths,ActiveState,Result,NoNewPrivileges,ProtectSystem,RestrictSUIDSGID,ProtectKernelTunables,"
            "PrivateDevices,ProtectClock,DevicePolicy,DeviceAllow,SystemCallErrorNumber")
    checked = 0
    for unit, hosts in units.items():
        for host in hosts:
            out = cluster.exec(host, "systemctl", "show", "-p", keys, unit)
            props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
            assert f"/{unit}.d/gpuhub-hardening.conf" in props["DropInPaths"], (host, unit, props)
            assert props["Result"] == "success", (host, unit, props)
            if unit != "gpuhub-cert-metrics.service":
                assert props["ActiveState"] == "active", (host, unit, props)
            assert (props["NoNewPrivileges"], props["ProtectSystem"], props["RestrictSUIDSGID"],
                    props["ProtectKernelTunables"]) == ("yes", "strict", "yes", "yes"), (host, unit, props)
            keeps_devices = unit == "gpuhub-agent.service"
            assert (props["PrivateDevices"] == "no") == keeps_devices, (host, unit, props)
            reads_clock = keeps_devices or unit == "prometheus-node-exporter.service"  # timex: adjtimex
            assert (props["ProtectClock"] == "no") == reads_clock, (host, unit, props)
            if keeps_devices:
                assert props["DevicePolicy"] == "auto" and not props.get("DeviceAllow"), (host, props)
            checked += 1
    assert checked >= 3 + len(cluster.groups["gpu_nodes"]) + 2 + 2 * len(everywhere)


def test_two_users_cells_get_different_gpus(cluster, alice, alice_kernel):
    bob = HubUser(cluster, "bob")
    bob.login()
    bob.start_server("gpu1")
    try:
        bob_channel = bob.kernel(bob.start_kernel("gpuhub-gpu1"))
        try:
            _, alice_channel = alice_kernel
            code = WHERE + "\nimport time; time.sleep(4)"
            results = {}

            def run(name, channel):
                results[name] = channel.collect(channel.send_execute(code))

            threads = [threading.Thread(target=run, args=("alice", alice_channel)),
                       threading.Thread(target=run, args=("bob", bob_channel))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(KERNEL_TIMEOUT_S)
            where = {name: tuple(out["stdout"].split()[:2]) for name, out in results.items()}
            assert len(where) == 2 and all(len(w) == 2 for w in where.values()), results
            waited = any("waiting for" in text for out in results.values() for text in out["notices"])
            assert where["alice"] != where["bob"] or waited, f"both cells ran on the same GPU at once: {where}"
        finally:
            bob_channel.close()
    finally:
        bob.stop_server()


def test_only_a_token_with_the_kernel_scope_may_run_kernels(cluster, alice, alice_kernel):
    """The kernel started through alice's server (its token carries custom:gpuhub:kernels); a token
    of hers with only what visiting someone's server gives (her name, access to a server) names her
    but may not start, list or stop kernels: starting one would run code as her."""
    r = alice.s.post(
        f"{alice.base}/hub/api/users/alice/tokens",
        json={"note": "no kernel scope", "expires_in": 600, "scopes": ["read:users:name!user", "access:servers!user"]},
        headers={"Authorization": f"token {alice.token}"}, timeout=30)
    assert r.status_code in (200, 201), r.text[:500]
    narrow = r.json()["token"]
    scheduler = f"{cluster.scheduler_url}/api/v1/kernels"
    for token, expected in ((narrow, 403), (alice.token, 200)):  # her full token inherits the scope
        got = http_session(cluster).get(scheduler, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert got.status_code == expected, (got.status_code, got.text[:300])
    refused = http_session(cluster).post(scheduler, headers={"Authorization": f"Bearer {narrow}"}, timeout=30,
                            json={"kernel_id": "stolen1", "key": "k", "gpus": 1})
    assert refused.status_code == 403 and "custom:gpuhub:kernels" in refused.json()["error"]


def test_admin_sees_the_kernel_and_every_servers_version(cluster, alice_kernel):
    """`gpuhub kernels` and `gpuhub version` as root on the hub, as an admin runs them after the install."""
    kid, _ = alice_kernel
    hub = cluster.groups["hub"][0]
    cli = "/opt/gpuhub/venv/bin/gpuhub"
    kernels = json.loads(cluster.exec(hub, cli, "kernels", "--user", "alice", "--json"))["kernels"]
    mine = next(k for k in kernels if k["kernel_id"] == kid)
    assert mine["user"] == "alice" and len(mine["replicas"]) == 3
    assert {r["node"] for r in mine["replicas"]} <= set(cluster.groups["gpu_nodes"])
    assert kid in cluster.exec(hub, cli, "kernels")
    versions = json.loads(cluster.exec(hub, cli, "version", "--json"))
    servers = set(cluster.groups["gpu_nodes"]) | set(cluster.groups["notebook_hosts"])
    assert versions["scheduler"] == versions["cli"] and set(versions["nodes"]) == servers
    assert set(versions["nodes"].values()) == {versions["cli"]}, versions


def test_the_daemons_answer_only_over_tls_with_the_cluster_cas_certificates(cluster, tmp_path):
    """Every agent and the scheduler serve https with a certificate the roles' cluster CA signed for
    the address the others reach them at; a client that trusts only the hub's own certificate gets
    no answer (the token is never sent), and plain HTTP gets no API."""
    hub_only = tmp_path / "hub-only.pem"
    hub_only.write_text(cluster.exec(cluster.groups["hub"][0], "cat", "/etc/gpuhub/secrets/proxy/tls.crt"))
    ca_file = str(cluster.inventory_dir / "credentials" / "tls" / "ca.crt")
    servers = {node: cluster.agent_url(node) for node in cluster.groups["gpu_nodes"] + cluster.groups["notebook_hosts"]}
    servers["scheduler"] = cluster.scheduler_url
    for name, url in servers.items():
        path = "/api/v1/nodes" if name == "scheduler" else "/api/v1/node"
        s = requests.Session()
        s.trust_env = False
        s.verify = ca_file
        assert s.get(url + path, timeout=10).status_code == 401, name  # verified; no token: refused
        s.verify = str(hub_only)
        with pytest.raises(requests.exceptions.SSLError):
            s.get(url + path, timeout=10)
        plain = url.replace("https://", "http://")
        try:
            answer = s.get(plain + path, timeout=10)
        except requests.ConnectionError:
            continue
        assert answer.status_code == 400, (name, answer.status_code)  # tornado refusing plain HTTP


def test_each_agent_takes_only_its_own_token_and_prometheus_only_reads_metrics(cluster):
    """What the roles handed out: each server's agent token opens that agent only, a server's disk
    holds only digests, and Prometheus' token opens /metrics and nothing else."""
    s = http_session(cluster)
    servers = cluster.groups["gpu_nodes"] + cluster.groups["notebook_hosts"]
    assert set(servers) <= set(cluster.agent_tokens)
    for node in servers:
        url = cluster.agent_url(node) + "/api/v1/node"
        assert s.get(url, headers=cluster.agent_auth(node), timeout=10).status_code == 200, node
        for other in servers:
            if other != node:
                assert s.get(url, headers=cluster.agent_auth(other), timeout=10).status_code == 401, (node, other)
        on_disk = cluster.exec(node, "cat", "/etc/gpuhub/secrets/agent.token", "/etc/gpuhub/secrets/metrics.token")
        assert [line[:7] for line in on_disk.split()] == ["sha256:", "sha256:"], node

    metrics_token = (cluster.inventory_dir / "credentials" / "metrics.token").read_text().strip()
    metrics = {"Authorization": f"Bearer {metrics_token}"}
    daemons = [(cluster.agent_url(n), "/api/v1/units") for n in servers] + [(cluster.scheduler_url, "/api/v1/kernels")]
    for url, admin_path in daemons:
        assert s.get(url + "/metrics", headers=metrics, timeout=10).status_code == 200, url
        assert s.get(url + admin_path, headers=metrics, timeout=10).status_code == 401, url

    monitoring = cluster.groups["monitoring"][0]
    kept = cluster.exec(monitoring, "ls", "/etc/prometheus/secrets").split()
    assert set(kept) - {"gpuhub-ca.crt"} == {"metrics.token", "jupyterhub-metrics.token"}, kept


def test_prometheus_scrapes_every_agent_the_scheduler_and_the_hub(cluster):
    """The real daemons and the real JupyterHub, with the tokens the roles gave Prometheus (the
    local monitoring tests stand in a stub for the hub: here it is the real one)."""
    agents = set(cluster.groups["gpu_nodes"]) | set(cluster.groups["notebook_hosts"])
    expected = {"gpuhub-agent": len(agents), "gpuhub-scheduler": 1, "jupyterhub": 1}
    seen: list = []  # the last answer, for the failure message

    def scraped():
        r = http_session(cluster).get(f"http://{cluster.hub}:9090/api/v1/query",
                                      params={"query": 'up{job=~"gpuhub-agent|gpuhub-scheduler|jupyterhub"}'},
                                      timeout=10)
        r.raise_for_status()
        series = r.json()["data"]["result"]
        seen[:] = [(s["metric"].get("job"), s["metric"].get("instance"), s["value"][1]) for s in series]
        up = {job: sum(s["metric"]["job"] == job and s["value"][1] == "1" for s in series) for job in expected}
        return up if up == expected else None

    assert wait_for(scraped, 45, interval=3), f"expected these targets up: {expected}; Prometheus said {seen}"

    # alice's GPU cells above are in the agents' wait histogram, her kernel in the scheduler's.
    def counted(expr: str):
        r = http_session(cluster).get(f"http://{cluster.hub}:9090/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        result = r.json()["data"]["result"]
        return result and float(result[0]["value"][1]) > 0

    assert wait_for(lambda: counted("sum(gpuhub_agent_cell_gpu_wait_seconds_count)"), 45, interval=3)
    assert wait_for(lambda: counted("gpuhub_scheduler_kernel_start_seconds_count"), 45, interval=3)
    # The hub certificate's expiry, from the hourly timer's node_exporter text file: the
    # certificate the cluster CA issued has more than 800 days left, and it was read.
    days_left = '(gpuhub_tls_cert_not_after_seconds{path="/etc/gpuhub/secrets/proxy/tls.crt"} - time()) / 86400 > 800'
    assert wait_for(lambda: counted(days_left), 45, interval=3)
    assert wait_for(lambda: counted('gpuhub_tls_cert_readable{path="/etc/gpuhub/secrets/proxy/tls.crt"}'), 45,
                    interval=3)
    # Every gpuhub host's own certificate and the cluster CA are watched the same way, read and far
    # from expiry (825 and 3650 days). Counted over the role's targets (they carry a `node` label):
    # for 5 minutes after a first install Prometheus still answers with what Debian's default
    # config scraped as "localhost:9100" before the role's config replaced it.
    gpuhub_hosts = len({h for g in ("hub", "notebook_hosts", "gpu_nodes") for h in cluster.groups[g]})
    ca = "/usr/local/share/ca-certificates/gpuhub-cluster-ca.crt"
    for path, days in (("/etc/gpuhub/tls/host.crt", 800), (ca, 3000)):
        left = f'(gpuhub_tls_cert_not_after_seconds{{path="{path}", node!=""}} - time()) / 86400'
        far = f"count({left} > {days}) == {gpuhub_hosts}"
        assert wait_for(lambda expr=far: counted(expr), 45, interval=3), far


# A webhook receiver for Alertmanager, on the monitoring host: appends "<path> <body>" per POST.
WEBHOOK = r"""
import http.server
class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with open("/run/gpuhub-e2e-webhook.log", "ab") as f:
            f.write(self.path.encode() + b" " + body.replace(b"\n", b" ") + b"\n")
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", 9099), Receiver).serve_forever()
"""


def test_alerts_reach_alertmanager_and_its_webhooks(cluster):
    """Prometheus sends its alerts to the Alertmanager beside it, which delivers them to the
    inventory's webhooks (here a receiver on the monitoring host); nothing of it listens outside."""
    mon = cluster.groups["monitoring"][0]
    addr = cluster.hosts[mon]
    for port in (9093, 9094):  # the API on loopback only, no gossip port at all
        with pytest.raises(requests.ConnectionError):
            http_session(cluster).get(f"http://{addr}:{port}/", timeout=5)
    cluster.exec(mon, "rm", "-f", "/run/gpuhub-e2e-webhook.log")
    cluster.exec(mon, "systemd-run", "--unit=gpuhub-e2e-webhook", "--collect", "python3", "-c", WEBHOOK)
    try:
        def delivered():
            log = cluster.exec(mon, "cat", "/run/gpuhub-e2e-webhook.log", check=False)
            for line in log.splitlines():
                path, _, body = line.partition(" ")
                if path == "/watchdog":
                    return json.loads(body)
            return None

        # The watchdog is repeated every minute in the test cluster's inventory.
        message = wait_for(delivered, 150, interval=2)
        assert message, "no GpuhubWatchdog notification reached the webhook within 150 s"
        (alert,) = message["alerts"]
        assert alert["labels"]["alertname"] == "GpuhubWatchdog" and alert["labels"]["cluster"] == "gpuhub"
        assert alert["status"] == "firing"
    finally:
        cluster.exec(mon, "systemctl", "stop", "gpuhub-e2e-webhook", check=False)


def test_a_kernel_whose_replicas_are_all_killed_at_once_keeps_its_large_values(cluster, alice):
    """All three replica processes killed together (as the OOM killer would, each over MemoryMax):
    systemd restarts each in place, and the large value, which no replica had in memory any more,
    comes back from each replica's own disk (gpuhub/replication/blobdisk.py)."""
    kid = alice.start_kernel("gpuhub-gpu1")
    channel = alice.kernel(kid)
    try:
        channel.run("big = bytes(range(256)) * 40_000\nstate = 7", timeout=60)
        placed = wait_for(lambda: (units := replica_units(cluster, kid)) and len(units) == 3 and units, 30)
        assert placed, f"replicas of {kid}: {replica_units(cluster, kid)}"

        def on_disk(node: str) -> bool:
            blobs = f"/var/lib/gpuhub/agent/journals/{placed[node]['name']}/blobs"
            return bool(cluster.exec(node, "ls", blobs, check=False).split())
        assert wait_for(lambda: all(on_disk(n) for n in placed), 60, interval=1), "no large values on disk"

        for node, unit in placed.items():
            cluster.exec(node, "systemctl", "kill", "-s", "KILL", f"{unit['name']}.service")
        def restarted(node: str, unit: str) -> bool:
            props = unit_props(cluster, node, unit, "NRestarts", "ActiveState")
            return props["NRestarts"] == "1" and props["ActiveState"] == "active"
        for node, unit in placed.items():
            assert wait_for(lambda n=node, u=unit["name"]: restarted(n, u), 60, interval=1), \
                f"systemd did not restart {unit['name']} on {node}"
        out = channel.run("print(len(big), big[:3], state)", timeout=180)
        assert out["stdout"].split() == ["10240000", "b'\\x00\\x01\\x02'", "7"], out
    finally:
        channel.close()
        alice.api("DELETE", f"/user/alice/api/kernels/{kid}")


def test_zz_losing_an_idle_replicas_server_loses_nothing(cluster, alice_kernel):
    """Runs last: `podman kill` (a power cut) of a GPU node holding an idle replica of the kernel.
    The other two replicas are a majority: the next cell works and sees the state from before."""
    _, channel = alice_kernel
    out = channel.run("survivor = 41\n" + WHERE)
    executor = out["stdout"].split()[0]
    victim = next(n for n in cluster.groups["gpu_nodes"] if n != executor)
    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    subprocess.run(["podman", "kill", cluster.containers[victim]], check=True, env=env, capture_output=True)
    try:
        started = time.monotonic()
        out = channel.run("survivor += 1\nprint(survivor)", timeout=60)
        assert out["stdout"].strip() == "42"
        print(f"next cell after losing {victim}: {time.monotonic() - started:.1f} s")
    finally:
        subprocess.run(["podman", "start", cluster.containers[victim]], env=env, capture_output=True)


def replica_units(cluster, kernel_id: str) -> dict[str, dict]:
    """The kernel's replica units by node, from every GPU node's agent that answers."""
    found = {}
    for node in cluster.groups["gpu_nodes"]:
        try:
            r = http_session(cluster).get(f"{cluster.agent_url(node)}/api/v1/units",
                                          headers=cluster.agent_auth(node), timeout=5)
            r.raise_for_status()
        except requests.RequestException:
            continue  # a node that is down
        for unit in r.json()["units"]:
            if unit.get("kind") == "kernel" and unit.get("kernel_id") == kernel_id:
                found[node] = unit
    return found


def unit_props(cluster, node: str, unit: str, *names: str) -> dict[str, str]:
    out = cluster.exec(node, "systemctl", "show", unit, "-p", ",".join(names))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def hold_every_gpu(cluster, node: str) -> str:
    """Another kernel on ``node`` holds all its GPUs (an admin-started unit and a lease on its own
    lease token, read as root the way systemd reads it). Returns the unit's name."""
    gpus = node_info(cluster, node)["gpu_count"]
    name = f"gpuhub-kernel-e2ehog-{node}-r0"
    admin = cluster.agent_auth(node)
    r = http_session(cluster).post(f"{cluster.agent_url(node)}/api/v1/units", headers=admin, timeout=30, json={
        "name": name, "kind": "kernel", "user": "bob", "gpus": gpus,
        "kernel": {"key": uuid.uuid4().hex, "kernel_id": f"e2ehog-{node}"}})
    assert r.status_code == 201, r.text
    env = cluster.exec(node, "cat", f"/run/gpuhub/units/{name}.env")
    token = next(line.split("=", 1)[1].strip().strip('"') for line in env.splitlines()
                 if line.startswith("GPUHUB_LEASE_TOKEN="))
    r = http_session(cluster).post(f"{cluster.agent_url(node)}/api/v1/leases", json={"gpus": gpus},
                                   headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    return name


def let_go(cluster, node: str, name: str) -> None:
    """Stop a unit ``hold_every_gpu`` started: its GPUs are free again."""
    http_session(cluster).delete(f"{cluster.agent_url(node)}/api/v1/units/{name}", timeout=30,
                                 headers=cluster.agent_auth(node))


def every_gpu_node_heartbeats(cluster) -> None:
    """Wait until every GPU node's agent answers and has heartbeated to the scheduler since (a
    test may have powered a node off and on again): only then is a new kernel placed on any."""
    nodes = cluster.groups["gpu_nodes"]

    def agents_up():
        try:
            return all(node_info(cluster, n) for n in nodes)
        except requests.RequestException:
            return False
    assert wait_for(agents_up, 120, interval=2), "not every GPU node's agent answers"
    back = time.time()

    def heartbeated_since():  # the scheduler's view of every node is fresh, as `gpuhub nodes` shows it
        # as the docs have admins run it: `sudo gpuhub ...`, found on the PATH
        listing = json.loads(cluster.exec(cluster.groups["hub"][0], "sudo", "gpuhub", "nodes", "--json"))
        seen = {n["node"]: n["last_seen"] for n in listing["nodes"] if n["live"]}
        return all(seen.get(n, 0) > back for n in nodes)
    assert wait_for(heartbeated_since, 60, interval=1), "not every GPU node heartbeated to the scheduler"


def four_gpu_nodes_up(cluster) -> list[str]:
    """The GPU nodes, once every one of them heartbeats (a test before may have powered one off);
    skips a test that needs a fourth, spare server on a cluster made with fewer."""
    nodes = cluster.groups["gpu_nodes"]
    if len(nodes) < 4:
        pytest.skip("needs a spare GPU node: a cluster made with GPUHUB_GPU_NODES=4 (make test-cluster does)")
    every_gpu_node_heartbeats(cluster)
    return nodes


def test_zz_crashed_and_lost_replicas_come_back(cluster, alice):
    """Runs last, on a fresh kernel. Real systemd, real power cut:
    1. a replica killed by a signal is restarted in place by systemd and the kernel goes on;
    2. after a power cut of another replica's server, the scheduler starts a replacement on the
       spare node (the two survivors are a majority meanwhile);
    3. the replacement holds the notebook's state and runs the next cell when the GPUs of the
       other two servers are all taken."""
    # The test before restarts a powered-off node: place this kernel only once every node is back.
    nodes = four_gpu_nodes_up(cluster)
    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    kid = alice.start_kernel("gpuhub-gpu1")
    channel = alice.kernel(kid)
    hogs: list[tuple[str, str]] = []
    powered_off = None
    try:
        executor = channel.run("state = 1\n" + WHERE)["stdout"].split()[0]
        placed = wait_for(lambda: (units := replica_units(cluster, kid)) and len(units) == 3 and units, 30)
        assert placed and executor in placed, f"replicas of {kid}: {placed}"
        crashed, powered_off = sorted(n for n in placed if n != executor)
        spare = next(n for n in nodes if n not in placed)

        # 1. SIGKILL an idle replica: systemd restarts it, and the next cell works.
        unit = placed[crashed]["name"]
        assert unit_props(cluster, crashed, unit, "Restart")["Restart"] == "on-failure"
        cluster.exec(crashed, "systemctl", "kill", "-s", "KILL", f"{unit}.service")
        restarted = wait_for(lambda: (p := unit_props(cluster, crashed, unit, "NRestarts", "ActiveState"))
                             ["NRestarts"] == "1" and p["ActiveState"] == "active", 30, interval=1)
        assert restarted, (f"systemd did not restart {unit}: "
                           f"{unit_props(cluster, crashed, unit, 'NRestarts', 'ActiveState')}")
        assert channel.run("state += 1; print(state)", timeout=60)["stdout"].strip() == "2"

        # 2. Power cut of the other idle replica's server: a replacement starts on the spare node.
        subprocess.run(["podman", "kill", cluster.containers[powered_off]], check=True, env=env, capture_output=True)
        started = time.monotonic()
        assert channel.run("state += 1; print(state)", timeout=60)["stdout"].strip() == "3"
        replacement = wait_for(lambda: (u := replica_units(cluster, kid).get(spare)) and u.get("state") == "active"
                               and u, 120, interval=2)
        assert replacement, f"no replacement replica on {spare} within 120 s"
        print(f"replacement on {spare} active {time.monotonic() - started:.1f} s after the power cut")

        # 3. It runs the next cell once the others cannot: their servers' GPUs are all taken.
        for node in (executor, crashed):
            hogs.append((node, hold_every_gpu(cluster, node)))
        out = channel.run("state += 1\n" + WHERE + "\nprint(state)", timeout=180)
        host, _, value = out["stdout"].split()[:3]
        assert (host, value) == (spare, "4"), f"expected the replacement on {spare} to run it with state 4: {out}"
    finally:
        for node, name in hogs:
            let_go(cluster, node, name)
        channel.close()
        alice.api("DELETE", f"/user/alice/api/kernels/{kid}")
        if powered_off:
            subprocess.run(["podman", "start", cluster.containers[powered_off]], env=env, capture_output=True,
                           check=False)
