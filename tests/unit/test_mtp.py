"""Multi-token prediction's batch and objective (trainlib.models.mtp), and the step runner's family hooks."""

import torch
import torch.nn.functional as F

from trainlib.loss import IGNORE_INDEX, cross_entropy_sum
from trainlib.models.mtp import mtp_objective, mtp_prepare_batch, mtp_targets
from trainlib.parallel.cp import shard_batch, shard_sequence


def _reference_targets(tokens: list[int], docs: list[int], depth: int) -> list[list[int]]:
    """Depth k's target at position i: token i + k + 1 of the window's tokens (S + 1 of them), if it exists and
    lies in position i's document (the token after the window counts as the last position's)."""
    S = len(tokens) - 1
    doc_of = docs + [docs[-1]]
    return [[tokens[i + k + 1] if i + k + 1 <= S and doc_of[i + k + 1] == doc_of[i] else IGNORE_INDEX
             for i in range(S)] for k in range(1, depth + 1)]


def test_mtp_targets_shift_by_depth_and_never_cross_a_document():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 50, (2, 13), generator=g)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1],
                                 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    inputs, targets = mtp_targets(tokens[:, 1:], position_ids, depth=3)
    for row in range(2):
        docs = ((position_ids[row] == 0).cumsum(0) - 1).tolist()
        want = _reference_targets(tokens[row].tolist(), docs, 3)
        assert [t[row].tolist() for t in targets] == want
        for k, inp in enumerate(inputs, start=1):  # depth k reads token i + k where it exists
            assert inp[row, :12 - k + 1].tolist() == tokens[row, k:].tolist()
    assert (targets[0][0] == IGNORE_INDEX).sum() > (targets[0][1] == IGNORE_INDEX).sum()  # boundaries masked


def test_prepared_targets_are_cut_for_context_parallelism_like_the_input():
    """The hook runs on whole windows; shard_batch then cuts its tensors, in lists too, with the input's layout."""
    labels = torch.arange(1, 17).view(1, 16)
    mb = mtp_prepare_batch(2)({"input": labels - 1, "labels": labels, "position_ids": torch.arange(16).view(1, 16)})

    class Mesh:
        def size(self):
            return 2

        def get_local_rank(self):
            return 1

    local = shard_batch(mb, Mesh())
    for whole, part in zip(mb["mtp_labels"] + mb["model_inputs"]["mtp_inputs"],
                           local["mtp_labels"] + local["model_inputs"]["mtp_inputs"]):
        assert torch.equal(part, shard_sequence(whole, 2, 1))
    assert local["mtp_labels"][0].shape == (1, 8)


def test_the_mtp_objective_is_main_plus_weighted_mean_of_depth_losses():
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(2, 6, 11, generator=g) for _ in range(3)]
    labels = [torch.randint(0, 11, (2, 6), generator=g) for _ in range(3)]
    labels[2][0, :3] = IGNORE_INDEX
    total, terms = mtp_objective(2, 0.3)((logits[0], *logits[1:]), {"labels": labels[0], "mtp_labels": labels[1:]},
                                         cross_entropy_sum)

    def ce(x, y):
        return F.cross_entropy(x.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")

    want = ce(logits[0], labels[0]) + 0.3 / 2 * (ce(logits[1], labels[1]) + ce(logits[2], labels[2]))
    torch.testing.assert_close(total, want)
    assert set(terms) == {"mtp_loss_1", "mtp_loss_2"}
    torch.testing.assert_close(terms["mtp_loss_2"], ce(logits[2], labels[2]))
    assert mtp_objective(0, 0.3) is None and mtp_prepare_batch(0) is None
