"""The step-time model's constants, fitted to measured single-GPU steps, and its error on rows it was not fitted to.

    python -m trainlib.plan.calibration            # the rows: measured, planned, error; fit and held out
    python -m trainlib.plan.calibration --refit    # and the constants a least-squares fit gives

`ROWS` are docs/performance.md's "GPU benchmark" tables (scripts/benchmark.py presets: an 8B shape cut
to 8 blocks or a 1B's 16, batch 1, one GPU, bf16 autocast over fp32 weights, fused AdamW unless a row
says otherwise), as measured: tokens/s, the median of steps 15..30, and the step it implies; they live
in calibration.toml beside this module, shipped in the package (`load`). Each row names the trainlib commit it ran; rows from before 9c90ebc scaled the clipped gradients in a pass of
their own (`clip_in_fused_step=False`), and none had a weight copy (training.mixed_precision_weight_copy).

`fit` solves by least squares on the relative error of the step, in two linear steps: the reciprocals of
the five rates (RATES; the planned step is linear in them) on the bf16 rows marked "fit" and on the H100
profile's three sums (PROFILE); then, with those fixed, the float8 constants on the float8 rows marked
"fit" (the time a converted linear saves is linear in 1 - 1/speedup per recipe and in the casts' bytes).
The rows marked "held out" are what the fit is judged on (tests/unit/test_plan_fit.py, docs/planner.md).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from trainlib.plan.hardware import ASSUMPTIONS, GPUS

@dataclass(frozen=True)
class Row:
    preset: str
    gpu: str
    commit: str  # the trainlib commit measured
    overrides: tuple[str, ...]
    tokens_per_second: float
    split: str  # "fit" or "held out"
    why: str = ""  # what a held-out row tests

    @property
    def tokens(self) -> int:  # batch 1
        return int(next(o for o in self.overrides if o.startswith("training.seq_len=")).split("=")[1])

    @property
    def step_seconds(self) -> float:
        return self.tokens / self.tokens_per_second

    @property
    def float8(self) -> bool:
        return "float8.enable=true" in self.overrides

    @property
    def code(self) -> dict:
        """The assumptions that describe the code the row ran."""
        return {"clip_in_fused_step": self.commit not in BEFORE_CLIP_IN_STEP}


BEFORE_CLIP_IN_STEP = ("e34b807", "054a122")

# The measured rows ship in the package (package data, pyproject.toml), so an installed trainlib fits and
# judges the constants as a checkout does (before, they sat in the checkout's benchmarks/ folder and an
# installed trainlib had no rows: `python -m trainlib.plan.calibration` listed nothing).
ROWS_FILE = Path(__file__).with_name("calibration.toml")


def load(path: Path = ROWS_FILE) -> tuple[list[Row], dict]:
    """(the rows, the profile) of a calibration file (trainlib/plan/calibration.toml's format)."""
    from trainlib.config.loader import ConfigError, tomllib

    if not path.is_file():
        raise ConfigError(f"{path} is missing: the calibration rows ship as trainlib/plan/calibration.toml")
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    rows = [Row(r["preset"], r["gpu"], r["commit"], tuple(r["overrides"]), r["tokens_per_second"], r["split"],
                r.get("why", "")) for r in data["row"]]
    p = data["profile"]
    row = next(r for r in rows if [r.preset, r.gpu, r.commit] == p["row"])
    return rows, {"row": row, "gemm": p["gemm"], "attention": p["attention"], "memory": p["memory"]}


# The H100 row's profile (docs/performance.md: torch.profiler, GPU kernel time inside one step of
# 8b8-compile-sac at e34b807): its GEMMs, its flash attention, and every other kernel (the optimizer,
# the clip, casts, elementwise, the loss's), seconds. Fitted beside the steps: whole steps alone hardly
# tell the GEMMs' rate from the memory-bound kernels' (every 8B row holds them in about the same proportion).
ROWS, PROFILE = load()


def no_weight_copy() -> list[str]:
    """No row kept a bf16 weight copy: where the job has the key (trainlib.precision), switch it off."""
    from trainlib.config.job import TrainingConfig

    names = {f.name for f in fields(TrainingConfig)}
    return ["training.mixed_precision_weight_copy=false"] if "mixed_precision_weight_copy" in names else []


def plan_row(row: Row, assumptions: dict | None = None):
    from trainlib.plan.core import make_plan

    return make_plan(None, 1, row.gpu, [*row.overrides, *no_weight_copy()], {**row.code, **(assumptions or {})})


# ---- the fit ---------------------------------------------------------------------------------------------------


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Least squares: x minimising |a x - b|, by the normal equations and Gaussian elimination."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(m[i][c]))
        m[c], m[p] = m[p], m[c]
        for i in range(n):
            if i != c:
                f = m[i][c] / m[c][c]
                m[i] = [x - f * y for x, y in zip(m[i], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


RATES = ("gemm_efficiency", "attention_efficiency", "attention_score_tera_per_s", "memory_efficiency",
         "memory_kernel_tbps")


def _columns(plan, capped: bool) -> dict[str, list[float]]:
    """Per kind of work, its seconds per unit of each rate's reciprocal (RATES order): the planned time
    is linear in the reciprocals. `capped`: the card's memory-bound kernels run at memory_kernel_tbps."""
    hw, w = GPUS[plan.gpu], plan.step_work
    peak = hw.bf16_tflops * 1e12
    mem = sum(v for k, v in w.items() if k.endswith("_bytes")) / 1e12
    return {"gemm": [(w["gemm_flops"] - w["float8_saved_flops"]) / peak, 0, 0, 0, 0],
            "attention": [0, w["attention_flops"] / peak, w["attention_scores"] / 1e12, 0, 0],
            "memory": [0, 0, 0, 0, mem] if capped else [0, 0, 0, mem / hw.memory_tbps, 0]}


def _capped(gpu: str, rates: dict) -> bool:
    return GPUS[gpu].memory_tbps * rates["memory_efficiency"] > rates["memory_kernel_tbps"]


def fit(rows: list[Row] | None = None) -> dict:
    """The constants least squares gives on the rows marked "fit" and the profile (ASSUMPTIONS keys)."""
    rows = [r for r in (ROWS if rows is None else rows) if r.split == "fit"]
    bf16 = [r for r in rows if not r.float8]
    plans = {r: plan_row(r) for r in bf16 + [PROFILE["row"]]}
    rates = {k: ASSUMPTIONS[k] for k in RATES}
    for _ in range(4):  # which cards the bandwidth cap binds on, from the last fit, until that holds
        a, b = [], []
        for r in bf16:
            cols = _columns(plans[r], _capped(r.gpu, rates))
            a.append([sum(c) / r.step_seconds for c in zip(*cols.values())])
            b.append(1.0)
        cols = _columns(plans[PROFILE["row"]], _capped(PROFILE["row"].gpu, rates))
        for kind in ("gemm", "attention", "memory"):
            a.append([c / PROFILE[kind] for c in cols[kind]])
            b.append(1.0)
        fitted = dict(zip(RATES, (1 / x for x in _solve(a, b))))
        if all(_capped(g, fitted) == _capped(g, rates) for g in GPUS):
            break
        rates = fitted
    rates = fitted
    # float8: with u = 1 - 1/speedup per recipe and c the casts' bytes, a converted linear's cut is
    # u - c * k / size (float8_cuts), and the saved time linear in both: read the two coefficients off
    # plans with (u = 1/2, c = 0) and (u = 0, c = 1).
    recipes = sorted({o.split("=")[1] for r in rows if r.float8 for o in r.overrides if o.startswith("float8.recipe")})
    a, b = [], []
    for r in (r for r in rows if r.float8):
        recipe = next(o.split("=")[1] for o in r.overrides if o.startswith("float8.recipe"))
        half = plan_row(r, {**rates, "float8_matmul_speedup": {recipe: 2.0}, "float8_cast_bytes": {recipe: 0.0}})
        cast = plan_row(r, {**rates, "float8_matmul_speedup": {recipe: 1.0}, "float8_cast_bytes": {recipe: 1.0}})
        rest = sum(v for k, v in half.step_terms.items() if k != "gemm")
        gemm_s = half.step_work["gemm_flops"] / (GPUS[r.gpu].bf16_tflops * 1e12 * rates["gemm_efficiency"])
        per_u = 2 * (gemm_s - half.step_terms["gemm"])  # seconds saved per unit of u
        per_c = gemm_s - cast.step_terms["gemm"]  # per cast byte (negative)
        a.append([per_u / r.step_seconds if x == recipe else 0.0 for x in recipes] + [per_c / r.step_seconds])
        b.append((rest + gemm_s) / r.step_seconds - 1)
    *us, cast_bytes = _solve(a, b)
    speedup = {x: 1 / (1 - u) for x, u in zip(recipes, us)}
    # rowwise_with_gw_hp, not measured: rowwise's forward and input-gradient matmuls, a bf16 weight gradient.
    speedup["rowwise_with_gw_hp"] = 3 / (2 / speedup["rowwise"] + 1)
    return {**rates, "float8_matmul_speedup": speedup, "float8_cast_bytes": dict.fromkeys(speedup, cast_bytes)}


def errors(rows: list[Row] | None = None, assumptions: dict | None = None) -> list[tuple[Row, float, float]]:
    """(row, planned step seconds, relative error planned / measured - 1) for every row."""
    out = []
    for r in ROWS if rows is None else rows:
        planned = plan_row(r, assumptions).step_seconds
        out.append((r, planned, planned / r.step_seconds - 1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser("python -m trainlib.plan.calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("--refit", action="store_true", help="also print the constants a fit to the rows gives")
    a = ap.parse_args(argv)
    from trainlib.config.loader import ConfigError

    try:
        load()
    except ConfigError as e:
        print(f"trainlib.plan.calibration: error: {e}")
        return 2
    print(f"{'preset':<28}{'gpu':<6}{'commit':<9}{'split':<10}{'measured s':>11}{'planned s':>10}{'error':>8}  tests")
    for split in ("fit", "held out"):
        errs = [(r, p, e) for r, p, e in errors() if r.split == split]
        for r, p, e in errs:
            print(f"{r.preset:<28}{r.gpu:<6}{r.commit:<9}{split:<10}{r.step_seconds:>11.4f}{p:>10.4f}{e:>+8.1%}"
                  f"  {r.why}")
        print(f"  {split}: mean |error| {sum(abs(e) for *_, e in errs) / len(errs):.1%}, "
              f"largest {max(abs(e) for *_, e in errs):.1%}")
    shipped = {k: ASSUMPTIONS[k] for k in (*RATES, "float8_matmul_speedup", "float8_cast_bytes")}
    print(f"shipped: {shipped}")
    if a.refit:
        print(f"refit:   {fit()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
