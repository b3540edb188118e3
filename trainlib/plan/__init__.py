"""Pre-flight planner: check a recipe for a cluster and predict its memory and speed, without GPUs.

    python -m trainlib.plan --recipe recipes/llama3_405b.toml --world-size 512 [--gpu h100|h200|a100]
                            [--section.key=value | --set section.key=value ...] [--json] [--suggest [--top N]]

What it does, in this order (`core.make_plan`):
1. Loads the recipe with its overrides and runs the job's own checks
   (`ParallelDims`, `validate_job`), so a bad layout fails with the same
   one-line error the real job would give.
2. For each pipeline rank, starts torch's fake process group as the first
   global rank of that pipeline coordinate (no communication happens),
   builds the mesh and calls the job's own `trainlib.build.build_model_parts`
   (meta build, float8, pipeline split, parallelize).
3. Reads per-rank parameter bytes from the local shards of the resulting
   DTensors: exact. Gradients and AdamW state follow from them (`memory`).
4. Estimates what is not a parameter with stated formulas (`memory`:
   activations, logits/loss, FSDP all-gather buffers), communication per
   axis (`comm`), and the step's work by kind (`speed`: GEMM and attention
   FLOPs, memory-bound bytes), each at a rate fitted to measured steps
   (`calibration`), for a step time.

Modules: `hardware` (GPUs, assumptions, links), `memory`, `comm`, `speed`,
`calibration` (the measured rows and the fit: `python -m
trainlib.plan.calibration`), `core` (the plan), `search` (--suggest), `cli`.
The formulas and their validation are written in docs/planner.md; the
constants a user may want to change are in `trainlib.hardware.GPUS` and
`hardware.ASSUMPTIONS`, printed with every plan.
"""

from __future__ import annotations

__all__ = ["ASSUMPTIONS", "GPUS", "GiB", "Plan", "StagePlan", "block_activation_bytes_per_token", "format_plan",
           "main", "make_plan", "microbatches_in_flight", "state_bytes", "suggest"]


def __getattr__(name: str):
    # Loaded on first use, so that `python -m trainlib.plan --help` (or a bad flag) answers before torch
    # is imported: core and search build the model.
    if name in ("format_plan", "main"):
        from trainlib.plan import cli as module
    elif name in ("Plan", "StagePlan", "make_plan"):
        from trainlib.plan import core as module
    elif name in ("ASSUMPTIONS", "GPUS", "GiB"):
        from trainlib.plan import hardware as module
    elif name in ("block_activation_bytes_per_token", "microbatches_in_flight", "state_bytes"):
        from trainlib.plan import memory as module
    elif name in ("suggest",):
        from trainlib.plan import search as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
