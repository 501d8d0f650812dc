import os

import pytest


@pytest.fixture
def write_trace_files(tmp_path):
    """write_trace_files(sessions_csv, cells_csv) -> directory with those two files."""

    def write(sessions: str, cells: str, name: str = "trace") -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "sessions.csv").write_text(sessions)
        (d / "cells.csv").write_text(cells)
        return os.fspath(d)

    return write
