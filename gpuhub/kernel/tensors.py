"""PyTorch tensors in the namespace image: storage bytes out of band, shared storages shared.

torch pickles a tensor by writing its whole storage with ``torch.save`` into the pickle stream.
In the namespace image (gpuhub/kernel/image.py) that meant every tensor of the namespace, a
model's parameters or a GPU tensor's host copy, was copied into the stream after every cell and
stored and sent to the group again, changed or not. Here a CPU tensor's storage leaves the stream
as a protocol-5 buffer instead, like a numpy array's: the image names it by content digest, so an
unchanged storage is neither copied nor sent again. Tensors that share a storage (views such as
``b = a[2:5]``, a model's tied weights) share one storage again once loaded, as in the kernel that
made them (plain pickling gave each its own copy). A loaded tensor uses the buffer's memory in
place, as a loaded numpy array does.

Only plain tensors and Parameters on the CPU take this path: strided, leaves, without Python
attributes, hooks, names or conjugate/negative bits. Anything else pickles as torch pickles it;
GPU tensors are turned into host copies first (gpuhub/kernel/devices.py), which then come here.
"""

from __future__ import annotations

import pickle
import sys

from gpuhub.kernel import devices


class _Storage:
    """One storage's bytes: pickled once per image however many tensors use it (the pickle memo
    shares this object), as a protocol-5 buffer the image can keep out of band."""

    __slots__ = ("array",)

    def __init__(self, array) -> None:
        self.array = array  # a uint8 numpy view of the storage: keeps it alive while pickling

    def __reduce__(self):
        return _storage, (pickle.PickleBuffer(self.array),)


def _storage(buffer):
    import torch

    mv = memoryview(buffer).cast("B")
    if mv.nbytes == 0:
        return torch.UntypedStorage(0)
    if mv.readonly:  # a tensor may be written in place: it needs memory of its own
        mv = memoryview(bytearray(mv))
    return torch.frombuffer(mv, dtype=torch.uint8).untyped_storage()  # keeps ``mv`` alive


def _tensor(storage, dtype, offset: int, size: tuple, stride: tuple, requires_grad: bool, parameter: bool):
    import torch

    t = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _plain_cpu_tensor(torch, obj) -> bool:
    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu"
            and obj.layout is torch.strided and not obj.is_quantized and obj.grad_fn is None
            and not obj.__dict__ and obj._backward_hooks is None and not obj.is_conj() and not obj.is_neg()
            and not any(getattr(obj, "names", None) or ()))  # named tensors: gone in newer torch


def reduce_tensor(obj, storages: dict):
    """A pickle reduction for a tensor: a plain CPU tensor's storage out of band, a GPU tensor as
    its host copy (gpuhub/kernel/devices.py); None for anything else, which pickles as usual.
    ``storages``: one dict per pickle, so that tensors sharing a storage share its :class:`_Storage`."""
    torch = sys.modules.get("torch")  # never import torch here: a namespace without it has no tensors
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    if obj.is_cuda:
        return devices.reduce_gpu_value(obj)
    try:
        if not _plain_cpu_tensor(torch, obj):
            return None
    except (AttributeError, RuntimeError):  # a torch without one of these: pickle as torch does
        return None
    storage = obj.untyped_storage()
    # Empty storages are never shared: resizing one tensor would resize the other's
    key = (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else id(obj)
    holder = storages.get(key)
    if holder is None:
        try:
            flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
            holder = storages[key] = _Storage(flat.numpy())
        except (RuntimeError, TypeError):  # numpy missing, or a storage numpy cannot view
            return None
    return _tensor, (holder, obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride(),
                     obj.requires_grad, type(obj) is torch.nn.Parameter)
