import pytest

from gpuhub.sim.trace import Session, Trace, TraceError, load_trace, write_trace

SESSIONS = "session_id,start_s,end_s,gpus\na,0,100,1\nb,10,50,4\n"
CELLS = "session_id,submit_s,duration_s,gpus\na,5,10,1\na,1,2,0\nb,20,5,4\n"


def test_loads_and_sorts_cells(write_trace_files):
    tr = load_trace(write_trace_files(SESSIONS, CELLS))
    a, b = tr.sessions
    assert (a.session_id, a.start_s, a.end_s, a.gpus) == ("a", 0.0, 100.0, 1)
    assert a.cells == [(1.0, 2.0, 0), (5.0, 10.0, 1)]
    assert b.cells == [(20.0, 5.0, 4)]
    assert tr.cell_count == 3


def test_extra_columns_and_column_order_are_free(write_trace_files):
    d = write_trace_files(
        "gpus,note,session_id,end_s,start_s\n2,hello,x,10,0\n",
        "session_id,user,gpus,duration_s,submit_s\nx,u1,2,3,4\n",
    )
    (s,) = load_trace(d).sessions
    assert (s.gpus, s.start_s, s.end_s, s.cells) == (2, 0.0, 10.0, [(4.0, 3.0, 2)])


@pytest.mark.parametrize(
    "sessions,cells,where,words",
    [
        ("session_id,start_s,gpus\na,0,1\n", CELLS, "sessions.csv:1", "end_s"),
        ("session_id,start_s,end_s,gpus\na,0,x,1\n", CELLS, "sessions.csv:2", "end_s"),
        (SESSIONS + "c,0,10,-1\n", CELLS, "sessions.csv:4", "negative"),
        (SESSIONS + "c,0,10,1.5\n", CELLS, "sessions.csv:4", "integer"),
        (SESSIONS + "c,20,10,1\n", CELLS, "sessions.csv:4", "before start_s"),
        (SESSIONS + "a,0,10,1\n", CELLS, "sessions.csv:4", "duplicate"),
        (SESSIONS + "c,0,inf,1\n", CELLS, "sessions.csv:4", "finite"),
        (SESSIONS + "c,0\n", CELLS, "sessions.csv:4", "fields"),
        ("", CELLS, "sessions.csv:1", "empty"),
        (SESSIONS, CELLS + "zz,1,1,0\n", "cells.csv:5", "not in sessions.csv"),
        (SESSIONS, CELLS + "a,1,1,2\n", "cells.csv:5", "2 GPU(s)"),
        (SESSIONS, CELLS + "a,500,1,0\n", "cells.csv:5", "outside session"),
        (SESSIONS, CELLS + "a,1,,0\n", "cells.csv:5", "empty"),
        (SESSIONS, "session_id,submit_s,gpus\n", "cells.csv:1", "duration_s"),
        (SESSIONS, CELLS + "\n\na,1,oops,0\n", "cells.csv:7", "duration_s"),
    ],
)
def test_errors_name_file_and_line(write_trace_files, sessions, cells, where, words):
    d = write_trace_files(sessions, cells)
    with pytest.raises(TraceError) as exc:
        load_trace(d)
    msg = str(exc.value)
    assert where in msg and words in msg
    assert exc.value.path.endswith(where.split(":")[0])
    assert exc.value.line == int(where.split(":")[1])


def test_missing_files(tmp_path):
    with pytest.raises(TraceError, match="not a directory"):
        load_trace(str(tmp_path / "nope"))
    (tmp_path / "sessions.csv").write_text(SESSIONS)
    with pytest.raises(TraceError, match=r"cells\.csv: file not found"):
        load_trace(str(tmp_path))


def test_write_then_load_round_trip(tmp_path):
    tr = Trace(
        [
            Session("s1", 0.0, 100.5, 1, [(1.25, 2.5, 1), (10.0, 3.0, 0)]),
            Session("s2", 3.0, 4.0, 0, []),
        ]
    )
    write_trace(tr, str(tmp_path / "t"))
    back = load_trace(str(tmp_path / "t"))
    assert [
        (s.session_id, s.start_s, s.end_s, s.gpus, s.cells) for s in back.sessions
    ] == [(s.session_id, s.start_s, s.end_s, s.gpus, s.cells) for s in tr.sessions]
