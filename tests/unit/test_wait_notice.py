"""The "waiting for a GPU" status line: one output, changed in place, that says at the end how
long the cell waited (gpuhub/kernel/wait_notice.py)."""

from __future__ import annotations

from gpuhub.kernel.wait_notice import WaitNotice, notice_text


def sent_by(notice_cell: str):
    sent: list[tuple[str, dict]] = []
    return WaitNotice(notice_cell, lambda kind, content: sent.append((kind, content))), sent


def test_the_first_word_is_a_display_and_later_ones_update_it_in_place():
    notice, sent = sent_by("cell-1")
    notice.show("[gpuhub] waiting for 1 GPU(s): all busy; waited 0 s…")
    notice.show("[gpuhub] waiting for 1 GPU(s): all busy; waited 0 s…")  # nothing new: nothing sent
    notice.show("[gpuhub] waiting for 1 GPU(s): all busy; waited 30 s…")
    notice.settle("[gpuhub] waited 41 s for 1 GPU(s); running on gpu2")
    assert [kind for kind, _ in sent] == ["display_data", "update_display_data", "update_display_data"]
    ids = {content["transient"]["display_id"] for _, content in sent}
    assert ids == {"gpuhub-wait-cell-1"}
    assert [notice_text(kind, content) for kind, content in sent] == [
        "[gpuhub] waiting for 1 GPU(s): all busy; waited 0 s…",
        "[gpuhub] waiting for 1 GPU(s): all busy; waited 30 s…",
        "[gpuhub] waited 41 s for 1 GPU(s); running on gpu2",
    ]


def test_a_cell_that_never_waited_shows_nothing():
    notice, sent = sent_by("cell-2")
    notice.settle("[gpuhub] waited 0 s for 1 GPU(s)")
    assert sent == []


def test_other_outputs_are_not_notices():
    assert notice_text("stream", {"name": "stderr", "text": "waiting"}) is None
    assert notice_text("display_data", {"data": {"text/plain": "x"}, "metadata": {}}) is None
    assert notice_text("display_data", {"data": {"text/plain": "x"}, "transient": {"display_id": "mine"}}) is None


def test_the_replica_that_runs_the_cell_ends_a_line_another_replica_showed():
    # Only the executor's outputs come before the cell's own outputs and its idle, so it settles
    # the line too; a follower's word could reach the client after the cell has ended.
    notice, sent = sent_by("cell-3")
    notice.settle("[gpuhub] waited 0 s for 1 GPU(s); running on gpu1", runs_it_after=0)  # no line was shown
    notice.settle("[gpuhub] waited 0 s for 1 GPU(s); running on gpu1", runs_it_after=1)
    assert sent == []
    notice.settle("[gpuhub] waited 31 s for 1 GPU(s); running on gpu1", runs_it_after=2)
    assert [(kind, notice_text(kind, content)) for kind, content in sent] == [
        ("update_display_data", "[gpuhub] waited 31 s for 1 GPU(s); running on gpu1")]
