"""Qwen3-MoE: the model (model.py), its parallel plan (parallelize.py), its Hugging Face adapter
(state_dict_adapter.py), its shapes (args.py), and the one ModelSpec the registry lists.

Everything but the shapes loads on first use: `args.py` imports without torch,
and importing it runs this file (the command line and recipes are checked
against the flavors before torch is imported, trainlib.models.flavors).
"""

from __future__ import annotations

from trainlib.models.lazy import lazy_attributes
from trainlib.models.qwen3_moe.args import FLAVORS, NAME, ModelArgs, get_model_args

# name -> the submodule that defines it (None: the name is a submodule)
_MODULE_OF = {"Transformer": "model", "block_forward_flops": "model", "block_shapes": "model", "flops_per_token": "model", "parallelize_qwen3_moe": "parallelize", "validate_degrees": "parallelize", "state_dict_adapter": None}

__all__ = ['FLAVORS', 'ModelArgs', 'SPEC', 'Transformer', 'block_forward_flops', 'block_shapes', 'flops_per_token', 'get_model_args', 'parallelize_qwen3_moe', 'state_dict_adapter', 'validate_degrees']


def _spec():
    from trainlib.models.qwen3_moe import state_dict_adapter
    from trainlib.models.qwen3_moe.model import Transformer, block_forward_flops, block_shapes, flops_per_token
    from trainlib.models.qwen3_moe.parallelize import parallelize_qwen3_moe, validate_degrees
    from trainlib.models.roles import moe_param_role
    from trainlib.models.spec import ModelSpec, StageRoots

    return ModelSpec(
        name=NAME,
        flavors=FLAVORS,
        get_args=get_model_args,
        args_type=ModelArgs,
        model_cls=Transformer,
        parallelize=parallelize_qwen3_moe,
        validate=validate_degrees,
        stage_roots=StageRoots(first=("tok_embeddings",), last=("norm", "output")),
        output_module="output",
        flops_per_token=flops_per_token,
        block_forward_flops=block_forward_flops,
        block_shapes=block_shapes,
        state_dict_adapter=state_dict_adapter,
        param_role=moe_param_role,
    )


__getattr__ = lazy_attributes(__name__, _MODULE_OF, _spec)
