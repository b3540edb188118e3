"""MuonClip (optimizer.muon.qk_clip_threshold): the kernel's per-head max logit against a plain reference, the
families' rescale bringing a head's max logit to tau, and the one-line refusals."""

import dataclasses

import pytest
import torch

from tests.helpers import doc_ids_from_starts
from trainlib.blocks.attention import document_mask, max_logits
from trainlib.config import load_job_config
from trainlib.errors import ConfigError


def _reference(q, k, visible, scale):
    """scale * q @ k^T per head, -inf where a key is not seen, max over batch, queries and keys: [h]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("masking", ["causal", "document", "document_flex"])
def test_max_logits_match_a_plain_reference(masking):
    torch.manual_seed(0)
    b, h, h_kv, s, d = 2, 4, 2, 40, 8
    q, k = torch.randn(b, h, s, d), torch.randn(b, h_kv, s, d)
    pos = torch.arange(s)
    causal = pos[None, :] <= pos[:, None]
    if masking == "causal":
        mask, visible = None, causal[None, None]
    else:
        doc_ids = doc_ids_from_starts([[0, 7, 30], [0, 19]], s)
        same = doc_ids[:, None, :] == doc_ids[:, :, None]  # [b, q, k]
        visible = (causal[None] & same)[:, None]
        mask = document_mask(doc_ids, torch.float32, flex=masking == "document_flex")
    got = max_logits(q, k, mask, scale=0.3, chunk=16)  # 3 chunks of queries, the last one short
    want = _reference(q, k, visible, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # a mask ignored would see later (larger) keys: the reference without it differs
    assert not torch.allclose(got, _reference(q, k, torch.ones_like(visible), 0.3))
    if masking == "causal":  # a chunk of queries starting at key position 24 (context parallelism's)
        part = max_logits(q[:, :, 24:], k, scale=0.3, q_offset=24, chunk=16)
        torch.testing.assert_close(part, _reference(q[:, :, 24:], k, visible[..., 24:, :], 0.3), rtol=1e-6,
                                   atol=1e-6)
        assert not torch.allclose(part, max_logits(q[:, :, 24:], k, scale=0.3))  # the offset ignored


def _measured_forward(attn, x, rope):
    attn.max_logit = None
    attn(x, rope)
    out, attn.max_logit = attn.max_logit, None
    return out


def _attention(family: str):
    if family == "llama3":
        from trainlib.models.llama3.model import Attention, get_model_args, precompute_rope
        args = get_model_args("debug")  # GQA: 4 query heads on 2 kv heads
        return Attention(args), precompute_rope(args, 32), args.dim
    from trainlib.models.deepseek_v3.model import MLA, get_model_args, precompute_rope
    args = get_model_args("debug")
    return MLA(args), precompute_rope(args, 32), args.dim


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3", "deepseek_v3_no_q_lora"])
def test_the_rescale_brings_each_clipped_head_to_tau(family):
    """Heads 0 and 3 over tau, 1 and 2 not: after the families' factors, 0 and 3 peak at tau exactly (to
    rounding) and 1 and 2 keep their logits (under GQA head 1 shares its keys with head 0)."""
    torch.manual_seed(0)
    if family == "deepseek_v3_no_q_lora":
        from trainlib.models.deepseek_v3.model import MLA, get_model_args, precompute_rope
        args = dataclasses.replace(get_model_args("debug"), q_lora_rank=0)
        attn, rope, dim = MLA(args), precompute_rope(args, 32), args.dim
    else:
        attn, rope, dim = _attention(family)
    with torch.no_grad():
        for p in attn.parameters():
            p.mul_(4.0)  # large logits
    attn.measure_max_logits()
    x = torch.randn(2, 32, dim)
    before = _measured_forward(attn, x, rope)
    tau = torch.stack([before[0], before[3]]).min() * 0.5
    scales = torch.ones_like(before)
    scales[[0, 3]] = tau / before[[0, 3]]
    touched = set()
    with torch.no_grad():
        for weight, factor in attn.qk_clip_factors(scales):
            assert factor.shape == weight.shape[:1]
            weight.mul_(factor[:, None])
            touched.add(weight)
    after = _measured_forward(attn, x, rope)
    torch.testing.assert_close(after[[0, 3]], torch.stack([tau, tau]), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[[1, 2]], before[[1, 2]], rtol=1e-5, atol=0)
    if family != "llama3":  # MLA: only the up-projections; the shared rope key and the latents are untouched
        names = {n for n, p in attn.named_parameters() if p in touched}
        assert names == {"wq_b.weight" if hasattr(attn, "wq_a") else "wq.weight", "wkv_b.weight"}


def test_measurement_costs_nothing_when_off():
    attn, rope, dim = _attention("llama3")
    attn(torch.randn(1, 8, dim), rope)
    assert attn.max_logit is None and "sdpa" not in vars(attn)


def test_a_qk_norm_family_is_refused_in_one_line():
    from tests.helpers import RECIPES, build_on_one_rank

    cfg = load_job_config(str(RECIPES / "debug_qwen3.toml"),
                          ["--optimizer.name=muon", "--optimizer.muon.qk_clip_threshold=5"])
    with pytest.raises(ConfigError, match=r"qwen3.model.Attention has no per-head W_q/W_k rescale \(QK-norm") as e:
        build_on_one_rank(cfg)
    assert "\n" not in str(e.value)


def test_the_step_runner_rescales_after_a_step_unless_withheld():
    """One process: a forward and backward measure, `max_attn_logit` is in the aux fields, a withheld step
    (host or device verdict) leaves every weight as it was, an applied one brings the max logit to tau."""
    from tests.helpers import RECIPES, build_on_one_rank
    from trainlib.step import aux_fields

    cfg = load_job_config(str(RECIPES / "debug.toml"), ["--optimizer.name=muon",
                                                        "--optimizer.muon.qk_clip_threshold=0.05"])
    from trainlib.parallel import init_model_weights

    built = build_on_one_rank(cfg)
    runner, (model,) = built.runner, built.parts
    init_model_weights(model, 0, "cpu")
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (2, 65))
    mbs = [{"input": tokens[:, :-1], "labels": tokens[:, 1:]}]

    def step():
        model.zero_grad()
        return runner.forward_backward(mbs, torch.tensor(128.0))[1]

    aux = step()
    first = aux_fields(aux)["max_attn_logit"]
    assert first > 0.05  # the untrained debug model's logits (about 0.15) exceed tau: every step clips
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for verdict in (True, torch.tensor(True)):
        step()
        runner.after_optimizer_step(verdict)
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    step()
    runner.after_optimizer_step(torch.tensor(False))
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, weights[n])}
    assert changed == {f"layers.{i}.attention.{w}.weight" for i in range(4) for w in ("wq", "wk")}
    # the max head of the max layer, to fp32 rounding through the forward (measured 1.9e-5 relative)
    assert abs(aux_fields(step())["max_attn_logit"] - 0.05) <= 1e-4 * 0.05
