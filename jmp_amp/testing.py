"""Fault injection: put inf/NaN into gradients or activations at chosen steps.

For testing that a training loop survives overflow: the functions here are
pure `jnp` code, so they run inside `jit`, `lax.scan` and `shard_map`, and a
fault schedule costs no host round trip or recompile.

Example (a scanned train loop whose gradients go bad at 50 random steps):

  >>> faults = jmp_amp.testing.random_fault_steps(jax.random.key(0), 1000, 50)
  >>> def body(carry, step):
  ...   params, opt_state = carry
  ...   grads = jax.grad(scaled_loss)(params, opt_state, step)
  ...   grads = jmp_amp.testing.inject_nonfinite(
  ...       grads, step, faults, jax.random.fold_in(key, step))
  ...   updates, opt_state = opt.update(grads, opt_state, params)
  ...   return (optax.apply_updates(params, updates), opt_state), None

Not imported by `import jmp_amp`; import `jmp_amp.testing` explicitly.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

_KINDS = ("nan", "inf", "-inf")
_VALUES = np.array([np.nan, np.inf, -np.inf], np.float32)


def random_fault_steps(key: jax.Array, num_steps: int, num_faults: int, *,
                       start: int = 0) -> np.ndarray:
  """Draws `num_faults` distinct steps in ``[start, num_steps)``, sorted.

  Returns a host NumPy int32 array: a schedule is test configuration, and the
  test usually needs it on the host too (to build the clean reference run).
  """
  if not 0 <= start <= num_steps:
    raise ValueError(f"start must be in [0, num_steps={num_steps}], got {start}")
  if not 0 <= num_faults <= num_steps - start:
    raise ValueError(
        f"cannot draw {num_faults} distinct fault steps from "
        f"{num_steps - start} steps [{start}, {num_steps})")
  steps = jax.random.choice(key, num_steps - start, (num_faults,),
                            replace=False)
  return np.sort(np.asarray(steps, np.int32) + np.int32(start))


def is_fault_step(step: Any, fault_steps: Any) -> jax.Array:
  """Whether `step` (a scalar, traced or not) is one of `fault_steps`."""
  fault_steps = jnp.asarray(fault_steps, jnp.int32).reshape(-1)
  if fault_steps.size == 0:
    return jnp.array(False)
  return jnp.any(fault_steps == jnp.asarray(step, jnp.int32))


def inject_nonfinite(tree: T,
                     step: Any,
                     fault_steps: Any,
                     key: Optional[jax.Array] = None,
                     *,
                     kind: Union[str, float] = "random") -> T:
  """Sets one element of one floating leaf of `tree` to inf/NaN on fault steps.

  On any other step `tree` is returned value-for-value unchanged (the select
  is data flow, not Python control flow, so one compiled step serves both).

  Args:
    tree: gradients, activations, or any pytree of arrays.
    step: the current step (traced int is fine).
    fault_steps: the steps to corrupt (1-D ints), or a bool that says whether
      this step is a fault step (e.g. ``step % 37 == 0``).
    key: picks the leaf, the element and (for ``kind="random"``) the value;
      without a key the first element of the first floating leaf is corrupted.
    kind: "nan", "inf", "-inf", "random" (one of the three, drawn with `key`;
      NaN without a key) or a float value.

  Returns:
    `tree`, with one non-finite element on fault steps.
  """
  pred = jnp.asarray(fault_steps)
  if pred.dtype != jnp.bool_:
    pred = is_fault_step(step, pred)
  elif pred.ndim != 0:
    raise ValueError(f"a boolean fault_steps must be a scalar, got shape "
                     f"{pred.shape}")

  leaves, treedef = jax.tree_util.tree_flatten(tree)
  floating = [i for i, x in enumerate(leaves)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
              and np.size(x) > 0]
  if not floating:
    raise ValueError("inject_nonfinite: the tree has no non-empty floating "
                     "leaf to corrupt")

  # One draw for every random choice: each jax.random call inlines a
  # threefry kernel, and a dozen of them slow down compiling a scanned step.
  if key is None:
    bits = jnp.zeros((len(floating) + 2,), jnp.uint32)
  else:
    bits = jax.random.bits(key, (len(floating) + 2,), jnp.uint32)
  chosen = bits[0] % np.uint32(len(floating))
  value = _fault_value(kind, bits[1])

  out = list(leaves)
  for slot, i in enumerate(floating):
    x = jnp.asarray(leaves[i])
    flat = x.reshape(-1)
    idx = (bits[2 + slot] % np.uint32(flat.size)).astype(jnp.int32)
    hit = jnp.logical_and(pred, chosen == slot)
    bad = jnp.where(hit, value.astype(x.dtype), flat[idx])
    out[i] = flat.at[idx].set(bad).reshape(x.shape)
  return jax.tree_util.tree_unflatten(treedef, out)


def _fault_value(kind: Union[str, float], bits: jax.Array) -> jax.Array:
  if isinstance(kind, str):
    if kind == "random":
      return jnp.asarray(_VALUES)[bits % np.uint32(3)]
    if kind not in _KINDS:
      raise ValueError(f"kind must be one of {_KINDS + ('random',)} or a "
                       f"float, got {kind!r}")
    return jnp.float32(_VALUES[_KINDS.index(kind)])
  return jnp.float32(kind)


# A factor finite in float16 whose cube overflows float16 (and bfloat16 is
# out of reach): values above ~2e-9 overflow float16 after three products;
# float32 stays finite below ~1e25.
_BIG = 2.0 ** 15
# Lost in float16 (below half an ulp of 1), exact in float32.
_EPS = 2.0 ** -12


def _overflow(x: jax.Array) -> jax.Array:
  y = x * _BIG * _BIG * _BIG
  return y / _BIG / _BIG / _BIG


def _nan(x: jax.Array) -> jax.Array:
  one = x * 0 + 1
  d = (one + _EPS) - one
  return x + (d / d - 1)


_PRECISION_FAULTS = {"overflow": _overflow, "nan": _nan}


def precision_fault(op: Callable[..., Any], kind: str = "overflow", *,
                    backward: bool = False) -> Callable[..., Any]:
  """`op` whose float16 results (or their gradients) go inf or NaN.

  A fault that only half precision triggers, as a real range or rounding
  problem would: the wrapped op returns ``op(*args, **kwargs)`` unchanged in
  float32 (a policy keeping it in float32 removes the fault), while in
  float16 "overflow" makes it inf in a ``mul`` (a product by ``2**15``,
  three times, then divided back) and "nan" makes it NaN in a ``div``
  (``d / d`` with ``d = (1 + 2**-12) - 1``, zero in float16). With
  ``backward=True`` the forward value is untouched and the same fault hits
  the cotangent in the gradient computation instead.

  Put it in a module through its op knob (``nnx.Linear(...,
  dot_general=...)``, ``nnx.Conv``'s ``conv_general_dilated``, an
  ``einsum_op``), to test that a tool finds the module and op.

  Example:
    >>> op = precision_fault(jnp.multiply, "nan")
    >>> x = jnp.array([1.0, 2.0])
    >>> op(x, 2.0).tolist(), op(x.astype(jnp.float16), 2.0).tolist()
    ([2.0, 4.0], [nan, nan])
    >>> g = jax.grad(lambda x: precision_fault(jnp.sin, backward=True)(x))
    >>> float(g(jnp.float16(1.0))), float(g(jnp.float32(1.0))) > 0
    (inf, True)

  Args:
    op: the function whose results get the fault.
    kind: "overflow" (inf, in ``mul``) or "nan" (NaN, in ``div``).
    backward: put the fault in the gradient instead of the forward value.

  Returns:
    The wrapped function.
  """
  if kind not in _PRECISION_FAULTS:
    raise ValueError(f"kind must be one of {sorted(_PRECISION_FAULTS)}, got "
                     f"{kind!r}")
  if not callable(op):
    raise TypeError(f"precision_fault wraps a function, got {op!r}")
  fault = _PRECISION_FAULTS[kind]
  if backward:
    fault = _in_gradient(fault)

  def wrapped(*args, **kwargs):
    return jax.tree.map(fault, op(*args, **kwargs))

  return wrapped


def _in_gradient(fault: Callable[[jax.Array], jax.Array]):
  @jax.custom_vjp
  def identity(x):
    return x

  def fwd(x):
    return x, None

  def bwd(_, g):
    return (fault(g),)

  identity.defvjp(fwd, bwd)
  return identity
