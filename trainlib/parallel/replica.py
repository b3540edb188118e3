"""The replica axis of fault tolerance: torchft's Manager and managed process group.

With `[fault_tolerance] enable`, each replica group is its own torchrun job
(its own world and `ParallelDims`: FSDP2/TP/PP/CP/EP inside it as usual). The
groups are not a mesh axis: group rank r of every group joins one torchft
`ProcessGroupGloo` that the Manager reconfigures at each quorum, so a dead
group drops out of the next step and a relaunched one joins it. What this
module adds to a step (`trainlib.step.StepRunner` calls it; `train.py` only
through the runner):

- `begin_step`: the step's quorum with the lighthouse (synchronous: no quorum
  thread runs beside FSDP2's forward); a group behind the others is healed here
  from a live peer (model, optimizer, scheduler, data loader, guard and
  trainer state, over torchft's HTTP transport, never through disk);
- `all_reduce_sum`: the sum over the live groups (token count, then the
  gradients with the loss and MoE statistics in one flat buffer). The loss is
  already divided by the live groups' target count, so the summed gradient
  is exactly the token mean over the live groups' batches;
- `should_commit`: every rank of the group agrees the step succeeded (no
  failed collective, at least min_replica_size live groups); if not, no update
  is made and the step runs again, on the same batch, after the next quorum (a
  group whose peers committed it is healed from them there instead).

A step with fewer live groups trains on their slices only (fewer tokens, not
the same global batch by accumulation): docs/reliability.md.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainlib.distributed import from_rank0
from trainlib.errors import ConfigError
from trainlib.params import local_tensor

logger = logging.getLogger("trainlib")


def lighthouse_address(cfg) -> str:
    """[fault_tolerance] lighthouse, or TORCHFT_LIGHTHOUSE."""
    return cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def check_lighthouse(address: str, connect_timeout_s: float) -> str | None:
    """None if a lighthouse answers at `address` within the timeout, else the one-line reason."""
    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(address, connect_timeout=timedelta(seconds=connect_timeout_s))
    except RuntimeError as e:  # torchft's Rust client raises RuntimeError for a failed connection
        return (f"no torchft lighthouse answers at {address} after fault_tolerance.connect_timeout_seconds = "
                f"{connect_timeout_s:g} ({str(e).split(';')[0].strip()}); start one (python -m trainlib.ft "
                f"lighthouse) and pass its address as fault_tolerance.lighthouse")
    return None


def _local(tree: Any) -> Any:
    """A state dict with every DTensor replaced by this rank's shard (what a peer's same rank holds)."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return tree


def _like(received: Any, template: Any) -> Any:
    """`received` (shards) as DTensors laid out like this rank's own `template` state dict."""
    if isinstance(template, DTensor):
        return DTensor.from_local(received.to(template.device), template.device_mesh, template.placements,
                                  run_check=False, shape=template.shape, stride=template.stride())
    if isinstance(received, dict) and isinstance(template, dict):
        return {k: _like(v, template.get(k)) for k, v in received.items()}
    if isinstance(received, (list, tuple)) and isinstance(template, (list, tuple)) and len(received) == len(template):
        return type(received)(_like(v, t) for v, t in zip(received, template))
    return received


class ReplicaAxis:
    """This group's torchft Manager and its managed process group (one per group rank)."""

    def __init__(self, cfg, dims, rank: int, world_size: int, device: torch.device):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.cfg, self.dims = cfg, dims
        address = lighthouse_address(cfg)
        pg_timeout = timedelta(seconds=cfg.process_group_timeout_seconds)
        # the gradient shards live on the device: NCCL between GPUs, gloo between CPU processes
        self.pg = (ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=pg_timeout)
        # torchrun's TCPStore (MASTER_ADDR/PORT) is this group's store; a process without torchrun (a group of
        # one rank) hosts its own. Rank 0 runs the group's manager server.
        self._own_store = None
        if "MASTER_ADDR" in os.environ:
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:
            self._own_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "127.0.0.1", self._own_store.port
        self.manager = Manager(
            pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.min_replica_size,
            use_async_quorum=False,  # the quorum (and a heal) finishes before the forward: no race with FSDP2
            timeout=pg_timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=cfg.connect_timeout_seconds), rank=rank, world_size=world_size,
            store_addr=store_addr, store_port=store_port, lighthouse_addr=address,
            replica_id=f"trainlib_replica_{cfg.replica_id}",
            init_sync=False)  # every group initialises the same weights from the seed (trainlib.parallel.init)
        self.states: dict[str, Any] = {}
        self.participants = 0
        self.quorum_ms = 0.0
        self.heal_s = 0.0  # seconds spent healing since the last logged step (metrics: ft_heal_s)
        self.heals: list[dict] = []  # every heal of this process: step, seconds, source quorum
        self._healed = False
        self._pending_quorum = False  # setup's quorum serves the first step
        self._params: list[torch.Tensor] = []
        self._begun = -1  # the step begun last, and the data loader's state before it (a failed step reruns it)
        self._data_state: dict | None = None

    # ---- state a peer heals from ------------------------------------------------------------------
    def register(self, checkpointer, params: list[torch.Tensor]) -> None:
        """The parts a heal transfers (the checkpointer's `Stateful` parts), which group writes checkpoints (the
        lowest live one, decided at each quorum) and the parameters whose gradients sum across groups."""
        self.checkpointer, self.states, self._params = checkpointer, checkpointer.states, params
        for key, part in self.states.items():
            self.manager.register_state_dict_fn(key, self._loader(key, part),
                                                lambda part=part: _local(part.state_dict()))

    def _loader(self, key: str, part):
        def load(received) -> None:
            part.load_state_dict(_like(received, part.state_dict()))
            self._healed = True
        return load

    def join(self, checkpointer) -> int:
        """At setup: the first quorum. A group that finds live peers ahead of it heals from one (no disk read);
        otherwise (a fresh run, or every group restarted) it loads the checkpoint as a run without fault
        tolerance does. Returns the step to continue after."""
        self._quorum()
        self._pending_quorum = True
        if self._healed:
            step = checkpointer.train_state.step
            logger.info(f"fault tolerance: replica group {self.cfg.replica_id} healed from a live peer at step "
                        f"{step} in {self.heal_s:.2f} s (no checkpoint read)")
        else:
            step = checkpointer.load()
            self.manager.load_state_dict({"step": step, "batches_committed": step * self.participants})
        return step

    def _quorum(self) -> None:
        t0 = time.perf_counter()
        self._healed = False
        self.manager.start_quorum()  # synchronous: a heal's state is applied before it returns
        if self.manager.errored() is not None:  # e.g. a heal's transfer failed: this group will retry next step
            logger.warning(f"fault tolerance: quorum error: {str(self.manager.errored()).splitlines()[0]}")
        seconds = time.perf_counter() - t0
        self.quorum_ms = seconds * 1e3
        self.participants = self.manager.num_participants()
        self.checkpointer.writer = self.manager.participating_rank() == 0
        if self._healed:
            self.heal_s += seconds
            self.heals.append({"step": self.manager.current_step(), "seconds": seconds,
                               "participants": self.participants})

    # ---- one step -----------------------------------------------------------------------------------
    def begin_step(self, step: int) -> int:
        """The quorum of the step after `step`; returns the step to run: the one after the last committed (a
        failed step runs again; a healed group continues from its peer's step)."""
        if self._pending_quorum:
            self._pending_quorum = False
        else:
            self._quorum()
        to_run = self.manager.current_step() + 1
        loader = self.states.get("dataloader")
        if loader is not None:
            if to_run == self._begun and not self._healed:  # the same step again: on the same batch
                loader.load_state_dict(self._data_state)
            else:
                self._data_state = loader.state_dict()
        self._begun = to_run
        return to_run

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum `tensors` (in place) over this group rank's peers in the live groups, in one flat buffer per
        dtype. A failure (a group died in the step) is recorded: should_commit then says no."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def gradients(self) -> list[torch.Tensor]:
        """This rank's gradient shards, in parameter order (the same on every group's same rank)."""
        grads = []
        for p in self._params:
            if p.grad is not None:
                g = p.grad
                grads.append(local_tensor(g))
        return grads

    def should_commit(self) -> bool:
        """Every rank of this group ran the step without a failure, and enough groups took part. False: the
        gradients are dropped, no update is made, and the step runs again on the same batch after the next
        quorum."""
        ok = self.manager.should_commit()
        if not ok:
            for p in self._params:
                p.grad = None
            logger.warning(f"fault tolerance: step {self.manager.current_step() + 1} not committed "
                           f"({self.participants} live groups, min_replica_size {self.cfg.min_replica_size}); "
                           f"running it again")
        return ok

    def take_fields(self) -> dict:
        """metrics.jsonl fields: ft_participants, ft_quorum_ms (this step's quorum), ft_heal_s (since the last
        logged step)."""
        fields = {"ft_participants": self.participants, "ft_quorum_ms": round(self.quorum_ms, 3),
                  "ft_heal_s": round(self.heal_s, 4)}
        self.heal_s = 0.0
        return fields

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        self._own_store = None


def build_replica_axis(cfg, dims, rank: int, world_size: int, device: torch.device) -> ReplicaAxis:
    """The replica axis of an enabled [fault_tolerance]; refuses an unreachable lighthouse in one line."""
    problem = check_lighthouse(lighthouse_address(cfg), cfg.connect_timeout_seconds) if rank == 0 else None
    problem = from_rank0(problem) if world_size > 1 else problem
    if problem is not None:
        raise ConfigError(problem)
    return ReplicaAxis(cfg, dims, rank, world_size, device)
