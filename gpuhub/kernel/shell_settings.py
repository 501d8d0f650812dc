"""Settings cells make in IPython and in common libraries, which live in the process, not in any
variable: IPython extensions (``%load_ext``), autoreload's mode (``%autoreload 2``),
``%precision``, ``%xmode``, ``%config`` (``%config InlineBackend.figure_format = "retina"``) and
the options of IPython's objects set directly (``InteractiveShell.ast_node_interactivity =
"all"``), the module search path (``sys.path.insert(0, "../src")``) and recursion limit, warnings
filters (``warnings.filterwarnings("ignore")``), the root logger's level and its handlers to the
notebook (``logging.basicConfig(level=logging.INFO)``), named loggers' levels, NumPy's print
options and floating-point error handling (``np.seterr``), pandas' options (``pd.set_option``),
Matplotlib's rcParams (``plt.rcParams["figure.figsize"] = ...``) and PyTorch's global switches
(default dtype, print options, deterministic algorithms, cuDNN and TF32 flags, gradient mode).

A plain kernel keeps them in its one process. A gpuhub kernel runs a GPU cell in a process forked
from its replica, which ends after the cell (or after a short linger), and a cell may run on another
replica after an election or a failover: each namespace image carries these settings beside the
working directory and environment (:mod:`gpuhub.kernel.process_state`, the image's ``<process>``
entry, key ``settings``), and each replica that loads an image takes them on, so the next cell's
process starts with them.

Everything travels as plain data (strings, numbers, lists), never as the objects themselves, so the
image always pickles and loads, and a setting one replica cannot take (a warning category or an
extension its server lacks) is logged once and skipped. What is not carried: a NumPy formatter
function, rcParams whose values are objects other than a color cycle, ``%config`` values and
options other than plain data (and the kernel application's and the history's own), logging
handlers other than the root logger's to sys.stdout/sys.stderr (or with a formatter of another
class), the replica's own loggers' levels (:data:`OWN_LOGGERS`), ``logging.disable`` (it would
silence the replicas' own logs too).

A GPU kernel's replica never runs a cell and must never initialise CUDA (every process forked from
it would lose it; gpuhub/kernel/warm_imports.py): it runs no code a setting names. An extension is
loaded, and a warning category's module imported, in each cell's process as it starts
(:func:`apply_deferred`, once its GPUs are set), not in the replica (:func:`defer_code`).
Completion options that evaluate what is typed (``%config IPCompleter.greedy = True``) are not
taken there either: the replica answers completions.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
import warnings
import weakref

from gpuhub.kernel.quiet import silenced

log = logging.getLogger(__name__)

_PRIMITIVES = (str, int, float, bool, type(None))
_baseline_filters: list | None = None
_baseline_logging: dict | None = None
_baseline_recursion: int | None = None  # sys.getrecursionlimit() at the kernel's start
_baseline_levels: dict[str, int] | None = None  # named loggers' levels at the kernel's start
_baseline_path: list[str] | None = None
_baseline_config: dict | None = None
_baseline_options: dict | None = None
_refused: set[str] = set()  # settings already logged as not taken here
_defer_code = False  # a GPU kernel's replica: see defer_code()
_deferred: dict = {}  # what this process left to the next cell's process
_last: dict | None = None  # the state last taken on (apply), for reapply()


def take_baseline() -> None:
    """The warnings filters, the root logger and the module search path the cells start from (the
    kernel calls it as it is built): an image carries each only once a cell changed it, so an
    unchanged namespace gives an unchanged image."""
    global _baseline_filters, _baseline_logging, _baseline_levels, _baseline_path, _baseline_config
    global _baseline_options, _baseline_recursion, _options_read, _options_applied
    _baseline_filters = _filters()
    _baseline_levels = _logger_levels()
    _baseline_logging = _logging()
    _baseline_path = list(sys.path)
    _baseline_recursion = sys.getrecursionlimit()
    _baseline_config = _config()
    _trait_names.clear()
    _baseline_options = _options()
    _options_read = _options_applied = None
    shell = _shell()
    if shell is not None:
        _watch.token(shell)  # learns the classes now, before any cell could hide a trait


def defer_code(on: bool = True) -> None:
    """This process (a GPU kernel's replica) runs no code a setting names: extensions not yet
    loaded here, and warning categories of modules not yet imported, are left to each cell's
    process (:func:`apply_deferred`)."""
    global _defer_code
    _defer_code = on


def apply_deferred() -> None:
    """In a cell's process, forked from a replica that deferred code: take on what it left (the
    last state's extensions, autoreload mode and warnings filters). Never raises."""
    global _defer_code
    _defer_code = False
    wanted = dict(_deferred)
    _deferred.clear()
    if "warnings" in wanted:
        _step("warnings", _apply_filters, wanted["warnings"])
    if "ipython" in wanted:
        with silenced():
            _step("IPython", _apply_ipython, wanted["ipython"])


def _plain(value):
    """``value`` as plain data, or raise ValueError."""
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise ValueError(type(value).__name__)


def _refuse(what: str, exc: BaseException) -> None:
    if what not in _refused:
        _refused.add(what)
        log.warning("cannot take the notebook's setting %s here: %s: %s", what, type(exc).__name__, exc)


# ------------------------------------------------------------------ IPython extensions, autoreload

_AUTORELOAD = ("enabled", "check_all", "autoload_obj", "hide_errors")


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _autoreloader(shell):
    magics = shell.magics_manager.registry.get("AutoreloadMagics")
    return getattr(magics, "_reloader", None)


def _capture_ipython() -> dict:
    shell = _shell()
    if shell is None:
        return {}
    out: dict = {"extensions": sorted(shell.extension_manager.loaded),
                 "precision": shell.display_formatter.formatters["text/plain"].float_precision,
                 "xmode": shell.InteractiveTB.mode}
    reloader = _autoreloader(shell)
    if reloader is not None:
        out["autoreload"] = {**{k: bool(getattr(reloader, k, False)) for k in _AUTORELOAD},
                             "modules": sorted(reloader.modules), "skip": sorted(reloader.skip_modules)}
    return out


def _apply_ipython(state: dict) -> None:
    shell = _shell()
    if shell is None:
        return
    missing = [n for n in state.get("extensions") or () if n not in shell.extension_manager.loaded
               and f"%load_ext {n}" not in _refused]
    if missing and _defer_code:
        _deferred["ipython"] = state  # autoreload's mode too: it needs the extension
    for name in () if _defer_code else missing:
        try:
            shell.extension_manager.load_extension(name)
        except (Exception, SystemExit) as exc:  # not installed on this server, or it fails here
            _refuse(f"%load_ext {name}", exc)
    plain = shell.display_formatter.formatters["text/plain"]
    if isinstance(state.get("precision"), str) and plain.float_precision != state["precision"]:
        plain.float_precision = state["precision"]
    if isinstance(state.get("xmode"), str) and shell.InteractiveTB.mode != state["xmode"]:
        shell.InteractiveTB.set_mode(state["xmode"])
    wanted = state.get("autoreload")
    reloader = _autoreloader(shell) if wanted else None
    if reloader is not None:
        for k in _AUTORELOAD:
            setattr(reloader, k, bool(wanted.get(k)))
        reloader.modules = dict.fromkeys(wanted.get("modules") or (), True)
        reloader.skip_modules = dict.fromkeys(wanted.get("skip") or (), True)


# ------------------------------------------------------------------ %config and the shell's options

# Never carried: the application's section names this process's connection file and ports, and the
# history is each replica's own to write (a GPU cell's process keeps its records in memory).
_OWN_SECTIONS = frozenset({"IPKernelApp", "HistoryManager"})
_MISSING = object()
_trait_names: dict[str, tuple[str, ...]] = {}  # class -> its options' names at the kernel's start (_options)


def _config_value(value):
    """A %config value as plain data (dicts with string keys too), or raise ValueError."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("dict with non-string keys")
        return {k: _config_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_config_value(v) for v in value]
    return _plain(value)


def _config() -> dict | None:
    """The shell's configuration (what the kernel started with plus every ``%config``), as
    {section: {name: value}}; values that are not plain data are left out."""
    shell = _shell()
    if shell is None:
        return None
    out: dict = {}
    for section, entries in shell.config.items():
        if not (section[:1].isupper() and isinstance(entries, dict)) or section in _OWN_SECTIONS:
            continue
        for name, value in entries.items():
            try:
                out.setdefault(section, {})[name] = _config_value(value)
            except ValueError as exc:  # a lazy value (``.append(...)``) or an object
                _refuse(f"%config {section}.{name}", exc)
    return out


def _configurables(shell, first: bool = False):
    """(object, its class's name, its options' names) for the shell's objects whose options are
    carried: those the shell had at the kernel's start (``first``: the baseline being taken). One
    made later (Matplotlib's InlineBackend) has no start to differ from; %config's own path carries
    what cells set on it. The names are those the class had at the start: the class attribute
    ``InteractiveShell.ast_node_interactivity = "all"`` that many notebooks set hides the trait."""
    from traitlets.config import Application

    for obj in shell.configurables:
        cls = type(obj).__name__
        if cls in _OWN_SECTIONS or isinstance(obj, Application):
            continue
        names = _trait_names.get(cls)
        if names is None:
            if not first:
                continue
            names = _trait_names[cls] = tuple(sorted(type(obj).class_trait_names(config=True)))
        yield obj, cls, names


class _OptionsWatch:
    """Tells when a carried option of the shell's objects may have changed since it was last read,
    so that an unchanged process reads none of them (about 100 traits, a descriptor call each):
    traitlets reports every set to its observers. A class attribute that hides a trait
    (``InteractiveShell.ast_node_interactivity = "all"``) is looked for where it would be; while
    one does, nothing is taken as unchanged (a set then lands in the object's ``__dict__``, which
    nobody reports). Not seen: a list or dict option changed in place (``.append`` on it), as rare
    as it is odd."""

    def __init__(self) -> None:
        self.version = 0
        self.ids: tuple = ()  # of the shell's configurables when last looked at
        self.watched: weakref.WeakSet = weakref.WeakSet()
        # class -> (names, what its __dict__ holds for them unhidden: the trait where the class
        # defines it, None where the class is a subclass of the one that does)
        self.classes: dict[type, tuple[tuple[str, ...], tuple]] = {}

    def _changed(self, change) -> None:
        self.version += 1

    def _learn(self, kind: type, names) -> None:
        from traitlets import TraitType

        wanted: dict[type, dict[str, object]] = {}
        for name in names:
            for klass in kind.__mro__:
                found = klass.__dict__.get(name)
                if isinstance(found, TraitType):
                    wanted.setdefault(klass, {})[name] = found
                    break
                wanted.setdefault(klass, {})[name] = None  # (a hiding attribute, if any: not the usual state)
        for klass, entries in wanted.items():
            have = dict(zip(*self.classes[klass], strict=True)) if klass in self.classes else {}
            have.update(entries)
            self.classes[klass] = (tuple(have), tuple(have.values()))

    def token(self, shell) -> tuple | None:
        """Equal to an earlier token exactly when no carried option can have changed in between;
        None when that cannot be told (a class attribute hides a trait)."""
        ids = tuple(map(id, shell.configurables))
        if ids != self.ids:
            self.ids = ids
            for obj, _, names in _configurables(shell):
                if obj not in self.watched:
                    self.watched.add(obj)
                    obj.observe(self._changed, names=list(names))
                    self._learn(type(obj), names)
        for klass, (names, unhidden) in self.classes.items():
            if tuple(map(klass.__dict__.get, names)) != unhidden:
                return None
        return self.version, ids


_watch = _OptionsWatch()
_options_read: tuple | None = None  # (token, what _option_changes found then)
_options_applied: tuple | None = None  # (the options wanted, token once set): see _apply_options


def _options() -> dict | None:
    """The options of the shell's objects at the kernel's start, {class: {name: value}}, plain
    values only (the baseline of :func:`_option_changes`)."""
    shell = _shell()
    if shell is None:
        return None
    out: dict = {}
    for obj, cls, names in _configurables(shell, first=True):
        entries = out.setdefault(cls, {})
        for name in names:
            try:
                entries[name] = _config_value(getattr(obj, name))
            except Exception:  # an object (a class, a callable): the process's own
                continue
    return out


def _option_changes() -> dict | None:
    """The options of the shell's objects that differ from the kernel's start: what ``%config`` set
    on them, and what a cell set directly (``get_ipython().ast_node_interactivity = "all"``)."""
    global _options_read
    shell = _shell()
    if shell is None or _baseline_options is None:
        return None
    token = _watch.token(shell)
    if token is not None and _options_read is not None and _options_read[0] == token:
        return _options_read[1]
    out: dict = {}
    for obj, cls, names in _configurables(shell):
        base = _baseline_options.get(cls, {})
        for name in names:
            try:
                value = getattr(obj, name)
                if value == base.get(name, _MISSING):  # most: compared as they are, not converted
                    continue
                value = _config_value(value)
            except Exception:  # an object: the process's own
                continue
            if value != base.get(name, _MISSING):
                out.setdefault(cls, {})[name] = value
    _options_read = (token, out or None)
    return out or None


def _config_changes() -> dict | None:
    """The entries of the shell's configuration that differ from the kernel's start: what
    ``%config`` set."""
    base = _baseline_config or {}
    changed = {section: {name: value for name, value in entries.items()
                         if base.get(section, {}).get(name, _MISSING) != value}
               for section, entries in sorted((_config() or {}).items())}
    return {section: entries for section, entries in changed.items() if entries} or None


# Completion answered by a GPU kernel's replica must not run the notebook's code: with these,
# IPython evaluates what is typed (``x.cuda().<Tab>`` calls ``x.cuda()``), which would give the
# replica a CUDA context that every process forked from it then lacks.
_EVALUATING_COMPLETION = frozenset({"greedy", "evaluation"})


def _skipped_here(section: str, name: str) -> bool:
    return _defer_code and section.endswith("Completer") and name in _EVALUATING_COMPLETION


def _apply_config(wanted: dict) -> None:
    """Make the shell's configuration what ``wanted`` says (entries of the kernel's start that it
    no longer lists go back to their start values) as ``%config`` does: every configurable of the
    shell takes the entries meant for its class, and the shell's config keeps them for those made
    later (Matplotlib's InlineBackend)."""
    from traitlets.config import Config

    shell = _shell()
    if shell is None:
        return
    base, now = _baseline_config or {}, _config() or {}
    target: dict = {}
    for section, entries in now.items():  # changed here (by this replica's own cells, too) and not wanted
        for name, value in entries.items():
            start = base.get(section, {}).get(name, _MISSING)
            if start is not _MISSING and value != start and name not in (wanted.get(section) or {}):
                target.setdefault(section, {})[name] = start
    for section, entries in wanted.items():
        if isinstance(entries, dict) and section not in _OWN_SECTIONS:
            target.setdefault(section, {}).update(entries)
    cfg = Config({section: {name: value for name, value in entries.items()
                            if now.get(section, {}).get(name, _MISSING) != value and not _skipped_here(section, name)}
                  for section, entries in target.items()})
    if not any(cfg.values()):
        return
    for configurable in shell.configurables:  # as IPython's %config magic
        if configurable.__class__.class_traits(config=True):
            try:
                configurable.update_config(cfg)
            except Exception as exc:  # a value this IPython's trait refuses
                _refuse(f"%config for {type(configurable).__name__}", exc)
    shell.config.merge(cfg)


def _apply_options(wanted: dict) -> None:
    """Make every carried option of the shell's objects what ``wanted`` says, or its value at the
    kernel's start where ``wanted`` does not list it (after %config's path: this decides)."""
    global _options_applied
    shell = _shell()
    if shell is None or _baseline_options is None:
        return
    token = _watch.token(shell)
    if token is not None and _options_applied is not None and _options_applied == (wanted, token):
        return  # set as wanted already, and nothing changed since
    for obj, cls, names in _configurables(shell):
        start, want = _baseline_options.get(cls, {}), wanted.get(cls) or {}
        for name in names:
            value = want.get(name, start.get(name, _MISSING))
            if value is _MISSING or _skipped_here(cls, name):
                continue
            try:
                if _config_value(getattr(obj, name, _MISSING)) != value:
                    setattr(obj, name, value)
            except Exception as exc:  # an option this IPython lacks or validates otherwise
                _refuse(f"{cls}.{name}", exc)
    _options_applied = (wanted, _watch.token(shell))


# ------------------------------------------------------------------ the module search path

def _path_change(base: list[str], path: list[str]) -> list:
    """``path`` as [entries before this replica's own, entries after], when a cell only added
    around it (``sys.path.insert(0, ...)``, ``.append(...)``: each replica keeps its own entries,
    which differ from server to server); else ["marked", len(base), entries], each entry of
    ``base`` named by its index (``sys.path.insert(1, ...)``, ``sys.path.remove(...)``)."""
    n = len(base)
    for at in range(len(path) - n + 1):
        if path[at:at + n] == base:
            return [path[:at], path[at + n:]]
    unused: dict[str, list[int]] = {}  # each entry's indices in base (an entry may appear twice)
    for i in reversed(range(n)):
        unused.setdefault(base[i], []).append(i)
    return ["marked", n, [unused[e].pop() if unused.get(e) else e for e in path]]


def _marked_path(n: int, entries: list) -> list[str]:
    """A "marked" path on this replica: its own entries where the cell kept the other replica's.
    Start paths of another length (another install) cannot be matched entry by entry: this
    replica's own path then stands where the first one was."""
    own = _baseline_path or []
    if len(own) == n:
        return [own[e] if isinstance(e, int) else e for e in entries]
    out: list[str] = []
    for e in entries:
        if not isinstance(e, int):
            out.append(e)
        elif not any(isinstance(x, int) for x in entries[:entries.index(e)]):
            out.extend(own)
    return out


def _apply_path(wanted: list) -> None:
    if wanted[0] == "whole":  # from a replica before "marked" paths
        path = list(wanted[1])
    elif wanted[0] == "marked":
        path = _marked_path(wanted[1], wanted[2])
    else:
        path = [*wanted[0], *(_baseline_path or ()), *wanted[1]]
    if sys.path != path:
        sys.path[:] = path
        importlib.invalidate_caches()


# ------------------------------------------------------------------ warnings filters

def _category_name(category: type) -> str:
    return f"{category.__module__}:{category.__qualname__}"


def _category(name: str) -> type:
    module, _, qualname = name.partition(":")
    obj = sys.modules.get(module)
    if obj is None:
        if _defer_code:
            raise _Deferred(module)
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Warning)):
        raise TypeError(f"{name} is not a Warning class")
    return obj


class _Deferred(Exception):
    """A setting this process leaves to the next cell's process (defer_code)."""


def _filters() -> list:
    return [[action, getattr(message, "pattern", message or ""), _category_name(category),
             getattr(module, "pattern", module or ""), lineno]
            for action, message, category, module, lineno in warnings.filters]


def _apply_filters(wanted: list) -> None:
    if _filters() == wanted:
        return
    rebuilt = []
    for action, message, category, module, lineno in wanted:
        try:
            # as warnings.filterwarnings builds an entry (the message's pattern ignores case)
            rebuilt.append((action, re.compile(message, re.I) if message else None, _category(category),
                            re.compile(module) if module else None, lineno))
        except _Deferred:
            _deferred["warnings"] = wanted  # the whole list, in its order, in the cell's process
        except Exception as exc:  # a category of a module this server lacks
            _refuse(f"warnings filter for {category}", exc)
    warnings.filters[:] = rebuilt
    warnings._filters_mutated()  # type: ignore[attr-defined]  # (what filterwarnings calls: caches reset)


# ------------------------------------------------------------------ logging

_STYLE_OF = {style: key for key, (style, _) in logging._STYLES.items()}  # type: ignore[attr-defined]


def _describe(handler: logging.Handler) -> list | None:
    """A root handler as basicConfig makes it (to the notebook's stdout or stderr), as plain data;
    None for any other handler (it stays the process's own)."""
    if type(handler) is not logging.StreamHandler:
        return None
    stream = "stderr" if handler.stream is sys.stderr else "stdout" if handler.stream is sys.stdout else None
    if stream is None:
        return None
    f = handler.formatter
    if f is not None and type(f) is not logging.Formatter:
        return None  # rebuilt as a plain Formatter, a subclass's fields would be missing
    return [stream, handler.level, f._fmt if f else None, f.datefmt if f else None,
            _STYLE_OF.get(type(f._style), "%") if f else "%"]


OWN_LOGGERS = ("gpuhub", "pysyncobj")
"""The loggers of the replica's own machinery, gpuhub's and its Raft library's: each replica's."""


_LEVELS_READ = object()  # a key of the root logger's level cache, see _logger_levels
_levels_read: tuple | None = None  # (how many loggers there were, their levels)


def _logger_levels() -> dict[str, int]:
    """The levels set on named loggers (``logging.getLogger("transformers").setLevel(logging.ERROR)``,
    what ``transformers.logging.set_verbosity_error()`` does), the replica's own excepted. Read
    again only when a level may have changed: ``Logger.setLevel`` clears every logger's level
    cache, the root's too, and so the mark this leaves there (a level assigned to ``.level``
    directly is not seen until then)."""
    global _levels_read
    loggers = logging.Logger.manager.loggerDict
    cache = getattr(logging.root, "_cache", None)
    if _levels_read is not None and _levels_read[0] == len(loggers) and isinstance(cache, dict) \
            and _LEVELS_READ in cache:
        return _levels_read[1]
    if isinstance(cache, dict):
        cache[_LEVELS_READ] = True  # before the read: a setLevel during it clears the mark
    levels = {name: logger.level for name, logger in list(loggers.items())
              if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET
              and not any(name == own or name.startswith(own + ".") for own in OWN_LOGGERS)}
    _levels_read = (len(loggers), levels)
    return levels


def _logging() -> dict:
    """The root logger's level and handlers to the notebook, and the named loggers whose level
    differs from the kernel's start (a library's own, set as it was imported, included)."""
    root = logging.getLogger()
    out = {"level": root.level,
           "handlers": [d for h in root.handlers if (d := _describe(h)) is not None]}
    base, now = _baseline_levels or {}, _logger_levels()
    levels = sorted([name, now.get(name, logging.NOTSET)] for name in now.keys() | base.keys()
                    if now.get(name, logging.NOTSET) != base.get(name, logging.NOTSET))
    if levels:
        out["levels"] = levels
    return out


def _apply_logging(wanted: dict) -> None:
    now = _logging()
    if now == wanted:
        return
    root = logging.getLogger()
    if wanted.get("handlers") != now["handlers"] or wanted.get("level") != root.level:
        for handler in [h for h in root.handlers if _describe(h) is not None]:
            root.removeHandler(handler)
        for stream, level, fmt, datefmt, style in wanted["handlers"]:
            handler = logging.StreamHandler(getattr(sys, stream))
            handler.setLevel(level)
            if fmt is not None or datefmt is not None:
                handler.setFormatter(logging.Formatter(fmt, datefmt, style))
            root.addHandler(handler)
        root.setLevel(wanted["level"])
    # every named logger as wanted, or as at the kernel's start (this replica's own cells may have
    # set one that a later cell elsewhere set back)
    base, levels = _baseline_levels or {}, dict(wanted.get("levels") or ())
    for name in (_logger_levels().keys() | base.keys()) - levels.keys():
        levels[name] = base.get(name, logging.NOTSET)
    for name, level in levels.items():
        logger = logging.getLogger(name)
        if logger.level != level:
            logger.setLevel(level)


# ------------------------------------------------------------------ NumPy, pandas, Matplotlib

def _capture_numpy() -> dict | None:
    np = sys.modules.get("numpy")
    if np is None:
        return None
    out = {}
    for k, v in sorted(np.get_printoptions().items()):
        try:
            out[k] = _plain(v)
        except ValueError:
            pass  # a formatter's functions: not carried
    return out


def _apply_numpy(wanted: dict) -> None:
    import numpy as np
    current = np.get_printoptions()
    changed = {k: v for k, v in wanted.items() if current.get(k) != v}
    if changed:
        np.set_printoptions(**changed)


def _capture_numpy_errors() -> dict | None:
    """How NumPy treats floating-point errors (``np.seterr(divide="ignore")``, or "raise"): a
    separate entry, which a replica of an earlier gpuhub skips."""
    np = sys.modules.get("numpy")
    return None if np is None else dict(sorted(np.geterr().items()))


def _apply_numpy_errors(wanted: dict) -> None:
    import numpy as np
    if np.geterr() != wanted:
        np.seterr(**wanted)


def _pandas_options():
    """pandas' registered options and their current values (pandas keeps no public list of them)."""
    from pandas._config import config
    for key, option in config._registered_options.items():
        if key in config._deprecated_options:
            continue
        node = config._global_config
        for part in key.split("."):
            node = node[part]
        yield key, option.defval, node


def _capture_pandas() -> dict | None:
    if "pandas" not in sys.modules:
        return None
    out = {}
    try:
        for key, default, value in _pandas_options():
            if value != default:
                try:
                    out[key] = _plain(value)
                except ValueError:
                    pass
    except Exception as exc:  # another pandas than the one this was written against
        _refuse("pandas options", exc)
        return None
    return dict(sorted(out.items()))


def _apply_pandas(wanted: dict) -> None:
    import pandas as pd
    for key, default, value in list(_pandas_options()):
        target = wanted.get(key, default)
        if value != target and (key in wanted or value != default):
            try:
                pd.set_option(key, target)
            except Exception as exc:
                _refuse(f"pandas option {key}", exc)


_RC_SKIPPED = frozenset({"backend", "backend_fallback", "interactive"})  # each process's own


def _rc_value(key: str, value):
    if key == "axes.prop_cycle":
        return repr(value)  # a Cycler: rcParams takes back its repr
    return _plain(value)


def _capture_matplotlib() -> dict | None:
    mpl = sys.modules.get("matplotlib")
    if mpl is None or not hasattr(mpl, "rcParamsDefault"):
        return None
    defaults, out = mpl.rcParamsDefault, {}
    for key, value in dict.items(mpl.rcParams):
        if key in _RC_SKIPPED or dict.get(defaults, key) == value:
            continue
        try:
            out[key] = _rc_value(key, value)
        except ValueError:
            pass
    return dict(sorted(out.items()))


def _apply_matplotlib(wanted: dict) -> None:
    import matplotlib as mpl
    defaults = mpl.rcParamsDefault
    for key, value in dict.items(mpl.rcParams):
        if key in _RC_SKIPPED:
            continue
        if key in wanted:
            try:
                same = _rc_value(key, value) == wanted[key]
            except ValueError:
                same = False
            if not same:
                try:
                    mpl.rcParams[key] = wanted[key]
                except Exception as exc:
                    _refuse(f"rcParams[{key!r}]", exc)
        elif dict.get(defaults, key) != value:
            mpl.rcParams[key] = dict.get(defaults, key)


# ------------------------------------------------------------------ PyTorch

def _torch_switches(torch) -> dict:
    opts = torch._tensor_str.PRINT_OPTS
    return {"default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "print": [opts.precision, opts.threshold, opts.edgeitems, opts.linewidth, opts.sci_mode],
            "deterministic": [torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()],
            "cudnn": [torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                      torch.backends.cudnn.enabled, torch.backends.cudnn.allow_tf32],
            "matmul": [torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32],
            "grad": torch.is_grad_enabled()}  # torch.set_grad_enabled(False), as inference notebooks do


def _capture_torch() -> dict | None:
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_default_dtype"):
        return None  # not imported, or still being imported
    return _torch_switches(torch)


def _apply_torch(wanted: dict) -> None:
    """Only flags: none of these makes a CUDA context (the replica never has one; a cell's process
    forked from it inherits them)."""
    import torch
    now = _torch_switches(torch)
    if now == wanted:
        return
    if now["default_dtype"] != wanted["default_dtype"]:
        torch.set_default_dtype(getattr(torch, wanted["default_dtype"]))
    if now["print"] != wanted["print"]:
        precision, threshold, edgeitems, linewidth, sci_mode = wanted["print"]
        torch.set_printoptions(precision=precision, threshold=threshold, edgeitems=edgeitems,
                               linewidth=linewidth, sci_mode=sci_mode)
    if now["deterministic"] != wanted["deterministic"]:
        torch.use_deterministic_algorithms(wanted["deterministic"][0], warn_only=wanted["deterministic"][1])
    cudnn = torch.backends.cudnn
    cudnn.benchmark, cudnn.deterministic, cudnn.enabled, cudnn.allow_tf32 = wanted["cudnn"]
    if now["matmul"] != wanted["matmul"]:
        torch.set_float32_matmul_precision(wanted["matmul"][0])
        torch.backends.cuda.matmul.allow_tf32 = wanted["matmul"][1]
    if wanted.get("grad", True) != now["grad"]:  # an image of an earlier gpuhub: the default
        torch.set_grad_enabled(wanted.get("grad", True))


# ------------------------------------------------------------------ the whole

def capture() -> dict:
    """This process's settings, as plain data in a stable order. Only what a cell can have changed:
    a library that was never imported has nothing here."""
    out: dict = {}
    try:
        out.update(_capture_ipython())
    except Exception as exc:  # an IPython whose internals moved: the rest still goes
        _refuse("IPython extensions", exc)
    for name, take, baseline in (("warnings", _filters, _baseline_filters), ("logging", _logging, _baseline_logging)):
        try:
            value = take()
        except Exception as exc:  # a filter or handler a cell built by hand, not as the library does
            _refuse(f"{name} settings", exc)
            continue
        if value != baseline:
            out[name] = value
    if _baseline_path is not None and sys.path != _baseline_path:
        out["path"] = _path_change(_baseline_path, [p for p in sys.path if isinstance(p, str)])
    if _baseline_recursion is not None and sys.getrecursionlimit() != _baseline_recursion:
        out["recursion_limit"] = sys.getrecursionlimit()  # sys.setrecursionlimit(5000)
    for name, changes in (("config", _config_changes), ("options", _option_changes)):
        try:
            value = changes()
        except Exception as exc:  # a shell whose config is not a traitlets Config
            _refuse(f"IPython {name}", exc)
            continue
        if value is not None:
            out[name] = value
    for name, take in (("numpy", _capture_numpy), ("numpy_errors", _capture_numpy_errors), ("pandas", _capture_pandas),
                       ("matplotlib", _capture_matplotlib), ("torch", _capture_torch)):
        try:
            value = take()
        except Exception as exc:
            _refuse(f"{name} settings", exc)
            continue
        if value is not None:
            out[name] = value
    return out


def apply(state: dict) -> None:
    """Take on ``state`` (from :func:`capture`, maybe in another process). Never raises: a setting
    that cannot be taken here is logged once. What taking them prints or warns (an extension
    loading, a library imported for its options) never reaches the notebook."""
    global _last
    if not isinstance(state, dict):
        return
    _last = state
    _deferred.clear()  # what the last state left undone: this one says anew
    # Not in silenced(): its catch_warnings() would put the filters back on the way out, and a
    # handler made there would write to its sink instead of sys.stderr.
    _step("warnings", _apply_filters, state.get("warnings", _baseline_filters))
    _step("logging", _apply_logging, state.get("logging", _baseline_logging))
    _step("path", _apply_path, state.get("path", [[], []] if _baseline_path is not None else None))
    _step("recursion limit", sys.setrecursionlimit, state.get("recursion_limit", _baseline_recursion))
    with silenced():
        _step("IPython", _apply_ipython, state)
        _step("%config", _apply_config, state.get("config", {}))
        _step("IPython options", _apply_options, state.get("options", {}))
        _step("numpy", _apply_numpy, state.get("numpy"))
        _step("numpy errors", _apply_numpy_errors, state.get("numpy_errors"))
        _step("pandas", _apply_pandas, state.get("pandas"))
        _step("matplotlib", _apply_matplotlib, state.get("matplotlib"))
        _step("torch", _apply_torch, state.get("torch"))


def reapply() -> None:
    """Take the last state on again, in this thread's context: NumPy's print options live in a
    context variable, so a state taken on in another thread (a replica catching up as it starts)
    is not seen by the cells."""
    if _last is not None:
        apply(_last)


def _step(name: str, step, wanted) -> None:
    if wanted is None:
        return
    try:
        step(wanted)
    except Exception as exc:
        _refuse(f"{name} settings", exc)
