"""Expert parallel (trainlib.parallel.ep) on gloo: a stack of MoE blocks whose experts are sharded over ep and
FSDP-sharded over what is left gives the single-process gradients of every parameter, the auxiliary losses'
included (fp32, within 1e-5)."""

import logging

import pytest
import torch
from torch import nn

from tests.helpers import spawn
from trainlib.blocks.moe import MoE, MoEArgs, MoEConfig, aux_loss_scale
from trainlib.parallel.ep import apply_ep
from trainlib.parallel.fsdp import apply_fsdp
from trainlib.parallel.grad import total_norm
from trainlib.parallel.parallel_dims import ParallelDims

D, E = 16, 8
X = torch.randn(4, 6, D, generator=torch.Generator().manual_seed(3))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.moe = MoE(D, MoEArgs(n_experts=E, top_k=2, expert_dim=12))

    def forward(self, x):
        return x + self.moe(torch.tanh(self.lin(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(2)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _net() -> _Net:
    torch.manual_seed(0)
    net = _Net()
    for p in net.parameters():
        nn.init.normal_(p, std=0.3)
    for m in net.modules():
        if isinstance(m, MoE):
            m.init_buffers()
            m.configure(MoEConfig(seq_aux_loss_coef=0.1, z_loss_coef=0.01))
    return net


def _loss(net, x):
    with aux_loss_scale(1 / X[..., 0].numel()):
        return net(x).square().sum() / X[..., 0].numel()


def _check(rank, world, degrees):
    dims = ParallelDims(world_size=world, **degrees)
    dims.build_mesh("cpu")
    net = _net()
    apply_ep(net, dims.mesh("ep"))
    apply_fsdp(net, dims.fsdp_mesh(), expert_mesh=dims.expert_fsdp_mesh())
    dp_rank, dp = dims.dp_coords()
    _loss(net, X.chunk(dp)[dp_rank]).backward()
    ref = _net()
    _loss(ref, X).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in net.named_parameters():
        name = name.replace("_fsdp_wrapped_module.", "")
        if name.endswith(("w1", "w2", "w3")):  # this rank holds ep's share of the experts, FSDP a share of that
            assert p.to_local().shape[0] <= E // dims.ep // dims.efsdp + 1, (name, p.placements)
        torch.testing.assert_close(p.grad.full_tensor(), want[name], rtol=1e-5, atol=1e-6, msg=name)
    # The gradient norm over the experts' (efsdp, ep) mesh is one all-reduce on the flattened mesh
    # ParallelDims makes: DTensor's warning that it ran one per dim (once per rank, every EP run) is gone.
    said = []
    handler = logging.Handler()
    handler.emit = said.append
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(handler)
    norm = total_norm([p.grad for p in net.parameters()])
    torch.testing.assert_close(norm, total_norm(list(want.values())), rtol=1e-5, atol=1e-6)
    assert not [r.getMessage() for r in said if "sequential" in r.getMessage()]
    counts = sum(m.take_stats()[:E] for m in net.modules() if isinstance(m, MoE))
    assert counts.sum() == 2 * 2 * X[..., 0].numel() // dp  # each rank routes (and counts) only its own tokens


def test_ep2_matches_one_process():
    spawn(_check, 2, {"dp_shard": 2, "ep": 2})


@pytest.mark.slow
@pytest.mark.parametrize("degrees", [{"dp_shard": 4, "ep": 2}, {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
                                     {"dp_shard": 4, "ep": 4}])
def test_ep_with_expert_fsdp_and_hsdp_matches_one_process(degrees):
    spawn(_check, 4, degrees)
