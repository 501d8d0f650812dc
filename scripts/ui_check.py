"""JupyterLab in Chromium, side by side: the same notebook on gpuhub's CPU and 1-GPU kernels and on a
plain ipykernel, each with Run All (an error in the middle). Prints each kernel's prompts and
outputs as JupyterLab shows them, saves a screenshot per kernel, and exits 1 when a gpuhub kernel
shows anything else than the plain one.

A manual check (docs/testing.md), not part of `make test`: it needs Debian's ``chromium`` and
Playwright for Python, which are not gpuhub's dependencies:

    apt-get install -y chromium
    python3 -m venv /tmp/pw && /tmp/pw/bin/pip install playwright
    PYTHONPATH=$PWD:$(echo /tmp/pw/lib/python3*/site-packages) .venv/bin/python scripts/ui_check.py /tmp/ui

The kernels run on a dev cluster (three agents with fake GPUs, a scheduler) behind a real Jupyter
Server with gpuhub's provisioner, as in `python -m bench lab-start`.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import requests
from playwright.sync_api import sync_playwright

from bench.lab_start_bench import JupyterServer
from gpuhub.admin.kernelspecs import kernelspec
from gpuhub.dev.cluster import DevCluster

CELLS = [
    "import numpy as np\nx = np.arange(10)\nx.sum()",
    "s = [1]\nholder = {'a': s, 'b': s}\ns.append(2)\nholder",
    "print('before the error')\n1/0",
    "y = 5\nprint('must not run')",  # Run All stops at the error: this cell and the next never run
    "y",
]
KINDS = ("python3", "gpuhub-cpu", "gpuhub-gpu1")  # the anchor first


def notebook(kind: str) -> dict:
    return {"nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": kind, "display_name": kind, "language": "python"}},
            "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "source": code, "outputs": [],
                       "execution_count": None} for i, code in enumerate(CELLS)]}


def run_all(browser, server: JupyterServer, kind: str, shots: Path) -> dict:
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    try:
        started = time.monotonic()
        page.goto(f"{server.url}/lab/workspaces/{kind}/tree/{kind}.ipynb?reset&token={server.token}")
        page.wait_for_selector("text=| Idle", timeout=120_000)
        idle_s = time.monotonic() - started
        page.click("text=Run", timeout=30_000)
        page.click("text=Run All Cells", timeout=30_000)
        # Run All is done when the last cell that runs has its prompt number (the error's cell)
        page.wait_for_function("() => [...document.querySelectorAll('.jp-InputArea-prompt')]"
                               ".filter(e => /\\[\\d+\\]/.test(e.textContent)).length >= 3", timeout=120_000)
        page.wait_for_selector("text=| Idle", timeout=120_000)
        page.screenshot(path=str(shots / f"{kind}.png"), full_page=True)
        return {
            "idle_s": round(idle_s, 2),
            "prompts": page.eval_on_selector_all(".jp-InputArea-prompt", "els => els.map(e => e.textContent)"),
            "outputs": page.eval_on_selector_all(".jp-OutputArea-output", "els => els.map(e => e.innerText)"),
        }
    finally:
        page.close()
        for k in requests.get(f"{server.url}/api/kernels", headers=server.headers, timeout=30).json():
            requests.delete(f"{server.url}/api/kernels/{k['id']}", headers=server.headers, timeout=60)


def main(shots: Path) -> int:
    shots.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpuhub-ui-"))
    cluster = DevCluster(tmp / "cluster", nodes=3, gpus_per_node=1).start()
    server = None
    try:
        server = JupyterServer(tmp / "server", cluster)
        spec_dir = tmp / "server" / "share" / "jupyter" / "kernels" / "gpuhub-gpu1"
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps(kernelspec(1, 3, sys.executable)))
        for kind in KINDS:
            requests.put(f"{server.url}/api/contents/{kind}.ipynb", headers=server.headers, timeout=30,
                         json={"type": "notebook", "format": "json", "content": notebook(kind)}).raise_for_status()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            seen = {kind: run_all(browser, server, kind, shots) for kind in KINDS}
            browser.close()
    finally:
        if server is not None:
            server.stop()
        cluster.stop()
    anchor = seen[KINDS[0]]
    differ = False
    for kind, view in seen.items():
        print(f"{kind}: Idle {view['idle_s']} s after the page load; prompts {view['prompts']}")
        if (view["prompts"], view["outputs"]) != (anchor["prompts"], anchor["outputs"]):
            differ = True
            print(f"  DIFFERS from {KINDS[0]}: outputs {view['outputs']} vs {anchor['outputs']}")
    print(f"screenshots in {shots}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/gpuhub-ui")))
