"""FP8 matmuls: quantization numerics, scaling rules, NNX application, resume."""

import collections
import copy
import dataclasses
import functools
from typing import Any

import flax
from flax import nnx
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers
import jmp_amp
from jmp_amp._src import dot_dims
from jmp_amp._src import fp8
from jmp_amp._src import fp8_compile
from jmp_amp._src import fp8_ops
import jmp_amp.flax
from jmp_amp.flax import _fp8_op as fp8_layers
from jmp_amp.flax import fp8 as flax_fp8
import models

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
MATMUL = (((1,), (0,)), ((), ()))
F32_RECIPE = fp8.FP8Recipe(compute_dtype=jnp.float32)
# Half the spacing of the largest binade: relative rounding error bound of a
# value in the normal range (3 mantissa bits for E4M3, 2 for E5M2), and the
# absolute bound in units of the scale in the subnormal range.
REL_ERR = {E4M3: 2.0**-4, E5M2: 2.0**-3}
SUBNORMAL_HALF_STEP = {E4M3: 2.0**-10, E5M2: 2.0**-17}


# --------------------------------------------------------------------------
# Quantization numerics.


def test_format_maxima():
  assert fp8.fp8_max(E4M3) == 448.0
  assert fp8.fp8_max(E5M2) == 57344.0


@pytest.mark.parametrize("dtype,limit", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_quantize_saturates_at_format_max(dtype, limit):
  x = jnp.array([limit * 1.01, 1e30, -limit * 4, -1e30, limit])
  q = fp8.quantize(x, dtype, 1.0)
  assert q.dtype == dtype
  np.testing.assert_array_equal(np.asarray(q, np.float32),
                                [limit, limit, -limit, -limit, limit])
  # A plain cast would give NaN (E4M3) or infinity (E5M2).
  assert not np.isfinite(np.asarray(x[:2].astype(dtype), np.float32)).all()


def test_quantize_keeps_nonfinite_so_overflow_is_detected():
  x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 1.0])
  q5 = np.asarray(fp8.quantize(x, E5M2, 1.0), np.float32)
  np.testing.assert_array_equal(q5[:2], [np.inf, -np.inf])
  assert np.isnan(q5[2]) and q5[3] == 1.0
  q4 = np.asarray(fp8.quantize(x, E4M3, 1.0), np.float32)
  assert np.isnan(q4[:3]).all(), q4  # E4M3 has no infinity


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scale_maps_amax_to_format_max(dtype):
  scale = fp8.compute_scale(jnp.float32(3.5), dtype)
  np.testing.assert_allclose(scale, 3.5 / fp8.fp8_max(dtype), rtol=1e-7)
  with_margin = fp8.compute_scale(jnp.float32(3.5), dtype, margin=2)
  np.testing.assert_allclose(with_margin, 4 * scale, rtol=1e-7)
  for bad in (0.0, np.inf, np.nan):
    assert float(fp8.compute_scale(jnp.float32(bad), dtype)) == 1.0, bad


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_all_zero_tensor_gives_zeros_and_no_nan(dtype):
  zeros = jnp.zeros((4, 3))
  scale, history = fp8.scale_of(zeros, jnp.zeros((2,)), dtype,
                                fp8.FP8Recipe())
  assert float(scale) == 1.0
  np.testing.assert_array_equal(history, [0.0, 0.0])
  q = fp8.quantize(zeros, dtype, scale)
  np.testing.assert_array_equal(fp8.dequantize(q, scale, jnp.float32), zeros)

  def loss(a, b):
    return jmp_amp.fp8.dot_general(a, b, MATMUL).astype(jnp.float32).sum()
  out = jmp_amp.fp8.dot_general(zeros, jnp.zeros((3, 2)), MATMUL)
  grads = jax.grad(loss, argnums=(0, 1))(zeros, jnp.zeros((3, 2)))
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    log_amax=st.floats(-20.0, 20.0),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([E4M3, E5M2]))
def test_current_scaling_error_bound(log_amax, seed, dtype):
  """|qdq(x) - x| <= max(rel * |x|, half subnormal step * scale)."""
  x = np.random.default_rng(seed).standard_normal(256).astype(np.float32)
  x *= np.float32(2.0**log_amax) / np.abs(x).max()
  scale, _ = fp8.scale_of(jnp.asarray(x), jnp.zeros((1,)), dtype,
                          fp8.FP8Recipe())
  back = np.asarray(fp8.dequantize(fp8.quantize(x, dtype, scale), scale,
                                   jnp.float32))
  bound = np.maximum(REL_ERR[dtype] * np.abs(x),
                     SUBNORMAL_HALF_STEP[dtype] * float(scale))
  err = np.abs(back - x)
  assert (err <= bound * (1 + 1e-6)).all(), (err - bound).max()
  # The amax itself is represented (it lands on the format's max).
  i = np.abs(x).argmax()
  np.testing.assert_allclose(back[i], x[i], rtol=1e-6)


# --------------------------------------------------------------------------
# Scaling rules.


def test_update_history_rolls_and_ignores_nonfinite():
  h = jnp.array([3.0, 2.0, 1.0])
  np.testing.assert_array_equal(fp8.update_history(h, 5.0), [5.0, 3.0, 2.0])
  np.testing.assert_array_equal(fp8.update_history(h, jnp.inf),
                                [3.0, 3.0, 2.0])
  np.testing.assert_array_equal(fp8.update_history(h, jnp.nan),
                                [3.0, 3.0, 2.0])


@pytest.mark.parametrize("size,where", [(3, 1), (4099, 4000), (4099, 0)])
def test_amax_of_a_nan_is_inf_however_the_max_is_reduced(size, where):
  # XLA:CPU's vectorised and cross-device max reductions can drop a NaN
  # (tests/test_distributed.py: across processes); counted as inf, it
  # always gives update_history's fallback.
  x = np.linspace(-2.0, 1.0, size).astype(np.float32)
  x[where] = np.nan
  assert float(fp8.amax(x)) == np.inf
  assert float(jax.jit(fp8.amax)(x)) == np.inf
  x[where] = -np.inf
  assert float(jax.jit(fp8.amax)(x)) == np.inf
  x[where] = 0.0
  assert float(jax.jit(fp8.amax)(x)) == np.max(np.abs(x))


def test_current_scaling_uses_this_steps_amax():
  x = jnp.array([100.0, -50.0, 1.0])
  scale, history = fp8.scale_of(x, jnp.array([7.0]), E4M3, fp8.FP8Recipe())
  np.testing.assert_allclose(scale, 100.0 / 448.0, rtol=1e-7)
  np.testing.assert_array_equal(history, [100.0])


def test_delayed_scaling_uses_history_max_and_saturates_new_outliers():
  recipe = fp8.FP8Recipe(scaling="delayed", history_len=3)
  history = jnp.array([2.0, 4.0, 1.0])
  x = jnp.array([100.0, -3.0, 1.0])
  scale, new_history = fp8.scale_of(x, history, E4M3, recipe)
  np.testing.assert_allclose(scale, 4.0 / 448.0, rtol=1e-7)
  np.testing.assert_array_equal(new_history, [100.0, 2.0, 4.0])
  back = fp8.qdq_operand(
      dataclasses.replace(recipe, compute_dtype=jnp.float32), x, history)
  np.testing.assert_allclose(back, [4.0, -3.0, 1.0], rtol=2.0**-4)
  # The first step (empty history) uses the current amax, not scale 1.
  scale, new_history = fp8.scale_of(x, jnp.zeros((3,)), E4M3, recipe)
  np.testing.assert_allclose(scale, 100.0 / 448.0, rtol=1e-7)
  np.testing.assert_array_equal(new_history, [100.0, 0.0, 0.0])


# --------------------------------------------------------------------------
# Rowwise scaling.

ROWWISE = fp8.FP8Recipe(scaling="rowwise")
DN = (((1,), (0,)), ((), ()))


def _rel(a, b, axis=None):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def test_rowwise_keeps_small_rows_next_to_an_outlier_row():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 64)).astype(np.float32)
  x[0] *= 1e6  # one outlier token
  w = rng.normal(size=(64, 32)).astype(np.float32)
  want = x @ w
  rowwise = jmp_amp.fp8.dot_general(x, w, DN, recipe=ROWWISE)
  current = jmp_amp.fp8.dot_general(x, w, DN)
  # Per-tensor scaling pushes the other rows below E4M3's range; one scale
  # per row keeps them at FP8's usual error.
  assert _rel(current, want, axis=1)[1:].min() > 0.5
  assert _rel(rowwise, want, axis=1).max() < 0.06
  assert rowwise.dtype == jnp.bfloat16


def test_rowwise_gradients_match_float32_with_batch_dims():
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.normal(size=(2, 5, 3, 8)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(8, 2, 6, 3)), jnp.float32)
  dn = (((3, 2), (0, 3)), ((0,), (1,)))  # a batch dim, two contracted
  c = jnp.asarray(rng.normal(size=(2, 5, 6)), jnp.float32)
  f8 = lambda a, b: jnp.sum(jmp_amp.fp8.dot_general(
      a, b, dn, recipe=ROWWISE).astype(jnp.float32) * c)
  f32 = lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dn) * c)
  y = jmp_amp.fp8.dot_general(a, b, dn, recipe=ROWWISE)
  assert y.shape == (2, 5, 6)
  assert _rel(y.astype(jnp.float32), jax.lax.dot_general(a, b, dn)) < 0.06
  for got, want in zip(jax.grad(f8, (0, 1))(a, b),
                       jax.grad(f32, (0, 1))(a, b)):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _rel(got, want) < 0.06, _rel(got, want)


def test_rowwise_histories_record_whole_tensor_amax():
  x = jnp.array([[1.0, -2.0], [0.5, 0.25]])
  w = jnp.array([[3.0], [-1.0]])
  state = fp8.FP8State(jnp.array([9.0, 8.0]), jnp.array([7.0, 6.0]),
                       jnp.array([5.0, 4.0]))
  recipe = fp8.FP8Recipe(scaling="rowwise", history_len=2)
  new = jax.grad(lambda s: jnp.sum(jmp_amp.fp8.dot_general(
      x, w, DN, state=s, recipe=recipe).astype(jnp.float32) * 3.0))(state)
  np.testing.assert_array_equal(new.lhs, [2.0, 9.0])
  np.testing.assert_array_equal(new.rhs, [3.0, 7.0])
  np.testing.assert_array_equal(new.grad, [3.0, 5.0])


def test_rowwise_einsum_is_the_rowwise_dot_general():
  """An einsum is one dot_general plus a transpose, rowwise included."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 5, 3)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
  recipe = dataclasses.replace(ROWWISE, compute_dtype=jnp.float32)
  got = jmp_amp.fp8.einsum("btd,df->bft", x, w, recipe=recipe)
  want = jnp.transpose(jmp_amp.fp8.dot_general(
      x, w, (((2,), (0,)), ((), ())), recipe=recipe), (0, 2, 1))
  np.testing.assert_array_equal(got, want)
  assert _rel(got, jnp.einsum("btd,df->bft", x, w)) < 0.05


def test_rowwise_convolution_is_refused():
  with pytest.raises(ValueError, match="rowwise scaling is for dot_general "
                     "and einsum"):
    jmp_amp.fp8.conv_general_dilated(jnp.ones((1, 2, 4, 4)),
                                     jnp.ones((3, 2, 3, 3)), (1, 1), "VALID",
                                     recipe=ROWWISE)


@pytest.mark.parametrize("spec,lhs,rhs", [
    ("ab,bc->ac", (2, 3), (3, 4)),
    ("ab,bc", (2, 3), (3, 4)),
    ("bqhd,bkhd->bhqk", (2, 5, 3, 4), (2, 6, 3, 4)),
    ("bhqk,bkhd->bqhd", (2, 3, 5, 6), (2, 6, 3, 4)),
    ("...d,df->...f", (2, 5, 3), (3, 4)),
    ("...d,...d->...", (2, 5, 3), (5, 3)),
    ("abc,cd->da", (2, 3, 4), (4, 5)),   # b summed out of lhs alone
    ("ij,jk->ki", (3, 4), (4, 2)),
])
def test_einsum_as_one_dot_general_matches_jnp_einsum(spec, lhs, rhs):
  rng = np.random.default_rng(0)
  a = rng.standard_normal(lhs).astype(np.float32)
  b = rng.standard_normal(rhs).astype(np.float32)
  a_sum, b_sum, dims, perm = dot_dims.einsum_as_dot_general(spec, a.shape,
                                                           b.shape)
  got = jnp.transpose(jax.lax.dot_general(
      a.sum(axis=a_sum), b.sum(axis=b_sum), dims), perm)
  np.testing.assert_allclose(got, np.einsum(spec, a, b), rtol=1e-5,
                             atol=1e-5)


def test_einsum_refuses_diagonals_and_wrong_ranks():
  with pytest.raises(ValueError, match="a diagonal"):
    dot_dims.einsum_as_dot_general("aab,bc->ac", (2, 2, 3), (3, 4))
  with pytest.raises(ValueError, match="the second operand has rank 3"):
    dot_dims.einsum_as_dot_general("ab,bc->ac", (2, 3), (3, 4, 5))
  with pytest.raises(ValueError, match="two-operand einsum string"):
    jmp_amp.fp8.einsum("ab->a", jnp.ones((2, 3)), jnp.ones((3,)))


def test_histories_arrive_as_gradients():
  """The "gradient" of each history is its updated value (current and delayed)."""
  x = jnp.array([[1.0, -2.0], [0.5, 0.25]])
  w = jnp.array([[3.0], [-1.0]])
  for recipe in (fp8.FP8Recipe(history_len=2),
                 fp8.FP8Recipe(scaling="delayed", history_len=2)):
    state = fp8.FP8State(jnp.array([9.0, 8.0]), jnp.array([7.0, 6.0]),
                         jnp.array([5.0, 4.0]))

    def loss(state):
      y = jmp_amp.fp8.dot_general(x, w, MATMUL, state=state, recipe=recipe)
      return 3.0 * y.astype(jnp.float32).sum()
    new = jax.grad(loss)(state)
    np.testing.assert_array_equal(new.lhs, [2.0, 9.0])
    np.testing.assert_array_equal(new.rhs, [3.0, 7.0])
    np.testing.assert_array_equal(new.grad, [3.0, 5.0])  # amax of d(3 sum y)


def test_dot_general_matches_hand_rounded_reference():
  """Forward: E4M3 operands; backward: E5M2 output gradient, straight-through."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)

  def rounded(a, dtype):
    s = fp8.compute_scale(fp8.amax(a), dtype)
    return fp8.dequantize(fp8.quantize(a, dtype, s), s, jnp.float32)

  y, vjp = jax.vjp(
      lambda a, b: jmp_amp.fp8.dot_general(a, b, MATMUL, recipe=F32_RECIPE),
      x, w)
  xq, wq, gq = rounded(x, E4M3), rounded(w, E4M3), rounded(g, E5M2)
  np.testing.assert_allclose(y, xq @ wq, rtol=1e-5, atol=1e-5)
  dx, dw = vjp(g)
  np.testing.assert_allclose(dx, gq @ wq.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, xq.T @ gq, rtol=1e-5, atol=1e-5)
  # And close to float32: relative Frobenius error of a few percent.
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(y, x @ w) < 0.05
  assert rel(dx, g @ w.T) < 0.1 and rel(dw, x.T @ g) < 0.1


def test_default_output_is_bf16_and_backward_is_rounded_through_e5m2():
  x, w = jnp.ones((2, 3)), jnp.ones((3, 2))
  y = jmp_amp.fp8.dot_general(x, w, MATMUL)
  assert y.dtype == jnp.bfloat16
  assert jmp_amp.fp8.dot_general(
      x, w, MATMUL, preferred_element_type=jnp.float32).dtype == jnp.float32
  jaxpr = str(jax.make_jaxpr(jax.grad(
      lambda a, b: jmp_amp.fp8.dot_general(a, b, MATMUL).astype(
          jnp.float32).sum(), argnums=(0, 1)))(x, w))
  assert "f8_e4m3fn" in jaxpr and "f8_e5m2" in jaxpr


def test_overflowing_gradient_stays_nonfinite_and_spares_history():
  """An inf cotangent reaches loss_scaling's finite check; no inf amax kept."""
  x, w = jnp.ones((2, 3)), jnp.ones((3, 2))
  state = fp8.FP8State(*(jnp.array([1.0, 2.0]),) * 3)
  recipe = fp8.FP8Recipe(scaling="delayed", history_len=2)
  _, vjp = jax.vjp(lambda a, b, s: jmp_amp.fp8.dot_general(
      a, b, MATMUL, state=s, recipe=recipe), x, w, state)
  g = jnp.array([[1.0, jnp.inf], [1.0, 1.0]], jnp.bfloat16)
  dx, dw, new_state = vjp(g)
  assert not bool(jmp_amp.all_finite((dx, dw)))
  np.testing.assert_array_equal(new_state.grad, [2.0, 1.0])


def test_autocast_entry_point_takes_equation_params():
  x, w = jnp.ones((4, 8)), jnp.full((8, 3), 0.5)
  eqn = jax.make_jaxpr(lambda a, b: a @ b)(x, w).eqns[0]
  assert eqn.primitive.name == "dot_general"
  y = fp8_ops.autocast_dot_general(x, w, **eqn.params)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), 4.0)
  dx = jax.grad(lambda a: fp8_ops.autocast_dot_general(a, w, **eqn.params)
                .astype(jnp.float32).sum())(x)
  assert dx.dtype == jnp.float32
  # The GEMM is exact; the two float32 scales multiply it within an ulp.
  np.testing.assert_allclose(dx, 1.5, rtol=2.0**-22)


def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="delayed scaling needs state="):
    jmp_amp.fp8.dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), MATMUL,
                        recipe=fp8.FP8Recipe(scaling="delayed", history_len=16))
  with pytest.raises(ValueError, match=r"state.lhs must have shape \(4,\)"):
    jmp_amp.fp8.dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), MATMUL,
                        state=fp8.init_state(fp8.FP8Recipe()),
                        recipe=fp8.FP8Recipe(scaling="delayed", history_len=4))
  with pytest.raises(TypeError, match="floating operands.*int32"):
    jmp_amp.fp8.dot_general(jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2)),
                            MATMUL)
  with pytest.raises(ValueError, match="scaling must be one of"):
    fp8.FP8Recipe(scaling="just-in-time")
  with pytest.raises(ValueError, match="history_len must be an int >= 1, got 0"):
    fp8.FP8Recipe(history_len=0)
  with pytest.raises(ValueError, match="fwd_dtype must be float8_e4m3fn or "
                     "float8_e5m2, got <class 'jax.numpy.float16'>"):
    fp8.FP8Recipe(fwd_dtype=jnp.float16)
  with pytest.raises(ValueError, match="compute_dtype must be"):
    fp8.FP8Recipe(compute_dtype=jnp.int8)


@pytest.mark.parametrize("margin", [-4, 17, 200, -200, 1.5, True])
def test_margin_outside_0_to_16_is_refused(margin):
  # A negative margin saturated every tensor (relative error 0.97); +-200
  # made the scales inf or 0 and the outputs NaN.
  with pytest.raises(ValueError, match=r"margin must be an int from 0 to 16 "
                     r"\(headroom in powers of two\), got "):
    fp8.FP8Recipe(margin=margin)


@pytest.mark.parametrize("scaling", ["current", "rowwise"])
def test_margin_is_honoured_and_costs_bits(scaling):
  """margin m: the largest value maps to fp8_max / 2**m. A power of two
  changes no rounding in E4M3's normal range, only where values sink into
  its subnormals: with magnitudes spread over four decades, the result
  moves."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((8, 16))
                  * 10.0 ** rng.uniform(-4, 0, (8, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
  outs = {m: jmp_amp.fp8.dot_general(x, w, MATMUL, recipe=fp8.FP8Recipe(
      scaling=scaling, margin=m, compute_dtype=jnp.float32)) for m in (0, 3)}
  assert not np.array_equal(outs[0], outs[3])
  for y in outs.values():
    assert _rel(y, x @ w) < 0.15


@pytest.mark.slow
def test_rowwise_rule_for_a_convolution_is_refused_by_set_policies():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.stem = nnx.Linear(4, 4, rngs=rngs)
      self.conv = nnx.Conv(4, 4, (3, 3), rngs=rngs)
      self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
      return self.head(self.conv(self.stem(x)))

  model = Net(nnx.Rngs(0))
  rule = flax_fp8.FP8Policy(fp8.FP8Recipe(scaling="rowwise"),
                            keep_first_last=False)
  with pytest.raises(ValueError, match="rowwise FP8 scaling is for "
                     "dot_general and einsum.*module 'conv' is a convolution"):
    jmp_amp.flax.set_policies(model, {"*": rule})
  # Nothing was converted: the model is as before.
  assert flax_fp8.histories(model) == {}


# --------------------------------------------------------------------------
# Applying FP8 to NNX models.


def _mlp(num_layers=4, **kw):
  return models.MLP(8, 3, num_layers=num_layers, width=16, rngs=nnx.Rngs(0),
                    **kw)


def _gpt(num_layers=2, **kw):
  """An abstract GPT (ShapeDtypeStruct variables): module structure only."""
  return nnx.eval_shape(lambda: models.GPT(
      vocab_size=32, d_model=16, num_heads=2, num_layers=num_layers,
      max_len=8, rngs=nnx.Rngs(0), **kw))


def _fp8_paths(model):
  return sorted(flax_fp8.histories(model))


def test_default_keeps_first_and_last_layers_out():
  set_policies = jmp_amp.flax.set_policies
  assert _fp8_paths(set_policies(_mlp(), {"*": "float8"})) == [
      "layers/1", "layers/2"]
  # Call order (one abstract call): blocks/0/attn/qkv is the first matmul,
  # blocks/1/mlp/out the last; embeddings, norms and the tied head are never
  # FP8. (Without example_args, see test_first_and_last_are_by_call_order.)
  tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  gpt = set_policies(_gpt(), {"*": "float8"}, example_args=(tokens,))
  assert _fp8_paths(gpt) == [
      "blocks/0/attn/proj", "blocks/0/mlp/fc", "blocks/0/mlp/out",
      "blocks/1/attn/proj", "blocks/1/attn/qkv", "blocks/1/mlp/fc"]
  # The probe left the knobs as they were: a second call gives the same.
  set_policies(gpt, {"*": "float8"}, example_args=(tokens,))
  assert len(flax_fp8.histories(gpt)) == 6
  assert gpt.blocks[0].attn.qkv.dot_general is jax.lax.dot_general
  mlp = _mlp(num_layers=12)  # layers/10 sorts after layers/9
  assert sorted(flax_fp8.histories(set_policies(mlp, "float8")), key=len) == [
      f"layers/{i}" for i in range(1, 11)]
  untied = set_policies(_gpt(tie_embeddings=False), "float8",
                        example_args=(tokens,))
  assert "head" not in flax_fp8.histories(untied)
  assert "blocks/1/mlp/out" in flax_fp8.histories(untied)
  everything = set_policies(_gpt(), flax_fp8.FP8Policy(keep_first_last=False))
  assert len(flax_fp8.histories(everything)) == 8


class _NamedAgainstCallOrder(nnx.Module):
  """Three Linear layers whose names sort against the order of the calls."""

  def __init__(self, rngs):
    self.z_first = nnx.Linear(4, 8, rngs=rngs)
    self.m_middle = nnx.Linear(8, 8, rngs=rngs)
    self.a_last = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.a_last(jax.nn.relu(self.m_middle(self.z_first(x))))


@pytest.mark.parametrize("rules", ["float8", {"*": flax_fp8.FP8Policy(
    fp8.FP8Recipe(scaling="delayed", history_len=2))}])
def test_first_and_last_are_by_call_order(rules):
  build = lambda: _NamedAgainstCallOrder(nnx.Rngs(0))
  x = jax.ShapeDtypeStruct((3, 4), jnp.float32)
  model = jmp_amp.flax.set_policies(build(), rules, example_args=(x,))
  assert _fp8_paths(model) == ["m_middle"]
  policies = jmp_amp.flax.get_policies(model)
  assert str(policies["z_first"]) == str(policies["a_last"]) == (
      "p=f32,c=bf16,o=bf16")
  # Without example inputs, the names would say a_last comes first: raise.
  with pytest.raises(ValueError, match=r"depends on the order "
                     r"_NamedAgainstCallOrder calls them.*pass example_args"):
    jmp_amp.flax.set_policies(build(), rules)
  # Not asked to keep the ends: no order needed.
  everything = jmp_amp.flax.set_policies(
      build(), flax_fp8.FP8Policy(keep_first_last=False))
  assert _fp8_paths(everything) == ["a_last", "m_middle", "z_first"]
  # List indices do decide the order: layers/0 ... layers/N.
  assert _fp8_paths(jmp_amp.flax.set_policies(_mlp(), "float8")) == [
      "layers/1", "layers/2"]
  # Or decide enough: the middle block holds neither end, whatever the
  # order within blocks.
  gpt = jmp_amp.flax.set_policies(_gpt(num_layers=3), {
      "blocks/1": "float8", "*": "bf16"})
  assert _fp8_paths(gpt) == ["blocks/1/attn/proj", "blocks/1/attn/qkv",
                             "blocks/1/mlp/fc", "blocks/1/mlp/out"]
  with pytest.raises(ValueError, match="pass example_args"):
    jmp_amp.flax.set_policies(_gpt(num_layers=3), {
        "blocks/2": "float8", "*": "bf16"})


@pytest.mark.parametrize("build,rules,why", [
    # Two Linear layers: the first and the last, which FP8 keeps in bf16.
    (lambda: _mlp(num_layers=2), {"*": "float8"},
     r"the only matmul modules the FP8 rules decide \('layers/0', "
     r"'layers/1'\) are the model's first and last, which FP8 keeps in "
     r"bfloat16 \(keep_first_last\); to convert them too, give them the rule "
     r"value jmp_amp.flax.fp8.FP8Policy\(keep_first_last=False\)"),
    (lambda: _mlp(num_layers=4), {"layers/0": "float8", "layers/3": "float8"},
     r"the only matmul modules the FP8 rules decide \('layers/0', "
     r"'layers/3'\) are the model's first and last"),
    # No Linear, Einsum or Conv at all.
    (lambda: nnx.Sequential(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), nnx.relu),
     {"*": "float8"},
     r"it has no module with a matmul knob \(nnx.Linear, "
     r"nnx.LinearGeneral, nnx.Einsum, nnx.Conv\)"),
    # Other rules decide every matmul module.
    (_mlp, {nnx.Linear: "bfloat16", "*": "float8"},
     r"the FP8 rules decide none of its matmul modules \(other rules "
     r"decide them\)"),
])
def test_fp8_rules_that_convert_nothing_warn_why(build, rules, why):
  model = build()
  with pytest.warns(UserWarning, match=r"jmp_amp.flax: FP8 converted no "
                    rf"layer of \w+: {why}") as record:
    jmp_amp.flax.set_policies(model, rules)
  assert record[0].filename == __file__  # points at the caller
  assert flax_fp8.histories(model) == {}


def test_fp8_module_knobs_state_and_clear():
  delayed = flax_fp8.FP8Policy(fp8.FP8Recipe(scaling="delayed", history_len=5))
  rules = {"layers/3": "float32", "*": delayed}
  model = jmp_amp.flax.set_policies(_mlp(), rules)
  layer = model.layers[1]
  assert isinstance(layer.dot_general, fp8_layers.FP8Op)
  assert layer.dot_general.knob == "dot_general"
  assert layer.dtype == jnp.bfloat16
  assert layer.kernel[...].dtype == jnp.float32  # master weights
  policy = jmp_amp.flax.get_policies(layer)[""]
  assert policy == delayed
  meta = nnx.state(model, flax_fp8.FP8Meta)
  assert jax.tree_util.tree_map(jnp.shape, nnx.to_pure_dict(meta)) == {
      "layers": {i: {"dot_general": {f"{t}_amax_history": (5,)
                                     for t in ("lhs", "rhs", "grad")}}
                 for i in (1, 2)}}
  assert model(jnp.ones((2, 8))).dtype == jnp.float32  # the float32 head
  # split/merge, clone and deepcopy keep the FP8 set-up.
  for copied in (nnx.merge(*nnx.split(model)), nnx.clone(model),
                 copy.deepcopy(model)):
    assert _fp8_paths(copied) == ["layers/1", "layers/2"]
  jmp_amp.flax.clear_policies(model)
  assert flax_fp8.histories(model) == {}
  assert layer.dot_general is jax.lax.dot_general and layer.dtype is None
  # Back to the plain model: same graph definition and state tree.
  assert nnx.graphdef(model) == nnx.graphdef(_mlp())
  assert jax.tree_util.tree_structure(nnx.state(model)) == (
      jax.tree_util.tree_structure(nnx.state(_mlp())))


@pytest.mark.parametrize("build,name", [  # built by the test, not at import
    (lambda: nnx.Embed(8, 4, rngs=nnx.Rngs(0)), "Embed"),
    (lambda: nnx.LayerNorm(4, rngs=nnx.Rngs(0)), "LayerNorm"),
    (lambda: nnx.ConvTranspose(3, 4, (3, 3), rngs=nnx.Rngs(0)),
     "ConvTranspose"),
])
def test_unsupported_module_raises(build, name):
  module = build()
  message = (rf"FP8 cannot handle module '<root>' of type {name}: FP8 "
             rf"converts modules with a matmul knob \('dot_general', "
             rf"'einsum_op', 'conv_general_dilated'")
  for rules in ({type(module): "float8"}, {"": "fp8"}):
    with pytest.raises(ValueError, match=message):
      jmp_amp.flax.set_policies(module, rules)
  # Nothing was changed before the error.
  assert jmp_amp.flax.get_policies(module) == {"": None}


def test_fp8_rules_name_embeddings_and_norms_only_to_raise():
  gpt = _gpt()
  with pytest.raises(ValueError, match="FP8 cannot handle module 'embed' of "
                     "type Embed"):
    jmp_amp.flax.set_policies(gpt, {"embed": "float8", "*": "bf16"})
  with pytest.raises(ValueError, match="FP8 cannot handle module "
                     "'ln_f' of type LayerNorm"):
    jmp_amp.flax.set_policies(gpt, {nnx.LayerNorm: "float8"})
  # Inherited or by default, they follow the rule's bfloat16 policy.
  jmp_amp.flax.set_policies(gpt, {"blocks/0": "float8", "*": "float32"},
                            example_args=(jnp.zeros((2, 8), jnp.int32),))
  policies = jmp_amp.flax.get_policies(gpt)
  assert str(policies["blocks/0/ln1"]) == "p=f32,c=bf16,o=bf16"
  assert gpt.blocks[0].ln1.dtype == jnp.bfloat16
  # blocks/0/attn/qkv is the model's first matmul (it sorts after .../proj).
  assert _fp8_paths(gpt) == [
      "blocks/0/attn/proj", "blocks/0/mlp/fc", "blocks/0/mlp/out"]
  # linen has no FP8 modules: a clear error instead of a silent bf16.
  with pytest.raises(ValueError, match="asks for FP8 .'float8'., which "
                     "jmp_amp.flax applies to NNX models only"):
    jmp_amp.flax.apply_with_policies(flax.linen.Dense(2), {"*": "float8"},
                                     {}, jnp.ones((1, 3)))
  with pytest.raises(ValueError, match="Rules also accept 'float8'"):
    jmp_amp.flax.set_policies(gpt, {"*": "float9"})


# --------------------------------------------------------------------------
# FP8 through set_policies rules.


@pytest.mark.parametrize("build,example,want", [
    (_mlp, None, ["layers/1", "layers/2"]),
    # blocks/0/attn/qkv is the first matmul, blocks/1/mlp/out the last.
    (_gpt, (jax.ShapeDtypeStruct((2, 8), jnp.int32),),
     ["blocks/0/attn/proj", "blocks/0/mlp/fc", "blocks/0/mlp/out",
      "blocks/1/attn/proj", "blocks/1/attn/qkv", "blocks/1/mlp/fc"]),
])
@pytest.mark.parametrize("rule", ["float8", flax_fp8.FP8Policy(
    fp8.FP8Recipe(scaling="delayed", history_len=3))])
def test_mixed_rules_with_an_fp8_default(build, example, want, rule):
  rules = jmp_amp.flax.mixed_rules() | {"*": rule}
  model = jmp_amp.flax.set_policies(build(), rules, example_args=example)
  paths = _fp8_paths(model)
  assert paths == want
  history_len = 1 if rule == "float8" else 3
  shapes = jax.tree_util.tree_map(
      jnp.shape, nnx.to_pure_dict(nnx.state(model, flax_fp8.FP8Meta)))
  leaves = jax.tree_util.tree_leaves(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  assert leaves == [(history_len,)] * (3 * len(want))  # lhs, rhs, grad
  for path, policy in jmp_amp.flax.get_policies(model).items():
    if path in paths:
      assert policy == (flax_fp8.FP8Policy() if rule == "float8" else rule), (
          path)
    elif policy is not None:
      assert isinstance(policy, jmp_amp.Policy), (path, policy)


def test_fp8_rules_select_in_the_glob_dialect():
  everywhere = flax_fp8.FP8Policy(keep_first_last=False)
  model = _gpt()
  # What the rules do not decide keeps its policy (none); exact paths
  # outrank globs.
  jmp_amp.flax.set_policies(model, {"blocks/*/mlp/*": everywhere,
                                    "blocks/0/mlp/out": None,
                                    "blocks/1/mlp/out": None})
  assert _fp8_paths(model) == ["blocks/0/mlp/fc", "blocks/1/mlp/fc"]
  policies = jmp_amp.flax.get_policies(model)
  assert {p for p, pol in policies.items() if pol is not None} == {
      "blocks/0/mlp/fc", "blocks/1/mlp/fc"}
  # `*` stays within a segment: "*/out" names no module of the GPT.
  with pytest.raises(ValueError, match=r"rule '\*/out' -> None matched no "
                     r"module of GPT: no module path matches it"):
    jmp_amp.flax.set_policies(model, {"blocks/*/mlp/*": everywhere,
                                      "*/out": None}, strict=True)
  # Applying again replaces the previous set-up; a glob outranks a class.
  jmp_amp.flax.set_policies(model, {nnx.Linear: everywhere,
                                    "blocks/0/**": None})
  assert _fp8_paths(model) == [
      "blocks/1/attn/proj", "blocks/1/attn/qkv", "blocks/1/mlp/fc",
      "blocks/1/mlp/out"]
  assert model.blocks[0].mlp.fc.dot_general is jax.lax.dot_general
  assert model.blocks[0].mlp.fc.dtype is None
  jmp_amp.flax.clear_policies(model)
  assert nnx.graphdef(model) == nnx.graphdef(_gpt())


@pytest.mark.slow
def test_one_rules_dict_mixes_fp8_bf16_and_float32_and_reapplies():
  model = models.GPT(vocab_size=32, d_model=16, num_heads=2, num_layers=2,
                     max_len=8, rngs=nnx.Rngs(0))
  fresh = nnx.graphdef(model)
  rules = {"blocks/*/mlp": "float8", nnx.LayerNorm: "float32",
           "*": "mixed_bfloat16"}
  tokens = jnp.asarray(models.data.token_batch(2, seq_len=8, vocab=32))
  jmp_amp.flax.set_policies(model, rules, example_args=(tokens,))
  # blocks/1/mlp/out is the model's last matmul module: kept bf16.
  assert _fp8_paths(model) == [
      "blocks/0/mlp/fc", "blocks/0/mlp/out", "blocks/1/mlp/fc"]
  attn = model.blocks[0].attn.qkv
  assert attn.dtype == jnp.bfloat16 and attn.dot_general is jax.lax.dot_general
  assert model.blocks[0].ln1.dtype == jnp.float32
  assert str(jmp_amp.flax.get_policies(model)["blocks/0/mlp/fc"]) == "float8"
  logits = nnx.jit(lambda m, t: m(t))(model, tokens)  # one compile
  assert logits.dtype == jnp.bfloat16 and bool(jnp.isfinite(logits).all())
  # Applying other rules replaces the FP8 set-up; clearing restores all.
  jmp_amp.flax.set_policies(model, jmp_amp.flax.mixed_rules())
  assert flax_fp8.histories(model) == {}
  assert model.blocks[0].mlp.fc.dot_general is jax.lax.dot_general
  assert model.blocks[0].mlp.fc.dtype == jnp.bfloat16
  jmp_amp.flax.set_policies(model, {"*": "float8"}, example_args=(tokens,))
  assert len(flax_fp8.histories(model)) == 6
  jmp_amp.flax.clear_policies(model)
  assert flax_fp8.histories(model) == {}
  assert nnx.graphdef(model) == fresh


def test_fp8_policy_spellings_and_bad_values():
  policy = flax_fp8.FP8Policy(
      fp8.FP8Recipe(scaling="delayed", history_len=8), keep_first_last=False,
      param_dtype="bf16")
  assert str(policy) == ("float8(delayed, history_len=8, "
                         "keep_first_last=False, param_dtype=bf16)")
  assert str(policy.policy) == "p=bf16,c=bf16,o=bf16"
  for value in ("float8", "FP8", flax_fp8.FP8Policy()):
    model = jmp_amp.flax.set_policies(_mlp(), {"*": value})
    assert _fp8_paths(model) == ["layers/1", "layers/2"]
  # The one FP8 rule value type is FP8Policy: a bare recipe is refused.
  for rules in ({"*": fp8.FP8Recipe()}, fp8.FP8Recipe()):
    with pytest.raises(TypeError, match=r"Rule '\*' has a jmp_amp.fp8."
                       r"FP8Recipe as its value; .* write jmp_amp.flax.fp8."
                       r"FP8Policy\(recipe\), or 'float8'"):
      jmp_amp.flax.set_policies(_mlp(), rules)
  model = jmp_amp.flax.set_policies(_mlp(), policy)
  assert len(flax_fp8.histories(model)) == 4
  assert model.layers[0].kernel[...].dtype == jnp.bfloat16
  for recipe in ("sometimes", "delayed", None):
    with pytest.raises(TypeError, match="recipe must be a jmp_amp.fp8.FP8R"):
      flax_fp8.FP8Policy(recipe)
  with pytest.raises(TypeError, match="keep_first_last must be a bool"):
    flax_fp8.FP8Policy(keep_first_last="yes")


# --------------------------------------------------------------------------
# nnx.Einsum and nnx.Conv.


def _rounded(x):
  """`x` as an FP8 layer with ``dtype=bfloat16`` sees it: cast to bfloat16,
  rounded through E4M3 with a per-tensor scale, dequantized in bfloat16."""
  x = jnp.asarray(x, jnp.bfloat16)
  scale = fp8.compute_scale(fp8.amax(x), E4M3)
  return np.asarray(fp8.dequantize(fp8.quantize(x, E4M3, scale), scale),
                    np.float32)


@pytest.mark.parametrize("make,x_shape", [
    (lambda: nnx.Einsum("btd,dhk->bthk", (8, 2, 4), (2, 4),
                        rngs=nnx.Rngs(0)), (2, 3, 8)),
    (lambda: nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)), (2, 6, 6, 3)),
])
@pytest.mark.slow
def test_einsum_and_conv_run_in_fp8(make, x_shape):
  x = jnp.asarray(np.random.default_rng(0).standard_normal(x_shape),
                  jnp.float32)
  ref_module = make()
  module = make()
  recipe = fp8.FP8Recipe(scaling="delayed", history_len=2)
  jmp_amp.flax.set_policies(module, flax_fp8.FP8Policy(
      recipe, keep_first_last=False))
  knob = {nnx.Einsum: "einsum_op", nnx.Conv: "conv_general_dilated"}
  op = getattr(module, knob[type(module)])
  assert type(op) is fp8_layers.FP8Op and op.knob == knob[type(module)]
  # Jitted: one compile each instead of an op-by-op run of the FP8 ops.
  y = nnx.jit(lambda m, x: m(x))(module, x)
  assert y.dtype == jnp.bfloat16
  # Against float32 on the same E4M3-rounded input and kernel, plus the
  # bias: equal up to the bfloat16 result's and bias's rounding (2**-8
  # relative each).
  ref_module.kernel[...] = _rounded(ref_module.kernel[...])
  expected = ref_module(jnp.asarray(_rounded(x)))
  np.testing.assert_allclose(np.asarray(y, np.float32), expected,
                             rtol=2**-7, atol=2**-7 * np.abs(expected).max())
  # Forward and backward matmuls on FP8 operands; the histories update.
  grad_fn = flax_fp8.value_and_grad(
      lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2))
  graphdef, state = nnx.split(module)
  sigs = _f8_signatures(
      lambda state, x: grad_fn(nnx.merge(graphdef, state), x)[1], state, x)
  # Forward; backward the kernel gradient and the input gradient (traced
  # because the histories are differentiated; XLA drops it unused), both
  # on the E5M2 output gradient.
  assert sigs["e4m3 x e4m3"] == 1, sigs
  assert sigs["e5m2 x e4m3"] + sigs["e4m3 x e5m2"] == 2, sigs
  nnx.jit(grad_fn)(module, x)
  # The amax of the input the layer sees (cast to bfloat16 by its dtype).
  assert float(op.lhs_amax_history[...][0]) == float(
      jnp.abs(x.astype(jnp.bfloat16)).max())
  assert float(op.grad_amax_history[...][0]) > 0


# --------------------------------------------------------------------------
# Training: state updates, resume, accuracy.


def _make_step():
  @nnx.jit
  def step(model, opt, x, y):
    grad_fn = flax_fp8.value_and_grad(
        lambda m: models.mse_loss(m(x), y))
    loss, grads = grad_fn(model)
    opt.update(model, grads)
    return loss
  return step


def _regression(n=6):
  rng = np.random.default_rng(0)
  return [(rng.standard_normal((16, 8)).astype(np.float32),
           rng.standard_normal((16, 3)).astype(np.float32)) for _ in range(n)]


def test_delayed_scaling_state_updates_in_jitted_step():
  model = jmp_amp.flax.set_policies(_mlp(), flax_fp8.FP8Policy(
      fp8.FP8Recipe(scaling="delayed", history_len=3), keep_first_last=False))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  step = _make_step()
  data = _regression(4)
  for x, y in data:
    loss = step(model, opt, x, y)
  assert np.isfinite(float(loss))
  h = flax_fp8.histories(model)["layers/0"]
  # The first layer's input history holds the last three batches' amaxes.
  np.testing.assert_array_equal(
      h.lhs, [np.abs(x.astype(jnp.bfloat16)).max() for x, _ in data[::-1][:3]])
  assert (np.asarray(h.grad) > 0).all() and (np.asarray(h.rhs) > 0).all()
  # The optimizer's state holds no FP8 histories.
  assert not nnx.state(opt, flax_fp8.FP8Meta)


@pytest.mark.slow
def test_checkpoint_resume_is_bitwise(tmp_path):
  checkpoint = pytest.importorskip("jmp_amp.checkpoint")
  recipe = fp8.FP8Recipe(scaling="delayed", history_len=4)

  def fresh():
    model = jmp_amp.flax.set_policies(_mlp(), jmp_amp.flax.mixed_rules() | {
        "*": flax_fp8.FP8Policy(recipe, keep_first_last=False)})
    assert len(flax_fp8.histories(model)) == 4
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  step = _make_step()
  data = _regression(6)
  model, opt = fresh()
  for x, y in data[:3]:
    step(model, opt, x, y)
  checkpoint.save(tmp_path / "run", {"model": model, "opt": opt}, step=3)
  for x, y in data[3:]:
    step(model, opt, x, y)

  model2, opt2 = fresh()
  restored = checkpoint.restore(tmp_path / "run",
                                target={"model": model2, "opt": opt2})
  model2, opt2 = restored["model"], restored["opt"]
  for x, y in data[3:]:
    step(model2, opt2, x, y)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         nnx.to_pure_dict(nnx.state(model)),
                         nnx.to_pure_dict(nnx.state(model2)))
  assert float(jnp.max(flax_fp8.histories(model2)["layers/3"].grad)) > 0


def _train_scan(model, loss_fn, batches, lr, compiler_options=None):
  """Adam on `batches` (stacked), all steps in one jitted `lax.scan`."""
  opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
  graphdef, state = nnx.split((model, opt))

  # Donated: the FP8 histories must be distinct buffers.
  @functools.partial(jax.jit, donate_argnums=0,
                     compiler_options=compiler_options)
  def train(state, batches):
    def body(state, batch):
      model, opt = nnx.merge(graphdef, state)
      loss, grads = flax_fp8.value_and_grad(
          lambda m: loss_fn(m, batch))(model)
      opt.update(model, grads)
      return nnx.state((model, opt)), loss
    return jax.lax.scan(body, state, batches)

  state, losses = train(state, batches)
  nnx.update((model, opt), state)
  return np.asarray(losses)


def _train_digits(setup, steps=150):
  # 150 steps (300 before): float32 then scores 98 % on the held-out digits
  # and each FP8 or bf16 run of the tests below is within 0.6 points of it
  # (measured on x86), well inside their 1- and 2-point bounds.
  pytest.importorskip("sklearn.datasets")
  (x, y), (xt, yt) = helpers.digits()
  model = setup(models.MLP(64, 10, num_layers=3, width=128,
                           rngs=nnx.Rngs(0)))

  def loss_fn(m, batch):
    logits = m(batch[0]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[1]).mean()

  idx = np.random.default_rng(1).integers(0, len(x), (steps, 128))
  _train_scan(model, loss_fn, (x[idx], y[idx]), 3e-3)
  # Jitted: one compile, not one per eager op (FP8's quantizing ops too).
  logits = nnx.jit(lambda m, v: m(v))(model, xt).astype(jnp.float32)
  return float((logits.argmax(-1) == yt).mean()), model


@pytest.mark.slow
def test_fp8_digits_within_two_points_of_float32():
  acc32, _ = _train_digits(lambda m: m)
  all_fp8 = lambda recipe: lambda m: jmp_amp.flax.set_policies(
      m, flax_fp8.FP8Policy(recipe, keep_first_last=False))
  acc_cur, model = _train_digits(all_fp8(fp8.FP8Recipe()))
  acc_del, _ = _train_digits(all_fp8(
      fp8.FP8Recipe(scaling="delayed", history_len=16)))
  assert acc32 > 0.95, acc32
  assert abs(acc_cur - acc32) <= 0.02, (acc32, acc_cur)
  assert abs(acc_del - acc32) <= 0.02, (acc32, acc_del)
  assert len(flax_fp8.histories(model)) == 3
  assert bool(jmp_amp.all_finite(nnx.state(model, nnx.Param)))


def _train_gpt(setup, steps=300):
  model = setup(models.GPT(vocab_size=64, d_model=32, num_heads=2,
                           num_layers=2, max_len=32, dtype=jnp.bfloat16,
                           rngs=nnx.Rngs(0)))
  tokens = np.stack([models.data.token_batch(16, seq_len=32, vocab=64,
                                             seed=i) for i in range(steps)])
  # Compiled at XLA:CPU's backend level 1, not the suite's 0 (conftest.py):
  # a few seconds more to compile, and the 300 steps run 5x faster.
  losses = _train_scan(model, lambda m, t: models.lm_loss(m(t), t), tokens,
                       3e-3, {"xla_backend_optimization_level": 1})
  return np.mean(losses[-10:]), model


@pytest.mark.slow
def test_rowwise_fp8_gpt_final_loss_within_2_percent_of_bf16():
  # bf16 model vs the same model with rowwise FP8 on every Linear layer but
  # the first and last (6 of its 8), same data and steps: from ln 64 = 4.2
  # bf16 ends near 0.07, rowwise within 2 % of it (-0.6 % measured; 3.4 %
  # after 150 or 200 steps, so the 300 steps stay). The default rules'
  # current scaling on this GPT ("float8", same sizes, data and optimizer)
  # is notebooks/04_fp8's check: within 5 % of bf16 after 250 steps.
  example = (jax.ShapeDtypeStruct((16, 32), jnp.int32),)
  loss_bf16, _ = _train_gpt(lambda m: m)
  assert loss_bf16 < 0.1 * np.log(64), loss_bf16  # it learned the task
  loss_row, model = _train_gpt(
      lambda m: jmp_amp.flax.set_policies(
          m, {"*": flax_fp8.FP8Policy(ROWWISE)}, example_args=example))
  assert len(flax_fp8.histories(model)) == 6
  assert abs(loss_row - loss_bf16) <= 0.02 * loss_bf16, (loss_bf16, loss_row)


@pytest.mark.slow
def test_rowwise_fp8_trains_like_bf16():
  # The rowwise recipe against bfloat16 compute on the same data and steps:
  # digits within 1 point (the small GPT's final loss: the test above).
  bf16 = lambda m: jmp_amp.flax.set_policies(
      m, jmp_amp.flax.mixed_rules("bfloat16"))
  acc_bf16, _ = _train_digits(bf16)
  acc_row, model = _train_digits(
      lambda m: jmp_amp.flax.set_policies(m, flax_fp8.FP8Policy(
          ROWWISE, keep_first_last=False)))
  assert len(flax_fp8.histories(model)) == 3
  assert acc_bf16 > 0.95, acc_bf16
  assert abs(acc_row - acc_bf16) <= 0.01, (acc_bf16, acc_row)


def test_make_train_step_updates_fp8_histories_under_loss_scaling():
  import jmp_amp.flax  # pylint: disable=g-import-not-at-top
  model = jmp_amp.flax.set_policies(
      models.MLP(8, 2, num_layers=3, width=16, rngs=nnx.Rngs(0)),
      flax_fp8.FP8Policy(fp8.FP8Recipe(scaling="delayed", history_len=4),
                         keep_first_last=False))
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.1), jmp_amp.DynamicLossScale(2.0**15)), wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(
      lambda m, b: models.mse_loss(m(b[0]), b[1]))
  x = jnp.full((4, 8), 3.0)
  kernel_before = np.asarray(model.layers[0].kernel[...])
  metrics = step(model, opt, (x, jnp.zeros((4, 2))))
  hist = flax_fp8.histories(model)["layers/0"]
  assert bool(metrics["grads_finite"])
  # The first layer's input amax is |x| = 3 (newest first); the output
  # gradient's amax is recorded too (scaled by the loss scale, > 0).
  assert float(hist.lhs[0]) == 3.0 and float(hist.lhs[1]) == 0.0
  assert float(hist.grad[0]) > 0.0
  # The histories are not handed to the optimizer: params still train.
  assert not np.array_equal(kernel_before, np.asarray(model.layers[0].kernel[...]))


def _jit_options_of_steps(model_rules, autocast=None, plain=True,
                          **step_kwargs):
  """The compiler_options each jax.jit of make_train_step's step got when
  it ran, compiling for CUDA: one MLP without (unless not `plain`) and one
  with `model_rules`, trained by one step function."""
  from unittest import mock  # pylint: disable=g-import-not-at-top

  import jmp_amp.flax  # pylint: disable=g-import-not-at-top
  batch = (jnp.ones((4, 8)), jnp.zeros((4, 2)))
  options = []
  # Compiled for CUDA as far as the options go (XLA:CPU ignores them).
  with mock.patch.object(fp8_compile, "_platform", return_value="cuda"):
    step = jmp_amp.flax.make_train_step(
        lambda m, b: models.mse_loss(m(b[0]), b[1]), autocast=autocast,
        **step_kwargs)
    with mock.patch.object(jax, "jit", wraps=jax.jit) as spy:
      for rules in (None, model_rules) if plain else (model_rules,):
        model = models.MLP(8, 2, num_layers=3, width=16, rngs=nnx.Rngs(0))
        if rules is not None:
          jmp_amp.flax.set_policies(model, rules)
        opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
            optax.sgd(0.1), jmp_amp.NoOpLossScale()), wrt=nnx.Param)
        calls = spy.call_count
        assert np.isfinite(float(step(model, opt, batch)["loss"]))
        options.append([c.kwargs["compiler_options"]
                        for c in spy.call_args_list[calls:]
                        if "compiler_options" in c.kwargs])
  return options


@pytest.mark.slow
def test_make_train_step_compiles_fp8_gemms_with_triton_gemms_off():
  # On a real H200 XLA's autotuner spent 50-120 s timing Triton kernels for
  # FP8 GEMMs and then chose cuBLAS for all of them; FP8 steps skip that.
  off = {"xla_gpu_enable_triton_gemm": False}
  assert jmp_amp.fp8.compiler_options(platform="cuda") == off
  for platform in ("cpu", "tpu", "rocm"):
    assert jmp_amp.fp8.compiler_options(platform=platform) == {}
  # A step without FP8 GEMMs runs the jitted step made with the user's
  # options; one with FP8 GEMMs gets another, with `off`.
  assert _jit_options_of_steps("float8") == [[], [off]]
  # The user's options are kept, and win where they say otherwise.
  mine = {"xla_backend_optimization_level": 1}
  assert _jit_options_of_steps("float8", compiler_options=mine) == [
      [], [{**off, **mine}]]
  tuned = {"xla_gpu_enable_triton_gemm": True}
  assert _jit_options_of_steps("float8", plain=False,
                               compiler_options=tuned) == [[tuned]]
  # Op-level FP8 autocast too, in every form: the traced program decides.
  assert _jit_options_of_steps(None, autocast="float8") == [[off], []]
  partial = functools.partial(jmp_amp.autocast, policy_or_dtype="float8")
  assert _jit_options_of_steps(None, autocast=partial) == [[off], []]
  assert _jit_options_of_steps(None, autocast="bfloat16") == [[], []]


@pytest.mark.parametrize("autocast,fp8_gemms", [
    ("float8", True),
    (functools.partial(jmp_amp.autocast, policy_or_dtype="float8"), True),
    ("mixed_bfloat16", False)], ids=["name", "partial", "bf16"])
def test_make_linen_train_step_reads_fp8_gemms_from_the_traced_step(
    autocast, fp8_gemms):
  from unittest import mock  # pylint: disable=g-import-not-at-top

  import jmp_amp.flax  # pylint: disable=g-import-not-at-top
  module = flax.linen.Dense(4)
  x, y = jnp.ones((8, 16)), jnp.zeros((8, 4))
  state = jmp_amp.flax.train.TrainState.create(
      apply_fn=module.apply, params=module.init(jax.random.key(0), x)[
          "params"],
      tx=jmp_amp.loss_scaling(optax.sgd(0.1), jmp_amp.NoOpLossScale()))
  loss_fn = lambda model, batch: jnp.mean(
      (model(batch[0]).astype(jnp.float32) - batch[1]) ** 2)
  with mock.patch.object(fp8_compile, "_platform", return_value="cuda"):
    step = jmp_amp.flax.make_linen_train_step(loss_fn, autocast=autocast)
    with mock.patch.object(jax, "jit", wraps=jax.jit) as spy:
      _, metrics = step(state, (x, y))
  assert np.isfinite(float(metrics["loss"]))
  options = [c.kwargs["compiler_options"] for c in spy.call_args_list
             if "compiler_options" in c.kwargs]
  assert options == ([{"xla_gpu_enable_triton_gemm": False}] if fp8_gemms
                     else [])


def test_compiler_options_reads_the_traced_program():
  x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
  plain = jax.jit(jnp.matmul).trace(x, w)
  in_fp8 = jax.jit(jax.grad(lambda x, w: jmp_amp.fp8.dot_general(
      x, w, MATMUL).astype(jnp.float32).sum())).trace(x, w)
  off = {"xla_gpu_enable_triton_gemm": False}
  assert jmp_amp.fp8.compiler_options(plain, platform="cuda") == {}
  assert jmp_amp.fp8.compiler_options(in_fp8, platform="cuda") == off
  assert jmp_amp.fp8.compiler_options(in_fp8.jaxpr, platform="cuda") == off
  assert jmp_amp.fp8.compiler_options(in_fp8, platform="cpu") == {}
  with pytest.raises(TypeError, match="traced program"):
    jmp_amp.fp8.compiler_options("float8", platform="cuda")


# --------------------------------------------------------------------------
# Op-level autocast to float8.


def _f8_origins_of_dots(closed) -> list[tuple[Any, Any]]:
  """(lhs, rhs) FP8 dtype of each matmul's operands.

  An FP8 operand gives its own dtype (the GEMMs of dot_general and einsum
  take FP8 tensors); otherwise the operand is followed back through
  dequantization (casts, scale multiplications, transposes, reshapes) to an
  FP8 array (convolutions), across nested jaxprs (jit, custom_vjp,
  checkpoint, scan); None where an operand does not come from FP8.
  """
  passthrough = {"mul", "convert_element_type", "transpose", "reshape",
                 "broadcast_in_dim", "squeeze", "copy", "neg", "rev"}
  dots = []

  def walk(jaxpr, in_origins):
    origin = dict(zip(jaxpr.invars, in_origins))
    def get(v):
      if hasattr(v, "val"):
        return None
      if v.aval.dtype in (E4M3, E5M2):
        return np.dtype(v.aval.dtype)
      return origin.get(v)
    for eqn in jaxpr.eqns:
      ins = [get(v) for v in eqn.invars]
      name = eqn.primitive.name
      sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr")
                  if k in eqn.params), None)
      if name in ("dot_general", "conv_general_dilated"):
        dots.append(tuple(ins))
        outs = [None]
      elif (name == "convert_element_type"
            and eqn.invars[0].aval.dtype in (E4M3, E5M2)):
        outs = [np.dtype(eqn.invars[0].aval.dtype)]
      elif name in passthrough:
        outs = [next((o for o in ins if o is not None), None)]
      elif sub is not None:
        inner = getattr(sub, "jaxpr", sub)
        outs = walk(inner, ins[len(ins) - len(inner.invars):])
      else:
        outs = [None] * len(eqn.outvars)
      origin.update(zip(eqn.outvars, outs))
    return [get(v) for v in jaxpr.outvars]

  walk(closed.jaxpr, [None] * len(closed.jaxpr.invars))
  return dots


def _f8_signatures(fn, *args) -> collections.Counter:
  def name(o):
    return "-" if o is None else {np.dtype(E4M3): "e4m3",
                                  np.dtype(E5M2): "e5m2"}[o]
  return collections.Counter(
      f"{name(a)} x {name(b)}"
      for a, b in _f8_origins_of_dots(jax.make_jaxpr(fn)(*args)))


def _mlp_params(seed=0, sizes=(16, 32, 32, 10)):
  rng = np.random.default_rng(seed)
  return [dict(w=jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a),
                             jnp.float32),
               b=jnp.asarray(rng.standard_normal(b) * 0.1, jnp.float32))
          for a, b in zip(sizes[:-1], sizes[1:])]


def _mlp_loss(params, x, labels):
  h = x
  for layer in params[:-1]:
    h = jax.nn.gelu(h @ layer["w"] + layer["b"])
  logits = h @ params[-1]["w"] + params[-1]["b"]
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                       labels[:, None], axis=1))


def _classification_batch(n=64, seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((n, 16)), jnp.float32),
          jnp.asarray(rng.integers(0, 10, n), jnp.int32))


@pytest.mark.slow
def test_autocast_float8_loss_and_grads_close_to_float32():
  # FP8 E4M3 rounds each operand to 3 mantissa bits (relative error up to
  # 2**-4 = 6 %, about 2 % RMS), E5M2 each output gradient to 2 bits (up to
  # 12 %, 4 % RMS), and a gradient passes through up to three such
  # roundings. Measured on this MLP: loss 0.02 % off, gradients 3-13 % off
  # (relative L2), cosine >= 0.992; bfloat16 autocast: 0.3-0.9 %. Bounds:
  # loss 2 %, gradients 20 % of each tensor's norm and cosine > 0.98.
  params, (x, labels) = _mlp_params(), _classification_batch()
  # Jitted (one compile each, not one per op run eagerly).
  loss32, grads32 = jax.jit(jax.value_and_grad(_mlp_loss))(params, x, labels)
  f8 = jax.jit(jax.value_and_grad(jmp_amp.autocast(_mlp_loss, "float8")))
  loss8, grads8 = f8(params, x, labels)
  assert loss8.dtype == jnp.float32
  np.testing.assert_allclose(loss8, loss32, rtol=0.02)
  for g32, g8 in zip(jax.tree_util.tree_leaves(grads32),
                     jax.tree_util.tree_leaves(grads8)):
    assert g8.dtype == jnp.float32
    g32, g8 = np.asarray(g32).ravel(), np.asarray(g8).ravel()
    err = np.linalg.norm(g8 - g32) / np.linalg.norm(g32)
    cos = g8 @ g32 / (np.linalg.norm(g8) * np.linalg.norm(g32))
    assert err < 0.2 and cos > 0.98, (err, cos)
  # Not a no-op: float8 differs from float32 and from bfloat16 autocast.
  loss16 = jax.jit(jmp_amp.autocast(_mlp_loss, "p=f32,c=bf16,o=f32"))(
      params, x, labels)
  assert float(loss8) != float(loss32) and float(loss8) != float(loss16)


def test_autocast_float8_matmuls_are_fp8_forward_and_backward():
  params, (x, labels) = _mlp_params(), _classification_batch()
  f8_grad = jax.jit(jax.grad(jmp_amp.autocast(_mlp_loss, "float8")))
  sigs = _f8_signatures(f8_grad, params, x, labels)
  # Three matmuls: each forward on two E4M3 operands; backward, three input
  # gradients (the E5M2 output gradient first) and three weight gradients
  # (the E4M3 input first, so the gradient comes out in the kernel's
  # layout). The first layer's input gradient is unused: XLA removes it,
  # see tests/test_fp8_shared_inputs.py.
  assert sigs == {"e4m3 x e4m3": 3, "e5m2 x e4m3": 3, "e4m3 x e5m2": 3}, sigs
  # The half path, for contrast, has no FP8 anywhere.
  bf16_grad = jax.grad(jmp_amp.autocast(_mlp_loss, "p=f32,c=bf16,o=f32"))
  assert _f8_signatures(bf16_grad, params, x, labels) == {"- x -": 8}
  # Softmax and the loss's reductions stay float32; matmul results bf16.
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(_mlp_loss, "float8"))(
      params, x, labels)
  out_dtypes = {e.primitive.name: e.outvars[0].aval.dtype
                for e in jaxpr.jaxpr.eqns}
  assert out_dtypes["exp"] == jnp.float32, out_dtypes
  assert out_dtypes["reduce_max"] == jnp.float32
  # Each FP8 matmul is one jitted call (traced once per signature) of one
  # custom-VJP call (its GEMMs inside), returning bf16.
  def custom_vjps(eqn):
    inner = eqn.params.get("jaxpr")
    return [e for e in (inner.eqns if inner is not None else ())
            if e.primitive.name.startswith("custom_vjp")]
  matmuls = [e.outvars[0].aval.dtype for e in jaxpr.jaxpr.eqns
             if len(custom_vjps(e)) == 1]
  assert matmuls == [jnp.bfloat16] * 3, out_dtypes


@pytest.mark.slow
def test_autocast_float8_under_remat_scan_and_conv():
  w = jnp.asarray(np.random.default_rng(0).standard_normal((3, 8, 8)) / 3,
                  jnp.float32)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8)),
                  jnp.float32)

  def loss(w, x, remat):
    def body(h, wi):
      layer = lambda h, wi: jnp.tanh(h @ wi)
      return (jax.checkpoint(layer) if remat else layer)(h, wi), None
    h, _ = jax.lax.scan(body, x, w)
    return jnp.sum(h ** 2)

  grads = {r: jax.jit(jax.grad(jmp_amp.autocast(
      functools.partial(loss, remat=r), "fp8")))(w, x) for r in (False, True)}
  # Recomputing the forward pass recomputes the same FP8 rounding.
  np.testing.assert_array_equal(grads[False], grads[True])
  ref = jax.jit(jax.grad(functools.partial(loss, remat=False)))(w, x)
  assert np.linalg.norm(grads[True] - ref) / np.linalg.norm(ref) < 0.1
  # The scan body's matmul, its remat recomputation and both backward
  # matmuls run on FP8-rounded operands.
  sigs = _f8_signatures(jax.grad(jmp_amp.autocast(
      functools.partial(loss, remat=True), "float8")), w, x)
  assert set(sigs) == {"e4m3 x e4m3", "e5m2 x e4m3", "e4m3 x e5m2"}, sigs

  # Convolutions (XLA:GPU fuses the forward one into an FP8 cuDNN conv).
  img = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 8, 8)),
                    jnp.float32)
  k = jnp.asarray(np.random.default_rng(3).standard_normal((4, 3, 3, 3)) / 5,
                  jnp.float32)
  conv = lambda k, img: jnp.sum(jax.nn.relu(jax.lax.conv_general_dilated(
      img, k, (1, 1), "SAME")) ** 2)
  sigs = _f8_signatures(jax.grad(jmp_amp.autocast(conv, "float8")), k, img)
  assert sigs == {"e4m3 x e4m3": 1, "e4m3 x e5m2": 1}, sigs  # fwd, dkernel
  g8 = jax.jit(jax.grad(jmp_amp.autocast(conv, "float8")))(k, img)
  g32 = jax.jit(jax.grad(conv))(k, img)
  assert np.linalg.norm(g8 - g32) / np.linalg.norm(g32) < 0.1


def test_autocast_float8_names_and_errors():
  fn = lambda w, x: x @ w
  w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
  for name in ("float8", "FP8", " f8 ", jmp_amp.fp8.FP8Recipe()):
    assert jmp_amp.autocast(fn, name)(w, x).dtype == jnp.float32
  with pytest.raises(ValueError, match=r"Unknown dtype 'float9'.*autocast "
                     r"also accepts 'float8'"):
    jmp_amp.autocast(fn, "float9")
  with pytest.raises(ValueError, match="autocast runs FP8 matmuls with "
                     "current or rowwise scaling.*scaling='delayed'"):
    jmp_amp.autocast(fn, jmp_amp.fp8.FP8Recipe(scaling="delayed",
                                               history_len=4))
  with pytest.raises(TypeError, match="'float8' or an FP8Recipe, got "):
    jmp_amp.autocast(fn, jnp.float8_e4m3fn)
  # A matmul already written in bfloat16 runs as written (as in the bf16
  # modes); integer matmuls run as traced.
  half = lambda w, x: x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)
  assert _f8_signatures(jmp_amp.autocast(half, "float8"), w, x) == {
      "- x -": 1}
  ints = lambda a, b: a @ b
  out = jmp_amp.autocast(ints, "float8")(jnp.ones((2, 2), jnp.int32),
                                         jnp.ones((2, 2), jnp.int32))
  assert out.dtype == jnp.int32 and out.tolist() == [[2, 2], [2, 2]]
