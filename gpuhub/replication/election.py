"""Who executes a cell: the executor election, as pure functions of the committed log.

Most cells need none: the executor of the last cell holds a lease on the next one and runs it
when it can get the GPUs (``KernelLog.holds_lease``). An election begins when it cannot (it
proposes YIELD) or when the router did not hand it the cell (another replica's proposal then
begins the election, and ``previous`` below is None: nobody waits for the holder).

Every replica of a kernel asks its own agent for the cell's GPUs and proposes LEAD (it got them)
or YIELD (it did not) through the Raft log. Each replica then decides locally, from the proposals
committed so far, whom it would pick, and commits that as its VOTE. The first committed vote is the
outcome for everyone: local decisions may differ (a timeout fired earlier on one host), the log
order cannot. A choice that needs no timeout depends on the log alone, so the log itself records it
as the vote when the proposal that makes it possible is applied (see ``KernelLog.propose``); only
timeouts need an explicit vote entry. Nothing here touches a clock or a socket, so the property tests can drive any
interleaving of proposals, votes and timeouts.

The local choice (NotebookOS's rule, made sticky and bounded):
1. the previous executor, if it proposed LEAD (its GPUs and caches are warm);
2. otherwise the first committed LEAD, once the previous executor has yielded, or there is no
   previous executor, or every member has proposed;
3. every member proposed and none LEADs → FAILED (nobody can run it now: wait and retry);
4. the timeout after the first proposal (a member may be dead): the first LEAD, else FAILED.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAILED = -1  # vote/outcome: no replica can run this attempt


@dataclass
class Election:
    """The committed facts about one attempt at one cell, in log order."""

    cell: str
    attempt: int
    previous: int | None  # the executor of the last completed cell, as of this election's first entry
    members: int  # replicas in the group
    proposals: dict[int, bool] = field(default_factory=dict)  # replica -> LEAD?, first per replica only
    outcome: int | None = None  # the first committed vote: a replica id or FAILED

    def add_proposal(self, replica: int, lead: bool) -> None:
        self.proposals.setdefault(replica, lead)  # a repeated proposal (a retried call) changes nothing

    def add_vote(self, choice: int) -> bool:
        """Record a committed vote; True when it decided the election (it was the first)."""
        if self.outcome is not None:
            return False
        self.outcome = choice
        return True

    @property
    def leads(self) -> list[int]:
        return [r for r, lead in self.proposals.items() if lead]


def local_choice(e: Election, timed_out: bool) -> int | None:
    """What this replica votes for now, or None to keep waiting for more proposals."""
    leads = e.leads
    if e.previous is not None and e.proposals.get(e.previous):
        return e.previous
    previous_done = e.previous is None or e.previous in e.proposals
    if leads and previous_done:
        return leads[0]
    if len(e.proposals) >= e.members:
        return leads[0] if leads else FAILED
    if timed_out and e.proposals:
        return leads[0] if leads else FAILED
    return None
