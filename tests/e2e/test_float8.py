"""float8 training (torchao) through the real CLI: each recipe reaches the
converted linears, leaves its own mark on the gradients, and tracks fp32.

The default suite emulates the float8 matmuls (`float8.emulate=true`: same
casts and scales, fp32 matmuls): `torch._scaled_mm` on CPU is ~60x slower
(3.6 s/step vs 0.06 s on the debug model, seq 128, batch 4) and gives the
same curve to within ~1e-5 (the slow test checks that)."""

import itertools

import pytest

from tests.helpers import RECIPES
from trainlib.compat import CPU_ROWWISE_MATMULS
from trainlib.models.llama3 import get_model_args
from trainlib.parity import run_parity

DEBUG = str(RECIPES / "debug.toml")
# Tiny steps: the comparison is about numerics, and launches dominate the time.
SMALL = ["--training.global_batch_size=4", "--training.seq_len=128"]
F8 = "float8.enable=true,float8.emulate=true"
N_LINEARS = 7 * get_model_args("debug").n_layers  # wq wk wv wo w1 w2 w3 per block; `output` is filtered

# float8 rounds every matmul input to 3 mantissa bits (e4m3); over 10 (and 20)
# steps of the debug model the loss stays within ~1.4e-3 relative of fp32
# (measured for all three recipes, 1 and 2 ranks); 5e-3 leaves margin without
# hiding a bug (a broken scale gives deviations of order 1).
LOSS_RTOL = 5e-3

# Grad norms of steps 1-2 (the same initial weights and batches, so only the
# casts differ). Measured (debug.toml + SMALL, fp32 matmuls):
#   fp32                1.105863571  1.130831718
#   tensorwise          1.105694294  1.130522966
#   rowwise             1.105667114  1.130589128
#   rowwise_with_gw_hp  1.105715275  1.130669713
# Pairwise, each differs from every other by >= 5.8e-5 relative (tensorwise
# vs rowwise, step 2), while real and emulated matmuls of one recipe differ by
# <= 3.6e-6. A recipe that was silently replaced by another would match it
# exactly: the emulated runs are deterministic.
SIGNATURE_RTOL = 2e-5


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_float8_recipes_are_applied_distinct_and_track_fp32():
    recipes = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    report = run_parity(DEBUG, [f"{F8},float8.recipe={r}" for r in recipes] + [f"dp_shard=2,{F8}"],
                        steps=10, extra=SMALL)
    print(report.table())
    *singles, fsdp = report.runs
    for recipe, run in zip(recipes, singles):  # the job's own account of what it converted
        assert f"float8 {recipe} (emulated): {N_LINEARS} linears converted: " in run.output, run.output[-3000:]
    # Tensorwise under FSDP all-gathers weights in float8 and precomputes their scales.
    assert f"float8 tensorwise (emulated): {N_LINEARS} linears converted, float8 FSDP all-gather: " in fsdp.output

    for run in report.runs:
        assert run.max_rel_loss < LOSS_RTOL, run.name
        assert run.max_rel_loss > 1e-5, run.name  # float8 really ran: fp32 layouts match to ~1e-7

    signatures = {"fp32": report.baseline.grad_norms[:2]}
    signatures |= {recipe: run.grad_norms[:2] for recipe, run in zip(recipes, singles)}
    for a, b in itertools.combinations(signatures, 2):
        assert _rel(signatures[a], signatures[b]) > SIGNATURE_RTOL, (a, b, signatures[a], signatures[b])


@pytest.mark.slow
def test_float8_real_matmuls_match_emulation_and_fsdp_all_gather_matches_high_precision():
    # ~170 s on 2 cores: every real step runs torch._scaled_mm on CPU (3.6 s per step).
    # Before torch 2.13 the CPU matmul has no row scales: the rowwise recipes are refused at setup (unit test).
    recipes = ("tensorwise", "rowwise", "rowwise_with_gw_hp") if CPU_ROWWISE_MATMULS else ("tensorwise",)
    layouts = [f"float8.enable=true,float8.recipe={r}{e}" for r in recipes for e in (",float8.emulate=true", "")]
    layouts += [f"dp_shard=2,{F8}", f"dp_shard=2,{F8},float8.fsdp_float8_all_gather=false"]
    report = run_parity(DEBUG, layouts, steps=3, extra=SMALL)
    print(report.table())
    runs = {r.name: r for r in report.runs}
    for recipe in recipes:
        emulated, real = runs[layouts[2 * recipes.index(recipe)]], runs[layouts[2 * recipes.index(recipe) + 1]]
        assert "(emulated)" not in real.output and f"float8 {recipe}: {N_LINEARS} linears converted" in real.output
        # Measured over 3 steps: loss <= 2.5e-6, grad norm <= 1.4e-5 (rowwise_with_gw_hp, step 3).
        assert _rel(real.losses, emulated.losses) < 1e-5, recipe
        assert _rel(real.grad_norms, emulated.grad_norms) < 5e-5, recipe
    # float8 all-gather of weights with precomputed global scales casts exactly as
    # gathering in fp32 and casting after (measured: bitwise equal).
    gathered_f8, gathered_hp = runs[layouts[-2]], runs[layouts[-1]]
    assert "float8 FSDP all-gather" in gathered_f8.output and "float8 FSDP all-gather" not in gathered_hp.output
    assert _rel(gathered_f8.losses, gathered_hp.losses) < 1e-6
    assert _rel(gathered_f8.grad_norms, gathered_hp.grad_norms) < 1e-6
