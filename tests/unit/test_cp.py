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
@pytest.mark.parametrize("cp,ulysses", [(2, 2), (4, 4), (4, 2), (6, 3), (6, 2)])
def test_ulysses_and_hybrid_layout(cp, ulysses, load_balance):
    """cp rank r = outer * u + inner: the u inner ranks hold contiguous pieces of their outer rank's
    all-gather part (so an all-to-all over them reassembles it in order); Ulysses alone (u = cp)
    holds contiguous parts whatever cp_load_balance says; positions follow the tokens."""
    x = torch.arange(2 * 48).view(2, 48)
    parts = [shard_sequence(x, cp, r, load_balance, ulysses=ulysses) for r in range(cp)]
    assert torch.equal(unshard_sequence(parts, load_balance, ulysses=ulysses), x)
    for r, part in enumerate(parts):
        assert torch.equal(layout_positions(48, cp, r, load_balance, ulysses=ulysses), part[0])
        outer, inner = divmod(r, ulysses)
        outer_part = shard_sequence(x, cp // ulysses, outer, load_balance) if cp > ulysses else x
        assert torch.equal(part, outer_part.chunk(ulysses, dim=1)[inner])
    if cp == ulysses:
        assert torch.equal(parts[1], x[:, 48 // cp:2 * 48 // cp])


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

    with pytest.raises(ValueError, match=r"apply_cp found no attention module \(a subclass of trainlib.blocks.attention.Attention\)"):
        apply_cp(torch.nn.Sequential(torch.nn.Linear(4, 4)), TwoRankMesh())


# ---------------------------------------------------------------- config errors
def _validate(**overrides):
    from trainlib.config import load_job_config
    from trainlib.config.validate import validate_job
    from trainlib.models.llama3 import get_model_args
    from trainlib.models.registry import ResolvedModel, get_model_spec
    from trainlib.parallel import ParallelDims

    cfg = load_job_config(str(RECIPE), [f"--{k}={v}" for k, v in overrides.items()])
    p = cfg.parallelism
    dims = ParallelDims(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, pp=p.pp,
                        world_size=p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp,
                        cp_ulysses=p.ulysses_degree)
    validate_job(cfg, dims, ResolvedModel(get_model_spec("llama3"), get_model_args("debug")), 256)


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




def test_cp_method_errors():
    """One line each: an unknown method, hybrid's inner degree unset, not dividing cp, or set for another
    method; query heads per tp rank (debug: 4) not divisible by the all-to-all degree; seq_len not cut
    into the hybrid layout."""
    from trainlib.config import ConfigError

    cp4 = {"parallelism.cp": 4, "parallelism.dp_shard": 1}
    with pytest.raises(ConfigError, match=r"parallelism.cp_method: 'ulyses' is not one of 'allgather', 'ulysses', "
                                          r"'hybrid'.*did you mean 'ulysses'"):
        _validate(**{"parallelism.cp_method": "ulyses"})
    with pytest.raises(ConfigError, match=r"cp_method = 'hybrid' needs cp_ulysses, the inner all-to-all degree, "
                                          r"dividing cp \(4\); got unset; set cp_ulysses to one of \[1, 2, 4\]"):
        _validate(**cp4, **{"parallelism.cp_method": "hybrid"})
    with pytest.raises(ConfigError, match=r"dividing cp \(4\); got 3"):
        _validate(**cp4, **{"parallelism.cp_method": "hybrid", "parallelism.cp_ulysses": 3})
    with pytest.raises(ConfigError, match=r"parallelism.cp_ulysses \(2\) is the inner degree of cp_method = "
                                          r"'hybrid', but cp_method = 'allgather'"):
        _validate(**cp4, **{"parallelism.cp_ulysses": 2})
    with pytest.raises(ConfigError, match=r"cp_method = 'ulysses' splits each tp rank's query heads over the "
                                          r"all-to-all degree cp \(8\), but block 0 has n_heads / tp = 4 / 1 = 4, "
                                          r"not divisible by 8; set cp_method = 'hybrid' with cp_ulysses in \[2, 4\]"):
        _validate(**{"parallelism.cp": 8, "parallelism.dp_shard": 1, "parallelism.cp_method": "ulysses"})
    with pytest.raises(ConfigError, match=r"all-to-all degree cp_ulysses \(4\), but block 0 has n_heads / tp = "
                                          r"4 / 2 = 2, not divisible by 4; set cp_method = 'hybrid' with cp_ulysses "
                                          r"in \[2\]"):
        _validate(**{"parallelism.cp": 8, "parallelism.tp": 2, "parallelism.dp_shard": 1,
                     "parallelism.cp_method": "hybrid", "parallelism.cp_ulysses": 4})
    with pytest.raises(ConfigError, match=r"training.seq_len \(20\) must be divisible by 8 \(lcm of the 4 "
                                          r"all-gather chunks and cp = 8, hybrid layout\)"):
        _validate(**{"parallelism.cp": 8, "parallelism.dp_shard": 1, "parallelism.cp_method": "hybrid",
                     "parallelism.cp_ulysses": 4, "training.seq_len": 20})
    # what is allowed: KV heads (debug: 2) that cp does not divide are replicated, not refused
    _validate(**cp4, **{"parallelism.cp_method": "ulysses", "training.seq_len": 36})  # 36: not a multiple of 8
    _validate(**cp4, **{"parallelism.cp_method": "hybrid", "parallelism.cp_ulysses": 2})
