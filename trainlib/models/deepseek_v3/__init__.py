"""DeepSeek-V3 (and Kimi K2): the model (model.py: MLA, first-k dense blocks, sigmoid group-limited MoE,
multi-token prediction), its parallel plan (parallelize.py), its Hugging Face adapter
(state_dict_adapter.py), its shapes (args.py), and the one ModelSpec the registry lists.

Everything but the shapes loads on first use: `args.py` imports without torch,
and importing it runs this file (the command line and recipes are checked
against the flavors before torch is imported, trainlib.models.flavors).
"""

from __future__ import annotations

from trainlib.models.deepseek_v3.args import FLAVORS, NAME, ModelArgs, get_model_args
from trainlib.models.lazy import lazy_attributes

# name -> the submodule that defines it (None: the name is a submodule)
_MODULE_OF = {"MLA": "model", "MTPModule": "model", "Transformer": "model",
              "block_forward_flops": "model", "block_shapes": "model", "flops_per_token": "model",
              "param_role": "model", "parallelize_deepseek_v3": "parallelize", "tp_plan": "parallelize",
              "validate_degrees": "parallelize", "state_dict_adapter": None}

__all__ = ["FLAVORS", "MLA", "MTPModule", "ModelArgs", "SPEC", "Transformer", "block_forward_flops",
           "block_shapes", "flops_per_token", "get_model_args", "param_role", "parallelize_deepseek_v3",
           "state_dict_adapter", "tp_plan", "validate_degrees"]


def _spec():
    from trainlib.models.deepseek_v3 import state_dict_adapter
    from trainlib.models.deepseek_v3.model import (Transformer, block_forward_flops, block_shapes, flops_per_token,
                                                   param_role)
    from trainlib.models.deepseek_v3.parallelize import parallelize_deepseek_v3, validate_degrees
    from trainlib.models.mtp import mtp_objective, mtp_prepare_batch
    from trainlib.models.spec import ModelSpec, StageRoots

    return ModelSpec(
        name=NAME,
        flavors=FLAVORS,
        get_args=get_model_args,
        args_type=ModelArgs,
        model_cls=Transformer,
        parallelize=parallelize_deepseek_v3,
        validate=validate_degrees,
        # the MTP modules run after the last block and use the output head: the last stage's
        stage_roots=StageRoots(first=("tok_embeddings",), last=("norm", "output", "mtp")),
        output_module="output",
        flops_per_token=flops_per_token,
        block_forward_flops=block_forward_flops,
        block_shapes=block_shapes,
        state_dict_adapter=state_dict_adapter,
        param_role=param_role,
        prepare_batch=lambda args: mtp_prepare_batch(args.mtp_depth),
        objective=lambda args, model_cfg: mtp_objective(args.mtp_depth, model_cfg.mtp_loss_weight),
    )


__getattr__ = lazy_attributes(__name__, _MODULE_OF, _spec)
