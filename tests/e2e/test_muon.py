"""optimizer.name = "muon" through the real CLI: the same seed and global batch give one process's curve under
every layout (fp32 CPU, Newton-Schulz in float32), and a resume continues it bitwise."""

import json

import pytest

from tests.e2e.test_checkpoint import _losses, _run, _steps
from tests.helpers import RECIPES
from trainlib.checkpoint import complete_steps
from trainlib.parity import run_parity

TOL = 1e-5  # relative; measured <= 1.6e-7 (loss) on every layout below
MUON = ["--optimizer.name=muon"]


def _assert_parity(recipe: str, layouts: list[str]):
    report = run_parity(str(RECIPES / recipe), layouts, steps=10, extra=MUON)
    print(report.table())
    assert len(report.baseline.losses) == 10
    assert "chosen: muon on" in report.baseline.output  # Muon ran, not AdamW
    for run in report.runs:
        assert run.max_rel_loss <= TOL, (run.name, run.max_rel_loss)
        assert run.max_rel_grad_norm <= 1e-4, (run.name, run.max_rel_grad_norm)
    assert report.baseline.losses[-1] < report.baseline.losses[0]


def test_muon_under_fsdp_matches_one_process():
    # FSDP2: every matrix sharded over dp_shard, orthogonalised by its owner rank (trainlib.muon).
    _assert_parity("debug.toml", ["dp_shard=2"])


@pytest.mark.slow
def test_muon_under_every_dense_layout_matches_one_process():
    # TP2 (owners over tp), FSDP2xTP2 (owners over both dims), HSDP, PP2, CP2.
    _assert_parity("debug.toml", ["tp=2", "dp_shard=2,tp=2", "dp_replicate=2,dp_shard=2", "pp=2", "cp=2"])


@pytest.mark.slow
def test_muon_under_expert_parallel_matches_one_process():
    # EP2 (whole experts per rank: local), FSDP2xEP2 (efsdp 2 on top), TP2xEP2.
    _assert_parity("debug_moe.toml", ["dp_shard=2,ep=2", "dp_shard=4,ep=2", "tp=2,ep=2"])


@pytest.mark.slow
def test_muon_resume_is_bitwise_fsdp2_and_a_reshard_continues(tmp_path):
    """Killed right after step 4's checkpoint, then the same command again: the momentum buffers and the
    AdamW groups' moments come back (bitwise); the checkpoint loaded under TP2 continues within 1e-6."""
    layout = {"dp_shard": 2}
    straight = tmp_path / "straight"
    _run(straight, layout, MUON)
    folder = tmp_path / "run"
    _run(folder, layout, MUON, fault="after_step:4")
    assert complete_steps(folder / "checkpoint") == [2, 4]
    proc = _run(folder, layout, MUON)
    assert "resumed from" in proc.stdout
    assert _steps(folder) == list(range(1, 9))
    assert _losses(folder) == _losses(straight)
    moved = tmp_path / "moved"
    _run(moved, layout, MUON, fault="after_step:4", markers="faults2")
    _run(moved, {"tp": 2}, MUON)
    for s, (a, b) in enumerate(zip(_losses(moved), _losses(straight)), 1):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {s}: {a} vs {b}"


def _clip_run(layouts: list[str], tmp_path, tau: float = 0.02, recipe: str = "debug.toml", extra=()):
    """The debug recipe under Muon with MuonClip at `tau` (below the untrained model's max logit, ~0.15, so
    every step clips): the one-process curve, each layout's, and every run's logged max_attn_logit."""
    report = run_parity(str(RECIPES / recipe), layouts, steps=10, out_dir=tmp_path,
                        extra=[*MUON, f"--optimizer.muon.qk_clip_threshold={tau}", *extra])
    logits = {}
    for run in [report.baseline, *report.runs]:
        folder = tmp_path / (run.name.replace(",", "_").replace("=", "") if run.name != "single" else "single")
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        logits[run.name] = [r["max_attn_logit"] for r in rows]
    return report, logits


def _assert_clip_parity(layouts: list[str], tmp_path, recipe: str = "debug.toml", extra=()):
    tau = 0.02
    report, logits = _clip_run(layouts, tmp_path, tau, recipe, extra)
    print(report.table())
    assert f"lr match_rms_adamw, MuonClip tau {tau:g})" in report.baseline.output  # the start-up line says it
    off = run_parity(str(RECIPES / recipe), [], steps=10, extra=[*MUON, *extra]).baseline  # pooled
    # the clip changed the curve: by little over 10 steps (measured 2.2e-5 relative at most; attention moves
    # the untrained model's loss little), but beyond the tolerance and 20x the layouts' own differences
    effect = max(abs(a - b) / b for a, b in zip(report.baseline.losses, off.losses))
    assert effect > TOL, effect
    assert all(effect > 20 * run.max_rel_loss for run in report.runs), (effect, report.table())
    single = logits["single"]
    assert single[0] > 5 * tau  # step 1 measured the unclipped initial weights
    assert all(x < 2 * tau for x in single[1:])  # after each rescale the next step's max is near tau
    for run in report.runs:
        assert run.max_rel_loss <= TOL, (run.name, run.max_rel_loss)
        for a, b in zip(logits[run.name], single):  # the max over heads and ranks is the one process's
            assert abs(a - b) <= 1e-4 * b, (run.name, a, b)


def test_muonclip_changes_the_curve_and_matches_under_fsdp(tmp_path):
    _assert_clip_parity(["dp_shard=2"], tmp_path)


@pytest.mark.slow
def test_muonclip_matches_under_tp_and_fsdp_tp(tmp_path):
    # TP2: each rank measures its heads (assembled per global head over tp); FSDP2xTP2 rescales 2-D shards.
    _assert_clip_parity(["tp=2", "dp_shard=2,tp=2", "pp=2"], tmp_path)


@pytest.mark.slow
def test_muonclip_on_mla_matches_under_tp_and_fsdp(tmp_path):
    # DeepSeek-V3's MLA: only the head-specific rows (wq_b, wkv_b's k_nope) rescale; TP2 splits the heads.
    _assert_clip_parity(["tp=2", "dp_shard=2"], tmp_path, "debug_deepseek.toml")


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["causal", "document"])
def test_muonclip_matches_under_context_parallelism(tmp_path, mask):
    # all-gather CP2 (each rank's query chunks against the keys they see), Ulysses CP2 (each rank's head slice
    # over the whole sequence) and hybrid 2x2 (both): the max over cp is one process's per head
    _assert_clip_parity(["cp=2", "cp=2,cp_method=ulysses", "cp=4,cp_method=hybrid,cp_ulysses=2"], tmp_path,
                        extra=[f"--model.attn_mask={mask}"])
