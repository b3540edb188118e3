"""Every shipped recipe loads and passes the checks that need no GPU; recipes resolve by name."""

from pathlib import Path

import pytest

from tests.helpers import RECIPES
from trainlib.config import ConfigError, load_job_config, resolve_recipe
from trainlib.config.validate import resolve_local_batch_size, validate_job
from trainlib.models.registry import model_args, resolve_model
from trainlib.parallel import ParallelDims

RECIPE_FILES = sorted(p.name for p in RECIPES.glob("*.toml"))

# Cluster each recipe is written for (world size); the base is not a runnable job on its own.
WORLD = {"debug.toml": 2, "debug_qwen3.toml": 2, "llama3_1b.toml": 1, "llama3_3b.toml": 1, "llama3_8b.toml": 8,
         "llama3_70b.toml": 256, "llama3_405b.toml": 512, "qwen3_8b.toml": 8, "qwen3_32b.toml": 32,
         "debug_moe.toml": 2, "qwen3_30b_a3b.toml": 64, "qwen3_235b_a22b.toml": 256,
         "debug_deepseek.toml": 2, "deepseek_v3_16b.toml": 8, "deepseek_v3_671b.toml": 256, "kimi_k2.toml": 1024}

@pytest.mark.parametrize("name", RECIPE_FILES)
def test_recipe_loads(name):
    cfg = load_job_config(str(RECIPES / name))
    model_args(cfg.model)
    if name in WORLD:
        p = cfg.parallelism
        dims = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, world_size=WORLD[name])
        resolve_local_batch_size(cfg, dims)


def test_every_recipe_has_a_target_world():
    assert set(RECIPE_FILES) - {"gpu_base.toml", "llama3_base.toml", "qwen3_base.toml"} <= set(WORLD)


def test_variants_extend_the_base():
    cfg = load_job_config(str(RECIPES / "llama3_70b.toml"))
    assert cfg.model.flavor == "llama3.1_70b" and cfg.training.seq_len == 8192  # from the family's base
    assert cfg.training.mixed_precision_param == "bfloat16"  # from gpu_base.toml
    cfg = load_job_config(str(RECIPES / "qwen3_32b.toml"))
    assert (cfg.model.name, cfg.model.flavor, cfg.training.seq_len) == ("qwen3", "qwen3_32b", 4096)
    assert cfg.tokenizer.kind == "hf" and cfg.training.mixed_precision_param == "bfloat16"




@pytest.mark.parametrize("name,file", [
    ("llama70b.toml", "llama3_70b.toml"), ("llama70b", "llama3_70b.toml"), ("llama8b", "llama3_8b.toml"),
    ("llama405b.toml", "llama3_405b.toml"), ("debug", "debug.toml"), ("llama3_8b.toml", "llama3_8b.toml"),
])
def test_names_and_card_aliases_resolve_from_any_folder(name, file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe(name).resolve() == (RECIPES / file).resolve()


def test_a_pathlike_resolves_like_its_string(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # resolve_recipe takes os.PathLike as well as str
    (tmp_path / "mine.toml").write_text("[training]\nsteps = 7\n")
    assert resolve_recipe(tmp_path / "mine.toml") == tmp_path / "mine.toml"
    assert resolve_recipe(Path("llama70b.toml")).resolve() == (RECIPES / "llama3_70b.toml").resolve()


def test_a_path_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "debug.toml").write_text("[training]\nsteps = 7\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.toml").write_text('extends = "../debug.toml"\n[training]\nseed = 3\n')
    assert load_job_config("debug.toml").training.steps == 7  # an existing file is a path, not the shipped name
    cfg = load_job_config("sub/mine.toml")
    assert (cfg.training.steps, cfg.training.seed) == (7, 3)
    assert load_job_config("debug").training.steps == 50  # no file called "debug" here: the shipped recipe


def test_a_users_recipe_in_any_folder_extends_a_shipped_recipe_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text('extends = "llama70b"\n[training]\nseed = 3\n')  # an alias, no .toml
    (tmp_path / "other.toml").write_text('extends = ["debug.toml"]\n[training]\nseed = 4\n')
    shipped = load_job_config("llama3_70b")
    mine = load_job_config("mine.toml")
    assert mine.training.seed == 3 and mine.model == shipped.model and mine.parallelism == shipped.parallelism
    assert load_job_config("other.toml").training.steps == load_job_config("debug").training.steps
    (tmp_path / "debug.toml").write_text("[training]\nsteps = 7\n")  # a file beside the recipe wins
    assert load_job_config("other.toml").training.steps == 7


def test_unknown_name_lists_the_shipped_recipes():
    with pytest.raises(ConfigError) as e:
        resolve_recipe("llama7b")
    msg = str(e.value)
    assert "unknown recipe 'llama7b'; did you mean 'llama70b'?" in msg and "\n" not in msg
    assert all(p.stem in msg for p in RECIPES.glob("*.toml")) and "llama3_70b (llama70b)" in msg


def test_a_missing_path_named_like_a_shipped_recipe_suggests_the_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the README's "recipes/llama3_70b.toml", typed outside the repo
    with pytest.raises(ConfigError, match="not found: recipes/llama3_70b.toml; the shipped recipe of that name "
                                          "is --recipe llama3_70b"):
        load_job_config("recipes/llama3_70b.toml")


def test_list_recipes_prints_one_line_per_recipe(capsys):
    from trainlib.train import main

    assert main(["--list-recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [p.stem for p in sorted(RECIPES.glob("*.toml"))]
    assert any(line.startswith("llama3_70b (llama70b)") and "256 GPUs" in line for line in lines)


def test_batch_that_does_not_split_over_the_data_ranks_names_that_rule():
    # With local_batch_size unset the batch is split over dp ranks; the message must say so
    # (not the accumulation rule, which would point at a key the user never set).
    dims = ParallelDims(dp_shard=4, world_size=4)
    with pytest.raises(ConfigError, match=r"^training.global_batch_size \(6\) must be divisible by the "
                                          r"data-parallel degree dp_replicate\*dp_shard \(4\); change"):
        resolve_local_batch_size(load_job_config(None, ["--training.global_batch_size=6"]), dims)
    with pytest.raises(ConfigError, match=r"global_batch_size \(2\) must be divisible"):  # fewer than dp: no lbs 0
        resolve_local_batch_size(load_job_config(None, ["--training.global_batch_size=2"]), dims)
    assert resolve_local_batch_size(load_job_config(None, ["--training.global_batch_size=8"]), dims) == (2, 1)
    # validate_job (what a hand-written loop and the planner call) applies the batch rules too
    with pytest.raises(ConfigError, match=r"^training.global_batch_size \(6\) must be divisible"):
        cfg = load_job_config(None, ["--training.global_batch_size=6"])
        validate_job(cfg, dims, resolve_model(cfg.model), 256)


@pytest.mark.parametrize("name", ["qwen3_30b_a3b.toml", "qwen3_235b_a22b.toml"])
def test_the_moe_recipes_say_what_compile_does_today(name):
    # issue 54 item 8: their comments said validate.py refuses compile with MoE blocks, which it no longer does
    cfg = load_job_config(str(RECIPES / name), ["--compile.enable=true"])
    dims = ParallelDims.from_config(cfg.parallelism, WORLD[name])
    validate_job(cfg, dims, resolve_model(cfg.model), model_args(cfg.model).vocab_size)  # accepted
    assert "refuses compile" not in (RECIPES / name).read_text()
