"""A replicated kernel gives what a plain ipykernel gives (issue: a faithful replicated kernel):
shared objects, a training loop across cells, a replica that fell behind, a lost majority,
output history, input, and secrets that never reach the disk."""

from __future__ import annotations

import os
import signal
import stat
import time
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

from gpuhub.dev.cluster import DevCluster
from tests.helpers import debugpy_adapters, wait_for
from tests.integration.test_gpu_cells import FRAGILE, run
from tests.integration.test_replicated import (
    ReplicatedKernel,
    executor_id,
    kill_replica,
    ok,
    plain_outputs,
    serving_replicas,
    take_the_gpu,
)

# A small model and an optimizer that holds references to the model's parameters, across cells:
# the shape of `model = Net(); opt = SGD(model.parameters())` (numpy: CPU-only CI has no torch).
TRAINING = [
    """import numpy as np
rng = np.random.default_rng(0)
X = rng.normal(size=(256, 8)); true_w = rng.normal(size=8); y = X @ true_w
class Linear:
    def __init__(self, n):
        self.w = np.zeros(n); self.b = np.zeros(1)
    def parameters(self):
        return [self.w, self.b]
    def __call__(self, X):
        return X @ self.w + self.b
class SGD:
    def __init__(self, params, lr):
        self.params, self.lr = params, lr
    def step(self, grads):
        for p, g in zip(self.params, grads):
            p -= self.lr * g
model = Linear(8); opt = SGD(model.parameters(), lr=0.05)
def train(steps):
    for _ in range(steps):
        err = model(X) - y
        opt.step([X.T @ err / len(X), np.array([err.mean()])])
    return float(((model(X) - y) ** 2).mean())""",
    "print(f'{train(20):.6f}')",
    "print(f'{train(20):.6f}')",
    "print(f'{train(20):.6f}')",
]


@pytest.fixture(scope="module")
def plain_losses():
    """What a plain ipykernel prints for the training cells: the anchor."""
    return plain_outputs(TRAINING)


@pytest.fixture
def cluster(tmp_path):
    c = DevCluster(tmp_path, nodes=3, gpus_per_node=1).start()
    yield c
    c.stop()


@pytest.fixture(params=[0, 1], ids=["cpu", "gpu"])
def kernel(cluster, request):
    k = ReplicatedKernel(cluster, gpus=request.param)
    yield k
    k.close()


def test_training_across_cells_gives_plain_ipykernels_losses(kernel, plain_losses):
    outs = [ok(kernel, code)["stdout"] for code in TRAINING]
    assert outs == plain_losses
    assert float(outs[-1]) < float(outs[1])  # it trains: the optimizer updates the model itself
    # the executor is lost: the next executor's copy of the graph still trains the same model
    kill_replica(kernel, executor_id(kernel))
    check = "print(opt.params[0] is model.w, f'{train(20):.6f}')"
    again = ok(kernel, check, timeout=60)["stdout"].split()
    anchor = plain_outputs([*TRAINING, check])[-1]
    assert again == anchor.split() and again[0] == "True"


def test_shared_objects_stay_shared(kernel):
    ok(kernel, "s = [1]\nholder = {'a': s, 'b': s}\nimport numpy as np\nbase = np.zeros(400_000)\nhead = base[:4]")
    ok(kernel, "s.append(2)\nbase[0] = 7")
    out = ok(kernel, "print(holder['a'] is s, holder['b'] is holder['a'], holder['a'], head[0])")
    assert out["stdout"].split() == ["True", "True", "[1,", "2]", "7.0"]
    kill_replica(kernel, executor_id(kernel))  # a follower's copy of the graph takes over
    out = ok(kernel, "head[1] = 5\nprint(holder['a'] is s, holder['a'], base[1])", timeout=60)
    assert out["stdout"].split() == ["True", "[1,", "2]", "5.0"]


def test_a_function_from_an_earlier_cell_rebinds_the_notebooks_globals(kernel):
    """``global n`` in a function defined in an earlier cell: on a GPU kernel every cell's child
    and then the replica load it, and after a failover another replica does; the function must
    still count in the notebook's ``n``, as in a plain ipykernel."""
    cells = ["n = 0\ndef mark():\n    global n\n    n += 1\n    return n", "mark()",
             "print(mark(), n)", "n = 10\nprint(mark(), n)"]
    anchor = plain_outputs(cells)
    assert [ok(kernel, code)["stdout"] for code in cells] == anchor
    kill_replica(kernel, executor_id(kernel))  # a follower's copy takes over
    after = ok(kernel, "print(mark(), n)", timeout=60)["stdout"]
    assert after == plain_outputs([*cells, "print(mark(), n)"])[-1] == "12 12\n"


def test_output_history_and_prompts_match_ipykernel(kernel):
    msg_id = kernel.kc.execute("6 * 7")
    reply = kernel.kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:  # e.g. a late kernel_info_reply
        reply = kernel.kc.get_shell_msg(timeout=30)
    reply = reply["content"]
    results = []
    while True:
        msg = kernel.kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "execute_result":
            results.append(msg["content"]["execution_count"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert results == [reply["execution_count"]]  # Out[n] next to In [n]
    n = reply["execution_count"]
    out = ok(kernel, f"print(_, Out[{n}], _{n})")
    assert out["stdout"].split() == ["42", "42", "42"]
    hist = kernel.kc.history(hist_access_type="tail", n=2, output=False, raw=True, reply=True, timeout=30)
    assert [entry[2] for entry in hist["content"]["history"]] == ["6 * 7", f"print(_, Out[{n}], _{n})"]


# Cells whose replies carry payloads (a help page, a new cell for the frontend), and the cells after.
PAYLOAD_CELLS = ["def f(x):\n    return x", "f?", "1", "get_ipython().set_next_input('# next')", "2", "1/0", "3"]


def payload_sources(kc, cells: list[str]) -> list[list[str]]:
    """Each cell's reply payloads, by source: what the frontend shows or does once per payload."""
    return [[p["source"] for p in run(kc, code)[0].get("payload", [])] for code in cells]


@pytest.fixture(scope="module")
def plain_payloads():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        return payload_sources(kc, PAYLOAD_CELLS)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_payload_comes_with_its_own_cell_only_as_on_plain_ipykernel(kernel, plain_payloads):
    # A GPU cell's process that stays for the next cell kept every payload and sent them all again.
    assert plain_payloads == [[], ["page"], [], ["set_next_input"], [], [], []]
    assert payload_sources(kernel.kc, PAYLOAD_CELLS) == plain_payloads


OUTPUTS = ["6 * 7", "'second'", "print(_, __)", "_ = 'mine'", "99", "print(_, __, ___)", "del _", "5",
           "print(_, __, ___)"]


def test_output_history_moves_on_after_a_failover_until_a_cell_assigns_it(kernel):
    """IPython moves ``_``, ``__``, ``___`` on with each result only while they hold what it put
    there, by its own record (the hidden namespace). A replica that loaded them from an image (a
    failover; on a GPU kernel any fresh cell process) had a stale record: ``_`` stopped at the
    first result it loaded, for good."""
    want = plain_streams([OUTPUTS[0], *OUTPUTS])
    ok(kernel, OUTPUTS[0])
    kill_replica(kernel, executor_id(kernel))
    assert [streams(ok(kernel, code, timeout=60)) for code in OUTPUTS] == want[1:]


RESULTS = [
    "import pandas as pd\ndf = pd.DataFrame({'a': range(6), 'b': [x / 3 for x in range(6)]})",
    "df.head(3)",
    "df",
    "[[1, 2], {'k': 'v'}]",
    "class Tag:\n    pass\nt = Tag()\nt",
    "(6 * 7, 'answer')",
]
READ_BACK = [
    "print(Out[2].equals(df.head(3)), Out[3] is df, Out[4], type(Out[5]) is Tag, Out[5] is t, _ is Out[6], _6,"
    " __ is t, sorted(Out))",
    "Out[4][0].append(3)\nprint(_4)",
    "df.loc[0, 'a'] = 99\nprint(Out[3].loc[0, 'a'], Out[2].loc[0, 'a'])",
]


def test_outputs_pickled_once_load_with_their_values_and_identities_after_a_failover(kernel):
    """Results kept in ``Out`` are pickled once, by the cell that made them, and carried by
    reference after (gpuhub/kernel/sealed_outputs.py): the replica that takes over must still
    have each with its value, and the same objects where they are the namespace's."""
    want = plain_streams(RESULTS + READ_BACK)
    for code in RESULTS:
        ok(kernel, code)
    kill_replica(kernel, executor_id(kernel))
    # Before any cell, a request that reads the namespace: the replicas loaded the outputs
    # pending (built only when read), and a completion must see them built.
    matches = kernel.kc.complete("_4.app", reply=True, timeout=60)["content"]["matches"]
    assert any(m.endswith("append") for m in matches), matches
    assert [streams(ok(kernel, code, timeout=60)) for code in READ_BACK] == want[len(RESULTS):]


def test_a_cpu_kernel_whose_variables_only_their_process_can_load_says_why_after_a_failover(cluster):
    """A CPU kernel's executor does not load its own image (a GPU kernel's does, and keeps such a
    cell's variables out: test_gpu_cells.py). Once it is lost, the replica elected cannot load
    them: the user is told why, not only that it could not."""
    kernel = ReplicatedKernel(cluster, gpus=0)
    try:
        ok(kernel, "x = 1")
        assert "ran" in ok(kernel, FRAGILE)["stdout"]
        kill_replica(kernel, executor_id(kernel))
        reply, _ = run(kernel.kc, "print(x)", timeout=60)
        assert reply["status"] == "error" and "could not load the kernel's variables" in reply["evalue"], reply
        assert "RuntimeError: made for process" in reply["evalue"], reply
    finally:
        kernel.close()


LOGGING = [
    "import logging\nlogging.getLogger('notebook').warning('a warning, no handler set up')",
    "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s %(message)s')\n"
    "logging.getLogger('notebook').info('shown once basicConfig ran')",
    "print(len(logging.getLogger().handlers), logging.getLogger().level)",
]


def test_logging_in_cells_reaches_the_notebook_as_on_plain_ipykernel(kernel):
    """Found side by side: the replicas configured the root logger for their own log, so a cell's
    logging.warning went to the unit's journal and logging.basicConfig did nothing."""
    want = plain_streams(LOGGING)
    assert [streams(ok(kernel, code)) for code in LOGGING] == want


def streams(out: dict) -> dict:
    return {"stdout": out["stdout"], "stderr": out["stderr"]}


def plain_streams(cells: list[str]) -> list[dict]:
    """A plain ipykernel's stdout and stderr for each of ``cells``: the anchor."""
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        return [streams(run(kc, code)[1]) for code in cells]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_the_working_directory_and_environment_follow_the_cells_to_another_replica(kernel, tmp_path):
    """A plain kernel keeps ``%cd`` and ``os.environ`` changes in its one process; after a
    failover the next cell runs on another replica, which takes them on from the image. What
    gpuhub sets per replica (GPUHUB_*) stays each replica's own."""
    ok(kernel, f"%cd {tmp_path}\nimport os\nos.environ['NOTEBOOK_A'] = '1'\nos.environ['NOTEBOOK_B'] = '2'")
    ok(kernel, "del os.environ['NOTEBOOK_B']\n%env NOTEBOOK_C=3")
    executor = executor_id(kernel)
    kill_replica(kernel, executor)
    out = ok(kernel, "print(os.getcwd(), os.environ.get('NOTEBOOK_A'), os.environ.get('NOTEBOOK_B'), "
                     "os.environ.get('NOTEBOOK_C'), os.environ['GPUHUB_REPLICA_ID'])")
    cwd, a, b, c, replica = out["stdout"].split()
    assert (cwd, a, b, c) == (str(tmp_path), "1", "None", "3")
    assert int(replica) != executor


SETTINGS = [
    "%load_ext autoreload\n%autoreload 2",
    "import warnings, numpy as np, pandas as pd, matplotlib as mpl\n"
    "warnings.filterwarnings('ignore', message='noisy')\n"
    "np.set_printoptions(precision=3)\n"
    "np.seterr(divide='ignore')\n"
    "pd.set_option('display.max_rows', 7)\n"
    "mpl.rcParams['figure.figsize'] = (3.0, 2.0)\n"
    "mpl.rcParams['axes.prop_cycle'] = mpl.cycler(color=['red', 'blue'])",
    "import logging\nlogging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')\n"
    "logging.getLogger('noisy.library').setLevel(logging.ERROR)",
    # %config, and the class attribute many notebooks set
    "%config Completer.use_jedi = False\nfrom IPython.core.interactiveshell import InteractiveShell\n"
    "InteractiveShell.ast_node_interactivity = 'all'",
]
SETTINGS_SHOWN = (
    "import warnings, numpy as np, pandas as pd, matplotlib as mpl\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.warn('noisy thing'); warnings.warn('other thing')\n"
    "reloader = get_ipython().magics_manager.registry['AutoreloadMagics']._reloader\n"
    "print([str(w.message) for w in caught], np.array([1 / 3]), pd.get_option('display.max_rows'),\n"
    "      mpl.rcParams['figure.figsize'], mpl.rcParams['axes.prop_cycle'].by_key()['color'],\n"
    "      'autoreload' in get_ipython().extension_manager.loaded, reloader.enabled, reloader.check_all,\n"
    "      get_ipython().ast_node_interactivity, get_ipython().Completer.use_jedi, np.geterr()['divide'])\n"
    "del reloader\n"
    "logging.getLogger('notebook').info('shown as on a plain kernel')\n"
    "logging.getLogger('noisy.library').warning('hidden as on a plain kernel')")


def test_settings_made_in_cells_follow_them_to_another_replica(kernel):
    """Found side by side: ``%autoreload 2``, a warnings filter, ``logging.basicConfig``, NumPy's and
    pandas' options, rcParams, ``%config`` and loggers' levels live in the process, not in a variable, and were gone
    once the next cell ran in another process (a GPU cell's, after its linger) or on another replica (here: a failover).
    gpuhub/kernel/shell_settings.py carries them with each image."""
    want = plain_streams([*SETTINGS, SETTINGS_SHOWN])[-1]
    for code in SETTINGS:
        ok(kernel, code)
    executor = executor_id(kernel)
    kill_replica(kernel, executor)
    assert streams(ok(kernel, SETTINGS_SHOWN)) == want
    assert executor_id(kernel) != executor


RANDOM_SEEDED = "import random, time, numpy as np\nrandom.seed(0)\nnp.random.seed(0)"
# drawn after a pause: the replicas' Raft exchanges messages meanwhile
RANDOM_DRAWN = "time.sleep(1.5)\nprint(random.random(), np.random.rand(), random.gauss(0, 1))"


def test_seeded_random_generators_continue_their_sequence_in_later_cells_and_after_a_failover(kernel):
    """Found side by side: on a CPU kernel pysyncobj drew its election timeouts from the `random`
    module's generator, so a seeded notebook's next draws differed from a plain kernel's
    (gpuhub/replication/__init__.py); and a cell on another replica (a failover; for a GPU kernel
    any cell's fresh process) drew from that replica's unseeded generators
    (gpuhub/kernel/random_state.py)."""
    want = plain_streams([RANDOM_SEEDED, RANDOM_DRAWN, RANDOM_DRAWN])
    assert streams(ok(kernel, RANDOM_SEEDED)) == want[0]
    assert streams(ok(kernel, RANDOM_DRAWN)) == want[1]
    kill_replica(kernel, executor_id(kernel))
    assert streams(ok(kernel, RANDOM_DRAWN)) == want[2]


def test_input_without_a_frontend_raises_stdin_not_implemented(kernel):
    reply, out = run(kernel.kc, "input('name? ')")
    assert reply["status"] == "error" and reply["ename"] == "StdinNotImplementedError", (reply, out)


def test_no_debugger_and_no_subshells_are_offered_and_their_requests_are_refused(cluster):
    """ipykernel offers both. Its debugger starts debugpy, which listens on 127.0.0.1 without
    authentication, where the server's other users could attach and run code as this user; a
    subshell's cell ran on the one replica that had made the subshell, outside the Raft log."""
    k = ReplicatedKernel(cluster, gpus=0)
    try:
        kc = k.kc
        info = kc.kernel_info(reply=True, timeout=30)["content"]
        assert not {"debugger", "kernel subshells"} & set(info["supported_features"]), info

        def control(msg_type: str, content: dict) -> dict:
            kc.control_channel.send(kc.session.msg(msg_type, content))
            return kc.control_channel.get_msg(timeout=30)["content"]

        before = debugpy_adapters()
        debug = control("debug_request", {"type": "request", "seq": 1, "command": "initialize",
                                          "arguments": {"clientID": "test", "adapterID": "python"}})
        assert debug["success"] is False and "no debugger" in debug["message"], debug
        assert debugpy_adapters() <= before
        subshell = control("create_subshell_request", {})
        assert subshell["status"] == "error" and subshell["ename"] == "SubshellsUnsupported", subshell
        # A request that names a subshell anyway runs nowhere.
        msg = kc.session.msg("execute_request", {"code": "leaked = 1", "silent": False, "store_history": True,
                                                 "user_expressions": {}, "allow_stdin": False})
        msg["header"]["subshell_id"] = "made-up"
        kc.shell_channel.send(msg)
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:  # kernel_info replies before it
            reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "error", reply["content"]
        reply, _ = run(kc, "x = 1")
        assert reply["status"] == "ok", reply
        for rid in range(3):
            assert k.namespace(rid, ["leaked", "x"]) == {"leaked": None, "x": "1"}, rid
    finally:
        k.close()


def test_the_socket_module_is_the_pythons_own(kernel):
    """pysyncobj swaps socket.inet_ntop for a Windows-only one when imported: user code (psutil's
    net_connections among it) must still get the one a plain ipykernel has."""
    cell = "import socket; print(socket.inet_ntop(socket.AF_INET6, bytes(15) + b'\\x01'))"
    reply, out = run(kernel.kc, cell)
    assert reply["status"] == "ok", reply
    assert out["stdout"] == plain_outputs([cell])[0] == "::1\n"


def test_a_replica_that_fell_behind_catches_up_before_it_executes(cluster):
    """A replica the router skipped (stopped for a while) must not run a cell on its old
    namespace: here it becomes the only replica with a free GPU, so it executes next."""
    kernel = ReplicatedKernel(cluster, gpus=1)
    try:
        ok(kernel, "counter = 0")
        behind = next(r for r in kernel.record["replicas"] if r["id"] != executor_id(kernel))
        os.kill(kernel.pid(behind["id"]), signal.SIGSTOP)
        try:
            # the router's heartbeat timeout (3 s) bounds this, even when the replica is stopped
            # before it ever echoed a heartbeat (its welcome ended its start-up grace)
            wait_for(lambda: behind["id"] not in serving_replicas(kernel), 30,
                     "the router to skip the stopped replica")
            for _ in range(5):
                ok(kernel, "counter += 1", timeout=60)
        finally:
            os.kill(kernel.pid(behind["id"]), signal.SIGCONT)
        wait_for(lambda: behind["id"] in serving_replicas(kernel), 30, "the replica to answer the router again")
        for agent in cluster.agents:  # only the replica that fell behind can get a GPU now
            if agent.name != behind["node"]:
                take_the_gpu(agent, "hog-" + agent.name)
        out = ok(kernel, "print(counter, __import__('os').environ['GPUHUB_NODE'])", timeout=120)
        assert out["stdout"].split() == ["5", behind["node"]]
    finally:
        kernel.close()


def test_each_cell_runs_once_when_the_router_skips_the_executor_and_it_comes_back(cluster, tmp_path):
    """The executor lease: the router skips the stopped executor, so the others revoke its lease
    and one of them runs the cell; back, the old executor has missed that cell and its view is
    stale, so it catches up (a barrier) before it looks at the lease and never runs a cell beside
    the new holder. Every cell appends one line to a file all replicas share (one machine)."""
    runs = tmp_path / "runs"
    kernel = ReplicatedKernel(cluster, gpus=0)
    try:
        ok(kernel, f"""import os
n = 0
def mark():
    global n
    n += 1
    with open({str(runs)!r}, "a") as f:
        f.write(f"{{n}} {{os.environ['GPUHUB_NODE']}}\\n")""")
        ok(kernel, "mark()")
        first = executor_id(kernel)
        node_of = {r["id"]: r["node"] for r in kernel.record["replicas"]}
        os.kill(kernel.pid(first), signal.SIGSTOP)
        try:
            wait_for(lambda: first not in serving_replicas(kernel), 30, "the router to skip the stopped executor")
            ok(kernel, "mark()", timeout=60)
            ok(kernel, "mark()")
        finally:
            os.kill(kernel.pid(first), signal.SIGCONT)
        wait_for(lambda: first in serving_replicas(kernel), 30, "the router to count the replica live again")
        ok(kernel, "mark()", timeout=60)
        ok(kernel, "mark()")
        lines = runs.read_text().splitlines()
        assert [line.split()[0] for line in lines] == ["1", "2", "3", "4", "5"], lines  # once each
        second = {line.split()[1] for line in lines[1:]}
        assert lines[0].split()[1] == node_of[first] and len(second) == 1 and node_of[first] not in second
        assert {rid: kernel.namespace(rid, ["n"])["n"] for rid in node_of} == dict.fromkeys(node_of, "5")
    finally:
        kernel.close()


def process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` ("T": stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_lost_majority_is_an_error_reply_and_the_cell_runs_once_replicas_are_back(cluster):
    kernel = ReplicatedKernel(cluster, gpus=0)
    stopped: list[int] = []
    try:
        ok(kernel, "x = 1")
        executor = executor_id(kernel)
        stopped = [kernel.pid(r["id"]) for r in kernel.record["replicas"] if r["id"] != executor]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        # stopped for sure before the cell (a process in the kernel, in an fsync, stops on its way out)
        wait_for(lambda: all(process_state(pid) in ("T", "t") for pid in stopped), 30, "the two replicas to stop")
        started = time.monotonic()
        reply, out = run(kernel.kc, "x += 1", timeout=60)
        took = time.monotonic() - started
        assert reply["status"] == "error" and reply["ename"] == "ReplicasUnavailable", (
            reply, out, f"after {took:.1f} s", {pid: process_state(pid) for pid in stopped},
            {r["id"]: cluster.agent(r["node"]).unit_log_tail(r["unit"], 15) for r in kernel.record["replicas"]})
        assert "majority" in reply["evalue"]
        print(f"lost majority answered in {took:.1f} s")  # the goal (5 s) is a benchmark's, not asserted
        # The executor ran the cell under its lease (no commit before a cell): whether its result
        # is kept is up to the log once replicas are back (Raft keeps an entry its leader appended,
        # unless a replica without it becomes leader); the reply says the cell ran.
        assert "the cell ran" in reply["evalue"]
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped = []
        x = int(ok(kernel, "x += 1\nprint(x)", timeout=60)["stdout"])
        assert x in (2, 3)  # the cell ran once here: on x = 1, or on the kept x = 2
        wait_for(lambda: len(serving_replicas(kernel)) == 3, 30, "every replica live again")
        ok(kernel, "pass")  # a replica the router skipped meanwhile loads the image with its next cell
        assert {rid: kernel.namespace(rid, ["x"])["x"] for rid in range(3)} == dict.fromkeys(range(3), str(x))
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        kernel.close()


def test_a_password_never_reaches_the_disk(cluster):
    kernel = ReplicatedKernel(cluster, gpus=0)
    secret = "correct-horse-" + os.urandom(6).hex()
    try:
        reply, out = run(kernel.kc, "import getpass\npw = getpass.getpass('password: ')\nn = len(pw)",
                         stdin=lambda msg: kernel.kc.input(secret))
        assert reply["status"] == "ok", out
        ok(kernel, "print(n)")
        journals = [p for p in Path(cluster.tmp).rglob("raft.journal")]
        assert len(journals) >= 3
        for journal in journals:
            assert stat.S_IMODE(journal.parent.stat().st_mode) == 0o700
            assert stat.S_IMODE(journal.stat().st_mode) == 0o600
        for path in Path(cluster.tmp).rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes(), f"the password is in {path}"
    finally:
        kernel.close()


def test_every_write_to_a_large_array_reaches_the_group(kernel):
    """Large buffers skip hashing when the page tracker vouches for them: single-byte writes, writes
    through another name or a view, and ufuncs with out= must all still travel."""
    ok(kernel, "import numpy as np\nbig = np.zeros(4_000_000)\nalias = big\nview = big[1000:2000]")
    ok(kernel, "pass")  # a cell that changes nothing
    ok(kernel, "big[123_456] = 5")
    ok(kernel, "alias[-1] = 9")
    ok(kernel, "view[0] = 7")
    ok(kernel, "np.add(big, 0, out=big); big[2_000_000] += 1")
    expected = ok(kernel, "print(float(big.sum()), big[1000], alias is big)")["stdout"]
    assert expected.split() == ["22.0", "7.0", "True"]
    kill_replica(kernel, executor_id(kernel))  # a follower's copy takes over
    out = ok(kernel, "print(float(big.sum()), big[1000], alias is big)", timeout=60)["stdout"]
    assert out == expected


def test_a_write_between_cells_after_the_next_arming_reaches_the_group(cluster, tmp_path):
    """A CPU kernel arms the next cell's write tracker once a cell's idle went out (write-protecting
    the pages, or forking a sentinel child). A background thread that writes a large array after
    that is seen by the next cell's capture: a follower that takes over has the write."""
    kernel = ReplicatedKernel(cluster, gpus=0)
    try:
        done = tmp_path / "written"
        ok(kernel, "import numpy as np, threading, time\nbig = np.zeros(1 << 18)  # 2 MiB: tracked")
        ok(kernel, f"""from gpuhub.kernel import dirty
armed = dirty._generation
def writer():
    while dirty._generation == armed:  # the next arming, after this cell's idle, has begun ...
        time.sleep(0.01)
    with dirty._arm_lock:  # ... and is over: its signal is on
        big[4096] = 7  # an interior page
    open({str(done)!r}, "w").close()
threading.Thread(target=writer, daemon=True).start()""")
        wait_for(done.exists, 30, "the write after the next arming")  # no cell runs meanwhile
        ok(kernel, "pass")  # captures the namespace: big changed since the arming
        kill_replica(kernel, executor_id(kernel))  # a follower's copy takes over
        assert ok(kernel, "print(big[4096])", timeout=60)["stdout"].split() == ["7.0"]
    finally:
        kernel.close()
