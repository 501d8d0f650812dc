"""GPU values in the namespace image: sent from the host, put back on the same logical GPU.

A GPU cell's child pickles the namespace image (gpuhub/kernel/image.py); a PyTorch tensor on
``cuda:k`` found anywhere in it (a module's parameters and buffers, an optimizer's state) is
pickled as its host copy plus ``k`` (:func:`reduce_gpu_value`). Whoever loads the image gets a CPU
tensor *tagged* with ``k``: the replica process never initialises CUDA. The next GPU cell's child
moves every tagged tensor back to ``cuda:k`` in place (``t.data = …``, as ``Module.to`` does), so
the objects keep their identity: an optimizer still holds the very parameters of its model.
Logical index k is stable because each cell's ``CUDA_VISIBLE_DEVICES`` renumbers its granted GPUs
from 0.

Not covered: two GPU tensors sharing one storage (views) come back as separate tensors; other GPU
libraries' values (CuPy, JAX) do not pickle from the device and stay on the executor (the cell
warns, naming the variable).
"""

from __future__ import annotations

import sys
import weakref

_tagged: dict[int, tuple[weakref.ref, int]] = {}  # id(tensor) -> (tensor, logical GPU), host copies
# The host copies made by the last captures (see take_host_copies); a list, kept small by its caller.
_host_copies: list = []


def _torch():
    return sys.modules.get("torch")  # never import torch ourselves: the parent must stay CUDA-free


def reduce_gpu_value(obj):
    """A pickle reduction for a tensor on a GPU (None for anything else)."""
    torch = _torch()
    if torch is None or not isinstance(obj, torch.Tensor) or not obj.is_cuda:
        return None
    host = obj.detach().cpu()
    _host_copies.append(host)
    return _on_device, (host, isinstance(obj, torch.nn.Parameter), obj.requires_grad, obj.device.index or 0)


def _on_device(host, parameter: bool, requires_grad: bool, index: int):
    torch = _torch() or __import__("torch")  # loading a tensor imports torch anyway
    value = torch.nn.Parameter(host, requires_grad=requires_grad) if parameter else host
    if not parameter and requires_grad:
        value.requires_grad_(True)
    key = id(value)
    _tagged[key] = (weakref.ref(value, lambda _: _tagged.pop(key, None)), index)
    return value


def take_host_copies() -> list[tuple[int, int]]:
    """(address, bytes) of the host copies of GPU tensors made since the last call, which are
    dropped here: memory that lives only while an image is captured, never a namespace's."""
    spans = [(h.untyped_storage().data_ptr(), h.untyped_storage().nbytes()) for h in _host_copies]
    _host_copies.clear()
    return spans


def tagged() -> list[tuple[object, int]]:
    """The live host tensors that belong on a GPU, with their logical index."""
    out = []
    for ref, index in list(_tagged.values()):
        value = ref()
        if value is not None:
            out.append((value, index))
    return out


def move_tagged_to_devices() -> None:
    """In a GPU cell's child, before the cell: put every tagged tensor back on its GPU, in place."""
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        return
    with torch.no_grad():
        for value, index in tagged():
            value.data = value.data.to(f"cuda:{index}")
