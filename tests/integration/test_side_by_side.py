"""A notebook's cells side by side: a plain ipykernel and a GPU kernel whose every cell runs in a
fresh process forked from its replica (no lingering process), which therefore has only what the
namespace image carries. Each cell's outputs must be the plain kernel's: values, output history,
settings made by magics and libraries, functions wrapped by functools. (Found so: ``_`` stopped at
the first result a fresh process loaded, an ``@lru_cache`` function stopped the kernel, the
recursion limit and ``%config`` were lost.)"""

from __future__ import annotations

import os
import tempfile

import pytest
from jupyter_client.manager import start_new_kernel

from gpuhub.dev.cluster import DevCluster, DevKernel

CELLS = [
    "6 * 7",
    "'second'",
    "print(_, __)",
    "_ = 'mine'",
    "99",
    "print(_, __, ___)",
    "del _",
    "5",
    "print(_, __, ___, _2)",
    "import functools\n@functools.lru_cache(maxsize=None)\ndef fib(n):\n"
    "    return n if n < 2 else fib(n - 1) + fib(n - 2)\nfib(30)",
    "print(fib(31), fib.cache_parameters())",
    "import sys\nsys.setrecursionlimit(4321)",
    "print(sys.getrecursionlimit())",
    "%config Completer.use_jedi = False\n%precision 3",
    "from IPython.core.interactiveshell import InteractiveShell\nInteractiveShell.ast_node_interactivity = 'all'",
    "1 / 3\n2 / 3",
    "import numpy as np\nnp.seterr(divide='ignore')\nnp.ones(2) / 0",
    "import logging\nlogging.getLogger('noisy.library').setLevel(logging.ERROR)",
    "logging.getLogger('noisy.library').warning('hidden')\nprint(get_ipython().Completer.use_jedi)",
    "import typing\nT = typing.TypeVar('T')\nclass Box(typing.Generic[T]):\n    def __init__(self, v: T):\n"
    "        self.v = v\nbox = Box(3)",
    "print(box.v, type(box).__name__, Out[1])",
]


def _outputs(kc, code: str) -> tuple[str, list]:
    out: list = []

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append((content["name"], content["text"]))
        elif kind in ("execute_result", "display_data"):
            out.append((kind, content["data"].get("text/plain")))
        elif kind == "error":
            out.append(("error", content["ename"], content["evalue"]))

    reply = kc.execute_interactive(code, output_hook=hook, timeout=60)
    return reply["content"]["status"], _joined(out)


def _joined(out: list) -> list:
    """Consecutive stream writes as one (a plain kernel may flush a print in two messages)."""
    joined: list = []
    for item in out:
        if joined and item[0] in ("stdout", "stderr") and joined[-1][0] == item[0]:
            joined[-1] = (item[0], joined[-1][1] + item[1])
        else:
            joined.append(item)
    return joined


@pytest.fixture(scope="module")
def plain():
    with tempfile.TemporaryDirectory(prefix="gpuhub-side-by-side-") as ipython_dir:
        km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, "IPYTHONDIR": ipython_dir})
        try:
            yield [_outputs(kc, code) for code in CELLS]
        finally:
            kc.stop_channels()
            km.shutdown_kernel(now=True)


def test_a_gpu_kernel_with_a_fresh_process_per_cell_gives_the_plain_kernels_outputs(tmp_path, plain):
    cluster = DevCluster(tmp_path, nodes=3, gpus_per_node=1, agent_settings={"gpu_linger_s": 0.0}).start()
    try:
        kernel = DevKernel(cluster, gpus=1)
        try:
            for code, want in zip(CELLS, plain, strict=True):
                assert _outputs(kernel.kc, code) == want, code
        finally:
            kernel.close()
    finally:
        cluster.stop()
