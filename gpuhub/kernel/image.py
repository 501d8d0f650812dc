"""The namespace image: a kernel's replicated variables as one object graph (docs/architecture.md D4).

After every cell the executor captures the whole replicated namespace as **one** pickle (protocol
5, cloudpickle so that functions and classes defined in the notebook travel by value) of the dict
``{name: value}``. One pickle has one memo, so whatever the names share survives: two names bound
to one object, references into other objects (``opt = SGD(model.parameters())`` keeps updating
``model``), cycles, and numpy views of one base (:func:`_view_of`). Pickling each name on its own,
as gpuhub did before, silently gave every name its own copy.

Large buffers (:data:`BUFFER_MIN_BYTES` or more: numpy arrays wherever they sit, DataFrame blocks,
PyTorch tensors' storages, ``bytes`` and ``bytearray`` values bound to names)
leave the stream out of band and are named by content digest. A buffer the group already has is
neither copied nor sent again; with :mod:`gpuhub.kernel.dirty` it is not even hashed. So a cell
costs what it changed in bytes, plus one pass over the namespace's small objects.

Functions and classes defined in the notebook keep the namespace itself as their globals: the
pickle names the captured namespace where a function's ``__globals__`` is it, and a load binds
them to the loading replica's own namespace (:func:`load`'s ``namespace``). cloudpickle alone
gives each loaded function a private copy of the globals it used, so ``global n; n += 1`` in a
function defined in an earlier cell would count in that copy after a failover, never in ``n``.

What is replicated: every name of ``user_ns`` except IPython's own (``user_ns_hidden``) and its
input history names (``_i``, ``_ii``, ``_i3`` …: each replica records the inputs itself). The
output history *is* replicated: ``_``, ``__``, ``___``, ``_3`` and ``Out`` (whose entries that
cannot be pickled are left out of the image, never the whole dict). A name whose value cannot be
pickled stays on the executor only; the caller warns. Beside the names, the image carries the
working directory and the environment variables the cells set (:mod:`gpuhub.kernel.process_state`)
the settings they made in IPython and common libraries (:mod:`gpuhub.kernel.shell_settings`) and
the global random generators' state (:mod:`gpuhub.kernel.random_state`), under :data:`PROCESS`, a
key no Python name can be.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import itertools
import logging
import pickle
import re
import sys
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

import cloudpickle

from gpuhub.kernel import (
    dirty,
    library_state,
    process_state,
    random_state,
    sealed_outputs,
    shell_settings,
    tensors,
    wrappers,
)
from gpuhub.kernel.quiet import silenced

log = logging.getLogger(__name__)

BUFFER_MIN_BYTES = 1 << 20
"""Buffers smaller than this stay in the pickle stream (naming them would not pay)."""
OUT = "Out"
PROCESS = "<process>"  # the image's entry for process_state (not a name: never in a namespace)
OUTPUT_NAME = re.compile(r"_+|_\d+")  # _, __, ___ and _N: IPython's output history
INPUT_NAME = re.compile(r"_i+|_i\d+|_ih|_oh|_dh")  # input history: each replica keeps its own


@dataclass
class Capture:
    """A captured namespace: the pickle stream and its out-of-band buffers, in pickle order.

    ``buffers`` alias the live values' memory: write them out (or hash them) before the values can
    change. ``digests[i]`` is buffer i's digest when it is known without hashing (else None)."""

    stream: bytes
    buffers: list[memoryview]
    digests: list[str | None]
    names: list[str]
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it could not be pickled

    def sized_buffers(self) -> list[tuple[str | None, int, memoryview]]:
        """(known digest, size, memory) per buffer, as :meth:`Replica.store_image` takes them."""
        return [(d, mv.nbytes, mv) for d, mv in zip(self.digests, self.buffers, strict=True)]


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (the stable buffer protocol), up to the fields read here."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None


def address_of(mv: memoryview) -> int:
    """The address of a buffer's first byte, read-only ones (a ``bytes`` value's) too. Without
    numpy: a kernel's environment need not have it."""
    if not mv.readonly:
        c = ctypes.c_char.from_buffer(mv)
        try:
            return ctypes.addressof(c)
        finally:
            del c
    view = _PyBuffer()
    if _get_buffer(mv, ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE; raises (ctypes) on failure
        raise BufferError("no buffer")
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))


def track(resident: dict[str, memoryview], *, mode: str, sentinel: bool,
          hash_instead: Collection[tuple[int, int]] = ()):
    """A :class:`gpuhub.kernel.dirty.BufferTracker` over the buffers this process holds of the last
    image (digest -> memory), and the ``known_digest`` function for :func:`capture` it answers.
    Buffers in ``hash_instead`` ((address, nbytes), see :func:`written`) are left untracked: the
    capture hashes them."""
    # smaller buffers are sealed outputs' streams (gpuhub/kernel/sealed_outputs.py): their seal
    # knows their digest, and their pages are the heap's, written all the time
    known = [(address_of(mv), mv.nbytes, d) for d, mv in resident.items()
             if mv.nbytes >= BUFFER_MIN_BYTES and (address_of(mv), mv.nbytes) not in hash_instead]
    if not known:
        return None, lambda mv: None
    tracker = dirty.BufferTracker.arm(known, mode=mode, sentinel=sentinel)
    return tracker, lambda mv: tracker.digest_if_unchanged(address_of(mv), mv.nbytes) if mv.nbytes else None


def buffer_digests(resident: dict[str, memoryview]) -> dict[tuple[int, int], str]:
    """(address, nbytes) -> digest of the buffers in ``resident`` (digest -> memory): what
    :func:`written` compares, kept across a cell instead of the memory, which the cell may free."""
    return {(address_of(mv), mv.nbytes): d for d, mv in resident.items() if mv.nbytes}


def written(before: dict[tuple[int, int], str], after: dict[str, memoryview]) -> set[tuple[int, int]]:
    """The buffers (address, nbytes) that a cell wrote in place: in the resident memory of the
    image before it (:func:`buffer_digests`) and of the image after it, with other bytes after.

    A buffer written by one cell is likely written by the next (a training loop's weights, an
    accumulator). Tracking it costs a minor fault per page written (userfaultfd write-protection:
    about 0.35 s per GiB on the dev VM; with a sentinel, a copied page too), and a changed buffer
    is hashed anyway, while it is copied into the store. So such buffers are left untracked for
    the next cell (:func:`track`'s ``hash_instead``); one then found unchanged was copied and hashed
    for nothing (about 0.2 s per GiB) and is tracked again from the cell after. (A buffer freed
    and another of its size allocated at its address counts as written: hashed once, harmless.)"""
    return {key for d, mv in after.items()
            if mv.nbytes and before.get(key := (address_of(mv), mv.nbytes), d) != d}


_ALWAYS, _UNLESS_HIDDEN, _NEVER = 1, 2, 3  # what a name's spelling says about carrying it
_KIND_OF: dict[str, int] = {}
_NEVER_CARRIED: set[str] = set()  # the same, for the names no image carries: skipped at C speed
_KIND_CACHE_MAX = 100_000


def _kind_of(name: str) -> int:
    if name == OUT or OUTPUT_NAME.fullmatch(name):
        kind = _ALWAYS  # the output history, although IPython hides it
    elif name == PROCESS or INPUT_NAME.fullmatch(name) or (name.startswith("__") and name.endswith("__")):
        kind = _NEVER  # PROCESS: put there by a replica of a release before it was carried apart
    else:
        kind = _UNLESS_HIDDEN
    if len(_KIND_OF) < _KIND_CACHE_MAX:
        _KIND_OF[name] = kind
        if kind == _NEVER:
            _NEVER_CARRIED.add(name)
    return kind


def replicated_names(ns: dict, hidden) -> list[str]:
    """The names of ``ns`` an image carries, in namespace order. Called for every cell over a
    namespace that holds every cell's input (``_i1``, ``_i2`` …), so a name's spelling is looked at
    once and remembered, and the inputs are passed over without a Python step each: matching each
    name against the patterns made a no-op cell cost about 0.3 ms more per 1,000 cells of the
    session."""
    kind = _KIND_OF.get
    return [name for name in itertools.filterfalse(_NEVER_CARRIED.__contains__, ns)
            if (k := kind(name) or _kind_of(name)) == _ALWAYS or (k == _UNLESS_HIDDEN and name not in hidden)]


def _view_of(base, offset: int, shape: tuple, strides: tuple, dtype):
    """Rebuild a numpy view on ``base`` (itself rebuilt once, from the same pickle memo)."""
    import numpy as np

    return np.ndarray(shape, dtype=dtype, buffer=base, offset=offset, strides=strides)


class _LargeBytes:
    """Stands in the image for a large ``bytes`` or ``bytearray`` value bound to a name. pickle
    writes both into the stream (it never asks ``reducer_override`` about bytes), so a 1 GiB one
    was copied, hashed and sent with every cell's image, changed or not; this way it leaves out of
    band like an array's buffer. (Large ones nested inside other values still go in the stream.)"""

    __slots__ = ("value",)

    def __init__(self, value: bytes | bytearray) -> None:
        self.value = value


def _out_of_band_bytes(image: dict, min_buffer: int) -> None:
    """Wrap the image's large ``bytes``/``bytearray`` values (one wrapper per object: names bound
    to one value keep sharing it)."""
    wrapped: dict[int, _LargeBytes] = {}
    for name, value in image.items():
        if type(value) in (bytes, bytearray) and len(value) >= min_buffer:
            image[name] = wrapped.setdefault(id(value), _LargeBytes(value))


class _NamespaceMarker:
    """Stands in a pickle for the captured namespace, where notebook functions have it as globals."""


_NAMESPACE = _NamespaceMarker()
_loading = threading.local()  # the namespace a load on this thread binds notebook functions to


def _namespace() -> dict:
    """What ``_NAMESPACE`` loads as: the namespace :func:`load` was given, else a new dict (one per
    pickle: the pickle's memo shares it among the functions that had the namespace as globals)."""
    namespace = getattr(_loading, "namespace", None)
    return {} if namespace is None else namespace


class _Output:
    """Stands in the image for an output (a value of ``Out``, and the ``_``/``_N`` names bound to
    it: one per output, so they share it), which the pickler seals or pickles as usual."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value


def _identity(value):
    """What an output that is not sealed loads as: itself."""
    return value


def _plain(value):
    return value.value if type(value) is _Output else value


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus numpy views kept as views of their (shared) base, PyTorch tensors with
    their storage out of band (:mod:`gpuhub.kernel.tensors`), GPU tensors sent from the host with
    their logical device (:mod:`gpuhub.kernel.devices`), notebook functions' functools wrappers by
    value (:mod:`gpuhub.kernel.wrappers`), notebook functions' globals sent as a reference to
    the namespace (``namespace``: the one being captured), and outputs sealed
    (:mod:`gpuhub.kernel.sealed_outputs`; ``sealed``: filled in with id -> (stream, digest) of the
    sealed streams that leave out of band)."""

    def __init__(self, file, *, namespace: dict | None = None, sealed: dict | None = None, **kw) -> None:
        super().__init__(file, **kw)
        self._storages: dict = {}  # tensors sharing a storage share it in the image
        self._namespace = namespace
        self._sealed = sealed if sealed is not None else {}
        self._memo_copy: dict | None = None  # the memo as the last output was tried against it
        # id -> (seal, object) for the objects of the outputs sealed by this dump; holding the object
        # keeps its id from going to another (a reducer's temporaries die with their pickler)
        self._own: dict[int, tuple[sealed_outputs.Seal, object]] = {}
        if namespace is not None:
            # cloudpickle looks a function's future globals up here by id (functions sharing
            # globals share them once loaded): the namespace's entry is the marker. globals_ref
            # is cloudpickle's own attribute (3.x): tests/unit/test_image.py fails if it changes
            self.globals_ref[id(namespace)] = _NAMESPACE

    def reducer_override(self, obj):
        if obj is _NAMESPACE:
            return _namespace, ()
        if type(obj) is _Output:
            return self._reduce_output(obj.value)
        np = sys.modules.get("numpy")
        if np is not None and type(obj) is np.ndarray and isinstance(obj.base, np.ndarray):
            base = obj.base
            while isinstance(base.base, np.ndarray):
                base = base.base
            if type(base) is np.ndarray and base.flags.c_contiguous and not base.dtype.hasobject:
                offset = obj.__array_interface__["data"][0] - base.__array_interface__["data"][0]
                if 0 <= offset <= base.nbytes:
                    return _view_of, (base, offset, obj.shape, obj.strides, obj.dtype)
        if type(obj) is _LargeBytes:  # loads as bytes(buffer) or bytearray(buffer): a copy of its own
            return type(obj.value), (pickle.PickleBuffer(obj.value),)
        reduced = (tensors.reduce_tensor(obj, self._storages) or wrappers.reduce_wrapper(obj)
                   or library_state.reduce_callback_registry(obj))
        if reduced is not None:
            return reduced
        reduced = super().reducer_override(obj)
        if reduced is NotImplemented and type(obj) not in self.dispatch_table:
            name = wrappers.by_reference_to_the_notebook(obj)
            if name is not None:  # an image another replica could not load: this name stays behind
                raise pickle.PicklingError(f"a {type(obj).__name__} pickles by its name in the notebook "
                                           f"({name!r}), which another process cannot look up as it loads the image")
        return reduced


    def _reduce_output(self, value):
        """An output: its seal's stream (sealed by this capture if it was not), else itself."""
        seal = sealed_outputs.seal_of(value)
        if seal is None and sealed_outputs.enabled() and not sealed_outputs.tried(value):
            seal = self._seal(value)
        self._memo_copy = None  # what follows may add to the memo
        if seal is None:
            return _identity, (value,)
        if len(seal.stream) >= sealed_outputs.OUT_OF_BAND_MIN:
            self._sealed[id(seal.stream)] = (seal.stream, seal.digest)
        return sealed_outputs.load_alone, (pickle.PickleBuffer(seal.stream), seal.shared)

    def _seal(self, value) -> sealed_outputs.Seal | None:
        if self._memo_copy is None:
            self._memo_copy = self.memo.copy()  # everything the image holds before this output
        made = _dump_alone(value, self._memo_copy, self._namespace)
        if made is None:
            sealed_outputs.refuse(value)
            return None
        stream, shared, own = made
        for i, obj in own.items():
            held = self._own.get(i)
            if held is not None and held[1] is obj:
                raise sealed_outputs.Unseal(held[0])
        seal = sealed_outputs.Seal(value, stream, shared)
        sealed_outputs.add(seal)
        self._own.update((i, (seal, obj)) for i, obj in own.items())
        return seal


class _SealingPickler(_Pickler):
    """Pickles one output on its own: what the rest of the image holds (``shared_ids``, id ->
    memo entry) becomes a reference (``shared``); ``refused`` once it meets what must not be sealed."""

    def __init__(self, file, shared_ids: dict, *, namespace: dict | None) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._buffer, namespace=namespace)
        self.shared_ids = shared_ids
        self.shared: list = []
        self._position: dict[int, int] = {}
        self.refused = False

    def persistent_id(self, obj):
        entry = self.shared_ids.get(id(obj))
        if entry is None or entry[1] is not obj:
            return None
        position = self._position.get(id(obj))
        if position is None:
            position = self._position[id(obj)] = len(self.shared)
            self.shared.append(obj)
        return position

    def _buffer(self, pb: pickle.PickleBuffer) -> bool:
        try:
            if pb.raw().nbytes >= BUFFER_MIN_BYTES:
                self.refused = True
        except BufferError:
            pass
        return True

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if (torch is not None and isinstance(obj, torch.Tensor)) or _held_by_pyplot(obj):
            self.refused = True  # a tensor's storage may be shared in ways the memo does not show
        return super().reducer_override(obj)


def _dump_alone(value, shared_ids: dict, namespace: dict | None):
    """Pickle an output on its own, the objects in ``shared_ids`` (id -> memo entry: the rest of
    the image's) as references. Returns (stream, the shared objects in reference order, id -> object
    of its own objects), or None when it must be pickled with the namespace: it holds a tensor, a
    large buffer or a figure pyplot still has open, or it does not pickle."""
    out = io.BytesIO()
    pickler = _SealingPickler(out, shared_ids, namespace=namespace)
    try:
        pickler.dump(value)
    except Exception:
        return None
    if pickler.refused or out.tell() > sealed_outputs.SEALED_MAX:
        return None
    own = {i: obj for i, (_, obj) in pickler.memo.copy().items()
           if i not in shared_ids and not isinstance(obj, sealed_outputs.NOT_OWNED)}
    return out.getvalue(), pickler.shared, own


def _held_by_pyplot(obj) -> bool:
    """A figure pyplot still has open: pyplot hands it back (``plt.gcf()``) to later cells."""
    helpers = sys.modules.get("matplotlib._pylab_helpers")
    figure = sys.modules.get("matplotlib.figure")
    if helpers is None or figure is None or not isinstance(obj, figure.Figure):
        return False
    return any(getattr(m.canvas, "figure", None) is obj for m in helpers.Gcf.get_all_fig_managers())


def _dumps(value, take: Callable[[pickle.PickleBuffer], bool], namespace: dict | None = None,
           sealed: dict | None = None) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=take, namespace=namespace, sealed=sealed).dump(value)
    return out.getvalue()


def _picklable(value) -> str | None:
    """None when ``value`` pickles on its own, else why not. Its large buffers are left out of
    band and dropped (the callback answers False): copying them into the probe's stream cost
    about 2 s per GiB, every cell, while an unpicklable value (a thread, a lock, an open file)
    stayed in the namespace."""
    try:
        _dumps(value, lambda pb: False)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def capture_process(ns: dict | None = None, hidden=None) -> dict:
    """The image's :data:`PROCESS` entry: this process's state beside the names (``ns``: the
    namespace being captured, and ``hidden`` IPython's hidden part of it)."""
    out = {**process_state.capture(), "settings": shell_settings.capture(), "random": random_state.capture(),
           "outputs_sealed": sealed_outputs.enabled()}
    if ns is not None and hidden is not None:
        out["output_history"] = _output_history(ns, hidden)
    return out


UNDERS = ("_", "__", "___")
_NOT_THE_NOTEBOOKS = object()  # IPython's record for an output-history name a cell assigned itself


def _displayhook():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "displayhook", None) if shell is not None else None


def _output_history(ns: dict, hidden) -> dict:
    """IPython's own record of ``_``, ``__``, ``___``: which of the names it still owns (it moves
    them on with each result only while each holds what it put there, by the hidden namespace,
    IPython 8.x, else by its displayhook's attributes; a cell that assigned one stops it), and the
    three results its displayhook holds, as keys of ``Out`` (None: the start's ``''``, or a result
    no longer there). A process that loads the image has a record of its own, stale: it takes this
    on (:func:`install`), else ``_`` stopped at the first result another replica, or a GPU cell's
    fresh process, loaded."""
    hook = _displayhook()
    owned = []
    for u in UNDERS:
        if u in ns:
            in_hidden = isinstance(hidden, dict) and u in hidden
            record = hidden[u] if in_hidden else getattr(hook, u, _NOT_THE_NOTEBOOKS)
            if record is ns[u]:
                owned.append(u)
    out = ns.get(OUT)
    # the hook's three are the last results: looked for among Out's last entries only
    recent = list(itertools.islice(reversed(out.items()), 8)) if isinstance(out, dict) else []
    held = []
    for u in UNDERS:
        value = getattr(hook, u, "")
        held.append(next((k for k, v in recent if v is value), None))
    return {"owned": owned, "held": held}


def _give_output_history_to_ipython(ns: dict, hidden, history) -> None:
    if not isinstance(history, dict) or not hasattr(hidden, "__setitem__"):
        return
    owned = history.get("owned") or []
    out = ns.get(OUT) if isinstance(ns.get(OUT), dict) else {}
    hook = _displayhook()
    for u, key in zip(UNDERS, history.get("held") or (None,) * len(UNDERS), strict=False):
        if hook is not None:
            setattr(hook, u, out.get(key, "") if key is not None else "")
        if u in ns:
            hidden[u] = ns[u] if u in owned else _NOT_THE_NOTEBOOKS


def apply_process(process) -> None:
    """Take on a :data:`PROCESS` entry (an image from before it existed has none). Never raises."""
    if isinstance(process, dict):
        process_state.apply(process)
        shell_settings.apply(process.get("settings"))
        random_state.apply(process.get("random"))
        if process.get("outputs_sealed") is False:  # a cell could reach the outputs: never sealed again
            sealed_outputs.disable()


def capture(ns: dict, hidden, *, known_digest: Callable[[memoryview], str | None] = lambda mv: None,
            min_buffer: int = BUFFER_MIN_BYTES) -> Capture:
    """Pickle the replicated part of ``ns`` as one object graph (see the module docstring).

    ``known_digest(buffer)``: the digest of an out-of-band buffer when it is known without hashing
    (e.g. unchanged since the last image, :mod:`gpuhub.kernel.dirty`), else None."""
    names = replicated_names(ns, hidden)
    failed: dict[str, str] = {}
    image = _in_pickle_order(ns, names)
    image[PROCESS] = capture_process(ns, hidden)
    _out_of_band_bytes(image, min_buffer)
    buffers: list[memoryview] = []
    digests: list[str | None] = []
    sealed: dict[int, tuple] = {}  # id of a sealed output's stream -> (stream, digest): out of band

    def take(pb: pickle.PickleBuffer) -> bool:
        try:
            raw = pb.raw()  # contiguous bytes; BufferError when not contiguous
        except BufferError:
            return True
        stream, known = sealed.get(id(raw.obj), (None, None))
        if stream is not raw.obj:  # (the entry holds the stream: its id stays its own)
            known = None
        if known is None and raw.nbytes < min_buffer:
            return True
        buffers.append(raw)
        digests.append(known)
        return False

    while True:
        buffers.clear()
        digests.clear()
        sealed.clear()
        try:
            stream = _dumps(image, take, ns, sealed)
            break
        except sealed_outputs.Unseal as exc:  # two outputs sealed apart share an object: one joins the graph
            sealed_outputs.refuse(exc.seal.value)
        except Exception as exc:
            # Find what cannot be pickled, name by name, and leave it out (rare: costs a second pass).
            bad = {name: why for name in image
                   if name not in (OUT, PROCESS) and (why := _picklable(_plain(image[name])))}
            out = image.get(OUT)
            dropped = [k for k, v in out.items() if _picklable(_plain(v))] if isinstance(out, dict) else []
            for key in dropped:
                del out[key]
            if not bad and not dropped:  # only the whole fails (e.g. too deep): nothing replicates
                bad = {name: f"{type(exc).__name__}: {exc}" for name in image if name != PROCESS}
                if not bad:
                    raise  # the process's own state does not pickle: a defect, not a value to leave out
            failed.update(bad)
            for name in bad:
                image.pop(name, None)
    digests = [d or known_digest(b) for d, b in zip(digests, buffers, strict=True)]
    return Capture(stream, buffers, digests, [n for n in names if n in image], failed)


def _in_pickle_order(ns: dict, names: list[str]) -> dict:
    """The image's ``{name: value}``: the output history last (``Out``, then ``_``, ``_N`` …), so
    that an output is pickled after everything else the namespace holds, and outputs in
    :class:`_Output` wrappers (one per output, shared by ``Out`` and the names bound to it) while
    outputs are sealed (:mod:`gpuhub.kernel.sealed_outputs`). ``Out`` is a copy, so that entries
    that cannot pickle can be left out."""
    kind = _KIND_OF.get
    # the names replicated_names just classified: their kind is remembered, no pattern is matched again
    history = {n for n in names if (kind(n) or _kind_of(n)) == _ALWAYS}
    image = {name: ns[name] for name in names if name not in history}
    out = ns.get(OUT) if OUT in history else None
    wrapped: dict[int, _Output] = {}
    if isinstance(out, dict):
        values = list(out.values())
        sealed_outputs.keep_only(values)
        if sealed_outputs.enabled():
            wrapped = {id(v): _Output(v) for v in values}
            out = {k: wrapped[id(v)] for k, v in out.items()}
        else:
            out = dict(out)
    for name in (n for n in names if n in history):
        image[name] = out if name == OUT else wrapped.get(id(ns[name]), ns[name])
    return image


def _loads(stream, buffers: list):
    with silenced():  # imports and unpickling code print nothing to the notebook (gpuhub/kernel/quiet.py)
        return pickle.loads(stream, buffers=buffers)


def load(stream, buffers: list, namespace: dict | None = None, *, defer_outputs: bool = False) -> dict:
    """The ``{name: value}`` an image holds, and its :data:`PROCESS` entry; ``buffers`` supply
    its out-of-band buffers, in order (writable memory the caller may let the values keep: see
    gpuhub/kernel/replica.py). ``namespace``: the one the values are for (:func:`install` them
    there next): notebook functions get it as their globals; without it they share a new dict.
    ``defer_outputs``: sealed outputs stay pending until :func:`build_outputs` (a replica's load)."""
    with sealed_outputs.deferring(defer_outputs), _loading_for(namespace):
        return _loads(stream, buffers)


@contextlib.contextmanager
def _loading_for(namespace: dict | None):
    if namespace is None:
        yield
        return
    builtins = namespace.get("__builtins__")
    _loading.namespace = namespace
    try:
        yield
    finally:
        del _loading.namespace
        if builtins is not None:  # cloudpickle sets its own module's (a dict) on functions' globals
            namespace["__builtins__"] = builtins


def build_outputs(ns: dict, hidden) -> None:
    """Build the outputs a deferred load left pending (:mod:`gpuhub.kernel.sealed_outputs`),
    wherever the image put them (``Out``, ``_N``, ``_``…) and IPython copied them (its hidden
    namespace, its displayhook). Called before code runs or a request reads the namespace; when
    nothing is pending it costs a flag test. An output that cannot be built is dropped, with a
    warning: a namespace in which the rest is missing would be worse."""
    global _installs_built
    installs = _pending_installs  # one installed meanwhile is built by the next call
    if installs == _installs_built:
        return
    Pending = sealed_outputs.Pending
    made: dict[int, tuple] = {}  # id(pending) -> (pending, its output or _NOT_BUILT)

    def output(pending):
        got = made.get(id(pending))
        if got is None:
            try:
                got = (pending, sealed_outputs.build(pending))
            except Exception as exc:
                log.warning("an output in Out could not be rebuilt on this replica and is left out: %s: %s",
                            type(exc).__name__, exc)
                got = (pending, _NOT_BUILT)
            made[id(pending)] = got
        return got[1]

    def rebuild(where: dict, keys) -> None:
        for key in keys:
            value = output(where[key])
            if value is _NOT_BUILT:
                del where[key]
            else:
                where[key] = value

    with silenced(), _loading_for(ns):
        out = ns.get(OUT)
        if isinstance(out, dict):
            rebuild(out, [k for k, v in out.items() if type(v) is Pending])
        rebuild(ns, [k for k, v in ns.items() if type(v) is Pending])
        if isinstance(hidden, dict):
            rebuild(hidden, [u for u in UNDERS if type(hidden.get(u)) is Pending])
        hook = _displayhook()
        for u in UNDERS:
            if type(getattr(hook, u, None)) is Pending:
                value = output(getattr(hook, u))
                setattr(hook, u, "" if value is _NOT_BUILT else value)
    _installs_built = installs


_NOT_BUILT = object()
# Installs that left pending outputs in a namespace, and how many of those the last build_outputs
# had seen: one on another thread (a joining replica's) while a build runs is not missed.
_pending_installs = 0
_installs_built = 0


def install(ns: dict, hidden, image: dict, known: Iterable[str] | None = None) -> None:
    """Make ``ns`` hold the image's replicated names (others of IPython's stay as they are).
    ``known``: the names the group had before (the previous image's); only those may be removed,
    so a value that could not be replicated stays on the replica that made it. None: every
    replicated name not in the image is removed. ``Out`` is updated in place: IPython's
    displayhook and history hold that very dict. The image's working directory and environment
    become this process's (an image from before they were carried leaves both as they are)."""
    global _pending_installs
    process = image.pop(PROCESS, None)
    apply_process(process)
    candidates = replicated_names(ns, hidden) if known is None else [n for n in known if n in ns]
    for name in candidates:
        if name not in image and name != OUT:
            del ns[name]
    out = image.pop(OUT, None)
    ns.update(image)
    if isinstance(out, dict):
        current = ns.get(OUT)
        if isinstance(current, dict):
            current.clear()
            current.update(out)
        else:
            ns[OUT] = out
        sealed_outputs.keep_only(out.values())  # the seals of the outputs replaced go
    if isinstance(process, dict):
        _give_output_history_to_ipython(ns, hidden, process.get("output_history"))
    if isinstance(out, dict) and any(type(v) is sealed_outputs.Pending for v in out.values()):
        _pending_installs += 1  # once they are in place: build_outputs must look
