"""The one status line a cell shows while it waits for GPUs.

A cell whose kernel's servers are all busy says so in its output: that it waits, how long so far,
and when it moves the kernel to another server. Printed to stderr, each new word was one more line
left in the notebook for good (a line every 30 s of a long wait). It is one display output instead
(``display_data`` with a ``display_id``, then ``update_display_data``: Jupyter's own way to change
an output in place), and when the cell starts its last form says how long it waited. Clients that
do not update displays in place (a terminal console) show its first form only.

The display id is the cell's, so it is the same on every replica: whichever replica speaks for
the waiting cell updates the same line. The replica that runs the cell changes it too when the wait
ends, even if another showed it: only the executor's outputs are ordered before the cell's own
outputs and its idle, so a follower's last word could reach the client after the cell had ended.
"""

from __future__ import annotations

from collections.abc import Callable

# (msg_type, content) to the kernel's iopub, as a reply to the waiting cell.
Publish = Callable[[str, dict], None]

DISPLAY_ID_PREFIX = "gpuhub-wait-"

# Elections are numbered alike on every replica. The first one of a cell is tentative and says
# nothing; one that found every server busy after it shows the line. So a cell decided at this
# attempt or later has had its line shown.
SHOWN_FROM_ATTEMPT = 2


def display_id(cell: str) -> str:
    return DISPLAY_ID_PREFIX + cell


class WaitNotice:
    """One waiting cell's status line, as this replica has shown it."""

    def __init__(self, cell: str, publish: Publish) -> None:
        self.cell = cell
        self.publish = publish
        self.text: str | None = None  # what this replica showed last; None: nothing yet

    def show(self, text: str) -> None:
        """Show ``text`` as the cell's status line: a new output the first time, the same one after."""
        if text == self.text:
            return
        self.publish("display_data" if self.text is None else "update_display_data", self._content(text))
        self.text = text

    def settle(self, text: str, *, runs_it_after: int | None = None) -> None:
        """The cell's wait is over: its line becomes ``text`` if this replica showed it, or if this
        replica runs the cell (``runs_it_after``: the attempt that elected it) after the line was
        shown by whichever replica showed it."""
        if self.text is not None:
            self.show(text)
        elif runs_it_after is not None and runs_it_after >= SHOWN_FROM_ATTEMPT:
            self.publish("update_display_data", self._content(text))
            self.text = text

    def _content(self, text: str) -> dict:
        return {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": display_id(self.cell)}}


def notice_text(msg_type: str, content: dict) -> str | None:
    """The status line's text if an iopub message (type and content) shows or updates one, else None."""
    if msg_type not in ("display_data", "update_display_data"):
        return None
    if not str((content.get("transient") or {}).get("display_id", "")).startswith(DISPLAY_ID_PREFIX):
        return None
    return str((content.get("data") or {}).get("text/plain", ""))
