"""Recipe sections [parallelism] (the degrees of the axes, the five dense ones and ep, and their options),
[activation_checkpoint] (trainlib.parallel.ac) and [compile] (trainlib.parallel.compile); torch-free, so
that the command line is answered before torch is imported (see trainlib.sections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainlib.errors import ConfigError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the dense view
EXPERT_AXES = ("pp", "dp_replicate", "efsdp", "ep")  # the sparse view (experts), over the same ranks


def check_degrees(degrees: dict[str, int]) -> None:
    """Each degree is an integer >= 1 (dp_shard may be -1: all remaining ranks).
    Also run when a [parallelism] section loads, before the world size is known."""
    for name, value in degrees.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"parallelism.{name} must be an integer, got {value!r}")
        if value < 1 and not (name == "dp_shard" and value == -1):
            hint = " (or -1 for 'all remaining ranks')" if name == "dp_shard" else ""
            raise ConfigError(f"parallelism.{name} must be >= 1{hint}, got {value}")


@dataclass
class ParallelismConfig:
    dp_replicate: int = field(default=1, metadata={
        "help": "data-parallel replicas of the model (HSDP: FSDP shards within each, gradients all-reduced "
                "across); 1 = off"})
    dp_shard: int = field(default=-1, metadata={
        "help": "FSDP degree: ranks sharding parameters, gradients and optimizer state; -1 = all ranks the "
                "other axes leave"})
    cp: int = field(default=1, metadata={
        "help": "context-parallel degree: ranks splitting each sequence (seq_len divisible by 2*cp, or cp if not "
                "load-balanced); 1 = off"})
    tp: int = field(default=1, metadata={
        "help": "tensor-parallel degree: ranks splitting each block's matmuls (innermost axis, fastest links); "
                "1 = off"})
    pp: int = field(default=1, metadata={
        "help": "pipeline-parallel degree: ranks the layers are split over in stages (outermost axis); 1 = off"})
    # Expert parallel (mixture-of-experts families): experts sharded over ep ranks borrowed from
    # dp_shard x cp x tp (trainlib.parallel.parallel_dims); 1 = off. A dense family refuses ep > 1.
    ep: int = field(default=1, metadata={
        "help": "expert-parallel degree (MoE families only): experts split over ep ranks taken from "
                "dp_shard x cp x tp; 1 = off"})
    # "default" reshards after forward (saves memory, re-gathers in backward)
    # except where it is known to be wrong or wasteful; "always"/"never" force it.
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = field(default="default", metadata={
        "help": "free each block's gathered parameters after forward, re-gather in backward; default = yes "
                "except under PP; always/never force it"})
    fsdp_cpu_offload: bool = field(default=False, metadata={
        "help": "keep FSDP's parameter shards, gradients and optimizer state in CPU memory (needs FSDP in the job)"})
    # Tensor parallel (trainlib.parallel.tp); see docs/tensor_parallel.md.
    tp_sequence_parallel: bool = field(default=True, metadata={
        "help": "under TP, shard norms and the residual stream along the sequence (needs seq_len % tp == 0)"})
    tp_loss_parallel: bool = field(default=True, metadata={
        "help": "under TP, compute the loss on vocabulary-sharded logits, never gathering whole logits"})
    tp_latent_sequence_parallel: bool = field(default=False, metadata={
        "help": "MLA attention under TP with sequence parallelism: run the query and key/value down-projections on "
                "each rank's sequence shard and all-gather their latents (q_lora_rank + kv_lora_rank + rope wide, "
                "Megatron's way) instead of the hidden states (dim wide); needs q_lora_rank > 0"})
    tp_async: bool = field(default=False, metadata={
        "help": "under TP, overlap its collectives with the matmuls (CUDA and compile.enable only)"})
    # Pipeline parallel (trainlib.parallel.pp); see docs/pipeline_parallel.md.
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                         "ZBVZeroBubble", "DualPipeV"] = field(default="1F1B", metadata={
        "help": "pipeline schedule: the order of micro-batch forwards and backwards (docs/pipeline_parallel.md)"})
    pp_microbatches: int | None = field(default=None, metadata={
        "help": "pipeline micro-batches per local batch (must divide it); none = the number of stages"})
    pp_stages_per_rank: int | None = field(default=None, metadata={
        "help": "pipeline stages per pp rank; none = 1 for GPipe/1F1B, 2 for the others (V schedules need 2)"})
    pp_layers_per_stage: list[int] | None = field(default=None, metadata={
        "help": "blocks per stage, one count per stage (e.g. [7, 8, 8, 7]), summing to n_layers; none = even split"})
    # Context parallel: each cp rank holds sequence chunks r and 2*cp-1-r so that
    # causal attention work is equal across ranks; false keeps one contiguous chunk.
    cp_load_balance: bool = field(default=True, metadata={
        "help": "under CP, rank r holds chunks r and 2*cp-1-r so causal attention work is even; "
                "false = one contiguous chunk"})
    # How attention reaches the other cp ranks' tokens (trainlib.parallel.cp, docs/context_parallel.md):
    # "allgather" gathers K/V over cp; "ulysses" re-shards q/k/v from sequence to heads by an all-to-all
    # over cp; "hybrid" does the all-to-all over cp_ulysses adjacent cp ranks and the all-gather across them.
    cp_method: Literal["allgather", "ulysses", "hybrid"] = field(default="allgather", metadata={
        "help": "under CP, how attention sees the whole sequence: allgather (K/V gathered over cp), ulysses "
                "(all-to-all from sequence to heads; query heads per tp rank divisible by cp), hybrid "
                "(ulysses over cp_ulysses adjacent ranks, allgather across them)"})
    cp_ulysses: int | None = field(default=None, metadata={
        "help": "cp_method = hybrid only: the inner all-to-all degree (a divisor of cp; put it within a node); "
                "none = unset"})

    def __post_init__(self) -> None:
        check_degrees({axis: getattr(self, axis) for axis in (*AXES, "ep")})
        self._check_cp_method()
        for key in ("pp_microbatches", "pp_stages_per_rank"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"parallelism.{key} must be >= 1 (or unset for the default), got {getattr(self, key)}")

    def _check_cp_method(self) -> None:
        u = self.cp_ulysses
        if self.cp_method != "hybrid":
            if u is not None:
                raise ConfigError(f"parallelism.cp_ulysses ({u}) is the inner degree of cp_method = 'hybrid', "
                                  f"but cp_method = '{self.cp_method}'; set cp_method = 'hybrid' or unset cp_ulysses")
            return
        if u is None or u < 1 or self.cp % u:
            got = "unset" if u is None else str(u)
            divisors = [d for d in range(1, self.cp + 1) if self.cp % d == 0]
            raise ConfigError(f"parallelism.cp_method = 'hybrid' needs cp_ulysses, the inner all-to-all degree, "
                              f"dividing cp ({self.cp}); got {got}; set cp_ulysses to one of {divisors}")

    @property
    def ulysses_degree(self) -> int:
        """Ranks each all-to-all spans (1: none, all-gather only; cp: Ulysses only)."""
        return {"allgather": 1, "ulysses": self.cp, "hybrid": self.cp_ulysses or 1}[self.cp_method]


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "selective_layer", "selective_op"] = field(default="none", metadata={
        "help": "recompute in backward: full = every block, selective_layer = blocks 0, k, 2k, ..., "
                "selective_op = cheap ops"})
    every_k: int = field(default=2, metadata={"help": "selective_layer: checkpoint blocks 0, k, 2k, ..."})
    selective_op_policy: Literal["all_mm", "every_other_mm"] = field(default="all_mm", metadata={
        "help": "selective_op: save every matmul's output (all_mm) or every other one's (every_other_mm)"})

    def __post_init__(self) -> None:
        if self.every_k < 1:
            raise ConfigError(f"activation_checkpoint.every_k must be >= 1, got {self.every_k}")


@dataclass
class CompileConfig:
    enable: bool = field(default=False, metadata={"help": "torch.compile each transformer block (one graph shared by "
                                                         "all blocks)"})
    # Also compile the loss (fuses the fp32 upcast of the logits with the
    # cross-entropy, which saves a [tokens, vocab] fp32 copy).
    loss: bool = field(default=False, metadata={
        "help": "also compile the loss (only with compile.enable); saves an fp32 [tokens, vocab] copy"})
    backend: str = field(default="inductor", metadata={"help": "torch.compile backend for the blocks and the loss"})
