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
    with pytest.raises(ValueError, match=rf"parallelism.{key} must be >= 1, got 0$"):
        ParallelDims(**{key: 0}, world_size=1)
    with pytest.raises(ValueError, match=r"parallelism.dp_shard must be >= 1 \(or -1 for 'all remaining ranks'\), got 0"):
        ParallelDims(dp_shard=0, world_size=1)


def test_meshes_need_build():
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(world_size=1).mesh("dp")
    assert ParallelDims(world_size=1).dp_coords() == (0, 1)




@pytest.mark.parametrize("value", [2.0, True, "2"])
def test_degrees_are_integers(value):
    # The recipe loader checks types first; ParallelDims is also built directly by custom loops.
    with pytest.raises(ValueError, match=rf"parallelism.tp must be an integer, got {value!r}"):
        ParallelDims(tp=value, world_size=2)


def test_from_config_and_enabled_axes():
    from trainlib.parallel.config import ParallelismConfig

    d = ParallelDims.from_config(ParallelismConfig(dp_replicate=2, dp_shard=-1, cp=2, tp=1, pp=2), world_size=16)
    assert d.degrees() == {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 1}
    assert (d.pp_enabled, d.cp_enabled, d.tp_enabled, d.hsdp_enabled, d.fsdp_enabled) == (True, True, False, True, True)
    one = ParallelDims(world_size=1)
    assert not (one.pp_enabled or one.cp_enabled or one.tp_enabled or one.hsdp_enabled or one.fsdp_enabled)


def test_build_mesh_needs_a_process_group_of_its_world_size():
    from trainlib.distributed import CommConfig, destroy_distributed, init_distributed

    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        ParallelDims(world_size=1).build_mesh("cpu")
    init_distributed(CommConfig(), "cpu")  # a world of one
    try:
        with pytest.raises(ValueError, match="built for world size 2, but the process group has 1 ranks"):
            ParallelDims(dp_shard=2, world_size=2).build_mesh("cpu")
    finally:
        destroy_distributed()


def test_ep_borrows_from_dp_shard_cp_tp_and_is_off_by_default():
    dims = ParallelDims(world_size=8, dp_shard=2, cp=2, tp=2, ep=4)
    assert (dims.efsdp, dims.ep_enabled) == (2, True) and dims.degrees()["ep"] == 4
    plain = ParallelDims(world_size=8)
    assert (plain.ep, plain.efsdp, plain.ep_enabled) == (1, 8, False) and "ep" not in plain.degrees()
    with pytest.raises(ValueError, match=r"^parallelism.ep \(3\) must divide dp_shard\(2\) \* cp\(1\) \* tp\(2\) = "
                                         r"4: expert parallel borrows its ranks from those axes .*; pick ep among "
                                         r"1, 2, 4 that also divides the model's number of experts$"):
        ParallelDims(world_size=4, dp_shard=2, tp=2, ep=3)
