"""Outputs pickled once: ``Out`` entries carried by reference in later images (docs/architecture.md D4).

Every result a notebook displays stays in ``Out`` (``df.head()``, the ``[Line2D]`` of a
``plt.plot(...)``, which holds its whole figure). Pickled again with every later cell's image, 200
small frames cost 26 ms a cell and 40 plots 232 ms, which a plain ipykernel never pays. So an
output is **sealed** by the cell that made it: pickled on its own, once, into a stream of its own
that later images carry as it is (in band when small, else as a blob the group already holds).

What keeps this exact:

- **Sharing.** The output is pickled after the rest of the namespace, and every object the rest
  already holds (a DataFrame's column labels, the axes a line was drawn on, a notebook class) is
  written as a reference to that object in the one graph (``Seal.shared``), so a load keeps every
  ``is`` relation. Outputs holding tensors or large buffers are not sealed (their memory could be
  shared in ways a reference does not see). Two outputs sealed in one capture (a replica that took
  over tries them all) that hold an object between them are not sealed apart (:class:`Unseal`).
- **No later change.** A sealed output's own objects are reachable only through the output
  history (``Out``, ``_oh``, ``_``, ``__``, ``___``, ``_N``). A cell that names one of those other
  than by assigning it, or reaches the namespace indirectly (``globals()``, ``eval``, ``exec``,
  ``get_ipython()``, a magic that runs code gpuhub does not read), ends sealing for the rest of
  the session (:func:`note_cell`): every output is pickled with the namespace again, as before,
  and the images say so, so a replica that takes over carries on the same way. A library could
  hand an output's object back to a later cell from its own state: pyplot does for a figure not
  yet closed, so such outputs are not sealed (the inline backend closes each cell's figures).
  Other such paths (an object a library caches and returns later) are not seen: after a failover
  that output would show the value it had when it was made.

One kernel process holds one namespace, so the seals are this module's state: made by a capture
(``gpuhub.kernel.image``), or taken on by a load (:func:`load_alone`), so a replica that takes
over, or a GPU cell's child forked from it, carries on the same streams.

**Built when read.** A replica's load rebuilds the whole namespace, so every output with it
(0.3 s for 240 results on the dev VM), after every cell that changed anything: a follower would
pay that for outputs nobody reads there. A replica loads with outputs deferred (:func:`deferring`):
each stays a :class:`Pending` (its stream and the objects it refers to, which the rest of the load
just built) until code or a request may read the namespace, and
``gpuhub.kernel.image.build_outputs`` builds them all. A capture carries a pending output's
stream as it carries a built one's.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import pickle
import re
import threading
import tokenize
import types

from gpuhub.replication.digest import digest

SEALED_MAX = 16 << 20
"""An output whose stream would be larger stays with the namespace (a seal keeps its stream in memory)."""
OUT_OF_BAND_MIN = 16 << 10
"""A sealed stream this large leaves the image's stream as a blob of its own (held by the group
once, never pushed again); a smaller one is copied into each image's stream (cheaper than a blob)."""

_OUTPUT_NAME = re.compile(r"Out|_oh|_+|_\d+")  # the names that reach the output history
# ... and what reaches it indirectly (the namespace, a frame's globals, IPython itself)
_INDIRECT_NAMES = frozenset({"eval", "exec", "globals", "locals", "vars", "get_ipython", "__import__",
                             "breakpoint", "__main__", "__builtins__", "builtins"})
_INDIRECT_ATTRIBUTES = frozenset({"get_ipython", "user_ns", "user_global_ns", "f_globals", "f_locals",
                                  "__globals__", "Out", "_oh", "displayhook", "__dict__", "__main__"})
# IPython magics whose arguments are not code, and those that run their arguments as code (read)
_PLAIN_MAGICS = frozenset({
    "matplotlib", "pip", "conda", "mamba", "micromamba", "uv", "config", "load_ext", "reload_ext",
    "unload_ext", "autoreload", "aimport", "env", "set_env", "cd", "pwd", "ls", "cat", "mkdir",
    "rmdir", "rm", "cp", "mv", "less", "more", "man", "pinfo", "pinfo2", "psearch", "pdoc", "pdef",
    "psource", "pfile", "who", "whos", "who_ls", "lsmagic", "magic", "history", "hist", "precision",
    "bookmark", "dhist", "dirs", "pushd", "popd", "colors", "xmode", "automagic", "autocall", "pprint",
    "page", "load", "sx", "sc", "system", "quickref", "clear", "gui", "tb", "writefile", "bash", "sh",
    "script", "html", "HTML", "javascript", "js", "latex", "markdown", "svg", "reset", "xdel",
})
_CODE_MAGICS = frozenset({"time", "timeit", "prun", "capture"})
_IPYTHON_CALLS = frozenset({"run_line_magic", "run_cell_magic", "system", "getoutput"})


# objects no output owns: immutable, or loaded by reference as the very same object (a
# capture does not count them among an output's own, gpuhub/kernel/image.py)
NOT_OWNED = (str, bytes, int, float, complex, tuple, frozenset, type, types.FunctionType,
              types.BuiltinFunctionType, types.ModuleType, types.MethodDescriptorType)


class Seal:
    """An output pickled on its own: ``stream`` loads it, given ``shared`` (the objects of the
    rest of the namespace it refers to, by position)."""

    __slots__ = ("_digest", "shared", "stream", "value")

    def __init__(self, value, stream: bytes, shared: list) -> None:
        self.value, self.stream, self.shared = value, stream, shared
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        """The stream's digest (computed when first asked: only out-of-band streams need one)."""
        if self._digest is None:
            self._digest = digest(self.stream)
        return self._digest


class Pending:
    """An output a deferred load left unbuilt: ``stream`` loads it, given ``shared``. Pickled with
    the namespace (sealing ended since it was loaded), it loads as the output itself."""

    __slots__ = ("shared", "stream")

    def __init__(self, stream: bytes, shared: list) -> None:
        self.stream, self.shared = stream, shared

    def __reduce__(self):
        return load_alone, (pickle.PickleBuffer(self.stream), self.shared)

    def __repr__(self) -> str:
        return "<gpuhub: an output not built yet>"


class Unseal(Exception):
    """Raised from a capture that sealed two outputs holding one object between them (each on its
    own would load a copy of it): it starts again with ``seal``'s output pickled with the namespace."""

    def __init__(self, seal: Seal) -> None:
        super().__init__("two outputs sealed apart share an object")
        self.seal = seal


_seals: dict[int, Seal] = {}  # id(output) -> its seal (the seal holds the output: the id stays its)
_not_sealed: dict[int, object] = {}  # outputs found not to seal: pickled with the namespace
_enabled = True
_loading = threading.local()  # .defer: outputs loaded on this thread are left pending


def enabled() -> bool:
    """Whether outputs are sealed in this session (False once a cell could reach them)."""
    return _enabled


def disable() -> None:
    """Pickle every output with the namespace from now on (:func:`note_cell`, or an image that says so)."""
    global _enabled
    _enabled = False
    _seals.clear()
    _not_sealed.clear()


def reset() -> None:
    """Forget every seal and seal again (a new session, as tests start one)."""
    global _enabled
    disable()
    _enabled = True


def note_cell(code: str) -> None:
    """Before a cell's image is captured: a cell that could reach the output history ends sealing."""
    if _enabled and may_reach_outputs(code):
        disable()


def seal_of(value) -> Seal | None:
    seal = _seals.get(id(value))
    return seal if seal is not None and seal.value is value else None


def tried(value) -> bool:
    """Whether ``value`` is an output already found not to seal (pickled with the namespace)."""
    return _not_sealed.get(id(value)) is value


def keep_only(outputs) -> None:
    """Drop the seals and marks of outputs no longer in ``Out`` (``outputs``: its values)."""
    live = {id(v) for v in outputs}
    for i in [i for i in _seals if i not in live]:
        del _seals[i]
    for i in [i for i in _not_sealed if i not in live]:
        del _not_sealed[i]


def add(seal: Seal) -> None:
    if _enabled:
        _seals[id(seal.value)] = seal


def refuse(value) -> None:
    """``value`` is pickled with the namespace from now on."""
    _seals.pop(id(value), None)
    if _enabled:
        _not_sealed[id(value)] = value


def may_reach_outputs(code: str) -> bool:
    """Whether a cell's source could read or change what the output history holds: it names
    ``Out``, ``_oh``, ``_``, ``__``, ``___`` or ``_N`` other than by assigning it, or reaches the
    namespace indirectly (see the module docstring). A cell that does not compile runs nothing."""
    try:
        tree = ast.parse(_transformer().transform_cell(code))
    except Exception:  # not Python once IPython's syntax is transformed: it runs nothing
        return False
    return _Reaches().reaches(tree)


@functools.cache
def _transformer():
    """IPython's own cell transformer (``%magic`` and ``!cmd`` to Python), made once per process."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager()


def _tokens_reach(text: str) -> bool:
    """For a magic's code argument (options and all, so not parsed): any token that could reach."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME and (_OUTPUT_NAME.fullmatch(tok.string) or tok.string in _INDIRECT_NAMES
                                              or tok.string in _INDIRECT_ATTRIBUTES):
                return True
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return True  # cannot tell: assume it can
    return False


class _Reaches(ast.NodeVisitor):
    def reaches(self, tree: ast.AST) -> bool:
        self.found = False
        self.visit(tree)
        return self.found

    def visit_Name(self, node: ast.Name) -> None:
        assigned = isinstance(node.ctx, (ast.Store, ast.Del))  # rebinding `_` touches no output
        if node.id in _INDIRECT_NAMES or (_OUTPUT_NAME.fullmatch(node.id) and not assigned):
            self.found = True

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in _INDIRECT_ATTRIBUTES:
            self.found = True
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
        if any(n.split(".")[0] in _INDIRECT_NAMES or n in _INDIRECT_ATTRIBUTES for n in names):
            self.found = True

    visit_ImportFrom = visit_Import

    def visit_Call(self, node: ast.Call) -> None:
        """``get_ipython().run_line_magic(...)`` and the like, as IPython writes ``%magic`` and ``!cmd``."""
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in _IPYTHON_CALLS and isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Name) and func.value.func.id == "get_ipython"):
            args = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None for a in node.args]
            if func.attr in ("system", "getoutput"):
                return  # a shell command (its {expressions} are formatted, read-only)
            if not args or args[0] is None or None in args:
                self.found = True
            elif args[0] in _CODE_MAGICS:
                self.found = self.found or any(_tokens_reach(a) for a in args[1:])
            elif args[0] not in _PLAIN_MAGICS:
                self.found = True
            return
        self.generic_visit(node)


@contextlib.contextmanager
def deferring(defer: bool = True):
    """Outputs loaded on this thread meanwhile are left :class:`Pending` (while sealing is on)."""
    before = getattr(_loading, "defer", False)
    _loading.defer = defer
    try:
        yield
    finally:
        _loading.defer = before


def load_alone(data, shared: list):
    """A sealed stream's value (``shared``: the objects its references name), remembered as sealed;
    a :class:`Pending` for it while :func:`deferring`."""
    stream = bytes(data)
    if _enabled and getattr(_loading, "defer", False):
        pending = Pending(stream, shared)
        add(Seal(pending, stream, shared))
        return pending
    return _build(stream, shared)


def build(pending: Pending):
    """The output ``pending`` stands for, remembered as sealed in its place."""
    _seals.pop(id(pending), None)
    return _build(pending.stream, pending.shared)


def _build(stream: bytes, shared: list):
    unpickler = pickle.Unpickler(io.BytesIO(stream))
    unpickler.persistent_load = shared.__getitem__
    value = unpickler.load()
    add(Seal(value, stream, shared))
    return value
