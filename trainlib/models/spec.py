"""The model contract: what a family declares, and all the generic runtime reads of it.

A family is one package under `trainlib/models/<family>/` that builds one
`ModelSpec` and one line in `trainlib/models/registry.py`. Generic code
(`parallel/`, `plan/`, `checkpoint/`, `config/`, the loop) reads a family only
through its spec and the model protocol below; it names no family and no
family's module (tests/unit/test_model_contract.py checks that from the code).

The model protocol (what `model_cls(args, rope_len=seq_len)` builds, plain
single-device PyTorch, built on the meta device):
  - `layers`: an nn.ModuleDict of blocks keyed by global index ("0", "1", ...),
    each block FSDP's, AC's and compile's unit;
  - the root modules named in `stage_roots`, which may be None on pipeline
    stages (the forward skips them), and `output_module`, an nn.Linear
    projection the chunked loss may apply itself when `output_in_forward` is
    set False;
  - every attention module subclasses `trainlib.models.layers.Attention` and
    runs its kernel as `self.sdpa(q, k, v, mask)` (context parallelism routes it);
  - `forward(tokens, position_ids=None, doc_ids=None)`, `attention_mask(doc_ids,
    dtype, q_positions=None)`, `init_buffers(device)`, `param_init_spec(name)`.
The args dataclass has `n_layers` and `vocab_size` (the layer count a pipeline
splits, the vocabulary the tokenizer must fit in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from trainlib.models.config import PARAM_ROLES

__all__ = ["PARAM_ROLES", "BlockShape", "ModelSpec", "StageRoots"]


@dataclass(frozen=True)
class StageRoots:
    """A family's modules outside its blocks, by the pipeline stage that owns
    them: the first stage runs `first` (the embedding) before its blocks, the
    last stage `last` (final norm, output projection) after them."""

    first: tuple[str, ...]
    last: tuple[str, ...]


@dataclass(frozen=True)
class BlockShape:
    """What the planner prices one block by: the residual width, attention's
    heads (GQA: n_kv_heads) and head width, and the gated MLP's width. A family
    lists one per block (`ModelSpec.block_shapes`), so blocks may differ. An MoE
    block (trainlib.models.moe.MoE) gives its MoEArgs as `moe`, and as ffn_dim the
    hidden width a token activates."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    moe: object = None  # trainlib.models.moe.MoEArgs of an MoE block, else None


@dataclass(frozen=True)
class ModelSpec:
    """One family's entry in the registry.

    name                recipe key `model.name`
    flavors             published shapes, by `model.flavor`
    get_args            (flavor, **shape overrides) -> validated args; one-line ConfigError naming the closest flavor
    args_type           the args dataclass (checkpoints save its fields; `convert` rebuilds it)
    model_cls           the plain single-device module (the protocol above)
    parallelize         (model, dims, parallelism, *, param_dtype, reduce_dtype, ac, compile) -> model: the
                        family's plan for every axis, applied in its fixed order with trainlib.parallel's helpers
    validate            (args, degrees, seq_len) -> None: the family's shape rules for the parallel degrees
                        (heads, kv heads, MLP width, vocabulary divisible by tp; what tied weights allow), each
                        a one-line ConfigError naming the rule, the values and the fix
    stage_roots         the root modules the first and last pipeline stages own
    output_module       the output projection's attribute name (the chunked loss applies its weight)
    flops_per_token     training FLOPs per token, for MFU and the planner
    block_forward_flops one block's forward FLOPs per token, op by op: (name, FLOPs, is a matmul), a matmul
                        named as its linear module and the attention scores' op "attention"; what activation
                        checkpointing reruns is counted from it
    block_shapes        (args) -> one BlockShape per block, in order: what the planner prices each block by
    state_dict_adapter  module mapping names, layouts and config.json to and from Hugging Face
                        (`ARCHITECTURES`: the config.json architectures it reads); a weight HF stores as one
                        tensor per slice of its first dimension (an MoE layer's experts) it names by the tuple
                        of their HF names, in order (trainlib.checkpoint.hf stacks and splits them)
    param_role          (canonical parameter name, e.g. `layers.3.attention.wq.weight`) -> one of PARAM_ROLES
                        ("embedding", "output", "norm", "bias", "router", "expert", "matrix"): what the optimizer
                        groups parameters by (trainlib.optim: AdamW's weight decay, Muon's orthogonalised set). A
                        "matrix" or "router" is 2-D [out, in]; an "expert" is 3-D [n_experts, out, in], one matrix
                        per expert; trainlib.models.roles has the shared name rules
    """

    name: str
    flavors: Mapping[str, Any]
    get_args: Callable[..., Any]
    args_type: type
    model_cls: type[nn.Module]
    parallelize: Callable[..., nn.Module]
    validate: Callable[[Any, Mapping[str, int], int], None]
    stage_roots: StageRoots
    output_module: str
    flops_per_token: Callable[[Any, int], float]
    block_forward_flops: Callable[[Any, int], list[tuple[str, float, bool]]]
    block_shapes: Callable[[Any], list[BlockShape]]
    state_dict_adapter: ModuleType
    param_role: Callable[[str], str]
