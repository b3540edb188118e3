"""Context parallel: layout helpers, attention vs plain SDPA on gloo ranks, config errors, parity."""

import pytest
import torch

from tests.helpers import RECIPES
from trainlib.parallel.cp import (
    chunk_ids,
    layout_positions,
    shard_sequence,
    unshard_sequence,
)

RECIPE = RECIPES / "debug.toml"

@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_round_trip(cp, load_balance):
    x = torch.arange(2 * 24).view(2, 24)
    parts = [shard_sequence(x, cp, r, load_balance) for r in range(cp)]
    assert torch.equal(unshard_sequence(parts, load_balance), x)
    # positions follow the same layout as the tokens
    for r, part in enumerate(parts):
        assert torch.equal(layout_positions(24, cp, r, load_balance), part[0])


def test_load_balanced_causal_work_is_equal():
    cp, s = 4, 64
    assert chunk_ids(cp, 0) == [0, 2 * cp - 1]
    work = []
    for r in range(cp):
        # causal pairs (query, key<=query) owned by rank r
        work.append(sum(int(p) + 1 for p in layout_positions(s, cp, r)))
    assert len(set(work)) == 1, work


def test_shard_rejects_indivisible_length():
    with pytest.raises(ValueError, match="not divisible by 4 chunks"):
        shard_sequence(torch.zeros(1, 10), 2, 0)


def test_apply_cp_refuses_a_model_without_attention():
    # A custom model whose attention does not expose `sdpa` would otherwise attend only
    # within each rank's own sequence chunks: wrong, without a word.
    from trainlib.parallel.cp import apply_cp

    class TwoRankMesh:  # what apply_cp reads of a DeviceMesh
        def size(self):
            return 2

        def get_local_rank(self):
            return 0

        def get_group(self):
            return None

    with pytest.raises(ValueError, match=r"apply_cp found no attention module \(a subclass of trainlib.models.layers.Attention\)"):
        apply_cp(torch.nn.Sequential(torch.nn.Linear(4, 4)), TwoRankMesh())


# ---------------------------------------------------------------- config errors
def _validate(**overrides):
    from trainlib.config import load_job_config
    from trainlib.config.validate import validate_job
    from trainlib.models.llama3 import get_model_args
    from trainlib.parallel import ParallelDims

    cfg = load_job_config(str(RECIPE), [f"--{k}={v}" for k, v in overrides.items()])
    p = cfg.parallelism
    dims = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, pp=p.pp,
                        world_size=p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp)
    validate_job(cfg, dims, get_model_args("debug"), 256)


def test_seq_len_must_split_into_2cp_chunks():
    from trainlib.config import ConfigError

    with pytest.raises(ConfigError, match=r"training.seq_len \(100\) must be divisible by 2 \* cp = 8 "
                                          r"\(load-balanced layout\).*set training.seq_len to 96"):
        _validate(**{"parallelism.cp": 4, "parallelism.dp_shard": 1, "training.seq_len": 100})
    with pytest.raises(ConfigError, match=r"divisible by cp = 3 for context parallelism"):
        _validate(**{"parallelism.cp": 3, "parallelism.dp_shard": 1, "training.seq_len": 100,
                     "training.global_batch_size": 3, "parallelism.cp_load_balance": "false"})
    _validate(**{"parallelism.cp": 4, "parallelism.dp_shard": 1, "training.seq_len": 104})  # 104 = 13 * 8
    _validate(**{"training.seq_len": 255})  # no context parallelism: any length, odd included


