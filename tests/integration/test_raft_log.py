"""The kernel's Raft group over real pysyncobj on loopback: replication, recovery from the journal
and from peers, snapshots (log compaction), the password derived from the kernel's key, and
RaftUnavailable without a majority. Every group is destroyed (its thread joined) at teardown.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

import pytest

from gpuhub.dev.portblocks import PortBlock, reserve_block
from gpuhub.replication.log import ImageEntry, RaftGroup, RaftUnavailable, raft_password

KEY = b"kernel-connection-key"
WRONG_KEY = b"some-other-kernel-key"
FAST_RECONNECT_S = 0.3


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def stop(group: RaftGroup) -> None:
    """destroy() only asks pysyncobj's tick thread to stop: wait until it did (port and journal freed)."""
    group.destroy()
    assert wait_until(lambda: group.stopped, 10), "pysyncobj thread still alive"


@pytest.fixture
def make_group():
    """RaftGroup factory; every group made is destroyed at teardown, its thread joined."""
    made: list[RaftGroup] = []

    def make(addr: str, peers: list[str], key: bytes = KEY, journal_dir=None, members: int = 3) -> RaftGroup:
        # Test speed only: a peer that was not listening yet is retried every 0.5 s by default,
        # which only delays readiness; retry faster here.
        g = RaftGroup(addr, [p for p in peers if p != addr], key, str(journal_dir) if journal_dir else None,
                      members, connection_retry_s=FAST_RECONNECT_S)
        made.append(g)
        return g

    yield make
    for g in made:
        g.destroy()
    for g in made:
        wait_until(lambda g=g: g.stopped, 10)


_ports: PortBlock | None = None


def addrs(n: int) -> list[str]:
    """Addresses on ports of a block this test process holds, never handed out twice: a port
    from the OS (bound to 0 and closed) could be taken again before a Raft peer binds it."""
    global _ports
    if _ports is None:
        _ports = reserve_block()  # given back when the test process exits
    return [f"127.0.0.1:{port}" for port in _ports.take(n)]


def names_of(img: ImageEntry | None) -> dict[str, bytes]:
    return {k: v.encode() for k, v in json.loads(img.inline).items()} if img is not None else {}


def complete(group: RaftGroup, cell: str, executor: int, count: int, **names: str) -> bool:
    """Run ``cell`` on ``executor`` and end it with a stand-in namespace image: the group's names so
    far plus ``names``, as JSON in the inline stream (the log never looks inside an image)."""
    img = None
    if names:  # an executor has applied every earlier cell before it runs one (as the kernel does)
        assert wait_until(lambda: group.log.execution_count >= count - 1), "earlier cells not applied"
        merged = {k: v.decode() for k, v in names_of(group.log.image).items()} | names
        stream = json.dumps(merged, sort_keys=True).encode()
        img = ImageEntry(f"digest-{stream.hex()}", stream, len(stream), (), tuple(sorted(merged)))
    if not group.log.holds_lease(cell, executor):  # elected first (the lease holder needs no election)
        group.propose(cell, 0, executor, True, timeout_s=10)
    return group.complete(cell, 0, executor, "ok", img, count, timeout_s=10)


def state(group: RaftGroup) -> tuple:
    log = group.log
    return (names_of(log.image), log.execution_count, log.previous_executor, list(log.outcomes))


def test_password_is_derived_from_the_key():
    assert raft_password(KEY) == raft_password(KEY)
    assert raft_password(KEY) != raft_password(WRONG_KEY)
    assert KEY.decode() not in raft_password(KEY)


def test_three_replicas_agree_on_the_election_and_the_names(make_group):
    a = addrs(3)
    groups = [make_group(addr, a) for addr in a]
    assert all(g.wait_ready(10) for g in groups)
    assert wait_until(lambda: all(g.connected(p) for g in groups for p in a if p != g.address))

    groups[1].propose("c1", 0, 1, True, timeout_s=10)  # committed via whichever is leader
    groups[2].propose("c1", 0, 2, True, timeout_s=10)
    # propose() returns once the leader applied the entry; the followers apply it a moment later
    assert wait_until(lambda: all(len(getattr(g.log.elections.get(("c1", 0)), "proposals", ())) == 2
                                  for g in groups))
    assert all(g.log.elections[("c1", 0)].proposals == {1: True, 2: True} for g in groups)
    assert {g.log.elections[("c1", 0)].outcome for g in groups} == {1}  # no previous: the first LEAD

    assert complete(groups[1], "c1", 1, 1, x="1") is True
    assert complete(groups[0], "c1", 0, 1, x="lost") is False  # the first end of a cell wins
    assert wait_until(lambda: all(state(g) == ({"x": b"1"}, 1, 1, ["c1"]) for g in groups)), \
        [state(g) for g in groups]


def test_an_entry_larger_than_a_batch_reaches_every_member_whole_at_once(make_group, caplog):
    # pysyncobj 0.3.17 sends an entry of appendEntriesBatchSizeBytes or more in parts and marks the
    # wrong part as the last one: the followers' tick thread failed on a truncated pickle at every
    # such commit (a GPU kernel's image of 80 KB after a DataFrame cell) and took it on a later part.
    a = addrs(3)
    groups = [make_group(addr, a) for addr in a]
    assert all(g.wait_ready(10) for g in groups)
    assert wait_until(lambda: all(g.connected(p) for g in groups for p in a if p != g.address))
    stream = os.urandom(300 * 1024)  # bytes of every value: pickled, about 1.5 times as many
    img = ImageEntry("digest-big", stream, len(stream), (), ("big",))
    with caplog.at_level("ERROR", logger="pysyncobj"):
        groups[0].propose("c1", 0, 0, True, timeout_s=10)
        assert groups[0].complete("c1", 0, 0, "ok", img, 1, timeout_s=10)
        assert wait_until(lambda: all(g.log.image is not None and g.log.image.inline == stream for g in groups))
    assert "failed _onTick" not in caplog.text, caplog.text[:2000]


def journaled_groups(make_group, tmp_path):
    """Three members, each with its journal in its own directory, all ready."""
    a = addrs(3)
    dirs = [tmp_path / f"r{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    groups = [make_group(addr, a, journal_dir=d) for addr, d in zip(a, dirs, strict=True)]
    assert all(g.wait_ready(10) for g in groups)
    return a, dirs, groups


def test_a_replica_restarts_from_its_journal_and_catches_up_from_its_peers(make_group, tmp_path):
    a, dirs, groups = journaled_groups(make_group, tmp_path)
    assert complete(groups[0], "c1", 0, 1, x="1") is True
    assert wait_until(lambda: all(state(g) == ({"x": b"1"}, 1, 0, ["c1"]) for g in groups))

    stop(groups[2])
    assert complete(groups[0], "c2", 0, 2, y="2") is True  # two of three: still a majority
    assert complete(groups[1], "c3", 1, 3, x="3") is True
    expected = ({"x": b"3", "y": b"2"}, 3, 1, ["c1", "c2", "c3"])
    assert wait_until(lambda: state(groups[0]) == state(groups[1]) == expected)
    assert state(groups[2]) == ({"x": b"1"}, 1, 0, ["c1"])  # stopped: missed c2 and c3

    again = make_group(a[2], a, journal_dir=dirs[2])
    assert again.wait_ready(10)
    assert wait_until(lambda: state(again) == expected), state(again)

    # the whole group down, then up again: everything comes back from the journals
    for g in (groups[0], groups[1], again):
        stop(g)
    revived = [make_group(addr, a, journal_dir=d) for addr, d in zip(a, dirs, strict=False)]
    assert all(g.wait_ready(10) for g in revived)
    assert wait_until(lambda: all(state(g) == expected for g in revived)), [state(g) for g in revived]
    assert complete(revived[2], "c4", 2, 4, z="4") is True  # and it goes on
    assert wait_until(lambda: all(state(g)[1] == 4 for g in revived))


def test_a_snapshot_rebuilds_a_replica_that_lost_its_journal(make_group, tmp_path):
    """Log compaction serializes KernelLog (pysyncobj forks to write raft.dump); a replica whose
    journal is gone gets that snapshot from the leader, not the compacted-away entries."""
    a = addrs(3)
    dirs = [tmp_path / f"r{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    groups = [make_group(addr, a, journal_dir=d) for addr, d in zip(a, dirs, strict=False)]
    for g in groups:
        g.log.on_apply = lambda kind, cell: None  # unpicklable: must stay out of the snapshot
    assert all(g.wait_ready(10) for g in groups)
    for i in range(3):
        assert complete(groups[i], f"c{i}", i, i + 1, **{f"v{i}": str(i)}) is True
    expected = ({"v0": b"0", "v1": b"1", "v2": b"2"}, 3, 2, ["c0", "c1", "c2"])
    assert wait_until(lambda: all(state(g) == expected for g in groups))
    for g in groups:
        g.compact_log()
    assert wait_until(lambda: all((d / "raft.dump").exists() for d in dirs)), list(dirs[0].iterdir())
    assert wait_until(lambda: all(g.log_length <= 2 for g in groups))

    stop(groups[2])
    for f in dirs[2].iterdir():
        f.unlink()  # a new host for replica 2: no journal, no dump
    assert complete(groups[0], "c3", 0, 4, v3="3") is True
    again = make_group(a[2], a, journal_dir=dirs[2])
    assert again.wait_ready(10)
    final = ({"v0": b"0", "v1": b"1", "v2": b"2", "v3": b"3"}, 4, 0, ["c0", "c1", "c2", "c3"])
    assert wait_until(lambda: state(again) == final), state(again)
    assert again.log.on_apply is None and again.log.changed is not groups[0].log.changed
    with again.log.changed:  # still a working condition after the snapshot was loaded
        again.log.changed.notify_all()
    assert complete(again, "c4", 2, 5) is True
    assert wait_until(lambda: all(state(g)[1] == 5 for g in (groups[0], groups[1], again)))


def test_a_newcomer_joins_after_replacements_that_left_the_leaders_snapshot_behind(make_group, tmp_path):
    """A replica that joined from a snapshot keeps it until it compacts its own log; the snapshot
    names the members of its time. After two replacements such a replica leads, and the third
    newcomer loads its snapshot: unless the leader brought it up to date, the newcomer's group is
    then three replicas that are all gone, it refuses the leader's connection, and never joins."""
    a = addrs(6)
    dirs = {addr: tmp_path / addr.replace(":", "_") for addr in a}
    for d in dirs.values():
        d.mkdir()
    groups: dict[str, RaftGroup] = {}

    def start(addr: str, members: list[str]) -> None:
        groups[addr] = make_group(addr, members, journal_dir=dirs[addr])
        groups[addr].log.on_apply = lambda kind, cell: None  # unpicklable: must stay out of snapshots

    def replace(leader: RaftGroup, members: list[str], old: str, new: str) -> list[str]:
        """What the scheduler and the leader's membership loop do; the old replica is stopped."""
        members = [m for m in members if m != old] + [new]
        start(new, members)
        want = {m for m in members if m != leader.address}
        while leader.change_membership(want):
            pass
        stop(groups.pop(old))
        assert groups[new].wait_ready(15), f"{new} did not join"
        return members

    members = a[:3]
    for addr in members:
        start(addr, members)
    assert all(g.wait_ready(10) for g in groups.values())
    for i, addr in enumerate(members):
        assert complete(groups[addr], f"c{i}", i, i + 1, **{f"v{i}": str(i)}) is True
    assert wait_until(lambda: all(state(g)[1] == 3 for g in groups.values()))  # every entry applied
    for g in groups.values():
        g.compact_log()  # newcomers now catch up from a snapshot that lists a[0], a[1], a[2]
    assert wait_until(lambda: all(g.log_length <= 2 for g in groups.values()))
    assert wait_until(lambda: any(g.is_leader for g in groups.values()))
    leader = next(g for g in groups.values() if g.is_leader)
    followers = [m for m in members if m != leader.address]
    members = replace(leader, members, followers[0], a[3])
    members = replace(leader, members, followers[1], a[4])
    # a[3] leads now, as an executor does: the leader hands over on the Raft thread as it applies
    # an entry (pysyncobj does it once a[3] has every entry; a barrier more until then)
    leader.log.on_apply = lambda kind, cell: leader.transfer_leadership_to(a[3])
    tokens = iter(range(1_000_000))
    assert wait_until(lambda: (leader.barrier(0, next(tokens)), groups[a[3]].is_leader)[1]), "a[3] did not lead"
    members = replace(groups[a[3]], members, leader.address, a[5])  # failed here before the fix
    assert complete(groups[a[5]], "c3", 5, 4, v3="3") is True
    assert wait_until(lambda: all(state(g)[1] == 4 for g in groups.values()))


def test_a_peer_with_the_wrong_key_gets_nothing_and_disturbs_nothing(make_group):
    a = addrs(3)
    groups = [make_group(addr, a) for addr in a]
    assert all(g.wait_ready(10) for g in groups)
    intruder_addr = addrs(1)[0]
    intruder = make_group(intruder_addr, a, key=WRONG_KEY, members=4)

    for i in range(5):
        assert complete(groups[i % 3], f"c{i}", i % 3, i + 1, x=str(i)) is True
    assert wait_until(lambda: all(state(g)[1] == 5 for g in groups))
    time.sleep(1.5)  # past pysyncobj's election timeouts: the intruder had every chance
    assert not intruder.ready
    assert state(intruder) == ({}, 0, None, [])
    assert not any(intruder.connected(p) for p in a)
    assert complete(groups[0], "c5", 0, 6, x="after") is True  # the good ones keep committing
    assert wait_until(lambda: all(state(g)[0] == {"x": b"after"} for g in groups))


def test_a_stranger_on_the_raft_port_is_dropped_after_a_few_kilobytes(make_group):
    """pysyncobj checks a message once it is whole: a connection announcing a 2 GiB message made
    a replica hold everything it sent. Now, before its first message decrypts, a connection may
    have only UNAUTHENTICATED_BYTES buffered: the replica closes it, so the stranger's sending
    fails long before 64 MiB, and the group goes on committing."""
    a = addrs(3)
    groups = [make_group(addr, a) for addr in a]
    assert all(g.wait_ready(10) for g in groups)
    host, port = a[0].rsplit(":", 1)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        chunk = b"\0" * (1 << 16)
        with pytest.raises(ConnectionError):  # reset by the replica (EPIPE or ECONNRESET), not a timeout
            sock.sendall(struct.pack("i", 2**31 - 1))
            while sent < 64 << 20:
                sock.sendall(chunk)
                sent += len(chunk)
        assert sent < 64 << 20
    assert complete(groups[0], "c1", 0, 1, x="still") is True
    assert wait_until(lambda: all(state(g)[0] == {"x": b"still"} for g in groups))


def test_one_member_with_the_wrong_key_the_majority_still_commits(make_group):
    a = addrs(3)
    good = [make_group(a[0], a), make_group(a[1], a)]
    bad = make_group(a[2], a, key=WRONG_KEY)
    assert all(g.wait_ready(10) for g in good)
    assert complete(good[1], "c1", 1, 1, x="1") is True
    assert complete(good[0], "c2", 0, 2, y="2") is True
    assert wait_until(lambda: state(good[0]) == state(good[1]) == ({"x": b"1", "y": b"2"}, 2, 0, ["c1", "c2"]))
    time.sleep(1.0)  # the absence of an event: the bad member had time to join, and did not
    assert not bad.ready
    assert state(bad) == ({}, 0, None, [])
    assert not good[0].connected(a[2]) and not good[1].connected(a[2])
    with pytest.raises(RaftUnavailable):  # and it cannot commit anything itself
        bad.propose("c3", 0, 2, True, timeout_s=1.0)
    assert ("c3", 0) not in good[0].log.elections


def test_a_group_of_one_commits_without_waiting_for_its_next_tick(make_group, monkeypatch, tmp_path):
    """A one-replica kernel: no peer answers to wake the leader's tick thread, which advances the
    commit index only at the start of a tick. With the tick period made 30 s, each entry commits only
    if the group wakes its own tick (each waited 50 ms, the default period, and made every cell of
    such a kernel 60 ms). Restarted from its journal, it has its entries back and commits again."""
    import gpuhub.replication.log as raft_log
    real_conf = raft_log.SyncObjConf
    monkeypatch.setattr(raft_log, "SyncObjConf", lambda **kw: real_conf(autoTickPeriod=30.0, **kw))
    (addr,) = addrs(1)
    for cells in (range(1, 4), range(4, 6)):  # then again after a restart
        group = make_group(addr, [addr], journal_dir=tmp_path, members=1)
        wake = group._sync._SyncObj__pipeNotifier.notify  # the election, too, runs only in a tick
        try:
            assert wait_until(lambda g=group, w=wake: w() or g.ready), "a group of one did not elect itself"
            for n in cells:
                assert complete(group, f"c{n}", 0, n, x=str(n)) is True  # each within its 10 s, not 30
            assert state(group) == ({"x": str(n).encode()}, n, 0, [f"c{i}" for i in range(1, n + 1)])
        finally:
            group.destroy()
            wake()  # its tick thread sees the destroy only once its poll returns
        assert wait_until(lambda g=group: g.stopped, 10), "pysyncobj thread still alive"


def test_an_entry_raises_raft_unavailable_without_a_majority(make_group):
    a = addrs(3)  # the other two never start
    alone = make_group(a[0], a)
    started = time.monotonic()
    with pytest.raises(RaftUnavailable) as info:
        alone.propose("c1", 0, 0, True, timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 3.0
    message = str(info.value)
    assert "'propose'" in message and "majority" in message and "1 s" in message
    assert alone.log.elections == {}


def test_raft_unavailable_after_the_majority_is_lost_is_not_a_rollback(make_group, tmp_path):
    """The leader cut off from its majority raises RaftUnavailable, but the entry stays in its log
    and commits once the majority is back (plain Raft): RaftUnavailable means "not known to be
    committed", never "dropped". Every entry is first-wins or idempotent, which makes that safe."""
    a, dirs, groups = journaled_groups(make_group, tmp_path)
    assert complete(groups[0], "c1", 0, 1, x="1") is True
    leader = a.index(groups[0].leader)
    others = [i for i in range(3) if i != leader]
    for i in others:
        stop(groups[i])
    with pytest.raises(RaftUnavailable, match="majority"):
        groups[leader].propose("c2", 0, leader, True, timeout_s=1.5)
    assert ("c2", 0) not in groups[leader].log.elections  # not applied: not committed (yet)
    back = [make_group(a[i], a, journal_dir=dirs[i]) for i in others]
    assert wait_until(lambda: all(("c2", 0) in g.log.elections for g in [groups[leader], *back]))
    assert all(g.log.elections[("c2", 0)].proposals == {leader: True} for g in [groups[leader], *back])
