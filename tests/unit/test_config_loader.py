"""Unit tests for trainlib.config.loader (stdlib only; no torch)."""
import dataclasses
import importlib.util
import math
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the tomli backport, a dependency there
    import tomli as tomllib

# Load loader.py by path rather than via ``trainlib.config``: the package
# __init__ pulls in the full job schema (and through it torch-using modules),
# while this module is meant to be stdlib-only and these tests torch-free.
_LOADER_PATH = Path(__file__).resolve().parents[2] / "trainlib" / "config" / "loader.py"
_spec = importlib.util.spec_from_file_location("_trainlib_config_loader", _LOADER_PATH)
loader = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = loader  # dataclasses/typing look modules up by name
_spec.loader.exec_module(loader)

ConfigError, closest_key, config_to_dict = loader.ConfigError, loader.closest_key, loader.config_to_dict
describe, dumps_toml, load_recipe = loader.describe, loader.dumps_toml, loader.load_recipe
load_toml_with_extends, parse_overrides = loader.load_toml_with_extends, loader.parse_overrides
save_config = loader.save_config


# ------------------------------------------------------------------ test schema
@dataclass
class JobSection:
    name: str = "run"
    dump_folder: str = "./outputs"


@dataclass
class TrainingConfig:
    steps: int = field(default=10, metadata={"help": "number of optimizer steps"})
    seed: int = 0
    lr: float = 3e-4
    compile: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    tokenizer_path: Optional[str] = None
    warmup: int | None = 5
    layers_per_stage: list[int] | None = None
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    tags: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.steps < 1:
            raise ConfigError(f"training.steps must be >= 1, got {self.steps}; "
                              "set it to a positive step count")
        if self.seed < 0:  # message deliberately lacks the section name, and spans lines
            raise ConfigError("seed must be non-negative\nuse 0 or more")


@dataclass
class ParallelismConfig:
    tp: int = 1
    pp: int = 1
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B"] = "1F1B"


@dataclass
class AttentionConfig:
    n_heads: int = 8
    rope_theta: float = 10000.0


@dataclass
class ModelConfig:
    dim: int = 256
    attention: AttentionConfig = field(default_factory=AttentionConfig)


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(dim=512))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def err(fn, *args, **kwargs) -> str:
    """Run fn expecting ConfigError; return its (checked single-line) message."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and "\r" not in msg, msg
    assert isinstance(info.value, ValueError)
    return msg


# ------------------------------------------------------------------- basics
def test_defaults_without_file():
    cfg = load_recipe(JobConfig, None)
    assert cfg == JobConfig()
    assert cfg.model.dim == 512  # custom default_factory value is kept


def test_toml_values_are_loaded_and_typed(tmp_path):
    p = write(tmp_path / "r.toml", """
        [training]
        steps = 100
        lr = 1
        compile = true
        dtype = "bfloat16"
        tokenizer_path = "tok.model"
        layers_per_stage = [2, 3]
        betas = [1, 0.5]
        [model.attention]
        n_heads = 16
    """)
    cfg = load_recipe(JobConfig, p)
    t = cfg.training
    assert (t.steps, t.compile, t.dtype, t.tokenizer_path) == (100, True, "bfloat16", "tok.model")
    assert t.lr == 1.0 and type(t.lr) is float  # int accepted for float, converted
    assert t.betas == [1.0, 0.5] and all(type(b) is float for b in t.betas)
    assert t.layers_per_stage == [2, 3]
    assert cfg.model.attention.n_heads == 16
    assert cfg.model.dim == 512  # untouched key in a touched section keeps factory default
    assert cfg.parallelism == ParallelismConfig()


def test_overrides_apply_after_file_and_in_order(tmp_path):
    p = write(tmp_path / "r.toml", "[training]\nsteps = 100\nseed = 3\n")
    cfg = load_recipe(JobConfig, p, ["--training.steps=5", "--training.lr", "1e-3",
                                     "--training.steps", "7", "--model.attention.n_heads=2"])
    assert cfg.training.steps == 7 and cfg.training.seed == 3
    assert cfg.training.lr == pytest.approx(1e-3)
    assert cfg.model.attention.n_heads == 2 and cfg.model.dim == 512


# ----------------------------------------------------------- override parsing
@pytest.mark.parametrize("tokens, expected", [
    (["--a.b=1"], [("a.b", "1")]),
    (["--a.b", "1"], [("a.b", "1")]),
    (["--a.b=x=y"], [("a.b", "x=y")]),
    (["--a.b="], [("a.b", "")]),
    (["--a.b", "-1", "--c=2"], [("a.b", "-1"), ("c", "2")]),
    (["--a-b.c_d", "v w"], [("a-b.c_d", "v w")]),
    ([], []),
])
def test_parse_overrides_forms(tokens, expected):
    assert parse_overrides(tokens) == expected


@pytest.mark.parametrize("tokens, fragment", [
    (["training.steps=5"], "bad override 'training.steps=5'"),
    (["-t=5"], "bad override '-t=5'"),
    (["--"], "bad override '--'"),
    (["--=5"], "bad override '--=5'"),
    (["--a..b=1"], "bad override '--a..b=1'"),
    (["--a.b"], "override --a.b has no value"),
    (["--a.b", "--c.d=1"], "override --a.b has no value"),
    (["--a=1", "stray"], "bad override 'stray'"),
])
def test_parse_overrides_errors(tokens, fragment):
    assert fragment in err(parse_overrides, tokens)


# ------------------------------------------------------------- value types
@pytest.mark.parametrize("text, value", [("5", 5), ("1_000", 1000), (" -3 ", -3), ("+2", 2)])
def test_int_override_accepts(text, value):
    assert load_recipe(JobConfig, None, ["--model.dim", text]).model.dim == value


def test_int_override_rejects_float_with_exact_message():
    assert err(load_recipe, JobConfig, None, ["--training.steps=1.5"]) == (
        "training.steps: expected int, got '1.5' (from --training.steps); "
        "fix the value in the recipe or override")


@pytest.mark.parametrize("toml_value, shown", [
    ("1.5", "1.5 (float)"), ('"5"', "'5' (str)"), ("true", "True (bool)"), ("[1]", "[1] (list)")])
def test_int_from_toml_rejects_other_types(tmp_path, toml_value, shown):
    p = write(tmp_path / "r.toml", f"[training]\nsteps = {toml_value}\n")
    msg = err(load_recipe, JobConfig, p)
    assert msg == (f"training.steps: expected int, got {shown} (from {p}); "
                   "fix the value in the recipe or override")


@pytest.mark.parametrize("text, value", [
    ("1e-3", 1e-3), ("5", 5.0), (".5", 0.5), ("-2", -2.0)])
def test_float_override_accepts(text, value):
    lr = load_recipe(JobConfig, None, [f"--training.lr={text}"]).training.lr
    assert lr == value and type(lr) is float


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "NaN", "1e400"])
def test_float_must_be_finite_from_cli_and_toml(tmp_path, text):
    """inf and nan pass range checks written as comparisons (nan > 0 is False, but nan < 0 too): refused
    for every float key, whatever its section's own checks."""
    assert err(load_recipe, JobConfig, None, [f"--training.lr={text}"]).startswith(
        f"training.lr: must be a finite number, got {float(text)} (from --training.lr)")
    p = write(tmp_path / "r.toml", f"[training]\nlr = {text.lower().replace('1e400', 'inf')}\n")
    assert "training.lr: must be a finite number" in err(load_recipe, JobConfig, p)


def test_float_rejects_garbage_and_bool(tmp_path):
    assert "expected float, got 'fast'" in err(load_recipe, JobConfig, None, ["--training.lr=fast"])
    p = write(tmp_path / "r.toml", "[training]\nlr = false\n")
    assert "expected float, got False (bool)" in err(load_recipe, JobConfig, p)


@pytest.mark.parametrize("text, value", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
    ("false", False), ("False", False), ("0", False), ("no", False)])
def test_bool_override_words(text, value):
    assert load_recipe(JobConfig, None, ["--training.compile", text]).training.compile is value


def test_bool_rejects_unknown_word_and_toml_int(tmp_path):
    assert "expected bool, got 'maybe'" in err(
        load_recipe, JobConfig, None, ["--training.compile=maybe"])
    p = write(tmp_path / "r.toml", "[training]\ncompile = 1\n")
    assert "training.compile: expected bool, got 1 (int)" in err(load_recipe, JobConfig, p)


def test_literal_accepts_choice_and_rejects_others(tmp_path):
    cfg = load_recipe(JobConfig, None, ["--parallelism.pp_schedule=GPipe"])
    assert cfg.parallelism.pp_schedule == "GPipe"
    msg = err(load_recipe, JobConfig, None, ["--parallelism.pp_schedule=GPipee"])
    assert msg.startswith("parallelism.pp_schedule: 'GPipee' is not one of "
                          "'GPipe', '1F1B', 'Interleaved1F1B' (from --parallelism.pp_schedule)")
    assert msg.endswith("did you mean 'GPipe'?")
    p = write(tmp_path / "r.toml", '[training]\ndtype = "fp8"\n')
    msg = err(load_recipe, JobConfig, p)
    assert "training.dtype: 'fp8' is not one of 'float32', 'bfloat16'" in msg
    assert f"(from {p})" in msg


def test_literal_of_ints_and_bools_is_type_exact(tmp_path):
    @dataclass
    class S:
        n: Literal[1, 2] = 1
        b: Literal[True] = True

    @dataclass
    class Top:
        s: S = field(default_factory=S)

    assert load_recipe(Top, None, ["--s.n=2"]).s.n == 2
    p = write(tmp_path / "r.toml", "[s]\nb = 1\n")
    assert "s.b: 1 is not one of True" in err(load_recipe, Top, p)


@pytest.mark.parametrize("text", ["none", "None", "NULL", "null"])
def test_optional_none_words(text):
    cfg = load_recipe(JobConfig, None, [f"--training.warmup={text}",
                                        "--training.tokenizer_path", text])
    assert cfg.training.warmup is None and cfg.training.tokenizer_path is None


def test_optional_inner_type_still_checked():
    assert load_recipe(JobConfig, None, ["--training.warmup=3"]).training.warmup == 3
    assert load_recipe(JobConfig, None, ["--training.tokenizer_path=a b"]).training.tokenizer_path == "a b"
    assert "training.warmup: expected int, got 'x'" in err(
        load_recipe, JobConfig, None, ["--training.warmup=x"])


@pytest.mark.parametrize("key, text, value", [
    ("layers_per_stage", "1,2,3", [1, 2, 3]),
    ("layers_per_stage", "[1, 2, 3]", [1, 2, 3]),
    ("layers_per_stage", " 4 , 5 ", [4, 5]),
    ("layers_per_stage", "", []),
    ("layers_per_stage", "[]", []),
    ("betas", "0.8,1", [0.8, 1.0]),
    ("betas", "[0.8, 1e-2]", [0.8, 0.01]),
    ("tags", "a,b", ["a", "b"]),
    ("tags", "[a, b]", ["a", "b"]),
    ("tags", '["x,y", "z"]', ["x,y", "z"]),
    ("tags", "[1, 2]", ["1", "2"]),
])
def test_list_overrides(key, text, value):
    got = getattr(load_recipe(JobConfig, None, [f"--training.{key}={text}"]).training, key)
    assert got == value and [type(v) for v in got] == [type(v) for v in value]


def test_list_element_errors(tmp_path):
    assert "training.layers_per_stage[1]: expected int, got '2.5'" in err(
        load_recipe, JobConfig, None, ["--training.layers_per_stage=1,2.5"])
    p = write(tmp_path / "r.toml", '[training]\ntags = ["a", 3]\n')
    assert "training.tags[1]: expected str, got 3 (int)" in err(load_recipe, JobConfig, p)
    p = write(tmp_path / "s.toml", "[training]\nbetas = 0.9\n")
    assert "training.betas: expected list[float], got 0.9 (float)" in err(load_recipe, JobConfig, p)


def test_none_cannot_come_from_toml_so_absent_means_default(tmp_path):
    p = write(tmp_path / "r.toml", "[training]\nsteps = 3\n")
    assert load_recipe(JobConfig, p).training.warmup == 5


# ------------------------------------------------------------ unknown keys
def test_unknown_key_in_toml_exact_message(tmp_path):
    p = write(tmp_path / "x.toml", "[training]\nstesp = 5\n")
    assert err(load_recipe, JobConfig, p) == (
        f"unknown key 'training.stesp' in {p}; did you mean 'training.steps'?")


def test_unknown_key_in_override_exact_message():
    assert err(load_recipe, JobConfig, None, ["--training.stesp=5"]) == (
        "unknown key 'training.stesp' in --training.stesp; did you mean 'training.steps'?")


def test_unknown_key_suggests_other_section():
    assert err(load_recipe, JobConfig, None, ["--training.tp=2"]) == (
        "unknown key 'training.tp' in --training.tp; did you mean 'parallelism.tp'?")


def test_unknown_key_suggests_both_typo_and_other_section():
    @dataclass
    class A:
        step: int = 0

    @dataclass
    class B:
        steps: int = 0

    @dataclass
    class Top:
        a: A = field(default_factory=A)
        b: B = field(default_factory=B)

    assert err(load_recipe, Top, None, ["--a.steps=1"]).endswith(
        "did you mean 'a.step' or 'b.steps'?")


def test_unknown_section_in_toml(tmp_path):
    p = write(tmp_path / "x.toml", "[trainig]\nsteps = 5\n")
    assert err(load_recipe, JobConfig, p) == (
        f"unknown section 'trainig' in {p}; did you mean 'training'?")


def test_unknown_section_in_override():
    assert err(load_recipe, JobConfig, None, ["--trainig.steps=5"]) == (
        "unknown section 'trainig' in --trainig.steps; did you mean 'training.steps'?")


def test_unknown_nested_key_and_top_level_key(tmp_path):
    assert "did you mean 'model.attention.n_heads'?" in err(
        load_recipe, JobConfig, None, ["--model.attention.nheads=4"])
    p = write(tmp_path / "x.toml", "steps = 5\n")
    assert err(load_recipe, JobConfig, p) == (
        f"unknown key 'steps' in {p}; did you mean 'training.steps'?")


def test_unknown_key_fuzzy_match_in_other_section():
    assert err(load_recipe, JobConfig, None, ["--training.tpp=2"]).endswith(
        "did you mean 'parallelism.tp'?")


def test_unknown_key_is_not_matched_to_a_section_name():
    # 'model_' is close to the section 'model', but a key should not suggest a section
    assert err(load_recipe, JobConfig, None, ["--parallelism.model_=1"]) == (
        "unknown key 'parallelism.model_' in --parallelism.model_; "
        "valid keys in 'parallelism': tp, pp, pp_schedule")


def test_unknown_key_without_suggestion_lists_valid_keys():
    msg = err(load_recipe, JobConfig, None, ["--parallelism.zzzzzz=1"])
    assert msg == ("unknown key 'parallelism.zzzzzz' in --parallelism.zzzzzz; "
                   "valid keys in 'parallelism': tp, pp, pp_schedule")


def test_override_naming_a_section_is_an_error():
    msg = err(load_recipe, JobConfig, None, ["--training=5"])
    assert msg.startswith("'training' is a section, not a key (from --training)")
    assert "--training.steps=" in msg
    assert "is a section" in err(load_recipe, JobConfig, None, ["--model.attention=1"])


def test_override_through_a_value_is_an_error():
    assert "'training.steps' is a value, not a section" in err(
        load_recipe, JobConfig, None, ["--training.steps.x=1"])


def test_section_given_as_scalar_in_toml(tmp_path):
    p = write(tmp_path / "x.toml", "training = 5\n")
    assert "training: expected a table [training], got 5 (int)" in err(load_recipe, JobConfig, p)


# ------------------------------------------------------------- post_init
def test_post_init_error_is_wrapped_single_line():
    msg = err(load_recipe, JobConfig, None, ["--training.steps=0"])
    # message already names the section, so it is not prefixed twice
    assert msg == "training.steps must be >= 1, got 0; set it to a positive step count"


def test_post_init_error_gets_section_prefix_and_is_one_line(tmp_path):
    p = write(tmp_path / "x.toml", "[training]\nseed = -1\n")
    assert err(load_recipe, JobConfig, p) == "training: seed must be non-negative use 0 or more"


def test_post_init_bug_is_not_turned_into_a_user_error():
    # Only ConfigError is user input; any other exception from a __post_init__ is a bug and keeps its type.
    @dataclass
    class Broken:
        n: int = 1

        def __post_init__(self):
            raise ValueError("a bug, not a bad value")

    @dataclass
    class Top:
        s: Broken = field(default_factory=lambda: Broken.__new__(Broken))

    with pytest.raises(ValueError, match="a bug") as info:
        load_recipe(Top, None, ["--s.n=2"])
    assert not isinstance(info.value, ConfigError)


def test_post_init_runs_once_on_final_values(tmp_path):
    # the file alone is invalid but the override fixes it before validation runs
    p = write(tmp_path / "x.toml", "[training]\nsteps = 0\n")
    assert load_recipe(JobConfig, p, ["--training.steps=2"]).training.steps == 2


def test_missing_required_key():
    @dataclass
    class S:
        path: str
        n: int = 1

    @dataclass
    class Top:
        s: S

    assert err(load_recipe, Top, None) == (
        "missing required key 's.path'; set it in the recipe or with --s.path=...")
    assert load_recipe(Top, None, ["--s.path=/x"]).s == S(path="/x")


def test_config_error_collapses_newlines():
    assert str(ConfigError("a\nb\r\n  c")) == "a b c"


# ----------------------------------------------------------------- extends
def test_extends_chain_deep_merges(tmp_path):
    write(tmp_path / "base.toml", """
        [training]
        steps = 100
        seed = 1
        betas = [0.1, 0.2, 0.3]
        [parallelism]
        tp = 2
    """)
    write(tmp_path / "mid.toml", """
        extends = "base.toml"
        [training]
        seed = 2
        betas = [0.5]
    """)
    leaf = write(tmp_path / "leaf.toml", """
        extends = "mid.toml"
        [parallelism]
        pp = 4
    """)
    raw = load_toml_with_extends(leaf)
    assert raw == {"training": {"steps": 100, "seed": 2, "betas": [0.5]},
                   "parallelism": {"tp": 2, "pp": 4}}
    cfg = load_recipe(JobConfig, leaf, ["--training.steps=3"])
    assert (cfg.training.steps, cfg.training.seed, cfg.training.betas) == (3, 2, [0.5])
    assert (cfg.parallelism.tp, cfg.parallelism.pp) == (2, 4)


def test_extends_list_merges_in_order_and_child_wins(tmp_path):
    write(tmp_path / "a.toml", "[training]\nsteps = 1\nseed = 1\nlr = 0.1\n")
    write(tmp_path / "b.toml", "[training]\nseed = 2\nlr = 0.2\n")
    c = write(tmp_path / "c.toml", 'extends = ["a.toml", "b.toml"]\n[training]\nlr = 0.3\n')
    assert load_toml_with_extends(c) == {"training": {"steps": 1, "seed": 2, "lr": 0.3}}


def test_extends_path_is_relative_to_extending_file(tmp_path, monkeypatch):
    write(tmp_path / "recipes" / "base" / "common.toml", "[training]\nseed = 9\n")
    child = write(tmp_path / "recipes" / "exp" / "run.toml", 'extends = "../base/common.toml"\n')
    monkeypatch.chdir(tmp_path)  # CWD must not matter
    assert load_recipe(JobConfig, Path("recipes/exp/run.toml")).training.seed == 9
    assert load_recipe(JobConfig, str(child)).training.seed == 9


def test_extends_table_replaced_by_scalar_and_back(tmp_path):
    write(tmp_path / "a.toml", "[x]\ny = 1\n")
    b = write(tmp_path / "b.toml", 'extends = "a.toml"\nx = 3\n')
    assert load_toml_with_extends(b) == {"x": 3}
    write(tmp_path / "c.toml", "x = 3\n")
    d = write(tmp_path / "d.toml", 'extends = "c.toml"\n[x]\ny = 2\n')
    assert load_toml_with_extends(d) == {"x": {"y": 2}}


def test_extends_diamond_is_not_a_cycle(tmp_path):
    write(tmp_path / "root.toml", "[training]\nsteps = 1\n")
    write(tmp_path / "l.toml", 'extends = "root.toml"\n[training]\nseed = 1\n')
    write(tmp_path / "r.toml", 'extends = "root.toml"\n[training]\nlr = 0.5\n')
    top = write(tmp_path / "top.toml", 'extends = ["l.toml", "r.toml"]\n')
    assert load_toml_with_extends(top) == {"training": {"steps": 1, "seed": 1, "lr": 0.5}}


def test_extends_cycle_is_reported(tmp_path):
    a = write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    msg = err(load_toml_with_extends, a)
    assert msg.startswith(f"extends cycle: {a} -> {tmp_path / 'b.toml'} -> {a}")
    s = write(tmp_path / "self.toml", 'extends = "self.toml"\n')
    assert f"extends cycle: {s} -> {s}" in err(load_recipe, JobConfig, s)


def test_extends_missing_file(tmp_path):
    a = write(tmp_path / "a.toml", 'extends = "nope.toml"\n')
    msg = err(load_recipe, JobConfig, a)
    assert str(tmp_path / "nope.toml") in msg and "not found" in msg and str(a) in msg
    assert str(tmp_path / "missing.toml") in err(load_recipe, JobConfig, tmp_path / "missing.toml")


def test_extends_bad_type(tmp_path):
    a = write(tmp_path / "a.toml", "extends = 3\n")
    assert "extends in" in err(load_toml_with_extends, a)


def test_error_names_the_file_the_key_came_from(tmp_path):
    base = write(tmp_path / "base.toml", "[training]\nstesp = 1\nseed = 1.5\n")
    child = write(tmp_path / "child.toml", 'extends = "base.toml"\n[training]\nseed = 2\n')
    assert err(load_recipe, JobConfig, child) == (
        f"unknown key 'training.stesp' in {base}; did you mean 'training.steps'?")
    write(tmp_path / "base.toml", "[training]\nsteps = 1.5\n")
    assert f"(from {base})" in err(load_recipe, JobConfig, child)


def test_invalid_toml(tmp_path):
    p = write(tmp_path / "bad.toml", "[training\nsteps = \n")
    assert err(load_recipe, JobConfig, p).startswith(f"invalid TOML in {p}:")


# ------------------------------------------------------- dumping and saving
TRICKY_VALUES = [
    0, -5, 2**63 - 1, -(2**63), True, False,
    1e-5, 1e-300, 5e-324, 1.7976931348623157e308, 0.1, 3.0, -0.0, 1e16, 123456789.125,
    math.inf, -math.inf,
    "", "plain", 'with "quotes"', "back\\slash\\", "C:\\path\\", "tab\tnew\nline\r",
    "ctrl \x00\x01\x1f\x7f", "héllo ✓ 𝔘 日本", "'single'", '"""', "a = b # not a comment",
    "[not.a.table]", [], [1, 2, 3], [1.5, math.inf], ["a", 'b"c', ""], [[1, 2], ["x"]], [True],
]


@pytest.mark.parametrize("value", TRICKY_VALUES, ids=repr)
def test_dumps_toml_round_trips_values(value):
    doc = {"v": value, "t": {"v": value}}
    back = tomllib.loads(dumps_toml(doc))
    assert back == doc
    assert type(back["v"]) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, back["v"]) == math.copysign(1, value)


def test_dumps_toml_nan():
    assert math.isnan(tomllib.loads(dumps_toml({"x": math.nan}))["x"])


def test_dumps_toml_keys_and_nesting():
    doc = {"top": 1, "a.b": {"c d": {"é": 2, "x": {}}, "z": [1]}, "empty": {}, "k-1_": "v"}
    text = dumps_toml(doc)
    assert tomllib.loads(text) == doc
    assert "[empty]" in text


def test_dumps_toml_random_documents_round_trip():
    rng = random.Random(1234)
    alphabet = "ab_-. \"\\'\n\t✓é\x01"

    def scalar():
        return rng.choice([
            lambda: rng.randint(-10**12, 10**12),
            lambda: rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-30, 30),
            lambda: rng.random() < 0.5,
            lambda: "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))),
        ])()

    def table(depth):
        out = {}
        for _ in range(rng.randint(0, 4)):
            key = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            kind = rng.random()
            if kind < 0.2 and depth < 3:
                out[key] = table(depth + 1)
            elif kind < 0.4:
                out[key] = [scalar() for _ in range(rng.randint(0, 3))]
            else:
                out[key] = scalar()
        return out

    for _ in range(300):
        doc = table(0)
        assert tomllib.loads(dumps_toml(doc)) == doc


@pytest.mark.parametrize("bad", [{"x": None}, {"x": object()}, {1: 2}, {"x": [None]}])
def test_dumps_toml_rejects_unsupported(bad):
    with pytest.raises(TypeError):
        dumps_toml(bad)


def test_config_to_dict_omits_none_and_copies_lists():
    cfg = JobConfig()
    d = config_to_dict(cfg)
    assert "tokenizer_path" not in d["training"] and "layers_per_stage" not in d["training"]
    assert d["model"] == {"dim": 512, "attention": {"n_heads": 8, "rope_theta": 10000.0}}
    d["training"]["betas"].append(1.0)
    assert cfg.training.betas == [0.9, 0.95]


def test_save_config_round_trips_through_load_recipe(tmp_path):
    cfg = load_recipe(JobConfig, None, ["--training.lr=1e-5", "--training.tags=a\"b,c\\d",
                                        "--job.name=ünï", "--training.tokenizer_path=t",
                                        "--model.attention.rope_theta=1.5e300"])
    out = tmp_path / "sub" / "dir" / "config.toml"
    save_config(cfg, out)
    assert load_recipe(JobConfig, out) == cfg
    assert sorted(os.listdir(out.parent)) == ["config.toml"]  # no temp file left behind


def test_save_config_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "config.toml"
    out.write_text("old = 1\n")
    calls = []
    real_replace = os.replace

    def failing_replace(src, dst):
        calls.append((Path(src), Path(dst)))
        raise OSError("disk on fire")

    monkeypatch.setattr(loader.os, "replace", failing_replace)
    with pytest.raises(OSError):
        save_config(JobConfig(), out)
    assert out.read_text() == "old = 1\n"  # the target is never half-written
    assert calls[0][0].parent == tmp_path and calls[0][1] == out  # tmp in same dir
    assert os.listdir(tmp_path) == ["config.toml"]  # tmp cleaned up on failure
    monkeypatch.setattr(loader.os, "replace", real_replace)
    save_config(JobConfig(), out)
    assert tomllib.loads(out.read_text())["training"]["steps"] == 10


# --------------------------------------------------------------- helpers
def test_closest_key():
    assert closest_key("stesp", ["steps", "seed", "lr"]) == "steps"
    assert closest_key("STEPS", ["steps", "seed"]) == "steps"
    assert closest_key("zzzz", ["steps", "seed"]) is None
    assert closest_key("x", []) is None


def test_describe_lists_every_key_with_default_type_and_help():
    text = describe(JobConfig)
    lines = text.splitlines()
    assert "training.steps = 10  # int; number of optimizer steps" in lines
    assert "training.tokenizer_path = none  # str | None" in lines
    assert "training.betas = [0.9, 0.95]  # list[float]" in lines
    assert "training.tags = []  # list[str]" in lines
    assert 'job.name = "run"  # str' in lines
    assert ("parallelism.pp_schedule = \"1F1B\"  # Literal['GPipe', '1F1B', 'Interleaved1F1B']"
            in lines)
    assert "model.dim = 512  # int" in lines  # default from the parent's factory
    assert "model.attention.rope_theta = 10000.0  # float" in lines
    n_leaves = sum(len(dataclasses.fields(c)) for c in
                   (JobSection, TrainingConfig, ParallelismConfig, AttentionConfig)) + 1
    assert len(lines) == n_leaves


def test_describe_required_and_string_lists():
    @dataclass
    class S:
        path: str = field(metadata={"help": "where"})
        names: list[str] = field(default_factory=lambda: ["a", 'b"'])
        n: int = 3  # a plain default, read from the field: no parent instance exists

    @dataclass
    class Top:
        s: S

    assert describe(Top).splitlines() == [
        "s.path = <required>  # str; where",
        's.names = ["a", "b\\""]  # list[str]',
        "s.n = 3  # int",
    ]


def test_string_annotations_are_resolved(tmp_path, monkeypatch):
    mod_path = write(tmp_path / "future_schema.py", """
        from __future__ import annotations
        from dataclasses import dataclass, field
        from typing import Literal

        @dataclass
        class Inner:
            n: int = 1
            mode: Literal["a", "b"] = "a"
            xs: list[float] | None = None

        @dataclass
        class Outer:
            inner: Inner = field(default_factory=Inner)
    """)
    spec = importlib.util.spec_from_file_location("future_schema", mod_path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "future_schema", mod)
    spec.loader.exec_module(mod)
    cfg = load_recipe(mod.Outer, None, ["--inner.n=3", "--inner.mode=b", "--inner.xs=1,2"])
    assert (cfg.inner.n, cfg.inner.mode, cfg.inner.xs) == (3, "b", [1.0, 2.0])
    assert "expected int, got '1.5'" in err(load_recipe, mod.Outer, None, ["--inner.n=1.5"])
    assert "'c' is not one of 'a', 'b'" in err(load_recipe, mod.Outer, None, ["--inner.mode=c"])


def test_schema_must_be_a_dataclass():
    with pytest.raises(TypeError, match="schema must be a dataclass type, got <class 'dict'>"):
        load_recipe(dict, None)


# ------------------------------------------------- schema shapes beyond JobConfig
def test_union_of_types_takes_the_first_arm_that_fits(tmp_path):
    @dataclass
    class S:
        size: int | str = 0  # e.g. a count, or a word such as "auto"
        ratio: int | float = 1

    @dataclass
    class Top:
        s: S = field(default_factory=S)

    cfg = load_recipe(Top, None, ["--s.size=5", "--s.ratio=0.5"])
    assert (cfg.s.size, cfg.s.ratio) == (5, 0.5) and type(cfg.s.size) is int
    assert load_recipe(Top, None, ["--s.size=auto"]).s.size == "auto"
    ratio = load_recipe(Top, write(tmp_path / "r.toml", "[s]\nratio = 2\n")).s.ratio
    assert ratio == 2 and type(ratio) is int  # the int arm comes first: no silent int -> float
    assert err(load_recipe, Top, None, ["--s.ratio=half"]) == (
        "s.ratio: expected int | float, got 'half' (from --s.ratio); fix the value in the recipe or override")


def test_path_fields_are_built_from_text_and_survive_save(tmp_path):
    @dataclass
    class S:
        folder: Path = Path("out")
        cache: Optional[Path] = None

    @dataclass
    class Top:
        s: S = field(default_factory=S)

    p = write(tmp_path / "r.toml", '[s]\nfolder = "/data/x"\n')
    cfg = load_recipe(Top, p, ["--s.cache=/tmp/c"])
    assert cfg.s == S(folder=Path("/data/x"), cache=Path("/tmp/c"))
    assert load_recipe(Top, None).s.folder == Path("out")  # a default that already is a Path is kept
    save_config(cfg, tmp_path / "saved.toml")
    assert load_recipe(Top, tmp_path / "saved.toml") == cfg
    bad = write(tmp_path / "bad.toml", "[s]\nfolder = 3\n")
    assert err(load_recipe, Top, bad) == (
        f"s.folder: expected Path, got 3 (int) (from {bad}); fix the value in the recipe or override")


def test_untyped_fields_take_values_as_given(tmp_path):
    @dataclass
    class S:
        extra: Any = None
        items: list = field(default_factory=list)
        weights: dict[str, float] = field(default_factory=dict)  # not a section: a table value, unchecked

    @dataclass
    class Top:
        s: S = field(default_factory=S)

    cfg = load_recipe(Top, None, ["--s.extra=x y", "--s.items=a,1"])
    assert (cfg.s.extra, cfg.s.items) == ("x y", ["a", "1"])
    p = write(tmp_path / "r.toml", '[s]\nextra = 3\nitems = [1, "a"]\nweights = {a = 0.5}\n')
    assert load_recipe(Top, p).s == S(extra=3, items=[1, "a"], weights={"a": 0.5})


def test_recipe_that_is_not_utf8_is_a_one_line_error(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes('[job]\nname = "café"\n'.encode("latin-1"))
    msg = err(load_recipe, JobConfig, p)
    assert msg.startswith(f"recipe {p} is not UTF-8 text (byte 17: ") and msg.endswith("save it as UTF-8")


def test_loader_imports_without_torch():
    # Empty stand-ins for the packages, so that only the loader and what it
    # imports run (trainlib/__init__ imports torch for its facade).
    root = _LOADER_PATH.parents[1]
    code = ("import sys, types\n"
            f"for name, path in (('trainlib', {str(root)!r}), ('trainlib.config', {str(root / 'config')!r})):\n"
            "    sys.modules[name] = m = types.ModuleType(name); m.__path__ = [path]\n"
            "import trainlib.config.loader\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_saved_config_is_readable_as_the_umask_allows(tmp_path):
    """Not mkstemp's 0600: the group's tools read a run's config.toml like its other files."""
    old = os.umask(0o022)
    try:
        save_config(JobConfig(), tmp_path / "config.toml")
    finally:
        os.umask(old)
    assert (tmp_path / "config.toml").stat().st_mode & 0o777 == 0o644
