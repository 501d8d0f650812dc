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


def effective_previous(previous: int | None, attempt: int, entries: list[tuple]) -> int | None:
    """The previous executor an election's sticky rule refers to: at attempt 0 it is the lease
    holder, and a first proposal by anyone else revokes the lease (no previous executor)."""
    first = entries[0] if entries else None
    if attempt == 0 and first is not None and first[0] == "propose" and first[1][2] != previous:
        return None
    return previous


def reference_outcome(previous: int | None, members: int, entries: list[tuple]) -> int | None:
    """The outcome of one election from its committed entries in order: the first decision, be it
    an explicit vote or the log's own (``spec_no_timeout``) when a proposal is applied."""
    previous = effective_previous(previous, 0 if not entries else entries[0][1][1], entries)
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


def ran(log: KernelLog, cell: str, executor: int, count: int = 1, **changed) -> None:
    """``cell`` ran on ``executor`` and completed: under its lease, or elected (a first proposal)."""
    if not log.holds_lease(cell, executor):
        log.apply("propose", cell, 0, executor, LEAD)
    assert complete(log, cell, 0, executor, count, **changed) is True


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


def test_the_lease_holder_runs_the_next_cell_with_one_entry():
    log = KernelLog(members=3)
    ran(log, "a", 1)
    assert log.holds_lease("b", 1) and not log.holds_lease("b", 0)
    assert complete(log, "b", 0, 0, count=2) is False  # not the holder: refused
    assert log.refused["b"] == 0 and "b" not in log.outcomes
    assert complete(log, "b", 0, 1, count=2, x=1) is True  # the holder, no election at all
    assert log.outcomes["b"].by == 1 and log.image_version == 1 and not log.elections


def test_a_holder_that_yields_begins_the_election_and_stays_sticky_for_later_attempts():
    log = KernelLog(members=3)
    ran(log, "a", 1)
    log.apply("propose", "b", 0, 1, YIELD)  # the holder cannot get the GPUs now
    assert log.elections[("b", 0)].previous == 1 and log.previous_executor == 1
    assert not log.holds_lease("b", 1)
    log.apply("propose", "b", 0, 2, LEAD)
    assert log.elections[("b", 0)].outcome == 2  # the holder yielded: the first LEAD
    assert complete(log, "b", 0, 1, count=2) is False  # the holder's lease is over for this cell
    assert complete(log, "b", 0, 2, count=2) is True and log.previous_executor == 2


def test_a_replica_handed_a_waiting_cell_late_joins_the_attempt_the_others_are_at():
    """Every server busy: attempts 0 and 1 failed, attempt 2 is open. A replica that joined the
    group meanwhile (the router hands it the waiting cell) takes part in attempt 2, where its LEAD
    wins, rather than replaying attempts already decided."""
    log = KernelLog(members=3)
    ran(log, "a", 1)
    assert log.latest_attempt("b") == -1
    for attempt in (0, 1):
        log.apply("propose", "b", attempt, 1, YIELD)
        log.apply("propose", "b", attempt, 2, YIELD)
        log.apply("vote", "b", attempt, 1, FAILED)  # the third member was silent: the timeout
    log.apply("propose", "b", 2, 1, YIELD)
    assert log.latest_attempt("b") == 2 and log.elections[("b", 2)].outcome is None
    log.apply("propose", "b", log.latest_attempt("b"), 3, LEAD)
    assert log.elections[("b", 2)].outcome == 3
    assert complete(log, "b", 2, 3, count=2) is True and log.latest_attempt("b") == -1


def test_a_proposal_by_another_replica_first_revokes_the_lease():
    """Another replica begins the election only when the router did not hand the cell to the
    holder: the lease is revoked there, in log order, and a late complete of the holder loses."""
    log = KernelLog(members=3)
    ran(log, "a", 1)
    log.apply("propose", "b", 0, 0, LEAD)
    assert log.elections[("b", 0)].previous is None and not log.holds_lease("b", 1)
    assert log.elections[("b", 0)].outcome == 0  # nobody waits for the holder: the first LEAD
    assert log.holds_lease("c", 1)  # for this cell only
    assert complete(log, "b", 0, 1, count=2) is False
    assert complete(log, "b", 0, 0, count=2) is True


def test_sticky_previous_executor_wins_over_an_earlier_lead_at_a_later_attempt():
    log = KernelLog(members=3)
    ran(log, "a", 1)
    log.apply("propose", "b", 0, 1, YIELD)
    log.apply("propose", "b", 0, 0, YIELD)
    log.apply("propose", "b", 0, 2, YIELD)
    assert log.elections[("b", 0)].outcome == FAILED  # nobody can run it now: attempt 1
    log.apply("propose", "b", 1, 0, LEAD)
    log.apply("propose", "b", 1, 2, LEAD)
    assert log.elections[("b", 1)].outcome is None  # waits for replica 1, the previous executor
    log.apply("propose", "b", 1, 1, LEAD)
    assert log.elections[("b", 1)].outcome == 1


def test_a_barrier_only_marks_a_place_in_the_log():
    log = KernelLog(members=3)
    ran(log, "a", 1, x=1)
    before = state_of(log)
    log.apply("barrier", 2, 7)
    assert log.barriers == {2: 7} and state_of(log) == before


def test_explicit_vote_first_wins_and_later_proposals_do_not_change_it():
    log = KernelLog(members=3)
    ran(log, "a", 1)
    log.apply("propose", "b", 0, 1, YIELD)
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
    ran(log, "a", 1)
    log.apply("abort", "b", 0, 0, "executor-lost", "", 2)
    assert log.previous_executor is None
    log.apply("propose", "c", 0, 2, LEAD)
    assert log.elections[("c", 0)].outcome == 2  # no wait for the lost replica
    log2 = KernelLog(members=3)
    ran(log2, "a", 1)
    log2.apply("abort", "b", 0, 0, "no-gpu", "", 2)
    assert log2.previous_executor == 1  # other aborts keep it


def test_proposals_for_a_future_cell_are_buffered_and_honoured():
    """A proposal is committed after the end of the cell before it (a replica proposes for a cell
    only once it applied the last cell's end); should one come earlier, it waits in its election
    and the cell still running keeps its own rules."""
    log = KernelLog(members=3)
    ran(log, "a", 1)
    log.apply("propose", "b", 0, 1, YIELD)  # the holder yields "b"
    log.apply("propose", "b", 0, 0, LEAD)
    assert log.elections[("b", 0)].outcome == 0
    log.apply("propose", "c", 0, 2, YIELD)  # early, for "c": revokes the holder's lease for "c" only
    log.apply("propose", "c", 0, 1, LEAD)
    assert log.elections[("c", 0)].previous is None and log.elections[("c", 0)].outcome == 1
    ran(log, "b", 0, count=2)  # "b" ends as elected, unaffected
    e = log.elections[("c", 0)]
    assert list(e.proposals.items()) == [(2, YIELD), (1, LEAD)]  # kept across "b"'s end
    assert complete(log, "c", 0, 1, count=3) is True


def test_a_buffered_election_keeps_the_previous_executor_as_of_its_first_entry():
    """Documented (Election.previous): the sticky rule of a buffered election refers to the lease
    holder as of its FIRST entry, not to the executor of the cell completed just before it runs.
    Every replica applies the same order, so all agree."""
    log = KernelLog(members=3)
    ran(log, "a", 0)
    log.apply("propose", "c", 1, 1, YIELD)  # early, an attempt 1 while "b" has not completed
    ran(log, "b", 2, count=2)
    assert log.previous_executor == 2
    log.apply("propose", "c", 1, 2, LEAD)
    assert log.elections[("c", 1)].previous == 0
    assert log.elections[("c", 1)].outcome is None  # waits for replica 0, not decided for 2
    log.apply("propose", "c", 1, 0, LEAD)
    assert log.elections[("c", 1)].outcome == 0


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
        sim.seed("propose", "z", 0, previous, LEAD)
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
    # (the lease holder is sticky only if it began the election: anyone else's first proposal revokes it)
    holder = effective_previous(previous, 0, entries)
    first_vote = next((i for i, (m, _) in enumerate(entries) if m == "vote"), len(entries))
    prev_first = next((i for i, (m, a) in enumerate(entries) if m == "propose" and a[2] == holder),
                      len(entries))
    if holder is not None and first_lead.get(holder) is LEAD and prev_first < first_vote:
        assert outcome == holder
    # without a timeout the log alone decides, the same for every apply timing
    if first_vote == len(entries):
        assert outcome == spec_no_timeout(holder, n, first_lead)
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
MULTI_ACTIONS = ["propose", "propose", "commit", "commit", "commit", "apply", "apply", "apply", "apply",
                 "act", "act", "act", "act", "timeout", "abort", "lost", "die"]


def check_replay(sim: Sim, n: int) -> Counter:
    """Apply the committed log to a fresh replica, entry by entry, against the reference."""
    ref = KernelLog(members=n)
    stats: Counter = Counter()
    per_key: dict[tuple[str, int], list[tuple]] = {}
    previous_at_first: dict[tuple[str, int], int | None] = {}
    previous = None  # the executor of the last completed cell, unless one was lost since
    for method, args in sim.committed:
        cell = args[0]
        finished = method != "barrier" and cell in ref.outcomes
        before = state_of(ref)
        if method in ("propose", "vote") and not finished:
            key = (cell, args[1])
            per_key.setdefault(key, []).append((method, args))
            previous_at_first.setdefault(key, effective_previous(previous, key[1], per_key[key]))
        refused = False
        if method == "complete" and not finished:
            # entitled: elected for this attempt, or the lease holder with no election for the cell
            e = ref.elections.get((cell, args[1]))
            entitled = (e.outcome == args[2] if e is not None else
                        args[1] == 0 and args[2] == previous and not any(k[0] == cell for k in ref.elections))
            refused = not entitled
        result = ref.apply(method, *args)
        if refused:
            assert result is False and state_of(ref) == before, (method, args)
            stats["complete refused"] += 1
        elif method == "barrier":
            assert state_of(ref) == before
        elif finished:
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
    """The replicas' side of the protocol (gpuhub.kernel.kernel and .replica), over a ``Sim``, with
    the router's dispatch: cell i goes to the replicas ``to[i]`` (the others are skipped: the router
    counted them dead), once cell i-1 ended in the committed log (the router forwards the next cell
    after the executor's reply) or every replica that got it died. Each replica works through CELLS
    in order and acts only on what it has applied itself:

    - a replica that did not get the previous cell (the router's "missed" note) commits a barrier
      and waits until it applied it before it looks at the lease;
    - the lease holder runs the cell at once (or yields: its first proposal begins the election);
    - the others wait for the end; they join an election once one began, begin one when the router
      says the holder did not get the cell, and abort the cell when the holder is lost.
    """

    def __init__(self, sim: Sim, to: list[set[int]]) -> None:
        self.sim = sim
        self.to = to
        self.cur = [0] * sim.n  # index into CELLS of the cell each replica is at
        self.attempt = [0] * sim.n
        self.phase = ["start"] * sim.n
        self.holder: list[int | None] = [None] * sim.n  # the holder a waiting replica waits for
        self.tokens = [0] * sim.n
        self.proposed: set[tuple[int, str, int]] = set()
        self.voted: set[tuple[int, str, int]] = set()
        self.started: dict[str, set[int]] = {}  # cell -> replicas that began running it
        self.truth = KernelLog(members=sim.n)  # the committed log, as the router learns of it
        self._truth_applied = 0

    def dispatched(self, i: int) -> bool:
        sim = self.sim
        while self._truth_applied < len(sim.committed):
            method, args = sim.committed[self._truth_applied]
            self.truth.apply(method, *args)
            self._truth_applied += 1
        return i == 0 or CELLS[i - 1] in self.truth.outcomes or not any(sim.alive[r] for r in self.to[i - 1])

    def advance(self, r: int) -> None:
        self.cur[r], self.attempt[r], self.phase[r] = self.cur[r] + 1, 0, "start"

    def run(self, r: int, cell: str, att: int) -> None:
        self.started.setdefault(cell, set()).add(r)
        self.sim.submit(r, "complete", cell, att, r, "ok", image_of({"cell": cell}), self.cur[r] + 1)
        self.phase[r] = "ran"

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
        i = self.cur[r]
        if i >= len(CELLS) or not self.dispatched(i):
            return
        if r not in self.to[i]:  # never got it
            if action == "act":
                self.advance(r)
            return
        log = sim.logs[r]
        cell, att, phase = CELLS[i], self.attempt[r], self.phase[r]
        ended = cell in log.outcomes
        begun = log.election_begun(cell)
        if action == "act" and ended and phase != "barrier":
            return self.advance(r)
        if phase == "start" and action == "act":
            if i > 0 and r not in self.to[i - 1]:  # missed the last cell: Replica.catch_up
                self.tokens[r] += 1
                sim.submit(r, "barrier", r, self.tokens[r])
                self.phase[r] = "barrier"
            else:
                self.phase[r] = "decide"
        elif phase == "barrier" and action == "act" and log.barriers.get(r) == self.tokens[r]:
            self.phase[r] = "decide"
        elif phase == "decide" and action == "act":  # GpuhubKernel._run_under_lease
            holder = log.previous_executor
            if begun or holder is None:
                self.phase[r] = "election"
            elif holder == r:
                if k % 2:
                    self.run(r, cell, 0)  # the GPUs are free here: run it under the lease
                else:
                    self.phase[r] = "election"  # yields: its proposal begins the election
            else:
                self.holder[r], self.phase[r] = holder, "wait"
        elif phase == "wait":  # Replica.wait_for_holder
            holder = self.holder[r]
            if action == "act" and (begun or holder not in self.to[i]):
                self.phase[r] = "election"  # the holder yielded, or never got the cell: elect
            elif action == "lost" and not sim.alive[holder]:
                sim.submit(r, "abort", cell, -1, r, "executor-lost", "", i + 1)
        elif phase == "ran" and action == "act" and log.refused.get(cell) == r:
            self.phase[r] = "follow"  # its lease was revoked before its complete: the group's result
        elif phase == "election":  # Replica.elect and the retry loop
            e = log.elections.get((cell, att))
            if action == "propose" and (r, cell, att) not in self.proposed:
                sim.submit(r, "propose", cell, att, r, bool(k % 2))
                self.proposed.add((r, cell, att))
            elif action == "timeout" and (r, cell, att) in self.proposed and (r, cell, att) not in self.voted:
                if e is not None and e.outcome is None and not ended:
                    choice = local_choice(e, timed_out=True)
                    if choice is not None:
                        sim.submit(r, "vote", cell, att, r, choice)
                        self.voted.add((r, cell, att))
            elif action == "abort" and not ended:
                reason = ["executor-lost", "no-gpu", "interrupted"][k % 3]
                sim.submit(r, "abort", cell, att, r, reason, "", i + 1)
            elif action == "lost" and not ended and e is not None and e.outcome not in (None, FAILED):
                if not sim.alive[e.outcome]:  # the executor's replica is gone: end the cell
                    sim.submit(r, "abort", cell, att, r, "executor-lost", "", i + 1)
            elif action == "act" and e is not None and e.outcome == r:
                self.run(r, cell, att)  # elected here: run it, publish the result
            elif action == "act" and e is not None and e.outcome == FAILED:
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
        raise AssertionError(f"no progress: live replicas at cells {self.cur}, phases {self.phase}, "
                             f"attempts {self.attempt}")


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_many_cells_under_any_interleaving(data):
    n = data.draw(st.integers(1, 5), label="members")
    sim = Sim(n)
    to = [data.draw(st.sets(st.integers(0, n - 1), min_size=1), label=f"cell {c} handed to") for c in CELLS]
    kernels = Kernels(sim, to)
    for i in range(len(CELLS)):  # chaos, then calm until every live replica is past cell i
        steps = data.draw(st.lists(st.tuples(st.sampled_from(MULTI_ACTIONS), st.integers(0, n - 1),
                                             st.integers(0, 7)), max_size=60), label=f"steps {i}")
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
    # a cell runs at most once: never under a lease and elected, never on two replicas
    assert all(len(v) <= 1 for v in kernels.started.values()), kernels.started
    # every cell that a replica still alive got has ended
    assert {c for c, t in zip(CELLS, to, strict=True) if any(sim.alive[r] for r in t)} <= set(replayed.outcomes)
    for cell, outcome in replayed.outcomes.items():
        if outcome.kind == "complete":
            assert kernels.started.get(cell) == {outcome.by}  # the one that ran it
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
    elected = {a[0] for m, a in sim.committed if m == "propose"}
    event(f"cells run under the lease: {sum(1 for c in completed if c not in elected)}")
    event(f"barriers: {min(sum(1 for m, _ in sim.committed if m == 'barrier'), 1)}+")
    event(f"lease completes refused: {min(stats['complete refused'], 1)}+")


def scripted(n: int, to: list[set[int]], script: list[tuple[str, int, int]]) -> Kernels:
    """Run ``script`` (action, replica, k) over the protocol model; commit/apply only when told."""
    kernels = Kernels(Sim(n), to)
    for action, r, k in script:
        kernels.step(action, r, k)
    return kernels


def everyone(kernels: Kernels, action: str, k: int = 1) -> list[tuple[str, int, int]]:
    return [(action, r, k) for r in range(kernels.sim.n)]


def test_a_replica_that_missed_a_cell_catches_up_before_it_trusts_the_lease():
    """Replica 0 ran "a"; the router skipped it for "b" (counted dead), so 1 and 2 revoked its lease
    and 1 ran "b". Back for "c", replica 0 has not applied "b" yet: without its barrier it would
    still see itself as the holder and run "c" beside replica 1, the real holder."""
    to = [{0, 1, 2}, {1, 2}, {0, 1, 2}, {0, 1, 2}]
    k = Kernels(Sim(3), to)
    a = [("act", 0, 1), ("act", 1, 1), ("act", 2, 1)]  # start -> decide
    for step in a + a + [("propose", 0, 1), ("propose", 1, 0), ("propose", 2, 0)]:
        k.step(*step)
    while k.sim.pending:
        k.sim.commit(0)
    for r in range(3):
        while k.sim.applied[r] < len(k.sim.committed):
            k.sim.apply_next(r)
    k.step("act", 0, 1)  # elected: runs "a"
    k.sim.commit(0)
    for r in (0, 1, 2):
        k.sim.apply_next(r)
    for r in (0, 1, 2):
        k.step("act", r, 1)  # "a" ended: on to "b" (replica 0 skips it)
    assert k.cur == [1, 1, 1]
    k.step("act", 0, 1)  # not handed "b": on to "c", whose dispatch waits for "b" to end
    for step in [("act", 1, 1), ("act", 2, 1), ("act", 1, 1), ("act", 2, 1), ("act", 1, 1),
                 ("act", 2, 1), ("propose", 1, 1), ("propose", 2, 0)]:
        k.step(*step)  # start, decide (holder 0 waited on), not handed "b": elect; 1 LEADs
    while k.sim.pending:
        k.sim.commit(0)
    for r in (1, 2):
        while k.sim.applied[r] < len(k.sim.committed):
            k.sim.apply_next(r)
    k.step("act", 1, 1)  # elected: runs "b"
    k.sim.commit(0)
    for r in (1, 2):
        k.sim.apply_next(r)
    assert k.dispatched(2)  # "b" ended: the router hands out "c"
    for step in [("act", 1, 1), ("act", 2, 1)] * 3 + [("act", 0, 1)] * 3:
        k.step(*step)  # "c": 1 holds the lease and runs it; replica 0, behind, must not
    assert k.started["c"] == {1}
    assert k.phase[0] == "barrier"  # waiting to apply its barrier, not running "c"
    k.sim.finish()
    for _ in range(3):
        k.step("act", 0, 1)
    assert k.started["c"] == {1}


def test_followers_elect_only_when_the_holder_was_not_handed_the_cell():
    """The holder got "b" and runs it; the others wait. Had they elected anyway, two would run it."""
    k = scripted(3, [{0, 1, 2}] * 4, [])
    k.drain(upto=1)
    holder = k.truth.previous_executor
    for _ in range(3):
        for r in range(3):
            k.step("act", r, 1)  # the holder runs "b" under its lease; the others wait
    assert k.started["b"] == {holder}
    assert all(k.phase[r] == "wait" for r in range(3) if r != holder)
    for r in range(3):
        k.step("propose", r, 1)  # a follower proposes only in an election: nothing to propose here
    assert not k.sim.pending or all(m == "complete" for _, m, _ in k.sim.pending)
    k.drain(upto=2)
    assert k.started["b"] == {holder}
