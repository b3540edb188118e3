"""Recipe section [activation_checkpoint]: trade recomputation for activation memory.

Modes (per transformer block; the block is the checkpoint region):
  none             keep every activation.
  full             every block keeps only its input; backward reruns its forward.
  selective_layer  `full`, but only for every `every_k`-th block (by global
                   block index, so pipeline stages agree); the rest keep all.
  selective_op     every block, but per op: outputs of matmuls and attention
                   are saved, everything else (norms, RoPE, SiLU, products,
                   casts) is recomputed. Those cheap ops hold a large share of
                   a block's activation bytes and cost few FLOPs to redo.
                   `selective_op_policy = "every_other_mm"` saves only the
                   1st, 3rd, ... matmul output of a block (wq, wk, wv, wo, w1,
                   w3, w2 -> saves wq, wv, w1, w2; recomputes wk, wo, w3),
                   TorchTitan's choice: of the two large SwiGLU matmuls only
                   w3 is redone (Llama 3 8B: 3 of 7 matmuls, 36% of a block's
                   matmul FLOPs; saving the other parity, wk/wo/w3, would redo
                   wq, wv, w1 and w2, 64%). Attention itself is never rerun:
                   its output is saved and wo's recompute starts from it.

Applied after TP/CP and before compile and FSDP (trainlib.parallel.apply). The
wrapper inserts `_checkpoint_wrapped_module` into parameter names; init and
checkpoint keys strip it (trainlib.params.canonical_name).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainlib.blocks.paths import block_paths, get_block, set_block
from trainlib.errors import ConfigError
from trainlib.parallel.config import ActivationCheckpointConfig

logger = logging.getLogger("trainlib")

MODES = ("none", "full", "selective_layer", "selective_op")


def _matmul_ops() -> set:
    return {torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default}  # _scaled_mm: float8 linears


def _saved_ops() -> set:
    ops = {torch.ops.aten.max.default}  # float8 amax: tiny, and recomputing it re-reads the whole tensor
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(torch.ops.aten, name):
            ops.add(getattr(torch.ops.aten, name).default)
    # Recomputing a TP reduce-scatter would repeat communication.
    ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return ops


def _op_policy(every_other_mm: bool):
    saved, matmuls = _saved_ops(), _matmul_ops()

    def policy(counts: dict, ctx, op, *args, **kwargs):
        if op in matmuls:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if every_other_mm and counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        # A fresh counter per checkpointed call, shared by its forward and its
        # recompute so both count matmuls the same way.
        return create_selective_checkpoint_contexts(partial(policy, defaultdict(int)))

    return context_fn


def recomputed_flops_per_token(block_ops: list[tuple[str, float, bool]], n_layers: int,
                               ac: ActivationCheckpointConfig) -> float:
    """Forward FLOPs per token that backward reruns under `ac`, summed over
    `n_layers` blocks. `block_ops` is one block's (name, forward FLOPs, is a
    matmul) in forward order (the model family's block_forward_flops).
    `full` reruns all but the last op: checkpoint's early stop ends the rerun
    once every saved tensor backward needs is back, and the last op's output
    (w2's in Llama) feeds only the residual add. `selective_op` saves attention
    and, under `all_mm`, every matmul: what it reruns (norms, RoPE, SiLU) has no
    matmul FLOPs; under `every_other_mm` it reruns the 2nd, 4th, ... matmul.
    `selective_layer` is `full` on blocks 0, k, 2k, ..."""
    if ac.mode == "none":
        return 0.0
    if ac.mode in ("full", "selective_layer"):
        blocks = n_layers if ac.mode == "full" else len(range(0, n_layers, ac.every_k))
        return blocks * sum(flops for _, flops, _ in block_ops[:-1])
    if ac.selective_op_policy == "all_mm":
        return 0.0
    matmuls = [flops for _, flops, is_mm in block_ops if is_mm]
    return n_layers * sum(matmuls[1::2])


def apply_ac(model: nn.Module, mode: str, *, every_k: int = 2, selective_op_policy: str = "all_mm") -> nn.Module:
    """Wrap every block of `model` (`trainlib.blocks.paths.block_paths`, by global index) in place;
    selective_layer wraps the blocks whose global index is a multiple of `every_k`."""
    if mode not in MODES:
        raise ConfigError(f"activation_checkpoint.mode '{mode}' is not one of {', '.join(MODES)}")
    if mode == "none":
        return model
    # No dropout in Llama, so there is no RNG state to replay.
    kwargs: dict = dict(preserve_rng_state=False)
    if mode == "selective_op":
        kwargs["context_fn"] = _op_policy(selective_op_policy == "every_other_mm")
    paths = block_paths(model)
    wrapped = [i for i in paths if mode != "selective_layer" or i % every_k == 0]
    for i in wrapped:
        set_block(model, paths[i], checkpoint_wrapper(get_block(model, paths[i]), **kwargs))
    policy = f" ({selective_op_policy})" if mode == "selective_op" else ""
    logger.info(f"activation checkpointing {mode}{policy}: blocks {', '.join(map(str, wrapped)) or 'none'} "
                f"of {len(paths)}")
    return model
