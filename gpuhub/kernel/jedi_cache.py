"""Completion's parse cache, made safe for replicas.

IPython completes with jedi, which keeps the parsed type stubs of the standard library (and of
every module a completion looks into) in parso's cache on disk, ``$XDG_CACHE_HOME/jedi``. parso
writes each cache file in place and reads it back without a second thought, so:

- a replica killed while it writes one (a failover, the OOM killer, a drain) leaves it truncated;
- the three replicas of a kernel complete every request together, and with a shared home (NFS,
  or a single server) they write the same files at once, each reading the others' half-written
  ones.

Either way jedi fails on the file ("jedi has crashed"), and completion answers nothing in every
later kernel of that user until someone deletes the file. Here each file is written whole under a
temporary name and renamed into place, and a file that cannot be read is parsed again (and so
written again) instead of failing completion.

parso is pinned (requirements/runtime.txt); the two functions replaced here are its own names for
reading and writing one cache file (parso/cache.py), checked at start.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile

log = logging.getLogger(__name__)


def make_completion_cache_safe() -> bool:
    """Replace parso's cache file reader and writer with safe ones (idempotent). False if parso is
    missing or no longer has the functions this relies on (then it is left as it is, and logged)."""
    try:
        import parso
        from parso import cache
    except ImportError:
        return False
    if getattr(cache, "_gpuhub_safe", False):
        return True
    load, hashed_path = getattr(cache, "_load_from_file_system", None), getattr(cache, "_get_hashed_path", None)
    if not (callable(load) and callable(hashed_path) and callable(getattr(cache, "_save_to_file_system", None))):
        log.warning("parso %s has no _load_from_file_system/_save_to_file_system/_get_hashed_path: its "
                    "cache files are left unprotected", getattr(parso, "__version__", "?"))
        return False

    def load_or_none(hashed_grammar, path, p_time, cache_path=None):
        try:
            return load(hashed_grammar, path, p_time, cache_path=cache_path)
        except Exception as e:  # a truncated or foreign pickle: parse the module again instead
            log.info("unreadable completion cache file for %s (%s: %s): parsed again", path, type(e).__name__, e)
            return None

    def save_whole(hashed_grammar, path, item, cache_path=None):
        target = hashed_path(hashed_grammar, path, cache_path=cache_path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".gpuhub-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(item, f, pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, target)  # readers see the old file or the new one, never a part
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    cache._load_from_file_system = load_or_none
    cache._save_to_file_system = save_whole
    cache._gpuhub_safe = True
    return True
