"""Completion's parse cache (gpuhub/kernel/jedi_cache.py): a cache file left truncated, by a replica
killed while it wrote it or read while another replica wrote it, no longer breaks completion."""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path

import parso
import pytest
from parso import cache

from gpuhub.kernel.jedi_cache import make_completion_cache_safe

MODULE = "def trained(model):\n    return model\n" * 200


@pytest.fixture
def parso_cache(monkeypatch, tmp_path):
    """parso's own reader and writer, restored after the test; a cache directory of the test's own;
    the module to parse and cache, and its cache file's path."""
    for name in ("_load_from_file_system", "_save_to_file_system"):
        monkeypatch.setattr(cache, name, getattr(cache, name))
    monkeypatch.setattr(cache, "_gpuhub_safe", False, raising=False)
    source = tmp_path / "notebook_helpers.py"
    source.write_text(MODULE)
    grammar = parso.load_grammar()
    cache_dir = tmp_path / "cache"
    path = cache._get_hashed_path(grammar._hashed, source, cache_path=cache_dir)
    return grammar, source, cache_dir, path


def _parse(grammar, source, cache_dir):
    cache.parser_cache.clear()  # from the disk, as a new kernel would
    return grammar.parse(path=source, cache=True, cache_path=cache_dir)


def _truncate(path: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])


def test_parsos_own_reader_fails_on_a_truncated_cache_file(parso_cache):
    """The defect, on parso as pinned: what jedi hits in a kernel (and then answers no completion)."""
    grammar, source, cache_dir, path = parso_cache
    _parse(grammar, source, cache_dir)
    _truncate(path)
    with pytest.raises((EOFError, pickle.UnpicklingError)):
        _parse(grammar, source, cache_dir)


def test_a_truncated_cache_file_is_parsed_again_and_written_whole(parso_cache):
    grammar, source, cache_dir, path = parso_cache
    assert make_completion_cache_safe()
    _parse(grammar, source, cache_dir)
    _truncate(path)
    module = _parse(grammar, source, cache_dir)
    assert module.get_code() == MODULE
    with open(path, "rb") as f:
        assert pickle.load(f).node.get_code() == MODULE


def test_a_writer_killed_midway_leaves_the_cache_file_as_it_was(parso_cache):
    """A replica SIGKILLed while it writes a cache file: readers still find the old file whole."""
    grammar, source, cache_dir, path = parso_cache
    assert make_completion_cache_safe()
    _parse(grammar, source, cache_dir)
    before = Path(path).read_bytes()

    class KilledWhilePickled:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGKILL)

    pid = os.fork()
    if pid == 0:  # the writer: a megabyte written, then killed
        try:
            cache._save_to_file_system(grammar._hashed, source, [b"x" * (1 << 20), KilledWhilePickled()],
                                       cache_path=cache_dir)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert Path(path).read_bytes() == before
    assert _parse(grammar, source, cache_dir).get_code() == MODULE


def test_making_it_safe_twice_wraps_once(parso_cache):
    assert make_completion_cache_safe()
    load = cache._load_from_file_system
    assert make_completion_cache_safe()
    assert cache._load_from_file_system is load
