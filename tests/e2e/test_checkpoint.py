"""Checkpoints: exact resume, crash during save, reshard on load, async saves.

Interruptions are real: tests/faults/sitecustomize.py, loaded into the run's
processes from outside (`tests.helpers.fault_env`), SIGKILLs a rank at a chosen
point of a chosen step; then the same command is launched again (or torchrun
restarts the workers) and must continue from the last complete checkpoint.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, fault_env, run_cli
from trainlib.checkpoint import complete_steps, incomplete_folders

STEPS = 8

BASE = ["--recipe", str(REPO / "recipes/debug.toml"), f"--training.steps={STEPS}", "--metrics.log_freq=1",
        "--metrics.console=false", "--training.seq_len=64", "--training.global_batch_size=8",
        "--checkpoint.enable=true", "--checkpoint.interval=2"]


def _layout_args(layout: dict) -> tuple[int, list[str]]:
    degrees = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, **layout}
    nproc = 1
    for v in degrees.values():
        nproc *= v
    return nproc, [f"--parallelism.{k}={v}" for k, v in degrees.items()]


def _run(folder: Path, layout: dict, extra=(), fault: str | None = None):
    """One launch; with `fault` ("POINT:STEP[:RANK]") it must die from that fault."""
    nproc, lay = _layout_args(layout)
    env = fault_env(folder.parent / "faults", fault) if fault else None
    proc = run_cli([*BASE, f"--job.dump_folder={folder}", *lay, *extra], nproc=nproc, timeout=600, env=env)
    if fault:
        point, step, rank = (fault.split(":") + ["0"])[:3]
        assert proc.returncode != 0, (proc.stdout + proc.stderr)[-4000:]
        assert f"[fault injection] SIGKILL rank {rank} at {point} of step {step}" in proc.stderr
    else:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _curve(folder: Path) -> list[float]:
    """The loss per step of a run that was interrupted and resumed: steps run
    twice (after the last checkpoint, before the crash) must repeat exactly."""
    records = {}
    for s, loss in zip(_steps(folder), _losses(folder)):
        assert records.setdefault(s, loss) == loss, f"step {s} logged {records[s]} then {loss}"
    return [records[s] for s in sorted(records)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference runs, one per layout, shared by the tests."""
    cache = {}
    root = tmp_path_factory.mktemp("straight")

    def get(layout: dict) -> list[float]:
        key = tuple(sorted(layout.items()))
        if key not in cache:
            folder = root / ("_".join(f"{k}{v}" for k, v in key) or "single")
            _run(folder, layout)
            cache[key] = _losses(folder)
        return cache[key]

    return get


def test_crash_then_resume_is_bitwise_exact_fsdp2(tmp_path, straight):
    """Killed (SIGKILL) right after step 4's checkpoint, then the same command again."""
    layout = {"dp_shard": 2}
    folder = tmp_path / "run"
    _run(folder, layout, fault="after_step:4")
    assert complete_steps(folder / "checkpoint") == [2, 4]
    proc = _run(folder, layout)
    assert "resumed from" in proc.stdout
    assert _steps(folder) == list(range(1, STEPS + 1))  # metrics.jsonl appended, not truncated
    assert _losses(folder) == straight(layout)  # bitwise: same layout, CPU fp32


@pytest.mark.parametrize("point", ["before_commit", pytest.param("mid_write", marks=pytest.mark.slow)])
def test_crash_mid_save_resumes_from_previous_checkpoint(tmp_path, straight, point):
    """Killed during step 6's save, after its shards and metadata are written
    but before the commit (or before its shards are written): step-6 must not
    count, the run resumes from step 4."""
    layout = {}
    folder = tmp_path / "run"
    _run(folder, layout, fault=f"{point}:6")
    ck = folder / "checkpoint"
    assert complete_steps(ck) == [2, 4]
    assert [p.name for p in incomplete_folders(ck)] == ["step-6.tmp"]
    proc = _run(folder, layout)
    assert "removing incomplete checkpoint folders" in proc.stdout
    assert "step 4" in proc.stdout
    assert not incomplete_folders(ck)
    assert _curve(folder) == straight(layout)


@pytest.mark.parametrize("save_layout,load_layout", [
    ({"dp_shard": 2}, {}),
    pytest.param({"dp_shard": 4}, {"dp_shard": 2}, marks=pytest.mark.slow),
    pytest.param({"dp_shard": 4}, {"dp_shard": 2, "tp": 2}, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "dp_shard": 2}, {"dp_shard": 2}, marks=pytest.mark.slow),
    pytest.param({"dp_replicate": 2, "dp_shard": 2}, {}, marks=pytest.mark.slow),
])
def test_reshard_on_load_continues_the_curve(tmp_path, straight, save_layout, load_layout):
    """Save under one layout, continue under another (another DP degree too:
    the data stream continues at the same global sample)."""
    folder = tmp_path / "run"
    _run(folder, save_layout, fault="after_step:4")
    assert complete_steps(folder / "checkpoint")[-1] == 4
    _run(folder, load_layout)
    ref = straight({})
    got = _losses(folder)
    assert len(got) == len(ref)
    for s, (a, b) in enumerate(zip(got, ref), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {s}: {a} vs {b}"


def test_training_steps_raised_and_load_step(tmp_path):
    folder = tmp_path / "run"
    _run(folder, {}, extra=["--training.steps=4"])
    assert complete_steps(folder / "checkpoint") == [2, 4]
    # More steps on the same folder: continues from 4.
    proc = _run(folder, {}, extra=["--training.steps=6", "--checkpoint.keep_latest_k=2"])
    assert "step 4" in proc.stdout and _steps(folder) == list(range(1, 7))
    assert complete_steps(folder / "checkpoint") == [4, 6]
    # A named step that does not exist: one clear line, before training.
    proc = run_cli([*BASE, f"--job.dump_folder={folder}", "--checkpoint.load_step=3"])
    assert proc.returncode == 2 and "checkpoint.load_step=3" in proc.stderr and "[4, 6]" in proc.stderr
    # Another model shape: one clear line, not DCP's traceback.
    proc = run_cli([*BASE, f"--job.dump_folder={folder}", "--model.vocab_size=600"])
    assert proc.returncode == 2 and "model.flavor / n_layers / vocab_size" in proc.stderr
    # fresh_start wipes and starts over.
    proc = _run(folder, {}, extra=["--training.steps=2", "--checkpoint.fresh_start=true"])
    assert _steps(folder) == [1, 2] and complete_steps(folder / "checkpoint") == [2]


@pytest.mark.slow
@pytest.mark.parametrize("mode,layout", [("async", {"dp_shard": 2}), ("async_with_pinned_mem", {})],
                         ids=["thread", "process"])
def test_async_saves_resume_exactly(tmp_path, straight, mode, layout):
    """Killed while step 6's async save is in flight (after step 4's was
    committed): resume from step 4's async-written checkpoint, in the same
    async mode, gives the uninterrupted curve bitwise."""
    folder = tmp_path / "run"
    extra = [f"--checkpoint.async_mode={mode}"]
    _run(folder, layout, extra, fault="async_in_flight:6")
    assert complete_steps(folder / "checkpoint") == [2, 4]  # save(6) committed 4 before it started
    assert "step-6.tmp" in [p.name for p in incomplete_folders(folder / "checkpoint")]
    proc = _run(folder, layout, extra)
    assert "step 4" in proc.stdout and "loop blocked" in proc.stdout
    assert complete_steps(folder / "checkpoint") == [2, 4, 6, 8]
    assert _curve(folder) == straight(layout)


def _torchrun(folder: Path, launcher: list[str], fault: str, nproc_layout: dict, timeout=600):
    _, lay = _layout_args(nproc_layout)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "trainlib.train", *BASE,
           f"--job.dump_folder={folder}", *lay]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **fault_env(folder.parent / "faults", fault)))


def _finish(procs, timeout=600):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out))
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    return outs


@pytest.mark.parametrize("fault", ["after_step:4:0", pytest.param("before_commit:6:0", marks=pytest.mark.slow),
                                   pytest.param("after_update:5:1", marks=pytest.mark.slow)],
                         ids=["kill_after_step", "kill_mid_save", "kill_rank1_mid_step"])
def test_elastic_restart_resumes_on_the_same_curve(tmp_path, straight, fault):
    """torchrun --max-restarts=1: a rank is SIGKILLed once; the agent restarts
    both workers, which resume from the latest complete checkpoint."""
    layout = {"dp_shard": 2}
    folder = tmp_path / "run"
    launcher = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5"]
    ((_, out),) = _finish([_torchrun(folder, launcher, fault, layout)])
    point, step, rank = fault.split(":")
    assert f"[fault injection] SIGKILL rank {rank} at {point} of step {step}" in out
    assert "resumed from" in out
    assert _curve(folder) == straight(layout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_agents_c10d_rendezvous_with_restart(tmp_path, straight):
    """Two torchrun agents on localhost (a stand-in for two machines) form one
    2-rank job; rank 0 is killed once; both agents restart and resume."""
    layout = {"dp_shard": 2}
    folder = tmp_path / "run"
    port = _free_port()
    launcher = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=trainlib-{port}", "--max-restarts=1", "--monitor-interval=0.5"]
    procs = [_torchrun(folder, launcher, "after_step:4:0", layout) for _ in range(2)]
    outs = _finish(procs)
    assert sum("[fault injection] SIGKILL rank 0" in out for _, out in outs) == 1
    assert any("resumed from" in out for _, out in outs)
    assert _curve(folder) == straight(layout)
