"""The parity tool itself: layouts parsed into CLI arguments, and the comparison
every layout test relies on (a comparison that always said 0 would pass them all)."""

import json
import math
import subprocess
from pathlib import Path

import pytest

from trainlib import parity
from trainlib.config import ConfigError
from trainlib.parity import LayoutRun, WorkerPool, default_pool, parse_layout, run_layout, run_parity


@pytest.fixture(autouse=True)
def _fresh_processes():
    """These tests fake or compare the launch itself: no session-wide worker pool."""
    with default_pool(None):
        yield


def test_parse_layout():
    nproc, args = parse_layout("dp_replicate=2,dp_shard=2,training.local_batch_size=1")
    assert nproc == 4
    assert "--training.local_batch_size=1" in args and "--parallelism.dp_shard=2" in args
    assert "--parallelism.tp=1" in args


def _run_layouts_as(curves: dict, monkeypatch) -> None:
    """Each layout's run gives `curves[layout]` (losses, grad norms), as its metrics.jsonl would; nothing runs."""
    monkeypatch.setattr(parity, "run_layout",
                        lambda recipe, spec, *a, **k: LayoutRun(spec or "single", 2, *curves[spec]))


def test_each_layout_is_compared_step_by_step_with_the_baseline(monkeypatch, tmp_path):
    curves = {  # layout -> (losses, grad norms)
        "": ([4.0, 2.0, 1.0], [10.0, 5.0, 2.0]),
        "dp_shard=2": ([4.0, 2.0, 1.0], [10.0, 5.0, 2.0]),
        "tp=2": ([4.0, 2.02, 1.0], [10.0, 5.0, 2.5]),  # 1% off in loss at step 2, 25% in grad norm at step 3
        "pp=2": ([4.0, 2.0], [10.0, 5.0]),  # a run that stopped early
        "cp=2": ([4.0, float("nan"), 1.0], [10.0, 5.0, 2.0]),
    }
    _run_layouts_as(curves, monkeypatch)
    report = run_parity(None, ["dp_shard=2", "tp=2", "pp=2", "cp=2"], steps=3, out_dir=tmp_path)
    got = {r.name: (r.max_rel_loss, r.max_rel_grad_norm) for r in report.runs}
    assert got["dp_shard=2"] == (0.0, 0.0)
    assert math.isclose(got["tp=2"][0], 0.01) and math.isclose(got["tp=2"][1], 0.25)
    assert got["pp=2"] == (math.inf, math.inf)
    assert got["cp=2"] == (math.inf, 0.0)
    assert report.max_rel_loss == report.max_rel_grad_norm == math.inf


def test_cli_fails_a_layout_past_the_tolerance(monkeypatch, capsys):
    _run_layouts_as({"": ([4.0, 2.0], [1.0, 1.0]), "tp=2": ([4.0, 2.0002], [1.0, 1.0])}, monkeypatch)  # 1e-4 off
    assert parity.main(["--layouts", "tp=2", "--steps", "2"]) == 1
    assert "FAIL: max relative loss deviation 1.00e-04 (tolerance 1e-05)" in capsys.readouterr().out
    assert parity.main(["--layouts", "tp=2", "--steps", "2", "--tol", "1e-3"]) == 0
    assert "PASS: max relative loss deviation 1.00e-04 (tolerance 1e-03)" in capsys.readouterr().out


def test_table_shows_each_steps_deviation_a_missing_step_and_each_layouts_maximum(monkeypatch):
    curves = {"": ([4.0, 2.0], [1.0, 1.0]), "tp=2": ([4.0, 2.02], [1.0, 1.5]), "pp=2": ([4.0], [1.0])}
    _run_layouts_as(curves, monkeypatch)
    lines = run_parity(None, ["tp=2", "pp=2"], steps=2).table().splitlines()
    assert lines[0].split() == ["step", "baseline", "loss", "tp=2", "pp=2"]
    assert lines[2].split() == ["1", "4.000000", "0.00e+00", "0.00e+00"]
    assert lines[3].split() == ["2", "2.000000", "1.00e-02", "missing"]
    assert lines[4] == "max relative deviation (loss / grad_norm):"
    assert lines[5].split() == ["tp=2", "1.00e-02", "/", "5.00e-01", "(2", "procs)"]
    assert lines[6].split() == ["pp=2", "inf", "/", "inf", "(2", "procs)"]
    assert len(lines) == 7


def _fake_job(monkeypatch, returncode=0, stderr="", metrics=()):
    """`_run` answers as a job would: it writes `metrics` to the run folder its command names; the commands are kept."""
    commands = []

    def run(cmd, name, timeout):
        commands.append(cmd)
        folder = Path(next(a for a in cmd if a.startswith("--job.dump_folder=")).partition("=")[2])
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        return subprocess.CompletedProcess(cmd, returncode, "out\n", stderr)

    monkeypatch.setattr(parity, "_run", run)
    return commands


def test_run_layout_launches_the_layouts_world_and_reads_its_curve(monkeypatch, tmp_path):
    commands = _fake_job(monkeypatch, metrics=[{"loss": 3.0, "grad_norm": 2.0}, {"loss": 2.5, "grad_norm": 1.5}])
    run = parity.run_layout("r.toml", "dp_shard=2,tp=2", 2, tmp_path, ["--optimizer.lr=1e-3"])
    assert (run.name, run.nproc, run.losses, run.grad_norms) == ("dp_shard=2,tp=2", 4, [3.0, 2.5], [2.0, 1.5])
    assert run.output == "out\n"
    cmd = commands[0]
    assert "--nproc-per-node=4" in cmd and cmd[cmd.index("--recipe") + 1] == "r.toml"
    assert {"--training.steps=2", "--optimizer.lr=1e-3", "--parallelism.tp=2", "--parallelism.dp_shard=2",
            f"--job.dump_folder={tmp_path / 'dp_shard2_tp2'}"} <= set(cmd)
    single = parity.run_layout(None, "", 2, tmp_path / "b")
    assert single.name == "single" and "--recipe" not in commands[1] and "torch.distributed.run" not in commands[1]


def test_run_layout_passes_a_jobs_input_error_on_as_one_line_and_keeps_an_internal_errors_tail(monkeypatch, tmp_path):
    _fake_job(monkeypatch, 1, "[rank0]: noise\ntrainlib: error: training.steps must be >= 1\n")
    with pytest.raises(ConfigError, match=r"^layout 'tp=2': training.steps must be >= 1$"):
        parity.run_layout(None, "tp=2", 2, tmp_path)
    _fake_job(monkeypatch, 1, "Traceback (most recent call last):\nRuntimeError: boom\n")
    with pytest.raises(RuntimeError, match=r"layout 'tp=2' failed \(exit 1\):\nout\nTraceback .*\nRuntimeError: boom"):
        parity.run_layout(None, "tp=2", 2, tmp_path / "again")


def test_cli_prints_the_table_and_writes_the_plot(monkeypatch, capsys, tmp_path):
    _run_layouts_as({"": ([4.0, 2.0], [1.0, 1.0]), "tp=2": ([4.0, 2.0], [1.0, 1.0])}, monkeypatch)
    assert parity.main(["--layouts", "tp=2", "--steps", "2", "--plot", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "max relative deviation (loss / grad_norm):" in out
    assert f"wrote {tmp_path / 'p.png'}" in out and f"wrote {tmp_path / 'p.html'}" in out
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "p.html").stat().st_size > 0


def test_a_worker_pools_run_is_a_fresh_runs_curve_bitwise_and_survives_a_dead_worker(tmp_path):
    """The suite's parity runs go through one WorkerPool: a pooled run must be the CLI's run exactly,
    one after another in the same processes, and a worker lost between runs is replaced."""
    small = ["--training.global_batch_size=4", "--training.seq_len=64"]
    fresh = run_layout(None, "dp_shard=2", 3, tmp_path / "fresh", small)
    with WorkerPool() as pool:
        first = run_layout(None, "dp_shard=2", 3, tmp_path / "pool1", small, pool=pool)
        pids = [w.pid for w in pool._workers]
        with pytest.raises(ConfigError, match=r"^layout 'dp_shard=2': training.steps must be >= 1"):
            run_layout(None, "dp_shard=2", 0, tmp_path / "bad", small, pool=pool)
        pool._workers[1].kill()
        pool._workers[1].wait()
        again = run_layout(None, "dp_shard=2", 3, tmp_path / "pool2", small, pool=pool)
        assert [w.pid for w in pool._workers] != pids
    for run in (first, again):
        assert (run.losses, run.grad_norms) == (fresh.losses, fresh.grad_norms)
    assert "world 2 on cpu" in first.output
