"""Completion in a replicated kernel whose user's jedi cache holds truncated files (left by a replica
killed while writing one, or half-written by another replica when they were read):
gpuhub/kernel/jedi_cache.py. A plain ipykernel answers no completion at all then."""

from __future__ import annotations

from pathlib import Path

import jedi

from gpuhub.dev.cluster import DevCluster, DevKernel


def _poisoned_cache(cache_home: Path) -> int:
    """Completion's cache for a fresh kernel, as jedi writes it, each file then cut in half."""
    jedi_dir = cache_home / "jedi"
    old = jedi.settings.cache_directory
    jedi.settings.cache_directory = str(jedi_dir)
    try:
        assert "zip" in {c.name for c in jedi.Interpreter("zi", [{}]).complete()}
    finally:
        jedi.settings.cache_directory = old
    files = list(jedi_dir.rglob("*.pkl"))
    for f in files:
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    return len(files)


def test_a_kernel_completes_despite_truncated_cache_files(tmp_path, monkeypatch):
    cache_home = tmp_path / "cache"
    assert _poisoned_cache(cache_home) > 0
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))  # the agents' units, so the replicas'
    cluster = DevCluster(tmp_path / "cluster", nodes=3, gpus_per_node=1).start()
    try:
        kernel = DevKernel(cluster, gpus=0)
        try:
            reply = kernel.kc.complete("zi", reply=True, timeout=60)
            assert "zip" in reply["content"]["matches"], reply["content"]
        finally:
            kernel.close()
    finally:
        cluster.stop()
