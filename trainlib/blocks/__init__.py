"""The building blocks the parallel axes find by class, one room below both the families and the axes.

`attention.py`: the `Attention` base every family's attention module subclasses, its kernel `sdpa` and the
document mask; `moe.py`: the Mixture-of-Experts parts (router, grouped experts, shared experts, the MoE
feed-forward) and `config.py` their torch-free shape (`MoEArgs`) and `[moe]` section (`MoEConfig`).
Families (`trainlib/models/`) build models from them; `trainlib/parallel/` shards and routes them by
class; neither imports the other for it. Importing this package imports no torch.
"""
