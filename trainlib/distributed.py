"""Process-group setup: torchrun or a world of one, with timeouts that end hangs."""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from trainlib.errors import ConfigError
from trainlib.sections import CommConfig

logger = logging.getLogger("trainlib")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def resolve_device(kind: str, local_rank: int) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("job.device = 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_backend(backend: str, device: torch.device) -> str:
    """comm.backend as the process group gets it: "auto" is NCCL on CUDA, gloo elsewhere."""
    return backend if backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")


def init_distributed(cfg: CommConfig, device: str = "auto", dump_dir: str | os.PathLike | None = None) -> DistInfo:
    """Initialise the default process group. Without torchrun's environment,
    a world of one with an in-process store: every code path (meshes, DTensor,
    collectives) is then the same as in a real multi-rank job. Under NCCL,
    `dump_dir` receives the flight recorder's dump when a collective times out."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = resolve_device(device, local_rank)
    backend = resolve_backend(cfg.backend, dev)
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError("comm.backend = 'nccl' needs job.device = 'cuda'; use 'gloo' on CPU")
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), dev)
    timeout = timedelta(seconds=cfg.init_timeout_seconds)
    kwargs = dict(backend=backend, timeout=timeout)
    if backend == "nccl":
        kwargs["device_id"] = dev
        if dump_dir is not None:
            _nccl_flight_recorder(Path(dump_dir))
    if launched:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        dist.init_process_group(store=_incarnation_store(store, rank, world_size, timeout), rank=rank,
                                world_size=world_size, **kwargs)
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return DistInfo(rank, local_rank, world_size, dev)


def _nccl_flight_recorder(folder: Path) -> None:
    """NCCL's flight recorder (the last collectives of each group, with their
    state) dumped to `folder/nccl_trace_rank_<rank>` when a collective times
    out. Read by ProcessGroupNCCL when it is created, hence set here; a value
    the user set wins. (trainlib's own watchdog, which acts first, dumps the
    recorder itself: `trainlib.resilience`.)"""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / "nccl_trace_rank_"))


def _incarnation_store(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """A namespace of torchrun's store private to this incarnation of the workers.

    torchrun --max-restarts keeps one store for every incarnation: without a
    namespace, restarted gloo ranks read the dead incarnation's addresses and
    fail to connect or hang. Nothing torchrun gives a worker names the
    incarnation: TORCHELASTIC_RESTART_COUNT differs across agents (with
    --nnodes > 1 only the agent whose worker failed counts a restart), and
    counting the workers that join breaks once a worker dies before it is
    counted. So the live workers agree on a fresh name: `fresh_namespace`."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return store
    name = fresh_namespace(store, rank, world_size, timeout)
    return dist.PrefixStore(f"trainlib/incarnation/{name}", store)


_HANDSHAKE = "trainlib/handshake"


def fresh_namespace(store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                    poll_seconds: float = 0.01) -> str:
    """A name that the `world_size` live ranks calling this agree on and that no
    earlier caller of this store used, whatever keys dead ranks left behind
    (a whole earlier incarnation, or one cut short at any point).

    Rank 0 draws a random epoch. Every other rank posts a random token at
    hello/<rank> and blocks in the store (no polling) until ack/<rank>/<token>
    exists; it holds the epoch, which the rank confirms at confirm/<rank>.
    Rank 0 writes ack/<rank>/<token> for whatever token hello/<rank> holds,
    again whenever it changes, until that rank's confirmation is the epoch. A
    dead process can neither post a live rank's token nor confirm the live
    epoch, so stale keys delay nobody and are never mistaken for live ones.
    Only rank 0 polls: two batched reads per poll, the interval doubling from
    `poll_seconds` to 0.2 s."""
    hello, ack, confirm = (functools.partial(_handshake_key, kind) for kind in ("hello", "ack", "confirm"))
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(hello(rank), token)
        try:
            store.wait([f"{ack(rank)}/{token}"], timeout)
        except dist.DistStoreError as e:
            raise dist.DistStoreError(f"rank {rank}: no answer from rank 0 within {timeout} in trainlib's "
                                      f"store handshake (rank 0 dead or not started)") from e
        epoch = store.get(f"{ack(rank)}/{token}").decode()
        store.set(confirm(rank), epoch)
        return epoch
    epoch = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    pending = list(range(1, world_size))
    store.wait([hello(r) for r in pending], timeout)
    for r in pending:  # so that reading every confirmation never blocks (sets only a missing key)
        store.compare_set(confirm(r), "", "")
    answered: dict[int, bytes] = {}
    while pending:
        tokens = store.multi_get([hello(r) for r in pending])
        new = [(r, t) for r, t in zip(pending, tokens) if answered.get(r) != t]
        if new:
            store.multi_set([f"{ack(r)}/{t.decode()}" for r, t in new], [epoch] * len(new))
            answered.update(new)
        confirmed = store.multi_get([confirm(r) for r in pending])
        pending = [r for r, c in zip(pending, confirmed) if c.decode() != epoch]
        if pending:
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"rank 0: ranks {pending[:8]}{'...' if len(pending) > 8 else ''} did "
                                          f"not confirm within {timeout} in trainlib's store handshake")
            time.sleep(poll_seconds)
            poll_seconds = min(2 * poll_seconds, 0.2)
    return epoch


def _handshake_key(kind: str, rank: int) -> str:
    return f"{_HANDSHAKE}/{kind}/{rank}"


def set_collective_timeout(seconds: float) -> None:
    """Apply `seconds` to every process group this rank belongs to. Sub-groups
    made by DeviceMesh start with torch's 30-minute default, not the timeout
    given to init_process_group, so each one is set."""
    timeout = timedelta(seconds=seconds)
    # Public from torch 2.14; the private one it replaces warns there (a FutureWarning on every run's stderr).
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    groups = list(dist.distributed_c10d._world.pg_map.keys())
    for group in groups:
        if dist.get_backend(group) == dist.Backend.FAKE:  # size-1 axes (ParallelDims.build_mesh): never wait
            continue
        try:
            set_timeout(timeout, group)
        except (ValueError, RuntimeError, AssertionError) as e:  # e.g. a group this rank is not in
            logger.debug(f"could not set timeout on {group}: {e}")


def barrier() -> None:
    """Wait for every rank of the default group; nothing to wait for in a world of one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def from_rank0(value):
    """Rank 0's `value` on every rank (any picklable object); `value` itself in a world of one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def destroy_distributed() -> None:
    """Destroy the process groups, after freeing what is no longer referenced
    (FSDP state, meshes and pipeline stages sit in reference cycles), so no
    group outlives this call. A gloo group that survives it keeps its worker
    threads into interpreter exit, where a worker dropping a finished
    collective's tensors must take the GIL and aborts the process ("terminate
    called without an active exception") after a good run. Call it once the
    model and optimizer are out of scope (trainlib.train does)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
