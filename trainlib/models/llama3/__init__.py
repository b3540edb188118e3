from trainlib.models.llama3.model import (
    FLAVORS,
    ModelArgs,
    Transformer,
    count_params,
    flops_per_token,
    get_model_args,
)
from trainlib.models.llama3.parallelize import parallelize_llama

__all__ = ["FLAVORS", "ModelArgs", "Transformer", "count_params", "flops_per_token", "get_model_args",
           "parallelize_llama"]
