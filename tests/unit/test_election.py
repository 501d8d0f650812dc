"""The executor election and the kernel's Raft state machine, without a network.

Raft guarantees one thing the election relies on: every replica applies the same committed
sequence of entries, each at its own pace. The simulation below models exactly that: N
``KernelLog`` objects (entries applied with ``KernelLog.apply``, as pysyncobj applies a committed
entry, no SyncObj needed), one shared committed list, and per replica the index it has
applied up to. Hypothesis draws the interleaving: replicas propose (or never do: dead), the log
commits pending entries in any order, replicas apply at their own pace, election timeouts fire on
a replica's own applied prefix, replicas die (their uncommitted entries may be lost).

The expected outcome is computed by an independent reference (``spec_no_timeout`` and
``reference_outcome``), not by ``local_choice`` itself.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpuhub.replication.election import FAILED, Election, local_choice
from gpuhub.replication.log import ImageEntry, KernelLog

LEAD, YIELD = True, False


# --- the reference -------------------------------------------------------------------------------
def spec_no_timeout(previous: int | None, members: int, proposals: dict[int, bool]) -> int | None:
    """The outcome the log alone decides (no timeout), from the first proposal per replica in
    commit order: the previous executor if it LEADs; once it has proposed (or there is none), the
    first LEAD; every member proposed and none LEADs: FAILED; else undecided."""
    if previous is not None:
        if previous not in proposals:
            return None  # nothing decides before the previous executor has spoken, but a timeout
        if proposals[previous]:
            return previous
    leads = [r for r, lead in proposals.items() if lead]
    if leads:
        return leads[0]
    return FAILED if len(proposals) >= members else None


def reference_outcome(previous: int | None, members: int, entries: list[tuple]) -> int | None:
    """The outcome of one election from its committed entries in order: the first decision, be it
    an explicit vote or the log's own (``spec_no_timeout``) when a proposal is applied."""
    proposals: dict[int, bool] = {}
    for method, args in entries:
        if method == "propose":
            proposals.setdefault(args[2], args[3])
            decided = spec_no_timeout(previous, members, proposals)
        else:  # vote
            decided = args[3]
        if decided is not None:
            return decided
    return None


def done(e: Election | None) -> int | None:
    return None if e is None else e.outcome


# --- the simulated group -----------------------------------------------------------------------------
class Sim:
    """N replicas sharing one committed sequence, each applying it at its own pace."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.logs = [KernelLog(members=n) for _ in range(n)]
        self.pending: list[tuple[int, str, tuple]] = []  # (submitter, method, args), not yet committed
        self.committed: list[tuple[str, tuple]] = []
        self.applied = [0] * n
        self.alive = [True] * n
        self.seen: dict[tuple[str, int], int] = {}  # election -> the outcome any replica first saw
        self.executors: dict[tuple[str, int], set[int]] = {}  # election -> replicas that saw themselves win

    def submit(self, replica: int, method: str, *args) -> None:
        self.pending.append((replica, method, args))

    def seed(self, method: str, *args) -> None:
        """An entry committed before the drawn interleaving starts."""
        self.committed.append((method, args))

    def commit(self, k: int) -> None:
        if self.pending:
            _, method, args = self.pending.pop(k % len(self.pending))
            self.committed.append((method, args))

    def lose_pending_of(self, replica: int) -> None:
        self.pending = [p for p in self.pending if p[0] != replica]

    def apply_next(self, r: int) -> None:
        if self.applied[r] < len(self.committed):
            method, args = self.committed[self.applied[r]]
            self.logs[r].apply(method, *args)
            self.applied[r] += 1
            self.observe(r)

    def observe(self, r: int) -> None:
        """What replica r believes now: a decided election never changes its outcome, every replica
        sees the same one, and at most one replica ever believes it is the executor."""
        for key, e in self.logs[r].elections.items():
            if e.outcome is None:
                continue
            assert self.seen.setdefault(key, e.outcome) == e.outcome, (key, r, e.outcome, self.seen[key])
            if e.outcome == r:
                self.executors.setdefault(key, set()).add(r)
                assert len(self.executors[key]) == 1, (key, self.executors[key])

    def finish(self) -> None:
        """Every pending entry commits, every replica (the dead too: they recover) applies all."""
        while self.pending:
            self.commit(0)
        for r in range(self.n):
            while self.applied[r] < len(self.committed):
                self.apply_next(r)

    def replay(self) -> KernelLog:
        fresh = KernelLog(members=self.n)
        for method, args in self.committed:
            fresh.apply(method, *args)
        return fresh


def state_of(log: KernelLog) -> tuple:
    return (log.image, log.image_version, log.execution_count, log.previous_executor, dict(log.outcomes),
            {k: (e.previous, list(e.proposals.items()), e.outcome) for k, e in log.elections.items()})


# --- local_choice: the rule as a table ----------------------------------------------------------
def election(previous: int | None, members: int, *proposals: tuple[int, bool]) -> Election:
    e = Election("c", 0, previous, members)
    for replica, lead in proposals:
        e.add_proposal(replica, lead)
    return e


L, Y = LEAD, YIELD
LOCAL_CHOICE_CASES = [
    # (previous, members, proposals in commit order, choice without timeout, choice after timeout)
    # nothing proposed yet: wait, even after a timeout (there is nobody to pick)
    (None, 3, [], None, None),
    (1, 3, [], None, None),
    # no previous executor: the first committed LEAD, at once
    (None, 3, [(2, L)], 2, 2),
    (None, 3, [(0, Y), (2, L), (1, L)], 2, 2),
    (None, 3, [(0, Y)], None, FAILED),
    (None, 3, [(0, Y), (1, Y)], None, FAILED),
    (None, 3, [(0, Y), (1, Y), (2, Y)], FAILED, FAILED),  # everyone yielded
    (None, 1, [(0, L)], 0, 0),
    (None, 1, [(0, Y)], FAILED, FAILED),
    # previous executor LEADs: it wins (sticky), even over earlier LEADs
    (1, 3, [(1, L)], 1, 1),
    (1, 3, [(0, L), (2, L), (1, L)], 1, 1),
    # previous executor not heard from: wait for it; a timeout takes the first LEAD
    (1, 3, [(0, L)], None, 0),
    (1, 3, [(0, L), (2, L)], None, 0),
    (1, 3, [(0, Y), (2, L)], None, 2),
    (1, 3, [(0, Y), (2, Y)], None, FAILED),
    # previous executor yielded: the first LEAD, whoever proposed it first
    (1, 3, [(2, L), (1, Y)], 2, 2),
    (1, 3, [(1, Y), (0, L), (2, L)], 0, 0),
    (1, 3, [(1, Y)], None, FAILED),
    (1, 3, [(1, Y), (0, Y), (2, Y)], FAILED, FAILED),
    # a repeated proposal (a retried call) keeps the first
    (None, 3, [(0, Y), (0, L)], None, FAILED),
    (1, 3, [(1, L), (1, Y)], 1, 1),
]


@pytest.mark.parametrize("previous,members,proposals,calm,timed_out", LOCAL_CHOICE_CASES)
def test_local_choice_table(previous, members, proposals, calm, timed_out):
    e = election(previous, members, *proposals)
    assert local_choice(e, timed_out=False) == calm
    assert local_choice(e, timed_out=True) == timed_out
    assert spec_no_timeout(previous, members, e.proposals) == calm  # the reference agrees


def test_local_choice_ignores_outcome_and_a_decision_never_unmakes():
    """Adding proposals to a decided calm choice never changes it (the log records it once)."""
    e = election(None, 3, (1, L))
    assert local_choice(e, False) == 1
    e.add_proposal(0, L)
    e.add_proposal(2, Y)
    assert local_choice(e, False) == 1
    assert e.add_vote(1) and not e.add_vote(0) and e.outcome == 1


# --- KernelLog: the state machine, entry by entry ----------------------------------------------------
def complete(log: KernelLog, cell: str, attempt: int, executor: int, count: int = 1, **changed) -> bool:
    image = image_of(changed) if changed else None
    return log.apply("complete", cell, attempt, executor, "ok", image, count)


def image_of(names: dict) -> ImageEntry:
    """A stand-in image whose inline stream is the names' repr (the log never looks inside)."""
    stream = repr(sorted(names.items())).encode()
    return ImageEntry(f"d-{stream.hex()}", stream, len(stream), (), tuple(names))


def test_entries_apply_directly_without_a_group():
    log = KernelLog(members=3)
    log.apply("propose", "a", 0, 2, LEAD)
    assert log.elections[("a", 0)].outcome == 2  # no previous executor: the first LEAD, no vote needed
    assert complete(log, "a", 0, 2, x=1) is True
    assert log.previous_executor == 2 and ("a", 0) not in log.elections
    assert log.outcomes["a"].kind == "complete" and log.outcomes["a"].by == 2
    assert log.image == image_of({"x": 1}) and log.image_version == 1 and log.execution_count == 1


def test_sticky_previous_executor_wins_over_an_earlier_lead():
    log = KernelLog(members=3)
    complete(log, "a", 0, 1)
    log.apply("propose", "b", 0, 0, LEAD)
    log.apply("propose", "b", 0, 2, LEAD)
    assert log.elections[("b", 0)].outcome is None  # waits for replica 1, the previous executor
    log.apply("propose", "b", 0, 1, LEAD)
    assert log.elections[("b", 0)].outcome == 1


def test_explicit_vote_first_wins_and_later_proposals_do_not_change_it():
    log = KernelLog(members=3)
    complete(log, "a", 0, 1)
    log.apply("propose", "b", 0, 0, LEAD)
    log.apply("vote", "b", 0, 0, 0)  # replica 0's timeout: replica 1 may be dead
    log.apply("vote", "b", 0, 2, FAILED)  # a later vote loses
    log.apply("propose", "b", 0, 1, LEAD)  # the previous executor, too late
    assert log.elections[("b", 0)].outcome == 0


def test_abort_and_complete_first_wins_and_late_entries_are_ignored():
    log = KernelLog(members=3)
    log.apply("propose", "a", 0, 0, LEAD)
    assert log.apply("abort", "a", 0, 1, "no-gpu", "", 1) is True
    assert complete(log, "a", 0, 0, x=1) is False  # the abort committed first
    assert log.apply("abort", "a", 0, 2, "interrupted", "", 1) is False
    assert log.outcomes["a"].kind == "abort" and log.outcomes["a"].by == 1 and log.image is None
    before = state_of(log)
    log.apply("propose", "a", 0, 2, LEAD)  # a retried call, committed late
    log.apply("propose", "a", 1, 2, LEAD)
    log.apply("vote", "a", 0, 2, 2)
    assert state_of(log) == before  # no resurrected election
    assert not any(k[0] == "a" for k in log.elections)


def test_abort_executor_lost_forgets_the_previous_executor():
    log = KernelLog(members=3)
    complete(log, "a", 0, 1)
    log.apply("abort", "b", 0, 0, "executor-lost", "", 2)
    assert log.previous_executor is None
    log.apply("propose", "c", 0, 2, LEAD)
    assert log.elections[("c", 0)].outcome == 2  # no wait for the lost replica
    log2 = KernelLog(members=3)
    complete(log2, "a", 0, 1)
    log2.apply("abort", "b", 0, 0, "no-gpu", "", 2)
    assert log2.previous_executor == 1  # other aborts keep it


def test_proposals_for_a_future_cell_are_buffered_and_honoured():
    log = KernelLog(members=3)
    complete(log, "a", 0, 1)
    log.apply("propose", "b", 0, 1, LEAD)
    log.apply("propose", "b", 0, 0, LEAD)
    assert log.elections[("b", 0)].outcome == 1
    # replicas 0 and 2 already propose for "c" while "b" runs on replica 1
    log.apply("propose", "c", 0, 0, YIELD)
    log.apply("propose", "c", 0, 2, LEAD)
    assert log.elections[("c", 0)].outcome is None  # previous executor (1) not heard from
    complete(log, "b", 0, 1, count=2)
    e = log.elections[("c", 0)]
    assert list(e.proposals.items()) == [(0, YIELD), (2, LEAD)]  # kept across "b"'s end
    log.apply("propose", "c", 0, 1, YIELD)
    assert e.outcome == 2


def test_a_buffered_election_keeps_the_previous_executor_as_of_its_first_entry():
    """Documented (Election.previous): the sticky rule of a buffered election refers to the executor
    of the last cell completed before its FIRST entry, not to the one completed just before it runs.
    Every replica applies the same order, so all agree; in practice a replica proposes for a cell
    only after applying the previous cell's end, so elections are rarely buffered."""
    log = KernelLog(members=3)
    complete(log, "a", 0, 0)
    log.apply("propose", "c", 0, 1, YIELD)  # early, while "b" has not completed
    log.apply("propose", "b", 0, 2, LEAD)
    log.apply("propose", "b", 0, 0, YIELD)
    complete(log, "b", 0, 2, count=2)
    assert log.previous_executor == 2
    log.apply("propose", "c", 0, 2, LEAD)
    assert log.elections[("c", 0)].previous == 0
    assert log.elections[("c", 0)].outcome is None  # waits for replica 0, not decided for 2
    log.apply("propose", "c", 0, 0, LEAD)
    assert log.elections[("c", 0)].outcome == 0


def test_retried_proposal_changes_nothing():
    log = KernelLog(members=3)
    log.apply("propose", "a", 0, 0, YIELD)
    log.apply("propose", "a", 0, 0, LEAD)
    assert log.elections[("a", 0)].proposals == {0: YIELD} and log.elections[("a", 0)].outcome is None


# --- one election, any interleaving -------------------------------------------------------------
ACTIONS = ["propose", "propose", "retry", "commit", "commit", "commit", "apply", "apply", "apply",
           "apply", "timeout", "timeout", "die"]


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_one_election_under_any_interleaving(data):
    n = data.draw(st.integers(1, 5), label="members")
    previous = data.draw(st.none() | st.integers(0, n - 1), label="previous executor")
    intents = data.draw(st.lists(st.sampled_from([LEAD, LEAD, YIELD, YIELD, None]), min_size=n, max_size=n),
                        label="LEAD/YIELD/never per replica")
    steps = data.draw(st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, n - 1),
                                         st.integers(0, 7)), min_size=20, max_size=100), label="steps")
    key = ("c", 0)
    sim = Sim(n)
    if previous is not None:
        sim.seed("complete", "z", 0, previous, "ok", None, 1)
    proposed, voted = set(), set()
    for action, r, k in steps:
        if not sim.alive[r]:
            continue
        if action == "propose" and r not in proposed and intents[r] is not None:
            sim.submit(r, "propose", *key, r, intents[r])
            proposed.add(r)
        elif action == "retry" and r in proposed:
            sim.submit(r, "propose", *key, r, intents[r])  # a retried call may commit twice
        elif action == "commit":
            sim.commit(k)
        elif action == "apply":
            for _ in range(1 + k % 3):
                sim.apply_next(r)
        elif action == "timeout" and r in proposed and r not in voted:
            e = sim.logs[r].elections.get(key)
            if e is not None and e.outcome is None:  # Replica.elect: vote only while undecided
                choice = local_choice(e, timed_out=True)
                if choice is not None:
                    sim.submit(r, "vote", *key, r, choice)
                    voted.add(r)
        elif action == "die":
            sim.alive[r] = False
            if k % 2:
                sim.lose_pending_of(r)  # what it had submitted never committed
    sim.finish()

    entries = [(m, a) for m, a in sim.committed if m in ("propose", "vote") and a[:2] == key]
    first_lead: dict[int, bool] = {}
    for i, (m, a) in enumerate(entries):
        if m == "propose":
            first_lead.setdefault(a[2], a[3])
        else:  # every vote, winning or not, is legal: FAILED or a LEAD committed before it
            assert a[3] == FAILED or first_lead.get(a[3]) is LEAD, (i, a, first_lead)

    # every replica, whenever it applied, ends with the same state, equal to a plain replay
    replayed = sim.replay()
    for log in sim.logs:
        assert state_of(log) == state_of(replayed)
    outcome = done(replayed.elections.get(key))
    # the outcome is the reference's: the first vote, or what the log decides without one
    assert outcome == reference_outcome(previous, n, entries)
    # ... which is FAILED or a replica that proposed LEAD
    assert outcome in (None, FAILED) or first_lead.get(outcome) is LEAD
    # sticky: the previous executor's LEAD, committed before any vote, wins
    first_vote = next((i for i, (m, _) in enumerate(entries) if m == "vote"), len(entries))
    prev_first = next((i for i, (m, a) in enumerate(entries) if m == "propose" and a[2] == previous),
                      len(entries))
    if previous is not None and first_lead.get(previous) is LEAD and prev_first < first_vote:
        assert outcome == previous
    # without a timeout the log alone decides, the same for every apply timing
    if first_vote == len(entries):
        assert outcome == spec_no_timeout(previous, n, first_lead)
        if len(first_lead) == n:
            assert outcome is not None  # everyone proposed: decided without any timeout
    event("decided by " + ("nothing yet" if outcome is None else "a vote" if first_vote < len(entries)
                           else "the log"))
    # liveness: once a proposal is committed, any proposer's single timeout vote decides it
    if outcome is None and first_lead:
        r = next(iter(first_lead))
        choice = local_choice(sim.logs[r].elections[key], timed_out=True)
        assert choice is not None
        sim.submit(r, "vote", *key, r, choice)
        sim.finish()
        assert {done(log.elections.get(key)) for log in sim.logs} == {choice}
    assert all(len(v) <= 1 for v in sim.executors.values())


# --- many cells, any interleaving ----------------------------------------------------------------
CELLS = ["a", "b", "c", "d"]
MULTI_ACTIONS = ["propose", "propose", "ahead", "commit", "commit", "commit", "apply", "apply",
                 "apply", "apply", "act", "act", "act", "timeout", "abort", "abort", "lost", "die"]


def check_replay(sim: Sim, n: int) -> Counter:
    """Apply the committed log to a fresh replica, entry by entry, against the reference."""
    ref = KernelLog(members=n)
    stats: Counter = Counter()
    per_key: dict[tuple[str, int], list[tuple]] = {}
    previous_at_first: dict[tuple[str, int], int | None] = {}
    previous = None  # the executor of the last completed cell, unless one was lost since
    for method, args in sim.committed:
        cell = args[0]
        finished = cell in ref.outcomes
        before = state_of(ref)
        if method in ("propose", "vote") and not finished:
            key = (cell, args[1])
            previous_at_first.setdefault(key, previous)
            per_key.setdefault(key, []).append((method, args))
        if method == "complete" and not finished:
            # the model completes only on a replica that saw itself elected: the log agrees
            assert ref.elections[(cell, args[1])].outcome == args[2]
        result = ref.apply(method, *args)
        if finished:
            assert state_of(ref) == before, (method, args)  # late entry: ignored, nothing resurrected
            assert result in (None, False)
            stats["late " + ("end" if method in ("complete", "abort") else "vote/proposal")] += 1
            stats[f"late {method}"] += 1
        elif method in ("complete", "abort"):
            assert result is True
            stats[method] += 1
            if method == "complete":
                previous = args[2]
            elif args[3] == "executor-lost":
                stats["previous forgotten"] += previous is not None
                previous = None
        assert ref.previous_executor == previous
        for key, e in ref.elections.items():
            assert key[0] not in ref.outcomes
            # buffered or not, every committed proposal is honoured (first per replica, in order)
            firsts: dict[int, bool] = {}
            for m, a in per_key[key]:
                if m == "propose":
                    firsts.setdefault(a[2], a[3])
            assert list(e.proposals.items()) == list(firsts.items())
            assert e.previous == previous_at_first[key]  # as of the election's first entry
            assert e.outcome == reference_outcome(e.previous, n, per_key[key])
            if e.outcome is not None:
                stats["decided"] += 1
    return stats


class Kernels:
    """The replicas' side of the protocol (what gpuhub.kernel.replica does), over a ``Sim``: each
    replica works through CELLS in order and acts only on what it has applied itself."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.cur = [0] * sim.n  # index into CELLS of the cell each replica is at
        self.attempt = [0] * sim.n
        self.proposed: set[tuple[int, str, int]] = set()
        self.voted: set[tuple[int, str, int]] = set()

    def step(self, action: str, r: int, k: int) -> None:
        sim = self.sim
        if not sim.alive[r]:
            return
        if action == "commit":
            return sim.commit(k)
        if action == "apply":
            return sim.apply_next(r)
        if action == "die":
            sim.alive[r] = False
            if k % 2:
                sim.lose_pending_of(r)  # what it had submitted never committed
            return
        if self.cur[r] >= len(CELLS):
            return
        log = sim.logs[r]
        cell, att = CELLS[self.cur[r]], self.attempt[r]
        e = log.elections.get((cell, att))
        ended = cell in log.outcomes
        if action == "propose" and (r, cell, att) not in self.proposed:
            sim.submit(r, "propose", cell, att, r, bool(k % 2))
            self.proposed.add((r, cell, att))
        elif action == "ahead" and self.cur[r] + 1 < len(CELLS):
            # proposes for the next cell before this one ended here: the log buffers it
            nxt = CELLS[self.cur[r] + 1]
            if (r, nxt, 0) not in self.proposed:
                sim.submit(r, "propose", nxt, 0, r, bool(k % 2))
                self.proposed.add((r, nxt, 0))
        elif action == "timeout" and (r, cell, att) in self.proposed and (r, cell, att) not in self.voted:
            if e is not None and e.outcome is None and not ended:  # Replica.elect
                choice = local_choice(e, timed_out=True)
                if choice is not None:
                    sim.submit(r, "vote", cell, att, r, choice)
                    self.voted.add((r, cell, att))
        elif action == "abort" and not ended:
            reason = ["executor-lost", "no-gpu", "interrupted"][k % 3]
            sim.submit(r, "abort", cell, att, r, reason, "", self.cur[r] + 1)
        elif action == "lost" and not ended and e is not None and e.outcome not in (None, FAILED):
            if not sim.alive[e.outcome]:  # the executor's replica is gone: end the cell
                sim.submit(r, "abort", cell, att, r, "executor-lost", "", self.cur[r] + 1)
        elif action == "act":
            if ended:
                self.cur[r], self.attempt[r] = self.cur[r] + 1, 0  # on to the next cell
            elif e is not None and e.outcome == r:  # elected here: run it, publish the result
                sim.submit(r, "complete", cell, att, r, "ok",
                           image_of({"cell": cell}), self.cur[r] + 1)
            elif e is not None and e.outcome == FAILED:
                self.attempt[r] += 1  # nobody could run it: try again

    def drain(self, upto: int, rounds: int = 12) -> None:
        """A calm spell: the live replicas LEAD, time out, and see cells through until each is past
        the first ``upto`` cells (liveness: whatever happened before, they get there)."""
        sim = self.sim
        for _ in range(rounds * upto):
            if all(self.cur[r] >= upto for r in range(sim.n) if sim.alive[r]):
                return
            for r in range(sim.n):
                for action in ("propose", "timeout", "lost", "act"):
                    self.step(action, r, 1)
            while sim.pending:
                sim.commit(0)
            for r in range(sim.n):
                while sim.alive[r] and sim.applied[r] < len(sim.committed):
                    sim.apply_next(r)
        raise AssertionError(f"no progress: live replicas at cells {self.cur}, attempts {self.attempt}")


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_many_cells_under_any_interleaving(data):
    n = data.draw(st.integers(1, 5), label="members")
    sim = Sim(n)
    kernels = Kernels(sim)
    for i in range(len(CELLS)):  # chaos, then calm until every live replica is past cell i
        steps = data.draw(st.lists(st.tuples(st.sampled_from(MULTI_ACTIONS), st.integers(0, n - 1),
                                             st.integers(0, 7)), max_size=50), label=f"steps {i}")
        for action, r, k in steps:
            kernels.step(action, r, k)
        kernels.drain(upto=i + 1)
    sim.finish()

    replayed = sim.replay()
    for log in sim.logs:
        assert state_of(log) == state_of(replayed)
    stats = check_replay(sim, n)
    assert not any(k[0] in replayed.outcomes for k in replayed.elections)
    assert all(len(v) <= 1 for v in sim.executors.values())
    if any(sim.alive):
        assert set(replayed.outcomes) == set(CELLS)
    # every completed cell published one image; the state holds the last one committed
    completed = [c for c, o in replayed.outcomes.items() if o.kind == "complete"]
    assert replayed.image_version == len(completed)
    if completed:
        assert replayed.image == image_of({"cell": completed[-1]})
    # how much the drawn runs exercise (pytest --hypothesis-show-statistics)
    event(f"cells completed: {stats['complete']}")
    event(f"late ends ignored: {min(stats['late end'], 2)}+")
    event(f"late completes ignored: {min(stats['late complete'], 1)}+")
    event(f"executor-lost forgot a previous executor: {min(stats['previous forgotten'], 1)}+")
    event(f"late proposals/votes ignored: {min(stats['late vote/proposal'], 2)}+")
