"""Honest errors, in-process through `trainlib.train.main`: every user-input
error is one line and exit 2; anything else keeps its traceback (exit 1)."""

import json
import shutil

import pytest
import torch

from trainlib.train import main

# (what, recipe file text or None, overrides, expected in the one line)
MOE = ["--model.name=qwen3_moe", "--model.flavor=debug_moe"]
BAD_INPUT = [
    ("misspelled key", None, ["--training.stesp=3"], "did you mean 'training.steps'?"),
    ("unknown section", None, ["--trainig.steps=3"], "trainig"),
    ("key is a section", None, ["--training=3"], "training"),
    ("value used as a section", None, ["--training.steps.max=3"], "is a value, not a section"),
    ("not an int", None, ["--training.steps=ten"], "training.steps: expected int, got 'ten'"),
    ("int with a fraction", None, ["--training.steps=1.5"], "expected int, got '1.5'"),
    ("not a float", None, ["--optimizer.lr=fast"], "optimizer.lr: expected float"),
    ("not a bool", None, ["--checkpoint.enable=maybe"], "checkpoint.enable: expected bool"),
    ("negative size", None, ["--training.global_batch_size=-4"], "training.global_batch_size must be >= 1"),
    ("zero length", None, ["--training.seq_len=0"], "training.seq_len must be >= 1"),
    ("bad enum", None, ["--training.on_nonfinite=ignore"], "'ignore' is not one of 'stop', 'skip', 'rollback'"),
    ("bad enum, close", None, ["--optimizer.implementation=fusedd"], "did you mean 'fused'?"),
    ("unknown flavor", None, ["--model.flavor=llama3.1_9b"], "unknown model.flavor 'llama3.1_9b'"),
    ("unknown model", None, ["--model.name=gpt5"], "unknown model.name 'gpt5'"),
    ("unknown recipe name", None, ["--recipe", "llama7b"], "unknown recipe 'llama7b'"),
    ("missing recipe file", None, ["--recipe", "/nonexistent/r.toml"], "recipe file not found: /nonexistent/r.toml"),
    ("--recipe without a value", None, ["--recipe"], "--recipe needs a recipe name or file path"),
    ("override without a value", None, ["--training.steps"], "override --training.steps has no value"),
    ("stray word", None, ["steps=3"], "bad override 'steps=3'"),
    ("--set without =", None, ["--set", "training.steps"], "expected SECTION.KEY=VALUE"),
    ("degrees != world size", None, ["--parallelism.tp=2", "--parallelism.dp_shard=1"], "= 2 != world size 1"),
    ("more processes than launched", None, ["--parallelism.tp=2", "--parallelism.dp_shard=4"],
     "e.g. torchrun --nproc-per-node=8 -m trainlib.train"),
    ("lr inf", None, ["--optimizer.lr=inf"], "optimizer.lr: must be a finite number, got inf"),
    ("weight decay nan", "[optimizer]\nweight_decay = nan\n", [], "optimizer.weight_decay: must be a finite number"),
    ("negative eps", None, ["--optimizer.eps=-1e-8"], "optimizer.eps must be > 0"),
    ("infinite timeout", None, ["--comm.train_timeout_seconds=inf"], "comm.train_timeout_seconds: must be a finite"),
    ("infinite watchdog", "[watchdog]\nmin_seconds = inf\n", [], "watchdog.min_seconds: must be a finite"),
    ("dp_shard=-1 cannot fill", None, ["--parallelism.tp=3"], "world size 1 is not divisible"),
    ("negative degree", None, ["--parallelism.pp=-2"], "parallelism.pp must be >= 1"),
    ("batch split", None, ["--training.global_batch_size=5", "--training.local_batch_size=2"],
     "multiple of training.local_batch_size"),
    ("lr 0", None, ["--optimizer.lr=0"], "optimizer.lr must be > 0"),
    ("beta out of range", None, ["--optimizer.beta1=1.5"], "optimizer.beta1 must be in [0, 1)"),
    ("interval 0", None, ["--checkpoint.interval=0"], "checkpoint.interval must be >= 1"),
    ("log_freq 0", None, ["--metrics.log_freq=0"], "metrics.log_freq must be >= 1"),
    ("rollback without checkpoints", None, ["--training.on_nonfinite=rollback"], "checkpoint.enable is false"),
    ("spike factor", None, ["--training.spike_factor=0.5"], "training.spike_factor must be > 1"),
    ("model too small for the tokenizer", None, ["--model.vocab_size=100"], "tokenizer vocabulary (258) is larger"),
    ("zero layers", None, ["--model.n_layers=0"], "model.n_layers must be >= 1"),
    ("missing data file", None, ["--data.path=/nonexistent/x.jsonl"], "data.path='/nonexistent/x.jsonl' does not exist"),
    ("hf tokenizer without a path", None, ["--tokenizer.kind=hf"], "tokenizer.path is required"),
    ("missing tokenizer file", None, ["--tokenizer.kind=tiktoken", "--tokenizer.path=/nonexistent/t.model"],
     "does not exist or is not a file"),
    ("nccl on CPU", None, ["--comm.backend=nccl", "--job.device=cpu"], "comm.backend = 'nccl' needs job.device"),
    ("export without checkpoints", None, ["--checkpoint.export_hf=true"], "needs checkpoint.enable = true"),
    ("no such checkpoint step", None, ["--checkpoint.enable=true", "--checkpoint.load_step=5"],
     "checkpoint.load_step=5 has no complete checkpoint"),
    ("bad float8 recipe", None, ["--float8.recipe=fast"], "float8.recipe: 'fast' is not one of"),
    ("TOML syntax", "[training\nsteps = 3\n", [], "invalid TOML in"),
    ("unknown section in a file", "[trainer]\nsteps = 3\n", [], "trainer"),
    ("misspelled key in a file", "[optimizer]\nlearning_rate = 1e-3\n", [], "optimizer.learning_rate"),
    ("string for an int", '[training]\nsteps = "ten"\n', [], "training.steps: expected int"),
    ("float for an int", "[training]\nsteps = 2.5\n", [], "training.steps: expected int"),
    ("array for a scalar", "[training]\nseed = [1, 2]\n", [], "training.seed: expected int"),
    ("missing extends target", 'extends = "nope.toml"\n', [], "nope.toml (extended from"),
    ("extends of a bad type", "extends = 3\n", [], "extends in"),
    ("extends cycle", 'extends = "recipe.toml"\n', [], "extends cycle"),
    ("not UTF-8", b"[training]\nsteps = 3 # \xff\xfe\n", [], "is not UTF-8 text"),
    ("MoE key on a dense model", None, ["--moe.z_loss_coef=0.01"], "moe.z_loss_coef set, but llama3 debug has no MoE"),
    ("MoE balance method", None, ["--moe.load_balance=aux"], "'aux' is not one of 'bias', 'none'"),
    ("negative capacity", None, MOE + ["--moe.capacity_factor=-1"], "moe.capacity_factor must be > 0"),
    ("zero capacity", "[moe]\ncapacity_factor = 0\n", MOE, 'for no limit set moe.capacity_factor = "dropless"'),
    ("capacity word", None, MOE + ["--moe.capacity_factor=none"], "moe.capacity_factor: expected float | Literal"),
    ("negative global aux", None, MOE + ["--moe.global_aux_loss_coef=-1"], "moe.global_aux_loss_coef must be >= 0"),
    ("float8 grouped experts on CPU", None, MOE + ["--float8.enable=true", "--float8.moe_experts=true"],
     "float8.moe_experts = true needs CUDA"),
]


@pytest.mark.parametrize("what,text,overrides,expected", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, what, text, overrides, expected):
    args = []
    if text is not None:
        recipe = tmp_path / "recipe.toml"
        (recipe.write_bytes if isinstance(text, bytes) else recipe.write_text)(text)
        args = ["--recipe", str(recipe)]
    assert main([*args, *overrides, f"--job.dump_folder={tmp_path / 'run'}", "--metrics.console=false"]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and out.err.startswith("trainlib: error: "), out.err[-3000:]
    assert expected in out.err, out.err
    assert "Traceback" not in out.err + out.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
def test_cuda_device_without_cuda_is_one_line_and_exit_2(capsys, tmp_path):
    # One short step: were job.device ignored, the run would train rather than fail quickly.
    args = ["--job.device=cuda", "--training.steps=1", "--training.seq_len=32", "--metrics.console=false"]
    assert main([*args, f"--job.dump_folder={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err == "trainlib: error: job.device = 'cuda' but no CUDA device is visible; use 'cpu' or 'auto'\n", err


@pytest.mark.parametrize("key", ["job.dump_folder", "checkpoint.folder"])
def test_a_folder_that_cannot_be_made_is_one_line_at_start_up(capsys, tmp_path, key):
    """A file where the run folder (or the checkpoint folder, or a parent) should be: refused before the
    first step, not at the first save."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    folders = {"job.dump_folder": str(tmp_path / "run"), "checkpoint.folder": "checkpoint",
               key: str(blocker / "sub")}
    args = [f"--job.dump_folder={folders['job.dump_folder']}", f"--checkpoint.folder={folders['checkpoint.folder']}",
            "--checkpoint.enable=true", "--training.steps=1", "--metrics.console=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == f"trainlib: error: {key} = '{blocker / 'sub'}': {blocker} is a file, not a folder; pick another path\n"
    assert blocker.read_text() == "not a folder"


def test_there_are_at_least_30_cases():
    assert len(BAD_INPUT) >= 30


@pytest.mark.parametrize("error", [ValueError("a bug, not the user's input"), RuntimeError("a broken machine")])
def test_internal_error_keeps_its_traceback(capsys, tmp_path, monkeypatch, error):
    from trainlib.models.llama3 import Transformer

    def forward(self, tokens, *args, **kwargs):
        raise error

    monkeypatch.setattr(Transformer, "forward", forward)
    run = tmp_path / "run"
    assert main(["--training.steps=2", "--training.seq_len=32", f"--job.dump_folder={run}"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[rank 0] Traceback (most recent call last):"
    assert all(line.startswith("[rank 0] ") for line in err)
    assert f"[rank 0] {type(error).__name__}: {error}" in err
    assert err[-1] == f"[rank 0] trainlib: internal error on rank 0 (also in {run}/errors/rank0.txt)"
    assert "trainlib: error:" not in "\n".join(err)
    saved = (run / "errors" / "rank0.txt").read_text()
    assert "in forward_backward" in saved and f"{type(error).__name__}: {error}" in saved


def test_torch_value_error_in_setup_is_not_a_user_error(capsys, tmp_path, monkeypatch):
    # Before, any ValueError raised during setup became "trainlib: error: ..." and lost its traceback.
    import trainlib.train as tt

    monkeypatch.setattr(tt, "build_optimizer", lambda parts, cfg, *copies: torch.optim.AdamW([], lr=1e-3))
    assert main(["--training.steps=1", f"--job.dump_folder={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "[rank 0] ValueError: optimizer got an empty parameter list" in err
    assert "[rank 0] Traceback" in err and "in setup" in err and "trainlib: error:" not in err


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory):
    from trainlib.data.prepare import prepare

    src = tmp_path_factory.mktemp("src") / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "x" * 40}) + "\n" for i in range(50)))
    out = tmp_path_factory.mktemp("prepared") / "p"
    prepare(str(out), [str(src)], progress=False)
    return out


@pytest.mark.parametrize("damage,overrides,expected", [
    ("truncate", [], "the folder is damaged"),
    ("other tokenizer", [], "another tokenizer than this run's"),
    ("manifest cut", [], "manifest.json is damaged (Unterminated string"),
    (None, ["--training.seq_len=100000"], "training.seq_len=100000 needs windows of 100001 tokens"),
    (None, ["--data.mixture=['{dir}:0']"], "sum to 0"),
])
def test_bad_prepared_data_is_one_line_and_exit_2(capsys, tmp_path, prepared_dir, damage, overrides, expected):
    """Prepared-data refusals are user errors too (issue 12): one line, exit 2."""
    folder = tmp_path / "p"
    shutil.copytree(prepared_dir, folder)
    if damage == "truncate":
        shard = sorted((folder / "shards").glob("*.tokens"))[0]
        shard.write_bytes(shard.read_bytes()[:10])
    if damage == "manifest cut":  # a copy or an editor cut it short
        (folder / "manifest.json").write_bytes((folder / "manifest.json").read_bytes()[:100])
    if damage == "other tokenizer":  # as if prepared with a tokenizer.json of another vocabulary
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["tokenizer"].update(kind="hf", file_sha256="0" * 64, vocab_size=32000)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    args = [o.format(dir=folder) for o in overrides]
    if not any(a.startswith("--data.mixture") for a in args):
        args.append(f"--data.path={folder}")
    assert main([*args, "--training.steps=1", f"--job.dump_folder={tmp_path / 'run'}", "--metrics.console=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainlib: error: ") and expected in err, err[-3000:]


def test_user_error_is_said_once_per_node_and_message_and_named_to_torchrun(capsys, tmp_path, monkeypatch):
    from trainlib.errors import ConfigError, report_user_error

    def worker(local_rank, exc):  # a torchrun worker of this node's attempt 0 (its error-file layout)
        error_file = tmp_path / "run-id" / "attempt_0" / str(local_rank) / "error.json"
        error_file.parent.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        report_user_error(exc)
        return json.loads(error_file.read_text())["message"]["message"], capsys.readouterr().err

    same, line = ConfigError("every rank's recipe is bad"), "trainlib: error: every rank's recipe is bad"
    assert worker(2, same) == (line, line + "\n")  # the first of the node to get here says it
    assert worker(0, same) == (line, "")  # said already on this node; torchrun still gets it
    own = ConfigError("a file missing on rank 3's node")
    assert worker(3, own)[1] == "trainlib: error: a file missing on rank 3's node\n"  # another message: said too
    # Without torchrun's folder (another launcher): local rank 0 speaks for the node.
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    for local_rank, said in ((1, ""), (0, "trainlib: error: x\n")):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        report_user_error(ConfigError("x"))
        assert capsys.readouterr().err == said


def _raised(exc):
    try:
        raise exc
    except type(exc) as e:
        return e


def test_the_second_failing_rank_of_a_node_says_one_line_naming_its_file(capsys, tmp_path, monkeypatch):
    from trainlib.errors import report_crash

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two workers of one launch on this node
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        report_crash(_raised(RuntimeError(f"rank {rank} broke")), tmp_path)
    *first, second = capsys.readouterr().err.splitlines()
    assert first[0] == "[rank 0] Traceback (most recent call last):" and first[-1] == \
        f"[rank 0] trainlib: internal error on rank 0 (also in {tmp_path}/errors/rank0.txt)"
    assert second == (f"[rank 1] trainlib: rank 1 failed too: RuntimeError: rank 1 broke; traceback in "
                      f"{tmp_path}/errors/rank1.txt")
    assert "RuntimeError: rank 1 broke" in (tmp_path / "errors" / "rank1.txt").read_text()


def test_a_crash_before_the_run_folder_exists_prints_its_whole_traceback(capsys, monkeypatch):
    from trainlib.errors import report_crash

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    report_crash(_raised(RuntimeError("early")), None)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[rank 0] Traceback (most recent call last):" and "[rank 0] RuntimeError: early" in err
    assert err[-1] == "[rank 0] trainlib: internal error on rank 0"  # no file named


def test_a_config_error_is_one_line_whatever_its_message():
    from trainlib.errors import ConfigError

    assert str(ConfigError("model.dim (7)\n   must be even;\r\n  set it to 8 ")) == \
        "model.dim (7) must be even; set it to 8"


def test_verdict_lines_of_a_stop_and_a_preemption_are_said_by_local_rank_0(capsys, monkeypatch):
    from trainlib.errors import Preempted, TrainingStopped, print_once_per_node, verdict_line

    preempted = Preempted(4)
    assert preempted.step == 4  # what a caller restarting the job reads
    assert verdict_line(preempted) == ("trainlib: preempted: SIGTERM or SIGUSR1: stopped after step 4, its "
                                       "checkpoint is saved; launch the same command again to continue")
    assert verdict_line(Preempted(5, interrupted=True, saved=False)) == (
        "trainlib: preempted: Ctrl-C: stopped after step 5, no checkpoint was saved (checkpoint.enable is false), "
        "so a new launch starts from step 0")  # it said "saved" with checkpoints off
    assert verdict_line(TrainingStopped("step 3: loss is nan")) == "trainlib: stopped: step 3: loss is nan"
    for local_rank, said in (("1", ""), ("0", "a verdict\n")):  # every rank reaches it alike: one copy a node
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        print_once_per_node("a verdict")
        assert capsys.readouterr().err == said


def test_a_crash_is_named_in_torchruns_summary_with_its_traceback_file(capsys, tmp_path, monkeypatch):
    from trainlib.errors import report_crash

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    report_crash(_raised(RuntimeError("broke")), tmp_path / "run")
    assert json.loads(error_file.read_text())["message"]["message"] == \
        f"RuntimeError: broke (traceback: {tmp_path}/run/errors/rank0.txt)"
    error_file.unlink()
    report_crash(_raised(RuntimeError("early")), None)  # no traceback file to name: left to torchrun
    assert not error_file.exists()


def test_every_float_key_of_the_job_refuses_inf_and_nan():
    """The finite rule is the loader's, so it holds for every float key, present and future."""
    import dataclasses
    import typing

    from trainlib.config.job import JobConfig
    from trainlib.config.loader import load_recipe
    from trainlib.errors import ConfigError

    def float_keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                yield from float_keys(tp, f"{prefix}{f.name}.")
            elif tp is float or float in typing.get_args(tp):
                yield prefix + f.name

    keys = list(float_keys(JobConfig))
    assert len(keys) >= 12 and "optimizer.lr" in keys and "comm.train_timeout_seconds" in keys, keys
    for key in keys:
        for text in ("inf", "nan"):
            # a list of floats (optimizer.muon.ns_coefficients) names the element: key[0]
            with pytest.raises(ConfigError, match=rf"^{key}(\[0\])?: must be a finite number"):
                load_recipe(JobConfig, None, [f"--{key}={text}"])


_RECORDS = [json.dumps({"text": f"document {i} " + "x" * 60}) + "\n" for i in range(40)]


@pytest.mark.parametrize("name,content,overrides,expected", [
    ("data.jsonl", "".join(_RECORDS[:20]).encode() + b'{"text": "a \xff byte"}\n' + "".join(_RECORDS[20:]).encode(),
     [], "data.jsonl line 21 is not UTF-8 text; fix or remove it"),
    ("data.jsonl", ("".join(_RECORDS) + _RECORDS[0][:12]).encode(), [],
     "data.jsonl line 41 is not a JSON record (cut mid-write?); fix or remove it"),
    ("tokenizer.json", b'{"model": {"type": "BPE", "vocab": {', ["--tokenizer.kind=hf"],
     "is not a tokenizer.json (damaged or another file"),
    ("tokenizer.model", b"aGVsbG8= 0\n!!notbase64 1\n", ["--tokenizer.kind=tiktoken"],
     "line 2 is not '<base64 token> <rank>' (damaged?)"),
], ids=["not UTF-8", "record cut mid-write", "tokenizer.json cut", "tiktoken line damaged"])
def test_a_damaged_data_or_tokenizer_file_is_one_line_naming_it(capsys, tmp_path, name, content, overrides,
                                                               expected):
    bad = tmp_path / name
    bad.write_bytes(content)
    key = "--data.path" if name.endswith(".jsonl") else "--tokenizer.path"
    # 4 steps: the byte that is not UTF-8 is found when its record is read (step 3), the rest at start-up
    args = [*overrides, f"{key}={bad}", "--training.steps=4", "--training.seq_len=32",
            f"--job.dump_folder={tmp_path / 'run'}", "--metrics.console=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainlib: error: ") and expected in err, err[-3000:]


def test_a_data_file_named_with_glob_characters_is_read_as_named(capsys, tmp_path):
    """`[1]` in an existing file's name is no pattern: before, the literal file "matched no files" in
    trainlib and then again in `datasets`, which expands data_files as globs."""
    data = tmp_path / "part[1].jsonl"
    data.write_text("".join(_RECORDS))
    assert main([f"--data.path={data}", "--training.steps=1", "--training.seq_len=32",
                 f"--job.dump_folder={tmp_path / 'run'}", "--metrics.console=false"]) == 0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(metrics[-1])["step"] == 1


def test_a_datasets_cache_that_cannot_be_written_is_one_line(capsys, tmp_path, monkeypatch):
    """`datasets` makes its cache folder even to stream local files: with a read-only HOME that was a
    traceback from inside `datasets`. (A file in the way stands in for the read-only folder: root may
    write anywhere.)"""
    import datasets

    blocker = tmp_path / "home"
    blocker.write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", blocker / ".cache" / "datasets")
    assert main(["--training.steps=1", f"--job.dump_folder={tmp_path / 'run'}", "--metrics.console=false"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainlib: error: the datasets cache (HF_DATASETS_CACHE) = ")
    assert f"{blocker} is a file, not a folder" in err, err


def test_a_job_bigger_than_the_machine_is_refused_before_it_allocates(capsys, tmp_path, monkeypatch):
    """seq_len 1,000,000 on the debug model (~370 GiB) was killed by the kernel without a word."""
    args = ["--training.steps=1", f"--job.dump_folder={tmp_path / 'run'}", "--metrics.console=false"]
    assert main([*args, "--training.seq_len=1000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainlib: error: this job needs about "), err
    assert "GiB per rank at its peak (trainlib.plan's estimate: activations " in err and "16 x 1000000 tokens" in err
    # What the rank has decides, and job.check_memory=false lets the job try anyway.
    import trainlib.plan.core as plan_core

    monkeypatch.setattr(plan_core, "available_bytes", lambda device: (2**20, "a 1 MiB test machine"))
    assert main([*args, "--training.seq_len=32"]) == 2
    assert "and this rank has 0.0 GiB (a 1 MiB test machine)" in capsys.readouterr().err
    assert main([*args, "--training.seq_len=32", "--job.check_memory=false"]) == 0
