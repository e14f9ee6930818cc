"""Optimizer state and master weights in 16 bits, with stochastic rounding.

Mixed precision halves activations; the persistent training state -- float32
master weights (4 bytes per parameter) and Adam's two float32 moments (8) --
stays. `compress_state` keeps any optax optimizer's state in bfloat16 and
`low_precision_params` updates bfloat16 params, both computing in float32 and
rounding the results back without bias: stochastically (random bits from a
key in the optimizer state) or, for the params, with a compensation buffer
(Kahan summation) that carries what rounding dropped into the next step.
"""

from __future__ import annotations

from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

STATE_ROUNDING = ("stochastic", "nearest")
PARAM_ROUNDING = ("stochastic", "kahan", "nearest")

# Folded into the seed so that the two transformations, chained with the same
# seed, never draw the same random bits.
_STATE_STREAM, _PARAM_STREAM = 0x5354, 0x5041


def _check_floating(x: Any, what: str) -> None:
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{what} must be a real floating array (float32, "
                    f"bfloat16, float16), got dtype {dtype}")


def _mix(h: jax.Array) -> jax.Array:
  """A bijective 32-bit hash with full avalanche (Wellons' lowbias32)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def _key_seed(key: jax.Array) -> jax.Array:
  """A uint32 scalar hash of a JAX random key (typed or raw key data)."""
  words = (jax.random.key_data(key) if jnp.issubdtype(
      jnp.asarray(key).dtype, jax.dtypes.prng_key) else jnp.asarray(key))
  words = words.astype(jnp.uint32).reshape(-1)
  s0 = jnp.uint32(0x9E3779B9)
  for i in range(words.shape[0]):
    s0 = _mix(s0 ^ words[i])
  return s0


def _random_bits16(seed: jax.Array, s1: jax.Array, bits: jax.Array
                   ) -> jax.Array:
  """16 uniform random bits per element: a hash of the seeds, the element's
  index and its value's bits (`bits`, float32 bitcast to uint32).

  The element's index in the whole array (an iota, which XLA partitions like
  any other value) is what is hashed, so the bits do not depend on the
  sharding. Rounding needs bits that are uniform for each element, not
  cryptographic ones: ``index * K1`` xor `seed`, a uniform word for each
  element, times the odd `K2` (a bijection, so still uniform) xor the
  value's bits and `s1`. Two multiplies per element: `jax.random.bits`
  (threefry) costs many times the rounding, and so did two rounds of a full
  32-bit mix in the compile time of a train step with hundreds of leaves.
  Hashing the value in gives each leaf its own bits from seeds shared by all
  leaves: nothing in a leaf's kernel is its own (per-leaf seed constants made
  every kernel distinct and a GPT's 16-bit train step 2-3x slower to
  compile; issue #33).

  Args:
    seed, s1: uint32 scalars, uniform random words.
    bits: the float32 values to round, bitcast to uint32.
  """
  # One iota, reshaped: the row-major index, in fewer instructions than an
  # iota per dimension.
  index = jax.lax.iota(jnp.uint32, bits.size).reshape(bits.shape)
  word = ((index * jnp.uint32(0x9E3779B9)) ^ seed) * jnp.uint32(0x7FEB352D)
  return (word ^ bits ^ s1) >> 16


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
  """Rounds `x` to bfloat16, up or down at random, without bias.

  A value between two neighbouring bfloat16 numbers ``lo < x < hi`` becomes
  ``hi`` with probability ``(x - lo) / (hi - lo)`` (to 2**-16) and ``lo``
  otherwise, so the expected result is `x` itself; representable values,
  infinities and NaN stay as they are. Finite values stay finite: one beyond
  bfloat16's largest finite value (about 3.39e38) becomes that value, with
  its sign (saturation), never inf. The random bits are a hash of `key`,
  each element's index in `x` and its value: the same for the same key,
  whatever the sharding of `x`.

  Example:
    >>> x = jnp.full(1000, 1.0 + 2.0 ** -10)  # 1/8 of the way to 1 + 2**-7
    >>> y = jmp_amp.optim.stochastic_round(x, jax.random.key(0))
    >>> sorted(set(y.tolist())), y.dtype
    ([1.0, 1.0078125], dtype(bfloat16))
    >>> round(float(jnp.mean(y.astype(jnp.float32))) - 1.0, 4)  # ~2**-10
    0.001

  Args:
    x: a real floating array (float32; narrower dtypes are exact in float32).
      At most 2**32 elements.
    key: one JAX random key: typed (``jax.random.key(seed)``) or its raw
      ``uint32`` key data (``jax.random.PRNGKey(seed)``). Anything else (an
      int, a float array) is refused: its values would be truncated into
      bits, and different keys would round alike.

  Returns:
    A bfloat16 array of the shape of `x`.
  """
  _check_floating(x, "stochastic_round: x")
  _check_key(key, "stochastic_round: key")
  x = jnp.asarray(x)
  if x.dtype == jnp.bfloat16:
    return x
  if x.size > 2 ** 32:
    raise ValueError(f"stochastic_round: x has {x.size} elements; at most "
                     "2**32 are supported (round it in parts)")
  x = x.astype(jnp.float32)
  # float32 and bfloat16 share sign and exponent: bfloat16 keeps the top 16
  # bits. Adding 16 uniform random bits to the low half and truncating rounds
  # the magnitude up with probability (dropped bits) / 2**16: unbiased.
  s0 = _key_seed(key)
  return _round_with_seeds(x, (s0, _mix(s0 ^ jnp.uint32(0x85EBCA6B))))


def _round_with_seeds(x: jax.Array, seeds) -> jax.Array:
  """`stochastic_round` of float32 `x` with the bits of two uint32 seeds.

  All in uint32 arithmetic on the bits, with `lax` operations only: about 20
  instructions per leaf (a jnp `isinf`/`copysign` version took 50, per leaf
  and per step, in a train step's compile time; issue #33). Integer
  arithmetic also keeps subnormals, which float operations on CPU may
  flush.
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  magnitude = bits & jnp.uint32(0x7FFFFFFF)
  # A finite magnitude is at most 0x7F7FFFFF, so adding 16 random bits cannot
  # carry into the sign. Rounding up from bfloat16's largest finite value
  # (0x7F7F0000) gives inf (0x7F800000); the minimum saturates it instead.
  rounded = jnp.minimum(
      (magnitude + _random_bits16(*seeds, bits)) & jnp.uint32(0xFFFF0000),
      jnp.uint32(0x7F7F0000))
  rounded = jax.lax.select(magnitude < jnp.uint32(0x7F800000),
                           (bits & jnp.uint32(0x80000000)) | rounded, bits)
  # Exact: the low 16 bits are zero (or the value is inf or NaN).
  return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(
      jnp.bfloat16)


def _check_key(key: Any, what: str) -> None:
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if jnp.shape(key) != ():
      raise ValueError(f"{what} must be one key, got an array of keys of "
                       f"shape {jnp.shape(key)}")
    return
  if dtype is not None and dtype == jnp.uint32 and jnp.ndim(key) == 1:
    return
  got = (f"{type(key).__name__} {key!r}" if dtype is None else
         f"a {dtype} array of shape {jnp.shape(key)}")
  raise TypeError(
      f"{what} must be a JAX PRNG key: jax.random.key(seed), or its raw "
      f"uint32 key data, jax.random.PRNGKey(seed); got {got}")


def _round_like(x: jax.Array, dtype, seeds, rounding: str) -> jax.Array:
  if rounding == "stochastic" and np.dtype(dtype) == jnp.bfloat16:
    if x.size > 2 ** 32:
      raise ValueError(f"stochastic rounding: an array of {x.size} elements;"
                       " at most 2**32 are supported")
    return _round_with_seeds(x.astype(jnp.float32), seeds)
  return x.astype(dtype)


# `_round_like` jitted: traced, and outside a jit compiled, once per leaf
# shape. Init rounds outside a jit: op by op, each of a rounding's ~20
# operations was compiled once per shape (a 16-block GPT's Adam state: 4.9 s
# on a CPU, about 7 s on an H200); one program for the whole state takes
# 1.8 s on a CPU, this 0.4 s. Inside a step the leaves of one shape share a
# trace (tracing each again cost that GPT's 16-bit step about two thirds of
# a second of tracing and lowering), and the call is inlined: the same
# program (issue #33).
_round_once = jax.jit(_round_like, static_argnums=(1, 3))


def _to_f32(tree):
  """Floating leaves narrower than float32, in float32; others unchanged."""
  def up(x):
    if (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
        and jnp.finfo(x.dtype).bits < 32):
      return x.astype(jnp.float32)
    return x
  return jax.tree.map(up, tree)


def _check_rounding(rounding: Any, accepted: tuple[str, ...], who: str) -> None:
  if not isinstance(rounding, str) or rounding not in accepted:
    raise ValueError(f"{who}: rounding must be one of {accepted}, got "
                     f"{rounding!r}")


def _seed_key(seed: Any, stream: int, who: str) -> jax.Array:
  if isinstance(seed, (bool, np.bool_)) or not isinstance(
      seed, (int, np.integer)):
    raise TypeError(f"{who}: seed must be an int, got {type(seed).__name__}:"
                    f" {seed!r}")
  return jax.random.key_data(jax.random.fold_in(jax.random.key(seed), stream))


def _next_seeds(key_data: jax.Array):
  """The state's next key and the seeds of every leaf's bits for this step.

  One threefry split per update; every leaf gets the step key's two words,
  and its bits differ from other leaves' through its values, which the bits
  hash too (`_random_bits16`). Nothing in a leaf's kernel is its own: XLA
  compiles one kernel per shape. (A threefry `fold_in` per leaf, and later a
  constant xor-ed into each leaf's seed, made a GPT's train step several
  times slower to compile. Issue #33.)
  """
  following, now = jax.random.split(jax.random.wrap_key_data(key_data))
  w0, w1 = jax.random.key_data(now).astype(jnp.uint32).reshape(-1)[:2]
  return jax.random.key_data(following), (w0, w1)


class CompressedState(NamedTuple):
  """State of `compress_state`.

  Attributes:
    key: the stochastic-rounding key (raw ``uint32[2]`` key data), split once
      per update.
    inner_state: the wrapped optimizer's state, its floating arrays of at
      least one dimension in bfloat16.
  """
  key: jax.Array
  inner_state: optax.OptState


def _compressible(x) -> bool:
  """Float32 (or wider) arrays: moments, accumulators, traces.

  Scalars stay: they are hyper-parameters (`optax.inject_hyperparams`), loss
  scales or counters, whose rounding would change the algorithm and whose
  memory is nothing.
  """
  return (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
          and jnp.finfo(x.dtype).bits >= 32 and jnp.ndim(x) > 0)


def compress_state(inner: optax.GradientTransformation, *,
                   rounding: str = "stochastic", seed: int = 0
                   ) -> optax.GradientTransformationExtraArgs:
  """Keeps `inner`'s state in bfloat16; computes each update in float32.

  Each update casts the stored state, the gradients and the params to
  float32, runs `inner`, and writes the floating arrays of its new state back
  in bfloat16 -- with stochastic rounding (default: unbiased, so small
  increments to Adam's moments are kept on average instead of lost), or to
  nearest. Integer leaves (step counts) and floating scalars (e.g. the
  hyper-parameters of `optax.inject_hyperparams`) are kept as they are. The
  updates it returns are float32.

  The random bits come from a key in the state, split once per update: runs
  are reproducible, resume bitwise from a checkpoint of the state, and do not
  depend on the sharding. Inside `jmp_amp.loss_scaling`, a skipped step leaves
  the whole state, key included, bit for bit unchanged.

  Example:
    >>> opt = jmp_amp.optim.compress_state(optax.adam(1e-3))
    >>> params = {"w": jnp.ones(3)}
    >>> state = opt.init(params)
    >>> updates, state = opt.update({"w": jnp.ones(3)}, state, params)
    >>> state.inner_state[0].mu["w"].dtype, updates["w"].dtype
    (dtype(bfloat16), dtype('float32'))

  Args:
    inner: any optax transformation (``optax.MultiSteps(...)`` as its
      ``.gradient_transformation()``).
    rounding: ``"stochastic"`` or ``"nearest"``.
    seed: the seed of the stochastic-rounding key.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `CompressedState`.
  """
  who = "compress_state"
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
        f"{who}: inner must be an optax.GradientTransformation (e.g. "
        "optax.adam(1e-3); for optax.MultiSteps pass "
        f".gradient_transformation()), got {type(inner).__name__}")
  _check_rounding(rounding, STATE_ROUNDING, who)
  key0 = _seed_key(seed, _STATE_STREAM, who)
  inner_update = optax.with_extra_args_support(inner).update

  def compress(tree, seeds):
    return jax.tree.map(
        lambda x: _round_once(x, jnp.bfloat16, seeds, rounding)
        if _compressible(x) else x, tree)

  def init_fn(params):
    state = inner.init(_to_f32(params))
    # A copy: a step that donates the state must not delete the key that
    # every later init starts from.
    return CompressedState(key=jnp.copy(key0), inner_state=compress(
        state, None if rounding == "nearest" else _next_seeds(key0)[1]))

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, CompressedState):
      raise TypeError(f"{who}: state must be the CompressedState this "
                      f"transformation's init returned, got "
                      f"{type(state).__name__}")
    stored = state.inner_state
    # Decompress only what compress wrote: bfloat16 arrays of >= 1 dimension.
    full = jax.tree.map(
        lambda x: x.astype(jnp.float32)
        if x.dtype == jnp.bfloat16 and x.ndim > 0 else x, stored)
    updates, new = inner_update(_to_f32(updates), full, _to_f32(params),
                                **extra_args)
    key, seeds = _next_seeds(state.key)
    return updates, CompressedState(key=key, inner_state=compress(new, seeds))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class LowPrecisionParamsState(NamedTuple):
  """State of `low_precision_params`.

  Attributes:
    key: the stochastic-rounding key (raw ``uint32[2]`` key data), split once
      per update (unused by ``"kahan"`` and ``"nearest"``).
    compensation: with ``"kahan"``, per 16-bit param what the last rounding
      dropped, in the param's dtype (float32 params: a placeholder scalar);
      otherwise ``()``.
  """
  key: jax.Array
  compensation: Any


def low_precision_params(rounding: str = "stochastic", *, seed: int = 0
                         ) -> optax.GradientTransformation:
  """Adds updates to 16-bit params in float32 and rounds the sum without bias.

  Chain it last, after the optimizer: ``optax.chain(optax.adamw(1e-3),
  low_precision_params())``. For each bfloat16 (or float16) param ``p`` it
  computes ``p + u`` in float32, rounds it to the param's dtype and returns
  the float32 update ``p_new - p``, so that `optax.apply_updates` (which
  `nnx.Optimizer` and linen's ``TrainState`` call) produces ``p_new`` exactly
  -- unless the param shrinks by more than 2**16 in one step, where the
  result is within 2**-24 of the old param's magnitude of it. Float32 params
  pass through unchanged; if every param is float32 (a policy without
  ``param="bfloat16"``), `init` warns that it does nothing. The rounding:

  * ``"stochastic"`` (bfloat16 params only): unbiased, so updates far below
    the param's resolution still move it on average; random bits from a key
    in the state, split once per update.
  * ``"kahan"``: round to nearest and keep the rounding error in a
    compensation buffer (the param's dtype, in the state), added to the next
    step's update: deterministic, 2 more bytes per parameter.
  * ``"nearest"``: plain rounding to nearest, what bfloat16 params get
    without this transformation; small updates are lost.

  Example:
    >>> opt = optax.chain(optax.sgd(1e-3),
    ...                   jmp_amp.optim.low_precision_params("kahan"))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = opt.init(params)
    >>> for _ in range(10):  # 1 - 1e-3 rounds back to 1 in bfloat16
    ...   updates, state = opt.update({"w": jnp.ones(2)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"].tolist()  # 1 - 1e-2, to bfloat16's resolution
    [0.98828125, 0.98828125]

  Args:
    rounding: ``"stochastic"``, ``"kahan"`` or ``"nearest"``.
    seed: the seed of the stochastic-rounding key.

  Returns:
    An `optax.GradientTransformation` whose state is a
    `LowPrecisionParamsState`.
  """
  who = "low_precision_params"
  _check_rounding(rounding, PARAM_ROUNDING, who)
  key0 = _seed_key(seed, _PARAM_STREAM, who)

  def narrow(p) -> bool:
    return jnp.finfo(p.dtype).bits < 32

  def check_params(params):
    if params is None:
      raise ValueError(f"{who}: update needs the params (opt.update(grads, "
                       "state, params))")
    for path, p in jax.tree_util.tree_leaves_with_path(params):
      _check_floating(p, f"{who}: the param at {jax.tree_util.keystr(path)}")
      if (rounding == "stochastic" and narrow(p)
          and jnp.result_type(p) != jnp.bfloat16):
        raise TypeError(
            f"{who}: stochastic rounding targets bfloat16, but the param at "
            f"{jax.tree_util.keystr(path)} is {jnp.result_type(p)}; use "
            "rounding='kahan' for float16 params")

  def init_fn(params):
    check_params(params)
    leaves = jax.tree_util.tree_leaves(params)
    if leaves and not any(narrow(p) for p in leaves):
      # Nothing to round: almost always a policy that forgot the params.
      dtypes = sorted({str(jnp.result_type(p)) for p in leaves})
      warnings.warn(
          f"{who}: every param is {' or '.join(dtypes)} ({len(leaves)} "
          "arrays), so it changes nothing; store the params in bfloat16 "
          "(jmp_amp.flax: mixed_rules(..., param=\"bfloat16\"), or a "
          "policy with p=bf16) or leave low_precision_params out", stacklevel=2)
    key = jnp.copy(key0)  # a donated state must not delete key0
    if rounding != "kahan":
      return LowPrecisionParamsState(key=key, compensation=())
    return LowPrecisionParamsState(key=key, compensation=jax.tree.map(
        lambda p: jnp.zeros(jnp.shape(p) if narrow(p) else (), p.dtype),
        params))

  def update_fn(updates, state, params=None):
    if not isinstance(state, LowPrecisionParamsState):
      raise TypeError(f"{who}: state must be the LowPrecisionParamsState "
                      "this transformation's init returned, got "
                      f"{type(state).__name__}")
    check_params(params)
    p_leaves, treedef = jax.tree.flatten(params)
    u_leaves = treedef.flatten_up_to(updates)
    key, seeds = state.key, None
    if rounding == "stochastic":
      key, seeds = _next_seeds(state.key)
    comp = (treedef.flatten_up_to(state.compensation) if rounding == "kahan"
            else [None] * len(p_leaves))
    out, new_comp = [], []
    for p, u, c in zip(p_leaves, u_leaves, comp):
      if not narrow(p):
        out.append(u)
        new_comp.append(c)
        continue
      p32 = p.astype(jnp.float32)
      exact = p32 + u.astype(jnp.float32)
      if c is not None:
        exact = exact + c.astype(jnp.float32)
      new = _round_once(exact, p.dtype, seeds, rounding)
      if c is not None:
        new_comp.append((exact - new.astype(jnp.float32)).astype(c.dtype))
      out.append(new.astype(jnp.float32) - p32)
    compensation = (treedef.unflatten(new_comp) if rounding == "kahan"
                    else state.compensation)
    return treedef.unflatten(out), LowPrecisionParamsState(key, compensation)

  return optax.GradientTransformation(init_fn, update_fn)
