"""What trainlib's resilience costs per step and per save (numbers in docs/reliability.md).

    torchrun --standalone --nproc-per-node=N scripts/resilience_cost.py [--step-ms 200] [--steps 200] [--gib 1]

  agreement   the preemption flag's all-reduce (one int32, MAX, on its own gloo
              group): median time of a blocking all-reduce, and the time the loop
              spends in `StepMonitor.start_step` + `end_step` (the flag's
              all-reduce overlapping a step of --step-ms of matmuls, and the
              watchdog's bookkeeping; its thread polls every 3 s at the default
              min_seconds), and in `spread()` at a log step (one all-gather)
  recorder    median time of a blocking one-element gloo all-reduce on the
              default group; run once as is and once with TORCH_FR_BUFFER_SIZE=0
              to see the flight recorder's share
  manifest    rank 0: writing a --gib GiB shard (write + fsync), then recording its
              size (what the manifest does) vs. reading it back for a CRC32 or a
              SHA-256 (what a checksum manifest would cost)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trainlib

from trainlib.distributed import destroy_distributed
from trainlib.resilience import StepMonitor, WatchdogConfig


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _busy(ms: float, a: torch.Tensor) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a @ a


def main() -> None:
    _measure()
    destroy_distributed()  # after _measure returns, so its extra group is no longer referenced


def _measure() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=200.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    flag = torch.zeros(1, dtype=torch.int32)
    one = torch.ones(1)
    for _ in range(20):  # warm up connections
        dist.all_reduce(flag, group=group)
    blocking = _median_us(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group), args.steps)
    default_pg = _median_us(lambda: dist.all_reduce(one), args.steps)

    a, starts, waits, spreads = torch.randn(128, 128), [], [], []
    with tempfile.TemporaryDirectory() as run_dir:
        monitor = StepMonitor(WatchdogConfig(), 600.0, run_dir)
        for step in range(1, max(args.steps // 10, 10) + 1):
            t0 = time.perf_counter()
            monitor.start_step(step)
            t1 = time.perf_counter()
            _busy(args.step_ms, a)
            t2 = time.perf_counter()
            monitor.end_step()
            t3 = time.perf_counter()
            dist.barrier()  # the ranks' skew is not spread()'s cost: the next collective would wait for it anyway
            t4 = time.perf_counter()
            monitor.spread()
            starts.append(t1 - t0)
            waits.append(t3 - t2)
            spreads.append(time.perf_counter() - t4)
        monitor.close()
    if rank == 0:
        fr = os.environ.get("TORCH_FR_BUFFER_SIZE", "default (2000)")
        print(f"world {world}, gloo on CPU, TORCH_FR_BUFFER_SIZE={fr}")
        print(f"agreement: blocking all-reduce of the flag, median {blocking:.0f} us per step")
        print(f"agreement: overlapped with a {args.step_ms:.0f} ms step (trainlib), median per step "
              f"{statistics.median(starts) * 1e6:.0f} us in start_step + {statistics.median(waits) * 1e6:.0f} us "
              f"in end_step; spread() at a log step {statistics.median(spreads) * 1e6:.0f} us")
        print(f"recorder: one-element all-reduce on the default group, median {default_pg:.0f} us")
        _manifest_cost(int(args.gib * 2**30))


def _manifest_cost(size: int) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        path = os.path.join(d, "__0_0.distcp")
        block = os.urandom(64 * 2**20)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(size // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        os.stat(path).st_size
        stat = time.perf_counter() - t0
        sums = {}
        for name, update in (("crc32", lambda h, b: zlib.crc32(b, h)), ("sha256", None)):
            h = 0 if update else hashlib.sha256()
            t0 = time.perf_counter()
            with open(path, "rb") as f:
                while b := f.read(64 * 2**20):
                    h = update(h, b) if update else (h.update(b) or h)
            sums[name] = time.perf_counter() - t0
        gib = size / 2**30
        print(f"manifest: {gib:.2f} GiB shard written + fsync in {write:.2f} s; recording its size {stat * 1e6:.0f} us; "
              f"reading it back for crc32 {sums['crc32']:.2f} s, sha256 {sums['sha256']:.2f} s "
              f"(page cache warm: a cold read adds the disk's read time)")


if __name__ == "__main__":
    main()
