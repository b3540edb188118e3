"""The recipe keys of float8 / compile / activation checkpointing are a contract."""

import pytest

from trainlib.config import ConfigError, load_job_config


def test_contract_keys_load_from_overrides():
    cfg = load_job_config(None, [
        "--float8.enable=true", "--float8.recipe=rowwise_with_gw_hp", "--compile.enable=true",
        "--activation_checkpoint.mode=selective_op", "--float8.filter_fqns=[\"output\", \"layers.0.*\"]",
    ])
    assert cfg.float8.enable and cfg.float8.recipe == "rowwise_with_gw_hp"
    assert cfg.float8.filter_fqns == ["output", "layers.0.*"]
    assert cfg.compile.enable and cfg.activation_checkpoint.mode == "selective_op"


@pytest.mark.parametrize("override,match", [
    ("--float8.recipe=rowise", "rowwise"),
    ("--activation_checkpoint.mode=selective", "selective_op|selective_layer"),
    ("--activation_checkpoint.every_k=0", "every_k must be >= 1"),
])
def test_bad_values_fail_in_one_line(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_job_config(None, [override])
    assert "\n" not in str(e.value)


