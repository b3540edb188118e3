"""The optimizer step's time and peak memory, AdamW beside Muon (the numbers in docs/optimizers.md).

    python scripts/optimizer_step.py                                   # the debug model, CPU, one process
    python scripts/optimizer_step.py --flavor llama3.2_1b --n_layers 2 --runs 3 --steps 3
    python scripts/optimizer_step.py --device cuda --flavor llama3.1_8b --n_layers 4

One process, the Llama 3 model of `--flavor` with the family's roles (ModelSpec.param_role), fp32 weights
and random gradients. Each optimizer is built over the same model, warmed up by one step (its state
allocated), then timed over `--steps` steps per run; the runs of AdamW and Muon alternate, `--runs` of each,
and the medians are printed. Peak memory: over one step after the warm-up, the most bytes the step's own
allocations held at once (CUDA: the allocator's peak; CPU: the profiler's allocation events), and the
optimizer state's bytes. On CPU set `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967296:
glibc.malloc.trim_threshold=17179869184` for steady timings (docs/optimizers.md says why). AdamW runs as
`optimizer.implementation = auto` picks it (foreach on CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trainlib

from trainlib.models.llama3 import SPEC, Transformer, get_model_args  # noqa: E402
from trainlib.optim import OptimizerConfig, build_optimizer  # noqa: E402
from trainlib.sections import MuonConfig  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def _peak_step_bytes(opt: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes the step allocates above what is live when it starts, at its peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        opt.step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    # The CPU allocator's own record of the step (the profiler's memory events, in order): the highest sum of
    # bytes allocated minus freed. (torch's MemTracker counted tensors the step touched that existed before
    # it, the weights and gradients, as if the step had allocated them.)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--n_layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=5, help="timed runs of each optimizer, alternating")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed run")
    ap.add_argument("--ns_dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    args = get_model_args(a.flavor, **({"n_layers": a.n_layers} if a.n_layers else {}))
    with torch.device(device):
        model = Transformer(args, rope_len=16)
    g = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-2
    n = sum(p.numel() for p in model.parameters())
    cfgs = {"adamw": OptimizerConfig(),
            "muon": OptimizerConfig(name="muon", muon=MuonConfig(ns_dtype=a.ns_dtype))}
    opts = {k: build_optimizer([model], c, None, SPEC.param_role) for k, c in cfgs.items()}
    for opt in opts.values():
        opt.step()  # state allocated
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(a.runs):
        for k, opt in opts.items():
            _sync(device)
            start = time.perf_counter()
            for _ in range(a.steps):
                opt.step()
            _sync(device)
            times[k].append((time.perf_counter() - start) / a.steps)
    print(f"{a.flavor}{f' ({a.n_layers} layers)' if a.n_layers else ''}: {n / 1e6:.2f}M parameters, {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {a.runs} runs x {a.steps} steps")
    print("| optimizer | step ms (median) | runs min-max ms | step peak above start MiB | state MiB |")
    print("|---|---|---|---|---|")
    for k, opt in opts.items():
        ms = [t * 1e3 for t in times[k]]
        label = k if k == "adamw" else f"muon (ns {opt.defaults['ns_dtype']})"
        print(f"| {label} | {statistics.median(ms):.2f} | {min(ms):.2f}-{max(ms):.2f} | "
              f"{_peak_step_bytes(opt, device) / 2**20:.2f} | {_state_bytes(opt) / 2**20:.2f} |")


if __name__ == "__main__":
    main()
