"""Notebook functions wrapped by :mod:`functools`, in the namespace image: rebuilt by value.

cloudpickle sends a function defined in the notebook by value (its code), but the wrappers
functools puts around one are other objects, which pickle does not send that way:

- ``@functools.lru_cache`` and ``@functools.cache`` make a C object that pickles *by name*
  (``__main__.fib``). Another replica, or a GPU cell's fresh process, looked that name up as it
  loaded the image, where it did not exist yet (or was the previous cell's function): the image
  could not be loaded, and the kernel's next cell failed. It is sent here as the wrapped function
  and the cache's parameters; the loaded one starts with an empty cache (a cache holds nothing a
  cell can tell apart except ``cache_info()``).
- ``@functools.cached_property`` in a notebook class holds a lock on Python 3.11, which does not
  pickle: the class and its instances could not be replicated. Sent as its function and name.
- ``@functools.singledispatch`` keeps a cache of weak references, which does not pickle. Sent as
  the function and the implementations registered for each type.

:func:`by_reference_to_the_notebook` guards the rest: any other object that would pickle by its
name in the notebook is refused at capture (the caller leaves it out of the image and warns), never
put in an image that cannot be loaded.
"""

from __future__ import annotations

import functools
import types

_LRU = type(functools.lru_cache(maxsize=None)(lambda: None))  # functools._lru_cache_wrapper
_SINGLEDISPATCH_CODE = functools.singledispatch(lambda: None).__code__  # every dispatcher's own code
_DISPATCHER_ATTRIBUTES = frozenset({"register", "dispatch", "registry", "_clear_cache", "__wrapped__"})


def _in_notebook(obj) -> bool:
    try:
        return getattr(obj, "__module__", None) == "__main__"
    except Exception:  # an object whose attribute lookup fails: not a wrapper of ours
        return False


def reduce_wrapper(obj):
    """A pickle reduction for a functools wrapper of a notebook function (None for anything else)."""
    kind = type(obj)
    if kind is _LRU and _in_notebook(obj):
        params = obj.cache_parameters()
        return _lru_cached, (obj.__wrapped__, params["maxsize"], params["typed"], _own_attributes(obj, {"__wrapped__"}))
    if kind is functools.cached_property:
        return _cached_property, (obj.func, obj.attrname, obj.__doc__)
    if kind is types.FunctionType and obj.__code__ is _SINGLEDISPATCH_CODE and _in_notebook(obj):
        registry = [(cls, impl) for cls, impl in obj.registry.items() if cls is not object]
        return _dispatcher, (obj.__wrapped__, registry, _own_attributes(obj, _DISPATCHER_ATTRIBUTES))
    return None


def _own_attributes(obj, skip) -> dict:
    """What was set on the wrapper beyond what functools sets again when it is rebuilt."""
    return {k: v for k, v in vars(obj).items() if k not in skip}


def _lru_cached(function, maxsize, typed: bool, attributes: dict):
    wrapper = functools.lru_cache(maxsize=maxsize, typed=typed)(function)
    vars(wrapper).update(attributes)
    return wrapper


def _cached_property(function, attrname: str | None, doc):
    prop = functools.cached_property(function)
    prop.attrname = attrname  # what __set_name__ set in the class that was pickled
    prop.__doc__ = doc
    return prop


def _dispatcher(function, registry: list, attributes: dict):
    dispatcher = functools.singledispatch(function)
    for cls, impl in registry:
        dispatcher.register(cls, impl)
    vars(dispatcher).update(attributes)
    return dispatcher


_MAY_BE_NAMED: dict[type, bool] = {}  # per type: may an instance pickle by a notebook name?


def by_reference_to_the_notebook(obj) -> str | None:
    """The notebook name ``obj`` would pickle by (another replica could not load it), else None.
    Asked only of what neither cloudpickle nor pickle reduces by value. Only instances that have a
    ``__dict__`` of their own can name the notebook as their module while their type does not
    (functools.update_wrapper copies a wrapped function's ``__module__`` there), so other types are
    never asked again (:data:`_MAY_BE_NAMED`); instances of notebook classes are not asked either
    (they pickle by value, a ``__reduce__`` returning a name aside: not seen in notebooks)."""
    kind = type(obj)
    may = _MAY_BE_NAMED.get(kind)
    if may is None:
        may = _MAY_BE_NAMED[kind] = (getattr(kind, "__dictoffset__", 0) != 0
                                     and getattr(kind, "__module__", None) != "__main__"
                                     and not isinstance(obj, type))
    if not may or not _in_notebook(obj):
        return None
    try:
        reduced = obj.__reduce_ex__(5)
    except Exception:
        return None  # the pickler raises its own error for it
    return reduced if isinstance(reduced, str) else None
