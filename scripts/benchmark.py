"""Throughput of the speed levers on one device, one row per configuration,
with the planner's prediction for the same configuration beside the measurement.

    # the issue-11 H100 table (Llama 3.1 8B shape cut to 8 blocks, seq 8192, batch 1; 1B rows), named presets
    python scripts/benchmark.py --presets all --steps 30 --warmup 14
    python scripts/benchmark.py --presets 8b8-compile-sac 8b8-compile-none
    # the lever grid: bf16, +compile, +float8 (each recipe), each with and without AC
    python scripts/benchmark.py --flavor llama3.2_1b --steps 200 --warmup 20 --seq 2048 --batch 4
    # CPU smoke run (tiny; numbers mean nothing), grid or presets
    python scripts/benchmark.py --cpu-smoke
    python scripts/benchmark.py --cpu-smoke --presets 8b8-eager-sac
    # --recipe and recipe overrides (train's grammar) apply to every configuration
    python scripts/benchmark.py --presets all --loss.chunk_tokens=1024

Every configuration is a separate run of the real CLI (`python -m
trainlib.train`), so compile caches, allocator state and float8 module swaps
never leak between configurations. tokens/s, TFLOP/s and MFU are medians of
the per-step records after the first `--warmup` steps (compilation and
first-time allocations excluded); memory is the run's peak (CUDA: allocated;
CPU: process RSS) and loss the last step's. MFU is always against the
device's dense bf16 peak, float8 runs included (see trainlib.metrics); "n/a"
where the peak is unknown (CPU). The planner columns are
`python -m trainlib.plan`'s prediction for the same configuration on one
`--gpu` (default: the GPU found, else h100): step time and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trainlib

from trainlib.config import ConfigError, load_job_config
from trainlib.config.cli import RecipeArgumentParser
from trainlib.launch import train_command

REPO = Path(__file__).resolve().parents[1]

# bf16 parameters (fp32 gradient reduction and optimizer state) are the
# baseline every lever is added to.
BASE = ["--training.mixed_precision_param=bfloat16", "--training.mixed_precision_reduce=float32"]
COMPILE = ["--compile.enable=true"]
F8_TW = ["--float8.enable=true", "--float8.recipe=tensorwise"]
F8_RW = ["--float8.enable=true", "--float8.recipe=rowwise"]
CONFIGS: dict[str, list[str]] = {
    "bf16": [],
    "bf16+compile": COMPILE,
    "float8_tensorwise": F8_TW,
    "float8_tensorwise+compile": COMPILE + F8_TW,
    "float8_rowwise+compile": COMPILE + F8_RW,
    "float8_rowwise_with_gw_hp+compile": COMPILE + ["--float8.enable=true", "--float8.recipe=rowwise_with_gw_hp"],
}
DEFAULT_CONFIGS = [c for c in CONFIGS if c != "float8_tensorwise"]  # float8 pays off compiled

# The rows of issue 11's H100 table (TorchTitan comparison), plus ablations
# that switch one automatic choice back, so a GPU run shows what each is worth.
SAC = ["--activation_checkpoint.mode=selective_op", "--activation_checkpoint.selective_op_policy=every_other_mm"]
SAC_ALL = ["--activation_checkpoint.mode=selective_op", "--activation_checkpoint.selective_op_policy=all_mm"]
NO_AC = ["--activation_checkpoint.mode=none"]
FULL_AC = ["--activation_checkpoint.mode=full"]
# The table's compiled rows compile the loss chunks too, as the recipes do and
# as TorchTitan does by default (its compile covers model and loss).
COMPILE_ALL = COMPILE + ["--compile.loss=true"]
NO_COPY = ["--training.mixed_precision_weight_copy=false"]
FUSED_ADAMW = ["--optimizer.implementation=fused"]
BF16_STATE = ["--optimizer.state_dtype=bfloat16"]
L8B = {"flavor": "llama3.1_8b", "n_layers": 8, "seq": 8192, "batch": 1}
L1B = {"flavor": "llama3.2_1b", "n_layers": 16, "seq": 8192, "batch": 1}
PRESETS: dict[str, tuple[dict, list[str]]] = {
    "8b8-eager-sac": (L8B, SAC),
    "8b8-compile-sac": (L8B, COMPILE_ALL + SAC),
    "8b8-compile-none": (L8B, COMPILE_ALL + NO_AC),
    "8b8-compile-sac-f8tw": (L8B, COMPILE_ALL + SAC + F8_TW),
    "8b8-compile-sac-f8rw": (L8B, COMPILE_ALL + SAC + F8_RW),  # the combination that trained NaN before the fix
    "8b8-compile-sacall-f8rw": (L8B, COMPILE_ALL + SAC_ALL + F8_RW),  # rowwise saving every matmul
    "8b8-seq32k-compile-full": ({**L8B, "seq": 32768}, COMPILE_ALL + FULL_AC),
    "1b16-compile-none": (L1B, COMPILE_ALL + NO_AC),
    "1b16-compile-none-f8tw": (L1B, COMPILE_ALL + NO_AC + F8_TW),
    # ablations of 8b8-compile-sac: each undoes one default
    "8b8-compile-sac-fsdp1": (L8B, COMPILE_ALL + SAC + ["--training.mixed_precision_impl=fsdp"]),
    "8b8-compile-sac-foreach": (L8B, COMPILE_ALL + SAC + ["--optimizer.implementation=foreach"]),
    "8b8-compile-sac-wholelogits": (L8B, COMPILE_ALL + SAC + ["--loss.chunked=false"]),
    "8b8-compile-sac-chunk256": (L8B, COMPILE_ALL + SAC + ["--loss.chunk_tokens=256"]),  # CUDA's auto is 2048
    "8b8-compile-sac-nocloss": (L8B, COMPILE + SAC),  # the loss chunks run eagerly (compile.loss's default)
    "8b8-compile-sac-nocopy": (L8B, COMPILE_ALL + SAC + NO_COPY),  # weights cast where used, not once per step
    # torch's fused AdamW and a separate pass for the weight copies, instead of trainlib's compiled AdamW
    "8b8-compile-sac-fusedadamw": (L8B, COMPILE_ALL + SAC + FUSED_ADAMW),
    "1b16-compile-none-fusedadamw": (L1B, COMPILE_ALL + NO_AC + FUSED_ADAMW),
    # bf16 AdamW moments (optimizer.state_dtype; off by default)
    "8b8-compile-sac-bf16state": (L8B, COMPILE_ALL + SAC + BF16_STATE),
    "8b8-compile-none-bf16state": (L8B, COMPILE_ALL + NO_AC + BF16_STATE),
}
TINY = {"flavor": "debug", "n_layers": None, "seq": 64, "batch": 2}  # --cpu-smoke shape, presets included


def _shape_args(shape: dict) -> list[str]:
    args = [f"--model.flavor={shape['flavor']}", f"--training.seq_len={shape['seq']}",
            f"--training.global_batch_size={shape['batch']}"]
    return args + ([f"--model.n_layers={shape['n_layers']}"] if shape["n_layers"] else [])


def run_row(name: str, shape: dict, overrides: list[str], a: argparse.Namespace, out_root: Path) -> dict:
    folder = out_root / name.replace("+", "_")
    args = [*_shape_args(shape), f"--training.steps={a.steps}", "--metrics.log_freq=1", "--metrics.console=false",
            f"--job.dump_folder={folder}", f"--job.device={a.device}", "--parallelism.dp_shard=1",
            *BASE, *overrides, *a.smoke_overrides]
    args = (["--recipe", a.recipe] if a.recipe else []) + args + a.overrides
    row = {"config": name} | (NO_PLAN if a.no_plan else plan_row(args, a.gpu))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        proc = subprocess.run(train_command(1, args), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=a.timeout)
    except subprocess.TimeoutExpired:  # one slow configuration must not lose the others' rows
        return row | {"error": f"timed out after {a.timeout:.0f} s (--timeout)"}
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["?"]
        return row | {"error": tail[0][:200]}
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > a.warmup] or records[-1:]

    def median(key):
        vals = [r[key] for r in steady if r[key] is not None]
        return statistics.median(vals) if vals else None

    return row | {
        "tokens_per_second": median("tokens_per_second"), "tflops": median("tflops"), "mfu": median("mfu"),
        "step_time_s": median("step_time_s"), "mfu_basis": records[-1].get("mfu_basis"),
        "matmul_precision": records[-1].get("matmul_precision"),
        "peak_memory_gib": max(r["peak_memory_gib"] for r in records),
        "final_loss": records[-1]["loss"], "steps": records[-1]["step"],
    }


NO_PLAN = {"plan_step_s": None, "plan_tokens_per_second": None, "plan_peak_gib": None, "plan_allocated_gib": None}


def plan_row(args: list[str], gpu: str) -> dict:
    """The planner's step time and peak memory for the job `args` describe, on one `gpu`."""
    from trainlib.plan import GiB, make_plan

    recipe = args[args.index("--recipe") + 1] if "--recipe" in args else None
    overrides = [x for x in args if x.startswith("--") and "=" in x]
    try:
        p = make_plan(recipe, 1, gpu, overrides)
    except ValueError as e:  # the job's own rejection; its run fails with the same message
        return NO_PLAN | {"plan_error": str(e)}
    worst = max(p.stages, key=lambda st: st.total_bytes)
    # plan_peak_gib includes the planner's allocator overhead (reserved memory); the run's peak_memory_gib is
    # torch's max_memory_allocated, which plan_allocated_gib predicts.
    return {"plan_step_s": p.step_seconds, "plan_tokens_per_second": p.tokens_per_second_per_gpu,
            "plan_peak_gib": p.max_total_bytes / GiB,
            "plan_allocated_gib": (worst.total_bytes - worst.memory["overhead"]) / GiB, "plan_gpu": gpu}


def detect_gpu(device: str) -> str:
    """The planner's name for the GPU this runs on (h100 when none is found)."""
    import torch

    from trainlib.hardware import gpu_of_device
    from trainlib.plan.hardware import GPUS

    if device != "cpu" and torch.cuda.is_available():
        found = gpu_of_device(torch.cuda.get_device_name())
        key = next((k for k, g in GPUS.items() if g is found), None)
        if key:
            return key
    return "h100"


def describe_device(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}, torch {torch.__version__}"


def table(rows: list[dict]) -> str:
    head = (f"| {'config':<34} | {'tokens/s':>10} | {'TFLOPs':>7} | {'MFU (bf16 peak)':>15} | {'mem GiB':>7} | "
            f"{'loss':>7} | {'step s':>7} | {'plan step s':>11} | {'plan GiB':>8} | {'plan alloc GiB':>14} |")
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        plan = (f"{r['plan_step_s']:>11.3f} | {r['plan_peak_gib']:>8.1f} | {r['plan_allocated_gib']:>14.2f} |"
                if r["plan_step_s"] is not None else f"{'n/a':>11} | {'n/a':>8} | {'n/a':>14} |")
        if "error" in r:
            lines.append(f"| {r['config']:<34} | failed: {r['error']} | {plan}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['config']:<34} | {r['tokens_per_second']:>10,.0f} | {r['tflops']:>7.2f} | {mfu:>15} | "
                     f"{r['peak_memory_gib']:>7.2f} | {r['final_loss']:>7.3f} | {r['step_time_s']:>7.3f} | {plan}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = RecipeArgumentParser("python scripts/benchmark.py", __doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=None, choices=[*PRESETS, "all"],
                   help="run these named rows (issue 11's table and ablations) instead of the lever grid")
    p.add_argument("--flavor", default="llama3.2_1b")
    p.add_argument("--n_layers", type=int, default=None, help="fewer layers of a big flavor, to fit one device")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="steps excluded from the medians")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--ac", nargs="+", default=["none", "full"],
                   choices=["none", "full", "selective_layer", "selective_op"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--gpu", default=None, help="the planner's GPU for the prediction columns (default: detected)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    p.add_argument("--no-plan", action="store_true",
                   help="leave out the planner's columns (they need no GPU: compute them later on any machine)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny CPU run: debug flavor, 4 steps; grid: bf16 and float8 tensorwise, no compile")
    if p.help_requested(argv):
        return 0
    try:
        a, overrides = p.parse_recipe_args(argv)
        load_job_config(a.recipe, overrides)  # a typo fails here, once, not in every configuration
    except ConfigError as e:
        print(f"trainlib: error: {e}", file=sys.stderr)
        return 2
    a.overrides, a.smoke_overrides = overrides, []
    if a.cpu_smoke:
        a.flavor, a.n_layers, a.steps, a.warmup, a.seq, a.batch = "debug", None, 4, 2, 64, 2
        a.device = "cpu"
        # The debug model's linears are below float8's size bound: convert them all, to run the path.
        a.smoke_overrides = ["--float8.min_size=0"]
        if a.configs == DEFAULT_CONFIGS:
            a.configs = ["bf16", "float8_tensorwise"]  # compiling takes minutes on a small CPU
    if a.steps <= a.warmup:
        print(f"trainlib: error: --steps ({a.steps}) must exceed --warmup ({a.warmup}) so something is measured",
              file=sys.stderr)
        return 2
    a.gpu = a.gpu or detect_gpu(a.device)

    if a.presets:
        names = list(PRESETS) if "all" in a.presets else a.presets
        jobs = [(n, TINY if a.cpu_smoke else PRESETS[n][0], PRESETS[n][1]) for n in names]
        what = "presets" + (" at the --cpu-smoke shape" if a.cpu_smoke else "")
    else:
        shape = {"flavor": a.flavor, "n_layers": a.n_layers, "seq": a.seq, "batch": a.batch}
        jobs = [(f"{c} ac={ac}", shape, CONFIGS[c] + [f"--activation_checkpoint.mode={ac}"])
                for c in a.configs for ac in a.ac]
        what = f"{a.flavor} n_layers={a.n_layers or 'default'} seq={a.seq} batch={a.batch}"
    print(f"# {describe_device(a.device)}; {what}; steps={a.steps} warmup={a.warmup}; plan on 1 x {a.gpu}",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainlib-bench-") as tmp:
        for name, shape, extra in jobs:
            rows.append(run_row(name, shape, extra, a, Path(tmp)))
            print(f"  done {name}", file=sys.stderr, flush=True)
            if a.out:  # after each row: a run cut short by a time limit keeps what it measured
                Path(a.out).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
