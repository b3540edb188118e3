"""Throughput of the speed levers on one device: bf16, +compile, +float8 (each
recipe), each with and without activation checkpointing.

    # one GPU, Llama 3.2 1B, a few hundred steps (the docs/performance.md table)
    python scripts/benchmark.py --flavor llama3.2_1b --steps 200 --warmup 20 --seq 2048 --batch 4
    # 8B layers that fit one GPU
    python scripts/benchmark.py --flavor llama3.1_8b --n_layers 4 --steps 100 --seq 4096 --batch 1
    # CPU smoke run (tiny; numbers mean nothing)
    python scripts/benchmark.py --cpu-smoke
    # --recipe and recipe overrides (train's grammar) apply to every configuration
    python scripts/benchmark.py --flavor llama3.1_8b --n_layers 4 --seq 4096 --batch 1 --optimizer.implementation=fused

Every configuration is a separate run of the real CLI (`python -m
trainlib.train`), so compile caches, allocator state and float8 module swaps
never leak between configurations. tokens/s, TFLOPs and MFU are averaged over
the log windows after the first `--warmup` steps (compilation and first-time
allocations excluded). MFU is always against the device's dense bf16 peak,
float8 runs included (see trainlib.metrics); "n/a" where the peak is unknown
(CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from trainlib.config import ConfigError, load_job_config
from trainlib.config.cli import RecipeArgumentParser
from trainlib.launch import train_command

REPO = Path(__file__).resolve().parents[1]

# name -> recipe overrides. bf16 parameters (fp32 gradient reduction and
# optimizer state) are the baseline every lever is added to.
BASE = ["--training.mixed_precision_param=bfloat16", "--training.mixed_precision_reduce=float32"]
CONFIGS: dict[str, list[str]] = {
    "bf16": [],
    "bf16+compile": ["--compile.enable=true"],
    "float8_tensorwise": ["--float8.enable=true", "--float8.recipe=tensorwise"],
    "float8_tensorwise+compile": ["--compile.enable=true", "--float8.enable=true", "--float8.recipe=tensorwise"],
    "float8_rowwise+compile": ["--compile.enable=true", "--float8.enable=true", "--float8.recipe=rowwise"],
    "float8_rowwise_with_gw_hp+compile": ["--compile.enable=true", "--float8.enable=true",
                                          "--float8.recipe=rowwise_with_gw_hp"],
}
DEFAULT_CONFIGS = [c for c in CONFIGS if c != "float8_tensorwise"]  # float8 pays off compiled


def run_config(name: str, ac: str, a: argparse.Namespace, out_root: Path) -> dict:
    folder = out_root / f"{name}_ac-{ac}".replace("+", "_")
    args = [
        f"--model.flavor={a.flavor}", f"--training.steps={a.steps}", f"--training.seq_len={a.seq}",
        f"--training.global_batch_size={a.batch}", f"--metrics.log_freq={a.warmup}", "--metrics.console=false",
        f"--job.dump_folder={folder}", f"--job.device={a.device}", "--parallelism.dp_shard=1",
        f"--activation_checkpoint.mode={ac}", *BASE, *CONFIGS[name],
    ]
    if a.n_layers:
        args.append(f"--model.n_layers={a.n_layers}")
    args = (["--recipe", a.recipe] if a.recipe else []) + args + a.overrides
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(train_command(1, args), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=a.timeout)
    row = {"config": name, "ac": ac}
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["?"]
        return row | {"error": tail[0][:200]}
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > a.warmup] or records[-1:]

    def mean(key):
        vals = [r[key] for r in steady if r[key] is not None]
        return sum(vals) / len(vals) if vals else None

    return row | {
        "tokens_per_second": mean("tokens_per_second"), "tflops": mean("tflops"), "mfu": mean("mfu"),
        "mfu_basis": records[-1].get("mfu_basis"), "matmul_precision": records[-1].get("matmul_precision"),
        "peak_memory_gib": records[-1]["peak_memory_gib"],
        "final_loss": records[-1]["loss"], "steps": records[-1]["step"],
    }


def describe_device(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}, torch {torch.__version__}"


def table(rows: list[dict]) -> str:
    head = f"| {'config':<34} | {'AC':<12} | {'tokens/s':>10} | {'TFLOPs':>7} | {'MFU (bf16 peak)':>15} | {'mem GiB':>7} | {'loss':>7} |"
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']:<34} | {r['ac']:<12} | failed: {r['error']} |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['config']:<34} | {r['ac']:<12} | {r['tokens_per_second']:>10,.0f} | {r['tflops']:>7.2f} | "
                     f"{mfu:>15} | {r['peak_memory_gib']:>7.2f} | {r['final_loss']:>7.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = RecipeArgumentParser("python scripts/benchmark.py", __doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="llama3.2_1b")
    p.add_argument("--n_layers", type=int, default=None, help="fewer layers of a big flavor, to fit one device")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20, help="steps excluded from the averages (also the log window)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--ac", nargs="+", default=["none", "full"],
                   choices=["none", "full", "selective_layer", "selective_op"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per configuration")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny CPU run: debug flavor, 4 steps, bf16 and float8 tensorwise, no compile")
    if "-h" in argv or "--help" in argv:
        print(p.format_help())
        return 0
    try:
        a, overrides = p.parse_recipe_args(argv)
        load_job_config(a.recipe, overrides)  # a typo fails here, once, not in every configuration
    except ConfigError as e:
        print(f"trainlib: error: {e}", file=sys.stderr)
        return 2
    a.overrides = overrides
    if a.cpu_smoke:
        a.flavor, a.n_layers, a.steps, a.warmup, a.seq, a.batch = "debug", None, 4, 2, 64, 2
        a.device = "cpu"
        if a.configs == DEFAULT_CONFIGS:
            a.configs = ["bf16", "float8_tensorwise"]  # compiling takes minutes on a small CPU
    if a.steps <= a.warmup:
        print(f"trainlib: error: --steps ({a.steps}) must exceed --warmup ({a.warmup}) so something is measured",
              file=sys.stderr)
        return 2

    print(f"# {describe_device(a.device)}; {a.flavor} n_layers={a.n_layers or 'default'} "
          f"seq={a.seq} batch={a.batch} steps={a.steps} warmup={a.warmup}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainlib-bench-") as tmp:
        for name in a.configs:
            for ac in a.ac:
                rows.append(run_config(name, ac, a, Path(tmp)))
                print(f"  done {name} ac={ac}", file=sys.stderr, flush=True)
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
