"""A cell's round trip over Jupyter Server's kernel websocket, with Jupyter Server's own websocket
connection (Nagle's algorithm on) and with gpuhub's (gpuhub/server/websocket.py: off), side by side.

Two local Jupyter Servers, each with a plain ipykernel, a websocket client on each (as JupyterLab
uses it: submit, then read until the reply and the idle status); cells alternate between them in
rounds so that machine noise hits both. Back to back (``x = 1``), then with 0.2 s before each cell.

    .venv/bin/python -m bench websocket
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.load_bench import pct
from bench.replicated_bench import interleaved
from gpuhub.dev.jupyter_server import LocalJupyterServer

CELLS = 200
WARMUP = 20
ROUNDS = 4
THINK_S = 0.2
THINK_CELLS = 60
CLASSES = {"Jupyter Server's": "", "gpuhub's": "gpuhub.server.websocket.NoDelayChannelsConnection"}


def run(server: LocalJupyterServer, code: str) -> float:
    return server.execute(code)[0]


def main() -> str:
    with tempfile.TemporaryDirectory() as root:
        servers: dict[str, LocalJupyterServer] = {}
        try:
            for label, cls in CLASSES.items():
                servers[label] = LocalJupyterServer(Path(root), cls)
            back_to_back = interleaved(servers, "x = 1", CELLS, WARMUP, ROUNDS, timed=run)
            paced = interleaved(servers, "x = 1", THINK_CELLS, 0, ROUNDS, THINK_S, timed=run)
        finally:
            for s in servers.values():
                s.close()
    lines = ["### A cell over Jupyter Server's kernel websocket: Nagle's algorithm on and off", "",
             "`.venv/bin/python -m bench websocket` (plain ipykernel behind a local Jupyter Server, "
             f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores)", "",
             "| websocket connection | `x = 1` back to back, p50 / p99 ms "
             "| with 0.2 s before each cell, p50 / p99 ms |",
             "|---|---|---|"]
    for label in servers:
        a, b = back_to_back[label], paced[label]
        lines.append(f"| {label} | {statistics.median(a) * 1e3:.1f} / {pct(a, .99) * 1e3:.1f} | "
                     f"{statistics.median(b) * 1e3:.1f} / {pct(b, .99) * 1e3:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
