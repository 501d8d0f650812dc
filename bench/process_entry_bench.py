"""What carrying the process's state costs each cell: the image's ``<process>`` entry
(gpuhub/kernel/image.py ``capture_process``/``apply_process``: working directory, environment,
settings, random generators).

Run: `.venv/bin/python -m bench process-entry`. Each configuration runs in a fresh process with an
IPython shell, as a replica has:

- ``bare``: no library imported; a cell seeded ``random`` and set ``%precision``;
- ``libraries``: NumPy, pandas, Matplotlib (Agg) and PyTorch imported, each generator seeded and
  one setting of each changed, as a data-science notebook has them.

Each side: ``capture_process`` (every image, on the executor) and ``apply_process`` of its pickle
(every replica that loads the image), medians over REPEATS calls, and the pickled entry's size.
Beside it, in the same process, the anchor: capturing a whole image of a small namespace (ten
small values), which every cell already pays; the entry is part of that figure.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import time

REPEATS = 2000
CONFIGS = ("bare", "libraries")


def _median_us(call, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(config: str) -> dict:
    """In this process (a fresh one per configuration: imports are for good)."""
    import random

    from IPython.core.interactiveshell import InteractiveShell

    from gpuhub.kernel import image, process_state, random_state, shell_settings

    shell = InteractiveShell.instance()
    for module in (process_state, shell_settings, random_state):
        module.take_baseline()
    random.seed(0)
    shell.run_line_magic("precision", "3")
    if config == "libraries":
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        import pandas as pd
        import torch
        np.random.seed(0)
        torch.manual_seed(0)
        np.set_printoptions(precision=4)
        pd.set_option("display.max_rows", 20)
        plt.rcParams["figure.figsize"] = (8, 4)
        torch.set_printoptions(precision=3)
    entry = image.capture_process()
    wire = pickle.dumps(entry, protocol=5)
    namespace = {f"v{i}": [i, str(i), {"k": float(i)}] for i in range(10)}
    return {"capture_us": _median_us(image.capture_process),
            "apply_us": _median_us(lambda: image.apply_process(pickle.loads(wire))),
            "bytes": len(wire),
            "image_us": _median_us(lambda: image.capture(namespace, set()), REPEATS // 4)}


def main() -> str:
    rows = []
    for config in CONFIGS:
        print(f"  {config} …", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, "-m", "bench.process_entry_bench", "--child", config],
                             check=True, capture_output=True, text=True, env={**os.environ, "MPLBACKEND": "Agg"})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(f"| {config} | {r['capture_us']:.0f} | {r['apply_us']:.0f} | {r['bytes']:,} | "
                    f"{r['image_us']:.0f} | {r['capture_us'] / r['image_us']:.0%} |")
    return "\n".join([
        "### The process entry of each image (`python -m bench process-entry`)", "",
        f"Medians over {REPEATS} calls (the whole image: {REPEATS // 4}), µs.", "",
        "| imported | capture | apply | pickled bytes | whole image of 10 small values | entry's share |",
        "|---|---:|---:|---:|---:|---:|", *rows, ""])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2])))
    else:
        print(main())
