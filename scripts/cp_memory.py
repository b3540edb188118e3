"""Per-rank memory of one long-sequence training step under context parallelism.

    torchrun --standalone --nproc-per-node=N scripts/cp_memory.py --seq-len 16384   # cp = N
    python scripts/cp_memory.py --seq-len 16384                                     # cp = 1

Builds the debug model as the trainer does (parallelize_llama: CP, then FSDP
over the cp ranks), runs forward + loss + backward on one sequence and reports
the largest value over ranks of
  saved   bytes of the tensors autograd keeps for backward (the activations),
          each storage counted once;
  peak    growth of the process's peak RSS during the step over its RSS just
          before it (includes transient buffers; CPU allocator noise of a few MB).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trainlib

from trainlib.distributed import destroy_distributed
from trainlib.loss import cross_entropy_sum
from trainlib.models.llama3 import Transformer, get_model_args, parallelize_llama
from trainlib.parallel import ParallelDims, ParallelismConfig, init_model_weights
from trainlib.parallel.cp import shard_batch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    _measure()
    # After _measure returns, nothing holds the model's process groups, so none outlives the destroy.
    destroy_distributed()


def _measure() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--n-layers", type=int, default=4)
    a = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    else:  # no torchrun: a world of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dims = ParallelDims(dp_shard=1, cp=world, world_size=world)
    dims.build_mesh("cpu")
    args = get_model_args("debug", n_layers=a.n_layers)
    with torch.device("meta"):
        model = Transformer(args, rope_len=a.seq_len)
    model = parallelize_llama(model, dims, ParallelismConfig(dp_shard=1, cp=world))
    init_model_weights(model, 0, "cpu")

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (1, a.seq_len + 1), generator=g)
    batch = {"input": tokens[:, :-1], "labels": tokens[:, 1:]}
    if dims.cp_enabled:
        batch = shard_batch(batch, dims.mesh("cp"))

    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    dist.barrier()
    rss0 = _rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(batch["input"])
        loss = cross_entropy_sum(logits, batch["labels"]) / a.seq_len
    del logits
    saved = sum(storages.values())
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0

    stats = torch.tensor([saved, peak], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"cp={world} seq_len={a.seq_len} layers={a.n_layers} tokens/rank={a.seq_len // world} "
              f"saved_MiB={stats[0] / 2**20:.1f} peak_rss_growth_MiB={stats[1] / 2**20:.1f}")


if __name__ == "__main__":
    main()
