"""Property-based tests of the lease book: never over-grant, idempotent release, dead holders expire."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpuhub.agent.leases import Lease, LeaseBook, LeaseError


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.book = LeaseBook(gpu_count=4)
        self.now = 0.0
        self.dead: set[str] = set()
        self.granted: dict[str, int] = {}

    @rule(n=st.integers(0, 4), holder=st.sampled_from(["a", "b", "c", "d"]), ttl=st.none() | st.floats(1, 100))
    def grant(self, n, holder, ttl):
        free_before = self.book.free
        lease = self.book.grant(n, holder, self.now, ttl_s=ttl)
        if n <= free_before:
            assert lease is not None and len(lease.gpus) == n
            self.granted[lease.lease_id] = n
        else:
            assert lease is None

    @precondition(lambda self: self.granted)
    @rule(data=st.data())
    def release(self, data):
        # insertion order, not sorted: lease ids are random, so a sorted order would differ between
        # hypothesis replays of the same steps
        lease_id = data.draw(st.sampled_from(list(self.granted)))
        first = self.book.release(lease_id)
        second = self.book.release(lease_id)
        assert second is None  # idempotent
        if first is not None:
            del self.granted[lease_id]
        else:
            self.granted.pop(lease_id, None)

    @rule(holder=st.sampled_from(["a", "b", "c", "d"]))
    def holder_dies(self, holder):
        self.dead.add(holder)
        gone = self.book.expire(self.now, lambda lease: lease.holder not in self.dead)
        for lease in gone:
            self.granted.pop(lease.lease_id, None)
        assert all(lease.holder not in self.dead for lease in self.book.leases.values())

    @precondition(lambda self: self.granted)
    @rule(data=st.data(), pid=st.integers(2, 99999))
    def linger(self, data, pid):
        lease_id = data.draw(st.sampled_from(list(self.granted)))
        assert self.book.linger(lease_id, pid, self.now).lingering_pid == pid

    @precondition(lambda self: self.granted)
    @rule(data=st.data())
    def resume(self, data):
        lease_id = data.draw(st.sampled_from(list(self.granted)))
        was = self.book.leases[lease_id].lingering_pid
        assert (self.book.resume(lease_id, self.now) is not None) == (was is not None)
        assert self.book.leases[lease_id].lingering_pid is None

    @rule(n=st.integers(0, 4))
    def reclaim(self, n):
        """What the agent does for a grant that needs lingering GPUs: end those, then grant."""
        taken = self.book.reclaimable(n)
        if taken is None:
            assert self.book.free + len(self.book.lingering) < n
            return
        assert all(lease.lingering_pid is not None for lease in taken)
        for lease in taken:
            self.book.release(lease.lease_id)
            del self.granted[lease.lease_id]
        assert self.book.free >= n

    @rule(dt=st.floats(0, 50))
    def time_passes(self, dt):
        self.now += dt
        for lease in self.book.expire(self.now):
            self.granted.pop(lease.lease_id, None)
        assert all(lease.expires_at is None or lease.expires_at > self.now for lease in self.book.leases.values())

    @invariant()
    def never_over_granted(self):
        gpus = [g for lease in self.book.leases.values() for g in lease.gpus]
        assert len(gpus) == len(set(gpus)), "a GPU is in two leases"
        assert self.book.committed <= self.book.gpu_count
        assert all(0 <= g < self.book.gpu_count for g in gpus)
        assert self.book.committed + len(self.book.lingering) + self.book.free == self.book.gpu_count


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_cannot_ask_for_more_than_the_node_has():
    book = LeaseBook(2)
    with pytest.raises(LeaseError, match="has 2"):
        book.grant(3, "a", 0.0)
    with pytest.raises(LeaseError):
        book.grant(-1, "a", 0.0)


@given(st.lists(st.integers(0, 8), max_size=20), st.integers(1, 8))
def test_pending_and_subscription_ratio(specs, gpus):
    book = LeaseBook(gpus)
    for i, n in enumerate(specs):
        book.place(f"r{i}", n)
    assert book.pending == sum(specs)
    assert book.subscription_ratio(3) == pytest.approx(sum(specs) / (gpus * 3))
    for i in range(len(specs)):
        book.unplace(f"r{i}")
    assert book.pending == 0


def test_a_lingering_lease_holds_its_gpus_but_is_not_committed_and_is_reclaimed_longest_lingering_first():
    book = LeaseBook(gpu_count=3, random_ids=False)
    a = book.grant(1, "ka", now=0.0)
    b = book.grant(1, "kb", now=0.0)
    c = book.grant(1, "kc", now=0.0)
    assert book.reclaimable(1) is None  # all three run cells: nothing to take back
    book.linger(b.lease_id, pid=200, now=5.0)
    book.linger(a.lease_id, pid=100, now=7.0)
    assert (book.committed, book.free, book.lingering) == (1, 0, {0, 1})
    assert book.grant(1, "kd", now=8.0) is None  # held all the same: ending one comes first
    assert book.reclaimable(1) == [b]  # the one lingering longest
    assert book.reclaimable(2) == [b, a]
    assert book.reclaimable(3) is None  # c runs a cell
    assert book.resume(c.lease_id, now=9.0) is None  # not lingering: nothing to resume
    resumed = book.resume(a.lease_id, now=9.0)
    assert resumed is a and a.lingering_pid is None and a.granted_at == 9.0  # its GPU-time counts anew
    assert book.committed == 2 and book.reclaimable(1) == [b]
    again = Lease.from_dict(b.to_dict())  # the agent's state file keeps it lingering across a restart
    assert (again.lingering_pid, again.lingering_since) == (200, 5.0)
