"""DeepSeek-V3 (debug_deepseek: MLA with q-LoRA and YaRN, top2-sum group routing, a shared expert, a dense first
block, one MTP module trained with the objective main + 0.3 * MTP) through the whole runtime: the same loss curve,
and the same MTP loss, under every layout as on one process (fp32 CPU, 1e-5), and checkpoints that resume bitwise
on the same layout and reshard across EP.

Measured (8 steps, seq 64, global batch 8, 2026-11-27, `python -m trainlib.parity --recipe debug_deepseek --steps 8
--training.seq_len=64 --training.global_batch_size=8 --layouts ...`): max relative loss / grad-norm deviation
pp=2 1.16e-07 / 2.16e-07, tp=2 with the latent option 1.16e-07 / 3.51e-07, dp_shard=2,ep=2 1.16e-07 / 3.60e-07,
tp=2,ep=2 1.16e-07 / 3.49e-07, cp=2,ep=2 1.27e-07 / 3.60e-07, dp_shard=2 1.16e-07 / 3.49e-07, tp=2 1.16e-07 /
3.51e-07, cp=2 1.27e-07 / 3.49e-07, cp=2 Ulysses 7.69e-08 / 3.51e-07, pp=2,dp_shard=2,ep=2 1.16e-07 / 3.00e-07."""

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import RECIPES, fault_env, run_cli
from trainlib.checkpoint import complete_steps
from trainlib.parity import run_parity

DEEPSEEK = str(RECIPES / "debug_deepseek.toml")
TOL = 1e-5
STEPS = 8
SHAPE = ["--training.seq_len=64", "--training.global_batch_size=8"]


def _assert_parity(report, out_dir: Path):
    print(report.table())
    for r in report.runs:
        assert r.max_rel_loss <= TOL, f"{r.name}: loss deviates {r.max_rel_loss:.2e}"
        assert r.max_rel_grad_norm <= 10 * TOL, f"{r.name}: grad norm deviates {r.max_rel_grad_norm:.2e}"
    assert report.baseline.losses[-1] < report.baseline.losses[0] - 1  # it learns
    # the MTP depth's own loss, logged by every layout, step by step (pipeline: from the last stage)
    runs = {p.parent.name: [json.loads(line)["mtp_loss_1"] for line in p.read_text().splitlines()]
            for p in sorted(out_dir.glob("*/metrics.jsonl"))}
    base = runs.pop("single")
    assert len(base) == STEPS and base[-1] < base[0] - 1
    for name, curve in runs.items():
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(curve, base, strict=True)), (name, curve, base)


def test_deepseek_mtp_parity_under_a_pipeline(tmp_path):
    # the last stage holds the MTP module, a copy of the embedding (its gradient summed with the first stage's)
    # and the objective, on targets packed into the schedule's one target
    _assert_parity(run_parity(DEEPSEEK, ["pp=2"], steps=STEPS, out_dir=tmp_path, extra=SHAPE), tmp_path)


@pytest.mark.slow
def test_deepseek_mtp_parity_all_layouts(tmp_path):
    layouts = ["dp_shard=2", "tp=2", "tp=2,tp_latent_sequence_parallel=true", "cp=2", "cp=2,cp_method=ulysses",
               "dp_shard=2,ep=2", "tp=2,ep=2", "cp=2,ep=2", "pp=2,dp_shard=2,ep=2", "pp=2,pp_schedule=ZBVZeroBubble"]
    _assert_parity(run_parity(DEEPSEEK, layouts, steps=STEPS, out_dir=tmp_path, extra=SHAPE), tmp_path)


def _run(folder: Path, degrees: dict, fault: str | None = None) -> list[dict]:
    nproc = 1
    for name, v in degrees.items():
        nproc *= 1 if name == "ep" else v  # ep borrows its ranks from the others
    env = fault_env(folder.parent / f"faults-{folder.name}", fault) if fault else None
    proc = run_cli(["--recipe", DEEPSEEK, *SHAPE, f"--training.steps={STEPS}", "--metrics.log_freq=1",
                    "--metrics.console=false", "--checkpoint.enable=true", "--checkpoint.interval=2",
                    f"--job.dump_folder={folder}", *(f"--parallelism.{k}={v}" for k, v in degrees.items())],
                   nproc=nproc, timeout=600, env=env)
    assert (proc.returncode != 0) if fault else (proc.returncode == 0), (proc.stdout + proc.stderr)[-4000:]
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_deepseek_resumes_bitwise_under_fsdp_ep_and_reshards_to_one_process(tmp_path):
    """Killed after step 4's checkpoint under FSDP2 x EP2: continued on the same layout, the uninterrupted run's
    curve bit for bit (MTP loss included); the same checkpoint continued on one process, within 1e-6."""
    layout = {"dp_shard": 2, "ep": 2}
    straight = _run(tmp_path / "straight", layout)
    killed = tmp_path / "run"
    _run(killed, layout, fault="after_step:4")
    assert complete_steps(killed / "checkpoint")[-1] == 4
    one = tmp_path / "one"
    shutil.copytree(killed, one)
    got = _run(killed, layout)
    assert [(r["loss"], r["mtp_loss_1"]) for r in got] == [(r["loss"], r["mtp_loss_1"]) for r in straight]
    resharded = {r["step"]: r for r in _run(one, {})}
    assert sorted(resharded) == list(range(1, STEPS + 1))
    for want in straight:
        r = resharded[want["step"]]
        for key in ("loss", "mtp_loss_1"):
            assert abs(r[key] - want[key]) <= 1e-6 * abs(want[key]), (want["step"], key, r[key], want[key])
