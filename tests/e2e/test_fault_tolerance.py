"""In-place fault tolerance on torchft (trainlib.parallel.replica), through real processes on CPU gloo.

Every test starts a lighthouse in this process and each replica group as its own job (`tests.ft_group`:
trainlib.train's job, then its model and optimizer shards saved for comparison), kills or stops a group with
a signal from outside and checks the others from their metrics.jsonl and saved state. The debug recipe;
each group reads its own half of the global batch (group g: data-parallel slices g*dp .. g*dp + dp - 1).

A step with one live group trains on that group's half only: the loss and the gradient are the mean over
its own tokens (`test_lone_group_step_sees_its_half`). After a kill the curve therefore leaves the clean one:
how far is stated in `test_kill_and_heal_fsdp` and docs/reliability.md.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, fault_env
from trainlib.launch import train_command
from trainlib.ft import group_args, start_lighthouse

pytest.importorskip("torchft")

HEARTBEAT_MS = 1000
BASE = ["--recipe", str(REPO / "recipes/debug.toml"), "--metrics.log_freq=1", "--metrics.console=false",
        "--training.seq_len=128", "--training.global_batch_size=8", "--watchdog.enable=false",
        "--fault_tolerance.connect_timeout_seconds=5",
        "--fault_tolerance.process_group_timeout_seconds=5", "--fault_tolerance.quorum_timeout_seconds=20"]


@pytest.fixture
def lighthouse():
    # join timeout: a group that starts a little later than the other (its manager heartbeats, it is still
    # building its model) is waited for at the first quorum instead of healing from the other at step 2
    server = start_lighthouse(heartbeat_timeout_ms=HEARTBEAT_MS, join_timeout_ms=3000)
    yield server.address()
    server.shutdown()


class Group:
    """One replica group's job, in a session of its own."""

    def __init__(self, folder: Path, group: int, lighthouse: str, steps: int, nproc: int = 1, extra=(), tag="",
                 groups: int = 2, env=None):
        self.folder, self.group, self.started = folder, group, time.time()
        args = group_args([*BASE, f"--job.dump_folder={folder}", f"--training.steps={steps}", *extra], groups,
                          group, lighthouse)
        run = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
        self.log = folder / f"group{group}{tag}.log"
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TRAINLIB_TEST_LONE_SLEEP": "0.2",
               **(env or {})}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, *run, "-m", "tests.ft_group", *args], cwd=REPO, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def run_dir(self) -> Path:
        return self.folder / f"replica_{self.group}"

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records() if "loss" in r]

    def wait_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(s >= step for s in self.steps()):
            assert self.proc.poll() is None, self.tail()
            assert time.monotonic() < deadline, f"group {self.group} did not reach step {step}\n" + self.tail()
            time.sleep(0.05)

    def signal(self, sig) -> None:
        """`sig` to the job and every process below it (torchrun starts its workers in sessions of their own)."""
        children: dict[int, list[int]] = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
        tree, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo += children.get(pid, [])
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 300) -> None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            raise AssertionError(f"group {self.group} did not finish\n" + self.tail())
        assert code == 0, self.tail()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait()

    def tail(self) -> str:
        lines = [x for x in self.log.read_text(errors="replace").splitlines() if "[INFO]" not in x]
        return "\n".join(lines[-60:])

    def state(self, rank: int = 0) -> dict:
        return torch.load(self.run_dir / f"state_rank{rank}.pt", weights_only=False)


def losses(group: Group) -> dict[int, float]:
    """step -> loss, the last record of a step (a step that failed to commit runs again)."""
    return {r["step"]: r["loss"] for r in group.records() if "loss" in r}


def assert_same_state(a: dict, b: dict) -> None:
    """Parameters and optimizer states (and hyper-parameters) bitwise equal."""
    for part in ("model", "optimizer"):
        flat_a, flat_b = _flat(a[part]), _flat(b[part])
        assert flat_a.keys() == flat_b.keys()
        same = lambda x, y: torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        bad = [k for k in flat_a if not same(flat_a[k], flat_b[k])]
        assert not bad, f"{part}: {len(bad)} entries differ, e.g. {bad[:3]}"
        assert any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in flat_a.values())


def _flat(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k2: v2 for k, v in tree.items() for k2, v2 in _flat(v, f"{prefix}{k}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k2: v2 for i, v in enumerate(tree) for k2, v2 in _flat(v, f"{prefix}{i}.").items()}
    return {prefix: tree}


def kill_and_heal(tmp: Path, lighthouse: str, steps: int, kill_at: int, nproc: int, extra=(), lone_sleep=0.2):
    """Two groups; every rank of group 1 SIGKILLs itself once step `kill_at` is done (tests/faults), and the
    group is relaunched at once; both run to the end. Returns (survivor, relaunched group, seconds from the
    kill to the survivor's next logged step)."""
    slow = {"TRAINLIB_TEST_LONE_SLEEP": str(lone_sleep)}
    survivor = Group(tmp, 0, lighthouse, steps, nproc, extra, env=slow)
    victim = Group(tmp, 1, lighthouse, steps, nproc, extra, env=fault_env(tmp / "faults", f"after_step:{kill_at}:*:KILL"))
    try:
        victim.proc.wait(timeout=240)
        killed_at = time.monotonic()
        assert max(victim.steps()) == kill_at
        last_before = max(survivor.steps(), default=0)
        pid = survivor.proc.pid
        relaunched = Group(tmp, 1, lighthouse, steps, nproc, extra, tag="-relaunched", env=slow)
        survivor.wait_step(last_before + 1)
        to_next_step = time.monotonic() - killed_at
        relaunched.wait()
        survivor.wait()
        assert survivor.proc.pid == pid
        return survivor, relaunched, to_next_step
    finally:
        for g in (survivor, victim):
            g.kill()


def test_kill_and_heal_one_rank_groups(tmp_path, lighthouse):
    """2 groups x 1 rank: the survivor trains on alone (same process, every step logged once in order, never a
    checkpoint read: checkpoints are off), the relaunched group heals from it in its first quorum and trains
    the next step with it, and from then on both hold bitwise the same parameters and AdamW moments and log
    bitwise the same losses."""
    survivor, healed, _ = kill_and_heal(tmp_path, lighthouse, steps=100, kill_at=4, nproc=1)
    steps = survivor.steps()
    assert steps == list(range(1, 101))  # never restarted, never went back
    alone = [r["step"] for r in survivor.records() if r.get("ft_participants") == 1]
    assert alone, "the survivor never trained alone"
    (heal,) = healed.state()["heals"]
    # its metrics.jsonl goes on from the killed run's records, as a resumed run's does
    first = min(s for s in healed.steps() if s > 4)
    assert first == heal["step"] + 1, (heal, first)  # healed at its first quorum, trains the very next step
    assert heal["participants"] == 2
    at_first = [r for r in survivor.records() if r["step"] == first]
    assert at_first[-1]["ft_participants"] == 2
    assert [r for r in healed.records() if r["step"] == first][0]["ft_heal_s"] > 0
    assert "no checkpoint read" in healed.log.read_text()
    a, b = losses(survivor), losses(healed)
    assert all(a[s] == b[s] for s in b), "the groups' losses differ after the heal"
    assert_same_state(survivor.state(), healed.state())


def test_lone_group_step_sees_its_half(tmp_path, lighthouse):
    """The choice for a step with fewer live groups: each trains on its own slice (no accumulation to keep the
    global batch). Group 0 of 2 alone: its first step's loss is the mean over samples 0..3 only, which a plain
    run with global batch 4 computes too (same weights, same samples), and not the 8-sample loss."""
    lone = Group(tmp_path / "ft", 0, lighthouse, steps=1)
    plain = {name: subprocess.Popen(train_command(1, [*BASE, "--training.steps=1", f"--job.dump_folder={tmp_path / name}",
                                                      f"--training.global_batch_size={batch}"]),
                                    cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name, batch in (("half", 4), ("whole", 8))}
    lone.wait()
    for proc in plain.values():
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    (rec,) = [r for r in lone.records() if "loss" in r]
    assert rec["ft_participants"] == 1
    read = lambda p: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()][0]["loss"]
    assert rec["loss"] == read(tmp_path / "half")
    assert rec["loss"] != read(tmp_path / "whole")


# ---- 2 groups x FSDP2 over 2 ranks (4 processes): slow --------------------------------------------------------
FSDP = ["--parallelism.dp_shard=2"]
STEPS = 80
# After the kill the curve leaves the clean one, for two reasons with two bounds. (1) A one-group step's loss
# is the mean over that group's half of the batch, not over the whole: another sample, so it differs by the
# half batch's sampling spread even before the weights have drifted (measured: mean 1.5 %, max 6.5 % over 29
# such steps, 8 x 128-token batches). (2) Once both groups train again the loss is over the whole batch again
# and differs only by the weights' drift from the half-batch updates (measured: at most 0.8-1.2 %, shrinking).
# Measured with the debug recipe, lr 3e-3, 80 steps, kill at 10, heal at steps 32-35 (-s prints it).
LONE_RTOL, HEALED_RTOL = 0.10, 0.02


def clean_run(tmp: Path, lighthouse: str, steps: int, extra=()) -> list[dict[int, float]]:
    groups = [Group(tmp, g, lighthouse, steps, 2, [*FSDP, *extra]) for g in range(2)]
    for g in groups:
        g.wait()
    return [losses(g) for g in groups]


@pytest.mark.slow
def test_kill_and_heal_fsdp(tmp_path, lighthouse):
    """The issue's run: group 1's ranks SIGKILLed at step 10, relaunched. The survivor's processes never
    restart and never read a checkpoint, and it goes on writing them (every 5 steps, the lowest live group);
    the relaunched group heals from it, not from the checkpoints on disk, and trains the next step; from then
    on both groups' parameter and AdamW shards are bitwise equal on each rank. Against a clean run of the same
    command: bitwise equal up to the kill, within LONE_RTOL / HEALED_RTOL after it."""
    ckpt = ["--checkpoint.enable=true", "--checkpoint.interval=5"]
    clean, _ = clean_run(tmp_path / "clean", lighthouse, STEPS, ckpt)
    survivor, healed, to_next = kill_and_heal(tmp_path / "kill", lighthouse, steps=STEPS, kill_at=10, nproc=2,
                                              extra=[*FSDP, *ckpt], lone_sleep=0.5)
    assert survivor.steps() == list(range(1, STEPS + 1))
    assert "resumed from" not in survivor.log.read_text() + healed.log.read_text()
    assert "no checkpoint read" in healed.log.read_text()
    saved = {p.name for p in (tmp_path / "kill" / "checkpoint").iterdir()}
    assert {f"step-{s}" for s in range(5, STEPS + 1, 5)} <= saved  # saves went on through the fault
    (heal,) = healed.state(0)["heals"]
    first = min(s for s in healed.steps() if s > 10)
    assert first == heal["step"] + 1
    for rank in (0, 1):
        assert_same_state(survivor.state(rank), healed.state(rank))
    a, b = losses(survivor), losses(healed)
    assert all(a[s] == b[s] for s in b if s >= first)
    assert all(a[s] == clean[s] for s in range(1, 11)), "not the clean curve before the kill"
    gap = {s: abs(a[s] - clean[s]) / clean[s] for s in range(11, STEPS + 1)}
    lone = [gap[s] for s in range(11, first)]
    joint = [gap[s] for s in range(first, STEPS + 1)]
    assert lone and max(lone) < LONE_RTOL, lone
    assert max(joint) < HEALED_RTOL, joint
    assert min(lone) > 0 and min(joint) > 0  # the half-batch steps did change the curve
    first_done = [r["time"] for r in healed.records() if r["step"] == first][0]
    print(f"kill -> survivor's next step {to_next:.2f} s; relaunch -> healed group's first step done "
          f"{first_done - healed.started:.2f} s; heal {heal['seconds']:.2f} s at step {heal['step']}; "
          f"loss gap: {len(lone)} one-group steps max {max(lone):.4f} mean {sum(lone) / len(lone):.4f}, "
          f"healed steps max {max(joint):.4f}")


@pytest.mark.slow
def test_stopped_group_is_dropped(tmp_path, lighthouse):
    """A group that stops responding (SIGSTOP on its torchrun and workers) fails the step it is in after
    process_group_timeout_seconds and is left out of the next quorum (the lighthouse's heartbeat timeout); the
    other trains on, alone, to the end."""
    survivor = Group(tmp_path, 0, lighthouse, 40, 2, FSDP)
    stopped = Group(tmp_path, 1, lighthouse, 40, 2, FSDP)
    try:
        stopped.wait_step(5)
        stopped.signal(signal.SIGSTOP)
        t0, last = time.monotonic(), max(survivor.steps())
        survivor.wait_step(last + 2)
        waited = time.monotonic() - t0
        survivor.wait()
        assert survivor.steps() == list(range(1, 41))
        alone = [r["step"] for r in survivor.records() if r["ft_participants"] == 1]
        assert alone and alone[-1] == 40
        assert "not committed" in survivor.log.read_text()  # the step in flight failed and ran again
        assert waited < 5 + 20 + 10  # process_group + quorum timeouts, and two steps
        print(f"SIGSTOP -> survivor two steps on in {waited:.2f} s")
    finally:
        stopped.signal(signal.SIGKILL)
        stopped.kill()
        survivor.kill()


@pytest.mark.slow
def test_both_groups_killed_resume_from_disk(tmp_path, lighthouse):
    """Both groups killed after step 12: the relaunch reads the shared checkpoint of step 10, which the lowest
    live group alone wrote, and trains on bitwise as the uninterrupted run does. min_replica_size = 2: a step
    commits with both groups only, so neither trains ahead of the other while they start."""
    ckpt = ["--checkpoint.enable=true", "--checkpoint.interval=5", "--fault_tolerance.min_replica_size=2"]
    clean, _ = clean_run(tmp_path / "clean", lighthouse, 20, ckpt)
    folder = tmp_path / "kill"
    first = [Group(folder, g, lighthouse, 20, 2, [*FSDP, *ckpt],
                   env=fault_env(folder / f"faults{g}", "after_step:12:*:KILL")) for g in range(2)]
    for g in first:
        g.proc.wait(timeout=300)
        assert g.proc.returncode != 0
    assert sorted(p.name for p in (folder / "checkpoint").iterdir() if p.name.startswith("step-")) == \
        ["step-10", "step-5"]
    assert "checkpoint step" not in first[1].log.read_text()  # group 1 never wrote one
    second = [Group(folder, g, lighthouse, 20, 2, [*FSDP, *ckpt], tag="-again") for g in range(2)]
    for g in second:
        g.wait()
    for g in second:
        resumed = losses(g)
        assert all(resumed[s] == clean[s] for s in range(11, 21)), [(resumed[s], clean[s]) for s in range(11, 21)]
    assert_same_state(second[0].state(0), second[1].state(0))


@pytest.mark.slow
def test_local_launcher_runs_n_groups(tmp_path):
    """python -m trainlib.ft local: a lighthouse and two groups on this machine, trained together to the end."""
    proc = subprocess.run([sys.executable, "-m", "trainlib.ft", "local", "--groups", "2", "--heartbeat-timeout-ms",
                           "1000", "--", *BASE, "--training.steps=3", f"--job.dump_folder={tmp_path}"],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trainlib.ft: lighthouse at http://" in proc.stdout
    for g in (0, 1):
        records = [json.loads(x) for x in (tmp_path / f"replica_{g}" / "metrics.jsonl").read_text().splitlines()]
        # (a group that starts late heals at its first quorum: its first record may be a later step)
        assert records[-1]["step"] == 3 and records[-1]["ft_participants"] == 2
