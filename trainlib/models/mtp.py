"""Multi-token prediction's batch and loss, for any family whose model has MTP depth modules
(DeepSeek-V3's: each depth k combines the main model's hidden state at position i with the embedding of
token i + k and predicts token i + k + 1).

Family-side code: a family's ModelSpec names `prepare_batch` and `objective` below (trainlib.models.spec);
the step runner calls them, so every layout that cuts micro-batches (context parallelism) sees the shifted
inputs and labels made on whole windows first.

Targets. In a window of S tokens (`input` = tokens 0..S-1, `labels` = tokens 1..S), depth k's input at
position i is token i + k (= labels[i + k - 1]) and its target token i + k + 1 (= labels[i + k]). A target
past the window's last label, or in another document than position i (documents start where
`position_ids` is 0; the token after the window counts as the last position's document), is ignored
(IGNORE_INDEX): no depth predicts across a document boundary, whatever `model.attn_mask` is.

Loss. The objective is  CE_main + lambda * mean_k CE_k  (lambda = `model.mtp_loss_weight`), each CE a
token-loss sum that the step runner divides by the global batch's target count (the main loss's), so it
does not depend on the layout; each CE_k is logged as `mtp_loss_<k>` with that same divisor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainlib.data import document_ids
from trainlib.loss import IGNORE_INDEX

__all__ = ["mtp_objective", "mtp_prepare_batch", "mtp_targets"]


def mtp_targets(labels: torch.Tensor, position_ids: torch.Tensor, depth: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """([inputs of depths 1..depth], [labels of depths 1..depth]), each [b, S] (see the module docstring)."""
    b, S = labels.shape
    docs = document_ids(position_ids)
    docs_ext = torch.cat([docs, docs[:, -1:]], dim=1)  # document of tokens 0..S (token S: the last position's)
    inputs, targets = [], []
    for k in range(1, depth + 1):
        inp = labels.new_zeros(b, S)  # past the window: any token (its target is ignored)
        inp[:, :S - k + 1] = labels[:, k - 1:]
        tgt = labels.new_full((b, S), IGNORE_INDEX)
        if k < S:
            tgt[:, :S - k] = labels[:, k:]
            other_doc = docs_ext[:, k + 1:] != docs[:, :S - k]  # token i + k + 1 against position i
            tgt[:, :S - k][other_doc] = IGNORE_INDEX
        inputs.append(inp)
        targets.append(tgt)
    return inputs, targets


def mtp_prepare_batch(depth: int) -> Callable[[dict], dict] | None:
    """The micro-batch hook of a model with `depth` MTP modules (None for depth 0): adds
    `model_inputs = {"mtp_inputs": [...]}` and `mtp_labels`."""
    if not depth:
        return None

    def prepare(mb: dict) -> dict:
        inputs, targets = mtp_targets(mb["labels"], mb["position_ids"], depth)
        return {**mb, "model_inputs": {**mb.get("model_inputs", {}), "mtp_inputs": inputs}, "mtp_labels": targets}

    return prepare


def mtp_objective(depth: int, weight: float) -> Callable | None:
    """(output, micro_batch, ce) -> (CE_main + weight * mean_k CE_k, {"mtp_loss_k": CE_k}), for a model whose
    forward returns the flat tuple (main output, depth 1's output, ...) when given `mtp_inputs`; None for depth 0."""
    if not depth:
        return None

    def objective(out, mb: dict, ce) -> tuple[torch.Tensor, dict]:
        main, *per_depth = out
        total = ce(main, mb["labels"])
        terms = {}
        for k, (o, labels) in enumerate(zip(per_depth, mb["mtp_labels"], strict=True), start=1):
            loss = ce(o, labels)
            terms[f"mtp_loss_{k}"] = loss.detach()
            total = total + (weight / depth) * loss
        return total, terms

    objective.term_names = [f"mtp_loss_{k}" for k in range(1, depth + 1)]  # what every rank reduces (step.py)
    return objective
