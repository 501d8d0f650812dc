"""A real notebook, run by nbclient (what "Run All" and papermill/nbconvert do), gives on a
replicated kernel what it gives on a plain ipykernel, cell by cell: pandas (rich HTML tables),
a matplotlib inline plot, IPython.display rich output, objects shared between names, a large
array written in place, and a cell that raises (with ``allow_errors`` and with nbclient's
default stop-on-error)."""

from __future__ import annotations

import base64
import difflib
import pprint
import re
import struct

import nbformat
import pytest
from jupyter_client import AsyncKernelManager, BlockingKernelClient
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from gpuhub.dev.cluster import DevCluster, DevKernel
from tests.integration.test_replicated import kill_replica

pytest.importorskip("pandas")

CELLS = [
    # 0: data from numpy
    """import numpy as np
import pandas as pd
rng = np.random.default_rng(42)
df = pd.DataFrame(rng.integers(0, 100, size=(200, 3)), columns=["a", "b", "c"])
df["g"] = np.array(list("xyzw"))[rng.integers(0, 4, size=200)]
print(df.shape, list(df.columns))""",
    # 1: a rich HTML table (execute_result: text/html and text/plain)
    "df.head()",
    # 2: groupby
    """summary = df.groupby("g").agg(total=("a", "sum"), mean_b=("b", "mean")).reset_index()
summary""",
    # 3: merge; print and a result in one cell
    """labels = pd.DataFrame({"g": list("xyzw"), "label": ["ex", "why", "zed", "dub"]})
merged = df.merge(labels, on="g")
print(len(merged), sorted(merged["label"].unique()))
merged.groupby("label").size()""",
    # 4: a column added in a later cell, then describe()
    """df["d"] = df["a"] * 2 + df["b"]
df.describe()""",
    # 5: a matplotlib plot with the kernel's default (inline) backend: display_data image/png
    """import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(4, 3), dpi=72)
summary.plot.bar(x="g", y="total", ax=ax, legend=False)
ax.set_title("totals")
plt.show()""",
    # 6: IPython.display rich output
    """from IPython.display import HTML, JSON, Markdown, display
display(HTML("<b>bold</b> <i>table</i>"))
display(Markdown("# Title\\n\\n*emphasis* and `code`"))
display(JSON({"a": [1, 2, 3], "b": {"c": None}}))""",
    # 7: one object under two names; a large array (10 MB) and a view of it
    """shared = {"rows": []}
alias = shared
big = np.zeros(1_250_000)
view = big[:5]
print(big.nbytes)""",
    # 8: mutate through one name, see it through the other; write the array in place
    """alias["rows"].append(len(df))
big[:5] = 3.5
big[-1] = 9.0
print(shared is alias, shared, view.tolist(), float(big.sum()))""",
    # 9: a cell that prints, then raises
    """print("before the error")
missing = df["no such column"]""",
    # 10: cells after the error (Run All with allow_errors runs them; stop-on-error must not)
    """after = True
print("after the error", int(df["d"].sum()), shared["rows"])""",
    "df.shape",
]
AFTER_ERROR = 10  # the first cell after the one that raises


def notebook() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(code) for code in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


class AttachedKernelManager(AsyncKernelManager):
    """A kernel manager for a kernel that is already running (here: a replicated kernel's router):
    it knows the connection info and starts, restarts and shuts down nothing (``owns_kernel``
    False), so nbclient only makes its client from it."""

    def __init__(self, connection_info: dict, **kw) -> None:
        super().__init__(owns_kernel=False, **kw)
        self.load_connection_info(connection_info)

    @property
    def has_kernel(self) -> bool:
        return True


def execute(nb: nbformat.NotebookNode, km: AsyncKernelManager, allow_errors: bool):
    """Run the notebook with nbclient on ``km``'s kernel, as nbclient runs it on a kernel it starts:
    (the executed notebook, the CellExecutionError it stopped on or None)."""
    client = NotebookClient(nb, km=km, allow_errors=allow_errors, timeout=180, startup_timeout=120,
                            kernel_name="python3")
    error = None
    try:
        client.execute()
    except CellExecutionError as exc:
        error = exc
    finally:
        if client.kc is not None:  # nbclient leaves a client of a kernel it does not own open
            client.kc.stop_channels()
    return nb, error


def png_size(b64: str) -> tuple[int, int]:
    """A PNG's (width, height), from its IHDR chunk."""
    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", raw[:16]
    return struct.unpack(">II", raw[16:24])


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def summary(nb: nbformat.NotebookNode) -> list[dict]:
    """What a notebook user sees, cell by cell: execution counts, and per output its type, stream
    name and text (consecutive pieces of one stream joined, as a notebook shows them), every MIME
    bundle entry but the PNG, metadata, the PNG's pixel size, error."""
    cells = []
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            o = {"output_type": out["output_type"]}
            if out["output_type"] == "stream":
                last = outputs[-1] if outputs else {}
                if last.get("output_type") == "stream" and last["name"] == out["name"]:
                    # one stream as Jupyter shows it: where a kernel's output stream flushed in
                    # between (its timer, a busy machine) is not something a user sees
                    last["text"] += out["text"]
                    continue
                o.update(name=out["name"], text=out["text"])
            elif out["output_type"] in ("execute_result", "display_data"):
                data = dict(out["data"])
                png = data.pop("image/png", None)
                o.update(data=data, metadata=dict(out.get("metadata", {})),
                         png_size=png_size(png) if png else None,
                         execution_count=out.get("execution_count"))
            elif out["output_type"] == "error":
                o.update(ename=out["ename"], evalue=out["evalue"],
                         traceback=[ANSI.sub("", line) for line in out["traceback"]])
            outputs.append(o)
        cells.append({"execution_count": cell.get("execution_count"), "outputs": outputs})
    return cells


def pngs(nb: nbformat.NotebookNode) -> list[bytes]:
    return [base64.b64decode(out["data"]["image/png"]) for cell in nb.cells for out in cell.get("outputs", [])
            if "image/png" in out.get("data", {})]


def run_on_plain(allow_errors: bool):
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        nb, error = execute(notebook(), AttachedKernelManager(km.get_connection_info()), allow_errors)
        return nb, error, probe(kc)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def probe(kc: BlockingKernelClient) -> str:
    """Whether the cell after the error ran in the kernel (its variable exists), asked in a cell
    that is not stored in the history."""
    seen: list[str] = []

    def on_output(msg):
        if msg["msg_type"] == "stream":
            seen.append(msg["content"]["text"])

    reply = kc.execute_interactive("print('after' in globals())", store_history=False, timeout=60,
                                   output_hook=on_output)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(seen).strip()


def difference(want, got) -> str:
    return "\n".join(difflib.unified_diff(pprint.pformat(want, width=110).splitlines(),
                                          pprint.pformat(got, width=110).splitlines(), lineterm="", n=1))


@pytest.fixture(scope="module")
def plain():
    """What a plain ipykernel gives for the notebook, with and without allow_errors: the anchor."""
    return {allow: run_on_plain(allow) for allow in (True, False)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = DevCluster(tmp_path_factory.mktemp("notebook"), nodes=3, gpus_per_node=1).start()
    yield c
    c.stop()


def run_on_replicated(cluster, gpus: int, allow_errors: bool):
    kernel = DevKernel(cluster, gpus=gpus)
    try:
        km = AttachedKernelManager(kernel.kc.get_connection_info())
        nb, error = execute(notebook(), km, allow_errors)
        return nb, error, probe(kernel.kc)
    finally:
        kernel.close()


@pytest.mark.parametrize("gpus", [0, 1], ids=["cpu", "gpu"])
@pytest.mark.parametrize("allow_errors", [True, False], ids=["allow_errors", "stop_on_error"])
def test_notebook_outputs_match_plain_ipykernel(cluster, plain, gpus, allow_errors):
    want_nb, want_error, want_ran = plain[allow_errors]
    got_nb, got_error, got_ran = run_on_replicated(cluster, gpus, allow_errors)

    # the anchor is what the test means it to be
    want = summary(want_nb)
    assert [c["execution_count"] for c in want[:AFTER_ERROR]] == list(range(1, AFTER_ERROR + 1))
    assert want[AFTER_ERROR - 1]["outputs"][-1]["ename"] == "KeyError"
    assert want[5]["outputs"][0]["png_size"] is not None
    if allow_errors:
        assert want_error is None and want_ran == "True"
        assert want[-1]["execution_count"] == len(CELLS)
    else:
        assert want_error is not None and want_error.ename == "KeyError" and want_ran == "False"
        assert all(c["execution_count"] is None and c["outputs"] == [] for c in want[AFTER_ERROR:])

    got = summary(got_nb)
    differences = [f"cell {i} differs (- plain ipykernel, + replicated):\n{CELLS[i]}\n{difference(w, g)}"
                   for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    # The PNG: same pixel size (in the summary); its bytes too, as the same matplotlib on the same
    # machine renders the same pixels and writes no timestamp into a PNG
    if pngs(got_nb) != pngs(want_nb):
        differences.append("the plot's PNG bytes differ")
    stopped = [(e.ename, e.evalue) if e is not None else None for e in (want_error, got_error)]
    if stopped[0] != stopped[1]:
        differences.append(f"nbclient stopped on {stopped[1]}, on a plain ipykernel on {stopped[0]}")
    if got_ran != want_ran:
        differences.append(f"the cell after the error ran in the kernel: {got_ran} (plain ipykernel: {want_ran})")
    assert not differences, "\n\n".join(differences)


@pytest.mark.parametrize("gpus,failover", [(0, False), (1, False), (0, True)],
                         ids=["cpu", "gpu", "cpu-after-failover"])
def test_tracebacks_and_source_of_earlier_cells(cluster, gpus, failover):
    """As ipykernel: an error in cell n shows ``Cell In[n]``, with the source lines of every cell
    it passes through, and ``inspect.getsource`` finds a function an earlier cell defined (IPython
    keeps each cell's source in linecache): on the replica that ran the cell, and on the one that
    takes over when the executor is lost. (The notebook test's cell 9, small.)"""
    kernel = DevKernel(cluster, gpus=gpus)
    try:
        seen = []

        def cell(code):
            out: list[str] = []
            reply = kernel.kc.execute_interactive(
                code, timeout=120, output_hook=lambda m: out.append(m["content"].get("text", "")))["content"]
            seen.append(reply["execution_count"])
            if reply["status"] == "error":
                text = ANSI.sub("", "\n".join(reply["traceback"]))
                seen.append([int(n) for n in re.findall(r"Cell In\[(\d+)\]", text)])
                seen.append("return 1 / 0" in text)  # the source line of f's frame is shown
            return "".join(out)

        node = cell("import os\nprint(os.environ['GPUHUB_NODE'])").strip()
        cell("1 / 0")
        cell("def f():\n    return 1 / 0")
        if failover:
            executor = next(r["id"] for r in kernel.record["replicas"] if r["node"] == node)
            kill_replica(kernel, executor)
        cell("f()")
        source = cell("import inspect\nprint(inspect.getsource(f), end='')")
        # f() in cell 4 fails in f, which cell 3 defined: the traceback names cell 4, then cell 3
        assert seen == [1, 2, [2], False, 3, 4, [4, 3], True, 5], repr(seen)
        assert source == "def f():\n    return 1 / 0\n"
    finally:
        kernel.close()
