"""`python -m trainlib.plan`: the planner's command line and its printed tables.

torch is imported only once the command line is read (`core` and `search` build
the model): `--help` and a bad flag answer at once.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

from trainlib.plan.hardware import GPUS, GiB

if TYPE_CHECKING:
    from trainlib.plan.core import Plan

DESCRIPTION = """Checks a recipe for a cluster and predicts per-GPU memory and step time, without GPUs.
Builds the job's own model on torch's fake process group, one pipeline rank at a
time; see docs/planner.md. Recipe keys are overridden as --section.key=value,
--section.key value, or --set section.key=value."""


def format_plan(p: Plan) -> str:
    unit, div = ("GiB", GiB) if p.max_total_bytes >= GiB else ("MiB", 2**20)
    deg = " ".join(f"{k}={v}" for k, v in p.degrees.items())
    if p.degrees.get("cp", 1) > 1:
        deg += f" cp_method={p.cp_method}" + (f" cp_ulysses={p.cp_ulysses}" if p.cp_method == "hybrid" else "")
    lines = [
        f"plan: {p.recipe} on {p.world_size} x {GPUS[p.gpu].name} | {p.model} {p.n_params / 1e9:.3g}B params",
        f"layout: {deg} | seq {p.seq_len} | local batch {p.local_batch_size} (micro-batch {p.microbatch}, "
        f"{p.pp_microbatches} pp micro-batches, accumulation {p.grad_accum}) | AC {p.ac}",
        f"links ({p.assumptions['gpus_per_node']} GPUs/node, tp innermost): "
        + ", ".join(f"{k}={'NVLink' if v else 'IB'}" for k, v in p.intra_node.items()),
        "",
        f"memory per rank ({unit})" + ("" if len(p.stages) == 1 else ", per pipeline rank"),
    ]
    keys = list(p.stages[0].memory)
    w = max(len(k) for k in keys) + 2
    lines.append(f"  {'pp rank':<8}{'blocks':>12}" + "".join(f"{k:>{w}}" for k in keys) + f"{'total':>{w}}")
    for s in p.stages:
        lay = f"{len(s.layers)}" + ("+emb" if s.has_embedding else "") + ("+out" if s.has_output else "")
        cells = [f"({s.memory[k] / div:.2f})" if k in s.not_live else f"{s.memory[k] / div:.2f} " for k in keys]
        lines.append(f"  {s.pp_rank:<8}{lay:>12}" + "".join(f"{c:>{w}}" for c in cells)
                     + f"{s.total_bytes / div:>{w}.2f}")
    lines += ["  (x): not live at the rank's peak, the start of a backward or the optimizer step (activations freed);",
              "  total: what is live there"]
    lines += ["", "communication per rank per step"]
    for k, v in p.comm_bytes.items():
        lines.append(f"  {k:<26}{v / GiB:9.2f} GiB  {p.comm_seconds[k]:8.3f} s")
    if not p.comm_bytes:
        lines.append("  none")
    lines += [
        "",
        f"FLOPs per rank per step {p.flops_per_step_per_rank:.3e} -> compute {p.compute_seconds:.3f} s"
        + (f"; pipeline bubble {p.bubble_fraction:.0%}" if p.bubble_fraction else ""),
        *_compute_lines(p),
        f"predicted step {p.step_seconds:.3f} s | {p.tokens_per_second_per_gpu:,.0f} tokens/s/GPU | MFU {p.mfu:.1%}",
        f"peak memory {p.max_total_bytes / GiB:.1f} GiB of {GPUS[p.gpu].memory_gib:.0f} GiB: "
        + ("fits" if p.fits else "DOES NOT FIT"),
    ]
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def _compute_lines(p: Plan) -> list[str]:
    """The compute time by kind of work, each at its rate (trainlib.plan.speed)."""
    from trainlib.plan.speed import memory_bytes_per_second

    hw, A, terms = GPUS[p.gpu], p.assumptions, p.step_terms
    memory = {k: v for k, v in terms.items() if k not in ("gemm", "attention")}
    return [f"  GEMMs {terms['gemm']:.3f} s at {A['gemm_efficiency']:.0%} of {hw.bf16_tflops:.0f} TFLOPs"
            f" | attention {terms['attention']:.3f} s"
            f" | memory-bound {sum(memory.values()):.3f} s at {memory_bytes_per_second(hw, A) / 1e12:.2f} TB/s: "
            + ", ".join(f"{k} {v:.3f}" for k, v in memory.items())]


def _cp_method(row: dict) -> str:
    """allgather, ulysses or hybrid:<inner degree>"""
    return f"hybrid:{row['cp_ulysses']}" if row.get("cp_ulysses") else row.get("cp_method", "allgather")


def format_suggestions(rows: list[dict], recipe: str | None, world_size: int, gpu: str) -> str:
    """The rows as a table; each ends with its overrides, to paste after `--recipe ...` of
    `python -m trainlib.train` (or of this command, for the whole plan)."""
    lines = [f"layouts of {recipe} on {world_size} x {GPUS[gpu].name} that fit, fastest first:",
             f"  {'tp':>3}{'pp':>4}{'cp':>4} {'cp_method':<10}{'dp_rep':>7}{'dp_shard':>9}  {'ac':<13}"
             f"{'peak GiB':>9}{'step s':>9}{'MFU':>7}  overrides"]
    moe = any("ep" in r for r in rows)
    if moe:
        lines[1] = lines[1].replace(f"{'dp_shard':>9}", f"{'dp_shard':>9}{'ep':>4}")
    for r in rows:
        ep = f"{r.get('ep', 1):>4}" if moe else ""
        lines.append(f"  {r['tp']:>3}{r['pp']:>4}{r['cp']:>4} {_cp_method(r):<10}{r['dp_replicate']:>7}"
                     f"{r['dp_shard']:>9}{ep}  {r['ac']:<13}{r['peak_gib']:>9.1f}{r['step_s']:>9.3f}"
                     f"{r['mfu']:>7.1%}  " + " ".join(f"--{o}" for o in r["set"]))
    if not rows:
        lines.append("  none fits: lower the local batch or sequence length, or add GPUs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from trainlib.config import ConfigError
    from trainlib.config.cli import RecipeArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = RecipeArgumentParser("python -m trainlib.plan", DESCRIPTION)
    ap.add_argument("--world-size", type=int, required=True, help="number of GPUs (ranks) of the job")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--suggest", action="store_true", help="list layouts that fit, fastest first")
    ap.add_argument("--top", type=int, default=10, help="with --suggest: how many layouts to list")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    if ap.help_requested(argv):
        return 0
    try:
        a, overrides = ap.parse_recipe_args(argv)
        if a.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {a.world_size}")
        from trainlib.plan.core import make_plan
        from trainlib.plan.search import progress_printer, suggest

        if a.suggest:
            rows = suggest(a.recipe, a.world_size, a.gpu, overrides, a.top, progress_printer(sys.stderr))
            print(json.dumps(rows, indent=1) if a.json else format_suggestions(rows, a.recipe, a.world_size, a.gpu))
            return 0
        p = make_plan(a.recipe, a.world_size, a.gpu, overrides)
    except ConfigError as e:  # the job's own one-line message; anything else keeps its traceback
        print(f"trainlib.plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(p), indent=1) if a.json else format_plan(p))
    return 0
