"""The DeepSeek-V3 family: the debug model builds, initialises and learns; MTP's forward against a plain
reference; logits against transformers' DeepseekV3ForCausalLM through `python -m trainlib.convert` both ways;
the hub's MTP names and a reference of the MTP depth from the imported weights; float8 block-scaled weights
dequantized on import; FLOPs, published sizes, parameter roles and the one-line refusals."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import sgd_losses
from trainlib.blocks import attention
from trainlib.blocks.moe import MoE, MoEArgs, moe_layers
from trainlib.errors import ConfigError
from trainlib.models import layers
from trainlib.models.deepseek_v3 import (
    MLA,
    MTPModule,
    Transformer,
    block_forward_flops,
    flops_per_token,
    get_model_args,
    param_role,
    validate_degrees,
)
from trainlib.models.deepseek_v3 import state_dict_adapter as adapter

# A tiny DeepSeek-V3: q-LoRA, YaRN, sigmoid scores in 4 groups keeping 2, a dense first layer, a shared expert.
TINY_HF = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=192,
               moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
               n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
               vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
               num_nextn_predict_layers=0,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                "mscale": 1.0, "mscale_all_dim": 1.0})


def _tokens(b=2, s=24, vocab=256, seed=1):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _scramble_(model: torch.nn.Module, seed: int) -> None:
    """Every weight random at a scale where each part shows in the logits (norm gains away from 1, matrices
    ~ 1/sqrt(fan_in), routers decisive), and the experts' score-correction bias nonzero."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif "embed" in name or "tok_embeddings" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            std = 1.0 if name.endswith(("mlp.gate.weight", "router.gate.weight")) else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)
    for name, b in model.named_buffers():
        if name.endswith(("e_score_correction_bias", "expert_bias")):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def _hf_model(transformers, seed=0, **overrides):
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TINY_HF, **overrides})).float()
    _scramble_(hf, seed)
    return hf.eval()


def _dcp_of(model: Transformer, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from trainlib.checkpoint.state import TrainState

    dcp.save({"model": model.state_dict(), "trainer": TrainState(model_args=model.args, model_name="deepseek_v3")},
             storage_writer=FileSystemWriter(str(path)), no_dist=True)


def _load_dcp(path) -> Transformer:
    from trainlib.checkpoint.convert import read_dcp_model, saved_model_args

    args = saved_model_args(path)
    model = Transformer(args, rope_len=64)
    model.load_state_dict(read_dcp_model(path), strict=True)
    return model.eval()


# ------------------------------------------------------------------------------------------- the debug model


def test_debug_deepseek_builds_on_meta_and_cpu_initialises_and_learns():
    args = get_model_args("debug_deepseek")
    m = args.moe
    assert (args.q_lora_rank > 0, m.score_func, m.n_experts, m.n_groups, m.topk_groups, m.group_score,
            args.n_dense_layers, m.n_shared_experts, args.mtp_depth) == (True, "sigmoid", 8, 4, 2, "top2_sum", 1, 1, 1)
    assert get_model_args("debug") == args
    with torch.device("meta"):
        meta = Transformer(args, rope_len=32)
    assert list(dict(meta.named_children())) == ["tok_embeddings", "layers", "norm", "output", "mtp"]
    assert type(meta.layers["0"]) is layers.TransformerBlock and isinstance(meta.layers["0"].attention, MLA)
    assert all(type(meta.layers[i]) is layers.MoEBlock and isinstance(meta.layers[i].moe, MoE) for i in "123")
    assert isinstance(meta.layers["1"].attention, attention.Attention)
    mtp = meta.mtp["0"]
    assert type(mtp) is MTPModule and type(mtp.transformer_layer) is layers.MoEBlock and mtp.eh_proj.weight.shape == (64, 128)
    att = meta.layers["1"].attention
    assert (att.wq_a.weight.shape, att.wq_b.weight.shape, att.wkv_a.weight.shape, att.wkv_b.weight.shape,
            att.wo.weight.shape) == ((32, 64), (4 * 24, 32), (32 + 8, 64), (4 * 32, 32), (64, 64))
    assert not hasattr(Transformer(get_model_args("debug", q_lora_rank=0), rope_len=8).layers["0"].attention, "wq_a")
    # YaRN: the scale carries mscale^2, the table the frequencies blended by the ramp
    assert att.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2)

    # materialised from meta (as the runtime does) = built and initialised on the CPU
    ref = Transformer(args, rope_len=32)
    ref.init_weights(seed=3)
    meta.to_empty(device="cpu")
    for t in meta.buffers():
        t.fill_(float("nan"))
    meta.init_weights(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(meta.state_dict().values(), ref.state_dict().values(), strict=True))
    assert sorted(moe_layers([ref])) == [1, 2, 3, 4]  # the MTP block's MoE after the blocks, as the hub numbers it
    assert sorted(n for n in ref.state_dict() if "expert_bias" in n) == [
        *(f"layers.{i}.moe.expert_bias" for i in "123"), "mtp.0.transformer_layer.moe.expert_bias"]
    depth = 0.02 / math.sqrt(2 * args.n_layers)
    spec = ref.param_init_spec
    assert spec("mtp.0.transformer_layer.moe.experts.w2") == spec("layers.1.attention.wo.weight") == ("trunc_normal", depth)
    assert spec("mtp.0.enorm.weight") == spec("layers.2.attention.kv_norm.weight") == ("ones", 0.0)

    # a few SGD steps on one batch lower its loss (gradients reach the router, experts and latents)
    tokens = _tokens(s=33, vocab=args.vocab_size)
    losses = sgd_losses(ref, tokens)
    assert losses[-1] < losses[0] - 0.1, losses
    assert ref.layers["1"].moe.router.gate.weight.grad.abs().sum() > 0
    assert ref.layers["2"].attention.wkv_a.weight.grad.abs().sum() > 0


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_forward_matches_a_plain_reference():
    """Depth k: h_k = block_k(eh_proj_k(cat(enorm_k(embed(t_{+k})), hnorm_k(h_{k-1})))), out_k =
    output(norm_k(h_k)), h_0 the last block's output before the final norm; two depths, each its own
    weights; the shared embedding and head; the main output as without MTP inputs."""
    args = get_model_args("debug", mtp_depth=2)
    model = Transformer(args, rope_len=16)
    model.init_weights(seed=0)
    _scramble_(model, 1)
    tokens = _tokens(s=16, vocab=args.vocab_size)
    shifted = [torch.roll(tokens, -k, dims=1) for k in (1, 2)]  # any [b, s] tokens do
    with torch.no_grad():
        main, *outs = model(tokens, mtp_inputs=shifted)
        assert torch.equal(main, model(tokens))
        h = model.tok_embeddings(tokens)
        for layer in model.layers.values():
            h = layer(h, model.rope)
        want = []
        for k in range(2):
            mod = model.mtp[str(k)]
            x = torch.cat([_rms(model.tok_embeddings.weight[shifted[k]], mod.enorm.weight),
                           _rms(h, mod.hnorm.weight)], dim=-1) @ mod.eh_proj.weight.T
            h = mod.transformer_layer(x, model.rope)
            want.append(_rms(h, mod.norm.weight) @ model.output.weight.T)
        for got, ref in zip(outs, want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert (outs[0] - outs[1]).abs().max() > 1e-2
        model.output_in_forward = False  # the chunked loss applies the head: the normed hidden states come back
        _, *hidden = model(tokens, mtp_inputs=shifted)
        torch.testing.assert_close(hidden[1] @ model.output.weight.T, want[1], rtol=1e-5, atol=1e-5)
        # embedded inputs (a pipeline's last stage has no embedding) give the same
        model.output_in_forward = True
        _, *again = model(tokens, mtp_inputs=[model.tok_embeddings(t) for t in shifted])
        assert all(torch.equal(a, b) for a, b in zip(again, outs))
    with pytest.raises(ValueError, match="forward got 1 MTP inputs; this model has 2 MTP depths"):
        model(tokens, mtp_inputs=shifted[:1])


# ------------------------------------------------------------------------------------ transformers parity


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_logits_match_transformers_through_convert_both_ways(tmp_path, q_lora_rank):
    """Import: transformers' save_pretrained folder -> `python -m trainlib.convert hf-to-dcp` -> our model:
    logits within 1e-5 (fp32). Export: our scrambled weights in a DCP checkpoint -> `dcp-to-hf` ->
    from_pretrained: logits within 1e-5. The score-correction bias travels both ways."""
    transformers = pytest.importorskip("transformers")
    from trainlib.convert import main as convert

    hf = _hf_model(transformers, q_lora_rank=q_lora_rank)
    hf.save_pretrained(tmp_path / "theirs")
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(tokens).logits
    routed = hf.model.layers[1].mlp.gate(hf.model.layers[1].post_attention_layernorm(hf.model.embed_tokens(tokens)))[2]
    assert routed.unique().numel() == 8  # routing varies: every expert is used

    assert convert(["hf-to-dcp", str(tmp_path / "theirs"), str(tmp_path / "dcp")]) == 0
    ours = _load_dcp(tmp_path / "dcp")
    a = ours.args
    assert (a.q_lora_rank, a.rope_factor, a.original_seq_len, a.moe.n_groups, a.moe.topk_groups, a.moe.route_scale,
            a.moe.group_score, a.n_dense_layers, a.mtp_depth) == (q_lora_rank or 0, 4.0, 64, 4, 2, 2.5, "top2_sum", 1, 0)
    torch.testing.assert_close(ours.layers["1"].moe.expert_bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    with torch.no_grad():
        diff = (ours(tokens) - ref).abs().max().item()
    assert diff < 1e-5, diff
    # a run's initial load from the folder (checkpoint.initial_load_path) takes the bias buffer too
    from trainlib.checkpoint.hf import load_hf_into_model

    direct = Transformer(a, rope_len=64)
    direct.init_weights(seed=9)
    load_hf_into_model([direct], tmp_path / "theirs", a)
    assert all(torch.equal(t, ours.state_dict()[n]) for n, t in direct.state_dict().items())

    src = Transformer(a, rope_len=64)
    src.init_weights(seed=5)
    _scramble_(src, 6)
    _dcp_of(src, tmp_path / "src")
    assert convert(["dcp-to-hf", str(tmp_path / "src"), str(tmp_path / "ours")]) == 0
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    torch.testing.assert_close(back.model.layers[1].mlp.gate.e_score_correction_bias, src.layers["1"].moe.expert_bias)
    with torch.no_grad():
        want = src.eval()(tokens)
        diff_back = (back(tokens).logits - want).abs().max().item()
    assert diff_back < 1e-5, diff_back
    assert (want - ref).abs().max() > 1e-1  # two different models: equal logits above are no coincidence


def test_mtp_weights_use_the_hubs_names_and_an_independent_reference(tmp_path):
    """The MTP module is exported under the hub's `model.layers.{n_layers}.*` names (enorm, hnorm, eh_proj,
    shared_head.norm/head, embed_tokens, the decoder block's), and imported back exactly; the depth-1
    logits of the imported weights equal a reference built from those files alone: transformers' own
    decoder layer as the MTP block, the MTP module's norms and projection written out."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from trainlib.checkpoint.convert import hf_to_dcp
    from trainlib.checkpoint.hf import write_hf_folder

    args = adapter.args_from_hf_config({**TINY_HF, "num_nextn_predict_layers": 1,
                                        "architectures": ["DeepseekV3ForCausalLM"]})
    src = Transformer(args, rope_len=64)
    src.init_weights(seed=2)
    _scramble_(src, 3)
    write_hf_folder(src.state_dict(), args, tmp_path / "hub")
    sd = load_file(tmp_path / "hub" / "model.safetensors")
    mtp_names = {n.removeprefix("model.layers.2.") for n in sd if n.startswith("model.layers.2.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "embed_tokens.weight", "self_attn.q_a_proj.weight", "mlp.gate.e_score_correction_bias",
            "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"} <= mtp_names
    assert torch.equal(sd["model.layers.2.shared_head.head.weight"], sd["lm_head.weight"])
    assert torch.equal(sd["model.layers.2.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    hf_to_dcp(tmp_path / "hub", tmp_path / "dcp")
    ours = _load_dcp(tmp_path / "dcp")
    assert all(torch.equal(t, src.state_dict()[n]) for n, t in ours.state_dict().items())

    # the reference, from the files: transformers' main model (h_0: its last layer's output), then the MTP layer
    config = transformers.DeepseekV3Config(**TINY_HF)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hub").eval()  # drops layer 2 (MTP)
    block = type(hf.model.layers[1])(config, layer_idx=1).eval()  # an MoE decoder layer, filled from layer 2
    prefix = "model.layers.2."
    own = {n.removeprefix(prefix): t for n, t in sd.items() if n.startswith(prefix)}
    fused = {"mlp.experts.gate_up_proj": torch.stack([torch.cat([own[f"mlp.experts.{e}.gate_proj.weight"],
                                                                 own[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(8)]),
             "mlp.experts.down_proj": torch.stack([own[f"mlp.experts.{e}.down_proj.weight"] for e in range(8)])}
    block.load_state_dict({**{n: own[n] for n in block.state_dict() if n in own}, **fused}, strict=True)
    tokens = _tokens(s=20)
    nxt = torch.roll(tokens, -1, dims=1)
    with torch.no_grad():
        captured = []
        hook = hf.model.layers[-1].register_forward_hook(lambda mod, inputs, output: captured.append(output))
        out = hf(tokens)
        hook.remove()
        h0 = captured[0] if torch.is_tensor(captured[0]) else captured[0][0]  # the last layer's output, before the norm
        x = torch.cat([_rms(own["embed_tokens.weight"][nxt], own["enorm.weight"]), _rms(h0, own["hnorm.weight"])], -1)
        x = x @ own["eh_proj.weight"].T
        pos = torch.arange(20)[None]
        h1 = block(x, position_embeddings=hf.model.rotary_emb(x, pos),
                   attention_mask=torch.full((20, 20), float("-inf")).triu(1)[None, None])
        want = _rms(h1, own["shared_head.norm.weight"]) @ own["shared_head.head.weight"].T
        main, got = ours(tokens, mtp_inputs=[nxt])
    assert (main - out.logits).abs().max() < 1e-5
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, diff
    # and the MTP loss the two give
    loss = lambda logits: F.cross_entropy(logits[:, :-2].flatten(0, 1), tokens[:, 2:].flatten())  # noqa: E731
    assert abs(loss(got).item() - loss(want).item()) < 1e-5


def test_float8_block_scaled_weights_dequantize_on_import(tmp_path):
    """A hub-style float8 checkpoint (e4m3 weights, a `weight_scale_inv` per 128 x 128 block,
    quantization_config in config.json) imports as the dequantized weights: each block times its scale."""
    from safetensors.torch import load_file, save_file

    from trainlib.checkpoint.hf import read_hf_folder, write_hf_folder

    args = get_model_args("debug", n_layers=2, mtp_depth=0, ffn_dim=320)  # a dense MLP of 320 x 64: 3 row blocks
    src = Transformer(args, rope_len=8)
    src.init_weights(seed=0)
    write_hf_folder(src.state_dict(), args, tmp_path / "hf")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    quantized, g = {}, torch.Generator().manual_seed(0)
    for name, t in sd.items():
        if t.dim() == 2 and "proj" in name:  # the hub quantizes the projections, not norms, router or embedding
            scale = torch.rand((t.shape[0] + 127) // 128, (t.shape[1] + 127) // 128, generator=g) + 0.5
            quantized[name] = (t * 100).to(torch.float8_e4m3fn)
            quantized[name + "_scale_inv"] = scale
        else:
            quantized[name] = t
    save_file(quantized, str(tmp_path / "hf" / "model.safetensors"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))

    _, weights = read_hf_folder(tmp_path / "hf")
    w1 = weights["layers.0.feed_forward.w1.weight"]
    fp8, scale = quantized["model.layers.0.mlp.gate_proj.weight"], quantized["model.layers.0.mlp.gate_proj.weight_scale_inv"]
    assert w1.dtype == torch.float32 and w1.shape == (320, 64) and scale.shape == (3, 1)
    for i in range(3):
        rows = slice(128 * i, 128 * (i + 1))
        assert torch.equal(w1[rows], fp8[rows].float() * scale[i, 0])
    experts = weights["layers.1.moe.experts.w2"]  # stacked from per-expert float8 tensors
    e3 = quantized["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert torch.equal(experts[3], e3.float() * quantized["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"])
    assert weights.planned("layers.1.moe.experts.w2").dtype == torch.float32
    torch.testing.assert_close(w1 / scale.repeat_interleave(128, 0)[:320] / 100, src.layers["0"].feed_forward.w1.weight,
                               rtol=0.07, atol=2e-4)  # e4m3's 3-bit mantissa
    assert not any(n.endswith("_scale_inv") for n in weights)
    # hf-to-dcp plans a float8 weight on a meta tensor (no dequantized copy of the model at once) and writes
    # the dequantized values
    planned = weights.planned("layers.0.feed_forward.w1.weight")
    assert planned.is_meta and planned.dtype == torch.float32 and planned.shape == (320, 64)
    from trainlib.checkpoint.convert import hf_to_dcp, read_dcp_model

    hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")
    assert torch.equal(read_dcp_model(tmp_path / "dcp")["layers.0.feed_forward.w1.weight"], w1)


# ------------------------------------------------------------------------------------ sizes and rules


@pytest.mark.parametrize("flavor,total,main", [("deepseek_v3_671b", 682.6e9, 671.0e9), ("kimi_k2", 1026.4e9, 1026.4e9),
                                               ("deepseek_v3_16b", 15.71e9, 15.71e9)])
def test_published_sizes(flavor, total, main):
    """671B without its MTP module (DeepSeek-V3's report: 671B, and 14B more with MTP's head and embedding
    copies), Kimi K2's 1.04T as counted by its config (1.026e12 here), DeepSeek-V2-Lite's 15.7B."""
    with torch.device("meta"):
        model = Transformer(get_model_args(flavor), rope_len=1)
    n = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    assert n == pytest.approx(total, rel=1e-3) and n - mtp == pytest.approx(main, rel=1e-3)


def test_flops_count_the_parameters_a_token_activates():
    args = get_model_args("debug")
    model = Transformer(args, rope_len=8)
    seq = 64

    def matmul_params(module):
        return sum(p.numel() for n, p in module.named_parameters() if "norm" not in n)

    m = args.moe
    moe_block = model.layers["1"]
    active_moe = (matmul_params(moe_block) - 3 * m.expert_dim * args.dim * (m.n_experts - m.top_k))
    active = matmul_params(model.layers["0"]) + 3 * active_moe
    attention_flops = 2 * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq
    blocks = 2 * active + args.n_layers * attention_flops
    assert sum(f for _, f, _ in block_forward_flops(args, seq)) * args.n_layers == pytest.approx(blocks)
    mtp = 2 * (active_moe + 2 * args.dim * args.dim) + attention_flops + 2 * args.vocab_size * args.dim
    assert flops_per_token(args, seq) == pytest.approx(3 * (blocks + 2 * args.vocab_size * args.dim + mtp))


def test_param_role_names_every_parameter():
    model = Transformer(get_model_args("debug"), rope_len=8)
    roles = {name: param_role(name) for name, _ in model.named_parameters()}
    assert set(roles.values()) == {"embedding", "output", "norm", "router", "expert", "matrix"}
    assert roles["tok_embeddings.weight"] == "embedding" and roles["output.weight"] == "output"
    assert all(roles[n] == "norm" for n in ("norm.weight", "mtp.0.enorm.weight", "layers.1.attention.q_norm.weight",
                                            "mtp.0.transformer_layer.attention.kv_norm.weight"))
    assert roles["layers.2.moe.router.gate.weight"] == roles["mtp.0.transformer_layer.moe.router.gate.weight"] == "router"
    assert roles["layers.2.moe.experts.w1"] == "expert"
    assert all(roles[n] == "matrix" for n in ("layers.2.moe.shared_experts.w2.weight", "mtp.0.eh_proj.weight",
                                              "layers.0.attention.wkv_b.weight", "layers.0.feed_forward.w1.weight"))


@pytest.mark.parametrize("change,message", [
    (dict(moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32, n_groups=3)),
     r"^model.moe n_groups \(3\) must divide n_experts \(8\): .*pick n_groups among 1, 2, 4, 8$"),
    (dict(moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32, n_groups=4, topk_groups=5)),
     r"^model.moe topk_groups \(5\) must be at most n_groups \(4\): .*lower topk_groups$"),
    (dict(moe=MoEArgs(n_experts=8, top_k=4, expert_dim=32, n_groups=4, topk_groups=1)),
     r"^topk_groups \(1\) groups of 2 experts hold fewer than top_k \(4\) experts; raise topk_groups$"),
    (dict(qk_rope_head_dim=7), r"^model.qk_rope_head_dim \(7\) must be even"),
    (dict(n_dense_layers=4), r"^model.mtp_depth \(1\) needs an MoE block"),
])
def test_bad_shapes_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message):
        get_model_args("debug", **change)


@pytest.mark.parametrize("degrees,message", [
    ({"tp": 3}, r"^model n_heads \(4\) must be divisible by parallelism.tp \(3\): wq/wq_b and wkv_b are column-wise"),
    ({"ep": 3}, r"^parallelism.ep \(3\) must divide the number of experts \(8\)"),
])
def test_bad_degrees_are_refused_in_one_line(degrees, message):
    with pytest.raises(ConfigError, match=message):
        validate_degrees(get_model_args("debug"), degrees, 64)


def test_config_round_trip_and_refusals():
    args = get_model_args("debug")
    cfg = adapter.hf_config_from_args(args)
    assert adapter.args_from_hf_config(cfg) == args
    # the hub's own form (rope_theta + rope_scaling, scoring_func, q_lora_rank null for none)
    hub = {**{k: v for k, v in cfg.items() if k != "rope_parameters"}, "rope_theta": 10000.0, "q_lora_rank": None,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    assert adapter.args_from_hf_config(hub) == get_model_args("debug", q_lora_rank=0)
    with pytest.raises(ConfigError, match=r"^HF config has scoring_func='softmax', but trainlib's DeepSeek-V3 needs"):
        adapter.args_from_hf_config({**cfg, "scoring_func": "softmax"})
    with pytest.raises(ConfigError, match=r"^model.moe score_func='softmax', but Hugging Face's DeepSeek-V3 has"):
        adapter.hf_config_from_args(get_model_args("deepseek_v3_16b"))


# ------------------------------------------------------------------------------------ tensor parallel


def _tp_matches_one_process(rank, world, sequence_parallel, latent):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trainlib.models.deepseek_v3 import tp_plan
    from trainlib.parallel.tp import apply_tp

    args = get_model_args("debug", mtp_depth=1)
    ref = Transformer(args, rope_len=16)
    ref.init_weights(seed=0)
    _scramble_(ref, 1)
    model = copy.deepcopy(ref)
    apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
             tp_plan(sequence_parallel, False, mtp_depth=1, latent=latent))
    tokens = _tokens(s=16, vocab=args.vocab_size)
    nxt = torch.roll(tokens, -1, dims=1)
    seen = []  # the sequence length attention's input holds: this rank's shard under the latent option
    model.layers["1"].attention.register_forward_pre_hook(lambda mod, a: seen.append(a[0].shape[1]))
    g = torch.Generator().manual_seed(2)
    probe = [torch.randn(2, 16, args.vocab_size, generator=g) for _ in range(2)]
    for m in (ref, model):
        main, depth1 = m(tokens, mtp_inputs=[nxt])
        ((main * probe[0]).sum() + (depth1 * probe[1]).sum()).backward()
    assert seen == [16 // world if latent else 16]
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        # without the shared rope key's all-reduce, wkv_a's rope rows miss the other rank's heads
        err = ((got - q.grad).norm() / q.grad.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err:.1e}"


@pytest.mark.parametrize("sequence_parallel,latent", [(True, False), (False, False), (True, True)])
def test_tensor_parallel_gradients_match_one_process(sequence_parallel, latent):
    """TP2 of the whole model, MTP module included (its forward with mtp_inputs): every parameter's gradient
    as on one process (fp32). The down-projections and latent norms are whole on every rank, the rope key's
    gradient summed over the ranks' heads; with `latent` (Megatron's option) the down-projections run on
    each rank's sequence shard and their latents are gathered, their weights' gradients summed over tp."""
    from tests.helpers import spawn

    spawn(_tp_matches_one_process, 2, sequence_parallel, latent)


# ------------------------------------------------------------------------------------ bad input (issue 51 item 8)


def test_mtp_depth_on_a_family_without_it_is_one_line():
    from trainlib.config import load_job_config

    with pytest.raises(ConfigError, match=r"^model.mtp_depth = 1, but model.name 'llama3' has no multi-token "
                                          r"prediction; set model.mtp_depth = 0, or use a family that has it: "
                                          r"deepseek_v3$"):
        load_job_config(None, ["--model.mtp_depth=1"])
    assert load_job_config(None, ["--model.mtp_depth=0"]).model.mtp_depth == 0  # 0 is every family's
    with pytest.raises(ConfigError, match=r"^model.mtp_depth must be >= 0, got -1$"):
        load_job_config(None, ["--model.name=deepseek_v3", "--model.mtp_depth=-1"])


def _saved(tmp_path, args, name):
    from trainlib.checkpoint import CheckpointConfig, Checkpointer, ModelState, TrainState
    from trainlib.models.registry import MODELS

    model = MODELS[name].model_cls(args, rope_len=8)
    model.init_weights(seed=0)
    state = {"model": ModelState([model]), "trainer": TrainState(tokens_per_step=1, model_args=args, model_name=name)}
    return Checkpointer(CheckpointConfig(enable=True, interval=1), tmp_path, state)


@pytest.mark.parametrize("saved_depth,run_depth", [(0, 1), (1, 0)])
def test_a_checkpoint_with_another_mtp_depth_is_refused_at_resume(tmp_path, saved_depth, run_depth):
    """A checkpoint saved without MTP resumed with MTP on (and the reverse): one line naming mtp_depth and both
    values, before any weight is read (the MTP module's weights would be missing, or left behind)."""
    _saved(tmp_path, get_model_args("debug", mtp_depth=saved_depth), "deepseek_v3").maybe_save(1, last_step=1)
    with pytest.raises(ConfigError) as e:
        _saved(tmp_path, get_model_args("debug", mtp_depth=run_depth), "deepseek_v3").load()
    assert "\n" not in str(e.value)
    assert f"mtp_depth={saved_depth}, but this run builds mtp_depth={run_depth}" in str(e.value), str(e.value)


def test_a_deepseek_checkpoint_given_to_another_family_is_refused_in_one_line(tmp_path):
    from trainlib.models.qwen3_moe import get_model_args as moe_args

    _saved(tmp_path, get_model_args("debug"), "deepseek_v3").maybe_save(1, last_step=1)
    with pytest.raises(ConfigError) as e:
        _saved(tmp_path, moe_args("debug_moe"), "qwen3_moe").load()
    assert "\n" not in str(e.value) and "deepseek_v3" in str(e.value) and "qwen3_moe" in str(e.value), str(e.value)
