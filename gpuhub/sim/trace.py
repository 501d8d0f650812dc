"""Notebook workload traces: a directory with ``sessions.csv`` and ``cells.csv``.

``sessions.csv``: ``session_id,start_s,end_s,gpus`` — a notebook kernel that lives from ``start_s`` to
``end_s`` (seconds, any origin) and asks for ``gpus`` GPUs per cell (0: CPU-only kernel).

``cells.csv``: ``session_id,submit_s,duration_s,gpus`` — one executed cell: submitted at
``submit_s``, running ``duration_s`` seconds once it starts, needing ``gpus`` GPUs (0: CPU-only cell;
never more than its session's ``gpus``).

Extra columns are ignored; column order is free. Errors name the file and the line.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field

SESSION_COLUMNS = ("session_id", "start_s", "end_s", "gpus")
CELL_COLUMNS = ("session_id", "submit_s", "duration_s", "gpus")


class TraceError(ValueError):
    """A trace that cannot be simulated; the message names the file and line where it can."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        self.path = path
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


@dataclass
class Session:
    session_id: str
    start_s: float
    end_s: float
    gpus: int
    # cells in submission order: (submit_s, duration_s, gpus)
    cells: list[tuple[float, float, int]] = field(default_factory=list)


@dataclass
class Trace:
    sessions: list[Session]

    @property
    def cell_count(self) -> int:
        return sum(len(s.cells) for s in self.sessions)

    def reserved_gpu_seconds(self) -> float:
        return sum(s.gpus * (s.end_s - s.start_s) for s in self.sessions)

    def busy_gpu_seconds(self) -> float:
        return sum(g * d for s in self.sessions for (_, d, g) in s.cells)


def _num(
    value: str, column: str, path: str, line: int, *, integer: bool = False
) -> float:
    text = (value or "").strip()
    if text == "":
        raise TraceError(f"column {column!r} is empty", path, line)
    try:
        x = int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise TraceError(
            f"column {column!r} must be {kind}, got {text!r}", path, line
        ) from None
    if not integer and not math.isfinite(x):
        raise TraceError(f"column {column!r} must be finite, got {text!r}", path, line)
    if x < 0:
        raise TraceError(
            f"column {column!r} must not be negative, got {text!r}", path, line
        )
    return x


def _reader(path: str, required: tuple[str, ...]):
    try:
        fh = open(path, newline="", encoding="utf-8")  # noqa: SIM115 (closed by _rows)
    except FileNotFoundError:
        raise TraceError("file not found", path) from None
    except OSError as exc:
        raise TraceError(f"cannot read: {exc.strerror}", path) from None
    reader = csv.reader(fh)
    try:
        header = next(reader)
    except StopIteration:
        fh.close()
        raise TraceError(
            "empty file (expected a header line: " + ",".join(required) + ")", path, 1
        ) from None
    except (csv.Error, UnicodeDecodeError) as exc:
        fh.close()
        raise TraceError(f"unreadable CSV: {exc}", path, 1) from None
    names = [h.strip() for h in header]
    missing = [c for c in required if c not in names]
    if missing:
        fh.close()
        raise TraceError(
            f"header lacks column(s) {', '.join(missing)} (found: {', '.join(names) or 'nothing'})",
            path,
            1,
        )
    index = tuple(names.index(c) for c in required)
    return fh, reader, index


def _rows(path: str, required: tuple[str, ...]):
    """Yield (line_number, [values of the required columns]) for each non-blank data line."""
    fh, reader, index = _reader(path, required)
    width = max(index) + 1
    with fh:
        try:
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) < width:
                    raise TraceError(
                        f"expected at least {width} fields, got {len(row)}", path, line
                    )
                yield line, [row[i] for i in index]
        except csv.Error as exc:
            raise TraceError(f"unreadable CSV: {exc}", path, reader.line_num) from None
        except UnicodeDecodeError as exc:
            raise TraceError(
                f"not UTF-8 text: {exc}", path, reader.line_num + 1
            ) from None


def load_trace(directory: str) -> Trace:
    """Read and validate a trace directory; raise :class:`TraceError` on the first problem."""
    if not os.path.isdir(directory):
        raise TraceError(
            "not a directory (expected sessions.csv and cells.csv inside)", directory
        )
    spath = os.path.join(directory, "sessions.csv")
    cpath = os.path.join(directory, "cells.csv")
    sessions: dict[str, Session] = {}
    for line, (sid, start, end, gpus) in _rows(spath, SESSION_COLUMNS):
        sid = sid.strip()
        if not sid:
            raise TraceError("column 'session_id' is empty", spath, line)
        if sid in sessions:
            raise TraceError(f"duplicate session_id {sid!r}", spath, line)
        s = _num(start, "start_s", spath, line)
        e = _num(end, "end_s", spath, line)
        g = int(_num(gpus, "gpus", spath, line, integer=True))
        if e < s:
            raise TraceError(f"end_s ({e:g}) is before start_s ({s:g})", spath, line)
        sessions[sid] = Session(sid, s, e, g)
    for line, (sid, submit, duration, gpus) in _rows(cpath, CELL_COLUMNS):
        sid = sid.strip()
        sess = sessions.get(sid)
        if sess is None:
            raise TraceError(f"session_id {sid!r} is not in sessions.csv", cpath, line)
        t = _num(submit, "submit_s", cpath, line)
        d = _num(duration, "duration_s", cpath, line)
        g = int(_num(gpus, "gpus", cpath, line, integer=True))
        if g > sess.gpus:
            raise TraceError(
                f"cell asks for {g} GPU(s) but session {sid!r} has {sess.gpus}",
                cpath,
                line,
            )
        if t < sess.start_s or t > sess.end_s:
            raise TraceError(
                f"submit_s ({t:g}) is outside session {sid!r} ({sess.start_s:g}..{sess.end_s:g})",
                cpath,
                line,
            )
        sess.cells.append((t, d, g))
    for sess in sessions.values():
        sess.cells.sort(
            key=lambda c: c[0]
        )  # stable: equal submit times keep file order
    return Trace(list(sessions.values()))


def write_trace(trace: Trace, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(
        os.path.join(directory, "sessions.csv"), "w", newline="", encoding="utf-8"
    ) as fh:
        w = csv.writer(fh)
        w.writerow(SESSION_COLUMNS)
        for s in trace.sessions:
            w.writerow((s.session_id, _fmt(s.start_s), _fmt(s.end_s), s.gpus))
    with open(
        os.path.join(directory, "cells.csv"), "w", newline="", encoding="utf-8"
    ) as fh:
        w = csv.writer(fh)
        w.writerow(CELL_COLUMNS)
        for s in trace.sessions:
            sid = s.session_id
            w.writerows((sid, _fmt(t), _fmt(d), g) for (t, d, g) in s.cells)


def _fmt(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".") if x != int(x) else str(int(x))
