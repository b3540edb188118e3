"""The shape of an MoE block (`MoEArgs`, held by an MoE family's flavors) and the `[moe]` recipe section
(`MoEConfig`), torch-free: the flavors and the recipe are read before torch is imported (trainlib.sections).
trainlib.blocks.moe, the block itself, re-exports both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainlib.errors import ConfigError




@dataclass(frozen=True)
class MoEArgs:
    """The shape of one MoE block (a family's flavor holds it)."""

    n_experts: int
    top_k: int
    expert_dim: int  # each routed expert's hidden width
    n_shared_experts: int = 0  # shared experts, as one gated MLP of n_shared_experts * expert_dim
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True  # the chosen experts' weights sum to 1
    route_scale: float = 1.0
    n_groups: int = 1  # group-limited routing: experts in n_groups groups of n_experts / n_groups
    topk_groups: int = 1  # tokens choose among the experts of this many groups
    # how a group ranks under group-limited routing: "max", its best expert's score (+ bias); "top2_sum", the
    # sum of its two best (DeepSeek-V3)
    group_score: Literal["max", "top2_sum"] = "max"

    def validate(self) -> None:
        for key in ("n_experts", "top_k", "expert_dim", "n_groups", "topk_groups"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.moe {key} must be >= 1, got {getattr(self, key)}")
        if self.top_k > self.n_experts:
            raise ConfigError(f"model.moe top_k ({self.top_k}) must be at most n_experts ({self.n_experts})")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"model.moe score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if self.n_experts % self.n_groups:
            raise ConfigError(f"model.moe n_groups ({self.n_groups}) must divide n_experts ({self.n_experts}): "
                              f"group-limited routing splits the experts into equal groups; pick n_groups among "
                              f"{', '.join(str(d) for d in range(1, self.n_experts + 1) if self.n_experts % d == 0)}")
        if self.topk_groups > self.n_groups:
            raise ConfigError(f"model.moe topk_groups ({self.topk_groups}) must be at most n_groups "
                              f"({self.n_groups}): tokens keep topk_groups of the n_groups groups; lower topk_groups")
        if self.group_score not in ("max", "top2_sum"):
            raise ConfigError(f"model.moe group_score must be 'max' or 'top2_sum', got {self.group_score!r}")
        if self.n_groups > 1 and self.group_score == "top2_sum" and self.n_experts // self.n_groups < 2:
            raise ConfigError(f"model.moe group_score 'top2_sum' ranks a group by its two best experts, but "
                              f"n_groups ({self.n_groups}) groups of {self.n_experts} experts hold one each; "
                              f"use group_score = 'max' or fewer groups")
        if self.n_groups > 1 and self.topk_groups * self.n_experts // self.n_groups < self.top_k:
            raise ConfigError(f"topk_groups ({self.topk_groups}) groups of {self.n_experts // self.n_groups} "
                              f"experts hold fewer than top_k ({self.top_k}) experts; raise topk_groups")


@dataclass
class MoEConfig:
    """Training-time settings of every MoE block (the `[moe]` recipe section); dense families ignore them."""

    load_balance: Literal["bias", "none"] = field(default="bias", metadata={
        "help": "'bias': the auxiliary-loss-free per-expert bias, updated after every optimizer step from the "
                "global batch's token counts; 'none': no bias"})
    bias_update_rate: float = field(default=1e-3, metadata={
        "help": "how far each expert's bias moves per optimizer step (DeepSeek-V3: 1e-3)"})
    seq_aux_loss_coef: float = field(default=0.0, metadata={
        "help": "weight of the sequence-wise load-balance loss (0: off)"})
    global_aux_loss_coef: float = field(default=0.0, metadata={
        "help": "weight of the global-batch load-balance loss, E * sum_i f_i P_i with f_i the previous global "
                "batch's share of expert i (0: off)"})
    z_loss_coef: float = field(default=0.0, metadata={
        "help": "weight of the router z-loss, mean logsumexp(logits)^2 over tokens (0: off)"})
    capacity_factor: float | Literal["dropless"] = field(default="dropless", metadata={
        "help": "'dropless': no limit; c > 0: an expert takes at most ceil(c * tokens * top_k / n_experts) "
                "assignments per forward, its highest-weighted; the rest are dropped and counted"})
    grouped_mm: bool = field(default=True, metadata={
        "help": "run the experts as one grouped matmul (false: a loop over experts; the same values, slower)"})

    def __post_init__(self) -> None:
        if self.load_balance not in ("bias", "none"):
            raise ConfigError(f"moe.load_balance must be 'bias' or 'none', got {self.load_balance!r}")
        for key in ("bias_update_rate", "seq_aux_loss_coef", "global_aux_loss_coef", "z_loss_coef"):
            if getattr(self, key) < 0:
                raise ConfigError(f"moe.{key} must be >= 0, got {getattr(self, key)}")
        if not self.dropless and not self.capacity_factor > 0:
            # 0 once meant dropless; a capacity of 0 (or less) would drop every assignment
            raise ConfigError(f"moe.capacity_factor must be > 0 (the share of the mean load one expert may take), "
                              f"got {self.capacity_factor:g}; for no limit set moe.capacity_factor = \"dropless\" "
                              f"(the default)")

    @property
    def dropless(self) -> bool:
        return self.capacity_factor == "dropless"
