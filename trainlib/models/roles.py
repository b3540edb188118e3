"""Parameter roles by name, shared by the families (`ModelSpec.param_role`; the vocabulary is
PARAM_ROLES, below).

A family whose modules follow these names uses `dense_param_role` (a dense transformer) or
`moe_param_role` (the same plus an MoE block's router and routed experts); a family with other names
writes its own function of the same signature.
"""

from __future__ import annotations

# The roles a family gives its parameters (ModelSpec.param_role), by canonical name: what an optimizer
# groups them by (trainlib.optim), torch-free so that the recipe's `optimizer.muon.roles` is checked
# before torch is imported.
#   embedding  the token embedding table            output  the output projection (the head)
#   norm       a normalisation gain (RMSNorm, ...)  bias    any additive bias
#   router     an MoE router's gate matrix          expert  a routed-expert weight [n_experts, out, in]
#   matrix     every other weight matrix (attention, MLP, shared experts) [out, in]
PARAM_ROLES = ("embedding", "output", "norm", "bias", "router", "expert", "matrix")


def dense_param_role(name: str) -> str:
    """The role of the parameter with canonical name `name` in a dense transformer: the embedding
    table `tok_embeddings.*`, the head `output.*`, a bias `*.bias`, a norm's gain (a module whose
    name ends in "norm": `norm`, `attention_norm`, `q_norm`, ...); every other weight a "matrix"."""
    parts = name.split(".")
    if parts[0] == "tok_embeddings":
        return "embedding"
    if parts[0] == "output":
        return "output"
    if parts[-1] == "bias":
        return "bias"
    if len(parts) >= 2 and parts[-2].endswith("norm"):
        return "norm"
    return "matrix"


def moe_param_role(name: str) -> str:
    """`dense_param_role` plus an MoE block's parts (trainlib.blocks.moe.MoE): the router's gate
    (`*.router.gate.weight`) a "router", the routed experts' stacked weights (`*.experts.w1`, one
    [n_experts, out, in] tensor each) "expert"; the shared experts are plain matrices."""
    parts = name.split(".")
    if "router" in parts and parts[-1] != "bias":
        return "router"
    if "experts" in parts and "shared_experts" not in parts and parts[-1] != "bias":
        return "expert"
    return dense_param_role(name)
