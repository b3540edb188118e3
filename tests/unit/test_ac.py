"""Activation checkpointing: same gradients as without, less activation memory,
and wrappers (AC, compile) that change neither init nor parameter keys."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainlib.loss import cross_entropy_sum
from trainlib.params import canonical_name
from trainlib.models.llama3 import Transformer, block_forward_flops, get_model_args
from trainlib.parallel.ac import ActivationCheckpointConfig, apply_ac, recomputed_flops_per_token
from trainlib.parallel.compile import apply_compile
from trainlib.parallel.init import init_model_weights

ARGS = get_model_args("debug")

AC_CONFIGS = [("full", "all_mm"), ("selective_layer", "all_mm"), ("selective_op", "all_mm"),
              ("selective_op", "every_other_mm")]

def _tokens(batch=2, seq=64):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, ARGS.vocab_size, (batch, seq + 1), generator=g)


def _grads(model, tokens):
    loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
    loss.backward()
    return loss.detach(), {canonical_name(n): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,policy", AC_CONFIGS)
def test_ac_gradients_equal_no_ac(mode, policy):
    tokens = _tokens()
    ref = Transformer(ARGS, rope_len=64)
    ref.init_weights(0)
    ref_loss, ref_grads = _grads(ref, tokens)

    model = Transformer(ARGS, rope_len=64)
    model.init_weights(0)
    apply_ac(model, mode, every_k=2, selective_op_policy=policy)
    wrapped = sum("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    assert wrapped > 0
    loss, grads = _grads(model, tokens)
    # Recomputation replays the same CPU kernels on the same inputs: bitwise equal.
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


def test_ac_saves_activation_memory():
    from torch.distributed._tools.mem_tracker import MemTracker

    tokens = _tokens(batch=2, seq=128)
    peaks = {}
    for mode, policy in [("none", "all_mm"), *AC_CONFIGS]:
        model = Transformer(ARGS, rope_len=128)
        model.init_weights(0)
        apply_ac(model, mode, every_k=2, selective_op_policy=policy)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            _grads(model, tokens)
        peaks[(mode, policy)] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    none = peaks[("none", "all_mm")]
    full = peaks[("full", "all_mm")]
    assert full < 0.6 * none, peaks
    assert full < peaks[("selective_layer", "all_mm")] < none, peaks
    assert full < peaks[("selective_op", "every_other_mm")] < peaks[("selective_op", "all_mm")] < none, peaks


def test_wrapped_model_inits_like_plain_model():
    """AC and compile wrappers insert `_checkpoint_wrapped_module` / `_orig_mod`
    into parameter names; init seeds and checkpoint keys must not see them."""
    plain = Transformer(ARGS, rope_len=64)
    plain.init_weights(7)
    with torch.device("meta"):
        wrapped = Transformer(ARGS, rope_len=64)
    apply_ac(wrapped, "full")
    apply_compile(wrapped)  # lazy: nothing compiles until a forward runs
    init_model_weights(wrapped, 7, "cpu")
    names = [n for n, _ in wrapped.named_parameters()]
    assert any("_orig_mod._checkpoint_wrapped_module" in n for n in names)
    got = {canonical_name(n): p for n, p in wrapped.named_parameters()}
    want = dict(plain.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    # DCP's state-dict API strips both wrappers, so checkpoint keys are the plain
    # model's (nn.Module.state_dict() would keep `_orig_mod.`).
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert set(get_model_state_dict(wrapped)) == set(plain.state_dict())


@pytest.mark.parametrize("mode,policy,line", [
    ("selective_layer", "all_mm", "activation checkpointing selective_layer: blocks 0, 3 of 5"),
    ("selective_op", "every_other_mm", "activation checkpointing selective_op (every_other_mm): blocks 0, 1, 2, 3, 4 of 5"),
])
def test_startup_line_names_the_wrapped_blocks(caplog, mode, policy, line):
    model = Transformer(get_model_args("debug", n_layers=5), rope_len=64)
    with caplog.at_level("INFO", logger="trainlib"):
        apply_ac(model, mode, every_k=3, selective_op_policy=policy)
    assert caplog.messages == [line]


def test_unknown_mode_is_rejected():
    model = Transformer(ARGS, rope_len=64)
    with pytest.raises(ValueError, match="activation_checkpoint.mode 'ful'"):
        apply_ac(model, "ful")




class _RecomputedLinears(TorchDispatchMode):
    """The forward matmuls and attention kernels that run while active: names of the
    linears (x @ W.t(), told apart from backward's grad @ W by the transposed,
    non-contiguous weight view) and "attention", in `seen`; their FLOPs, from the
    shapes, in `flops`."""

    def __init__(self, model):
        super().__init__()
        self.names = {m.weight.data_ptr(): canonical_name(n).split(".", 2)[-1]
                      for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.seen, self.flops = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default and not args[1].is_contiguous():
            self.seen.append(self.names.get(args[1].data_ptr()))
            self.flops += 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product") and not name.endswith("_backward"):
            self.seen.append("attention")
            (b, h, s, d), s_kv = args[0].shape, args[1].shape[2]
            self.flops += 4 * b * h * s * s_kv * d
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode,policy,recomputed", [
    ("selective_op", "all_mm", []),  # attention is saved too, whichever kernel runs it
    # TorchTitan's choice: every second matmul of a block, the cheaper half (w3, not w1 and w2).
    ("selective_op", "every_other_mm", ["attention.wk", "attention.wo", "feed_forward.w3"]),
    # Every matmul but the last: no backward needs w2's output (the residual add saves nothing),
    # and the recompute stops once it has what backward needs.
    ("full", "all_mm", ["attention.wq", "attention.wk", "attention.wv", "attention", "attention.wo",
                        "feed_forward.w1", "feed_forward.w3"]),
])
def test_which_matmuls_backward_recomputes(mode, policy, recomputed):
    model = Transformer(get_model_args("debug", n_layers=1), rope_len=64)
    model.init_weights(0)
    apply_ac(model, mode, selective_op_policy=policy)
    tokens = _tokens()
    loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
    with _RecomputedLinears(model) as seen:
        loss.backward()
    assert sorted(seen.seen) == sorted(recomputed)


@pytest.mark.parametrize("mode,policy,every_k", [("none", "all_mm", 2), ("full", "all_mm", 2),
                                                 ("selective_layer", "all_mm", 2), ("selective_layer", "all_mm", 3),
                                                 ("selective_op", "all_mm", 2), ("selective_op", "every_other_mm", 2)])
def test_planned_recompute_flops_are_what_backward_reruns(mode, policy, every_k):
    """The planner's recomputed FLOPs (trainlib.plan's step time) against the
    forward FLOPs backward really reruns, on 5 blocks of unequal matmuls."""
    args = get_model_args("debug", n_layers=5)
    model = Transformer(args, rope_len=64)
    model.init_weights(0)
    apply_ac(model, mode, every_k=every_k, selective_op_policy=policy)
    tokens = _tokens()
    loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
    with _RecomputedLinears(model) as rerun:
        loss.backward()
    ac = ActivationCheckpointConfig(mode=mode, every_k=every_k, selective_op_policy=policy)
    planned = recomputed_flops_per_token(block_forward_flops(args, 64), args.n_layers, ac) * tokens[:, 1:].numel()
    assert rerun.flops == planned
    assert (planned > 0) == (mode in ("full", "selective_layer") or policy == "every_other_mm")
