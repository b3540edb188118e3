"""Same seed, same global batch: FSDP and HSDP reproduce the single-process curve."""


from trainlib.parity import parse_layout


def test_parse_layout():
    nproc, args = parse_layout("dp_replicate=2,dp_shard=2,training.local_batch_size=1")
    assert nproc == 4
    assert "--training.local_batch_size=1" in args and "--parallelism.dp_shard=2" in args
    assert "--parallelism.tp=1" in args


