"""FP8 matmuls' exact numerics: result dtypes, float16, tiny scales, einsum
broadcasting (issue 52)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_amp
from jmp_amp._src import fp8

MATMUL = (((1,), (0,)), ((), ()))
E4M3 = jnp.float8_e4m3fn
RECIPES = [jmp_amp.fp8.FP8Recipe(),
           jmp_amp.fp8.FP8Recipe(scaling="rowwise")]


def _operands(seed=0, shape=((16, 32), (32, 8))):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in shape)


def _rounded(x):
  """`x` rounded through E4M3 with its whole-tensor scale, in float64."""
  s = fp8.compute_scale(fp8.amax(x), E4M3)
  q = np.asarray(fp8.quantize(x, E4M3, s), np.float64)
  return q * np.float64(s)


def test_float32_result_is_accumulated_and_scaled_in_float32():
  x, w = _operands()
  y = jmp_amp.fp8.dot_general(x, w, MATMUL,
                              preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  want = _rounded(x) @ _rounded(w)
  # Rounded once from float32 accumulation: float32's precision, not
  # bfloat16's (2**-8), against the exact product of the FP8 values.
  np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5,
                             atol=1e-5)
  as_bf16 = np.asarray(y.astype(jnp.bfloat16).astype(jnp.float32))
  assert not np.array_equal(as_bf16, np.asarray(y))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.scaling)
def test_float32_result_of_einsum_and_rowwise_is_not_bf16(recipe):
  x, w = _operands(1)
  y = jmp_amp.fp8.einsum("ab,bc->ac", x, w, recipe=recipe,
                         preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  as_bf16 = np.asarray(y.astype(jnp.bfloat16).astype(jnp.float32))
  assert not np.array_equal(as_bf16, np.asarray(y))


@pytest.mark.parametrize("scaling", ["current", "delayed", "rowwise"])
def test_float16_compute_dtype_does_not_overflow(scaling):
  recipe = jmp_amp.fp8.FP8Recipe(scaling=scaling, compute_dtype=jnp.float16)
  state = jmp_amp.fp8.FP8State(*(jnp.zeros(1) for _ in range(3)))
  y = jmp_amp.fp8.dot_general(jnp.ones((4, 8)), jnp.ones((8, 3)), MATMUL,
                              recipe=recipe, state=state)
  assert y.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(y), np.full((4, 3), 8.0))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.scaling)
def test_float16_operands_have_finite_gradients_close_to_float32(recipe):
  x, w = _operands(2)

  def grads(dtype):
    loss = lambda a, b: jnp.sum(jmp_amp.fp8.dot_general(
        a, b, MATMUL, recipe=recipe).astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1))(x.astype(dtype), w.astype(dtype))

  half, full = grads(jnp.float16), grads(jnp.float32)
  for h, f in zip(half, full):
    assert h.dtype == jnp.float16
    assert np.all(np.isfinite(np.asarray(h)))
    rel = np.linalg.norm(np.asarray(h, np.float32) - f) / np.linalg.norm(f)
    assert rel < 2e-2, rel


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.scaling)
def test_tiny_amax_gives_a_finite_scale_and_result(recipe):
  # 1e-36 / 448 is subnormal in float32, which XLA:CPU flushes to zero.
  assert float(fp8.compute_scale(jnp.float32(1e-36), E4M3)) >= (
      np.finfo(np.float32).tiny)
  x, w = jnp.full((2, 4), 1e-36), jnp.ones((4, 3))
  y = jmp_amp.fp8.dot_general(x, w, MATMUL, recipe=recipe,
                              preferred_element_type=jnp.float32)
  # Few bits are left so close to the range's end: within E4M3's spacing.
  np.testing.assert_allclose(np.asarray(y), np.full((2, 3), 4e-36),
                             rtol=2**-3)
  dx = jax.grad(lambda a: jnp.sum(jmp_amp.fp8.dot_general(
      a, w, MATMUL, recipe=recipe, preferred_element_type=jnp.float32)
      * 1e-35))(jnp.ones((2, 4)))
  np.testing.assert_allclose(np.asarray(dx), np.full((2, 4), 3e-35),
                             rtol=2**-2)


def test_einsum_broadcasts_batch_dimensions_like_jnp_einsum():
  rng = np.random.default_rng(3)
  for spec, a, b in [("...ij,...jk->...ik", (2, 1, 4, 5), (3, 5, 6)),
                     ("...ij,...jk->...ik", (4, 5), (3, 5, 6)),
                     ("bij,bjk->bik", (1, 4, 5), (3, 5, 6)),
                     ("ij,jk->ik", (4, 1), (5, 6))]:
    x = jnp.asarray(rng.normal(size=a), jnp.float32)
    w = jnp.asarray(rng.normal(size=b), jnp.float32)
    want = jnp.einsum(spec, x, w)
    got = jmp_amp.fp8.einsum(spec, x, w, preferred_element_type=jnp.float32)
    assert got.shape == want.shape, spec
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 0.1, (spec, rel)


def test_einsum_refuses_sizes_that_do_not_broadcast():
  with pytest.raises(ValueError, match=r"index '\.\.\.' has size 2 in the "
                     "first operand and 3 in the second"):
    jmp_amp.fp8.einsum("...ij,...jk->...ik", jnp.ones((2, 4, 5)),
                       jnp.ones((3, 5, 6)))


def test_non_floating_preferred_element_type_is_refused():
  with pytest.raises(TypeError, match="preferred_element_type must be a "
                     "floating dtype"):
    jmp_amp.fp8.dot_general(jnp.ones((2, 3)), jnp.ones((3, 4)), MATMUL,
                            preferred_element_type=jnp.int32)
