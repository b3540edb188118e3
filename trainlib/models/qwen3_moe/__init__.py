"""Qwen3-MoE: the model (model.py), its parallel plan (parallelize.py), its Hugging Face adapter
(state_dict_adapter.py), and the one ModelSpec the registry lists."""

from trainlib.models.qwen3_moe import state_dict_adapter
from trainlib.models.qwen3_moe.model import (
    FLAVORS,
    ModelArgs,
    MoEBlock,
    Transformer,
    block_forward_flops,
    block_shapes,
    flops_per_token,
    get_model_args,
)
from trainlib.models.qwen3_moe.parallelize import parallelize_qwen3_moe, validate_degrees
from trainlib.models.spec import ModelSpec, StageRoots

SPEC = ModelSpec(
    name="qwen3_moe",
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
)

__all__ = ["FLAVORS", "ModelArgs", "MoEBlock", "SPEC", "Transformer", "block_forward_flops", "block_shapes",
           "flops_per_token", "get_model_args", "parallelize_qwen3_moe", "state_dict_adapter", "validate_degrees"]
