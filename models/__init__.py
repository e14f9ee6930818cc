"""Plain Flax reference models for mixed-precision experiments.

They know nothing of mixed precision: every layer is a standard Flax layer
exposed as an attribute and taking the usual ``dtype``/``param_dtype`` knobs,
so precision policies can be applied from outside.

* `MLP` / `LinenMLP`: the MLP of PyTorch's AMP recipe, with `mse_loss`.
* `ResNet` / `LinenResNet`: a CIFAR-style ResNet with BatchNorm, with
  `cross_entropy_loss`.
* `GPT`: a small GPT-style decoder, with `lm_loss`.
* `Llama` / `LlamaConfig`: a Llama-style decoder (RMSNorm, rotary
  embeddings, SwiGLU, grouped-query attention), tiny to 1B, with `lm_loss`.
* `data`: deterministic synthetic batches for each.
"""

from . import data
from .convert import linen_variables_from_nnx
from .gpt import Block as GPTBlock
from .gpt import CausalSelfAttention
from .gpt import GPT
from .gpt import lm_loss
from .gpt import MLPBlock
from .llama import Llama
from .llama import LlamaConfig
from .mlp import linen_params_from_nnx
from .mlp import LinenMLP
from .mlp import MLP
from .mlp import mse_loss
from .resnet import BasicBlock
from .resnet import cross_entropy_loss
from .resnet import LinenBasicBlock
from .resnet import LinenResNet
from .resnet import ResNet

__all__ = [
    "BasicBlock", "CausalSelfAttention", "GPT", "GPTBlock", "LinenBasicBlock",
    "LinenMLP", "LinenResNet", "Llama", "LlamaConfig", "MLP", "MLPBlock",
    "ResNet",
    "cross_entropy_loss", "data", "linen_params_from_nnx",
    "linen_variables_from_nnx", "lm_loss", "mse_loss",
]
