import pytest

from trainlib.parallel import ParallelDims


def test_dp_shard_fills_remaining_ranks():
    d = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=16)
    assert d.dp_shard == 4 and d.dp == 8 and d.fsdp_enabled and d.hsdp_enabled and d.tp_enabled


def test_product_must_equal_world_size():
    with pytest.raises(ValueError, match=r"dp_replicate\(1\) \* dp_shard\(2\) \* cp\(1\) \* tp\(2\) \* pp\(1\) = 4 != world size 8"):
        ParallelDims(dp_shard=2, tp=2, world_size=8)


def test_remaining_ranks_must_divide():
    with pytest.raises(ValueError, match="not divisible"):
        ParallelDims(tp=3, world_size=8)


@pytest.mark.parametrize("key", ["tp", "cp", "pp", "dp_replicate"])
def test_degrees_positive(key):
    with pytest.raises(ValueError, match=f"parallelism.{key} must be >= 1"):
        ParallelDims(**{key: 0}, world_size=1)


def test_meshes_need_build():
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(world_size=1).mesh("dp")
    assert ParallelDims(world_size=1).dp_coords() == (0, 1)


