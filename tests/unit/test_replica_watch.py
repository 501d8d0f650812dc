"""How a replica waits for another to run a cell (Replica._watch): it returns the cell's outcome
once committed, and aborts the cell when the runner is lost: its server stopped answering, or it
left the group. The second was found by the 20-user load benchmark (bench/load_bench.py): a
migration moved away the replica just elected to run a waiting cell, and the other replicas,
no longer finding it among their peers, waited for its result for good."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from gpuhub.kernel.replica import Peer, Replica

LOST_S = 0.2


class Watcher(SimpleNamespace):
    """What _watch uses of a replica: its log's outcomes, its peers (current and departed), its
    settings and its abort (recorded here, where a real replica commits it)."""

    _wait = Replica._wait
    _watch = Replica._watch

    def __init__(self, peers: dict[int, Peer], departed: dict[int, Peer] | None = None) -> None:
        super().__init__(state=SimpleNamespace(changed=threading.Condition(), outcomes={}), peers=peers,
                         departed=departed or {}, settings=SimpleNamespace(executor_lost_s=LOST_S), aborted=[])

    def abort(self, cell, attempt, reason, detail, execution_count):
        self.aborted.append((reason, detail))
        return f"aborted: {reason}"

    def wait_for_end(self, cell: str, runner: int) -> object:
        return self._watch(cell, runner, 1, lambda: cell in self.state.outcomes, "running this cell")


@pytest.fixture
def live(monkeypatch) -> set[str]:
    """The blob addresses that answer (replica.reachable's probe, without sockets)."""
    answering: set[str] = set()
    monkeypatch.setattr("gpuhub.kernel.replica.reachable", lambda addr, timeout_s=0.5: addr in answering)
    return answering


def peer(i: int, blob: str, node: str) -> Peer:
    return Peer(id=i, raft=f"127.0.0.1:{20000 + i}", blob=blob, node=node)


def test_a_member_that_answers_is_waited_for_until_its_outcome_commits(live):
    live.update({"gpu1:1", "gpu2:1"})
    w = Watcher({0: peer(0, "gpu1:1", "gpu1"), 1: peer(1, "gpu2:1", "gpu2")})

    def commit_later():
        with w.state.changed:
            w.state.outcomes["c"] = "ended"
            w.state.changed.notify_all()

    threading.Timer(3 * LOST_S, commit_later).start()  # longer than executor_lost_s: still waited for
    assert w.wait_for_end("c", 1) == "ended" and w.aborted == []


def test_a_member_that_stops_answering_is_lost(live):
    live.add("gpu1:1")
    w = Watcher({0: peer(0, "gpu1:1", "gpu1"), 1: peer(1, "gpu2:1", "gpu2")})
    assert w.wait_for_end("c", 1) == "aborted: executor-lost"
    assert w.aborted == [("executor-lost", "the replica running this cell (on gpu2) stopped")]


def test_a_runner_that_left_the_group_is_lost_even_while_it_answers(live):
    live.update({"gpu1:1", "gpu2:1", "gpu4:1"})
    moved = peer(1, "gpu4:1", "gpu4")
    w = Watcher({0: peer(0, "gpu1:1", "gpu1"), 3: peer(3, "gpu2:1", "gpu2")}, departed={1: moved})
    assert w.wait_for_end("c", 1) == "aborted: executor-lost"
    (reason, detail), = w.aborted
    assert reason == "executor-lost"
    assert "(on gpu4) left this kernel's group (it was moved to another server)" in detail


def test_a_runner_this_replica_never_knew_is_lost(live):
    # The replica that joined in a migration never had the moved one among its peers.
    live.update({"gpu1:1", "gpu2:1"})
    w = Watcher({0: peer(0, "gpu1:1", "gpu1"), 3: peer(3, "gpu2:1", "gpu2")})
    assert w.wait_for_end("c", 1) == "aborted: executor-lost"
    assert "left this kernel's group" in w.aborted[0][1]


def test_reload_peers_remembers_who_left(tmp_path):
    import json

    path = tmp_path / "peers.json"
    r = SimpleNamespace(id=0, peers={0: peer(0, "a:1", "gpu1"), 1: peer(1, "a:2", "gpu4")}, departed={},
                        _peers_file=str(path), _peers_mtime=0)
    path.write_text(json.dumps({"replicas": [{"id": 0, "raft": "127.0.0.1:20000", "blob": "a:1", "node": "gpu1"},
                                             {"id": 3, "raft": "127.0.0.1:20003", "blob": "a:3", "node": "gpu2"}]}))
    assert Replica.reload_peers(r)
    assert sorted(r.peers) == [0, 3] and sorted(r.departed) == [1] and r.departed[1].node == "gpu4"
