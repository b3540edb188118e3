"""The real CLI on one CUDA device: bf16 against fp32, compile really compiled,
async_with_pinned_mem checkpoints resumed, the NCCL one-rank paths, FSDP CPU
offload. Skipped without CUDA; `python -m pytest -m gpu tests/gpu`.

The debug recipe keeps each run to seconds: these tests check paths and
numerics, tests/gpu/test_float8_ac_compile.py and scripts/benchmark.py the
large shapes.
"""

import json
import math
import os
import sys

import pytest

from tests.e2e.test_compile import compiled_graphs
from tests.helpers import RECIPES, REPO, fault_env, needs_cuda, run_cli, run_tree
from trainlib.checkpoint import complete_steps
from trainlib.parity import run_parity

pytestmark = [pytest.mark.gpu, needs_cuda]

RECIPE = str(RECIPES / "debug.toml")
CUDA = ["--job.device=cuda", "--training.global_batch_size=8", "--training.seq_len=256"]
# bf16 matmuls round to 8 bits of mantissa; over 20 steps of the debug recipe
# (lr 3e-3) the CPU measurement was ~1e-3 (docs/performance.md). 2e-2 leaves
# room for GPU kernels (flash attention, split-K GEMMs) and still fails a run
# that diverges or trains on another curve.
BF16_RTOL = 2e-2


def _losses(folder) -> list[float]:
    return [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_bf16_follows_fp32_over_20_steps():
    report = run_parity(RECIPE, ["training.mixed_precision_param=bfloat16",  # one rank: autocast
                                 "training.mixed_precision_param=bfloat16,training.mixed_precision_impl=fsdp"],
                        steps=20, extra=CUDA)
    print(report.table())
    assert report.max_rel_loss < BF16_RTOL
    for run in report.runs:  # really bf16: not the fp32 curve
        assert run.losses != report.baseline.losses
    assert all(math.isfinite(x) for r in report.runs for x in r.losses)
    assert report.baseline.losses[-1] < report.baseline.losses[0] - 0.5  # and it trains


def test_compile_really_compiles_on_cuda(monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "dynamo")
    report = run_parity(RECIPE, ["compile.enable=true,compile.loss=true,activation_checkpoint.mode=selective_op"],
                        steps=10, extra=CUDA)
    print(report.table())
    # One graph for the 4 blocks (inductor's triton backend), one for the loss, no recompiles.
    assert compiled_graphs(report.runs[0].output) == ["block", "loss"], report.runs[0].output[-3000:]
    # fp32 on both sides; inductor's fused reductions reorder sums (CPU: 1.1e-7).
    assert report.max_rel_loss < 1e-4


def test_async_with_pinned_mem_checkpoint_resumes(tmp_path):
    """Killed while step 6's save (pinned-memory staging, background process)
    is in flight: the run resumes from step 4's checkpoint. The first step after
    the resume depends only on the restored weights, optimizer state and data
    position, and a forward is deterministic on one GPU: its loss is bitwise the
    uninterrupted run's. Later steps follow within 1e-5 (GPU backward kernels
    may accumulate in another order from run to run)."""
    args = [*CUDA, "--recipe", RECIPE, "--training.steps=8", "--metrics.log_freq=1", "--metrics.console=false",
            "--parallelism.dp_shard=1", "--checkpoint.enable=true", "--checkpoint.interval=2",
            "--checkpoint.async_mode=async_with_pinned_mem"]
    straight = tmp_path / "straight"
    assert run_cli([*args, f"--job.dump_folder={straight}"]).returncode == 0
    folder = tmp_path / "run"
    proc = run_cli([*args, f"--job.dump_folder={folder}"], env=fault_env(tmp_path / "faults", "async_in_flight:6"))
    assert proc.returncode != 0 and "[fault injection] SIGKILL rank 0 at async_in_flight of step 6" in proc.stderr
    assert complete_steps(folder / "checkpoint") == [2, 4]
    proc = run_cli([*args, f"--job.dump_folder={folder}"])
    assert proc.returncode == 0 and "resumed from" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    assert complete_steps(folder / "checkpoint") == [2, 4, 6, 8]
    # metrics.jsonl is appended: steps 1..6 before the kill, then 5..8 from the resume.
    resumed, ref = _losses(folder)[-4:], _losses(straight)[4:]
    assert resumed[0] == ref[0]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(resumed[1:], ref[1:])), (resumed, ref)


@pytest.mark.parametrize("launch", ["plain", "torchrun"])
def test_nccl_one_rank_paths(tmp_path, launch):
    """One rank on NCCL: without torchrun (an in-process store) and under
    torchrun; FSDP on the one-rank mesh (mixed_precision_impl=fsdp) and with
    its CPU offload, against the autocast path that uses no collective."""
    base = [*CUDA, "--recipe", RECIPE, "--training.steps=5", "--metrics.log_freq=1", "--metrics.console=false",
            "--comm.backend=nccl", "--parallelism.dp_shard=1", "--training.mixed_precision_param=bfloat16"]
    # train_command runs one process without torchrun; torchrun sets RANK/WORLD_SIZE (the env:// rendezvous).
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    curves = {}
    for name, extra in [("autocast", []), ("fsdp", ["--training.mixed_precision_impl=fsdp"]),
                        ("fsdp_offload", ["--training.mixed_precision_impl=fsdp", "--parallelism.fsdp_cpu_offload=true"])]:
        folder = tmp_path / name
        args = [*base, *extra, f"--job.dump_folder={folder}"]
        if launch == "plain":
            proc = run_cli(args)
        else:
            proc = run_tree([*torchrun, "-m", "trainlib.train", *args], 600, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        curves[name] = _losses(folder)
    # Offload moves memory, not arithmetic; only the optimizer's kernels differ (CPU foreach, GPU fused).
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(curves["fsdp"], curves["fsdp_offload"])), curves
    assert all(math.isclose(a, f, rel_tol=BF16_RTOL) for a, f in zip(curves["autocast"], curves["fsdp"])), curves
