import json

from gpuhub.sim.cli import main
from gpuhub.sim.generate import GenConfig, generate, trace_stats
from gpuhub.sim.trace import load_trace

KEYS = {
    "policy",
    "cells",
    "gpu_hours_reserved",
    "gpu_hours_committed",
    "gpu_hours_provisioned",
    "gpu_hours_saved_vs_reservation",
    "delay_p50_s",
    "delay_p95_s",
    "delay_p99_s",
    "frac_started_within_1s",
    "frac_started_within_10s",
    "migrations",
    "gpu_hours_saved_provisioned",
    "gpu_hours_physical_limit",
    "delay_max_s",
    "cells_over_grant_timeout",
    "servers_released",
    "servers_acquired",
}


def test_generate_then_run_round_trip(tmp_path, capsys):
    out = str(tmp_path / "gen")
    assert (
        main(
            [
                "generate",
                out,
                "--sessions",
                "12",
                "--hours",
                "10",
                "--seed",
                "3",
                "--stats",
            ]
        )
        == 0
    )
    assert "wrote 12 sessions" in capsys.readouterr().out
    trace = load_trace(out)
    assert len(trace.sessions) == 12 and trace.cell_count > 0
    assert main(["run", out, "--json", "--policy", "gpuhub"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj.keys() >= KEYS
    assert (
        obj["policy"] == "gpuhub"
        and obj["cells"] == trace.cell_count
        and isinstance(obj["migrations"], int)
    )
    assert main(["run", out, "--policy", "all", "--autoscale", "--closed-loop"]) == 0
    table = capsys.readouterr().out
    assert "reservation" in table and "batch" in table and "delay p95 (s)" in table
    assert main(["run", out, "--policy", "all", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(x)["policy"] for x in lines] == [
        "reservation",
        "batch",
        "gpuhub",
    ]


def test_generate_is_deterministic(tmp_path):
    a, b = (
        generate(GenConfig(sessions=5, seed=9)),
        generate(GenConfig(sessions=5, seed=9)),
    )
    assert [(s.start_s, s.cells) for s in a.sessions] == [
        (s.start_s, s.cells) for s in b.sessions
    ]


def test_generated_trace_follows_published_figures():
    stats = trace_stats(generate(GenConfig(sessions=600, hours=96, seed=5)))
    assert 240 <= stats["long_cell_duration_p50_s"] <= 420  # published 5-6 min
    assert 1300 <= stats["long_cell_duration_p90_s"] <= 2600  # published 32 min
    assert 0.15 <= stats["busy_frac_of_reserved"] <= 0.35  # published about 25%
    assert 120 <= stats["long_think_p50_s"] <= 300  # published 3 min
    assert stats["short_cell_frac"] > 0.3 and all(
        stats["cells_by_gpus"][g] for g in (0, 1, 4, 8)
    )


def test_bad_trace_exits_2_with_file_and_line(write_trace_files, capsys):
    d = write_trace_files(
        "session_id,start_s,end_s,gpus\na,0,10,1\n",
        "session_id,submit_s,duration_s,gpus\na,1,x,1\n",
    )
    assert main(["run", d]) == 2
    err = capsys.readouterr().err
    assert "cells.csv:2" in err and "duration_s" in err


def test_bad_config_exits_2(write_trace_files, capsys):
    d = write_trace_files(
        "session_id,start_s,end_s,gpus\na,0,10,8\n",
        "session_id,submit_s,duration_s,gpus\n",
    )
    assert main(["run", d, "--gpus-per-node", "4"]) == 2
    assert "8 GPUs but nodes have 4" in capsys.readouterr().err


def test_plot(tmp_path, capsys):
    out = str(tmp_path / "gen")
    main(["generate", out, "--sessions", "5", "--hours", "5"])
    png = str(tmp_path / "p.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["run", out, "--plot", png]) == 2
        assert "pip install 'gpuhub[sim]'" in capsys.readouterr().err
        return
    assert main(["run", out, "--policy", "all", "--autoscale", "--plot", png]) == 0
    with open(png, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_on_request(tmp_path, capsys):
    out = str(tmp_path / "gen")
    main(["generate", out, "--sessions", "3", "--hours", "3"])
    capsys.readouterr()
    assert main(["run", out, "--progress"]) == 0
    assert "100%" in capsys.readouterr().err
    assert main(["run", out]) == 0
    assert capsys.readouterr().err == ""  # not a TTY, not asked


def test_elastic_run_reports_the_pool(tmp_path, capsys):
    out = str(tmp_path / "gen")
    main(["generate", out, "--sessions", "12", "--hours", "10", "--seed", "2"])
    capsys.readouterr()
    assert main(["run", out, "--json", "--elastic", "--acquire-s", "60", "--pool-spare-servers", "1"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["elastic"] is True and obj["servers_acquired"] >= 1
    assert obj["gpu_hours_saved_provisioned"] == obj["gpu_hours_reserved"] - obj["gpu_hours_provisioned"]
    assert obj["cells_over_grant_timeout"] >= 0 and obj["delay_max_s"] >= obj["delay_p99_s"]
    assert main(["run", out, "--policy", "all", "--elastic"]) == 0
    table = capsys.readouterr().out
    # the headline leads with the servers kept on; the pool runs the gpuhub column only
    assert table.splitlines()[3].startswith("GPU-hours provisioned (servers on)")
    assert "gpuhub, elastic pool" in table and "reservation, " in table
    assert main(["run", out, "--elastic", "--autoscale"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert main(["run", out, "--elastic", "--pool-min-active", "0"]) == 2
    assert "pool_min_active" in capsys.readouterr().err
