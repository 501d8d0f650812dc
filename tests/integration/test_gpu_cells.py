"""A GPU kernel started by a real agent runs each cell in a forked child holding a per-cell lease."""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import threading
import time

import pytest
import zmq
from jupyter_client import BlockingKernelClient

from gpuhub.agent.units import ProcessRunner
from gpuhub.dev.cluster import current_user
from gpuhub.kernel.wait_notice import notice_text
from gpuhub.platform import curve
from gpuhub.platform.curve import kernel_curve_keys, with_keys
from tests import zmq_peers
from tests.helpers import wait_for


def start_kernel(agent, name="gpuhub-kernel-t1", gpus=1, env=None):
    key = secrets.token_hex(16)
    status, unit = agent.call("POST", "/api/v1/units", {
        "name": name, "kind": "kernel", "user": current_user(), "gpus": gpus,
        "env": env or {}, "kernel": {"key": key, "kernel_id": name},
    })
    assert status == 201, unit
    conn = unit["connection"]
    status, body = agent.call("PUT", f"/api/v1/units/{name}/peers", {"replicas": [{  # a group of one
        "id": 0, "node": agent.name, "raft": f"{conn['ip']}:{conn['raft_port']}",
        "blob": f"{conn['ip']}:{conn['blob_port']}"}]})
    assert status == 200, body
    return connect(unit["connection"], key), unit


def connect(conn: dict, key: str, timeout: float = 60) -> BlockingKernelClient:
    """A client of a kernel that may still be starting (its heartbeat is not up yet)."""
    deadline = time.monotonic() + timeout
    while True:
        kc = BlockingKernelClient()
        kc.load_connection_info(with_keys(conn, key))
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
            while True:  # a slow start leaves extra kernel_info replies: tests read the shell channel
                try:
                    kc.get_shell_msg(timeout=0.3)
                except queue.Empty:
                    return kc
        except RuntimeError:  # "died before replying": no heartbeat yet
            kc.stop_channels()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def run(kc, code, timeout=30, stdin=None):
    """Execute and collect (reply content, stdout, stderr, results, errors)."""
    out = {"stdout": "", "stderr": "", "results": [], "errors": [], "displays": [], "notices": []}

    def on_output(msg):
        t, c = msg["msg_type"], msg["content"]
        if (notice := notice_text(t, c)) is not None:  # the kernel's "waiting for a GPU" line
            out["notices"].append(notice)
        elif t == "stream":
            out[c["name"]] += c["text"]
        elif t == "execute_result":
            out["results"].append(c["data"].get("text/plain"))
        elif t == "display_data":
            out["displays"].append(c["data"])
        elif t == "error":
            out["errors"].append(c["ename"])

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=on_output,
                                   allow_stdin=stdin is not None, stdin_hook=stdin)
    return reply["content"], out


def wait_for_output(kc, msg_id: str, text: str, timeout: float = 30) -> None:
    """Read iopub until request ``msg_id`` has printed ``text``: the cell is past that point."""
    deadline = time.monotonic() + timeout
    seen = ""
    while text not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the cell did not print {text!r} within {timeout:g} s (printed {seen!r})")
        try:
            msg = kc.get_iopub_msg(timeout=left)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            seen += msg["content"]["text"]


def committed(agent) -> int:
    return agent.call("GET", "/api/v1/node")[1]["committed"]


def committed_soon(agent, within: float = 10.0) -> int:
    """The node's committed GPUs once the last cell's grant has ended: that happens just after its
    reply, when the cell's process has exited (gpuhub/kernel/reaper.py)."""
    deadline = time.monotonic() + within
    while (n := committed(agent)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def process_alive(pid: int) -> bool:
    """Running, not a zombie: a zombie's memory (GPU memory included) is already freed."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# A cell's code that makes its own process linger this many seconds after sending its results.
SLOW_EXIT = ("import os, time\n_exit = os._exit\nos._exit = lambda code: (time.sleep({s}), _exit(code))\n"
             "print(os.getpid())")


@pytest.fixture
def gpu_kernel(make_agent):
    agent = make_agent("gpunode", gpus=2)
    kc, unit = start_kernel(agent)
    yield agent, kc, unit
    kc.stop_channels()


@pytest.fixture
def fresh_gpu_kernel(make_agent):
    """A GPU kernel whose cells' processes never linger (GPUHUB_GPU_LINGER_S=0): each cell runs in
    a process forked for it, which exits after the cell."""
    agent = make_agent("gpunode", gpus=2)
    kc, unit = start_kernel(agent, env={"GPUHUB_GPU_LINGER_S": "0"})
    yield agent, kc, unit
    kc.stop_channels()


def lingering(agent) -> int:
    return agent.call("GET", "/api/v1/node")[1]["lingering"]


def test_cell_sees_exactly_its_granted_gpu_and_lease_is_released(gpu_kernel):
    agent, kc, _ = gpu_kernel
    _, node = agent.call("GET", "/api/v1/node")
    uuids = [g["uuid"] for g in node["gpus"]]
    reply, out = run(kc, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert reply["status"] == "ok", out
    assert out["stdout"].strip() in uuids
    assert committed_soon(agent) == 0
    assert agent.call("GET", "/api/v1/node")[1]["pending"] == 1


def test_a_replicas_sockets_refuse_every_client_without_the_kernels_keys(gpu_kernel):
    """Another user of the GPU server (or of the site network) connects to the replica's ports:
    without the kernel's CurveZMQ keys, plain or with a key pair of their own, no handshake
    succeeds on any of them, so they read no output and send nothing; the agent wrote the keys
    into the replica's connection file, and its rightful client works."""
    agent, kc, unit = gpu_kernel
    conn = unit["connection"]
    ctx = zmq.Context.instance()
    strangers = {"keyless": None, "own key pair": dict(zip(curve.KEY_FIELDS, (k.decode() for k in zmq.curve_keypair()),
                                                           strict=True))}
    kinds = {"shell_port": zmq.DEALER, "control_port": zmq.DEALER, "stdin_port": zmq.DEALER,
             "iopub_port": zmq.SUB, "hb_port": zmq.REQ}
    for port_key, kind in kinds.items():
        for who, keys in strangers.items():
            sock = zmq_peers.peer(ctx, kind, keys)
            try:
                outcome = zmq_peers.handshake(sock, f"tcp://{conn['ip']}:{conn[port_key]}")
            finally:
                sock.close(linger=0)
            assert outcome == "failed", (port_key, who)
    on_disk = json.loads((agent.dir / "run" / "units" / unit["name"] / "connection.json").read_text())
    assert {k: on_disk[k] for k in curve.KEY_FIELDS} == kernel_curve_keys(on_disk["key"])
    reply, out = run(kc, "print('only for its owner')")
    assert reply["status"] == "ok" and out["stdout"] == "only for its owner\n", out


def test_gpu_committed_while_cell_runs(gpu_kernel):
    agent, kc, _ = gpu_kernel
    msg_id = kc.execute("import time; time.sleep(3)")
    deadline, seen = time.monotonic() + 3, 0
    while time.monotonic() < deadline and not seen:
        seen = agent.call("GET", "/api/v1/node")[1]["committed"]
        time.sleep(0.1)
    assert seen == 1
    reply = kc.get_shell_msg(timeout=20)
    assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
    assert committed_soon(agent) == 0


def test_lease_is_held_until_the_cells_process_has_exited(fresh_gpu_kernel):
    agent, kc, _ = fresh_gpu_kernel
    started = time.monotonic()
    reply, out = run(kc, SLOW_EXIT.format(s=2))
    replied = time.monotonic() - started
    assert reply["status"] == "ok", out
    pid = int(out["stdout"].strip())
    assert replied < 2, "the reply waited for the cell's process to exit"
    samples = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        alive = process_alive(pid)  # first, so that a release seen after it cannot precede the exit
        samples.append((alive, committed(agent)))
        if not alive and samples[-1][1] == 0:
            break
        time.sleep(0.05)
    assert samples[0] == (True, 1)
    assert all(n == 1 for alive, n in samples if alive), "the lease ended while the cell's process lived"
    assert samples[-1] == (False, 0)
    reply, out = run(kc, "print('next')")  # the next cell gets a GPU again
    assert reply["status"] == "ok" and out["stdout"].strip() == "next"


def test_namespace_changes_come_back(gpu_kernel):
    _, kc, _ = gpu_kernel
    assert run(kc, "a = [1, 2]\nb = 'x'\ndef f(n):\n    return n * 2\nclass C:\n    v = 3")[0]["status"] == "ok"
    assert run(kc, "a.append(3)\ndel b\nc = f(21) + C.v")[0]["status"] == "ok"
    reply, out = run(kc, "print(a, 'b' in dir(), c, f(1))")
    assert out["stdout"].strip() == "[1, 2, 3] False 45 2"
    reply, out = run(kc, "c")
    assert out["results"] == ["45"] and reply["execution_count"] >= 4


def test_rich_output_errors_and_unpicklable_warning(gpu_kernel):
    _, kc, _ = gpu_kernel
    _, out = run(kc, "from IPython.display import display, HTML\ndisplay(HTML('<b>hi</b>'))")
    assert out["displays"] and out["displays"][0]["text/html"] == "<b>hi</b>"
    reply, out = run(kc, "1/0")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError"
    assert out["errors"] == ["ZeroDivisionError"]
    reply, out = run(kc, "gen = (i for i in range(3))\nz = 5")
    assert reply["status"] == "ok"
    assert "'gen'" in out["stderr"] and "warning" in out["stderr"]
    reply, out = run(kc, "print(z)")
    assert out["stdout"].strip() == "5"


def test_interrupt_reaches_the_cell_and_frees_the_gpu(gpu_kernel):
    agent, kc, _ = gpu_kernel
    run(kc, "before = 1")
    msg_id = kc.execute("import time\nbefore = 2\nprint('sleeping', flush=True)\ntime.sleep(60)")
    wait_for_output(kc, msg_id, "sleeping")  # the interrupt must find the cell in its sleep
    from jupyter_client.session import Session  # noqa: F401 - message is sent by the client below

    kc.control_channel.send(kc.session.msg("interrupt_request", {}))
    reply = kc.get_shell_msg(timeout=15)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert committed_soon(agent) == 0
    _, out = run(kc, "print(before)")
    assert out["stdout"].strip() == "2"  # what ran before the interrupt is kept, as in plain IPython


def test_input_is_relayed(gpu_kernel):
    _, kc, _ = gpu_kernel
    answers = queue.Queue()

    def stdin_hook(msg):
        answers.put(msg["content"]["prompt"])
        kc.input("forty-two")

    _, out = run(kc, "v = input('value? ')\nprint('got', v)", stdin=stdin_hook)
    assert answers.get_nowait() == "value? "
    assert out["stdout"].strip() == "got forty-two"


def test_two_kernels_get_different_gpus_and_third_waits_visibly(make_agent):
    agent = make_agent("gpunode", gpus=2)
    kcs = [start_kernel(agent, name=f"gpuhub-kernel-k{i}")[0] for i in range(3)]
    code = "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(4)"
    results = {}

    def go(i):
        results[i] = run(kcs[i], code, timeout=60)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: committed(agent) == 2, 30, "both GPUs granted to the first two cells")
    t3 = threading.Thread(target=go, args=(2,))
    t3.start()
    for t in [*threads, t3]:
        t.join()
    first = {results[i][1]["stdout"].strip() for i in range(2)}
    assert len(first) == 2, results
    assert "waiting for 1 GPU" in results[2][1]["notices"][0], results[2]
    assert results[2][0]["status"] == "ok"
    # What users felt, in the agent's histogram: the third cell waited (until a 4 s cell ended), the
    # first two got their GPUs at once. Each is counted when its lease goes back.
    def wait_samples():
        text = agent.call("GET", "/metrics")[1]
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("gpuhub_agent_cell_gpu_wait_seconds")}

    prefix = "gpuhub_agent_cell_gpu_wait_seconds"
    wait_for(lambda: wait_samples()[f'{prefix}_count{{node="gpunode"}}'] == 3, 30, "three cells' waits counted")
    waits = wait_samples()
    assert waits[f'{prefix}_bucket{{le="0.5",node="gpunode"}}'] <= 2, waits
    assert waits[f'{prefix}_sum{{node="gpunode"}}'] >= 0.5, waits
    for kc in kcs:
        kc.stop_channels()


def children(pid: int) -> set[int]:
    """The live (not zombie) child processes of ``pid``."""
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found.update(int(c) for c in f.read().split())
    return {c for c in found if process_alive(c)}


def spare_of(replica: int, last_cell: int) -> int:
    """The process the replica forked for its next GPU cell, once the last cell's has exited."""
    return wait_for(lambda: len(kids := children(replica) - {last_cell}) == 1 and next(iter(kids)), 30,
                    "the replica to fork the next cell's process")


def test_the_next_gpu_cells_process_is_forked_before_the_cell_comes_and_runs_it(fresh_gpu_kernel):
    """After a GPU cell the replica forks the next cell's process at once (it gets ready while the
    user reads the output: gpuhub/kernel/cell_process.py); the next cell runs in that process, with
    every change of the cell before it."""
    _, kc, _ = fresh_gpu_kernel
    run(kc, "x = 1")  # the first cells' processes import what cells need: the replica follows
    _, out = run(kc, "import os\nx += 1\nprint(os.getpid(), os.getppid())")
    cell_pid, replica = (int(v) for v in out["stdout"].split())
    spare = spare_of(replica, cell_pid)
    reply, out = run(kc, "x += 1\nprint(os.getpid(), x)")
    assert reply["status"] == "ok" and out["stdout"].split() == [str(spare), "3"], out
    assert spare_of(replica, spare) not in (spare, cell_pid)  # a new one for the cell after


def test_a_cell_in_a_process_forked_before_its_request_sees_that_request(fresh_gpu_kernel):
    """User code that asks which request it answers (IPython's parent_header, the kernel's
    get_parent(), as widget and progress-bar libraries do) gets this cell's, as in ipykernel, though
    its process was forked before the request came."""
    _, kc, _ = fresh_gpu_kernel
    run(kc, "x = 1")
    _, out = run(kc, "import os\nprint(os.getpid(), os.getppid())")
    cell_pid, replica = (int(v) for v in out["stdout"].split())
    spare = spare_of(replica, cell_pid)
    printed = []
    reply = kc.execute_interactive(
        "print(os.getpid(), get_ipython().parent_header['header']['msg_id'], "
        "get_ipython().kernel.get_parent()['header']['msg_id'])", timeout=30,
        output_hook=lambda m: printed.append(m["content"]["text"]) if m["msg_type"] == "stream" else None)
    assert reply["content"]["status"] == "ok", reply["content"]
    request = reply["parent_header"]["msg_id"]
    assert "".join(printed).split() == [str(spare), request, request]


def test_a_spare_cell_process_that_died_waiting_is_replaced_and_the_cell_runs(fresh_gpu_kernel):
    _, kc, _ = fresh_gpu_kernel
    run(kc, "x = 1")
    _, out = run(kc, "import os\nx += 1\nprint(os.getpid(), os.getppid())")
    cell_pid, replica = (int(v) for v in out["stdout"].split())
    spare = spare_of(replica, cell_pid)
    os.kill(spare, signal.SIGKILL)
    wait_for(lambda: not process_alive(spare), 10, "the spare to die")
    reply, out = run(kc, "x += 1\nprint(os.getpid(), x)")
    assert reply["status"] == "ok", out
    pid, x = out["stdout"].split()
    assert int(pid) != spare and x == "3"


def test_killed_cell_process_reports_error_and_keeps_namespace(gpu_kernel):
    _, kc, _ = gpu_kernel
    run(kc, "x = 1")
    reply, out = run(kc, "import os, signal\nx = 2\nos.kill(os.getpid(), signal.SIGKILL)")
    assert reply["status"] == "error" and reply["ename"] == "CellProcessDied"
    assert reply["execution_count"] == 2  # the cell's own number, as IPython counts a failed cell
    _, out = run(kc, "print(x)")
    assert out["stdout"].strip() == "1"


# A frame begun on the cell's pipe, then the process killed: found on the podman cluster, where the
# kernel unit's memory limit killed a child sending back a new 1 GiB array; the replica then spun
# on the half frame at 100 % CPU and the notebook never got a reply.
HALF_FRAME = {
    "in its pickle": "pipe.HEADER.pack(1000, 0) + b'x' * 10",
    "in an out-of-band buffer": "pipe.HEADER.pack(len(data), 1) + pipe.SIZE.pack(1 << 20) + data + b'x' * 10",
}


@pytest.mark.parametrize("where", HALF_FRAME)
def test_a_cell_process_killed_while_sending_a_frame_reports_error_and_keeps_namespace(gpu_kernel, where):
    _, kc, _ = gpu_kernel
    run(kc, "x = 1")
    reply, _ = run(kc, "import os, pickle, signal, sys\nfrom gpuhub.kernel import pipe\nx = 2\n"
                       "data = pickle.dumps(('stream', 'stdout', 'lost'), protocol=5)\n"
                       f"os.write(sys.stdout.chan.fd, {HALF_FRAME[where]})\n"
                       "os.kill(os.getpid(), signal.SIGKILL)")
    assert reply["status"] == "error" and reply["ename"] == "CellProcessDied", reply
    _, out = run(kc, "print(x)")
    assert out["stdout"].strip() == "1"


def test_a_cell_whose_variables_cannot_be_handed_back_says_so_instead_of_ok(gpu_kernel):
    """The cell ran in its child, but gpuhub failed to capture its namespace (here: a value whose
    pickling raises a BaseException, which no per-name fallback catches). An "ok" would have lost
    the cell's changes without a word."""
    _, kc, _ = gpu_kernel
    run(kc, "x = 1")
    reply, out = run(kc, "class Boom:\n    def __reduce__(self):\n        raise KeyboardInterrupt\n"
                         "x = 2\nb = Boom()\nprint('ran')")
    assert out["stdout"] == "ran\n"
    assert reply["status"] == "error" and reply["ename"] == "CellVariablesLost", reply
    assert "variables are as they were before this cell" in reply["evalue"] and reply["execution_count"] == 2
    reply, out = run(kc, "print(x, 'b' in dir())")
    assert reply["status"] == "ok" and out["stdout"] == "1 False\n" and reply["execution_count"] == 3


def test_shutdown_after_a_cell_gives_its_gpu_back(gpu_kernel):
    agent, kc, _ = gpu_kernel
    reply, out = run(kc, SLOW_EXIT.format(s=1))
    assert reply["status"] == "ok", out
    kc.shutdown()
    assert committed_soon(agent, within=15) == 0


def test_asyncio_in_a_gpu_cell(gpu_kernel):
    _, kc, _ = gpu_kernel
    reply, out = run(kc, "import asyncio\nawait asyncio.sleep(0.01)\nprint('awaited')")
    assert reply["status"] == "ok" and out["stdout"].strip() == "awaited", out
    code = ("loop = asyncio.get_event_loop()\n"
            "print(loop.is_running(), loop.run_until_complete(asyncio.sleep(0, 'ran')))\n"
            "print(asyncio.run(asyncio.sleep(0, 'run')))")
    reply, out = run(kc, code)
    assert reply["status"] == "ok" and out["stdout"].split() == ["False", "ran", "run"], out


def test_a_gpu_cells_stdout_and_stderr_look_like_the_kernels_own(gpu_kernel):
    """Found running the same cells on a plain ipykernel: in a GPU cell, sys.stdout had no
    encoding (IPython's %time printed "us" for "μs") and no file descriptor, so passing it to a
    subprocess, or faulthandler's timer, raised UnsupportedOperation. A plain kernel prints
    "UTF-8 UTF-8 0" here."""
    _, kc, _ = gpu_kernel
    code = ("import faulthandler, subprocess, sys\n"
            "done = subprocess.run([sys.executable, '-c', 'pass'], stdout=sys.stdout, stderr=sys.stderr)\n"
            "faulthandler.dump_traceback_later(1000)\n"
            "faulthandler.cancel_dump_traceback_later()\n"
            "print(sys.stdout.encoding, sys.stderr.encoding, done.returncode)")
    reply, out = run(kc, code)
    assert reply["status"] == "ok", (reply, out)
    assert out["stdout"].split() == ["UTF-8", "UTF-8", "0"], out


# Comms as ipywidgets (and so tqdm.auto's progress bars) use them: opened, a message, closed.
COMM_CELL = ("from comm import create_comm\n"
             "c = create_comm(target_name='gpuhub.test', data={'v': 1}, buffers=[b'raw'])\n"
             "c.send({'v': 2})\n"
             "c.close()\n"
             "del c")


def test_a_gpu_cells_comm_messages_reach_the_client(gpu_kernel):
    """Found with ipywidgets and tqdm.auto: a GPU cell's comm_open and comm_msg went to the
    replica's iopub socket, whose sending thread does not exist in the forked process, and the
    frontend never saw them (a progress bar showed "model not found"). A plain ipykernel sends
    these three, with the cell as their parent."""
    _, kc, _ = gpu_kernel
    seen: list[dict] = []
    reply = kc.execute_interactive(COMM_CELL, timeout=30, output_hook=seen.append)
    assert reply["content"]["status"] == "ok", reply
    comms = [m for m in seen if m["msg_type"].startswith("comm_")]
    assert [(m["msg_type"], m["content"]["data"]) for m in comms] == [
        ("comm_open", {"v": 1}), ("comm_msg", {"v": 2}), ("comm_close", {})], seen
    assert comms[0]["content"]["target_name"] == "gpuhub.test"
    assert [bytes(b) for b in comms[0]["buffers"]] == [b"raw"]
    assert {m["parent_header"]["msg_id"] for m in comms} == {reply["parent_header"]["msg_id"]}
    assert len({m["content"]["comm_id"] for m in comms}) == 1


def test_agent_restart_between_cells_costs_the_kernel_nothing(gpu_kernel):
    agent, kc, _ = gpu_kernel
    assert run(kc, "x = 1")[0]["status"] == "ok"  # its lease connection to the agent is open now
    assert committed_soon(agent) == 0
    agent.stop()
    agent.start()  # same port: the kept-alive connection is dead, the next grant reconnects
    started = time.monotonic()
    reply, out = run(kc, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], x)")
    assert reply["status"] == "ok", out
    assert out["stdout"].split()[1] == "1" and "waiting" not in out["stderr"]
    assert time.monotonic() - started < 5  # no retry with backoff: granted at the first ask
    assert committed_soon(agent) == 0


def test_gpu_kernel_keeps_every_write_to_large_arrays(make_agent):
    """End to end: a GPU kernel's cells (forked child, tracker armed) lose no write (the tracker
    alone: tests/integration/test_dirty_process.py)."""
    kc, _ = start_kernel(make_agent("gpunode", gpus=1), name="gpuhub-kernel-dirty")
    try:
        cells = [
            "import numpy as np\na = np.zeros(4 << 20)\nb = np.ones(4 << 20)\nc = bytearray(4 << 20)",
            "x = 1",  # nothing written: a, b and c stay as they are
            "a[123] = 5",
            "b[-1] = 7; c[0] = 9",
            "v = a[::2]\nv[1] = 3",  # a write through a view (a[2])
            "a.shape = (2, -1)",  # the same bytes, another layout
        ]
        for code in cells:
            reply, out = run(kc, code)
            assert reply["status"] == "ok", (code, reply, out)
        _, out = run(kc, "print(a.ravel()[123], a.ravel()[2], a.shape, b[-1], b[0], c[0], v[1])")
        assert out["stdout"].split() == ["5.0", "3.0", "(2,", f"{2 << 20})", "7.0", "1.0", "9", "3.0"]
    finally:
        kc.stop_channels()


def test_modules_a_cell_imported_are_imported_by_the_replica_for_the_next_cells(gpu_kernel):
    """The replica imports, between cells, what a cell's process imported (quietly: `this` prints
    the Zen of Python at import), so the next cells' processes start with it
    (gpuhub/kernel/warm_imports.py)."""
    _, kc, _ = gpu_kernel
    check = "import sys; print('this' in sys.modules)"
    assert run(kc, check)[1]["stdout"] == "False\n"
    reply, out = run(kc, "def f():\n    import this\nf()")  # imported, and no name in the namespace
    assert reply["status"] == "ok" and "Beautiful is better than ugly." in out["stdout"]
    wait_for(lambda: run(kc, check)[1] == {"stdout": "True\n", "stderr": "", "results": [], "errors": [],
                                            "displays": [], "notices": []}, 30, "the replica to import the module")


def test_a_gpu_cells_working_directory_and_environment_reach_the_next_cells_process(fresh_gpu_kernel, tmp_path):
    """Found side by side with a plain ipykernel: ``%cd`` and ``os.environ`` changes of a GPU cell
    were gone in the next cell once that ran in a new process (no lingering process: the default
    linger is 30 s). The image carries them (gpuhub/kernel/process_state.py)."""
    _, kc, _ = fresh_gpu_kernel
    reply, out = run(kc, f"%cd {tmp_path}\nimport os\nos.environ['NOTEBOOK_A'] = '1'\n"
                         "os.environ['NOTEBOOK_B'] = '2'\nfirst = os.getpid()")
    assert reply["status"] == "ok", out
    reply, out = run(kc, "del os.environ['NOTEBOOK_B']\n%env NOTEBOOK_C=3")
    assert reply["status"] == "ok", out
    reply, out = run(kc, "print(os.getpid() != first, os.getcwd(), os.environ.get('NOTEBOOK_A'), "
                         "os.environ.get('NOTEBOOK_B'), os.environ.get('NOTEBOOK_C'))")
    assert out["stdout"].split() == ["True", str(tmp_path), "1", "None", "3"], out


def test_settings_a_gpu_cell_made_reach_the_next_cells_process(fresh_gpu_kernel, tmp_path):
    """``%autoreload 2``, ``%precision``, ``sys.path.insert``, a warnings filter,
    ``logging.basicConfig``, NumPy's print options and the seeded random generators live in the
    cell's process, which ends after the cell: the next cell's process starts with them all the
    same (gpuhub/kernel/shell_settings.py, random_state.py; pandas and rcParams:
    test_faithful.py). Found trying the kernel as notebooks use it: ``sys.path.insert(0, "../src")``
    then ``import mymodule`` in a later cell raised ModuleNotFoundError."""
    _, kc, _ = fresh_gpu_kernel
    (tmp_path / "notebook_helpers.py").write_text("ANSWER = 42\n")
    reply, out = run(kc, f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n%precision 3\n"
                         "%load_ext autoreload\n%autoreload 2\nimport os, warnings, numpy as np\n"
                         "warnings.simplefilter('error', UserWarning)\nnp.set_printoptions(precision=2)\n"
                         "import logging\nlogging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
                         "import random\nrandom.seed(0)\nnp.random.seed(0)\nfirst = os.getpid()")
    assert reply["status"] == "ok", out
    reply, out = run(kc, "reloader = get_ipython().magics_manager.registry['AutoreloadMagics']._reloader\n"
                         "print(os.getpid() != first, reloader.check_all, np.array([2 / 3]), random.random(),\n"
                         "      float(np.random.rand()))\n"
                         "del reloader\nlogging.getLogger('x').info('logged')\nwarnings.warn('raised')")
    assert reply["status"] == "error" and reply["ename"] == "UserWarning", (reply, out)
    # what the first draws after seed(0) are, in any Python and NumPy (both keep their streams)
    assert out["stdout"].split() == ["True", "True", "[0.67]", "0.8444218515250481", "0.5488135039273248"], out
    assert out["stderr"] == "INFO logged\n", out
    reply, out = run(kc, "import notebook_helpers\nnotebook_helpers.ANSWER / 7")
    assert reply["status"] == "ok" and out["results"] == ["6.000"], (reply, out)


# --- the lingering lease: a cell's process stays for the kernel's next cell ----
def test_quick_successive_gpu_cells_run_warm_in_the_last_cells_process(gpu_kernel):
    """After a GPU cell its process (CUDA context, GPU memory) stays for the next cell under the
    same lease, which lingers: not committed, but held. The next cell runs there, sees every change,
    and what it changes comes back to the replica as from any cell's process."""
    agent, kc, _ = gpu_kernel
    reply, out = run(kc, "import os\nfirst = os.getpid()\nx = [1]")
    assert reply["status"] == "ok", out
    wait_for(lambda: lingering(agent) == 1, 30, "the cell's lease to linger")
    assert committed(agent) == 0
    [lease] = agent.call("GET", "/api/v1/node")[1]["leases"]
    assert lease["lingering_pid"] == int(run(kc, "print(os.getpid())")[1]["stdout"])
    reply, out = run(kc, "x.append(2)\nprint(os.getpid() == first, x)")
    assert reply["status"] == "ok" and out["stdout"].strip() == "True [1, 2]", out
    assert agent.call("GET", "/api/v1/node")[1]["leases"][0]["lease_id"] == lease["lease_id"]
    reply, out = run(kc, "1/0")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError"
    printed = []  # as in a process forked for it, the cell sees the request it answers
    reply = kc.execute_interactive(
        "print(os.getpid() == first, get_ipython().parent_header['header']['msg_id'], "
        "get_ipython().kernel.get_parent()['header']['msg_id'])", timeout=30,
        output_hook=lambda m: printed.append(m["content"]["text"]) if m["msg_type"] == "stream" else None)
    request = reply["parent_header"]["msg_id"]
    assert "".join(printed).split() == ["True", request, request]
    # A value that cannot be replicated is gone from the replicas: from this process too, as it
    # would be from one forked for the next cell.
    reply, out = run(kc, "gen = (i for i in range(2))\nprint(os.getpid() == first, x)")
    assert reply["status"] == "ok" and out["stdout"].strip() == "True [1, 2]" and "'gen'" in out["stderr"], out
    reply, out = run(kc, "print(os.getpid() == first, x, 'gen' in dir())")
    assert out["stdout"].strip() == "True [1, 2] False", out


def test_another_kernel_takes_a_lingering_gpu_at_once_and_the_first_kernel_loses_nothing(make_agent):
    """One GPU: kernel A's last cell's process lingers on it. Kernel B's cell gets the GPU at once:
    the agent kills A's idle process (its exit frees the GPU's memory) and takes its lease back.
    A's next cell runs in a new process with A's namespace as it was."""
    agent = make_agent("gpunode", gpus=1)
    a, _ = start_kernel(agent, name="gpuhub-kernel-ka")
    b, _ = start_kernel(agent, name="gpuhub-kernel-kb")
    try:
        _, out = run(a, "import os\nx = 41\nprint(os.getpid())")
        a_pid = int(out["stdout"])
        wait_for(lambda: lingering(agent) == 1, 30, "A's lease to linger")
        # An election's tentative ask (reclaim false) takes nothing back: B's replica is told "busy"
        token = ProcessRunner(str(agent.dir / "run"), 0).read_env("gpuhub-kernel-kb")["GPUHUB_LEASE_TOKEN"]
        status, body = agent.call("POST", "/api/v1/leases", {"gpus": 1, "reclaim": False}, token=token)
        assert status == 409 and process_alive(a_pid), body
        reply, out = run(b, "import os\nprint(os.environ['CUDA_VISIBLE_DEVICES'])")
        assert reply["status"] == "ok" and "waiting" not in out["stderr"], out
        assert not process_alive(a_pid)
        reclaimed = [line for line in agent.call("GET", "/metrics")[1].splitlines()
                     if line.startswith("gpuhub_agent_leases_reclaimed_total")]
        assert reclaimed == ['gpuhub_agent_leases_reclaimed_total{node="gpunode"} 1.0'], reclaimed
        reply, out = run(a, f"x += 1\nprint(x, os.getpid() != {a_pid})", timeout=60)
        assert reply["status"] == "ok" and out["stdout"].strip() == "42 True", out
    finally:
        a.stop_channels()
        b.stop_channels()


def test_a_lingering_process_ends_after_the_kernels_linger_time(make_agent):
    agent = make_agent("gpunode", gpus=1)
    kc, _ = start_kernel(agent, env={"GPUHUB_GPU_LINGER_S": "0.5"})
    try:
        _, out = run(kc, "import os\nx = 1\nprint(os.getpid())")
        pid = int(out["stdout"])
        wait_for(lambda: not process_alive(pid) and not agent.call("GET", "/api/v1/node")[1]["leases"], 30,
                 "the lingering process to end and its lease to go back")
        reply, out = run(kc, f"print(x, os.getpid() != {pid})")
        assert reply["status"] == "ok" and out["stdout"].strip() == "1 True", out
    finally:
        kc.stop_channels()


FRAGILE = """import os
def _rebuild(pid):
    if pid != os.getpid():
        raise RuntimeError(f"made for process {pid}")
    return Fragile()
class Fragile:
    def __init__(self):
        self.pid = os.getpid()
    def __reduce__(self):
        return _rebuild, (self.pid,)
bad = Fragile()
x = 2
print('ran')"""


def test_a_cell_whose_variables_no_other_process_can_load_says_so_and_the_kernel_goes_on(gpu_kernel):
    """A value that pickles in the cell's process but cannot be unpickled anywhere else: its image,
    once committed, stopped every later cell ("this replica could not load the kernel's
    variables"). The replica loads the image before it commits it; this one is not committed."""
    _, kc, _ = gpu_kernel
    run(kc, "x = 1")
    reply, out = run(kc, FRAGILE)
    assert out["stdout"] == "ran\n"
    assert reply["status"] == "error" and reply["ename"] == "CellVariablesLost", reply
    assert "RuntimeError: made for process" in reply["evalue"] and reply["execution_count"] == 2
    reply, out = run(kc, "print(x, 'bad' in dir())\ny = 3")
    assert reply["status"] == "ok" and out["stdout"] == "1 False\n" and reply["execution_count"] == 3
    reply, out = run(kc, "print(x, y)")
    assert reply["status"] == "ok" and out["stdout"] == "1 3\n"
