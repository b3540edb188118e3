"""Every shipped recipe loads and passes the checks that need no GPU."""

import pytest

from tests.helpers import RECIPES
from trainlib.config import load_job_config
from trainlib.config.validate import resolve_local_batch_size
from trainlib.models.llama3 import get_model_args
from trainlib.parallel import ParallelDims

RECIPE_FILES = sorted(p.name for p in RECIPES.glob("*.toml"))

# Cluster each recipe is written for (world size); the base is not a runnable job on its own.
WORLD = {"debug.toml": 2, "llama3_1b.toml": 1, "llama3_3b.toml": 1, "llama3_8b.toml": 8, "llama3_70b.toml": 256,
         "llama3_405b.toml": 512}

@pytest.mark.parametrize("name", RECIPE_FILES)
def test_recipe_loads(name):
    cfg = load_job_config(str(RECIPES / name))
    get_model_args(cfg.model.flavor)
    if name in WORLD:
        p = cfg.parallelism
        dims = ParallelDims(p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, world_size=WORLD[name])
        resolve_local_batch_size(cfg, dims)


def test_every_recipe_has_a_target_world():
    assert set(RECIPE_FILES) - {"llama3_base.toml"} <= set(WORLD)


def test_variants_extend_the_base():
    cfg = load_job_config(str(RECIPES / "llama3_70b.toml"))
    assert cfg.model.flavor == "llama3.1_70b" and cfg.training.seq_len == 8192  # from the base
    assert cfg.training.mixed_precision_param == "bfloat16"


