"""What a GPU cell's child imported is imported in the replica only when a probe child saw it start
no thread and initialise no CUDA (gpuhub/kernel/warm_imports.py). The probe is a fork of this
process, as it is of the replica."""

from __future__ import annotations

import ctypes
import select
import sys
import textwrap

import pytest

from gpuhub.kernel.warm_imports import ImportWarmer, cuda_initialised, import_quietly, imported_since
from tests.unit.test_gpus import nvml_gpu_count

MODULES = {
    "gh_warm_clean": "print('printed at import')\nVALUE = 42\n",
    "gh_warm_pkg/__init__.py": "",
    "gh_warm_pkg/sub": "import warnings\nwarnings.warn('warned at import')\n",
    "gh_warm_thread": "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n",
    "gh_warm_broken": "raise RuntimeError('cannot import me')\n",
    "gh_warm_exits": "raise SystemExit(3)\n",
    "gh_warm_cuinit": "import ctypes\nctypes.CDLL('libcuda.so.1').cuInit(0)\n",
}


@pytest.fixture
def modules(tmp_path, monkeypatch):
    for name, text in MODULES.items():
        path = tmp_path / (name if name.endswith(".py") else name + ".py")
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in list(sys.modules):
        if name.startswith("gh_warm"):
            del sys.modules[name]


def run_probe(warmer: ImportWarmer, names: list[str]) -> None:
    warmer.offer(names)
    fd = warmer.start_probe()
    assert fd is not None
    assert select.select([fd], [], [], 60)[0], "the probe did not report within 60 s"
    warmer.probe_done()


def test_imported_since_names_real_modules_in_import_order(modules):
    before = frozenset(sys.modules)
    import gh_warm_pkg.sub  # noqa: F401
    sys.modules["gh_warm_alias"] = sys.modules["gh_warm_pkg"]  # an alias: not importable by that name
    assert imported_since(before) == ["gh_warm_pkg", "gh_warm_pkg.sub"]


def test_imports_print_and_warn_nowhere_and_failures_are_left_out(modules, capsys):
    assert import_quietly(["gh_warm_clean", "gh_warm_pkg.sub", "gh_warm_broken", "gh_warm_exits"]) == [
        "gh_warm_clean", "gh_warm_pkg.sub"]
    assert capsys.readouterr() == ("", "")


def test_a_clean_module_is_imported_here_after_the_probe(modules, capsys):
    warmer = ImportWarmer()
    run_probe(warmer, ["gh_warm_clean", "gh_warm_pkg", "gh_warm_pkg.sub", "gh_warm_broken"])
    assert sys.modules["gh_warm_clean"].VALUE == 42 and "gh_warm_pkg.sub" in sys.modules
    assert warmer.warmed == 3 and warmer.refused == {"gh_warm_broken"}
    assert capsys.readouterr() == ("", "")
    warmer.offer(["gh_warm_clean", "gh_warm_broken"])  # imported or refused: not probed again
    assert warmer.start_probe() is None


def test_a_module_that_starts_a_thread_is_not_imported_here(modules):
    warmer = ImportWarmer()
    run_probe(warmer, ["gh_warm_clean", "gh_warm_thread"])
    assert "gh_warm_thread" not in sys.modules and "gh_warm_clean" not in sys.modules  # the batch is refused
    assert warmer.refused == {"gh_warm_clean", "gh_warm_thread"} and warmer.warmed == 0


def test_a_probe_that_dies_refuses_its_names(modules, monkeypatch):
    monkeypatch.setattr("gpuhub.kernel.warm_imports._probe", lambda names, fd: __import__("os")._exit(1))
    warmer = ImportWarmer()
    run_probe(warmer, ["gh_warm_clean"])
    assert warmer.refused == {"gh_warm_clean"} and "gh_warm_clean" not in sys.modules


@pytest.mark.gpu
@pytest.mark.skipif(nvml_gpu_count() == 0, reason="no NVIDIA GPU found by NVML")
def test_a_module_that_initialises_cuda_is_not_imported_here(modules):
    try:
        ctypes.CDLL("libcuda.so.1")  # loaded, as `import torch` loads it, but not initialised
    except OSError:
        pytest.skip("no CUDA driver library")
    if cuda_initialised():
        pytest.skip("this test process initialised CUDA already")
    warmer = ImportWarmer()
    run_probe(warmer, ["gh_warm_cuinit"])
    assert warmer.refused == {"gh_warm_cuinit"} and not cuda_initialised()
