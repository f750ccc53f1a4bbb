"""The GRT model: config, the gated recurrent block, the language model, depth samplers, FLOPs."""

from grt_megatron.model.config import ConfigError, GRTConfig
from grt_megatron.model.depth_sampler import DepthDraw, DepthSampler
from grt_megatron.model.flops import count_parameters, forward_flops_per_token, train_flops_per_token
from grt_megatron.model.language_model import GRTLanguageModel
from grt_megatron.model.recurrent_block import GatedRecurrentBlock

__all__ = [
    "ConfigError", "GRTConfig", "DepthDraw", "DepthSampler", "GatedRecurrentBlock", "GRTLanguageModel",
    "count_parameters", "forward_flops_per_token", "train_flops_per_token",
]
