"""What the families share of their parallel plans: the usual Megatron TP plan of a
pre-norm block with GQA attention and a gated MLP (Llama 3, Qwen3), and the shape
rules for the degrees, dense (`check_dense_degrees`) and MoE (`check_moe_degrees`:
Qwen3-MoE, DeepSeek-V3). Family-side code (it names the shared blocks' modules, which
generic code must not); a family passes its own extras (Qwen3's QK-norm)."""

from __future__ import annotations

from collections.abc import Mapping

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from trainlib.errors import ConfigError
from trainlib.parallel.tp import TPPlan, activation_layout, block_input_style, embedding_style, norm_style, output_style


def dense_tp_plan(sequence_parallel: bool, loss_parallel: bool,
                  extra_block: Mapping[str, ParallelStyle] | None = None) -> TPPlan:
    """Column-wise q, k, v and gate/up projections, row-wise output and down projections, norms on
    sequence shards under SP, a vocab-sharded embedding and output projection; `extra_block` adds a
    family's own block entries."""
    act, norm = activation_layout(sequence_parallel), norm_style(sequence_parallel)
    return TPPlan(
        root={"tok_embeddings": embedding_style(sequence_parallel), "norm": norm,
              "output": output_style(sequence_parallel, loss_parallel)},
        block={
            "attention_norm": norm, "ffn_norm": norm,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
            # attention(x, rope, mask): the rope table and mask are plain, whole-sequence values
            "attention": block_input_style(sequence_parallel, n_args=3),
            "feed_forward": block_input_style(sequence_parallel),
            **(extra_block or {}),
        })


def check_dense_degrees(args, degrees: Mapping[str, int], family: str, tied_hint: str = "") -> None:
    """A dense model's shape rules for the parallel degrees: no experts for ep; tied embeddings
    cannot live on two pipeline stages; heads, kv heads, MLP width and vocabulary split over tp."""
    tp, pp, ep = degrees.get("tp", 1), degrees.get("pp", 1), degrees.get("ep", 1)
    if ep > 1:
        raise ConfigError(f"parallelism.ep ({ep}) shards a model's experts, and {family} is dense (no experts); "
                          f"set parallelism.ep = 1")
    _check_tied(args, pp, family, tied_hint)
    if tp > 1:
        for what, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads),
                            ("ffn_dim", args.ffn_dim), ("vocab_size", args.vocab_size)):
            if value % tp:
                raise ConfigError(
                    f"model {what} ({value}) must be divisible by parallelism.tp ({tp}): each TP rank owns "
                    f"1/tp of them{' (GQA: kv heads are not replicated)' if what == 'n_kv_heads' else ''}; "
                    f"choose tp dividing {value}")


def check_moe_degrees(args, degrees: Mapping[str, int], seq_len: int, family: str) -> None:
    """An MoE model's rules for the degrees beyond its attention's and MLP's tp rules: the MoE blocks route
    each tp rank's 1/tp of the sequence; ep divides the experts (the hint also satisfies ParallelDims' rule
    that ep divides dp_shard * cp * tp, whose ranks it borrows); tied embeddings and pp."""
    tp, pp, ep = degrees.get("tp", 1), degrees.get("pp", 1), degrees.get("ep", 1)
    if tp > 1 and seq_len % tp:
        raise ConfigError(f"training.seq_len ({seq_len}) must be divisible by parallelism.tp ({tp}): the MoE "
                          f"blocks route each rank's 1/tp of the sequence; choose tp dividing {seq_len}")
    if args.moe.n_experts % ep:
        n, span = args.moe.n_experts, degrees.get("dp_shard", 1) * degrees.get("cp", 1) * tp
        both = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and span % d == 0)
        raise ConfigError(f"parallelism.ep ({ep}) must divide the number of experts ({n}): each EP rank holds "
                          f"n_experts / ep of them; pick ep among {both} (dividing both {n} and dp_shard * cp * tp "
                          f"= {span})")
    _check_tied(args, pp, family)


def _check_tied(args, pp: int, family: str, hint: str = "") -> None:
    if args.tie_embeddings and pp > 1:
        raise ConfigError(
            f"this {family} flavor ties the embedding and output weights, which live on the first and last "
            f"pipeline stages (pp={pp}); use pp=1 with it, or a flavor without tied embeddings{hint}")
