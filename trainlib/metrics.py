"""Per-step metrics on rank 0: a console line, `metrics.jsonl`, and optionally
TensorBoard and Weights & Biases.

The field names written to metrics.jsonl are a contract read by external tools:
step, loss, grad_norm, lr, tokens_per_second (global), step_time_s, tflops
(achieved per device), mfu (null where the device's peak is unknown),
peak_memory_gib. Add fields; never rename these.
Added fields: mfu_basis ("bf16_peak": the denominator of mfu, whatever the
matmul precision), matmul_precision ("float8" when float8 linears run,
else "default"), tokens_seen (global input tokens since step 0),
tokens_seen_per_dataset ({dataset name: input tokens of the global batch since
step 0}, from the data loader; see docs/data.md), on validation steps
val_loss and val_perplexity (trainlib.validation), and with [fault_tolerance]
ft_participants (live replica groups in the step's quorum), ft_quorum_ms (the
step's quorum wait) and ft_heal_s (seconds spent healing since the previous
record) (trainlib.parallel.replica; docs/reliability.md).

To add a field the loop measures, pass it to `MetricsLogger.log` as a keyword
(`log(step, loss=..., grad_norm=..., lr=..., val_loss=...)`): it is written to
metrics.jsonl under that name, and to TensorBoard / W&B when numeric (a dict of
numbers as `name/key` scalars). The console line shows only the fields in
CONSOLE_FIELDS, so that per-dataset or per-rank fields do not flood it.

Every line is valid JSON: a NaN or infinite value (a non-finite loss, say) is
written as null, and the record's `nonfinite` field maps each such key to its
value as text (`{"loss": "nan", "grad_norm": "inf"}`). Records written at one
point without a step in between (the guard's event records, trainlib.guard)
share the timing fields of the window that ends there.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import resource
import secrets
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from trainlib.sections import MetricsConfig
from trainlib.hardware import gpu_of_device

logger = logging.getLogger("trainlib")


# Added fields shown on the console line (every field goes to the files), in this order.
CONSOLE_FIELDS = {"val_loss": "val_loss {:.4f}", "event": "{}", "action": "{}"}  # the last two: trainlib.guard
# Numeric record fields that are not metrics: the x axis, and wall-clock time (each backend keeps its own).
_NOT_SCALARS = ("step", "time")


def scalars(record: dict) -> dict[str, float]:
    """The record's numeric fields, a dict of numbers flattened to `name/key` (a key's own slashes, as in a
    dataset's path, become `_`: both backends group tags at every slash)."""
    out = {}
    for k, v in record.items():
        if k in _NOT_SCALARS:
            continue
        if isinstance(v, dict):
            out.update({f"{k}/{name.strip('/').replace('/', '_')}": x for name, x in v.items() if _is_number(x)})
        elif _is_number(v):
            out[k] = v
    return out


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _TensorBoard:
    def __init__(self, folder: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or after it from an interrupted earlier attempt are hidden,
        # so a resumed run shows one curve.
        self.writer = SummaryWriter(str(folder), purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self, summary: dict) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, cfg: MetricsConfig, run_dir: Path, resume_step: int, run_config: dict | None):
        import wandb

        # One W&B run per run folder: a resumed job continues the run it started.
        id_file = run_dir / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, dir=str(run_dir),
                              name=run_dir.resolve().name, id=run_id, resume="allow", config=run_config,
                              mode=os.environ.get("WANDB_MODE") or cfg.wandb_mode)

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, summary: dict) -> None:
        self.run.summary.update({f"run/{k}": v for k, v in summary.items() if v is not None})
        self.run.finish()


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


# What a run from step 0 finds of an earlier run in its folder and keeps aside rather than appending to
# (metrics.jsonl), writing over (TensorBoard's event files would overlay the two runs' curves as one) or
# leaving in place to be taken for this run's (the report `python -m trainlib.report` drew).
EARLIER_RUN_FILES = ("metrics.jsonl", "report.png", "report.html")


def keep_earlier_run(run_dir: Path, tb_folder: str | None = None) -> dict[str, str]:
    """Move an earlier run's non-empty files (EARLIER_RUN_FILES and the TensorBoard folder) aside to
    `name.K`, one K for the whole set, the first free one (1, 2, ...); says so in one line and returns
    {name: kept name}."""
    names = [*EARLIER_RUN_FILES, *([tb_folder] if tb_folder else [])]

    def held(path: Path) -> bool:
        return (path.is_file() and path.stat().st_size > 0) or (path.is_dir() and any(path.iterdir()))

    found = [n for n in names if held(run_dir / n)]
    if not found:
        return {}
    k = 1
    while any((run_dir / f"{n}.{k}").exists() for n in names):
        k += 1
    kept = {n: f"{n}.{k}" for n in found}
    for n, to in kept.items():
        os.replace(run_dir / n, run_dir / to)
    logger.warning(f"a new run from step 0 in {run_dir}, which holds an earlier run: its "
                   f"{', '.join(found)} kept as {', '.join(kept.values())}")
    return kept


def drop_torn_tail(path: Path) -> None:
    """Cut a record torn by a kill mid-write (the bytes after the last newline) off the end of `path`, with one
    line: a resumed run appends after it, and its first record would otherwise join the torn one on a line no
    reader can parse."""
    if not path.is_file():
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        tail = b""
        while len(tail) < size and b"\n" not in tail:  # read back from the end to the last newline
            n = min(4096, size - len(tail))
            f.seek(size - len(tail) - n)
            tail = f.read(n) + tail
        torn = len(tail) - (tail.rfind(b"\n") + 1)
        if torn:
            f.truncate(size - torn)
    if torn:
        logger.warning(f"{path.name} ended in a torn record ({torn} bytes, cut mid-write when the last run was "
                       f"stopped): dropped")


class MetricsLogger:
    """Accumulates timing between log steps and writes one record per log step.

    Only rank 0 writes. Each record is flushed as soon as it is written so a
    crash loses nothing already logged, and no run's records are ever
    truncated: `start_step` > 0 continues a resumed run (metrics.jsonl
    appended, the same W&B run); a run from step 0 in a folder that holds an
    earlier run's metrics.jsonl keeps that file as metrics.jsonl.1 (.2, ...); `total_steps` gives the
    console its step/total and ETA; `tokens_seen` is the global input token
    count before this process's first step (a resumed run's TrainState).
    """

    def __init__(self, cfg: MetricsConfig, run_dir: str | os.PathLike | None, *, rank: int,
                 device: torch.device, flops_per_token: float, world_size: int,
                 float8: bool = False, start_step: int = 0, total_steps: int | None = None, tokens_seen: int = 0,
                 run_config: dict | None = None):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.float8 = float8
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak = device_peak_flops(device)
        self.start_step, self.total_steps, self.tokens_seen = start_step, total_steps, tokens_seen
        self._file = None
        self._backends: list[_TensorBoard | _WandB] = []
        if rank == 0 and run_dir is not None:
            run_dir = Path(run_dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            if not start_step:
                keep_earlier_run(run_dir, cfg.save_tb_folder)
            else:
                drop_torn_tail(run_dir / "metrics.jsonl")
            self._file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
            if cfg.enable_tensorboard:
                self._backends.append(_TensorBoard(run_dir / cfg.save_tb_folder, start_step))
            if cfg.enable_wandb:
                self._backends.append(_WandB(cfg, run_dir, start_step, run_config))
        self._start = self._window_start = time.perf_counter()
        self._window_steps = 0
        self._window_tokens = 0
        self._tokens_run = 0  # this process's, for the summary
        self._eta_origin: tuple[float, int] | None = None  # (time, step) of the first log
        self._summary: dict = {}
        self._last_window: tuple[float, int, float] | None = None  # (seconds, steps, tokens/s)

    def should_log(self, step: int, last_step: int) -> bool:
        return step % self.cfg.log_freq == 0 or step == last_step or step == 1

    def step_done(self, tokens: int) -> None:
        """Call after every optimizer step with the global number of tokens it consumed."""
        self._window_steps += 1
        self._window_tokens += tokens
        self._tokens_run += tokens
        self.tokens_seen += tokens

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Leave the block's time (e.g. validation) out of tok/s and step_time_s (not out of the wall time)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._window_start += time.perf_counter() - t0

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
            "tokens_seen": self.tokens_seen,
        }
        clash = record.keys() & fields.keys()
        if clash:
            raise TypeError(f"MetricsLogger.log: {sorted(clash)} are built-in fields; give added fields new names")
        record.update(fields)
        line = self._console_line(record, now) if self.rank == 0 and self.cfg.console else None  # nan as nan
        nonfinite = {k: repr(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        if nonfinite:
            record.update(dict.fromkeys(nonfinite), nonfinite=nonfinite)
        if self.rank == 0:
            if self._file is not None:
                self._file.write(json.dumps(record, allow_nan=False) + "\n")
                self._file.flush()
            values = scalars(record)
            for backend in self._backends:
                backend.write(step, values)
            if line:
                logger.info(line)
        self._window_start, self._window_steps, self._window_tokens = now, 0, 0
        return record

    def _console_line(self, r: dict, now: float) -> str:
        step, total = r["step"], self.total_steps
        parts = [f"step {step:>{len(str(total))}}/{total}" if total else f"step {step:>6}",
                 f"loss {r['loss']:7.4f}", f"grad_norm {r['grad_norm']:7.3f}", f"lr {r['lr']:.2e}",
                 f"tok/s {r['tokens_per_second']:9,.0f}"]
        if r["mfu"] is not None:
            parts.append(f"mfu {100 * r['mfu']:4.1f}%" + (" (float8, vs bf16 peak)" if self.float8 else ""))
        else:  # no known peak (CPU, an unlisted GPU): the achieved rate alone
            parts.append(f"tflops {r['tflops']:6.2f}")
        parts.append(f"mem {r['peak_memory_gib']:6.2f} GiB")
        parts += [fmt.format(r[k]) for k, fmt in CONSOLE_FIELDS.items() if r.get(k) is not None]
        if total:
            parts.append(f"eta {_duration(self._eta_seconds(step, now, r['step_time_s']))}")
        return " | ".join(parts)

    def _eta_seconds(self, step: int, now: float, step_time: float) -> float:
        # Wall-clock rate since the first log (validation and checkpoint time included, compile
        # and first-step allocations not); at the first log only that window's step time.
        if self._eta_origin is None:
            self._eta_origin = (now, step)
            rate = step_time
        else:
            t0, s0 = self._eta_origin
            rate = (now - t0) / max(step - s0, 1)
        return rate * max(self.total_steps - step, 0)

    def summary(self, last_checkpoint: str | os.PathLike | None) -> dict:
        """The end-of-training numbers (this process's steps), printed on rank 0 and kept in W&B's summary."""
        wall = time.perf_counter() - self._start
        tps = self._tokens_run / max(wall, 1e-9)
        tflops = tps / self.world_size * self.flops_per_token / 1e12
        s = {"tokens": self._tokens_run, "tokens_seen": self.tokens_seen, "wall_time_s": wall,
             "tokens_per_second": tps, "tflops": tflops, "mfu": tflops * 1e12 / self.peak if self.peak else None,
             "last_checkpoint": str(last_checkpoint) if last_checkpoint else None}
        if self.rank == 0:
            mfu = f"MFU {100 * s['mfu']:.1f}%" if s["mfu"] is not None else "MFU n/a (no known peak for this device)"
            logger.info(f"done: {s['tokens']:,} tokens in {_duration(wall)} wall, {tps:,.0f} tok/s mean, "
                        f"{tflops:.2f} TFLOP/s per device, {mfu}; "
                        + (f"last checkpoint {last_checkpoint}" if last_checkpoint else "no checkpoint"))
        self._summary = s
        return s

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for backend in self._backends:
            backend.close(self._summary)
        self._backends = []


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds))) if math.isfinite(seconds) else "?"
