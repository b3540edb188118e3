"""The real CLI: torchrun end to end, and user errors as one clean line."""


import pytest


@pytest.mark.parametrize("args,expected", [
    (["--training.stesp=3"], "unknown key 'training.stesp' in --training.stesp; did you mean 'training.steps'?"),
    (["--training.tp=2"], "did you mean 'parallelism.tp'"),
    (["--training.steps", "1.5"], "training.steps: expected int, got '1.5'"),
    (["--parallelism.fsdp_reshard_after_forward=sometimes"], "'always'"),
    (["--recipe", "recipes/nope.toml"], "nope.toml"),
    (["--recipe"], "--recipe needs a recipe name or file path"),
    (["--recipe", "llama7b.toml"], "unknown recipe 'llama7b.toml'; did you mean 'llama70b'? shipped recipes: debug,"),
    (["--training.steps=0"], "training.steps must be >= 1"),
    (["--loss.chunk_tokens=-1"], "loss.chunk_tokens must be >= 1, or 0 for auto; got -1"),
    # Each section's own value rules (its config's __post_init__), one row per rule.
    (["--optimizer.lr=0"], "optimizer.lr must be > 0, got 0.0"),
    (["--optimizer.beta2=1"], "optimizer.beta2 must be in [0, 1), got 1.0"),
    (["--optimizer.weight_decay=-0.1"], "optimizer.weight_decay must be >= 0, got -0.1"),
    (["--lr_scheduler.warmup_steps=-1"], "lr_scheduler.warmup_steps must be >= 0, got -1"),
    (["--lr_scheduler.min_lr_ratio=1.5"], "lr_scheduler.min_lr_ratio must be in [0, 1], got 1.5"),
    (["--lr_scheduler.decay_ratio=0"], "lr_scheduler.decay_ratio must be in (0, 1], got 0.0"),
    (["--checkpoint.keep_latest_k=-1"], "checkpoint.keep_latest_k must be >= 0 (0 keeps all), got -1"),
    (["--checkpoint.load_step=-2"], "checkpoint.load_step must be a step >= 0 or -1 for the latest, got -2"),
    (["--checkpoint.enable=false", "--checkpoint.export_hf=true"],
     "checkpoint.export_hf = true needs checkpoint.enable = true"),
    (["--training.gc_freq=-1"], "training.gc_freq must be >= 0 (0 = automatic collection), got -1"),
    (["--comm.train_timeout_seconds=0"], "comm.train_timeout_seconds must be > 0 seconds, got 0.0"),
    (["--comm.backend=nccl", "--job.device=cpu"], "comm.backend = 'nccl' needs job.device = 'cuda'; use 'gloo' on CPU"),
    (["--float8.min_size=-1"], "float8.min_size must be >= 0 (or unset for the recipe's bound), got -1"),
    (["--parallelism.pp_microbatches=0"], "parallelism.pp_microbatches must be >= 1 (or unset for the default)"),
    (["--parallelism.dp_shard=1", "--parallelism.tp=2"],
     "dp_replicate(1) * dp_shard(1) * cp(1) * tp(2) * pp(1) = 2 != world size 1"),
    (["--parallelism.dp_shard=-1", "--parallelism.tp=2"], "world size 1 is not divisible by dp_replicate(1) * "),
    (["--profiling.profile_freq=5", "--profiling.profile_warmup=3", "--profiling.profile_active=3"],
     "profiling.profile_warmup (3) + profile_active (3) must fit in profile_freq (5) steps"),
    (["--data.prefetch=-1"], "data.prefetch=-1 must be >= 0 (0 builds batches in the loop)"),  # raw data too
    (["--data.shuffle_buffer_size=0"], "data.shuffle_buffer_size=0 must be >= 1"),
    (["--watchdog.step_factor=1"], "watchdog.step_factor must be > 1 (a multiple of the median step time), got 1.0"),
    (["--watchdog.min_seconds=0"], "watchdog.min_seconds must be > 0, got 0.0"),
    (["--watchdog.min_seconds=150"], "watchdog.min_seconds (150) must be below half of comm.train_timeout_seconds (300)"),
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


def test_help_describes_every_key():
    """Every recipe key's --help line ends in its help text (`field(metadata={"help": ...})`): a key added
    without one fails here, naming it."""
    import re

    from trainlib.config.job import JobConfig
    from trainlib.config.loader import describe

    lines = describe(JobConfig).splitlines()
    assert len(lines) > 100  # every section's keys, nested ones (validation.data.*) included
    line_re = re.compile(r"(?P<key>[a-z_][a-z0-9_.]*) = .+?  # (?P<type>[^;]+?)(?:; (?P<help>.*))?")
    bad = [line for line in lines if not line_re.fullmatch(line)]
    assert not bad, f"lines that do not read 'section.key = default  # type; help': {bad}"
    missing = [m["key"] for m in map(line_re.fullmatch, lines) if not (m["help"] or "").strip()]
    assert not missing, f"recipe keys without help (add metadata={{'help': ...}} to the field): {missing}"




def test_one_parser_for_every_tool_set_alias_and_tool_flags():
    from trainlib.config.cli import RecipeArgumentParser

    p = RecipeArgumentParser("tool")
    p.add_argument("--world-size", type=int)
    p.add_argument("--layouts", nargs="+")
    ns, overrides = p.parse_recipe_args([
        "--recipe", "r.toml", "--training.steps", "7", "--world-size", "8", "--set", "optimizer.lr=0.1",
        "--layouts", "tp=2", "dp_shard=2", "--model.flavor=debug", "--set=--training.seed=3"])
    assert (ns.recipe, ns.world_size, ns.layouts) == ("r.toml", 8, ["tp=2", "dp_shard=2"])
    # --set is an alias: both forms come back normalised, in command-line order per form.
    assert overrides == ["--optimizer.lr=0.1", "--training.seed=3", "--training.steps=7", "--model.flavor=debug"]


@pytest.mark.parametrize("argv,expected", [
    (["--world-size", "x"], "argument --world-size: invalid int value: 'x'"),
    (["--set", "training.steps"], "expected SECTION.KEY=VALUE"),
    (["stray"], "bad override 'stray'"),
    (["--training.steps"], "override --training.steps has no value"),
])
def test_parser_errors_are_one_line_config_errors(argv, expected):
    from trainlib.config import ConfigError
    from trainlib.config.cli import RecipeArgumentParser

    p = RecipeArgumentParser("tool")
    p.add_argument("--world-size", type=int)
    with pytest.raises(ConfigError, match=expected) as e:
        p.parse_recipe_args(argv)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv,expected", [
    (["--layouts", "dp_shard=2", "--trainig.steps=1"], "did you mean 'training.steps'"),
    (["--steps", "2"], "the following arguments are required: --layouts"),
    (["--layouts", "dp_shard"], "layout item 'dp_shard' in 'dp_shard' is not key=value"),
    (["--layouts", "tp=x"], "tp=x must be a whole number >= 1"),
    (["--layouts", "tp=2,float8.recipe=fast"], "float8.recipe: 'fast' is not one of"),
    (["--layouts", "tp=2", "--set", "training.seed"], "expected SECTION.KEY=VALUE"),
    (["--layouts", "tp=2", "--recipe", "recipes/nope.toml"], "nope.toml"),
])
def test_parity_user_errors_are_one_line_before_any_run(capsys, argv, expected, monkeypatch):
    import trainlib.parity

    def no_runs(*a, **k):
        raise AssertionError("a layout ran although the input was bad")

    monkeypatch.setattr(trainlib.parity, "run_layout", no_runs)
    assert trainlib.parity.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainlib: error: ") and expected in err[0], err


@pytest.mark.parametrize("tool,own_flags", [("trainlib.parity", ["--layouts", "tp=2"]),
                                            ("trainlib.checkpoint.bench", ["--model", "debug"])])
def test_tools_share_the_grammar(capsys, tool, own_flags):
    import importlib

    main = importlib.import_module(tool).main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--recipe NAME|FILE" in out and "--set SECTION.KEY=VALUE" in out
    assert main([*own_flags, "--training.stesp=3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "trainlib: error: unknown key 'training.stesp' in --training.stesp; did you mean 'training.steps'?")


# torch made unimportable: any import of it in the child raises ImportError, so these fail if a tool reads
# its command line only after torch is imported (5-18 s of `import torch` and friends on a loaded machine).
_WITHOUT_TORCH = ("import runpy, sys\n"
                  "sys.modules['torch'] = None\n"
                  "sys.argv = [sys.argv[0], *sys.argv[1:]]\n"
                  "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n")


def _run_without_torch(tool: str, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, tool, *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("tool", ["trainlib.train", "trainlib.plan", "trainlib.parity"])
def test_help_is_answered_without_importing_torch(tool):
    proc = _run_without_torch(tool, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr[-3000:]
    if tool == "trainlib.train":  # the epilog: every recipe key, with its help (test_help_describes_every_key)
        from trainlib.config.job import JobConfig
        from trainlib.config.loader import describe

        assert describe(JobConfig) in proc.stdout


@pytest.mark.parametrize("args,expected", [
    (["--training.stesp=3"], "trainlib: error: unknown key 'training.stesp' in --training.stesp; did you mean "
                             "'training.steps'?"),
    (["--optimizer.lr=inf"], "trainlib: error: optimizer.lr"),
    (["--model.flavor=llama3.1_8"], "did you mean 'llama3.1_8b'?"),
])
def test_a_refused_command_line_is_answered_without_importing_torch(args, expected):
    proc = _run_without_torch("trainlib.train", *args)
    assert proc.returncode == 2 and expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr[-3000:]


def test_list_recipes_is_answered_without_importing_torch():
    proc = _run_without_torch("trainlib.train", "--list-recipes")
    assert proc.returncode == 0 and "debug" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("tool,args", [("trainlib.train", ["--help"]), ("trainlib.plan", ["--help"]),
                                       ("trainlib.train", ["--list-recipes"])])
def test_help_read_by_head_exits_quietly(tool, args):
    # issue 54 item 8: `python -m trainlib.train --help | head` ended in a BrokenPipeError traceback
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", tool, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(6) == b"usage:" or args == ["--list-recipes"]
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and err == "", err


def test_the_launcher_refuses_a_recipe_and_answers_help_without_importing_torch():
    # issue 54 item 7: python -m trainlib.launch checks the recipe before torch (and torchrun) is imported
    proc = _run_without_torch("trainlib.launch", "--nproc-per-node=2", "--recipe", "debug", "--training.stesp=3")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "trainlib: error: unknown key 'training.stesp' in --training.stesp; did you mean 'training.steps'?"], \
        proc.stderr[-3000:]
    proc = _run_without_torch("trainlib.launch", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m trainlib.launch"), proc.stderr[-3000:]
