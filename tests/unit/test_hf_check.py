"""Issue 54 item 3: an HF folder is checked before anything is written. Each fault is one line naming the
file and the field, exit 2, and no output folder left behind (`python -m trainlib.convert hf-to-dcp`, which
`checkpoint.initial_load_path` shares the reader with)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainlib.checkpoint.hf import write_hf_folder
from trainlib.convert import main
from trainlib.models.qwen3_moe import Transformer, get_model_args

EXPERT = "model.layers.{}.mlp.experts.{}.down_proj.weight"


@pytest.fixture
def hf(tmp_path):
    args = get_model_args("debug_moe")
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    return write_hf_folder(model.state_dict(), args, tmp_path / "hf")


def _refused(hf, capsys, *expected):
    out = hf.parent / "out"
    assert main(["hf-to-dcp", str(hf), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for part in expected:
        assert part in err, (part, err)
    assert not out.exists()  # nothing written, no partial checkpoint
    return err


def _edit_config(hf, **changes):
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


def test_a_missing_expert_tensor_is_named(hf, capsys):
    tensors = load_file(hf / "model.safetensors")
    del tensors[EXPERT.format(2, 5)]
    save_file(tensors, hf / "model.safetensors")
    _refused(hf, capsys, f"{hf / 'model.safetensors'} lacks 1 tensor(s) config.json's model has "
                         f"({EXPERT.format(2, 5)})")


def test_a_config_with_more_or_fewer_experts_than_the_tensors_is_refused(hf, capsys):
    _edit_config(hf, num_experts=16)  # before: a checkpoint with no expert weights at all, exit 0
    _refused(hf, capsys, "lacks 72 tensor(s) config.json's model has", EXPERT.format(1, 8))
    _edit_config(hf, num_experts=4)  # before: experts 4-7 silently dropped
    _refused(hf, capsys, "holds 36 tensor(s) config.json's model does not have", EXPERT.format(1, 4),
             "does not describe these weights")


def test_a_config_with_other_heads_or_layers_than_the_tensors_is_refused(hf, capsys):
    _edit_config(hf, num_key_value_heads=1)
    _refused(hf, capsys, "holds model.layers.0.self_attn.k_proj.weight of shape [64, 64], config.json's model "
                         "has [32, 64]")
    _edit_config(hf, num_key_value_heads=2, num_hidden_layers=3)
    _refused(hf, capsys, "holds", "tensor(s) config.json's model does not have (model.layers.3.")


def test_a_truncated_file_or_an_index_naming_a_tensor_its_file_lacks_is_named(hf, capsys):
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[:-1000])
    _refused(hf, capsys, f"{hf / 'model.safetensors'} is cut short: {len(data) - 1000} bytes, its header "
                         f"describes {len(data)}")
    (hf / "model.safetensors").write_bytes(data[:5])
    _refused(hf, capsys, f"{hf / 'model.safetensors'} is not a safetensors file")
    (hf / "model.safetensors").write_bytes(data)
    tensors = load_file(hf / "model.safetensors")
    gone = EXPERT.format(3, 0)
    index = {"weight_map": {name: "model.safetensors" for name in tensors}}
    del tensors[gone]
    save_file(tensors, hf / "model.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(hf, capsys, f"{hf / 'model.safetensors.index.json'} names {gone} in model.safetensors, which does "
                         f"not hold it")


def test_a_string_where_a_number_belongs_is_named(hf, capsys):
    _edit_config(hf, hidden_size="64")
    _refused(hf, capsys, f"{hf / 'config.json'}: hidden_size is the string '64' where a number belongs")


def test_an_output_folder_that_cannot_be_written_is_refused_before_reading(hf, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["hf-to-dcp", str(hf), str(tmp_path / "file" / "out")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_a_tied_folder_that_also_keeps_lm_head_and_old_rotary_buffers_pass(tmp_path):
    # what the config explains by other names is no stray tensor: lm_head beside a tied embedding, inv_freq
    from trainlib.checkpoint.hf import read_hf_folder

    args = get_model_args("debug_moe", tie_embeddings=True)
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    hf = write_hf_folder(model.state_dict(), args, tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    save_file(tensors, hf / "model.safetensors")
    assert read_hf_folder(hf)[0] == args


def test_from_checkpoint_takes_the_folders_shape_and_names_what_it_lacks(hf):
    """Issue 54 item 2: model.flavor = 'from_checkpoint' resolves to the shape the HF folder records; without a
    load path, or with another family named, it is one line saying what to set."""
    from trainlib.config import ConfigError, load_job_config, resolve_job_model

    with pytest.raises(ConfigError, match="checkpoint.initial_load_path, which is not set"):
        load_job_config("debug_moe", ["--model.flavor=from_checkpoint"])
    cfg = load_job_config("debug_moe", ["--model.flavor=from_checkpoint", f"--checkpoint.initial_load_path={hf}",
                                        "--model.n_layers=1"])
    assert resolve_job_model(cfg).args == get_model_args("debug_moe", n_layers=1)  # the recipe's overrides apply
    cfg = load_job_config("debug", ["--model.flavor=from_checkpoint", f"--checkpoint.initial_load_path={hf}"])
    with pytest.raises(ConfigError, match="holds a qwen3_moe model, but model.name is 'llama3': set model.name = "
                                          "'qwen3_moe'"):
        resolve_job_model(cfg)


def test_convert_says_no_dcp_warning_either_way(hf, tmp_path, capsys):
    """Issue 54 item 8: DCP warned "torch.distributed is disabled ..." on every conversion, though trainlib
    converts in one process on purpose (no_dist=True); the two commands now print their one line each."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["hf-to-dcp", str(hf), str(tmp_path / "dcp")]) == 0
        assert main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "back")]) == 0
    assert not [str(w.message) for w in seen if "torch.distributed is disabled" in str(w.message)]
    assert capsys.readouterr().out.count("\n") == 2
