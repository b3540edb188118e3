"""The real CLI: torchrun end to end, and user errors as one clean line."""


import pytest


@pytest.mark.parametrize("args,expected", [
    (["--training.stesp=3"], "unknown key 'training.stesp' in --training.stesp; did you mean 'training.steps'?"),
    (["--training.tp=2"], "did you mean 'parallelism.tp'"),
    (["--training.steps", "1.5"], "training.steps: expected int, got '1.5'"),
    (["--parallelism.fsdp_reshard_after_forward=sometimes"], "'always'"),
    (["--recipe", "recipes/nope.toml"], "nope.toml"),
    (["--recipe"], "--recipe needs a file path"),
    (["--training.steps=0"], "training.steps must be >= 1"),
    (["--training.global_batch_size=5", "--training.local_batch_size=2"], "multiple of training.local_batch_size"),
])
def test_user_errors_are_one_line(capsys, tmp_path, args, expected):
    from trainlib.train import main

    assert main([*args, f"--job.dump_folder={tmp_path}"]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("trainlib: error:")]
    assert len(lines) == 1 and expected in lines[0], err[-2000:]


def test_help_lists_keys(capsys):
    from trainlib.train import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in ("training.global_batch_size", "parallelism.dp_shard", "metrics.log_freq", "job.dump_folder"):
        assert key in out


