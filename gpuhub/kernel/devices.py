"""Move GPU values to the host after a GPU cell and back to the same logical GPU before the next one.

Covered: PyTorch tensors and modules (``nn.Module``, moved in place), also inside lists, tuples and
dicts (three levels deep). Logical index k (``cuda:k``) is stable because each cell's
``CUDA_VISIBLE_DEVICES`` renumbers its granted GPUs from 0. Other GPU libraries' values (CuPy, JAX)
are not moved and may fail to cross; the cell then warns naming the variable.
"""

from __future__ import annotations

import sys

MAX_DEPTH = 3


def _torch():
    return sys.modules.get("torch")  # never import torch ourselves: the parent must stay CUDA-free


def to_host(value, depth: int = 0):
    """Return (value with GPU parts on the CPU, logical GPU index or None)."""
    torch = _torch()
    if torch is None or depth > MAX_DEPTH:
        return value, None
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            return value.cpu(), value.device.index or 0
        return value, None
    if isinstance(value, torch.nn.Module):
        for p in value.parameters():
            if p.is_cuda:
                idx = p.device.index or 0
                return value.cpu(), idx
            break
        return value, None
    if isinstance(value, (list, tuple)):
        moved = [to_host(v, depth + 1) for v in value]
        idx = next((i for _, i in moved if i is not None), None)
        if idx is None:
            return value, None
        items = [v for v, _ in moved]
        return (type(value)(items) if isinstance(value, list) else tuple(items)), idx
    if isinstance(value, dict):
        moved = {k: to_host(v, depth + 1) for k, v in value.items()}
        idx = next((i for _, i in moved.values() if i is not None), None)
        if idx is None:
            return value, None
        return {k: v for k, (v, _) in moved.items()}, idx
    return value, None


def to_device(value, index: int, depth: int = 0):
    """Put ``value`` (moved to the host by :func:`to_host`) back on logical GPU ``index``."""
    torch = _torch()
    if torch is None or depth > MAX_DEPTH or not torch.cuda.is_available():
        return value
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        return value.to(f"cuda:{index}")
    if isinstance(value, list):
        return [to_device(v, index, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(to_device(v, index, depth + 1) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, index, depth + 1) for k, v in value.items()}
    return value
