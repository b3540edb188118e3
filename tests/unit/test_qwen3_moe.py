"""The Qwen3-MoE family: the debug model builds, initialises and learns; logits against transformers'
Qwen3-MoE through Hugging Face folders both ways (the hub's per-expert format); FLOPs count the
parameters a token activates; the parallel degrees not built yet are refused in one line; the adapter's
config rules; HF <-> DCP conversion keeps every key."""

import dataclasses
import json
import math

import pytest
import torch

from tests.helpers import sgd_losses
from trainlib.blocks import attention
from trainlib.errors import ConfigError
from trainlib.models import count_params, layers
from trainlib.blocks.moe import MoE, MoEArgs
from trainlib.models.qwen3_moe import (
    SPEC,
    Transformer,
    block_forward_flops,
    block_shapes,
    flops_per_token,
    get_model_args,
    validate_degrees,
)
from trainlib.models.qwen3_moe import state_dict_adapter as adapter

# A tiny Qwen3-MoE: head_dim (16) != hidden / heads, GQA, a dense first layer (mlp_only_layers) then an MoE one.
TINY_HF = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1, vocab_size=256, rope_theta=1e6,
               rms_norm_eps=1e-6, max_position_embeddings=512, attention_bias=False, tie_word_embeddings=False)


def _tokens(b=2, s=24, vocab=256, seed=1):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _scramble_(model: torch.nn.Module, seed: int) -> None:
    """Every weight random at a scale where each part shows in the logits: norm gains away from 1,
    matrices ~ 1/sqrt(fan_in), routers large enough that routing is decisive (no near-ties for the two
    libraries to break differently) and varies from token to token."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif "embed" in name or "tok_embeddings" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            std = 1.0 if name.endswith(("mlp.gate.weight", "router.gate.weight")) else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _logits_hf(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens).logits


# ------------------------------------------------------------------------------------------- the debug model


def test_debug_moe_builds_on_meta_and_cpu_initialises_and_learns():
    args = get_model_args("debug_moe")
    assert (args.n_dense_layers, args.moe.n_experts, args.moe.top_k) == (1, 8, 2)
    with torch.device("meta"):
        meta = Transformer(args, rope_len=32)
    assert list(meta.layers.keys()) == ["0", "1", "2", "3"]
    assert list(dict(meta.named_children())) == ["tok_embeddings", "layers", "norm", "output"]
    assert type(meta.layers["0"]) is layers.TransformerBlock and hasattr(meta.layers["0"], "feed_forward")
    assert all(type(meta.layers[i]) is layers.MoEBlock and isinstance(meta.layers[i].moe, MoE) for i in "123")
    assert isinstance(meta.layers["1"].attention, attention.Attention)
    moe = meta.layers["1"].moe
    assert moe.experts.w1.shape == moe.experts.w3.shape == (8, 32, 64) and moe.experts.w2.shape == (8, 64, 32)
    assert moe.router.gate.weight.shape == (8, 64)
    # initialisation: the MoE's own spec inside an MoE, DecoderLM's elsewhere
    depth = 0.02 / math.sqrt(2 * args.n_layers)
    spec = meta.param_init_spec
    assert spec("layers.1.moe.router.gate.weight") == spec("layers.2.moe.experts.w1") == ("trunc_normal", 0.02)
    assert spec("layers.3.moe.experts.w2") == spec("layers.0.feed_forward.w2.weight") == ("trunc_normal", depth)
    assert spec("layers.1.ffn_norm.weight") == ("ones", 0.0)

    # materialised from meta (as the runtime does) = built and initialised on the CPU; the bias buffers zero
    ref = Transformer(args, rope_len=32)
    ref.init_weights(seed=3)
    meta.to_empty(device="cpu")
    for t in meta.buffers():
        t.fill_(float("nan"))
    meta.init_weights(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(meta.state_dict().values(), ref.state_dict().values(), strict=True))
    assert all(torch.equal(m.expert_bias, torch.zeros(8)) for m in meta.moe_modules())
    assert sorted(n for n in ref.state_dict() if "expert_bias" in n) == [f"layers.{i}.moe.expert_bias" for i in "123"]
    assert ref.layers["2"].moe.experts.w2.std() < 0.5 * ref.layers["2"].moe.experts.w1.std()  # depth-scaled

    tokens = _tokens(s=32, vocab=args.vocab_size)
    assert ref(tokens).shape == (2, 32, args.vocab_size)
    ref.output_in_forward = False
    assert ref(tokens).shape == (2, 32, args.dim)
    ref.output_in_forward = True

    # a few SGD steps on one batch lower its loss (gradients reach router and experts)
    losses = sgd_losses(ref, tokens)
    assert losses[-1] < losses[0] - 0.1, losses
    assert ref.layers["1"].moe.router.gate.weight.grad.abs().sum() > 0


def test_pipeline_stages_without_embedding_and_head_pass_hidden_states():
    args = get_model_args("debug_moe")
    full = Transformer(args, rope_len=16)
    full.init_weights(seed=0)
    first, last = Transformer(args, rope_len=16), Transformer(args, rope_len=16)
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    first.norm = first.output = None
    del first.layers["2"], first.layers["3"]
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    last.init_buffers()  # a stage initialises the MoE buffers of the blocks it holds
    tokens = _tokens(s=16, vocab=args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), full(tokens))


# ------------------------------------------------------------------------------------ transformers parity


def test_logits_match_transformers_through_hf_folders_both_ways(tmp_path):
    """Import: transformers' save_pretrained folder (what the hub holds: one tensor per expert; transformers
    5 fuses them only in memory) read by trainlib's HF reader, logits equal. Export: our weights written by
    trainlib's HF writer in the same per-expert format, loaded by from_pretrained, logits equal, and
    written back by transformers tensor for tensor as we wrote them."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open
    from safetensors.torch import load_file

    from trainlib.checkpoint.hf import load_hf_into_model, read_hf_folder, write_hf_folder

    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY_HF)).float()
    _scramble_(hf, 0)
    hf.save_pretrained(tmp_path / "theirs")
    with safe_open(str(tmp_path / "theirs" / "model.safetensors"), framework="pt") as f:
        written = set(f.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in written and "model.layers.1.mlp.gate.weight" in written
    assert "model.layers.0.mlp.gate_proj.weight" in written and not any("gate_up_proj" in n for n in written)

    tokens = _tokens()
    ref = _logits_hf(hf, tokens)
    routed = hf.model.layers[1].mlp.gate(hf.model.layers[1].post_attention_layernorm(
        hf.model.embed_tokens(tokens)))[2]
    assert routed.unique().numel() == 8  # routing varies: every expert is used

    # HF -> trainlib, through the reader convert and initial loads use
    args, weights = read_hf_folder(tmp_path / "theirs")
    assert type(weights.spec) is type(SPEC) and weights.spec.name == "qwen3_moe"
    assert args == get_model_args("debug_moe", dim=64, n_layers=2, head_dim=16, ffn_dim=96, vocab_size=256,
                                  moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32), max_seq_len=512)
    ours = Transformer(args, rope_len=tokens.shape[1])
    ours.init_weights(seed=1)
    load_hf_into_model([ours], tmp_path / "theirs", args)
    theirs_sd = load_file(tmp_path / "theirs" / "model.safetensors")
    torch.testing.assert_close(ours.layers["1"].moe.experts.w2[5],
                               theirs_sd["model.layers.1.mlp.experts.5.down_proj.weight"], rtol=0, atol=0)
    assert torch.equal(ours.layers["1"].moe.expert_bias, torch.zeros(8))  # no HF counterpart: starts at zero
    with torch.no_grad():
        diff = (ours.eval()(tokens) - ref).abs().max().item()
    assert diff < 1e-5, diff

    # trainlib -> HF: our own weights, written by our writer, loaded by transformers
    src = Transformer(args, rope_len=tokens.shape[1])
    src.init_weights(seed=5)
    _scramble_(src, 6)
    src.layers["1"].moe.expert_bias.fill_(0.5)  # trainlib-only state: not exported
    write_hf_folder(src.state_dict(), args, tmp_path / "ours")
    ours_sd = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(ours_sd) == written  # the hub's names, expert by expert
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_experts"], cfg["mlp_only_layers"]) == (["Qwen3MoeForCausalLM"], 8, [0])
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours")
    assert back.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    src.layers["1"].moe.expert_bias.zero_()  # HF has no bias: compare the model it describes
    with torch.no_grad():
        want = src.eval()(tokens)
    diff_back = (_logits_hf(back, tokens) - want).abs().max().item()
    assert diff_back < 1e-5, diff_back
    assert (want - ref).abs().max() > 1e-1  # two different models: equal logits above are no coincidence
    # the round trip of tensors is exact: transformers writes back what we wrote, and we read back ours
    back.save_pretrained(tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert set(again) == set(ours_sd) and all(torch.equal(again[n], ours_sd[n]) for n in ours_sd)
    _, reread = read_hf_folder(tmp_path / "again")
    src_sd = src.state_dict()
    assert set(reread) == {n for n in src_sd if not n.endswith(("expert_bias", "expert_load"))}
    assert all(torch.equal(reread[n], src_sd[n]) for n in reread)


def test_flavor_shapes_agree_with_transformers_and_the_model_cards():
    """transformers' Qwen3-MoE built on meta from our config of each published flavor has our parameters,
    name for name (per expert); the totals and activated counts are the model cards' (30.5B / 3.3B,
    235B / 22B; activated: the blocks' active parameters, the embedding and the output projection), to the
    digits the cards give."""
    transformers = pytest.importorskip("transformers")
    cards = {"qwen3_30b_a3b": ("30.5", "3.3"), "qwen3_235b_a22b": ("235", "22")}
    for flavor, (total_b, active_b) in cards.items():
        args = get_model_args(flavor)
        with torch.device("meta"):
            ours = Transformer(args, rope_len=8)
        total = count_params(ours)
        active = flops_per_token(args, 0) / 6 + args.vocab_size * args.dim  # + the embedding (a lookup)
        for count, published in ((total, total_b), (active, active_b)):
            digits = len(published.split(".")[1]) if "." in published else 0  # the cards truncate (3.35B: "3.3B")
            assert math.floor(count / 10 ** (9 - digits)) == round(float(published) * 10**digits), (flavor, count)
    args = get_model_args("debug_moe", n_layers=3)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**adapter.hf_config_from_args(args)))
        ours = Transformer(args, rope_len=8)
    theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    n_experts = args.moe.n_experts
    # transformers fuses gate and up per layer in memory: [E, 2 * expert_dim, dim]
    mine = {}
    for n, p in ours.named_parameters():
        if n.endswith("experts.w1"):
            mine[adapter.to_hf_name(n).replace("*.gate_proj.weight", "gate_up_proj")] = (n_experts, 2 * p.shape[1],
                                                                                         p.shape[2])
        elif n.endswith("experts.w2"):
            mine[adapter.to_hf_name(n).replace("*.down_proj.weight", "down_proj")] = tuple(p.shape)
        elif not n.endswith("experts.w3"):
            mine[adapter.to_hf_name(n)] = tuple(p.shape)
    assert mine == theirs


# ------------------------------------------------------------------------------------------------- FLOPs


def _active_params(model: Transformer) -> float:
    """Matmul parameters one token goes through, from the model's own parameters: every block's
    attention projections, a dense block's MLP, an MoE block's router, top_k / n_experts of its routed
    experts and its shared experts; the output projection."""
    total = model.output.weight.numel()
    for block in model.layers.values():
        for name, p in block.named_parameters():
            if "norm" in name:
                continue
            share = block.moe.args.top_k / block.moe.args.n_experts if ".experts." in f".{name}" else 1
            total += p.numel() * share
    return total


@pytest.mark.parametrize("shared", [0, 1], ids=["routed", "shared_expert"])
def test_flops_count_the_parameters_a_token_activates(shared):
    args = get_model_args("debug_moe", moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32, n_shared_experts=shared))
    with torch.device("meta"):
        model = Transformer(args, rope_len=8)
    seq = 128
    attention = 3 * args.n_layers * 4 * args.n_heads * args.head_dim * seq
    assert flops_per_token(args, seq) == 6 * _active_params(model) + attention
    # the average block the planner multiplies by n_layers: the model's blocks exactly, plus the output
    ops = block_forward_flops(args, seq)
    assert math.isclose(3 * (args.n_layers * sum(f for _, f, _ in ops) + 2 * args.vocab_size * args.dim),
                        flops_per_token(args, seq))
    names = [n for n, _, _ in ops]
    assert names == ["wq", "wk", "wv", "attention", "wo", "w1", "w3", "w2", "router", "experts"] + (
        ["shared_experts"] if shared else [])
    shapes = block_shapes(args)
    assert len(shapes) == args.n_layers and shapes[0].ffn_dim == args.ffn_dim
    assert {s.ffn_dim for s in shapes[1:]} == {(2 + shared) * 32}
    # no dense block (the published flavors): the list is the MoE block's, experts priced at top_k experts
    big = get_model_args("qwen3_30b_a3b")
    f = {n: flops for n, flops, _ in block_forward_flops(big, 4096)}
    assert list(f) == ["wq", "wk", "wv", "attention", "wo", "router", "experts"]
    assert f["experts"] == 2 * 3 * 2048 * 768 * 8 and f["router"] == 2 * 2048 * 128
    assert SPEC.flops_per_token is flops_per_token and SPEC.block_shapes is block_shapes


# ------------------------------------------------------------------------------------- parallel degrees


@pytest.mark.parametrize("degrees,message", [
    # issue 54 item 8: the hint lists what both ep rules take (it listed 2, 4 and 8, which dp_shard 6 refuses)
    ({"ep": 3, "dp_shard": 6}, r"^parallelism.ep \(3\) must divide the number of experts \(8\).*pick ep among 1, 2 "
                               r"\(dividing both 8 and dp_shard \* cp \* tp = 6\)$"),
    ({"tp": 3}, r"^model n_heads \(4\) must be divisible by parallelism.tp \(3\)"),
    ({"tp": 2}, None),  # seq_len 255 below
])
def test_bad_degrees_are_refused_in_one_line(degrees, message):
    args = get_model_args("debug_moe")
    if message is None:
        with pytest.raises(ConfigError, match=r"^training.seq_len \(255\) must be divisible by parallelism.tp \(2\)"):
            SPEC.validate(args, degrees, 255)
        return
    with pytest.raises(ConfigError, match=message) as e:
        SPEC.validate(args, degrees, 256)
    assert "\n" not in str(e.value)
    validate_degrees(args, {"dp_shard": 4, "pp": 2, "cp": 2, "tp": 2, "ep": 8}, 256)  # what runs
    tied = dataclasses.replace(args, tie_embeddings=True)
    with pytest.raises(ConfigError, match=r"^this Qwen3-MoE flavor ties the embedding .*\(pp=2\); use pp=1"):
        validate_degrees(tied, {"pp": 2}, 256)


# ------------------------------------------------------------------------------------ the adapter's config


def test_config_round_trip_and_names():
    args = get_model_args("debug_moe")
    assert adapter.args_from_hf_config(adapter.hf_config_from_args(args)) == args
    big = get_model_args("qwen3_235b_a22b")
    assert adapter.args_from_hf_config(adapter.hf_config_from_args(big)) == big
    # as transformers 5 writes the expert count (num_local_experts), and a sparse step that leaves layer 0 dense
    cfg = {k: v for k, v in adapter.hf_config_from_args(args).items() if k != "num_experts"}
    assert adapter.args_from_hf_config({**cfg, "num_local_experts": 8}) == args
    assert adapter.args_from_hf_config({**cfg, "num_local_experts": 8, "num_hidden_layers": 2, "mlp_only_layers": [],
                                        "decoder_sparse_step": 2}).n_dense_layers == 1
    assert adapter.to_hf_name("layers.2.moe.experts.w3") == "model.layers.2.mlp.experts.*.up_proj.weight"
    assert adapter.from_hf_name("model.layers.2.mlp.experts.5.up_proj.weight") == "layers.2.moe.experts.w3"
    assert adapter.from_hf_name("model.layers.2.mlp.gate.weight") == "layers.2.moe.router.gate.weight"
    assert adapter.from_hf_name("model.layers.0.mlp.gate_proj.weight") == "layers.0.feed_forward.w1.weight"
    with torch.device("meta"):
        model = Transformer(args, rope_len=8)
    names = adapter.trainlib_weight_names(model.state_dict(), args)
    assert "layers.1.moe.expert_bias" not in names
    assert names["layers.1.moe.experts.w2"] == tuple(f"model.layers.1.mlp.experts.{e}.down_proj.weight"
                                                     for e in range(8))
    flat = [n for hf in names.values() for n in ((hf,) if isinstance(hf, str) else hf)]
    assert adapter.hf_weight_names(flat, args) == names
    # an expert missing: the stacked weight is left out, for the loader to report
    assert "layers.1.moe.experts.w2" not in adapter.hf_weight_names(
        [n for n in flat if n != "model.layers.1.mlp.experts.3.down_proj.weight"], args)


@pytest.mark.parametrize("change,message", [
    ({"norm_topk_prob": False}, r"^HF config has norm_topk_prob=False, but trainlib's Qwen3-MoE renormalises"),
    ({"mlp_only_layers": [1]}, r"^HF config makes layer\(s\) \[1\] dense .*dense blocks first"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, r"not Qwen3-MoE's \('qwen3_moe', "
                                                                      r"Qwen3MoeForCausalLM\)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type='yarn'"),
    ({"num_experts": 0}, r"a Qwen3-MoE without experts is a dense Qwen3"),
])
def test_configs_this_model_cannot_run_are_refused_in_one_line(change, message):
    base = adapter.hf_config_from_args(get_model_args("debug_moe"))
    with pytest.raises(ConfigError, match=message) as e:
        adapter.args_from_hf_config({**base, **change})
    assert "\n" not in str(e.value)


def test_export_refuses_what_hf_qwen3_moe_cannot_express():
    args = get_model_args("debug_moe", moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32, n_shared_experts=1))
    with pytest.raises(ConfigError, match=r"^model.moe n_shared_experts=1, but Hugging Face's Qwen3-MoE has "
                                          r"n_shared_experts=0 only"):
        adapter.hf_config_from_args(args)


def test_hf_to_dcp_and_back_keeps_every_key_and_value(tmp_path):
    """HF -> DCP -> HF through `python -m trainlib.convert`'s functions: the DCP checkpoint holds every key of
    the model's state dict (the expert bias at zero: HF has none), records the shape (the MoE args
    included), and exports back the same tensors."""
    from safetensors.torch import load_file

    from trainlib.checkpoint.convert import dcp_to_hf, hf_to_dcp, read_dcp_model, saved_model_args
    from trainlib.checkpoint.hf import write_hf_folder

    args = get_model_args("debug_moe", n_layers=2)
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    write_hf_folder(model.state_dict(), args, tmp_path / "hf", max_shard_bytes=200_000)  # experts across files
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert hf_to_dcp(tmp_path / "hf", tmp_path / "dcp") == args == saved_model_args(tmp_path / "dcp")
    sd = read_dcp_model(tmp_path / "dcp")
    assert set(sd) == set(model.state_dict())
    assert all(torch.equal(sd[n], t) for n, t in model.state_dict().items())
    dcp_to_hf(tmp_path / "dcp", tmp_path / "back")
    first = {n: t for f in (tmp_path / "hf").glob("*.safetensors") for n, t in load_file(f).items()}
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(first) and all(torch.equal(back[n], first[n]) for n in first)
