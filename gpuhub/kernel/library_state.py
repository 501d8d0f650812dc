"""Reductions for library objects whose own pickling changes them (docs/architecture.md D4).

Pickling a matplotlib ``CallbackRegistry`` (every figure, axes and artist holds some) calls
``next()`` on its callback-id counter: each capture moved the live registry on, and two captures
of an unchanged namespace holding a figure gave two different streams, so the image was committed
and pushed to both followers again after every cell, and the notebook's own next callback id was
not the one a plain kernel gives. :func:`reduce_callback_registry` pickles the same state and
leaves the counter where it was.
"""

from __future__ import annotations

import copyreg
import itertools
import sys


def reduce_callback_registry(obj):
    """A pickle reduction for a matplotlib ``CallbackRegistry`` that leaves it as it was, or None
    for anything else (and for a matplotlib whose registry this does not know: pickled as usual)."""
    cbook = sys.modules.get("matplotlib.cbook")
    if cbook is None or type(obj) is not getattr(cbook, "CallbackRegistry", None):
        return None
    counter = getattr(obj, "_cid_gen", None)
    if type(counter) is not itertools.count:
        return None
    following = next(counter)  # the id the registry would give next ...
    obj._cid_gen = itertools.count(following)
    try:
        state = obj.__getstate__()  # ... which its __getstate__ takes from the counter
    finally:
        obj._cid_gen = itertools.count(following)  # ... and still gives next
    return copyreg.__newobj__, (type(obj),), state
