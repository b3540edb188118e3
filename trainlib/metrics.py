"""Per-step metrics: a console line and `metrics.jsonl` on rank 0.

The field names written to metrics.jsonl are a contract read by external tools:
step, loss, grad_norm, lr, tokens_per_second (global), step_time_s, tflops
(achieved per device), mfu (null where the device's peak is unknown),
peak_memory_gib. Add fields; never rename these.
Added fields: mfu_basis ("bf16_peak": the denominator of mfu, whatever the
matmul precision), matmul_precision ("float8" when float8 linears run,
else "default") and tokens_seen_per_dataset ({dataset name: input tokens of
the global batch since step 0}, from the data loader; see docs/data.md).

To add a field the loop measures, pass it to `MetricsLogger.log` as a keyword
(`log(step, loss=..., grad_norm=..., lr=..., val_loss=...)`): it is written to
metrics.jsonl under that name and shown on the console line.

Every line is valid JSON: a NaN or infinite value (a non-finite loss, say) is
written as null, and the record's `nonfinite` field maps each such key to its
value as text (`{"loss": "nan", "grad_norm": "inf"}`). Records written at one
point without a step in between (the guard's event records, trainlib.guard)
share the timing fields of the window that ends there.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainlib.errors import ConfigError
from trainlib.hardware import gpu_of_device

logger = logging.getLogger("trainlib")


@dataclass
class MetricsConfig:
    log_freq: int = 10
    # A line per log step on rank 0. Off only for programs that print their own.
    console: bool = True

    def __post_init__(self) -> None:
        if self.log_freq < 1:
            raise ConfigError(f"metrics.log_freq must be >= 1, got {self.log_freq}")


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of `device` from trainlib.hardware's GPU table (None: CPU or unknown GPU)."""
    if device.type != "cuda":
        return None
    gpu = gpu_of_device(torch.cuda.get_device_name(device))
    return gpu.bf16_tflops * 1e12 if gpu else None


def peak_memory_gib(device: torch.device) -> float:
    """Accelerator: peak allocated by the caching allocator. CPU: peak resident
    set size of this process (includes the Python runtime)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2**20


def setup_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere, so N ranks do not print N copies."""
    level = logging.INFO if rank == 0 else logging.WARNING
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[trainlib] %(message)s" if rank == 0 else f"[trainlib rank{rank}] %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


class MetricsLogger:
    """Accumulates timing between log steps and writes one record per log step.

    Only rank 0 writes. Each record is flushed as soon as it is written so a
    crash loses nothing already logged.
    """

    def __init__(self, cfg: MetricsConfig, run_dir: str | os.PathLike | None, *, rank: int,
                 device: torch.device, flops_per_token: float, world_size: int, append: bool = False,
                 float8: bool = False):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.float8 = float8
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak = device_peak_flops(device)
        self._file = None
        if rank == 0 and run_dir is not None:
            path = Path(run_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a" if append else "w", encoding="utf-8")
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._window_tokens = 0
        self._last_window: tuple[float, int, float] | None = None  # (seconds, steps, tokens/s)

    def should_log(self, step: int, last_step: int) -> bool:
        return step % self.cfg.log_freq == 0 or step == last_step or step == 1

    def step_done(self, tokens: int) -> None:
        """Call after every optimizer step with the global number of tokens it consumed."""
        self._window_steps += 1
        self._window_tokens += tokens

    def log(self, step: int, *, loss: float, grad_norm: float, lr: float, **fields: float) -> dict:
        """Write one record: the contract fields, then `fields` (added names, never a contract name)."""
        now = time.perf_counter()
        if self._window_steps or self._last_window is None:
            elapsed = max(now - self._window_start, 1e-9)
            self._last_window = elapsed, max(self._window_steps, 1), self._window_tokens / elapsed
        elapsed, steps, tps = self._last_window
        tflops = tps / self.world_size * self.flops_per_token / 1e12
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_second": tps,
            "step_time_s": elapsed / steps,
            "tflops": tflops,
            "mfu": (tflops * 1e12 / self.peak) if self.peak else None,
            "peak_memory_gib": peak_memory_gib(self.device),
            "time": time.time(),
            # float8 runs are still measured against the bf16 peak (not the 2x
            # float8 peak), so MFU compares across precisions; these say so.
            "mfu_basis": "bf16_peak",
            "matmul_precision": "float8" if self.float8 else "default",
        }
        clash = record.keys() & fields.keys()
        if clash:
            raise TypeError(f"MetricsLogger.log: {sorted(clash)} are built-in fields; give added fields new names")
        record.update(fields)
        nonfinite = {k: repr(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        if nonfinite:
            record.update(dict.fromkeys(nonfinite), nonfinite=nonfinite)
        if self.rank == 0:
            if self._file is not None:
                self._file.write(json.dumps(record, allow_nan=False) + "\n")
                self._file.flush()
            if self.cfg.console:
                mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
                if self.float8:
                    mfu += " (float8, vs bf16 peak)"
                logger.info(
                    f"step {step:>6} | loss {loss:8.4f} | grad_norm {grad_norm:8.3f} | lr {lr:.2e} | "
                    f"tok/s {tps:10,.0f} | {record['step_time_s']:.3f} s/step | tflops {tflops:7.2f} | "
                    f"mfu {mfu} | mem {record['peak_memory_gib']:.2f} GiB"
                    + "".join(f" | {k} {v:.4g}" if isinstance(v, float) else f" | {k} {v}" for k, v in fields.items())
                )
        self._window_start, self._window_steps, self._window_tokens = now, 0, 0
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
