"""How long the training loop is blocked per checkpoint save, per async_mode.

    python -m trainlib.checkpoint.bench [--steps 9] [--interval 3] [--nproc 1] [--model debug|wide]
        [--recipe FILE] [--section.key=value ...]

Runs the real CLI once per `checkpoint.async_mode` and reads the
"loop blocked" time that `Checkpointer.save` logs for every save; prints a
markdown table (first save separately: the process mode starts its writer
process then). `wide` is llama3.2_1b's width (dim 2048, ffn 8192) with one
layer and an 8192-token vocabulary: ~77M parameters, ~0.9 GB of model +
optimizer state, big enough to be write-bound on CPU. Recipe overrides
(train's grammar) apply to every run; without --recipe the built-in defaults
run.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from trainlib.config import ConfigError, load_job_config
from trainlib.config.cli import RecipeArgumentParser
from trainlib.launch import train_command

def _flavor_of_width(dim: int) -> list[str]:
    """The first registered family's first flavor whose blocks are `dim` wide, as model overrides."""
    from trainlib.models.registry import MODELS as FAMILIES

    for spec in FAMILIES.values():
        for flavor, args in spec.flavors.items():
            if getattr(args, "dim", None) == dim:
                return [f"--model.name={spec.name}", f"--model.flavor={flavor}"]
    raise ValueError(f"no registered flavor is {dim} wide")


MODELS = {
    "debug": ["--model.flavor=debug", "--training.seq_len=256", "--training.global_batch_size=16"],
    # one block 2048 wide (a 1B-class model's): ~60 MB of weights per block in fp32
    "wide": [*_flavor_of_width(2048), "--model.n_layers=1", "--model.vocab_size=8192",
             "--training.seq_len=64", "--training.global_batch_size=2"],
}
MODES = ("disabled", "async", "async_with_pinned_mem")


def _args(model: str, mode: str, steps: int, interval: int, folder: str, overrides: list[str]) -> list[str]:
    return [*MODELS[model], *overrides, f"--training.steps={steps}", f"--metrics.log_freq={steps}",
            f"--job.dump_folder={folder}", "--checkpoint.enable=true", f"--checkpoint.interval={interval}",
            f"--checkpoint.async_mode={mode}", "--checkpoint.fresh_start=true"]


def blocked_seconds(output: str) -> list[float]:
    """Each save's "loop blocked" time in a job's log (Checkpointer.save's line), in order."""
    return [float(x) for x in re.findall(r"loop blocked ([0-9.]+) s", output)]


def run(recipe: str | None, args: list[str], nproc: int) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    proc = subprocess.run(train_command(nproc, (["--recipe", recipe] if recipe else []) + args),
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return blocked_seconds(proc.stdout), wall


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = RecipeArgumentParser("python -m trainlib.checkpoint.bench", __doc__)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--interval", type=int, default=3)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--model", nargs="+", default=["debug", "wide"], choices=sorted(MODELS))
    if p.help_requested(argv):
        return 0
    try:
        a, overrides = p.parse_recipe_args(argv)
        for model in a.model:  # a typo fails here, in one line, not after minutes of runs
            load_job_config(a.recipe, _args(model, MODES[0], a.steps, a.interval, ".", overrides))
    except ConfigError as e:
        print(f"trainlib: error: {e}", file=sys.stderr)
        return 2
    print("| model | async_mode | first save blocked (s) | later saves blocked, median (s) | run wall (s) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="trainlib-ckbench-") as tmp:
        for model in a.model:
            for mode in MODES:
                folder = os.path.join(tmp, model)
                blocked, wall = run(a.recipe, _args(model, mode, a.steps, a.interval, folder, overrides), a.nproc)
                later = statistics.median(blocked[1:]) if len(blocked) > 1 else float("nan")
                print(f"| {model} | {mode} | {blocked[0]:.3f} | {later:.3f} | {wall:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
