"""Hugging Face interop: logits match transformers after import and after export."""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, run_cli

transformers = pytest.importorskip("transformers")

from trainlib.checkpoint.hf import args_from_hf_config, spec_of_args  # noqa: E402
from trainlib.checkpoint.convert import dcp_to_hf, hf_to_dcp, read_dcp_model  # noqa: E402

# The trainlib `debug` flavor's shape, so a training run can start from it.
DEBUG_SHAPE = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=4096,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)

# Llama 3.1 rope scaling and tied embeddings (as Llama 3.2 1B/3B).
SCALED_TIED = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=300, rope_theta=500000.0, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})

# Qwen3: head_dim independent of hidden_size / heads, QK-norm, rope theta 1e6; the debug_qwen3 recipe's shape,
# and a tied one (as Qwen3 0.6B-4B).
QWEN3_DEBUG = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=512, rope_theta=1e6, max_position_embeddings=4096,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_TIED = {**QWEN3_DEBUG, "num_hidden_layers": 2, "vocab_size": 300, "tie_word_embeddings": True}
HF_CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}


def _hf_model(shape, seed=0, family="llama"):
    torch.manual_seed(seed)
    config_cls, model_cls = HF_CLASSES[family]
    extra = {"mlp_bias": False} if family == "llama" else {}
    cfg = config_cls(**shape, attention_bias=False, **extra)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # HF inits norms to 1; random gains catch a swapped norm
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _trainlib_logits(args, sd, tokens):
    model = spec_of_args(args).model_cls(args, rope_len=tokens.shape[1])
    model.init_buffers()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        return model.eval()(tokens)


def _convert_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "trainlib.convert", *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("family,shape,shard", [("llama", SCALED_TIED, None), ("llama", DEBUG_SHAPE, "40KB"),
                                                ("qwen3", QWEN3_TIED, None), ("qwen3", QWEN3_DEBUG, "40KB")],
                         ids=["scaled_tied", "sharded", "qwen3_tied", "qwen3_sharded"])
def test_import_export_roundtrip_logits(tmp_path, family, shape, shard):
    hf = _hf_model(shape, family=family)
    hf_dir, dcp_dir, out_dir = tmp_path / "hf", tmp_path / "dcp", tmp_path / "export"
    hf.save_pretrained(hf_dir, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (hf_dir / "model.safetensors.index.json").exists()
    tokens = torch.randint(0, shape["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits

    if shard:  # the CLI contract, once; functions otherwise
        _convert_cli("hf-to-dcp", hf_dir, dcp_dir)
    else:
        hf_to_dcp(hf_dir, dcp_dir)
    sd = read_dcp_model(dcp_dir)
    args = args_from_hf_config(json.loads((hf_dir / "config.json").read_text()))
    assert (_trainlib_logits(args, sd, tokens) - ref).abs().max() <= 1e-5

    if shard:  # exported in files of at most 40 kB too, which transformers reads through their index
        _convert_cli("dcp-to-hf", dcp_dir, out_dir, "--max-shard-gb=0.00004")
        assert len(list(out_dir.glob("model-*-of-*.safetensors"))) > 1
    else:
        dcp_to_hf(dcp_dir, out_dir)
    back = HF_CLASSES[family][1].from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(tokens).logits - ref).abs().max() <= 1e-5
    assert type(back.config).__name__ == HF_CLASSES[family][0].__name__


@pytest.mark.parametrize("family,recipe,shape,layout", [
    ("llama", "debug", DEBUG_SHAPE, ["--parallelism.dp_shard=2"]),
    # tied embeddings under TP: the lookup and the output projection shard the one matrix
    ("qwen3", "debug_qwen3", {**QWEN3_DEBUG, "tie_word_embeddings": True},
     ["--parallelism.dp_shard=1", "--parallelism.tp=2", "--model.flavor=debug_tied"]),
], ids=["llama_fsdp2", "qwen3_tied_tp2"])
def test_train_from_hf_and_export_hf(tmp_path, family, recipe, shape, layout):
    """Recipe keys: start from an HF folder, train sharded (FSDP2, TP2), export
    HF at the end from the sharded checkpoint; the first loss is the HF model's loss."""
    from trainlib.data import (
        DataConfig,
        TokenizerConfig,
        build_dataloader,
        build_tokenizer,
    )

    hf = _hf_model(shape, seed=3, family=family)
    hf.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    proc = run_cli(["--recipe", recipe, "--training.steps=2", "--metrics.log_freq=1",
                    "--training.seq_len=64", "--training.global_batch_size=8", f"--job.dump_folder={run}",
                    "--checkpoint.enable=true", f"--checkpoint.initial_load_path={tmp_path / 'hf'}",
                    "--checkpoint.export_hf=true", *layout], nproc=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    batch = next(build_dataloader(DataConfig(), build_tokenizer(TokenizerConfig(kind="byte")), 64, 8))
    with torch.no_grad():
        logits = hf(batch["input"]).logits
    hf_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(first - hf_loss) <= 1e-5 * hf_loss

    # The export equals the final (sharded) checkpoint, read back in one process.
    exported = HF_CLASSES[family][1].from_pretrained(run / "hf", dtype=torch.float32).eval()
    sd = read_dcp_model(run / "checkpoint" / "step-2")
    args = args_from_hf_config(json.loads((run / "hf" / "config.json").read_text()))
    with torch.no_grad():
        diff = (exported(batch["input"]).logits - _trainlib_logits(args, sd, batch["input"])).abs().max()
    assert diff <= 1e-5




# A Llama shape no shipped flavor has (width 48, 6 heads of 8, 3 blocks, rope theta 2e4, vocab 384).
UNSHIPPED = dict(hidden_size=48, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, vocab_size=384, rope_theta=20000.0, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)


def test_a_hub_shape_no_flavor_has_converts_plans_trains_and_exports(tmp_path):
    """Issue 54 item 2: model.flavor = 'from_checkpoint' takes the shape the checkpoint records, so an HF
    checkpoint of a shape no flavor has converts, is planned, trains and exports (before: refused, pointing
    at a flavor that does not exist)."""
    from trainlib.convert import main as convert

    hf = _hf_model(UNSHIPPED, seed=5)
    hf.save_pretrained(tmp_path / "hf")
    assert convert(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    run = tmp_path / "run"
    recipe = ["--recipe", "debug", "--model.flavor=from_checkpoint", f"--checkpoint.initial_load_path={tmp_path / 'dcp'}",
              "--training.seq_len=64", "--training.global_batch_size=4"]
    # The planner plans it like a shipped flavor: the checkpoint's parameters.
    plan = subprocess.run([sys.executable, "-m", "trainlib.plan", *recipe, "--world-size=2", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert json.loads(plan.stdout)["n_params"] == sum(p.numel() for p in hf.parameters()), plan.stdout[:2000]
    proc = run_cli([*recipe, "--training.steps=2", "--metrics.log_freq=1", f"--job.dump_folder={run}",
                    "--checkpoint.enable=true", "--checkpoint.export_hf=true"])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    exported = json.loads((run / "hf" / "config.json").read_text())
    assert {k: exported[k] for k in UNSHIPPED} == UNSHIPPED
    back = transformers.LlamaForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
    assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in hf.parameters())

    # A named flavor on the same checkpoint is refused, pointing to from_checkpoint.
    proc = run_cli(["--recipe", "debug", f"--checkpoint.initial_load_path={tmp_path / 'dcp'}", "--training.steps=1",
                    f"--job.dump_folder={tmp_path / 'named'}", "--checkpoint.enable=true"])
    assert proc.returncode == 2 and "model.flavor = 'from_checkpoint'" in proc.stderr, proc.stderr[-2000:]
