from trainlib.models.llama3.model import (
    FLAVORS,
    ModelArgs,
    Transformer,
    block_forward_flops,
    flops_per_token,
    get_model_args,
)
from trainlib.models.llama3.parallelize import parallelize_llama
from trainlib.models.llama3 import state_dict_adapter

__all__ = ["FLAVORS", "ModelArgs", "Transformer", "block_forward_flops", "flops_per_token", "get_model_args",
           "parallelize_llama", "state_dict_adapter"]
