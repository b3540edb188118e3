"""--suggest: layouts of a recipe's model for a cluster that fit in memory, fastest first."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from trainlib.errors import ConfigError
from trainlib.plan.core import load_job, make_plan, memory_floor
from trainlib.plan.hardware import ASSUMPTIONS, GPUS, GiB

AC_MODES = ("none", "selective_op", "full")
MANY_EXPERTS = 64  # from this many experts, expert parallel is also tried across nodes ...
MAX_EP = 64  # ... up to this degree (DeepSeek-V3's report trains with 64-way expert parallel over 8 nodes)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_methods(cp: int) -> list[tuple[str, int | None]]:
    """(cp_method, cp_ulysses) the search tries at a CP degree: the all-gather, Ulysses over all cp ranks,
    and from cp = 4 hybrid with an inner all-to-all over 2 (layouts the heads refuse are skipped with
    the rest the job would reject)."""
    if cp == 1:
        return [("allgather", None)]
    return [("allgather", None), ("ulysses", None)] + ([("hybrid", 2)] if cp >= 4 else [])


def layouts(world_size: int, kv_heads: int, n_layers: int, gpus_per_node: int, n_experts: int = 0
            ) -> Iterator[tuple[list[str], list[str]]]:
    """Every layout --suggest tries, in the order it tries them (the order ties keep), as overrides:
    (the degrees, the pipeline schedule's). With `n_experts` (an MoE model), each layout also with every
    expert-parallel degree that divides the experts and dp_shard x cp x tp, up to a node's GPUs (the
    all-to-all on NVLink) and, for models of at least MANY_EXPERTS experts, beyond a node up to
    MAX_EP (the all-to-all over the network; what keeps DeepSeek-V3-sized expert sets from being
    FSDP-gathered over the network every step); with cp > 1, each CP method (`cp_methods`)."""
    for tp in [d for d in _divisors(kv_heads) if d <= gpus_per_node and world_size % d == 0]:
        for pp in [d for d in _divisors(world_size // tp) if d <= min(n_layers, 16)]:
            for cp in [c for c in (1, 2, 4) if (world_size // (tp * pp)) % c == 0]:
                rest = world_size // (tp * pp * cp)
                for dpr in sorted({1, max(1, rest // max(1, gpus_per_node // (tp * cp)))}):
                    if rest % dpr:
                        continue
                    schedule = ["parallelism.pp_schedule=1F1B", "parallelism.pp_stages_per_rank=1"] if pp > 1 else []
                    span = rest // dpr * cp * tp  # dp_shard x cp x tp, where expert parallel takes its ranks
                    for method, inner in cp_methods(cp):
                        layout = [f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.cp={cp}",
                                  f"parallelism.dp_replicate={dpr}", "parallelism.dp_shard=-1"]
                        if cp > 1:
                            layout += [f"parallelism.cp_method={method}"]
                            layout += [f"parallelism.cp_ulysses={inner}"] if inner else []
                        # an MoE model's layout names its ep, 1 included: left out, the recipe's own ep would
                        # make it the same layout as one of the ep rows below
                        yield [*layout, "parallelism.ep=1"] if n_experts else layout, schedule
                        most = MAX_EP if n_experts >= MANY_EXPERTS else gpus_per_node
                        for ep in [e for e in _divisors(n_experts) if 1 < e <= max(most, gpus_per_node)
                                   and span % e == 0]:
                            yield [*layout, f"parallelism.ep={ep}"], schedule


def suggest(recipe: str | None, world_size: int, gpu: str = "h100", overrides: list[str] | None = None,
            top: int = 10, progress: Callable[[int, int, int], None] | None = None) -> list[dict]:
    """Enumerates tp (divisors of the kv heads, inside a node), pp (divisors of
    the rest, at most min(layers, 16), with 1F1B), cp (1, 2, 4) with each
    cp_method (`cp_methods`), dp_replicate (1 or one replica per node group),
    for an MoE model ep (`layouts`), and AC none / selective_op / full; keeps
    the recipe's global and local batch; drops the layouts the job would
    reject and those that do not fit. Each row carries its overrides ("set").

    A layout is built (the expensive part: the job's model on a fake world,
    once per pipeline rank, shared by the AC modes) only where an AC mode's
    `memory_floor`, a lower bound of its peak from formulas alone, fits: the
    rows are those of planning every layout. `progress(layouts done, layouts,
    rows so far)` is called after each layout."""
    from trainlib.config import job_model_args, load_job_config
    from trainlib.models.registry import get_model_spec

    if gpu not in GPUS:
        raise ConfigError(f"--gpu '{gpu}' is unknown; valid: {', '.join(GPUS)}")
    overrides = list(overrides or [])
    job_cfg = load_job_config(recipe, [o if o.startswith("--") else f"--{o}" for o in overrides])
    model, args = job_cfg.model, job_model_args(job_cfg)
    kv_heads = min(b.n_kv_heads for b in get_model_spec(model.name).block_shapes(args))  # tp must divide each block's
    memory = GPUS[gpu].memory_gib * GiB
    moe = getattr(args, "moe", None)  # an MoE family's shape (trainlib.blocks.moe.MoEArgs)
    todo = list(layouts(world_size, kv_heads, args.n_layers, ASSUMPTIONS["gpus_per_node"],
                        moe.n_experts if moe is not None else 0))
    results = []
    for i, (degrees, schedule) in enumerate(todo):
        for ac in AC_MODES:
            row = [*degrees, f"activation_checkpoint.mode={ac}", *schedule]
            try:
                job = load_job(recipe, world_size, gpu, overrides + row)
            except ConfigError:  # the job would reject this layout
                continue
            if memory_floor(job) > memory:
                continue  # cannot fit whatever the build holds: not built
            p = make_plan(recipe, world_size, gpu, overrides + row, job=job)
            if p.fits:
                results.append({"tp": p.degrees["tp"], "pp": p.degrees["pp"], "cp": p.degrees["cp"],
                                "cp_method": p.cp_method, "cp_ulysses": p.cp_ulysses,
                                "dp_replicate": p.degrees["dp_replicate"], "dp_shard": p.degrees["dp_shard"],
                                **({"ep": p.degrees["ep"]} if "ep" in p.degrees else {}), "ac": ac,
                                "peak_gib": p.max_total_bytes / GiB, "step_s": p.step_seconds, "mfu": p.mfu,
                                "set": row,
                                "cp_gib": sum(v for k, v in p.comm_bytes.items() if k.startswith("cp")) / GiB})
        if progress is not None:
            progress(i + 1, len(todo), len(results))
    # Ties (e.g. CP methods whose traffic is equally small): less CP traffic first
    results.sort(key=lambda r: (r["step_s"], r["cp_gib"]))
    return results[:top]


def progress_printer(stream, every_s: float = 2.0) -> Callable[[int, int, int], None]:
    """A `progress` for `suggest` that writes one line to `stream` at most every `every_s` seconds,
    and at the end."""
    start = last = time.monotonic()

    def report(done: int, total: int, fitting: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s or done == total:
            last = now
            print(f"suggest: {done}/{total} layouts ({done / total:.0%}), {fitting} fit, {now - start:.0f} s",
                  file=stream, flush=True)

    return report
