"""What the non-finite/spike guard costs (the numbers in docs/reliability.md).

    PYTHONPATH=. python scripts/guard_overhead.py                       # check and scan, CPU, the debug model
    PYTHONPATH=. python scripts/guard_overhead.py --flavor llama3.2_1b --n_layers 2 --vocab_size 32000
    PYTHONPATH=. python scripts/guard_overhead.py --device cuda --flavor llama3.1_8b --n_layers 4
    PYTHONPATH=. torchrun --nproc-per-node=2 scripts/guard_overhead.py  # the loss all-reduce
    PYTHONPATH=. python scripts/guard_overhead.py --reads [--training.on_nonfinite=skip ...]

  check       `Guard.check` per step (the verdict on the device, the fused gate), spike
              detection off and on; on CUDA kernel launches, the host never waits
  scan        the NaN/Inf scan before every save (`nonfinite_entries`) over the model's
              weights and AdamW state: seconds and GB/s
  all-reduce  (under torchrun) the loss's all-reduce, run every step
  --reads     device-to-host reads (`.item()`, `.tolist()`, ...) made by trainlib's own code
              per normal step and per log step, from two short runs of `trainlib.train`
              with the given overrides; imports only what any trainlib version has, so
              it also measures an older tree (PYTHONPATH=that tree)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_check(device: torch.device, spike: bool, steps: int = 2000) -> float:
    from trainlib.guard import Guard, GuardConfig

    p = torch.nn.Parameter(torch.zeros(1, device=device))
    guard = Guard(GuardConfig(on_spike="skip" if spike else "off"), torch.optim.AdamW([p], fused=True), device)
    loss, norm = torch.tensor(2.0, device=device), torch.tensor(1.0, device=device)
    for i in range(100):  # warm-up, and past the spike window's warm-up
        guard.check(i, loss, norm)
    _sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        guard.check(i, loss, norm)
        guard._pending.clear()  # settle would empty it at the next log step
    _sync(device)
    return (time.perf_counter() - t0) / steps


def time_scan(device: torch.device, flavor: str, n_layers: int | None, vocab_size: int | None) -> tuple[float, float]:
    from trainlib.checkpoint.state import ModelState, OptimizerState, nonfinite_entries
    from trainlib.models.llama3 import Transformer, get_model_args
    from trainlib.optim import OptimizerConfig, build_optimizer

    args = get_model_args(flavor, n_layers=n_layers, vocab_size=vocab_size)
    with torch.device(device):
        model = Transformer(args, rope_len=16)
    model.init_weights(seed=0)
    opt = build_optimizer([model], OptimizerConfig())
    states = {"model": ModelState([model]), "optimizer": OptimizerState([model], opt)}
    states["optimizer"].state_dict()  # creates the AdamW moments
    nbytes = sum(t.numel() * t.element_size()
                 for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())])
    nonfinite_entries(states)
    _sync(device)
    t0 = time.perf_counter()
    assert nonfinite_entries(states) == []
    seconds = time.perf_counter() - t0
    return seconds, nbytes / seconds / 1e9


def time_all_reduce(device: torch.device, steps: int = 2000) -> float:
    import torch.distributed as dist

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    x = torch.ones((), device=device)
    for _ in range(100):
        dist.all_reduce(x)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        dist.all_reduce(x)
    _sync(device)
    dt = (time.perf_counter() - t0) / steps
    dist.destroy_process_group()
    return dt


def count_reads(overrides: list[str]) -> tuple[float, float]:
    import trainlib
    from trainlib.config import load_job_config
    from trainlib.train import train

    root, n = str(Path(trainlib.__file__).parent), [0]
    originals = {name: getattr(torch.Tensor, name) for name in
                 ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")}
    for name, orig in originals.items():
        def counted(t, *a, _orig=orig, **k):
            n[0] += sys._getframe(1).f_code.co_filename.startswith(root)
            return _orig(t, *a, **k)

        setattr(torch.Tensor, name, counted)

    def run(steps: int, log_freq: int) -> int:
        n[0] = 0
        with tempfile.TemporaryDirectory() as d:
            train(load_job_config(None, [f"--job.dump_folder={d}", f"--training.steps={steps}",
                                         "--training.seq_len=32", "--training.global_batch_size=2",
                                         "--metrics.console=false", f"--metrics.log_freq={log_freq}", *overrides]))
        return n[0]

    try:  # steps 1 and the last are always logged (and saved, with checkpoints on): 6 - 3 = 3 more of a kind
        return (run(6, 1000) - run(3, 1000)) / 3, (run(6, 1) - run(3, 1)) / 3
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--n_layers", type=int, default=None)
    ap.add_argument("--vocab_size", type=int, default=None)
    ap.add_argument("--reads", action="store_true", help="count host reads per step; other arguments are overrides")
    a, overrides = ap.parse_known_args()
    device = torch.device(a.device)
    if a.reads:
        normal, logged = count_reads(overrides)
        print(f"{overrides or 'defaults'}: host reads per normal step {normal:g}, per log step {logged:g}")
    elif "RANK" in os.environ:
        dt = time_all_reduce(device)
        if os.environ["RANK"] == "0":
            print(f"all-reduce of the loss, {os.environ['WORLD_SIZE']} ranks: {dt * 1e6:.0f} us per step")
    else:
        for spike in (False, True):
            print(f"check, spike detection {'on' if spike else 'off'}: "
                  f"{time_check(device, spike) * 1e6:.0f} us per step")
        seconds, gbps = time_scan(device, a.flavor, a.n_layers, a.vocab_size)
        print(f"scan before a save ({a.flavor}, n_layers={a.n_layers}, vocab_size={a.vocab_size}): "
              f"{seconds:.3f} s, {gbps:.1f} GB/s")


if __name__ == "__main__":
    main()
