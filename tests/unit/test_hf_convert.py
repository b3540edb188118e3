"""Hugging Face and Meta interop in one process: CLI errors and shape fallbacks, Meta-format import,
refusals of weights of another shape or format."""

import json

import pytest
import torch

from trainlib.models.llama3 import Transformer  # noqa: E402


def test_convert_cli_errors_are_one_line(tmp_path, capsys):
    from trainlib.convert import main

    assert main(["dcp-to-hf", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "not a complete DCP checkpoint" in capsys.readouterr().err
    assert main(["hf-to-dcp", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a Hugging Face checkpoint folder" in capsys.readouterr().err


def test_dcp_to_hf_takes_the_shape_from_the_run_config_when_the_checkpoint_lacks_it(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from trainlib.config import JobConfig, save_config
    from trainlib.convert import main
    from trainlib.models.llama3 import get_model_args

    model = Transformer(get_model_args("debug", n_layers=2), rope_len=8)
    model.init_weights(seed=0)
    ckpt = tmp_path / "run" / "checkpoint" / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)  # no trainer.model_args
    assert main(["dcp-to-hf", str(ckpt), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"trainlib.convert: error: {ckpt} does not record the model shape and no run "
                                       "config.toml is two folders up: pass --model and --flavor\n")
    from trainlib.checkpoint.convert import dcp_to_hf
    from trainlib.errors import ConfigError

    with pytest.raises(ConfigError, match="does not record the model shape: give it"):
        dcp_to_hf(ckpt, tmp_path / "out")
    cfg = JobConfig()
    cfg.model.n_layers = 2
    save_config(cfg, tmp_path / "run" / "config.toml")
    assert main(["dcp-to-hf", str(ckpt), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 2


def test_convert_cli_flavor_dtype_and_shard_size(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from trainlib.convert import main
    from trainlib.models.llama3 import get_model_args

    model = Transformer(get_model_args("debug"), rope_len=8)
    model.init_weights(seed=0)
    ckpt, out = tmp_path / "step-1", tmp_path / "hf"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)  # no shape, no run config
    assert main(["dcp-to-hf", str(ckpt), str(out), "--flavor", "debug"]) == 2
    from trainlib.models.registry import MODELS

    assert capsys.readouterr().err == (f"trainlib.convert: error: {ckpt} does not record its model family: pass "
                                       f"--model ({', '.join(sorted(MODELS))}) with --flavor\n")
    assert main(["dcp-to-hf", str(ckpt), str(out), "--model", "llama3", "--flavor", "debug", "--max-shard-gb",
                 "0"]) == 2
    assert capsys.readouterr().err == "trainlib.convert: error: --max-shard-gb must be > 0, got 0.0\n"
    assert main(["dcp-to-hf", str(ckpt), str(out), "--model", "llama3", "--flavor", "debug", "--dtype",
                 "bfloat16"]) == 0
    assert capsys.readouterr().out == f"wrote 1 safetensors file(s) and config.json to {out}\n"
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert main(["hf-to-dcp", str(out), str(tmp_path / "dcp")]) == 0
    assert capsys.readouterr().out == f"wrote DCP checkpoint {tmp_path / 'dcp'} (llama3, n_layers=4, vocab_size=512)\n"


def _meta_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's rotate-half q/k rows back into Meta's layout, where rotary pairs are
    adjacent rows. HF's convert_llama_weights_to_hf.py permutes Meta's rows
    with view(n_heads, head_dim // 2, 2, dim).transpose(1, 2); its inverse,
    written out by index: within each head, Meta row 2i + j is HF row
    j * head_dim / 2 + i."""
    hd = w.shape[0] // n_heads
    return w[[h * hd + (m % 2) * (hd // 2) + m // 2 for h in range(n_heads) for m in range(hd)]]


def test_meta_consolidated_pth_loads_into_a_model(tmp_path):
    """A Meta reference-format folder built independently from an HF model
    (Meta's names, q/k in Meta's rotary layout, a Llama-2-style rope.freqs
    buffer, Meta's params.json) gives the HF model's logits."""
    transformers = pytest.importorskip("transformers")
    from trainlib.checkpoint.hf import load_meta_into_model
    from trainlib.models.llama3 import get_model_args

    args = get_model_args("debug")  # dim 64, 4 layers, 4 heads, 2 kv heads, rope_theta 1e4, no rope scaling
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)).float().eval()
    with torch.no_grad():  # HF inits norms to 1; random gains catch a swapped norm
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf_sd = hf.state_dict()
    meta = {"tok_embeddings.weight": hf_sd["model.embed_tokens.weight"], "norm.weight": hf_sd["model.norm.weight"],
            "output.weight": hf_sd["lm_head.weight"], "rope.freqs": torch.ones(8)}
    for i in range(4):
        h = f"model.layers.{i}."
        meta |= {
            f"layers.{i}.attention.wq.weight": _meta_rotary_rows(hf_sd[h + "self_attn.q_proj.weight"], 4),
            f"layers.{i}.attention.wk.weight": _meta_rotary_rows(hf_sd[h + "self_attn.k_proj.weight"], 2),
            f"layers.{i}.attention.wv.weight": hf_sd[h + "self_attn.v_proj.weight"],
            f"layers.{i}.attention.wo.weight": hf_sd[h + "self_attn.o_proj.weight"],
            f"layers.{i}.feed_forward.w1.weight": hf_sd[h + "mlp.gate_proj.weight"],
            f"layers.{i}.feed_forward.w2.weight": hf_sd[h + "mlp.down_proj.weight"],
            f"layers.{i}.feed_forward.w3.weight": hf_sd[h + "mlp.up_proj.weight"],
            f"layers.{i}.attention_norm.weight": hf_sd[h + "input_layernorm.weight"],
            f"layers.{i}.ffn_norm.weight": hf_sd[h + "post_attention_layernorm.weight"],
        }
    assert not torch.equal(meta["layers.0.attention.wq.weight"], hf_sd["model.layers.0.self_attn.q_proj.weight"])
    torch.save(meta, tmp_path / "consolidated.00.pth")
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                                                      "vocab_size": 512, "norm_eps": 1e-5, "rope_theta": 10000.0}))
    dst = Transformer(args, rope_len=32)
    dst.init_weights(seed=6)
    load_meta_into_model([dst], tmp_path, args)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (dst.eval()(tokens) - hf(tokens).logits).abs().max() <= 1e-5
    # The same folder as a run's checkpoint.initial_load_path: the Checkpointer takes it for Meta's format.
    from trainlib.checkpoint import CheckpointConfig, Checkpointer, ModelState, TrainState

    run = Transformer(args, rope_len=32)
    run.init_weights(seed=7)
    ck = Checkpointer(CheckpointConfig(initial_load_path=str(tmp_path)), tmp_path / "run",
                      {"model": ModelState([run]), "trainer": TrainState(tokens_per_step=1, model_args=args)})
    assert ck.load() == 0
    assert all(torch.equal(a, b) for a, b in zip(run.state_dict().values(), dst.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="n_layers=2"):
        load_meta_into_model([dst], tmp_path, get_model_args("debug", n_layers=2))
    # The head counts, which the weights alone cannot tell, come from params.json where there is one.
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "n_heads": 8, "n_kv_heads": 1}))
    with pytest.raises(ValueError, match=r"holds a model of n_heads=8 n_kv_heads=1, but this run builds n_heads=4 "
                                         r"n_kv_heads=2 \(llama3 flavor 'debug'\): no shipped llama3 flavor has "
                                         r"the checkpoint's values"):
        load_meta_into_model([dst], tmp_path, args)
    (tmp_path / "params.json").unlink()
    dst.init_weights(seed=8)
    load_meta_into_model([dst], tmp_path, args)
    assert all(torch.equal(a, b) for a, b in zip(run.state_dict().values(), dst.state_dict().values(), strict=True))


def test_weights_of_another_shape_or_format_are_refused_with_the_fix(tmp_path):
    import torch.distributed.checkpoint as dcp

    from trainlib.checkpoint.convert import hf_to_dcp, read_dcp_model, saved_model_args
    from trainlib.checkpoint.hf import checkpoint_format, load_hf_into_model, load_meta_into_model, write_hf_folder
    from trainlib.errors import ConfigError
    from trainlib.models.llama3 import get_model_args

    args = get_model_args("debug")
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    write_hf_folder(model.state_dict(), args, tmp_path / "hf")
    assert checkpoint_format(tmp_path / "hf") == "hf"
    other = Transformer(args, rope_len=8)
    other.init_weights(seed=1)
    load_hf_into_model([other], tmp_path / "hf", args)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True))
    with pytest.raises(ConfigError, match=r"HF checkpoint .* holds a model of n_layers=4, but this run builds "
                                          r"n_layers=2 \(llama3 flavor 'debug'\): set model.n_layers = 4$"):
        load_hf_into_model([other], tmp_path / "hf", get_model_args("debug", n_layers=2))

    assert hf_to_dcp(tmp_path / "hf", tmp_path / "dcp") == saved_model_args(tmp_path / "dcp")
    assert checkpoint_format(tmp_path / "dcp") == "dcp"
    assert set(read_dcp_model(tmp_path / "dcp")) == set(model.state_dict())
    dcp.save({"trainer": {"step": torch.tensor(3)}}, checkpoint_id=str(tmp_path / "no_model"), no_dist=True)
    with pytest.raises(ConfigError, match="holds no model tensors"):
        read_dcp_model(tmp_path / "no_model")

    (tmp_path / "meta").mkdir()
    for n in (0, 1):  # a model-parallel Meta checkpoint
        torch.save({}, tmp_path / "meta" / f"consolidated.0{n}.pth")
    assert checkpoint_format(tmp_path / "meta") == "meta"
    with pytest.raises(ConfigError, match="holds 2 consolidated.*pth files .*convert larger ones to HF format first"):
        load_meta_into_model([other], tmp_path / "meta", args)
    with pytest.raises(ConfigError, match="is neither a DCP checkpoint folder .*, a Hugging Face folder"):
        checkpoint_format(tmp_path / "no_model" / "missing")


def test_hf_import_keeps_only_model_weights_and_export_of_tied_weights_writes_one_matrix(tmp_path):
    """An HF folder may hold tensors that are not weights (old exports saved each layer's rotary
    inv_freq): import skips them, so the model and a converted DCP checkpoint hold exactly the
    model's keys. A tied model exports one matrix (embed_tokens), as transformers writes it."""
    from safetensors.torch import load_file, save_file

    from trainlib.checkpoint.convert import hf_to_dcp, read_dcp_model
    from trainlib.checkpoint.hf import read_hf_folder, write_hf_folder
    from trainlib.models.llama3 import get_model_args

    args = get_model_args("debug", n_layers=2)
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    write_hf_folder(model.state_dict(), args, tmp_path / "hf")
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(hf, tmp_path / "hf" / "model.safetensors")
    _, sd = read_hf_folder(tmp_path / "hf")
    assert set(sd) == set(model.state_dict())
    hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    assert set(read_dcp_model(tmp_path / "dcp")) == set(model.state_dict())

    tied_args = get_model_args("debug", n_layers=2, tie_embeddings=True)
    tied = Transformer(tied_args, rope_len=8)
    tied.init_weights(seed=0)
    write_hf_folder(tied.state_dict(), tied_args, tmp_path / "tied")
    written = load_file(tmp_path / "tied" / "model.safetensors")
    assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written
    _, back = read_hf_folder(tmp_path / "tied")
    assert torch.equal(back["output.weight"], tied.output.weight)


def test_hf_config_whose_head_dim_is_not_dim_over_heads_is_refused():
    from trainlib.checkpoint.hf import args_from_hf_config
    from trainlib.errors import ConfigError

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 192, "vocab_size": 512}
    assert args_from_hf_config({**cfg, "head_dim": 16}).head_dim == 16  # stated, and what dim / heads gives
    with pytest.raises(ConfigError, match="head_dim=32 != hidden_size/num_attention_heads"):
        args_from_hf_config({**cfg, "head_dim": 32})


def _bf16_hf_folder(folder, n_layers: int):
    """(args, model) of a debug model written to `folder` as a bf16 HF folder."""
    from trainlib.checkpoint.hf import write_hf_folder
    from trainlib.models.llama3 import get_model_args

    args = get_model_args("debug", n_layers=n_layers)
    src = Transformer(args, rope_len=8)
    src.init_weights(seed=0)
    write_hf_folder({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, args, folder)
    return args, src


def _track_conversions(monkeypatch):
    """(given, alive_at_read), filled as HF weights are put in trainlib's layout: given holds
    (name, weakref) of each converted weight that is a copy (wq and wk; the rest are views of the
    mapped file), alive_at_read the names still alive at each read."""
    import weakref

    import trainlib.models.llama3.state_dict_adapter as hf_mod

    convert, given, alive_at_read = hf_mod.hf_weight_to_trainlib, [], []

    def tracked(name, t, a):
        alive_at_read.append([n for n, ref in given if ref() is not None])
        out = convert(name, t, a)
        if out is not t:
            given.append((name, weakref.ref(out)))
        return out

    monkeypatch.setattr(hf_mod, "hf_weight_to_trainlib", tracked)
    return given, alive_at_read


def test_hf_import_reads_one_weight_at_a_time_and_casts_no_whole_copy(tmp_path):
    """Each rank loads an HF folder weight by weight from the mapped files: the only copies are wq's
    and wk's rows gathered in trainlib's rotary order (on one device the whole weight), each dropped
    before the next is made, and a bf16 tensor goes into an fp32 parameter by copy_ (no whole fp32
    copy first). Eagerly converted, every rank held all blocks' permuted wq and wk at once (72 GB for
    405B in bf16); measured in docs/checkpointing.md. A sharded rank's gathers are its shard's rows
    (tests/distributed/test_copy_full.py)."""
    import trainlib.checkpoint.hf as hf_mod
    from tests.helpers import NewTensors

    args, src = _bf16_hf_folder(tmp_path / "hf", n_layers=2)
    dst = Transformer(args, rope_len=8)
    dst.init_weights(seed=1)
    with NewTensors() as seen:
        hf_mod.load_hf_into_model([dst], tmp_path / "hf", args)
    rotary = [tuple(p.shape) for name, p in dst.named_parameters() if name.endswith(("wq.weight", "wk.weight"))]
    assert seen.made == [("aten.index_select.default", shape) for shape in rotary], seen.made
    assert not any(seen.alive_before), seen.alive_before
    for (name, got), want in zip(dst.state_dict().items(), src.state_dict().values()):
        assert torch.equal(got, want.to(torch.bfloat16).float()), name


def test_hf_to_dcp_converts_one_weight_at_a_time_and_writes_trainlib_layout(tmp_path, monkeypatch):
    """`hf-to-dcp` saves each weight converted when DCP's writer asks for it, one weight a file: at
    any read at most the weight just written is still alive (eagerly converted, every block's permuted
    wq and wk were held at once: 72 GB for 405B in bf16). What it writes is trainlib's layout, bit for
    bit (the planned tensors are the files' own, in HF's layout)."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainlib.checkpoint.convert import hf_to_dcp, read_dcp_model

    import safetensors

    args, src = _bf16_hf_folder(tmp_path / "hf", n_layers=3)
    given, alive_at_read = _track_conversions(monkeypatch)
    opened, safe_open = [], safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda path, **kw: opened.append(path) or safe_open(path, **kw))
    hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    assert len(given) == 2 * args.n_layers and max(map(len, alive_at_read)) <= 1, alive_at_read
    # Each file is opened once per weight for the planned tensor (the headers that list and check the weights
    # are read without safetensors); the writer converts that tensor (it reopened the file for every weight,
    # doubling the header reads).
    assert len(opened) == len(src.state_dict()), len(opened)
    # DCP's writer keeps a file's tensors until that file is written: one weight per file bounds it.
    storage = FileSystemReader(str(tmp_path / "dcp")).read_metadata().storage_data
    files = [info.relative_path for index, info in storage.items() if index.fqn.startswith("model.")]
    assert len(files) == len(set(files)) == len(src.state_dict()), files
    got = read_dcp_model(tmp_path / "dcp")
    for name, want in src.state_dict().items():
        assert torch.equal(got[name], want.to(torch.bfloat16)), name


def test_an_incomplete_hf_folder_is_refused_naming_what_it_lacks(tmp_path):
    """A sharded folder missing a shard its index lists (an interrupted download), or a folder
    missing some weight: a ConfigError before any weight is copied, not a KeyError mid-load."""
    from safetensors.torch import load_file, save_file

    from trainlib.checkpoint.hf import load_hf_into_model, write_hf_folder
    from trainlib.errors import ConfigError
    from trainlib.models.llama3 import get_model_args

    args = get_model_args("debug", n_layers=2)
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    folder = tmp_path / "hf"
    write_hf_folder(model.state_dict(), args, folder)
    whole = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in whole.items() if ".layers.1." not in k},
              "model-00002-of-00002.safetensors": {k: v for k, v in whole.items() if ".layers.1." in k}}
    for name, tensors in shards.items():
        save_file(tensors, folder / name)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, tensors in shards.items() for k in tensors}}))
    dst = Transformer(args, rope_len=8)
    dst.init_weights(seed=1)
    load_hf_into_model([dst], folder, args)  # whole: loads
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), model.state_dict().values(), strict=True))

    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"lists 1 file\(s\) the folder lacks \(model-00002-of-00002.safetensors\): "
                                          "an incomplete download"):
        load_hf_into_model([dst], folder, args)
    (folder / "model.safetensors.index.json").unlink()  # no index to tell: the weights themselves are missing
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ConfigError, match=r"\S+model-00001-of-00002.safetensors lacks 9 tensor\(s\) config.json's "
                                          r"model has \(model.layers.1.input_layernorm.weight, .*, \.\.\.\): an "
                                          r"incomplete download"):
        load_hf_into_model([Transformer(args, rope_len=8)], folder, args)
    with pytest.raises(ConfigError, match="lacks 9 tensor"):
        load_hf_into_model([dst], folder, args)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())  # nothing copied


def test_dcp_to_hf_writes_files_of_a_bounded_size_reading_one_file_of_weights_at_a_time(tmp_path, monkeypatch):
    """The export never holds the model: it reads one output file's weights from the checkpoint,
    writes that file and drops them (a 405B checkpoint is 1.6 TB in fp32). The files and their index
    are transformers' sharded layout, neighbouring blocks in the same or the next file (blocks 2 and
    10 are not neighbours); a later export into the folder replaces them all."""
    import weakref

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from trainlib.checkpoint.convert import DCPWeights, dcp_to_hf
    from trainlib.checkpoint.hf import read_hf_folder
    from trainlib.checkpoint.state import TrainState
    from trainlib.models.llama3 import get_model_args

    args = get_model_args("debug", n_layers=12)
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    dcp.save({"model": model.state_dict(), "trainer": TrainState(model_args=args)},
             checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    read, limit = [], 75_000  # bytes of bf16 files; a block is 98,560 in bf16, embedding and output 65,536 each
    earlier: list[weakref.ref] = []

    def recording(self, names):
        assert all(ref() is None for ref in earlier), "a file's weights outlived its file"
        got = read_many(self, names)
        read.append(sum(t.numel() * t.element_size() for t in got.values()))
        earlier.extend(weakref.ref(t) for t in got.values())
        return got

    read_many = DCPWeights.read_many
    monkeypatch.setattr(DCPWeights, "read_many", recording)
    metadata_reads = []  # a large checkpoint's .metadata lists every rank's chunk of every tensor: read it once
    read_metadata = FileSystemReader.read_metadata
    monkeypatch.setattr(FileSystemReader, "read_metadata", lambda self: metadata_reads.append(1) or read_metadata(self))
    out = dcp_to_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=limit, dtype=torch.bfloat16)
    assert len(metadata_reads) == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 12 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    file_of_block = [sorted({files.index(f) for k, f in index["weight_map"].items() if f".layers.{i}." in k})
                     for i in range(12)]
    assert all(a[-1] <= b[0] <= a[-1] + 1 for a, b in zip(file_of_block, file_of_block[1:])), file_of_block
    assert sorted(p.name for p in out.glob("*.safetensors")) == files and len(read) == n
    # Each read is one file's weights (in fp32, the file's twice) and each file within the limit.
    sizes = [sum(t.numel() * t.element_size() for t in load_file(out / f).values()) for f in files]
    assert read == [2 * s for s in sizes] and all(s <= limit for s in sizes), (sizes, limit)
    assert all(a + b > limit for a, b in zip(sizes, sizes[1:])), sizes  # filled: no two neighbours would fit in one
    assert index["metadata"]["total_size"] == sum(sizes)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, back = read_hf_folder(out)
    assert set(back) == set(model.state_dict())
    assert torch.equal(DCPWeights(tmp_path / "ckpt")["layers.11.ffn_norm.weight"], model.layers["11"].ffn_norm.weight)
    for name, want in model.state_dict().items():
        assert torch.equal(back[name], want.to(torch.bfloat16)), name

    dcp_to_hf(tmp_path / "ckpt", out)  # default size: one file, and none of the others left behind
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_tied_checkpoint_starts_an_untied_model_with_its_output_as_the_embedding(tmp_path):
    """HF and Meta folders of a tied model (Llama 3.2 1B/3B) store one matrix; an untied model
    of that shape starts with both its embedding and its output projection from it."""
    from trainlib.checkpoint.hf import load_hf_into_model, load_meta_into_model, write_hf_folder
    from trainlib.models.llama3 import get_model_args

    tied_args = get_model_args("debug", n_layers=2, tie_embeddings=True)
    tied = Transformer(tied_args, rope_len=8)
    tied.init_weights(seed=0)
    write_hf_folder(tied.state_dict(), tied_args, tmp_path / "hf")
    (tmp_path / "meta").mkdir()
    torch.save({k: v for k, v in tied.state_dict().items() if k != "output.weight"},
               tmp_path / "meta" / "consolidated.00.pth")
    args = get_model_args("debug", n_layers=2)
    for load, folder in ((load_hf_into_model, "hf"), (load_meta_into_model, "meta")):
        untied = Transformer(args, rope_len=8)
        untied.init_weights(seed=1)
        load([untied], tmp_path / folder, args)
        assert torch.equal(untied.output.weight, tied.tok_embeddings.weight), folder
        assert torch.equal(untied.tok_embeddings.weight, tied.tok_embeddings.weight), folder


def test_an_hf_folder_no_family_reads_or_of_another_family_is_one_line(tmp_path):
    from safetensors.torch import save_file

    from trainlib.checkpoint.hf import load_hf_into_model, read_hf_folder, write_hf_folder
    from trainlib.errors import ConfigError
    from trainlib.models.llama3 import get_model_args
    from trainlib.models.qwen3 import Transformer as Qwen3, get_model_args as qwen3_args

    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "mistral" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"^\S+config.json is a Hugging Face model of architecture "
                                          r"\['MistralForCausalLM'\], which no trainlib family reads \(llama3: "
                                          r"LlamaForCausalLM; qwen3: Qwen3ForCausalLM; qwen3_moe: "
                                          r"Qwen3MoeForCausalLM; deepseek_v3: DeepseekV3ForCausalLM\); convert it"):
        read_hf_folder(tmp_path / "mistral")
    args = qwen3_args("debug")
    src = Qwen3(args, rope_len=8)
    src.init_weights(seed=0)
    write_hf_folder(src.state_dict(), args, tmp_path / "qwen3")
    llama = Transformer(get_model_args("debug"), rope_len=8)
    with pytest.raises(ConfigError, match=r"^HF checkpoint \S+ holds a qwen3 model, but this run builds llama3: "
                                          r"set model.name = 'qwen3'"):
        load_hf_into_model([llama], tmp_path / "qwen3", get_model_args("debug"))
