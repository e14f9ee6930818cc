"""Dimension numbers of `lax.dot_general`: its gradients', a two-operand
einsum's, and their shardings under Explicit mesh axes.

The FP8 matmuls (`jmp_amp._src.fp8_ops`) write their own backward GEMMs and
run einsums as one `dot_general`; this is the index algebra they share.
"""

from __future__ import annotations

import string

import jax
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np


def kept(ndim: int, *dims) -> list[int]:
  return [i for i in range(ndim) if not any(i in d for d in dims)]


def norm_dims(dims) -> tuple:
  (lc, rc), (lb, rb) = dims
  return ((tuple(map(int, lc)), tuple(map(int, rc))),
          (tuple(map(int, lb)), tuple(map(int, rb))))


def _transpose_lhs_dims(dims, lhs_ndim, rhs_ndim, swap_ans=False):
  """(dimension numbers, axes) of the lhs cotangent of ``dot_general(lhs,
  rhs, dims)``: ``transpose(dot_general(g, rhs, dimension numbers), axes)``
  (the transpose rule of `lax.dot_general`)."""
  (xc, yc), (xb, yb) = dims
  xk, yk = kept(lhs_ndim, xc, xb), kept(rhs_ndim, yc, yb)
  nb = len(xb)
  if swap_ans:
    ans_y = list(range(nb, nb + len(yk)))
  else:
    ans_y = list(range(nb + len(xk), nb + len(xk) + len(yk)))
  new_dims = ((tuple(ans_y), tuple(yk)), (tuple(range(nb)), tuple(yb)))
  xc_by_y = list(np.take(list(xc), np.argsort(list(yc))))
  axes = tuple(int(i) for i in np.argsort(list(xb) + xk + xc_by_y))
  return new_dims, axes


def grad_dims(dims, lhs_ndim, rhs_ndim):
  """((dims, axes) of the lhs gradient, (dims, axes) of the rhs gradient).

  The lhs gradient is ``transpose(dot_general(g, rhs, dims), axes)``, the
  rhs gradient ``transpose(dot_general(lhs, g, dims), axes)``: with the
  operand first, a kernel laid out ``[in, out]`` (nn.Linear's) gets its
  gradient in its own layout, with no transposed float32 copy.
  """
  (lc, rc), (lb, rb) = dims
  (gdims, raxes) = _transpose_lhs_dims(((rc, lc), (rb, lb)), rhs_ndim,
                                       lhs_ndim, swap_ans=True)
  # dot_general(g, lhs, gdims) is laid out (batch, g's kept, lhs's kept);
  # dot_general(lhs, g, swapped) is (batch, lhs's kept, g's kept).
  (g_c, l_c), (g_b, l_b) = gdims
  nb, nl = len(g_b), lhs_ndim - len(l_c) - len(l_b)
  ng = len(raxes) - nb - nl
  where = list(range(nb)) + [nb + nl + i for i in range(ng)] + [
      nb + i for i in range(nl)]
  rhs_grad = (((l_c, g_c), (l_b, g_b)), tuple(where[a] for a in raxes))
  return _transpose_lhs_dims(dims, lhs_ndim, rhs_ndim), rhs_grad


# --------------------------------------------------------------------------
# Two-operand einsum as one dot_general.


def einsum_as_dot_general(subscripts: str, lhs_shape, rhs_shape):
  """How ``jnp.einsum(subscripts, lhs, rhs)`` is one `lax.dot_general`.

  An index of size 1 in one operand and n in the other broadcasts, as in
  `jnp.einsum`: the operand of size 1 drops it (a sum over one element).

  Returns:
    ``(lhs_sum, rhs_sum, dims, perm)``: sum `lhs` over the axes `lhs_sum`
    and `rhs` over `rhs_sum` (indices that appear in one operand only and
    not in the output, and broadcast axes of size 1), then
    ``transpose(dot_general(lhs, rhs, dims), perm)`` is the einsum.

  Raises:
    ValueError: `subscripts` is not a two-operand einsum of these shapes
      (ranks, or an index's sizes neither equal nor 1), or repeats an index
      within one operand (a diagonal).
  """
  lhs_shape, rhs_shape = tuple(lhs_shape), tuple(rhs_shape)
  lhs_ndim, rhs_ndim = len(lhs_shape), len(rhs_shape)
  spec = subscripts.replace(" ", "")
  ins, arrow, out = spec.partition("->")
  operands = ins.split(",")
  if len(operands) != 2:
    raise ValueError(f"a two-operand einsum string such as 'ab,bc->ac' is "
                     f"needed, got {subscripts!r}")
  fresh = [c for c in string.ascii_letters if c not in spec]
  widest = max(ndim - (len(s) - 3) for s, ndim in
               zip(operands, (lhs_ndim, rhs_ndim)) if "..." in s) if (
                   "..." in ins) else 0
  ellipsis = "".join(fresh[:widest])

  def expand(s, ndim):
    if "..." not in s:
      return s
    n = ndim - (len(s) - 3)
    return s.replace("...", ellipsis[widest - n:] if n else "")

  a, b = expand(operands[0], lhs_ndim), expand(operands[1], rhs_ndim)
  if not arrow:
    once = sorted(c for c in set(a + b) if (a + b).count(c) == 1
                  and c not in ellipsis)
    out = ellipsis + "".join(once)
  else:
    out = out.replace("...", ellipsis)
  for name, s, ndim in (("first", a, lhs_ndim), ("second", b, rhs_ndim)):
    if len(s) != ndim:
      raise ValueError(f"einsum {subscripts!r}: the {name} operand has rank "
                       f"{ndim}, the string names {len(s)} axes")
    if len(set(s)) != len(s):
      raise ValueError(f"einsum {subscripts!r}: an index repeated within "
                       f"one operand (a diagonal) is not supported in FP8")
  size_a, size_b = dict(zip(a, lhs_shape)), dict(zip(b, rhs_shape))
  shared = [c for c in a if c in b and size_a[c] != size_b[c]]
  for c in shared:
    if 1 not in (size_a[c], size_b[c]):
      raise ValueError(
          f"einsum {subscripts!r}: index "
          f"{'...' if c in ellipsis else c!r} has size {size_a[c]} in the "
          f"first operand and {size_b[c]} in the second; sizes must be "
          f"equal or 1 (broadcast), shapes {lhs_shape} and {rhs_shape}")
  drop_a = {c for c in shared if size_a[c] == 1}
  drop_b = {c for c in shared if size_b[c] == 1}
  in_a, in_b = set(a) - drop_a, set(b) - drop_b
  a_sum = tuple(i for i, c in enumerate(a)
                if c in drop_a or (c not in in_b and c not in out))
  b_sum = tuple(i for i, c in enumerate(b)
                if c in drop_b or (c not in in_a and c not in out))
  a = "".join(c for i, c in enumerate(a) if i not in a_sum)
  b = "".join(c for i, c in enumerate(b) if i not in b_sum)
  contract = [c for c in a if c in b and c not in out]
  batch = [c for c in a if c in b and c in out]
  dims = ((tuple(a.index(c) for c in contract),
           tuple(b.index(c) for c in contract)),
          (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
  result = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
  perm = tuple(result.index(c) for c in out)
  return a_sum, b_sum, dims, perm


# --------------------------------------------------------------------------
# Sharding in types (Explicit mesh axes).


def is_explicit(mesh) -> bool:
  return AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()) or ())


def explicit_out(out_sharding):
  """Whether `out_sharding` goes to the GEMM itself (Explicit axes, as
  `lax.dot_general` takes it) rather than to a sharding constraint."""
  if out_sharding is None:
    return False
  mesh = getattr(out_sharding, "mesh", None)
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  return is_explicit(mesh)


def spec_of(x) -> tuple:
  """`x`'s partition spec, one entry per axis (None where unsharded)."""
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (np.ndim(x) - len(spec))


def grad_sharding(x, axes):
  """Under Explicit axes, the sharding of `x`'s gradient as its GEMM lays
  it out, before ``transpose(axes)`` puts it in `x`'s layout (each
  gradient keeps its operand's sharding, as JAX's own transpose of
  `lax.dot_general` does); else None (the compiler's choice)."""
  sharding = jax.typeof(x).sharding
  if not is_explicit(getattr(sharding, "mesh", None)):
    return None
  spec, out = spec_of(x), [None] * np.ndim(x)
  for i, axis in enumerate(axes):
    out[axis] = spec[i]
  return NamedSharding(sharding.mesh, PartitionSpec(*out))


def like(scale, y):
  """A rowwise `scale` (broadcastable to `y`) sharded as `y` is, so that
  ``y * scale`` is defined under Explicit axes."""
  sharding = jax.typeof(y).sharding
  if not is_explicit(getattr(sharding, "mesh", None)):
    return scale
  spec = tuple(s if n != 1 else None
               for s, n in zip(spec_of(y), np.shape(scale)))
  return jax.sharding.reshard(
      scale, NamedSharding(sharding.mesh, PartitionSpec(*spec)))


def permuted(out_sharding, perm):
  """The einsum's `out_sharding` laid out as its GEMM writes the result,
  which ``transpose(perm)`` turns into the einsum's layout."""
  if isinstance(out_sharding, NamedSharding):
    mesh, spec = out_sharding.mesh, out_sharding.spec
  else:
    mesh, spec = None, out_sharding
  spec = tuple(spec) + (None,) * (len(perm) - len(spec))
  gemm = [None] * len(perm)
  for i, axis in enumerate(perm):
    gemm[axis] = spec[i]
  spec = PartitionSpec(*gemm)
  return spec if mesh is None else NamedSharding(mesh, spec)
