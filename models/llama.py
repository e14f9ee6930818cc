"""A Llama-style decoder in NNX.

token `nnx.Embed`, ``num_layers`` pre-norm blocks (RMSNorm -> grouped-query
causal self-attention with rotary position embeddings -> residual, RMSNorm
-> SwiGLU MLP -> residual), a final RMSNorm and an untied `nnx.Linear` head.
No layer has a bias. Every layer takes the standard Flax ``dtype`` /
``param_dtype`` knobs, so precision policies are applied from outside.

The attention runs through `jax.nn.dot_product_attention` (the GPT's
`fused_causal_attention`: cuDNN's fused kernel where the program is compiled
for a CUDA GPU and cuDNN takes the inputs, XLA's implementation elsewhere),
with keys and values of ``num_kv_heads`` heads shared by groups of query
heads. ``scan_layers`` stacks the blocks and runs them under `nnx.scan`;
``remat`` recomputes each block's activations in the backward pass
(`nnx.remat`) except what its checkpoint policy saves.

Example:
  >>> from jmp_amp.models import Llama, LlamaConfig, lm_loss
  >>> config = LlamaConfig.preset("tiny")
  >>> model = Llama(config, scan_layers=True, remat="dots_saveable",
  ...               rngs=nnx.Rngs(0))
  >>> tokens = jnp.zeros((2, config.max_len), jnp.int32)
  >>> model(tokens).shape
  (2, 16, 64)
  >>> model.blocks.attn.k.kernel.shape  # 3 blocks, 2 kv heads of 8
  (3, 32, 16)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

from flax import nnx
import jax
import jax.numpy as jnp

from .gpt import fused_causal_attention
from .gpt import lm_loss

__all__ = ["Llama", "LlamaConfig", "lm_loss"]

Dtype = Any
Policy = Union[None, str, Callable[..., bool]]
_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The shape of a `Llama`.

  Attributes:
    vocab_size: number of token ids.
    d_model: model width.
    num_layers: transformer blocks.
    num_heads: query heads (must divide ``d_model``).
    num_kv_heads: key/value heads (must divide ``num_heads``).
    mlp_hidden: SwiGLU hidden width.
    max_len: longest sequence.
    rope_theta: base of the rotary frequencies.
    norm_eps: RMSNorm's epsilon.
  """
  vocab_size: int = 64
  d_model: int = 32
  num_layers: int = 3
  num_heads: int = 4
  num_kv_heads: int = 2
  mlp_hidden: int = 64
  max_len: int = 16
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5

  def __post_init__(self):
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} is not divisible by "
                       f"num_heads={self.num_heads}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not divisible by "
                       f"num_kv_heads={self.num_kv_heads}")
    if (self.d_model // self.num_heads) % 2:
      raise ValueError(f"the head dim {self.d_model // self.num_heads} must "
                       "be even (rotary embeddings rotate pairs)")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def num_params(self) -> int:
    """Parameters of the model this config builds."""
    d, kv = self.d_model, self.num_kv_heads * self.head_dim
    block = 2 * d * d + 2 * d * kv + 3 * d * self.mlp_hidden + 2 * d
    return self.num_layers * block + 2 * self.vocab_size * d + d

  @classmethod
  def preset(cls, name: str, **overrides: Any) -> "LlamaConfig":
    """One of `PRESETS` by name, with some fields overridden.

    Args:
      name: ``"tiny"`` (CPU tests), ``"small"`` (CPU benchmarks) or ``"1b"``
        (TinyLlama-1.1B's shape, 22 blocks, with 16 query heads of 128:
        1,123,117,056 parameters).
      **overrides: fields to change, e.g. ``num_layers=4``.

    Returns:
      The config.
    """
    if name not in PRESETS:
      raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


PRESETS = {
    "tiny": LlamaConfig(),
    "small": LlamaConfig(vocab_size=256, d_model=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, mlp_hidden=176,
                         max_len=64),
    "1b": LlamaConfig(vocab_size=32000, d_model=2048, num_layers=22,
                      num_heads=16, num_kv_heads=4, mlp_hidden=5632,
                      max_len=2048),
}


def rotary(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``[batch, length, heads, dim]``.

  Position ``t`` rotates the pairs ``(x[..., i], x[..., i + dim / 2])`` by
  ``t * theta ** (-2 i / dim)``; computed in float32, returned in x's dtype.
  """
  length, dim = x.shape[1], x.shape[-1]
  freqs = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  angles = jnp.arange(length, dtype=jnp.float32)[:, None] * freqs
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query causal self-attention with rotary embeddings.

  Attributes:
    q: `nnx.Linear` ``d_model -> num_heads * head_dim``.
    k: `nnx.Linear` ``d_model -> num_kv_heads * head_dim``.
    v: `nnx.Linear` ``d_model -> num_kv_heads * head_dim``.
    o: `nnx.Linear` ``d_model -> d_model``, the output projection.
    dtype: dtype q, k and v are cast to before the attention (None: leave
      them as the projections return them).
  """

  def __init__(self, config: LlamaConfig, *, dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    d, kv = config.d_model, config.num_kv_heads * config.head_dim
    knobs = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
                 rngs=rngs)
    self.num_heads = config.num_heads
    self.num_kv_heads = config.num_kv_heads
    self.rope_theta = config.rope_theta
    self.dtype = dtype
    self.q = nnx.Linear(d, d, **knobs)
    self.k = nnx.Linear(d, kv, **knobs)
    self.v = nnx.Linear(d, kv, **knobs)
    self.o = nnx.Linear(d, d, **knobs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, d_model = x.shape
    head_dim = d_model // self.num_heads
    q, k, v = self.q(x), self.k(x), self.v(x)
    if self.dtype is not None:
      q, k, v = (a.astype(self.dtype) for a in (q, k, v))
    q = rotary(q.reshape(batch, length, self.num_heads, head_dim),
               self.rope_theta)
    kv_shape = (batch, length, self.num_kv_heads, head_dim)
    k = rotary(k.reshape(kv_shape), self.rope_theta)
    out = fused_causal_attention(q, k, v.reshape(kv_shape))
    return self.o(out.reshape(batch, length, d_model))


class SwiGLU(nnx.Module):
  """``down(silu(gate(x)) * up(x))``.

  Attributes:
    gate: `nnx.Linear` ``d_model -> hidden``.
    up: `nnx.Linear` ``d_model -> hidden``.
    down: `nnx.Linear` ``hidden -> d_model``.
  """

  def __init__(self, d_model: int, hidden: int, *,
               dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    knobs = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
                 rngs=rngs)
    self.gate = nnx.Linear(d_model, hidden, **knobs)
    self.up = nnx.Linear(d_model, hidden, **knobs)
    self.down = nnx.Linear(hidden, d_model, **knobs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-RMSNorm Llama block.

  Attributes:
    attn_norm: `nnx.RMSNorm` before attention.
    attn: `Attention`.
    mlp_norm: `nnx.RMSNorm` before the MLP.
    mlp: `SwiGLU`.
  """

  def __init__(self, config: LlamaConfig, *, dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    knobs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    norm = dict(epsilon=config.norm_eps, **knobs)
    self.attn_norm = nnx.RMSNorm(config.d_model, **norm)
    self.attn = Attention(config, **knobs)
    self.mlp_norm = nnx.RMSNorm(config.d_model, **norm)
    self.mlp = SwiGLU(config.d_model, config.mlp_hidden, **knobs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


def _checkpoint_policy(remat: Policy) -> Optional[Callable[..., bool]]:
  if remat is None or callable(remat):
    return remat
  policy = getattr(jax.checkpoint_policies, remat, None)
  if policy is None or not callable(policy) or remat.startswith("_"):
    raise ValueError(
        f"remat must be None, a checkpoint policy or the name of one in "
        f"jax.checkpoint_policies (e.g. 'nothing_saveable', 'dots_saveable', "
        f"'dots_with_no_batch_dims_saveable'), got {remat!r}")
  if remat.startswith("save_") or remat.startswith("offload"):
    raise ValueError(f"jax.checkpoint_policies.{remat} builds a policy from "
                     "arguments: pass the policy it returns instead")
  return policy


class Llama(nnx.Module):
  """Llama-style decoder returning next-token logits.

  Attributes:
    embed: token `nnx.Embed` (``vocab_size x d_model``).
    blocks: `nnx.List` of `Block`, or with ``scan_layers`` one `Block` whose
      variables are stacked along a leading axis of size ``num_layers``.
    norm: final `nnx.RMSNorm`.
    head: `nnx.Linear` ``d_model -> vocab_size`` without bias (untied).
    config: the `LlamaConfig`.
    scan_layers: whether the blocks run under `nnx.scan`.
    remat: the blocks' checkpoint policy (None: no rematerialisation).
  """

  def __init__(self, config: LlamaConfig = LlamaConfig(), *,
               scan_layers: bool = False, remat: Policy = None,
               dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      config: the model's shape (`LlamaConfig.preset` has some).
      scan_layers: False for a list of blocks, run one after the other;
        True for one block with its variables stacked (`nnx.vmap`), run
        under `nnx.scan`: the compiled program holds one block.
      remat: None, or each block under `nnx.remat` with this checkpoint
        policy: a callable, or the name of one in `jax.checkpoint_policies`
        (``"nothing_saveable"`` recomputes everything,
        ``"dots_with_no_batch_dims_saveable"`` keeps the projections'
        outputs).
      dtype: compute dtype of every layer (None: follow the inputs).
      param_dtype: dtype the parameters are created in.
      rngs: parameter initialisation keys.
    """
    _checkpoint_policy(remat)  # Checks it now.
    knobs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.config = config
    self.scan_layers = scan_layers
    self.remat = remat
    self.embed = nnx.Embed(config.vocab_size, config.d_model,
                           embedding_init=_EMBED_INIT, **knobs)
    if scan_layers:
      @nnx.split_rngs(splits=config.num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def stacked(rngs):
        return Block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
      self.blocks = stacked(rngs)
    else:
      self.blocks = nnx.List([Block(config, **knobs)
                              for _ in range(config.num_layers)])
    self.norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, **knobs)
    self.head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False,
                           **knobs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits ``[batch, length, vocab_size]`` of int tokens ``[batch, length]``.

    The logits at position ``t`` depend on ``tokens[:, :t + 1]`` only.
    """
    length = tokens.shape[-1]
    if length > self.config.max_len:
      raise ValueError(f"sequence length {length} > max_len "
                       f"{self.config.max_len}")
    x = self.embed(tokens)
    forward = lambda block, x: block(x)
    if self.remat is not None:
      # Inside a scan the loop already keeps XLA from merging the recomputed
      # forward pass into the original one.
      forward = nnx.remat(forward, policy=_checkpoint_policy(self.remat),
                          prevent_cse=not self.scan_layers)
    if self.scan_layers:
      x = nnx.scan(forward, in_axes=(0, nnx.Carry),
                   out_axes=nnx.Carry)(self.blocks, x)
    else:
      for block in self.blocks:
        x = forward(block, x)
    return self.head(self.norm(x))
