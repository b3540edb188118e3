"""Where one profiled step's GPU time goes: the kernels of a torch.profiler
trace (a run's profile_traces/step-N/rankR_trace.json) summed by kind and by
name, inside the last step's GPU-side annotation only.

    python scripts/trace_kernels.py /tmp/prof/profile_traces/step-20/rank0_trace.json [--top 40]

Why the window: a trace also holds kernels of the steps around the profiled
one (summing them all gave 470 ms for a 284 ms step on an H100), and the
GPU-side `ProfilerStep#N` annotation is the step as the device ran it. Kinds
are read from kernel names (cuBLAS/nvjet GEMMs, flash attention, the
multi-tensor optimizer and clip kernels, inductor's triton kernels); a trace
without a GPU-side annotation is summed whole, and says so.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

KINDS = [  # first match wins: inductor's kernels around attention name it too
    ("triton (inductor)", re.compile(r"^triton_")),
    ("attention", re.compile(r"sdpa|flash|fmha|attention|cudnn::fusion", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|sm90_xmma|matmul", re.I)),
    ("optimizer (fused AdamW)", re.compile(r"multi_tensor_apply.*Fused", re.I)),
    ("multi-tensor (foreach: norm, clip, ...)", re.compile(r"multi_tensor_apply", re.I)),
]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def short_name(name: str) -> str:
    """A kernel's name without its template arguments' numbers, so one kernel
    launched at many shapes sums as one; multi-tensor kernels by functor."""
    if "multi_tensor_apply" in name:
        functor = re.search(r"\w*Functor\w*|Fused\w*", name)
        return f"multi_tensor_apply {functor.group(0) if functor else ''}".rstrip()
    return re.sub(r"[0-9_]+", "_", name)[:100]


def summarize(events: list[dict]) -> dict:
    steps = [e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("ProfilerStep")]
    if steps:
        last = max(steps, key=lambda e: e["ts"])
        t0, t1, window = last["ts"], last["ts"] + last["dur"], last["name"]
    else:
        t0, t1, window = float("-inf"), float("inf"), None
    by_name, count, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "kernel" and t0 <= e["ts"] < t1:
            n = short_name(e["name"])
            by_name[n] += e["dur"]
            count[n] += 1
            by_kind[kind_of(e["name"])] += e["dur"]
    return {"window": window, "window_us": (t1 - t0) if steps else None, "busy_us": sum(by_name.values()),
            "by_kind": by_kind, "by_name": by_name, "count": count}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a torch.profiler chrome trace (JSON)")
    p.add_argument("--top", type=int, default=40, help="kernels listed by name")
    args = p.parse_args(argv)
    with open(args.trace) as f:
        s = summarize(json.load(f)["traceEvents"])
    if s["window"] is None:
        print("no GPU-side ProfilerStep annotation: every kernel in the trace is summed")
    else:
        print(f"{s['window']}: {s['window_us'] / 1e3:.2f} ms on the GPU, kernels busy {s['busy_us'] / 1e3:.2f} ms")
    for kind, us in s["by_kind"].most_common():
        print(f"{us / 1e3:9.2f} ms  {kind}")
    print()
    for name, us in s["by_name"].most_common(args.top):
        print(f"{us / 1e3:9.2f} ms {s['count'][name]:5d}x  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
