"""ParallelDims: the one holder of parallel state.

It validates the degrees, builds the DeviceMesh once, and hands out named
sub-meshes. It is passed explicitly to whoever needs a mesh; there are no
module-level process groups anywhere in trainlib.

Two families of views over the same ranks, outermost to innermost:
  dense   pp, dp_replicate, dp_shard, cp, tp    (every parameter but experts')
  sparse  pp, dp_replicate, efsdp, ep           (experts'), efsdp = dp_shard*cp*tp / ep
tp is innermost because its collectives are the most frequent and belong on
the fastest links (NVLink within a node); pp is outermost because
point-to-point activations tolerate the slowest links. Expert parallel borrows
its ranks from the dense view's dp_shard x cp x tp, innermost first (tp's, then
cp's, then dp_shard's), as Megatron's parallel folding and TorchTitan do: its
all-to-all stays on the fastest links, and the experts' own FSDP shards over
what is left (efsdp). With ep = 1 the sparse view is not built and nothing
changes.

Named meshes handed out by `mesh(name)`:
  pp, dp_replicate, dp_shard, cp, tp   the dense axes
  dp           dp_replicate x dp_shard   ranks that see different data
  dp_shard_cp  dp_shard x cp             what FSDP shards parameters over
  fsdp         (dp_replicate, dp_shard_cp), 2-D, for HSDP
  dp_cp        dp_replicate x dp_shard x cp   ranks over which the loss and
               token counts are summed (every rank that holds distinct tokens)
  cp_outer, cp_inner  (hybrid context parallel, 1 < cp_ulysses < cp) cp split
               into cp/cp_ulysses x cp_ulysses, inner = adjacent cp ranks
  efsdp, ep    (ep > 1) the sparse axes
  expert_fsdp  (ep > 1) (dp_replicate, efsdp), 2-D: what experts' FSDP/HSDP uses
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend (see build_mesh)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainlib.errors import ConfigError
from trainlib.parallel.config import AXES, EXPERT_AXES, check_degrees

@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    ep: int = 1
    # ranks each context-parallel all-to-all spans (cp_method: allgather 1, ulysses cp, hybrid cp_ulysses);
    # between 1 and cp it splits cp into cp_outer x cp_inner meshes
    cp_ulysses: int = 1
    # [fault_tolerance]: this world is replica group `replica_id` of `replica_groups` torchrun jobs, which
    # average gradients through torchft's managed group (trainlib.parallel.replica), not a mesh axis
    replica_groups: int = 1
    replica_id: int = 0
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)
    _view_dim: dict[str, tuple[DeviceMesh, int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_degrees(self.degrees())
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"world size {self.world_size} is not divisible by dp_replicate({self.dp_replicate}) * "
                    f"cp({self.cp}) * tp({self.tp}) * pp({self.pp}) = {others}, so dp_shard=-1 cannot fill "
                    f"the rest; change the degrees or the number of processes"
                )
            self.dp_shard = self.world_size // others
        total = others * self.dp_shard
        if total != self.world_size:
            launch = (f", e.g. torchrun --nproc-per-node={total} -m trainlib.train ... (or --nnodes and a per-node "
                      f"count whose product is {total})" if total > self.world_size else "")
            raise ConfigError(
                f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * tp({self.tp}) * "
                f"pp({self.pp}) = {total} != world size {self.world_size}; make the product equal the number "
                f"of processes{launch}, or set parallelism.dp_shard = -1 to use the remaining ranks"
            )
        check_degrees({"ep": self.ep, "cp_ulysses": self.cp_ulysses})
        if self.cp % self.cp_ulysses:
            raise ConfigError(f"parallelism.cp_ulysses ({self.cp_ulysses}) must divide cp ({self.cp}); pick one of "
                              f"{[d for d in range(1, self.cp + 1) if self.cp % d == 0]}")
        span = self.dp_shard * self.cp * self.tp
        if span % self.ep:
            raise ConfigError(
                f"parallelism.ep ({self.ep}) must divide dp_shard({self.dp_shard}) * cp({self.cp}) * tp({self.tp}) = "
                f"{span}: expert parallel borrows its ranks from those axes (efsdp = {span} / ep shards the experts "
                f"over the rest); pick ep among {', '.join(str(d) for d in range(1, span + 1) if span % d == 0)} "
                f"that also divides the model's number of experts")

    @classmethod
    def from_config(cls, parallelism, world_size: int, fault_tolerance=None) -> "ParallelDims":
        """The degrees of a [parallelism] recipe section (ParallelismConfig), and the replica groups of an
        enabled [fault_tolerance] one."""
        ft = fault_tolerance if fault_tolerance is not None and fault_tolerance.enable else None
        return cls(world_size=world_size, ep=getattr(parallelism, "ep", 1),
                   cp_ulysses=getattr(parallelism, "ulysses_degree", 1),
                   replica_groups=ft.replica_groups if ft else 1, replica_id=ft.replica_id if ft else 0,
                   **{axis: getattr(parallelism, axis) for axis in AXES})

    # ---- degrees -------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches run at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_parallel(self) -> int:
        """Slices of each global batch: dp in every replica group (fault tolerance), dp otherwise."""
        return self.dp * self.replica_groups

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def efsdp(self) -> int:
        """What the experts' FSDP shards over: the dense dp_shard x cp x tp ranks that ep leaves."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def distinct_token_ranks(self) -> int:
        """Ranks that hold distinct tokens (dp_replicate x dp_shard x cp): more than one means FSDP shards."""
        return self.dp_replicate * self.dp_shard * self.cp

    def degrees(self) -> dict[str, int]:
        """The dense view's degrees, and ep where it is on."""
        return {name: getattr(self, name) for name in AXES} | ({"ep": self.ep} if self.ep_enabled else {})

    # ---- mesh ------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create every named mesh. Call once, after the process group exists."""
        if self._meshes:
            raise RuntimeError("ParallelDims.build_mesh was already called; reuse the meshes it built")
        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs an initialised process group (trainlib.distributed.init_distributed)")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"ParallelDims was built for world size {self.world_size}, "
                             f"but the process group has {dist.get_world_size()} ranks")
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        # every rank of this job as one 1-D mesh (pp x dp_cp x tp): one collective where a reduction spans all
        self._meshes["pp_dp_cp_tp"], self._view_dim["pp_dp_cp_tp"] = world, (world, 0)
        # Each view is an unflattening of the same world mesh, so that the
        # flattened dims (dp, dp_shard_cp, dp_cp) are first-class meshes rather
        # than slices of flattened dims, which torch is deprecating.
        pp, dpr, dps, cp, tp = (self.degrees()[a] for a in AXES)
        views = [
            ((pp, dpr, dps, cp, tp), AXES),
            ((pp, dpr, dps * cp, tp), ("pp", "dp_replicate", "dp_shard_cp", "tp")),
            ((pp, dpr * dps, cp, tp), ("pp", "dp", "cp", "tp")),
            ((pp, dpr * dps * cp, tp), ("pp", "dp_cp", "tp")),
        ]
        if 1 < self.cp_ulysses < cp:  # hybrid CP: all-to-all over adjacent cp ranks, all-gather across them
            views.append(((pp, dpr, dps, cp // self.cp_ulysses, self.cp_ulysses, tp),
                          ("pp", "dp_replicate", "dp_shard", "cp_outer", "cp_inner", "tp")))
        for shape, names in views:
            # A size-1 axis gets a fake process group (torch's "fake" backend, which
            # DeviceMesh offers for disabled dims): no real communicator or gloo
            # pair per rank and axis. Every collective trainlib or torch runs on a
            # one-rank group stays correct on it: in-place ones (all-reduce, the
            # loss and token counts) are no-ops, and a one-rank all-gather or
            # reduce-scatter copies its input (FSDP skips them anyway).
            fake = {name: "fake" for name, size in zip(names, shape) if size == 1}
            view = world._unflatten(0, shape, names, backend_override=fake)
            if names == AXES:
                self._meshes["world"] = view
            for i, name in enumerate(names):
                self._meshes.setdefault(name, view[name])
                self._view_dim.setdefault(name, (view, i))
            if "dp_shard_cp" in names:
                self._meshes["fsdp"] = view["dp_replicate", "dp_shard_cp"]
        if self.ep_enabled:
            view = world._unflatten(0, (pp, dpr, self.efsdp, self.ep), EXPERT_AXES,
                                    backend_override={n: "fake" for n, size in zip(EXPERT_AXES, (pp, dpr, self.efsdp,
                                                                                                self.ep)) if size == 1})
            for i, name in enumerate(("efsdp", "ep")):
                self._meshes[name] = view[name]
                self._view_dim[name] = (view, i + 2)
            self._meshes["expert_fsdp"] = view["dp_replicate", "efsdp"]
            # The experts' weights are DTensors over (efsdp, ep), with HSDP (dp_replicate, efsdp, ep): a
            # reduction over all of them (the gradient norm's) finds these flattened meshes and runs as one
            # all-reduce, where it ran one per dim and DTensor warned so once per rank
            self._meshes["efsdp_ep"] = view["efsdp", "ep"]._flatten("efsdp_ep")
            if dpr > 1:
                self._meshes["dp_replicate_efsdp_ep"] = view["dp_replicate", "efsdp", "ep"]._flatten(
                    "dp_replicate_efsdp_ep")
        return self._meshes["world"]

    def mesh(self, name: str) -> DeviceMesh:
        if not self._meshes:
            raise RuntimeError("call ParallelDims.build_mesh(device_type) before asking for meshes")
        if name not in self._meshes:
            raise KeyError(f"no mesh named '{name}'; available: {', '.join(sorted(self._meshes))}")
        return self._meshes[name]

    def rank_groups(self, name: str) -> list[list[int]]:
        """Every group of global ranks along the 1-D mesh `name`, not only this
        rank's (e.g. to see which groups cross a node boundary)."""
        self.mesh(name)
        view, dim = self._view_dim[name]
        return view.mesh.movedim(dim, -1).reshape(-1, view.size(dim)).tolist()

    def fsdp_mesh(self) -> DeviceMesh:
        """1-D mesh for plain FSDP, 2-D (replicate, shard) for HSDP."""
        return self.mesh("fsdp") if self.hsdp_enabled else self.mesh("dp_shard_cp")

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """What experts' FSDP shards over (ep > 1): efsdp, or (dp_replicate, efsdp) for HSDP."""
        return self.mesh("expert_fsdp") if self.hsdp_enabled else self.mesh("efsdp")

    def sum_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """All-reduce (in place) a loss summed over this rank's tokens into the
        global one: over the ranks that hold distinct tokens (dp_cp) and, under
        PP, over the stages (only the last holds a loss; the others add 0)."""
        dist.all_reduce(loss_sum, group=self.mesh("dp_cp").get_group())
        if self.pp_enabled:
            dist.all_reduce(loss_sum, group=self.mesh("pp").get_group())
        return loss_sum

    def dp_coords(self) -> tuple[int, int]:
        """(rank, degree) of this process along dp: which slice of each global
        batch it loads. Ranks that differ only in cp/tp/pp load the same data;
        replica group g (fault tolerance) takes the g-th dp-sized run of slices."""
        if not self._meshes:
            return self.replica_id, self.replica_groups
        return self.replica_id * self.dp + self.mesh("dp").get_local_rank(), self.data_parallel
