"""The model contract: what a family declares, and all the generic runtime reads of it.

A family is one package under `trainlib/models/<family>/` that builds one
`ModelSpec` and one line in `trainlib/models/registry.py`. Generic code
(`parallel/`, `plan/`, `checkpoint/`, `config/`, the loop) reads a family only
through its spec and the model protocol below; it names no family and no
family's module (tests/unit/test_model_contract.py checks that from the code).

The model protocol (what `model_cls(args, rope_len=seq_len)` builds, plain
single-device PyTorch, built on the meta device):
  - `layers`: an nn.ModuleDict of blocks keyed by global index ("0", "1", ...),
    each block FSDP's, AC's, compile's and TP's unit, built by the family's
    `make_block(args, index)` (blocks may differ by index); more blocks outside
    `layers` (multi-token prediction's) are named by `extra_block_paths()`
    (global index -> dotted path), and every axis finds them all through
    `trainlib.blocks.paths.block_paths`;
  - the root modules named in `stage_roots`, which may be None on pipeline
    stages (the forward skips them), and `output_module`, an nn.Linear
    projection the chunked loss may apply itself when `output_in_forward` is
    set False;
  - an MoE feed-forward is `trainlib.blocks.moe.MoE`: the family chooses its
    parts' classes (`router`, `experts`, `shared_experts`: subclasses of
    Router, GroupedExperts, SharedExperts, which the axes find by base class),
    and MoEArgs its routing (softmax or sigmoid scores, expert groups ranked by
    their best score or the sum of their two best, route normalisation and
    scale; the auxiliary-loss-free bias is the MoE's `expert_bias` buffer);
  - every attention module subclasses `trainlib.blocks.attention.Attention` and
    runs its kernel as `self.sdpa(q, k, v, mask, scale=None)` (v may be narrower
    than q and k; context parallelism routes it);
  - `forward(tokens, position_ids=None, doc_ids=None, **model_inputs)`,
    `attention_mask(doc_ids, dtype, q_positions=None)`, `init_buffers(device)`,
    `param_init_spec(name)`.

Outputs and the loss belong to the family (both optional; without them the
model's output and the micro-batch's `labels` go to the job's cross-entropy):
  - `prepare_batch(args)` -> None or a function of a micro-batch of whole
    windows ({"input", "labels", "position_ids"}: [b, S] each) returning it with
    more entries: `model_inputs` (a dict of keyword arguments for `forward`) and
    any targets the objective reads. It runs before the batch is cut for context
    parallelism, so shifted labels exist; every [b, S] tensor in the result (in
    lists and dicts too) is then cut like `input`.
  - `objective(args, model_cfg)` -> None or a function (output, micro_batch, ce)
    -> (token-loss sum, {name: term}) where `ce(output, labels)` is the job's
    cross-entropy sum (chunked, vocab-parallel); the step runner divides both by
    the global batch's target count and logs each term to metrics.jsonl under
    its name (multi-token prediction: `mtp_loss_1`, ...), which the function
    lists as its `term_names` attribute (every rank reduces them, pipeline
    stages without the loss included). Under pipeline parallelism it runs on
    the last stage; a first-stage root the last stage needs too (the shared
    embedding) the model names in `last_stage_copies()` (trainlib.parallel.pp).
The args dataclass has `n_layers` and `vocab_size` (the layer count a pipeline
splits, the vocabulary the tokenizer must fit in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from trainlib.models.roles import PARAM_ROLES

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
    heads (GQA: n_kv_heads) and head widths, and the gated MLP's width. A family
    lists one per block (`ModelSpec.block_shapes`), so blocks may differ. An MoE
    block (trainlib.blocks.moe.MoE) gives its MoEArgs as `moe`, and as ffn_dim the
    hidden width a token activates.

    Attention is described by the q, k, v tensors the block hands its kernel
    (`self.sdpa(q, k, v, ...)`, [b, heads, s, width]), which is what context
    parallelism moves:
      n_heads     query heads
      n_kv_heads  key/value heads (GQA: a divisor of n_heads; MLA: n_heads, since
                  its up-projection gives every head its own K and V, the shared
                  RoPE part broadcast into each)
      head_dim    the width of a q and a k head (MLA: qk_nope_head_dim +
                  qk_rope_head_dim, 128 + 64 = 192 for DeepSeek-V3)
      v_head_dim  the width of a v head and of the attention output per head, where
                  it differs from head_dim (MLA: v_head_dim, 128); None: head_dim
    The planner's CP lines (trainlib.plan.comm.cp_bytes, ulysses_bytes,
    trainlib.plan.memory.cp_kept_bytes) price K and V as head_dim + v_dim per KV
    head and token.
      q_lora_rank, kv_lora_rank, rope_head_dim
                  MLA's down-projections: the query latent (0: queries straight
                  from the hidden state), the key/value latent and the RoPE key
                  they produce; all 0 for GQA. What tensor parallel's latent
                  option gathers (parallelism.tp_latent_sequence_parallel) and
                  the planner prices as the block's latent activations."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    moe: object = None  # trainlib.blocks.moe.MoEArgs of an MoE block, else None
    v_head_dim: int | None = None  # v's (and the output's) head width where it differs from head_dim (MLA)
    # MLA's latents (0: GQA): the query down-projection's width (0: no q-LoRA), the key/value latent's, and the
    # RoPE key width every head shares (part of the key/value down-projection's output)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0

    @property
    def v_dim(self) -> int:
        """The width of a v head and of the attention output per head."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


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
    block_shapes        (args) -> one BlockShape per block, in global index order: what the planner prices each
                        block by; the n_layers decoder blocks, then any extra blocks (multi-token prediction's
                        depths, `extra_block_paths`), which the last pipeline stage runs, one output each
    prepare_batch       (args) -> a micro-batch hook or None (the model protocol above); default None
    objective           (args, model_cfg) -> the family's loss or None (the model protocol above); default None
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
    prepare_batch: Callable[[Any], Callable[[dict], dict] | None] | None = None
    objective: Callable[[Any, Any], Callable[..., tuple[Any, dict]] | None] | None = None
