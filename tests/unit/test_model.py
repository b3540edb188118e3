import math

import pytest
import torch

from trainlib.models import count_params
from trainlib.params import canonical_name, generate_init
from trainlib.models.llama3 import (
    Transformer,
    flops_per_token,
    get_model_args,
)
from trainlib.models.llama3.model import apply_rope, precompute_rope

# Published parameter counts (Meta model cards / HF configs).
PUBLISHED = {
    "llama3.2_1b": 1_235_814_400,
    "llama3.2_3b": 3_212_749_824,
    "llama3.1_8b": 8_030_261_248,
    "llama3.1_70b": 70_553_706_496,
    "llama3.1_405b": 405_853_388_800,
}

@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_param_count_matches_published(flavor):
    with torch.device("meta"):
        model = Transformer(get_model_args(flavor), rope_len=8)
    assert count_params(model) == PUBLISHED[flavor]


def test_published_shapes():
    a = get_model_args("llama3.1_70b")
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim) == (8192, 80, 64, 8, 28672)
    assert get_model_args("llama3.2_1b").tie_embeddings and not get_model_args("llama3.1_8b").tie_embeddings


def test_forward_shapes_and_layer_keys():
    args = get_model_args("debug")
    model = Transformer(args, rope_len=32)
    model.init_weights(seed=0)
    logits = model(torch.randint(0, args.vocab_size, (2, 32)))
    assert logits.shape == (2, 32, args.vocab_size)
    assert list(model.layers.keys()) == [str(i) for i in range(args.n_layers)]
    assert "layers.3.attention.wq.weight" in dict(model.named_parameters())


def test_tied_embeddings_share_storage():
    args = get_model_args("debug", vocab_size=512)
    from dataclasses import replace

    model = Transformer(replace(args, tie_embeddings=True), rope_len=8)
    assert model.output.weight is model.tok_embeddings.weight


def test_init_is_deterministic_per_seed_and_name():
    args = get_model_args("debug")
    a, b, c = Transformer(args, rope_len=16), Transformer(args, rope_len=16), Transformer(args, rope_len=16)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    c.init_weights(seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if "norm" not in n:
            assert not torch.equal(pa, pc), n
    # different layers get different values from the same spec
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)
    assert torch.all(a.layers["0"].attention_norm.weight == 1)


def test_init_std_follows_spec():
    args = get_model_args("debug", n_layers=2)
    model = Transformer(args, rope_len=8)
    model.init_weights(seed=0)
    # (weight, std of its truncated normal): trunc at 3 std gives 0.986 std, and a 4096+ sample is within 5%
    depth = 0.02 / (2 * args.n_layers) ** 0.5  # residual-branch outputs scaled by depth
    want = [(model.layers["0"].feed_forward.w1.weight, 0.02), (model.layers["1"].attention.wq.weight, 0.02),
            (model.layers["0"].attention.wo.weight, depth), (model.layers["1"].feed_forward.w2.weight, depth),
            (model.tok_embeddings.weight, 1.0), (model.output.weight, args.dim ** -0.5)]
    tied_args = get_model_args("debug", n_layers=2, tie_embeddings=True)
    tied = Transformer(tied_args, rope_len=8)
    tied.init_weights(seed=0)
    want.append((tied.tok_embeddings.weight, args.dim ** -0.5))  # one matrix for both: the output's scale
    for w, std in want:
        assert abs(w.std().item() / (0.986 * std) - 1) < 0.05, (tuple(w.shape), w.std().item(), std)


def test_canonical_name_strips_wrappers():
    assert canonical_name("layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight") == \
        "layers.0.attention.wq.weight"


def test_rope_is_rotation_and_positions_override():
    args = get_model_args("debug")
    rope = precompute_rope(args, 16)
    x = torch.randn(1, 16, 2, args.head_dim)
    y = apply_rope(x, rope)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep norms
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is identity
    model = Transformer(args, rope_len=16)
    model.init_weights(0)
    tokens = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(model(tokens), model(tokens, position_ids=torch.arange(16)[None]))


def test_llama31_rope_scaling_changes_low_frequencies_only():
    scaled = get_model_args("llama3.1_8b")
    plain = get_model_args("llama3.1_8b", rope_scaling_factor=None)
    from dataclasses import replace

    plain = replace(scaled, rope_scaling_factor=None)
    a, b = precompute_rope(scaled, 2), precompute_rope(plain, 2)
    angle_a, angle_b = a[1, :, 1].asin(), b[1, :, 1].asin()  # position-1 angle = inv_freq (small)
    assert torch.allclose(angle_a[:4], angle_b[:4])  # high frequencies untouched
    assert torch.allclose(angle_a[-4:], angle_b[-4:] / 8, rtol=1e-3)  # lowest divided by factor 8


def test_causal_model_ignores_future_tokens():
    args = get_model_args("debug")
    model = Transformer(args, rope_len=16)
    model.init_weights(0)
    t = torch.randint(0, 256, (1, 16))
    t2 = t.clone()
    t2[0, 10:] = (t2[0, 10:] + 1) % 256
    torch.testing.assert_close(model(t)[0, :10], model(t2)[0, :10])


def test_unknown_flavor_suggests():
    with pytest.raises(ValueError, match="did you mean 'llama3.1_8b'"):
        get_model_args("llama3.1_8")


@pytest.mark.parametrize("overrides,message", [
    ({"n_kv_heads": 3}, r"n_heads \(4\) must be a multiple of n_kv_heads \(3\) for GQA"),
    ({"n_layers": 0}, r"model.n_layers must be >= 1, got 0"),
    ({"vocab_size": 0}, r"model.vocab_size must be >= 1, got 0"),
    ({"dim": 66}, r"model.dim \(66\) must be divisible by n_heads \(4\)"),
    ({"dim": 12}, r"head_dim \(3\) must be even for rotary embeddings"),
])
def test_shape_rules(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_model_args("debug", **overrides)


def test_flops_per_token_8b():
    # 6N (N = non-embedding matmul params + output) + attention term
    a = get_model_args("llama3.1_8b")
    f = flops_per_token(a, 8192)
    n = 8_030_261_248 - 128256 * 4096 - 32 * 2 * 4096 - 4096  # minus embedding and norms
    assert math.isclose(f, 6 * n + 12 * 32 * 32 * 128 * 8192)


def test_an_unknown_init_kind_is_an_error_not_a_normal_draw():
    assert torch.equal(generate_init(("ones", 0.0), (2, 3), 0, "w", "cpu", torch.float32), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"^unknown init kind 'zeros' for parameter layers.0.w$"):
        generate_init(("zeros", 0.02), (2, 3), 0, "layers.0.w", "cpu", torch.float32)


def test_a_model_built_on_meta_and_materialised_equals_one_built_on_the_cpu():
    # to_empty leaves the rotary table as whatever memory held: init_weights computes it again.
    args = get_model_args("debug")
    ref = Transformer(args, rope_len=32)
    ref.init_weights(seed=3)
    with torch.device("meta"):
        model = Transformer(args, rope_len=32)
    model.to_empty(device="cpu")
    model.rope.fill_(float("nan"))
    model.init_weights(seed=3)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(tokens), ref(tokens))


def test_a_rotary_table_longer_than_the_input_gives_the_same_output():
    args = get_model_args("debug")
    short, long = Transformer(args, rope_len=16), Transformer(args, rope_len=64)
    short.init_weights(seed=0)
    long.init_weights(seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(long(tokens), short(tokens))


def test_tied_weights_stay_one_matrix_through_the_meta_build_and_initialisation():
    # torch 2.13's to_empty makes a new parameter per holder of a shared one: the 1B models (tied) trained
    # with an untied output layer on one device until init_model_weights tied them again.
    from trainlib.parallel import init_model_weights

    args = get_model_args("debug", tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args, rope_len=16)
    init_model_weights(model, 0, "cpu")
    assert model.output.weight is model.tok_embeddings.weight
    ref = Transformer(args, rope_len=16)
    ref.init_weights(0)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), model.state_dict().values()))
