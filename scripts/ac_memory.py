"""Activation memory of each activation-checkpointing mode, measured on CPU.

    python scripts/ac_memory.py [--flavor debug] [--batch 8] [--seq 256] [--n_layers N] [--vocab_size V]

Runs one forward+backward of the model under torch's MemTracker (it accounts
every tensor allocation by category) and prints, per mode, the activation
bytes kept for backward at the end of the forward (what AC reduces), the peak
of the whole step (parameters and gradients included: where they dominate,
AC cannot lower the peak), and the wall time of the step (MemTracker slows it
a lot; times compare modes only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trainlib

from trainlib.loss import cross_entropy_sum
from trainlib.models.llama3 import Transformer, get_model_args
from trainlib.parallel.ac import apply_ac

CONFIGS = [("none", "all_mm"), ("full", "all_mm"), ("selective_layer", "all_mm"),
           ("selective_op", "all_mm"), ("selective_op", "every_other_mm")]


def measure(flavor: str, batch: int, seq: int, n_layers: int | None, mode: str, policy: str, every_k: int = 2,
            vocab_size: int | None = None):
    """(peak MiB of the step, MiB of activations kept after forward, seconds)."""
    args = get_model_args(flavor, n_layers=n_layers, vocab_size=vocab_size)
    model = Transformer(args, rope_len=seq)
    model.init_weights(0)
    apply_ac(model, mode, every_k=every_k, selective_op_policy=policy)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
    tracker = MemTracker()
    tracker.track_external(model)
    start = time.perf_counter()
    with tracker:
        loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        kept = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        loss.backward()
    seconds = time.perf_counter() - start
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    act = sum(v for k, v in kept.items() if getattr(k, "name", None) == "ACT")
    return peak["Total"] / 2**20, act / 2**20, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--n_layers", type=int, default=None)
    p.add_argument("--vocab_size", type=int, default=None, help="smaller vocab: block activations, not logits")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args()
    print(f"{a.flavor} n_layers={a.n_layers or 'default'} vocab={a.vocab_size or 'default'} batch={a.batch} "
          f"seq={a.seq}, fp32, CPU")
    print(f"| {'mode':<30} | {'activations kept MiB':>20} | {'saved vs none':>13} | {'step peak MiB':>13} | {'time s':>6} |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for mode, policy in CONFIGS:
        total, act, sec = measure(a.flavor, a.batch, a.seq, a.n_layers, mode, policy, vocab_size=a.vocab_size)
        base = base or act
        name = mode + (f" ({policy})" if mode == "selective_op" else " (every_k=2)" if mode == "selective_layer" else "")
        print(f"| {name:<30} | {act:>20.1f} | {100 * (1 - act / base):>12.0f}% | {total:>13.1f} | {sec:>6.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
