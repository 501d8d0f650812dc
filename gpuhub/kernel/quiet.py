"""Output that must not reach the notebook: what a replica's own work prints.

A replica that loads a namespace image imports the modules its values refer to and runs their
classes' unpickling code; a GPU kernel's replica also imports what a cell's process imported
(gpuhub/kernel/warm_imports.py). Whatever that prints or warns was already shown once, by the cell
that made the value, as a plain kernel shows it; printed again here it would reach the notebook as
more output of the last cell (once per replica). Logging is unaffected: its handlers keep their own
streams.

The swap is process-wide, not per thread: while a replica joins its group, the join thread loads
the namespace with the sink in place, and a request the kernel's thread dispatches meanwhile sets
its parent header on the sink instead of on the kernel's streams. So every replicated cell sets its
parent again before it runs (``GpuhubKernel.do_execute``).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """Drop what is printed to sys.stdout/sys.stderr and every warning, for the block's duration."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
