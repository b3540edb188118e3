"""--suggest: layouts of a recipe's model for a cluster that fit in memory, fastest first."""

from __future__ import annotations

from itertools import product

from trainlib.errors import ConfigError
from trainlib.plan.core import make_plan
from trainlib.plan.hardware import ASSUMPTIONS, GiB


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_methods(cp: int) -> list[tuple[str, int | None]]:
    """(cp_method, cp_ulysses) the search tries at a CP degree: the all-gather, Ulysses over all cp ranks,
    and from cp = 4 hybrid with an inner all-to-all over 2 (layouts the heads refuse are skipped with
    the rest the job would reject)."""
    if cp == 1:
        return [("allgather", None)]
    return [("allgather", None), ("ulysses", None)] + ([("hybrid", 2)] if cp >= 4 else [])


def suggest(recipe: str | None, world_size: int, gpu: str = "h100", overrides: list[str] | None = None,
            top: int = 10) -> list[dict]:
    """Enumerates tp (divisors of the kv heads, inside a node), pp (divisors of
    the rest, at most min(layers, 16), with 1F1B), cp (1, 2, 4) with each
    cp_method (`cp_methods`), dp_replicate
    (1 or one replica per node group) and AC none / selective_op / full; keeps
    the recipe's global and local batch; drops the layouts the job would
    reject and those that do not fit. Each row carries its overrides ("set")."""
    from trainlib.config import load_job_config
    from trainlib.models.registry import get_model_spec, model_args

    overrides = list(overrides or [])
    model = load_job_config(recipe, [o if o.startswith("--") else f"--{o}" for o in overrides]).model
    args = model_args(model)
    kv_heads = min(b.n_kv_heads for b in get_model_spec(model.name).block_shapes(args))  # tp must divide each block's
    node = ASSUMPTIONS["gpus_per_node"]
    results = []
    for tp in [d for d in _divisors(kv_heads) if d <= node and world_size % d == 0]:
        for pp in [d for d in _divisors(world_size // tp) if d <= min(args.n_layers, 16)]:
            for cp in [c for c in (1, 2, 4) if (world_size // (tp * pp)) % c == 0]:
                rest = world_size // (tp * pp * cp)
                for dpr in sorted({1, max(1, rest // max(1, node // (tp * cp)))}):
                    if rest % dpr:
                        continue
                    for (method, inner), ac in product(cp_methods(cp), ("none", "selective_op", "full")):
                        layout = [f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.cp={cp}",
                                  f"parallelism.dp_replicate={dpr}", "parallelism.dp_shard=-1",
                                  f"activation_checkpoint.mode={ac}"]
                        if cp > 1:
                            layout += [f"parallelism.cp_method={method}"]
                            layout += [f"parallelism.cp_ulysses={inner}"] if inner else []
                        if pp > 1:
                            layout += ["parallelism.pp_schedule=1F1B", "parallelism.pp_stages_per_rank=1"]
                        try:
                            p = make_plan(recipe, world_size, gpu, overrides + layout)
                        except ConfigError:  # the job would reject this layout
                            continue
                        if p.fits:
                            results.append({"tp": tp, "pp": pp, "cp": cp, "cp_method": method, "cp_ulysses": inner,
                                            "dp_replicate": dpr,
                                            "dp_shard": p.degrees["dp_shard"], "ac": ac,
                                            "peak_gib": p.max_total_bytes / GiB, "step_s": p.step_seconds,
                                            "mfu": p.mfu, "set": layout,
                                            "cp_gib": sum(v for k, v in p.comm_bytes.items()
                                                          if k.startswith("cp")) / GiB})
    # CP traffic is priced as overlapping compute (as FSDP's), so methods often tie on time: less traffic first
    results.sort(key=lambda r: (r["step_s"], r["cp_gib"]))
    return results[:top]
