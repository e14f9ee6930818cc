"""A small GPT-style decoder in NNX.

token `nnx.Embed` + learned position `nnx.Embed`, ``num_layers`` pre-LayerNorm
blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP ->
residual), final LayerNorm, then logits from the token embedding
(``embed.attend``, tied) or from a separate `nnx.Linear` head (untied).

Every layer takes the standard Flax ``dtype``/``param_dtype`` knobs. The
attention is a plain module around two `nnx.Linear`s; its ``attention`` knob
picks how the scores and the weighted sum are computed on the projections'
outputs, in whatever dtype those are (which precision they get is for a policy
or autocast applied from outside to decide):

* ``"fused"`` (the default): `jax.nn.dot_product_attention`, causal, through
  `fused_causal_attention`: cuDNN's fused (flash) kernel when the program is
  compiled for a CUDA GPU and cuDNN takes the inputs (bfloat16 or float16,
  a head dim it supports), XLA's implementation otherwise. The T x T scores
  never reach memory in the cuDNN kernel, and its softmax runs in float32.
* ``"einsum"``: the contractions written out, through the ``einsum_op`` knob
  (``jnp.einsum`` by default, the knob `nnx.Einsum` has), with the softmax
  (`jax.nn.softmax`) in the scores' dtype.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

Dtype = Any
ATTENTION_KINDS = ("fused", "einsum")
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# One jitted `jax.nn.dot_product_attention`: a traced program shows the call
# as one `jit` equation named "dot_product_attention" (which a jaxpr
# interpreter, such as an autocast, can recognise as attention).
_dot_product_attention = jax.jit(
    jax.nn.dot_product_attention,
    static_argnames=("is_causal", "implementation"))


@functools.lru_cache(maxsize=None)
def _cudnn_takes(q_shape: tuple[int, ...], kv_shape: tuple[int, ...],
                 dtype: Any) -> bool:
  """Whether cuDNN's fused attention accepts causal q, k = v of this type.

  Asked by tracing the cuDNN implementation abstractly: it raises when
  cuDNN is not installed or the dtype (float32), head dim, head counts or
  sequence lengths are ones it does not take.
  """
  if jnp.dtype(dtype) not in _HALF:
    return False
  q = jax.ShapeDtypeStruct(q_shape, dtype)
  kv = jax.ShapeDtypeStruct(kv_shape, dtype)
  try:
    jax.eval_shape(functools.partial(_dot_product_attention, is_causal=True,
                                     implementation="cudnn"), q, kv, kv)
  except (RuntimeError, NotImplementedError, ValueError, TypeError):
    return False
  return True


def fused_causal_attention(q: jax.Array, k: jax.Array,
                           v: jax.Array) -> jax.Array:
  """Causal `jax.nn.dot_product_attention` of ``[batch, length, heads, dim]``.

  Where cuDNN takes the inputs (bfloat16/float16 and a head dim it supports,
  cuDNN installed), the program carries both implementations and the
  platform it is compiled for picks (`jax.lax.platform_dependent`): cuDNN's
  fused flash-attention kernel for a CUDA GPU, XLA's implementation
  elsewhere (the CPU). Otherwise, float32 inputs say, XLA's implementation.
  Both scale the scores by ``1 / sqrt(dim)`` and run the softmax in float32.

  Keys and values may have fewer heads than the queries (grouped-query
  attention): a number that divides the queries', each kv head serving that
  many consecutive query heads.

  Args:
    q: queries ``[batch, length, heads, dim]``.
    k: keys ``[batch, length, kv_heads, dim]``, q's dtype.
    v: values, k's shape and q's dtype.

  Returns:
    ``[batch, length, heads, dim]`` in the inputs' dtype.
  """
  xla = functools.partial(_dot_product_attention, is_causal=True,
                          implementation="xla")
  if q.dtype == jnp.float16:
    # XLA's implementation contracts float16 into float32
    # (preferred_element_type), which XLA:CPU does not implement: on the CPU
    # it runs on float32 copies instead.
    half_xla = xla
    xla = lambda q, k, v: lax.platform_dependent(
        q, k, v, default=half_xla, cpu=lambda *qkv: half_xla(
            *(a.astype(jnp.float32) for a in qkv)).astype(jnp.float16))
  if not (k.shape == v.shape and q.dtype == k.dtype == v.dtype
          and _cudnn_takes(tuple(q.shape), tuple(k.shape), q.dtype)):
    return xla(q, k, v)
  cudnn = functools.partial(_dot_product_attention, is_causal=True,
                            implementation="cudnn")
  return lax.platform_dependent(q, k, v, cuda=cudnn, default=xla)

# GPT-2's embedding initialisation.
_EMBED_INIT = nnx.initializers.normal(stddev=0.02)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention.

  Attributes:
    qkv: `nnx.Linear` ``d_model -> 3 * d_model`` (queries, keys, values).
    proj: `nnx.Linear` ``d_model -> d_model``, the output projection.
    num_heads: number of heads.
    dtype: dtype q, k and v are cast to before the attention contractions
      (None: leave them as the projections return them).
    attention: "fused" (`fused_causal_attention`: cuDNN's flash kernel on a
      GPU where it takes the inputs, XLA's implementation elsewhere) or
      "einsum" (the contractions through ``einsum_op``, then a softmax in the
      scores' dtype).
    einsum_op: the einsum used for scores and the weighted sum of values
      when ``attention="einsum"``.
  """

  def __init__(self, d_model: int, num_heads: int, *,
               dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32,
               attention: str = "fused",
               einsum_op: Callable[..., jax.Array] = jnp.einsum,
               rngs: nnx.Rngs):
    if d_model % num_heads:
      raise ValueError(f"d_model={d_model} is not divisible by "
                       f"num_heads={num_heads}")
    if attention not in ATTENTION_KINDS:
      raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got "
                       f"{attention!r}")
    knobs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.num_heads = num_heads
    self.dtype = dtype
    self.attention = attention
    self.einsum_op = einsum_op
    self.qkv = nnx.Linear(d_model, 3 * d_model, **knobs)
    self.proj = nnx.Linear(d_model, d_model, **knobs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, d_model = x.shape
    head_dim = d_model // self.num_heads
    q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
    if self.dtype is not None:
      q, k, v = (a.astype(self.dtype) for a in (q, k, v))
    shape = (batch, length, self.num_heads, head_dim)
    q, k, v = (a.reshape(shape) for a in (q, k, v))
    if self.attention == "fused":
      out = fused_causal_attention(q, k, v)
      return self.proj(out.reshape(batch, length, d_model))
    # Scaling q rather than the scores keeps float16 scores further from
    # overflow.
    q = q * jnp.asarray(1.0 / np.sqrt(head_dim), q.dtype)
    scores = self.einsum_op("bqhd,bkhd->bhqk", q, k)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    # The weighted sum runs in the values' dtype (float32 scores, say, from an
    # accumulate-in-float32 einsum_op, would otherwise promote it).
    out = self.einsum_op("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
    return self.proj(out.reshape(batch, length, d_model))


class MLPBlock(nnx.Module):
  """Linear -> gelu -> Linear.

  Attributes:
    fc: `nnx.Linear` ``d_model -> hidden``.
    out: `nnx.Linear` ``hidden -> d_model``.
  """

  def __init__(self, d_model: int, hidden: int, *,
               dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs):
    knobs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.fc = nnx.Linear(d_model, hidden, **knobs)
    self.out = nnx.Linear(hidden, d_model, **knobs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
  """Pre-LayerNorm transformer block.

  Attributes:
    ln1: `nnx.LayerNorm` before attention.
    attn: `CausalSelfAttention`.
    ln2: `nnx.LayerNorm` before the MLP.
    mlp: `MLPBlock`.
  """

  def __init__(self, d_model: int, num_heads: int, mlp_hidden: int, *,
               dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, attention: str = "fused",
               rngs: nnx.Rngs):
    knobs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.ln1 = nnx.LayerNorm(d_model, **knobs)
    self.attn = CausalSelfAttention(d_model, num_heads, attention=attention,
                                    **knobs)
    self.ln2 = nnx.LayerNorm(d_model, **knobs)
    self.mlp = MLPBlock(d_model, mlp_hidden, **knobs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
  """GPT-style decoder returning next-token logits.

  Attributes:
    embed: token `nnx.Embed` (``vocab_size x d_model``); also the output
      head when ``tie_embeddings`` (via ``embed.attend``).
    pos_embed: learned position `nnx.Embed` (``max_len x d_model``).
    blocks: `nnx.List` of `Block`, or with ``scan_layers`` one `Block` whose
      variables are stacked along a leading axis of size ``num_layers``.
    ln_f: final `nnx.LayerNorm`.
    head: `nnx.Linear` ``d_model -> vocab_size`` without bias, or None when
      the embeddings are tied.
    tie_embeddings: whether the logits come from ``embed.attend``.
    max_len: longest sequence accepted.
    scan_layers: whether the blocks run under `nnx.scan`.
  """

  def __init__(self, vocab_size: int = 256, d_model: int = 64,
               num_heads: int = 4, num_layers: int = 2, max_len: int = 64, *,
               mlp_ratio: int = 4, tie_embeddings: bool = True,
               scan_layers: bool = False,
               dtype: Optional[Dtype] = None,
               param_dtype: Dtype = jnp.float32, attention: str = "fused",
               rngs: nnx.Rngs):
    """Builds the layers.

    Args:
      vocab_size: number of token ids.
      d_model: model width.
      num_heads: attention heads (must divide ``d_model``).
      num_layers: transformer blocks.
      max_len: longest sequence (size of the position table).
      mlp_ratio: MLP hidden width as a multiple of ``d_model``.
      tie_embeddings: True for logits from the token embedding, False for a
        separate head.
      scan_layers: False for a list of blocks, run one after the other;
        True for one block with its variables stacked (`nnx.vmap`), run
        under `nnx.scan`: the compiled program holds one block, and its
        compile time does not grow with ``num_layers``.
      dtype: compute dtype of every layer (None: follow the inputs).
      param_dtype: dtype the parameters are created in.
      attention: how each block's attention is computed: "fused" (cuDNN's
        flash kernel on a GPU where it takes the inputs, XLA's
        implementation elsewhere) or "einsum" (see `CausalSelfAttention`).
      rngs: parameter initialisation keys.
    """
    knobs = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.tie_embeddings = tie_embeddings
    self.max_len = max_len
    self.embed = nnx.Embed(vocab_size, d_model, embedding_init=_EMBED_INIT,
                           **knobs)
    self.pos_embed = nnx.Embed(max_len, d_model, embedding_init=_EMBED_INIT,
                               **knobs)
    self.scan_layers = scan_layers
    if scan_layers:
      @nnx.split_rngs(splits=num_layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def stacked(rngs):
        return Block(d_model, num_heads, mlp_ratio * d_model, dtype=dtype,
                     param_dtype=param_dtype, attention=attention, rngs=rngs)
      self.blocks = stacked(rngs)
    else:
      self.blocks = nnx.List([
          Block(d_model, num_heads, mlp_ratio * d_model, attention=attention,
                **knobs)
          for _ in range(num_layers)])
    self.ln_f = nnx.LayerNorm(d_model, **knobs)
    # nnx.data: a None attribute would otherwise be static, and a module
    # could never be put there later.
    self.head = nnx.data(None if tie_embeddings else nnx.Linear(
        d_model, vocab_size, use_bias=False, **knobs))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Logits ``[batch, length, vocab_size]`` of int tokens ``[batch, length]``.

    The logits at position ``t`` depend on ``tokens[:, :t + 1]`` only.
    """
    length = tokens.shape[-1]
    if length > self.max_len:
      raise ValueError(f"sequence length {length} > max_len {self.max_len}")
    # Only when needed: flax 0.12.3's Embed takes no out_sharding.
    rows = _rows_of(tokens)
    x = self.embed(tokens) if rows is None else self.embed(
        tokens, out_sharding=rows)
    x = x + self.pos_embed(jnp.arange(length))
    if self.scan_layers:
      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      def run(block, x):
        return block(x)
      x = run(self.blocks, x)
    else:
      for block in self.blocks:
        x = block(x)
    x = self.ln_f(x)
    if self.head is None:
      return self.embed.attend(x)
    return self.head(x)


def _rows_of(tokens: jax.Array) -> Optional[jax.sharding.PartitionSpec]:
  """The sharding of the embeddings of `tokens`: under `Explicit` mesh axes,
  a table lookup must be told it (each device looks up its own tokens);
  None otherwise."""
  spec = getattr(getattr(jax.typeof(tokens), "sharding", None), "spec", ())
  if all(p is None for p in spec):
    return None
  return jax.sharding.PartitionSpec(*spec, None)


@jax.custom_vjp
def token_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-position cross-entropy ``logsumexp(logits) - logits[label]``, float32.

  The log-sum-exp runs in float32 whatever the logits' dtype. The gradient
  with respect to the logits, ``(softmax(logits) - onehot(label)) * g``, is
  computed in float32 in one elementwise pass and returned in the logits'
  dtype, so no float32 copy of half logits (or of their gradient) needs to
  live in memory; for float32 logits it equals what autodiff gives.

  Args:
    logits: ``[..., vocab]`` logits, any float dtype.
    labels: ``[...]`` int labels in ``[0, vocab)``.

  Returns:
    ``[...]`` float32 losses.
  """
  return _token_cross_entropy_fwd(logits, labels)[0]


def _token_cross_entropy_fwd(logits, labels):
  x = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(x, axis=-1)
  picked = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
  return lse - picked, (logits, labels, lse)


def _token_cross_entropy_bwd(residuals, g):
  logits, labels, lse = residuals
  x = logits.astype(jnp.float32)
  onehot = labels[..., None] == jnp.arange(logits.shape[-1])
  grad = (jnp.exp(x - lse[..., None]) - onehot) * g[..., None]
  return grad.astype(logits.dtype), None


token_cross_entropy.defvjp(_token_cross_entropy_fwd, _token_cross_entropy_bwd)


def lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, computed in float32.

  The log-sum-exp over the vocabulary runs in float32 (`token_cross_entropy`);
  half logits are not copied to float32 as a whole, and their gradient comes
  back in their own dtype.

  Args:
    logits: ``[batch, length, vocab]`` logits of a causal model run on
      ``tokens``.
    tokens: ``[batch, length]`` the same tokens: position ``t``'s logits are
      scored against ``tokens[:, t + 1]``; the last position has no target.

  Returns:
    The scalar float32 loss.
  """
  batch, length = tokens.shape
  # Every position is scored (the last against a dummy label, weighted 0)
  # rather than slicing the logits: a slice's gradient would be a padded
  # copy of the whole logits gradient.
  labels = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])],
                           axis=1)
  weights = (jnp.arange(length) < length - 1).astype(jnp.float32)
  losses = token_cross_entropy(logits, labels)
  return jnp.sum(losses * weights) / (batch * (length - 1))
