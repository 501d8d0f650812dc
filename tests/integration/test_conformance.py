"""Kernel conformance (jupyter_kernel_test): a replicated gpuhub kernel behind its router passes
what a plain ipykernel passes (docs/architecture.md D3: the client sees one ordinary kernel)."""

from __future__ import annotations

import os
import tempfile

import jupyter_kernel_test as jkt
import pytest
from jupyter_client import BlockingKernelClient
from jupyter_client.manager import start_new_kernel

from gpuhub.dev.cluster import DevCluster, DevKernel


class IPythonSamples:
    """What to send a Python kernel (after jupyter_kernel_test's own ipykernel example)."""

    kernel_name = "python3"
    language_name = "python"
    file_extension = ".py"
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = ({"text": "zi", "matches": {"zip"}},)
    complete_code_samples = ("1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n")
    incomplete_code_samples = ("print('''hello", "def f(x):\n  x*2")
    invalid_code_samples = ("import = 7q",)
    code_page_something = "zip?"
    code_generate_error = "raise"
    code_execute_result = ({"code": "1+2+3", "result": "6"},
                           {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"})
    code_display_data = ({"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
                          "mime": "text/html"},
                         {"code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
                          "mime": "text/latex"})
    code_history_pattern = "1?2*"
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"


class TestPlainIPyKernel(IPythonSamples, jkt.KernelTests):
    """The reference: ipykernel as Jupyter starts it, with an IPython directory of its own: its
    history search reads the whole history database, which the machine's other kernels share (a
    ``1\n2`` run by hand in any kernel there made the unique search find two entries)."""

    @classmethod
    def setUpClass(cls) -> None:
        cls._ipython_dir = tempfile.TemporaryDirectory(prefix="gpuhub-conformance-")
        cls.km, cls.kc = start_new_kernel(kernel_name=cls.kernel_name,
                                          env={**os.environ, "IPYTHONDIR": cls._ipython_dir.name})

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            super().tearDownClass()
        finally:
            cls._ipython_dir.cleanup()


class TestPlainIPyKernelWelcome(jkt.IopubWelcomeTests):
    """The kernel is up before the tested client subscribes, as for the replicated kernel below: a
    client that subscribes while ipykernel starts can get its "starting" status before the welcome
    (ipykernel's IOPub thread answers a subscription a moment after libzmq took it; seen once on a
    busy machine)."""

    support_iopub_welcome = True

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        probe = cls.km.client()
        probe.start_channels()
        try:
            probe.wait_for_ready(timeout=60)
        finally:
            probe.stop_channels()


@pytest.fixture(scope="class")
def replicated(request, tmp_path_factory):
    """A replicated kernel of three replicas through the dev harness (as test_replicated), as the
    class's kernel client: a CPU kernel, or a GPU kernel (fake GPUs) when the class says ``gpus``."""
    cluster = DevCluster(tmp_path_factory.mktemp("conformance"), nodes=3, gpus_per_node=1).start()
    kernel = None
    try:
        kernel = DevKernel(cluster, gpus=getattr(request.cls, "gpus", 0))
        request.cls.kernel = kernel
        request.cls.kc = kernel.kc
        yield kernel
    finally:
        if kernel is not None:
            kernel.close()
        cluster.stop()


@pytest.mark.usefixtures("replicated")
class TestReplicatedKernel(IPythonSamples, jkt.KernelTests):
    kernel: DevKernel

    @classmethod
    def setUpClass(cls) -> None:  # the fixture starts the kernel
        pass

    @classmethod
    def tearDownClass(cls) -> None:  # and stops it
        pass

    def test_recv_iopub_welcome_msg(self) -> None:
        """IopubWelcomeTests's check, for a new client of the running router: its first iopub message."""
        kc = BlockingKernelClient()
        kc.load_connection_info(self.kernel.kc.get_connection_info())
        kc.start_channels()
        try:
            msg = kc.get_iopub_msg(timeout=30)
            assert msg["msg_type"] == "iopub_welcome"
            assert msg["content"]["subscription"] == ""
        finally:
            kc.stop_channels()


class TestReplicatedGpuKernel(TestReplicatedKernel):
    """The same, for a GPU kernel: every cell runs in a forked child holding a (fake) GPU."""

    gpus = 1
