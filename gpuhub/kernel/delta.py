"""What a cell changed in the namespace, as the bytes that replicate it (the namespace delta).

Used by the GPU cell's child (its delta goes to the parent over a pipe) and by a CPU kernel's
executor (in-process). Large buffers no write touched are skipped with :mod:`gpuhub.kernel.dirty`.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import cloudpickle

from gpuhub.kernel import devices, dirty
from gpuhub.replication import oob
from gpuhub.replication.digest import digest, fill_and_digest  # one content hash for all

IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), frozenset, range, types.ModuleType,
             types.FunctionType, types.BuiltinFunctionType, type)


def pickle_value(value, *, out_of_band: bool = False, alloc: Callable[[int], bytearray] | None = None
                 ) -> tuple[bytes | bytearray | memoryview, str | None]:
    """The bytes that replicate ``value``, and their digest when it came for free: an in-band
    pickle, or with ``out_of_band`` a layout (gpuhub/replication/oob.py) when the value holds
    large buffers. A layout is written into new memory the caller owns (``alloc(n)``: at least
    n bytes, e.g. a reused buffer; the result is then a view of its first n), never aliasing the
    value (the blob store keeps these bytes while later in-process cells may write the value in
    place), and hashed while it is written."""
    if not out_of_band:
        return cloudpickle.dumps(value, protocol=5), None
    layout = oob.dumps(value)
    if isinstance(layout, bytes):
        return layout, None
    buf = alloc(layout.nbytes) if alloc is not None else bytearray(layout.nbytes)
    view = memoryview(buf)[:layout.nbytes]
    d = fill_and_digest(view, lambda lo, hi: layout.write_range(view, lo, hi))
    return (view if len(buf) != layout.nbytes else buf), d


def namespace_delta(ns: dict, before: dict[str, int], digests: dict[str, str], hidden: set[str], *,
                    tracker: dirty.Tracker | None = None, out_of_band: bool = False,
                    alloc: Callable[[int], bytearray] | None = None) -> dict:
    """What the cell changed: new or rebound names, mutated objects (by content digest), deletions.

    ``tracker`` (armed before the cell over names whose values the group has, see
    gpuhub/kernel/dirty.py) lets large buffers that no write touched skip the pickle + digest.
    ``out_of_band``, ``alloc``: large buffers travel as a layout (:func:`pickle_value`)."""
    changed: dict[str, bytes] = {}
    hashed: dict[str, str] = {}  # digests computed here, so the commit need not hash 1 GiB again
    tags: dict[str, int] = {}
    failed: dict[str, str] = {}
    for name, value in list(ns.items()):
        if name in hidden or name.startswith("_"):
            continue
        rebound = before.get(name) != id(value)
        if not rebound and isinstance(value, IMMUTABLE):
            continue
        if not rebound and tracker is not None and tracker.unchanged(name, value):
            continue
        try:
            host_value, index = devices.to_host(value)
            data, known = pickle_value(host_value, out_of_band=out_of_band, alloc=alloc)
        except Exception as exc:
            if rebound:
                failed[name] = f"{type(value).__name__}: {exc}"
            continue
        if known is not None or not rebound:
            hashed[name] = known or digest(data)
        if rebound or digests.get(name) != hashed[name]:
            changed[name] = data
            if index is not None:
                tags[name] = index
    deleted = [name for name in before if name not in ns and not name.startswith("_")]
    return {"set": changed, "deleted": deleted, "device_tags": tags, "failed": failed,
            "digests": {name: d for name, d in hashed.items() if name in changed}}
