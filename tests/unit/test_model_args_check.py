"""Issue 54 item 1: the run's model is the checkpoint's model, or one line says why not. Every field a
checkpoint records (an HF folder's config.json, a DCP checkpoint's trainer.model_args), shape or not, is
compared with the run's: HF and DCP initial loads, resume, and `python -m trainlib.convert dcp-to-hf`."""

import dataclasses
import re

import pytest
import torch

from trainlib.checkpoint import CheckpointConfig, Checkpointer, ModelState, TrainState
from trainlib.checkpoint.hf import load_hf_into_model, write_hf_folder
from trainlib.errors import ConfigError
from trainlib.models.qwen3_moe import Transformer as MoETransformer, get_model_args as moe_args


def _moe(**changes):
    args = moe_args("debug_moe")
    if "top_k" in changes:
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, top_k=changes.pop("top_k")))
    args = dataclasses.replace(args, **changes)
    model = MoETransformer(args, rope_len=8)
    model.init_weights(seed=0)
    return args, model


def test_an_hf_folder_of_another_top_k_or_rope_theta_is_refused_naming_the_field(tmp_path):
    # before: only tensor shapes were compared, and routing (top_k 4 -> 2) or positions changed silently
    args, model = _moe(top_k=4, rope_theta=1e4)
    write_hf_folder(model.state_dict(), args, tmp_path / "hf")
    run_args, run_model = _moe()
    with pytest.raises(ConfigError) as e:
        load_hf_into_model([run_model], tmp_path / "hf", run_args)
    assert str(e.value).count("\n") == 0
    assert re.fullmatch(r"HF checkpoint \S+ holds a model of moe.top_k=4 rope_theta=10000.0, but this run builds "
                        r"moe.top_k=2 rope_theta=1000000.0 \(qwen3_moe flavor 'debug_moe'\): no shipped qwen3_moe "
                        r"flavor has the checkpoint's values.*", str(e.value)), str(e.value)
    load_hf_into_model([_moe(top_k=4, rope_theta=1e4)[1]], tmp_path / "hf", args)  # its own shape loads


def _checkpointer(run_dir, args, model, **cfg):
    return Checkpointer(CheckpointConfig(**{"enable": True, **cfg}), run_dir, {
        "model": ModelState([model]), "trainer": TrainState(tokens_per_step=1, model_args=args,
                                                            model_name="qwen3_moe")})


def test_a_dcp_checkpoint_of_another_top_k_is_refused_at_resume_and_as_initial_weights(tmp_path):
    args, model = _moe(top_k=4)
    saver = _checkpointer(tmp_path / "a", args, model, interval=1)
    saver.maybe_save(1, last_step=1)
    run_args, run_model = _moe()
    expected = (r"checkpoint \S+step-1 holds a model of moe.top_k=4, but this run builds moe.top_k=2 \(qwen3_moe "
                r"flavor 'debug_moe'\)")
    with pytest.raises(ConfigError, match=expected):  # resume
        _checkpointer(tmp_path / "a", run_args, run_model).load()
    with pytest.raises(ConfigError, match=expected):  # checkpoint.initial_load_path, a DCP folder
        _checkpointer(tmp_path / "b", run_args, run_model,
                      initial_load_path=str(tmp_path / "a" / "checkpoint" / "step-1")).load()
    assert _checkpointer(tmp_path / "a", *_moe(top_k=4)).load() == 1


def test_a_dense_checkpoint_exported_as_moe_or_as_another_flavor_is_refused_and_nothing_written(tmp_path, capsys):
    # before: dcp-to-hf --model qwen3_moe on a dense Qwen3 checkpoint wrote an MoE config over dense weights,
    # exit 0 (transformers then initialised every expert at random); other pairs ended in a KeyError traceback.
    from trainlib.convert import main
    from trainlib.models.qwen3 import Transformer as Dense, get_model_args as dense_args

    args = dense_args("debug")
    model = Dense(args, rope_len=8)
    model.init_weights(seed=0)
    ck = Checkpointer(CheckpointConfig(enable=True, interval=1), tmp_path / "run", {
        "model": ModelState([model]), "trainer": TrainState(tokens_per_step=1, model_args=args, model_name="qwen3")})
    ck.maybe_save(1, last_step=1)
    step = tmp_path / "run" / "checkpoint" / "step-1"
    for flags, what in ((["--model", "qwen3_moe", "--flavor", "debug_moe"], "a qwen3 model, but this export "
                                                                              "asks for qwen3_moe"),
                        (["--model", "llama3", "--flavor", "debug"], "a qwen3 model, but this export asks for "
                                                                      "llama3"),
                        (["--flavor", "debug", "--model", "qwen3_moe"], "a qwen3 model"),
                        (["--model", "llama3"], "a qwen3 model, but this export asks for llama3: drop --model")):
        out = tmp_path / "out"
        assert main(["dcp-to-hf", str(step), str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and what in err and "Traceback" not in err, err
        assert not out.exists()  # nothing written
    assert main(["dcp-to-hf", str(step), str(tmp_path / "ok"), "--model", "qwen3", "--flavor", "debug"]) == 0


def test_a_field_the_recipe_sets_explicitly_may_differ_and_the_start_up_line_names_it(tmp_path, caplog):
    # --model.n_layers=2 over a 4-layer checkpoint: its first 2 blocks start the run, said in one line
    from trainlib.models.llama3 import Transformer, get_model_args

    args = get_model_args("debug")
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    write_hf_folder(model.state_dict(), args, tmp_path / "hf")
    small_args = get_model_args("debug", n_layers=2)
    small = Transformer(small_args, rope_len=8)
    ck = Checkpointer(CheckpointConfig(initial_load_path=str(tmp_path / "hf")), tmp_path / "run", {
        "model": ModelState([small]), "trainer": TrainState(tokens_per_step=1, model_args=small_args,
                                                            model_overrides=("n_layers",))})
    assert ck.load() == 0
    assert torch.equal(small.layers["1"].attention.wq.weight, model.layers["1"].attention.wq.weight)
    assert "records in what the recipe sets (model.n_layers 4 -> 2): the run's values apply" in caplog.text
    wide_args = get_model_args("debug", vocab_size=1024)  # an override that changes a shape is still refused
    with pytest.raises(ConfigError, match=r"holds tok_embeddings.weight of shape \[512, 64\], but this run's "
                                          r"model.vocab_size = 1024 makes it \[1024, 64\]: set model.vocab_size = 512"):
        load_hf_into_model([Transformer(wide_args, rope_len=8)], tmp_path / "hf", wide_args, ("vocab_size",))
