"""The Qwen3 dense family: logits against transformers' Qwen3 both ways, the
forward's document mask and position ids, shapes, parameter counts and the
one-line errors of its config and adapter."""

import dataclasses
import math

import pytest
import torch

from trainlib.blocks import attention
from trainlib.errors import ConfigError
from trainlib.models import count_params, layers
from trainlib.models.qwen3 import FLAVORS, Transformer, block_forward_flops, flops_per_token, get_model_args
from trainlib.models.qwen3 import state_dict_adapter as adapter
from trainlib.models.qwen3.model import ModelArgs, apply_rope, precompute_rope

# A tiny shape with head_dim (32) != hidden / heads (16), GQA (4 heads, 2 kv heads).
TINY_HF = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               intermediate_size=128, vocab_size=256, rope_theta=1e6, rms_norm_eps=1e-6,
               max_position_embeddings=512, attention_bias=False)


def _random_gains_(model: torch.nn.Module, seed: int) -> None:
    """Norm gains away from 1 (both libraries init them to 1), so a swapped or
    dropped norm, QK-norm included, changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def _hf_model(tied: bool, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**TINY_HF, tie_word_embeddings=tied)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    _random_gains_(model, seed)
    return model


def _tokens(b=2, s=48, vocab=256, seed=1):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers_after_import_and_after_export(tied):
    transformers = pytest.importorskip("transformers")
    hf = _hf_model(tied)
    args = adapter.args_from_hf_config(hf.config.to_dict())
    assert (args.head_dim, args.tie_embeddings, args.rope_theta) == (32, tied, 1e6)
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(tokens).logits

    # HF -> trainlib
    hf_sd = hf.state_dict()
    names = adapter.hf_weight_names(hf_sd, args)
    ours = Transformer(args, rope_len=tokens.shape[1])
    ours.load_state_dict({n: adapter.hf_weight_to_trainlib(n, hf_sd[h], args) for n, h in names.items()}, strict=True)
    with torch.no_grad():
        diff = (ours.eval()(tokens) - ref).abs().max().item()
    assert diff < 1e-5, diff

    # trainlib -> HF: our own weights, exported, in a fresh transformers model built from our config
    src = Transformer(args, rope_len=tokens.shape[1])
    src.init_weights(seed=5)
    _random_gains_(src, 6)
    src_sd = src.state_dict()
    exported = {h: adapter.trainlib_weight_to_hf(n, src_sd[n], args)
                for n, h in adapter.trainlib_weight_names(src_sd, args).items()}
    assert ("lm_head.weight" in exported) != tied  # tied: one matrix, the embedding
    back = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**adapter.hf_config_from_args(args))).float()
    missing, unexpected = back.load_state_dict(exported, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set()), (missing, unexpected)
    if tied:
        assert back.lm_head.weight is back.model.embed_tokens.weight
    with torch.no_grad():
        want = src.eval()(tokens)
        diff_back = (back.eval()(tokens).logits - want).abs().max().item()
    assert diff_back < 1e-5, diff_back
    # the two models differ, so equal logits above are not a coincidence
    assert (want - ref).abs().max() > 1e-2


def test_names_layouts_and_config_round_trip():
    args = get_model_args("debug_tied", n_layers=2)
    model = Transformer(args, rope_len=8)
    for name in model.state_dict():
        hf_name = adapter.to_hf_name(name)
        assert adapter.from_hf_name(hf_name) == name
        assert adapter.hf_row_order(name, args) is None  # rotate-half in both: no permutation
    assert adapter.to_hf_name("layers.1.attention.q_norm.weight") == "model.layers.1.self_attn.q_norm.weight"
    assert adapter.to_hf_name("layers.0.attention.k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert adapter.from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert adapter.args_from_hf_config(adapter.hf_config_from_args(args)) == args
    cfg = adapter.hf_config_from_args(args, dtype="bfloat16")
    assert (cfg["architectures"], cfg["model_type"], cfg["torch_dtype"]) == (["Qwen3ForCausalLM"], "qwen3", "bfloat16")
    assert list(adapter.ARCHITECTURES) == cfg["architectures"] and adapter.MODEL_TYPE == "qwen3"
    # tied: the embedding serves as the output, even where a folder also stores lm_head
    hf_names = [adapter.to_hf_name(n) for n in model.state_dict()] + ["lm_head.weight"]
    assert adapter.hf_weight_names(hf_names, args)["output.weight"] == "model.embed_tokens.weight"
    untied = dataclasses.replace(args, tie_embeddings=False)
    assert "output.weight" not in adapter.hf_weight_names([n for n in hf_names if n != "lm_head.weight"], untied)


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
     r"^HF config has model_type='llama' architectures=\['LlamaForCausalLM'\], not Qwen3's \('qwen3', "
     r"Qwen3ForCausalLM\): set model.name"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, r"architectures=\['Qwen3MoeForCausalLM'\], not Qwen3's"),
    ({"attention_bias": True}, r"^HF config has attention_bias=true, but trainlib's Qwen3 projections have no bias"),
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1},
     r"^HF config gives 1 layer\(s\) sliding-window attention \(sliding_window=4096, from layer 1\)"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 128},
     r"gives 1 layer\(s\) sliding-window attention \(sliding_window=128, from layer 1\)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type='yarn', but trainlib's Qwen3 implements "
                                                              r"unscaled RoPE only: remove rope_scaling"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu', but trainlib's Qwen3 MLP is SwiGLU"),
])
def test_configs_this_model_cannot_run_are_refused_in_one_line(change, message):
    base = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **TINY_HF,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2}
    assert adapter.args_from_hf_config(base).dim == 64
    # published configs state sliding_window but do not use it
    assert adapter.args_from_hf_config({**base, "sliding_window": 32768}).n_layers == 2
    with pytest.raises(ConfigError, match=message) as e:
        adapter.args_from_hf_config({**base, **change})
    assert "\n" not in str(e.value)


def test_one_document_is_the_causal_forward_and_documents_see_only_themselves():
    args = get_model_args("debug", n_layers=2)
    model = Transformer(args, rope_len=48)
    model.init_weights(seed=0)
    _random_gains_(model, 1)
    tokens = _tokens(s=48, vocab=args.vocab_size)
    with torch.no_grad():
        causal = model(tokens)
        torch.testing.assert_close(model(tokens, doc_ids=torch.zeros_like(tokens)), causal, rtol=1e-5, atol=1e-5)
        starts = [0, 17, 30]
        doc_ids = torch.zeros_like(tokens)
        for lo in starts[1:]:
            doc_ids[:, lo:] += 1
        masked = model(tokens, doc_ids=doc_ids)
        for lo, hi in zip(starts, starts[1:] + [48]):
            torch.testing.assert_close(masked[:, lo:hi], model(tokens[:, lo:hi]), rtol=1e-4, atol=1e-4)
        assert (masked[:, 17:] - causal[:, 17:]).abs().max() > 1e-2


def test_permuted_positions_give_the_rows_of_the_full_forward():
    """Context parallelism's layout on one process: the tokens in the order cp=2
    load-balanced ranks hold them (chunks 0,3 then 1,2), their window positions as
    position_ids, every attention's `sdpa` replaced per instance by one that puts
    K/V back in window order (what the all-gather does) under the model's own
    mask for those query positions. The output rows are the full forward's."""
    args = get_model_args("debug", n_layers=2)
    model = Transformer(args, rope_len=32)
    model.init_weights(seed=0)
    _random_gains_(model, 2)
    tokens = _tokens(s=32, vocab=args.vocab_size)
    order = torch.arange(32).view(4, 8)[[0, 3, 1, 2]].flatten()
    window = torch.argsort(order)
    doc_ids = torch.zeros_like(tokens)
    mask = model.attention_mask(doc_ids, torch.float32, q_positions=order)

    def gathered_sdpa(q, k, v, _mask):
        return attention.sdpa(q, k[:, :, window], v[:, :, window], mask)

    with torch.no_grad():
        full = model(tokens)
        for block in model.layers.values():
            block.attention.sdpa = gathered_sdpa
        out = model(tokens[:, order], position_ids=order.expand(2, -1), doc_ids=doc_ids)
        torch.testing.assert_close(out, full[:, order], rtol=1e-5, atol=1e-5)
        # the positions matter: the held order's own 0..s-1 gives other logits
        assert (model(tokens[:, order], doc_ids=doc_ids) - full[:, order]).abs().max() > 1e-2


def test_rope_rotates_halves_and_is_relative():
    args = get_model_args("debug")
    rope = precompute_rope(args, 16)
    assert rope.shape == (16, args.head_dim // 2, 2) and rope.dtype == torch.float32
    x = torch.randn(1, 16, 2, args.head_dim)
    y = apply_rope(x, rope)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])
    # feature i pairs with i + head_dim/2: a vector only in feature 0 moves only into feature head_dim/2
    e = torch.zeros(1, 16, 1, args.head_dim)
    e[..., 0] = 1
    moved = apply_rope(e, rope)[0, 5, 0]
    assert torch.count_nonzero(moved) == 2 and moved[args.head_dim // 2] != 0
    # scores depend on position differences only
    q, k = torch.randn(args.head_dim), torch.randn(args.head_dim)
    qs, ks = apply_rope(q.expand(1, 16, 1, -1), rope), apply_rope(k.expand(1, 16, 1, -1), rope)
    torch.testing.assert_close((qs[0, 7, 0] * ks[0, 3, 0]).sum(), (qs[0, 12, 0] * ks[0, 8, 0]).sum())


def test_debug_shape_layers_names_and_tied_init():
    assert not get_model_args("debug").tie_embeddings  # every parallel layout, pipeline ones included
    args = get_model_args("debug_tied")
    assert args.head_dim * args.n_heads != args.dim and args.tie_embeddings
    model = Transformer(args, rope_len=16)
    model.init_weights(seed=0)
    assert list(model.layers.keys()) == [str(i) for i in range(args.n_layers)]
    attn = model.layers["0"].attention
    assert isinstance(attn, attention.Attention)
    assert attn.wq.weight.shape == (args.n_heads * args.head_dim, args.dim)
    assert attn.wk.weight.shape == (args.n_kv_heads * args.head_dim, args.dim)
    assert attn.wo.weight.shape == (args.dim, args.n_heads * args.head_dim)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (args.head_dim,)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())  # one matrix
    assert model.param_init_spec("layers.0.attention.q_norm.weight") == ("ones", 0.0)
    assert model.param_init_spec("tok_embeddings.weight") == ("trunc_normal", args.dim ** -0.5)
    untied = Transformer(dataclasses.replace(args, tie_embeddings=False), rope_len=8)
    assert untied.param_init_spec("tok_embeddings.weight") == ("trunc_normal", 1.0)
    assert model.rope.shape == (16, args.head_dim // 2, 2)
    logits = model(_tokens(s=16, vocab=args.vocab_size))
    assert logits.shape == (2, 16, args.vocab_size)
    model.output_in_forward = False
    assert model(_tokens(s=16, vocab=args.vocab_size)).shape == (2, 16, args.dim)


def test_pipeline_stage_without_embedding_and_head_passes_hidden_states():
    args = get_model_args("debug")
    full = Transformer(args, rope_len=16)
    full.init_weights(seed=0)
    tokens = _tokens(s=16, vocab=args.vocab_size)
    first, last = Transformer(args, rope_len=16), Transformer(args, rope_len=16)
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    first.norm = first.output = None
    del first.layers["2"], first.layers["3"]
    last.tok_embeddings = None
    del last.layers["0"], last.layers["1"]
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), full(tokens))


def test_a_model_built_on_meta_and_materialised_equals_one_built_on_the_cpu():
    # Untied: nn.Module.to_empty gives each holder of a shared parameter its own
    # copy, so re-tying after it is the materialising code's job (init_model_weights), not the model's.
    args = get_model_args("debug")
    ref = Transformer(args, rope_len=32)
    ref.init_weights(seed=3)
    with torch.device("meta"):
        model = Transformer(args, rope_len=32)
    model.to_empty(device="cpu")
    model.rope.fill_(float("nan"))
    model.init_weights(seed=3)
    tokens = _tokens(s=32, vocab=args.vocab_size)
    assert torch.equal(model(tokens), ref(tokens))


# Qwen3 model cards (huggingface.co/Qwen/Qwen3-*): total and non-embedding
# parameters, in billions, to the precision the cards give them.
PUBLISHED = {"qwen3_0.6b": ("0.6", "0.44"), "qwen3_1.7b": ("1.7", "1.4"), "qwen3_4b": ("4.0", "3.6"),
             "qwen3_8b": ("8.2", "6.95"), "qwen3_14b": ("14.8", "13.2"), "qwen3_32b": ("32.8", "31.2")}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_param_counts_match_the_model_cards(flavor):
    args = get_model_args(flavor)
    with torch.device("meta"):
        model = Transformer(args, rope_len=8)
    total = count_params(model)
    non_embedding = total - args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    for count, published in zip((total, non_embedding), PUBLISHED[flavor]):
        digits = len(published.split(".")[1])
        assert f"{count / 1e9:.{digits}f}" == published, (flavor, count, published)


def test_flavor_shapes_agree_with_transformers_qwen3():
    """transformers' Qwen3, built on meta from our config of a published flavor,
    has the same parameters, name for name (QK-norm and head_dim included)."""
    transformers = pytest.importorskip("transformers")
    for flavor in ("qwen3_0.6b", "qwen3_32b"):
        args = get_model_args(flavor)
        with torch.device("meta"):
            hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**adapter.hf_config_from_args(args)))
            ours = Transformer(args, rope_len=8)
        theirs = {n: tuple(p.shape) for n, p in hf.named_parameters()}
        mine = {adapter.to_hf_name(n): tuple(p.shape) for n, p in ours.named_parameters()}
        assert mine == theirs, flavor


def test_flops_count_head_dim_not_dim():
    args = get_model_args("qwen3_32b")  # 64 heads x 128 = 8192 != dim 5120
    ops = block_forward_flops(args, 4096)
    assert [name for name, _, _ in ops] == ["wq", "wk", "wv", "attention", "wo", "w1", "w3", "w2"]
    f = dict((name, flops) for name, flops, _ in ops)
    assert f["wq"] == f["wo"] == 2 * 5120 * 8192 and f["wk"] == 2 * 5120 * 1024
    assert f["attention"] == 4 * 8192 * 4096
    # 6 x matmul params of the blocks and the output, plus the attention term
    with torch.device("meta"):
        model = Transformer(args, rope_len=8)
    block = model.layers["0"]
    matmul = sum(p.numel() for n, p in block.named_parameters() if "norm" not in n)
    assert math.isclose(flops_per_token(args, 4096),
                        6 * (args.n_layers * matmul + args.vocab_size * args.dim)
                        + 3 * args.n_layers * 4 * 8192 * 4096)


def test_unknown_flavor_names_the_closest_and_the_valid_ones():
    with pytest.raises(ConfigError, match=r"^unknown model.flavor 'qwen3_8' for model.name 'qwen3'; did you mean "
                                          r"'qwen3_8b'\? \(valid: debug, debug_tied, qwen3_0.6b, .*qwen3_32b\)$"):
        get_model_args("qwen3_8")
    assert get_model_args("qwen3_8b", n_layers=None, vocab_size=None) == FLAVORS["qwen3_8b"]
    assert get_model_args("debug", n_layers=2).n_layers == 2


@pytest.mark.parametrize("overrides,message", [
    ({"n_kv_heads": 3}, r"^model.n_heads \(4\) must be a multiple of model.n_kv_heads \(3\) for grouped-query "
                        r"attention: set n_kv_heads to one of 1, 2, 4$"),
    ({"head_dim": 33}, r"^model.head_dim \(33\) must be even for rotary embeddings, .*: set an even head_dim"),
    ({"n_layers": 0}, r"^model.n_layers must be >= 1, got 0$"),
    ({"vocab_size": 0}, r"^model.vocab_size must be >= 1, got 0$"),
    ({"norm_eps": 0.0}, r"^model.norm_eps must be > 0, got 0.0"),
])
def test_shape_rules_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        get_model_args("debug", **overrides)
    assert "\n" not in str(e.value)


def test_head_dim_independent_of_dim_over_heads_runs():
    # dim 48 is not a multiple of heads x head_dim = 64, nor is head_dim dim / heads
    args = ModelArgs(dim=48, n_layers=1, n_heads=4, n_kv_heads=1, head_dim=16, ffn_dim=64, vocab_size=64,
                     max_seq_len=64)
    args.validate()
    model = Transformer(args)
    model.init_weights(seed=0)
    assert model(_tokens(s=8, vocab=64)).shape == (2, 8, 64)
