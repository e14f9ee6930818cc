"""Plain Flax reference models for mixed-precision experiments.

They know nothing of mixed precision: every layer is a standard Flax layer
exposed as an attribute and taking the usual ``dtype``/``param_dtype`` knobs,
so precision policies can be applied from outside.

* `MLP` / `LinenMLP`: the MLP of PyTorch's AMP recipe, with `mse_loss`.
* `ResNet` / `LinenResNet`: a CIFAR-style ResNet with BatchNorm, with
  `cross_entropy_loss`.
* `GPT`: a small GPT-style decoder, with `lm_loss`.
* `data`: deterministic synthetic batches for each.
"""

from models import data
from models.convert import linen_variables_from_nnx
from models.gpt import GPT
from models.gpt import Block as GPTBlock
from models.gpt import CausalSelfAttention
from models.gpt import MLPBlock
from models.gpt import lm_loss
from models.mlp import LinenMLP
from models.mlp import MLP
from models.mlp import linen_params_from_nnx
from models.mlp import mse_loss
from models.resnet import BasicBlock
from models.resnet import LinenBasicBlock
from models.resnet import LinenResNet
from models.resnet import ResNet
from models.resnet import cross_entropy_loss

__all__ = [
    "BasicBlock", "CausalSelfAttention", "GPT", "GPTBlock", "LinenBasicBlock",
    "LinenMLP", "LinenResNet", "MLP", "MLPBlock", "ResNet",
    "cross_entropy_loss", "data", "linen_params_from_nnx",
    "linen_variables_from_nnx", "lm_loss", "mse_loss",
]
