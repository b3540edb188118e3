"""Checkpoints and what they answer: exact resume, crash during save, reshard
on load, async saves, kills at random points, preemption, damaged and
unwritable checkpoints, a hung rank.

Interruptions are real: tests/faults/sitecustomize.py, loaded into the run's
processes from outside (`tests.helpers.fault_env`), SIGKILLs (or signals, or
hangs, or fills the disk of) a rank at a chosen point of a chosen step; then
the same command is launched again (or torchrun restarts the workers) and must
continue from the last complete checkpoint, on the uninterrupted curve.
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, communicate_all, fault_env, kill_tree, run_cli
from trainlib.checkpoint import complete_steps, incomplete_folders
from trainlib.errors import EXIT_HUNG, EXIT_PREEMPTED

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


def _run(folder: Path, layout: dict, extra=(), fault: str | None = None, markers: str = "faults", rc: int = 0):
    """One launch, which must exit with `rc`; with `fault`
    ("POINT:STEP[:RANK[:ACTION]]", default KILL; more after commas) it must die
    from the first fault (or exit with `rc` when it is not 0)."""
    nproc, lay = _layout_args(layout)
    env = fault_env(folder.parent / markers, fault) if fault else None
    proc = run_cli([*BASE, f"--job.dump_folder={folder}", *lay, *extra], nproc=nproc, timeout=600, env=env)
    out = (proc.stdout + proc.stderr)[-4000:]
    if fault:
        first = fault.split(",")[0].split(":")
        point, step, rank, action = (first + ["0", "KILL"][len(first) - 2:])[:4]
        action = action if action in ("ENOSPC", "HANG") else "SIG" + action
        assert proc.returncode != 0 if not rc else proc.returncode == rc, out
        assert f"[fault injection] {action} rank {rank} at {point} of step {step}" in proc.stderr, out
    else:
        assert proc.returncode == rc, out
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

    def get(layout: dict, extra=()) -> list[float]:
        key = (tuple(sorted(layout.items())), tuple(extra))
        if key not in cache:
            folder = root / f"run{len(cache)}"
            _run(folder, layout, extra)
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


@pytest.mark.slow
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
    assert proc.returncode == 2 and "model.name / flavor / n_layers / vocab_size" in proc.stderr
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


def _torchrun(folder: Path, launcher: list[str], fault: str, nproc_layout: dict, extra=()):
    _, lay = _layout_args(nproc_layout)
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "trainlib.train", *BASE,
           f"--job.dump_folder={folder}", *lay, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **fault_env(folder.parent / "faults", fault)))


def _finish(procs, timeout=600):
    outs = [(p.returncode, out) for p, (out, _) in zip(procs, communicate_all(procs, timeout))]
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


def test_elastic_restart_after_a_worker_died_before_joining(tmp_path, straight):
    """Rank 1 is SIGKILLed at start-up before it touches torchrun's store,
    while rank 0 is already in it. The restarted workers must still agree on
    one store namespace (they did not when the namespace counted the workers
    that joined: they waited in different ones until the init timeout)."""
    layout = {"dp_shard": 2}
    folder = tmp_path / "run"
    launcher = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5"]
    proc = _torchrun(folder, launcher, "before_init:0:1", layout, extra=["--comm.init_timeout_seconds=60"])
    ((_, out),) = _finish([proc])
    assert "[fault injection] SIGKILL rank 1 at before_init of step 0" in out
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


# ----------------------------------------------------------------- kills at random points


def _next_kill(rng: random.Random, i: int, latest: int, last_step: int, interval: int) -> tuple[str, str]:
    """(async_mode, fault) of the i-th killed launch, which resumes after step
    `latest`: the first kill is during a synchronous save, the second during
    an asynchronous one, the others anywhere; always at a step the launch
    reaches, on a random rank (rank 0 before a commit)."""
    if i == 0:
        mode, point = "disabled", "mid_write"
    elif i == 1:
        mode, point = "async", rng.choice(["mid_write", "async_in_flight"])
    else:
        mode = rng.choice(["disabled", "async"])
        point = rng.choice(["after_update", "after_step", "mid_write", "before_commit"]
                           + (["async_in_flight"] if mode == "async" else []))
    steps = {"after_update": range(latest + 1, last_step + 1), "after_step": range(latest + 1, last_step)}.get(
        point, range(latest + interval, last_step + 1, interval))  # save points: the saves still to come
    # before_commit kills the committing rank: on rank 1 (whose commit is empty) rank 0 may commit first.
    return mode, f"{point}:{rng.choice(steps)}:{0 if point == 'before_commit' else rng.randrange(2)}"


def _random_kills(tmp_path, straight, kills: int, steps: int) -> None:
    """SIGKILL a random rank at `kills` random points (sync and async saves
    included), relaunching after each: each launch resumes from the latest
    complete checkpoint, a save that was killed never counts, and the final
    curve is the uninterrupted one. Retention keys are on throughout."""
    seed = int(os.environ.get("TRAINLIB_KILL_SEED", random.randrange(2**32)))
    print(f"kill seed {seed} (rerun with TRAINLIB_KILL_SEED={seed})")
    rng, layout, folder, done = random.Random(seed), {"dp_shard": 2}, tmp_path / "run", []
    extra = [f"--training.steps={steps}", "--checkpoint.keep_latest_k=2", "--checkpoint.keep_every=4"]
    for i in range(kills):
        before = complete_steps(folder / "checkpoint")
        mode, fault = _next_kill(rng, i, before[-1] if before else 0, steps, interval=2)
        done.append((mode, fault))
        proc = _run(folder, layout, [*extra, f"--checkpoint.async_mode={mode}"], fault=fault, markers=f"faults{i}")
        if before:
            assert f"step-{before[-1]} (step {before[-1]}" in proc.stdout, (seed, done)  # the latest complete one
        point, step = fault.split(":")[:2]
        if point in ("mid_write", "before_commit", "async_in_flight"):  # that save never completed
            assert int(step) not in complete_steps(folder / "checkpoint"), (seed, done)
    _run(folder, layout, extra)
    assert _curve(folder) == straight(layout, [] if steps == STEPS else [f"--training.steps={steps}"]), (seed, done)
    kept = sorted(set(range(4, steps + 1, 4)) | {steps - 2, steps})  # keep_every=4, keep_latest_k=2
    assert complete_steps(folder / "checkpoint") == kept, (seed, done)


# Slow only: the default suite's crash, elastic-restart and mid-save tests kill at fixed points.
@pytest.mark.slow
def test_ten_kills_at_random_points_resume_on_the_same_curve(tmp_path, straight):
    _random_kills(tmp_path, straight, kills=10, steps=16)


# ----------------------------------------------------------------- preemption


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path, straight):
    """SIGTERM reaches rank 1 only, after step 3's update: both ranks finish
    step 4 (the flag is agreed on at every step's end), save step 4 (not a
    save step of the interval) and exit with 75; the relaunch continues it.
    Rank 0's cleanup is made 3 s slower: rank 1 must not exit first (torchrun
    would terminate rank 0 before it says why the run stopped)."""
    layout, folder = {"dp_shard": 2}, tmp_path / "run"
    extra = ["--checkpoint.interval=3"]
    proc = _run(folder, layout, extra, fault="after_update:3:1:TERM,slow_close:0:0")
    assert "[fault injection] slow_close rank 0" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count(f"exitcode  : {EXIT_PREEMPTED}") == 2, proc.stderr[-3000:]  # neither rank terminated
    assert proc.stderr.count("trainlib: preempted: SIGTERM or SIGUSR1: stopped after step 4, its checkpoint is saved") == 1
    assert complete_steps(folder / "checkpoint") == [3, 4] and _steps(folder) == [1, 2, 3, 4]
    for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()):  # per-rank step-time spread
        assert r["step_time_max_s"] >= r["step_time_min_s"] > 0 and r["step_time_max_rank"] in (0, 1), r
        assert r["step_time_min_rank"] == 1 - r["step_time_max_rank"] or r["step_time_max_s"] == r["step_time_min_s"], r
    proc = _run(folder, layout, extra)
    assert "step-4 (step 4" in proc.stdout
    assert _curve(folder) == straight(layout)


@pytest.mark.parametrize("sig", ["USR1", "INT"])
def test_sigusr1_or_ctrl_c_saves_and_exits_75_then_the_relaunch_continues(tmp_path, straight, sig):
    # Ctrl-C (SIGINT) takes SIGTERM's path (issue 43 item 10): it printed a traceback and saved nothing.
    folder = tmp_path / "run"
    extra = ["--checkpoint.interval=4"]
    proc = _run(folder, {}, extra, fault=f"after_step:5:0:{sig}", rc=EXIT_PREEMPTED)
    assert complete_steps(folder / "checkpoint") == [4, 6] and _steps(folder)[-1] == 6
    said = "Ctrl-C" if sig == "INT" else "SIGTERM or SIGUSR1"
    assert f"trainlib: preempted: {said}: stopped after step 6, its checkpoint is saved" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run(folder, {}, extra)
    assert "step-6 (step 6" in proc.stdout
    assert _curve(folder) == straight({})


# ----------------------------------------------------------------- damaged and unwritable checkpoints


def test_truncated_and_missing_files_fall_back_to_the_previous_checkpoint(tmp_path, straight):
    """The latest checkpoint has a truncated shard, the one before a missing
    shard: both are moved aside with one line each, the run resumes from the
    third and continues on the uninterrupted curve."""
    folder = tmp_path / "run"
    _run(folder, {})
    ck = folder / "checkpoint"
    shard8, shard6 = ck / "step-8" / "__0_0.distcp", ck / "step-6" / "__0_0.distcp"
    os.truncate(shard8, shard8.stat().st_size - 100)
    shard6.unlink()
    proc = _run(folder, {})
    warnings = [x for x in proc.stdout.splitlines() if "skipping damaged checkpoint" in x]
    assert len(warnings) == 2, proc.stdout
    assert "__0_0.distcp has" in warnings[0] and "step-8.corrupt" in warnings[0]
    assert "__0_0.distcp is missing" in warnings[1] and "step-6.corrupt" in warnings[1]
    assert "step-4 (step 4" in proc.stdout
    assert (ck / "step-8.corrupt").is_dir() and complete_steps(ck) == [2, 4, 6, 8]
    assert _curve(folder) == straight({})


@pytest.mark.parametrize("mode", ["disabled", pytest.param("async", marks=pytest.mark.slow)])
def test_full_disk_during_a_save_keeps_the_previous_checkpoint_and_trains_on(tmp_path, straight, mode):
    """The writer raises ENOSPC in step 6's save: one line, step 4 stays the
    latest, training goes on (step 7 runs); killed after step 7, the relaunch
    resumes from step 4 on the same curve."""
    folder = tmp_path / "run"
    extra = [f"--checkpoint.async_mode={mode}"]
    # An async save's failure shows when it is collected: at the latest when step 8's save starts.
    kill = "after_step:7:0" if mode == "disabled" else "async_in_flight:8:0"
    env = fault_env(tmp_path / "faults", "mid_write:6:0:ENOSPC", kill)
    proc = run_cli([*BASE, f"--job.dump_folder={folder}", *extra], env=env)
    assert proc.returncode != 0 and "[fault injection] ENOSPC rank 0 at mid_write of step 6" in proc.stderr
    assert f"[fault injection] SIGKILL rank 0 at {kill.rsplit(':', 1)[0].replace(':', ' of step ')}" in proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if "not saved" in x]
    assert "checkpoint step 6 not saved: no space left on device" in line and "step 4 stays the latest" in line
    assert complete_steps(folder / "checkpoint") == [2, 4] and "step-6.tmp" not in os.listdir(folder / "checkpoint")
    assert _steps(folder)[-1] >= 7
    _run(folder, {}, extra)
    assert _curve(folder) == straight({})


# ----------------------------------------------------------------- hang watchdog


def test_a_hung_rank_is_named_with_stacks_of_every_rank_before_the_collective_timeout(tmp_path, straight):
    """Rank 1 sleeps forever after step 5's update; rank 0 waits in step 6's
    first all-reduce. Within the watchdog's limit (3 s here, the collective
    timeout 120 s) every rank writes its stacks and flight recorder, and one
    line names rank 1 and the collective rank 0 waits in."""
    layout, folder = {"dp_shard": 2}, tmp_path / "run"
    _, lay = _layout_args(layout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainlib.train",
           *BASE, f"--job.dump_folder={folder}", *lay, "--watchdog.min_seconds=3", "--comm.train_timeout_seconds=120"]
    env = dict(os.environ, OMP_NUM_THREADS="1", **fault_env(tmp_path / "faults", "after_update:5:1:HANG"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stamped = []  # (arrival, line): read aside, so that a job that never ends cannot block the test
    reader = threading.Thread(target=lambda: stamped.extend((time.monotonic(), x) for x in proc.stdout), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=120)
        ended = time.monotonic()
    finally:  # a watchdog that failed must not leave the sleeping rank behind
        kill_tree(proc)
        reader.join(timeout=10)
    lines = [x for _, x in stamped]
    out = "".join(lines)
    hung_at = next((t for t, x in stamped if "[fault injection] HANG rank 1 at after_update of step 5" in x), None)
    assert hung_at is not None and ended - hung_at < 60, out[-3000:]  # half the collective timeout
    assert f"exitcode  : {EXIT_HUNG}" in out, out[-3000:]
    (verdict,) = [x for x in lines if x.startswith("trainlib: hang")]
    assert verdict.startswith("trainlib: hang at step 6: rank 1 did not arrive at gloo:all_reduce #"), verdict
    assert "which rank 0 entered" in verdict and "train.py" in verdict and "rank 1 is at step 5" in verdict
    hang = folder / "hang"
    for rank in (0, 1):
        stacks = (hang / f"stacks_rank{rank}.txt").read_text()
        assert "in train_loop" in stacks and "in _report_and_exit" in stacks  # the main thread and the watchdog's
        assert json.loads((hang / f"flight_recorder_rank{rank}.json").read_text())
    assert _losses(folder) == straight(layout)[:5]


def test_workers_stop_with_a_checkpoint_when_their_torchrun_agent_is_killed(tmp_path):
    """Issue 43 item 7: a SIGKILLed agent left its workers training unsupervised (hundreds of steps, dozens
    of checkpoints) and their watchdog threads died on the lost store. Now each worker, reparented, stops
    after the step like a preemption, with that step's checkpoint."""
    folder = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "trainlib.train", *BASE, f"--job.dump_folder={folder}", "--parallelism.dp_shard=2",
           f"--training.steps={STEPS * 50}", "--checkpoint.interval=1000"]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics, deadline = folder / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(p) for p in open(f"/proc/{agent.pid}/task/{agent.pid}/children").read().split()]
    assert len(workers) == 2
    agent.kill()  # SIGKILL: no SIGTERM reaches the workers
    agent.wait()
    deadline = time.monotonic() + 120
    while any(os.path.exists(f"/proc/{w}") and open(f"/proc/{w}/stat").read().split()[2] != "Z" for w in workers):
        assert time.monotonic() < deadline, "workers still running two minutes after their agent died"
        time.sleep(0.2)
    steps = complete_steps(folder / "checkpoint")
    assert len(steps) == 1 and steps[0] < STEPS * 50  # the stop's checkpoint, long before the end
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert steps[0] == last


def test_sigterm_to_the_process_group_under_async_with_pinned_mem_saves_and_resumes(tmp_path, straight):
    """Issue 43 item 2: a SIGTERM to the whole process group (torchrun's to its workers, SLURM's to a job
    step) also killed DCP's background writer; the preemption save failed ("Checkpoint background process
    is dead"), the job exited 1 and the save in flight was lost. The writer now starts with the stop signals
    blocked, so it finishes both."""
    folder = tmp_path / "run"
    extra = ["--training.steps=40", "--checkpoint.async_mode=async_with_pinned_mem"]
    cmd = [sys.executable, "-m", "trainlib.train", *BASE, f"--job.dump_folder={folder}", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    metrics, deadline = folder / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # the worker and its writer process alike
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    stopped = _steps(folder)[-1]
    assert stopped < 40 and stopped in complete_steps(folder / "checkpoint"), (stopped, out[-3000:])
    _run(folder, {}, extra)
    assert _curve(folder) == straight({}, extra)
