"""The global random generators a notebook seeds (``random.seed(0)``, ``np.random.seed(0)``,
``torch.manual_seed(0)``), carried with each image like the working directory
(:mod:`gpuhub.kernel.process_state`; the image's ``<process>`` entry, key ``random``).

In a plain kernel the numbers a cell draws continue the sequence the earlier cells drew from. A
gpuhub kernel runs a GPU cell in a process forked from its replica, which ends after the cell
(after a short linger), and after a failover on another replica: without the generators' state
their draws started from that replica's own, unseeded one. Each replica that loads an image takes
the state on, so the next cell's process continues the sequence.

Carried: Python's ``random``, NumPy's legacy global generator (``np.random.rand``; a
``np.random.default_rng(0)`` Generator is a variable and replicates as one) and PyTorch's CPU
generator, each once the library is imported. Not carried: PyTorch's CUDA generators (the replica
has no CUDA context), other libraries' generators.
"""

from __future__ import annotations

import logging
import random
import sys

log = logging.getLogger(__name__)

_baseline: tuple | None = None
_refused: set[str] = set()


def take_baseline() -> None:
    """Python's generator as this replica starts: it is carried only once a cell drew from it or
    seeded it (each replica's unseeded state is its own, as each plain kernel's is)."""
    global _baseline
    _baseline = random.getstate()


def capture() -> dict:
    out: dict = {}
    state = random.getstate()
    if state != _baseline:
        version, internal, gauss = state
        out["random"] = [version, list(internal), gauss]
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            out["numpy"] = [str(name), keys.tobytes(), int(pos), int(has_gauss), float(cached)]
        except Exception as exc:
            _refuse("numpy", exc)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_rng_state"):
        try:
            out["torch"] = torch.get_rng_state().numpy().tobytes()
        except Exception as exc:
            _refuse("torch", exc)
    return out


def apply(state: dict) -> None:
    """Take on ``state`` (from :func:`capture`). Never raises; a generator missing from ``state``
    keeps this process's own."""
    if not isinstance(state, dict):
        return
    for name, step in (("random", _apply_random), ("numpy", _apply_numpy), ("torch", _apply_torch)):
        if state.get(name) is not None:
            try:
                step(state[name])
            except Exception as exc:
                _refuse(name, exc)


def _apply_random(value) -> None:
    version, internal, gauss = value
    random.setstate((version, tuple(internal), gauss))


def _apply_numpy(value) -> None:
    import numpy as np
    name, keys, pos, has_gauss, cached = value
    np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))


def _apply_torch(value) -> None:
    import torch
    torch.set_rng_state(torch.frombuffer(bytearray(value), dtype=torch.uint8))


def _refuse(name: str, exc: BaseException) -> None:
    if name not in _refused:
        _refused.add(name)
        log.warning("cannot carry the %s random generator's state here: %s: %s", name, type(exc).__name__, exc)
