"""Tests for jmp_amp.autocast: op-level torch.autocast semantics for JAX."""

import collections
import functools

import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tree_bytes_equal
import jmp_amp
from jmp_amp._src.autocast import casting

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
HALF = (BF16, F16)
MATMULS = ("dot_general", "conv_general_dilated")
FRAGILE = ("exp", "log", "log1p", "reduce_sum", "reduce_max", "rsqrt",
           "integer_pow", "erf")
MIXED_BF16 = "p=f32,c=bf16,o=f32"


# ---- Helpers. -------------------------------------------------------------


def _sub_jaxprs(params):
  for value in params.values():
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jax.extend.core.Jaxpr):
        yield v


def eqns(jaxpr):
  """Yields every equation of `jaxpr`, nested jaxprs included."""
  if isinstance(jaxpr, jax.extend.core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _sub_jaxprs(eqn.params):
      yield from eqns(sub)


def in_dtypes(eqn):
  return [np.dtype(v.aval.dtype) for v in eqn.invars
          if jnp.issubdtype(v.aval.dtype, jnp.floating)]


def dtypes_of(jaxpr, name):
  """The floating input dtypes of each `name` equation in `jaxpr`."""
  return [in_dtypes(e) for e in eqns(jaxpr) if e.primitive.name == name]


def assert_amp_jaxpr(jaxpr, half=BF16, fragile=FRAGILE):
  """Matmuls see `half` inputs, fragile ops float32 inputs."""
  matmuls = [in_dtypes(e) for e in eqns(jaxpr) if e.primitive.name in MATMULS]
  assert matmuls, "no matmul in the program"
  for dts in matmuls:
    assert set(dts) == {half}, (dts, jaxpr)
  for name in fragile:
    for dts in dtypes_of(jaxpr, name):
      assert set(dts) <= {F32}, (name, dts)


def mlp_loss(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


@pytest.fixture
def mlp():
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, 4)) * 0.3, "b2": jnp.zeros(4)}
  x = jax.random.normal(k3, (5, 8))
  y = jax.nn.one_hot(jnp.arange(5) % 4, 4)
  return params, x, y


# ---- Small hand-written functions. ----------------------------------------


def test_forward_dtypes(mlp):
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(mlp_loss, MIXED_BF16))(*mlp)
  assert_amp_jaxpr(jaxpr)
  # The float32 bias added to the half matmul stays half (torch's addmm), so
  # tanh runs in half.
  assert dtypes_of(jaxpr, "add")[0] == [BF16, BF16]
  assert dtypes_of(jaxpr, "tanh") == [[BF16]]
  assert jaxpr.out_avals[0].dtype == F32
  # Parameters enter as float32: the casts happen inside.
  assert all(a.dtype == F32 for a in jaxpr.in_avals)


@pytest.mark.parametrize("policy,out", [("mixed_bfloat16", BF16),
                                        ("p=f32,c=f16,o=f32", F32),
                                        (jnp.bfloat16, F32),
                                        (np.dtype("float16"), F32)])
def test_output_dtype(mlp, policy, out):
  loss = jmp_amp.autocast(mlp_loss, policy)(*mlp)
  assert loss.dtype == out


def test_gradient_dots_stay_half(mlp):
  grad_fn = jax.grad(jmp_amp.autocast(mlp_loss, MIXED_BF16))
  jaxpr = jax.make_jaxpr(grad_fn)(*mlp)
  assert_amp_jaxpr(jaxpr)
  # Forward 2 dots plus 3 backward dots (no dx for the first layer's input
  # is needed by grad w.r.t. params, but XLA gets it anyway before DCE).
  assert len([e for e in eqns(jaxpr) if e.primitive.name == "dot_general"]) >= 5
  grads = grad_fn(*mlp)
  chex.assert_trees_all_equal_dtypes(grads, mlp[0])


def test_lowered_matmuls_are_half(mlp):
  grad_fn = jax.grad(jmp_amp.autocast(mlp_loss, "p=f32,c=f16,o=f32"))
  report = jmp_amp.matmul_report(grad_fn, *mlp)
  assert len(report) >= 5
  assert report.all_inputs_in("f16"), report


def test_numerics_close_to_float32(mlp):
  loss32, grads32 = jax.value_and_grad(mlp_loss)(*mlp)
  for policy, tol in (("p=f32,c=bf16,o=f32", 3e-2), ("p=f32,c=f16,o=f32", 5e-3)):
    loss, grads = jax.jit(jax.value_and_grad(
        jmp_amp.autocast(mlp_loss, policy)))(*mlp)
    chex.assert_trees_all_close(loss, loss32, rtol=tol, atol=tol)
    chex.assert_trees_all_close(grads, grads32, rtol=tol * 5, atol=tol)


def test_softmax_of_large_logits_does_not_overflow():
  logits = jnp.array([[1e5, 0.9e5, -1e5], [3.0, 2.0, 1.0]], jnp.float32)
  plain = jax.nn.softmax(logits.astype(jnp.float16))
  assert not np.isfinite(np.asarray(plain, np.float32)).all()
  amp = jmp_amp.autocast(jax.nn.softmax, "p=f32,c=f16,o=f32")(logits)
  chex.assert_tree_all_finite(amp)
  chex.assert_trees_all_close(amp, jax.nn.softmax(logits), atol=1e-6)


def test_naive_logsumexp_sum_and_exp_run_in_float32():
  # exp(15) and a 1e5-element sum both overflow float16 (max 65504).
  x = jnp.full((2, 8), 15.0)
  naive = lambda x: jnp.log(jnp.sum(jnp.exp(x), axis=-1))
  assert not np.isfinite(np.asarray(naive(x.astype(jnp.float16)), np.float32)).all()
  out = jmp_amp.autocast(naive, "p=f32,c=f16,o=f32")(x)
  chex.assert_trees_all_close(out, naive(x), rtol=1e-6)
  total = jmp_amp.autocast(jnp.sum, "p=f32,c=f16,o=f32")(jnp.ones(100_000))
  assert total == 100_000


def test_layer_norm_statistics_in_float32():
  def layer_norm(x, w):
    h = x @ w  # half
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    return (h - mu) * lax.rsqrt(var + 1e-5)

  x, w = jnp.ones((2, 4)), jnp.eye(4) * 300.0
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(layer_norm, "p=f32,c=f16,o=f32"))(x, w)
  assert_amp_jaxpr(jaxpr, half=F16)


def test_promote_uses_widest_and_ignores_scalars():
  def f(x, w, b):
    h = x @ w          # half
    # scalar: half; half * half; f32 subtracted: f32; f32 + f32: f32.
    return h * 2.0, h * h, h - b, x + b

  x, w, b = jnp.ones((2, 3)), jnp.ones((3, 3)), jnp.ones(3)
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(f, "p=f32,c=bf16,o=bf16"))(x, w, b)
  assert dtypes_of(jaxpr, "mul") == [[BF16, BF16], [BF16, BF16]]
  assert dtypes_of(jaxpr, "sub") == [[F32, F32]]
  assert dtypes_of(jaxpr, "add") == [[F32, F32]]


def test_explicit_casts_are_honoured():
  def f(x, w):
    return (x @ w).astype(jnp.float32) * 3.0

  half = jnp.ones((2, 3), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(f, "p=f32,c=bf16,o=bf16"))(
      half, half.T)
  assert dtypes_of(jaxpr, "mul") == [[F32, F32]]


def test_static_arguments_and_kwargs():
  def f(x, *, scale, training):
    return x * scale if training else x

  g = jmp_amp.autocast(f, jnp.bfloat16)
  chex.assert_trees_all_close(g(jnp.ones(3), scale=2.0, training=True),
                              jnp.full(3, 2.0))
  assert g(jnp.ones(3), scale=2.0, training=False).dtype == F32


def test_half_scatter_add_lowers():
  # The scatter's scalar combiner is re-typed for the half operand.
  def f(x, w):
    h = x @ w
    return h.at[jnp.array([0, 1])].add(h[2:4])

  x, w = jnp.ones((4, 3)), jnp.ones((3, 3))
  g = jmp_amp.autocast(f, "mixed_float16")
  assert dtypes_of(jax.make_jaxpr(g)(x, w), "scatter-add") == [[F16, F16]]
  chex.assert_trees_all_close(jax.jit(g)(x, w), f(x, w))
  chex.assert_trees_all_close(jax.grad(lambda w: jax.jit(g)(x, w).sum())(w),
                              jax.grad(lambda w: f(x, w).sum())(w))


# ---- Higher-order primitives. ---------------------------------------------


def test_jit_inside_is_autocast():
  inner = jax.jit(lambda x, w: jnp.exp(x @ w))
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(inner, MIXED_BF16))(
      jnp.ones((2, 3)), jnp.ones((3, 3)))
  assert_amp_jaxpr(jaxpr, fragile=("exp",))


def test_checkpoint_is_kept():
  f = jax.checkpoint(lambda x, w: jnp.sum(jnp.tanh(x @ w)))
  g = jmp_amp.autocast(f, MIXED_BF16)
  x, w = jnp.ones((2, 3)), jnp.ones((3, 3)) * 0.1
  jaxpr = jax.make_jaxpr(jax.grad(g, argnums=1))(x, w)
  assert "remat2" in {e.primitive.name for e in eqns(jaxpr)}
  assert_amp_jaxpr(jaxpr, fragile=("reduce_sum",))
  chex.assert_trees_all_close(jax.grad(g, argnums=1)(x, w),
                              jax.grad(f, argnums=1)(x, w), rtol=2e-2)


def test_scan_carry_dtype_is_consistent():
  def rnn(h0, xs, w):
    def step(h, x):
      h = jnp.tanh(h @ w + x)   # half matmul plus float32 x: half (addmm)
      return h, jnp.exp(h)
    return lax.scan(step, h0, xs)

  h0, xs, w = jnp.ones(4), jnp.ones((5, 4)) * 0.1, jnp.eye(4) * 0.5
  g = jmp_amp.autocast(rnn, "p=f32,c=bf16,o=f32")
  jaxpr = jax.make_jaxpr(g)(h0, xs, w)
  assert_amp_jaxpr(jaxpr, fragile=("exp",))
  chex.assert_trees_all_close(g(h0, xs, w), rnn(h0, xs, w), rtol=3e-2)


def _scan_carry_dtypes(jaxpr):
  scan = [e for e in eqns(jaxpr) if e.primitive.name == "scan"][0]
  _, n_carry = casting.scan_counts(scan.params)
  return [v.aval.dtype for v in scan.outvars[:n_carry]]


def test_scan_carry_keeps_wider_initial_dtype():
  # The body returns a half carry (matmul then tanh) for a float32 carry: the
  # carry stays float32 and the body's output is cast back at the boundary.
  f = lambda c, xs, w: lax.scan(lambda c, x: (jnp.tanh(c @ w) * x, None), c, xs)[0]
  c, xs, w = jnp.ones(3), jnp.ones((2, 3), jnp.bfloat16), jnp.eye(3)
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(f, "p=f32,c=bf16,o=f32"))(c, xs, w)
  assert _scan_carry_dtypes(jaxpr) == [F32]
  assert dtypes_of(jaxpr, "tanh") == [[BF16]]


def test_scan_carry_widens_to_fixed_point():
  # In bfloat16 the carry stays bfloat16; under autocast exp runs in float32,
  # so the carry is widened to float32 for every iteration.
  f = lambda c, xs: lax.scan(lambda c, x: (jnp.exp(c) * x, None), c, xs)[0]
  c, xs = jnp.ones(3, jnp.bfloat16), jnp.full((2, 3), 0.5, jnp.bfloat16)
  g = jmp_amp.autocast(f, "p=f32,c=bf16,o=f32")
  jaxpr = jax.make_jaxpr(g)(c, xs)
  assert _scan_carry_dtypes(jaxpr) == [F32]
  chex.assert_trees_all_close(g(c, xs), f(c.astype(F32), xs.astype(F32)),
                              rtol=1e-6)


def test_while_and_cond():
  def f(x, w):
    def body(c):
      i, h = c
      return i + 1, h @ w
    _, h = lax.while_loop(lambda c: c[0] < 3, body, (0, x))
    return lax.cond(h.sum() > 0, lambda h: jnp.exp(h), lambda h: h * 2, h)

  x, w = jnp.ones((2, 3)), jnp.eye(3) * 0.5
  g = jmp_amp.autocast(f, MIXED_BF16)
  jaxpr = jax.make_jaxpr(g)(x, w)
  assert_amp_jaxpr(jaxpr, fragile=("exp",))
  chex.assert_trees_all_close(g(x, w), f(x, w), rtol=2e-2)


def test_custom_jvp_rule_is_kept():
  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  f.defjvp(lambda p, t: (f(p[0]), 42.0 * t[0]))
  g = jmp_amp.autocast(lambda x, w: jnp.sum(f(x @ w)), MIXED_BF16)
  x, w = jnp.ones((1, 2)), jnp.eye(2)
  chex.assert_trees_all_close(jax.grad(g, argnums=1)(x, w), jnp.full((2, 2), 42.0))
  # relu is a custom_jvp: gradient at exactly 0 is 0 (the rule), not 0.5.
  relu = jmp_amp.autocast(lambda x: jnp.sum(jax.nn.relu(x)), jnp.float16)
  assert jax.grad(relu)(jnp.zeros(3)).tolist() == [0.0, 0.0, 0.0]
  # Forward mode works through the custom JVP (no half matmul involved).
  h = jmp_amp.autocast(lambda x: jnp.sum(f(x)), jnp.float16)
  _, tangent = jax.jvp(h, (x,), (jnp.ones_like(x),))
  chex.assert_trees_all_close(tangent, 42.0 * 2)


def test_custom_vjp_rule_is_kept_and_autocast():
  @jax.custom_vjp
  def clip_grad(x):
    return x

  clip_grad.defvjp(lambda x: (x, None),
                   lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))
  f = lambda x, w: jnp.sum(clip_grad(x @ w) * 100.0)
  g = jmp_amp.autocast(f, MIXED_BF16)
  x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
  grads = jax.grad(g, argnums=1)(x, w)
  chex.assert_trees_all_close(grads, jnp.full((3, 3), 2e-3), rtol=1e-2)
  jaxpr = jax.make_jaxpr(jax.grad(g, argnums=1))(x, w)
  assert_amp_jaxpr(jaxpr, fragile=())


# ---- custom_vjp / custom_jvp functions that close over arrays (issue 12). --

_D = 8
# Closed over by the custom functions below: a constant, not an argument.
_R = jax.random.normal(jax.random.key(7), (_D, _D)) / _D ** 0.5


@jax.custom_vjp
def _mix(h):
  return h @ _R


# The straight-through rule of the issue: half the incoming cotangent.
_mix.defvjp(lambda h: (h @ _R, h), lambda h, g: (0.5 * g.astype(h.dtype),))


@jax.custom_vjp
def _half_grad_mix(h):
  return h @ _R


# Half the true gradient, so the rule's use is visible analytically.
_half_grad_mix.defvjp(lambda h: (h @ _R, None),
                      lambda _, g: (0.5 * (g @ _R.T),))


@jax.custom_jvp
def _half_tangent_mix(h):
  return h @ _R


_half_tangent_mix.defjvp(
    lambda p, t: (_half_tangent_mix(p[0]), 0.5 * (t[0] @ _R)))


@jax.custom_vjp
def _outer(h):
  """A custom_vjp whose fwd and bwd call the custom_vjp `_mix`."""
  return jnp.sin(_mix(h))


def _outer_fwd(h):
  return jnp.sin(_mix(h)), (h,)


def _outer_bwd(res, g):
  (h,) = res
  y, pullback = jax.vjp(_mix, h)
  return pullback(g * jnp.cos(y))


_outer.defvjp(_outer_fwd, _outer_bwd)

_CUSTOM_LAYERS = {
    "vjp": lambda w, h: jnp.tanh(_mix(h @ w)),
    "vjp_half_grad": lambda w, h: jnp.tanh(_half_grad_mix(h @ w)),
    "jvp_half_tangent": lambda w, h: jnp.tanh(_half_tangent_mix(h @ w)),
    "nested_vjp": lambda w, h: _outer(h @ w),
    # A custom_jvp (relu) and a custom_vjp inside a custom_jvp rule's function.
    "vjp_in_jvp": lambda w, h: jax.nn.relu(_mix(h @ w)) + jax.nn.softplus(h),
}


def _wrap(kind, layer):
  """A loss over two layers, the layer under jit, remat or scan."""
  if kind == "scan":
    def loss(ws, x):
      h, _ = lax.scan(lambda h, w: (layer(w, h), None), x, ws)
      return jnp.sum(h ** 2)
    return loss
  layer = {"plain": layer, "jit": jax.jit(layer),
           "remat": jax.checkpoint(layer)}[kind]
  return lambda ws, x: jnp.sum(layer(ws[1], layer(ws[0], x)) ** 2)


def _custom_args():
  ws = jax.random.normal(jax.random.key(1), (2, _D, _D)) / _D ** 0.5
  x = jax.random.normal(jax.random.key(2), (4, _D))
  return ws, x


@pytest.mark.slow
def test_custom_vjp_closing_over_array_grad_issue_example():
  ws, x = _custom_args()
  loss = lambda w, x: jnp.sum(_mix(x @ w))
  # The rule passes 0.5 * g straight through: d loss / d w = x^T @ 0.5.
  expected = 0.5 * x.T @ jnp.ones((4, _D))
  grads = _fast_jit(lambda *a: [jax.grad(f)(*a) for f in (
      loss, *(jmp_amp.autocast(loss, dtype) for dtype in HALF))])(ws[0], x)
  chex.assert_trees_all_close(grads[0], expected, rtol=1e-5)
  for grad in grads[1:]:
    assert grad.dtype == F32
    chex.assert_trees_all_close(grad, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["plain", "jit", "remat", "scan"])
@pytest.mark.parametrize("name", sorted(_CUSTOM_LAYERS))
def test_custom_rules_closing_over_arrays(kind, name):
  loss = _wrap(kind, _CUSTOM_LAYERS[name])
  ws, x = _custom_args()
  amps = [jmp_amp.autocast(loss, dtype) for dtype in HALF]
  for amp, dtype in zip(amps, HALF):
    jaxpr = jax.make_jaxpr(jax.grad(amp))(ws, x)
    assert_amp_jaxpr(jaxpr, half=dtype, fragile=("reduce_sum",))
  (loss32, grads32), *results = _fast_jit(lambda *a: [
      jax.value_and_grad(f)(*a) for f in (loss, *amps)])(ws, x)
  # float16 has 3 more mantissa bits than bfloat16.
  for (value, grads), tol in zip(results, (4e-2, 8e-3)):
    assert grads.dtype == F32
    chex.assert_trees_all_close(value, loss32, rtol=tol)
    _assert_rel_close(grads, grads32, 2 * tol)


@pytest.mark.parametrize("name", ["vjp_half_grad", "jvp_half_tangent"])
def test_custom_rule_closing_over_array_is_the_one_used(name):
  # With one layer, the rule's factor 0.5 halves the whole gradient.
  ws, x = _custom_args()
  layer = _CUSTOM_LAYERS[name]
  true_layer = lambda w, h: jnp.tanh(h @ w @ _R)
  loss = lambda w, x: jnp.sum(layer(w, x) ** 2)
  true_loss = lambda w, x: jnp.sum(true_layer(w, x) ** 2)
  amps = [jmp_amp.autocast(f, dtype) for f in (loss, jax.checkpoint(loss))
          for dtype in HALF]
  true_grad, *grads = _fast_jit(lambda *a: [
      jax.grad(f)(*a) for f in (true_loss, *amps)])(ws[0], x)
  for grad in grads:
    _assert_rel_close(grad, 0.5 * true_grad, 4e-2)


def test_custom_jvp_closing_over_array_forward_mode():
  ws, x = _custom_args()
  loss = lambda w, x: jnp.sum(_half_tangent_mix(x @ w))
  tangent = jnp.ones_like(ws[0])
  amp = jmp_amp.autocast(loss, jnp.bfloat16)
  expected, got = _fast_jit(lambda w: [
      jax.jvp(lambda w: f(w, x), (w,), (tangent,))[1] for f in (loss, amp)])(
          ws[0])
  chex.assert_trees_all_close(got, expected, rtol=3e-2)


# ---- Composition, idempotence, identity. ----------------------------------


@pytest.mark.slow
def test_jit_and_vmap(mlp):
  params, x, y = mlp
  g = jmp_amp.autocast(mlp_loss, MIXED_BF16)
  eager = g(params, x, y)
  chex.assert_trees_all_close(jax.jit(g)(params, x, y), eager, rtol=1e-2)
  per_example = jax.vmap(g, in_axes=(None, 0, 0))(params, x[:, None], y[:, None])
  assert per_example.shape == (5,) and per_example.dtype == F32
  chex.assert_trees_all_close(per_example.mean(), eager, rtol=2e-2)
  jaxpr = jax.make_jaxpr(jax.vmap(jax.grad(g), in_axes=(None, 0, 0)))(
      params, x[:, None], y[:, None])
  assert_amp_jaxpr(jaxpr)


def test_idempotent(mlp):
  once = jmp_amp.autocast(mlp_loss, MIXED_BF16)
  twice = jmp_amp.autocast(once, MIXED_BF16)
  assert tree_bytes_equal(jax.jit(twice)(*mlp), jax.jit(once)(*mlp))
  assert tree_bytes_equal(jax.jit(jax.grad(twice))(*mlp),
                          jax.jit(jax.grad(once))(*mlp))


def test_float32_policy_is_identity(mlp):
  f = jax.jit(lambda p, x, y: (mlp_loss(p, x, y), jnp.exp(x @ p["w1"])))
  for policy in ("float32", jnp.float32, jmp_amp.get_policy("p=f32,c=f32")):
    g = jmp_amp.autocast(f, policy)
    assert tree_bytes_equal(g(*mlp), f(*mlp))
    assert tree_bytes_equal(jax.grad(lambda *a: g(*a)[0])(*mlp),
                            jax.grad(lambda *a: f(*a)[0])(*mlp))


@pytest.mark.parametrize("policy", [MIXED_BF16, "float8", "float32"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_fn_is_traced_once_per_call(policy, grad):
  traces = collections.Counter()

  def fn(w, x):
    traces["fn"] += 1

    def body(h, _):
      traces["scan body"] += 1
      return jnp.tanh(h @ w), None

    def double(h):
      traces["checkpointed"] += 1
      return h * 2.0

    h, _ = jax.lax.scan(body, x, None, length=3)
    h = jax.checkpoint(double)(h)
    return jax.lax.cond(h.sum() > 0, jnp.sum, jnp.max, h)

  w, x = jnp.full((4, 4), 0.1), jnp.ones((2, 4))
  amp_fn = jmp_amp.autocast(fn, policy)
  jax.make_jaxpr(jax.grad(amp_fn) if grad else amp_fn)(w, x)
  assert traces == {"fn": 1, "scan body": 1, "checkpointed": 1}


# ---- Rules. ----------------------------------------------------------------


def test_default_rules():
  rules = jmp_amp.AutocastRules()
  # dot_product_attention: a jitted jax.nn.dot_product_attention call
  # (tests/test_attention.py).
  assert rules.half == {"dot_general", "conv_general_dilated",
                        "dot_product_attention"}
  for name in ("exp", "log", "reduce_sum", "reduce_max", "rsqrt", "cumsum",
               "erf_inv", "pow", "integer_pow"):
    assert rules.rule_for(name) == "float32", name
  for name in ("sub", "mul", "div", "tanh", "logistic", "sqrt", "reshape"):
    assert rules.rule_for(name) == "promote", name
  assert rules.keep_half == {"add"}
  assert rules.rule_for(lax.exp_p) == "float32"
  lists = (rules.half, rules.float32, rules.keep_half, rules.promote)
  assert sum(map(len, lists)) == len(frozenset().union(*lists))


def test_editing_rules_changes_behaviour():
  f = lambda x, w: jnp.tanh(jnp.exp(x @ w))
  x, w = jnp.ones((2, 3)), jnp.ones((3, 3)) * 0.1
  rules = jmp_amp.AutocastRules().with_half("exp").with_float32(lax.tanh_p)
  assert rules.rule_for("exp") == "half" and rules.rule_for("tanh") == "float32"
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(f, MIXED_BF16, rules=rules))(x, w)
  assert dtypes_of(jaxpr, "exp") == [[BF16]]
  assert dtypes_of(jaxpr, "tanh") == [[F32]]
  # Off every list, a primitive runs as traced (here: float32).
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(
      f, MIXED_BF16, rules=rules.without("exp")))(x, w)
  assert dtypes_of(jaxpr, "exp") == [[F32]]
  # dot_general moved to float32: no half matmul left.
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(
      f, MIXED_BF16, rules=rules.with_float32("dot_general")))(x, w)
  assert dtypes_of(jaxpr, "dot_general") == [[F32, F32]]
  # The default rules are untouched.
  assert jmp_amp.AutocastRules().rule_for("exp") == "float32"


def test_rules_are_hashable_data():
  rules = jmp_amp.AutocastRules(half={"dot_general"}, float32=["exp"],
                                keep_half=(), promote=())
  assert rules == jmp_amp.AutocastRules(half=("dot_general",), float32={"exp"},
                                        keep_half=[], promote=set())
  assert hash(rules) == hash(rules.with_half("dot_general"))
  assert rules.promote == frozenset()
  # A list not given keeps its default.
  only = jmp_amp.AutocastRules(float32=["exp"])
  assert only.float32 == {"exp"} and only.half == jmp_amp.AutocastRules().half


@pytest.mark.parametrize("edit,match", [
    (lambda r: r.with_float32("expp"), "Unknown primitive name 'expp'.*'exp'"),
    (lambda r: r.with_half("scan"), "'scan' cannot be put on an autocast list"),
    (lambda r: r.with_promote("convert_element_type"), "cannot be put"),
    (lambda r: jmp_amp.AutocastRules(half={"exp"}, float32={"exp"}),
     "'exp' is on both"),
    (lambda r: jmp_amp.AutocastRules(float32={"dot_general"}),
     r"'dot_general' is on both the 'half' and the 'float32' autocast lists "
     r"\(a list not given keeps its default; AutocastRules\(\).with_<list>"),
])
def test_rule_errors(edit, match):
  with pytest.raises(ValueError, match=match):
    edit(jmp_amp.AutocastRules())


# ---- Errors. ---------------------------------------------------------------


def test_errors():
  with pytest.raises(TypeError, match="callable"):
    jmp_amp.autocast(3, "mixed_bfloat16")
  with pytest.raises(ValueError, match="Unknown dtype 'bfloat17'"):
    jmp_amp.autocast(jnp.sin, "p=f32,c=bfloat17")
  with pytest.raises(TypeError, match="floating dtype.*int32"):
    jmp_amp.autocast(jnp.sin, jnp.int32)
  with pytest.raises(TypeError, match="AutocastRules"):
    jmp_amp.autocast(jnp.sin, jnp.bfloat16, rules={"half": {"exp"}})


# ---- Reference models (models/, used unmodified). ---------------------------


def _models():
  import os
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if root not in sys.path:
    sys.path.insert(0, root)
  import models  # pylint: disable=g-import-not-at-top
  return models


def _build(make_model):
  """The model `make_model()` builds, with numpy-initialised weights.

  Running the Flax initialisers compiles one XLA program per parameter shape
  (tens of seconds on a loaded CPU); the abstract model plus numpy weights
  (normal / sqrt(fan_in); norm scales and variances one; biases and means
  zero) is instant and just as good for dtype and gradient checks.
  """
  from flax import nnx
  graphdef, state = nnx.split(nnx.eval_shape(make_model))
  rng = np.random.default_rng(0)

  def init(path, leaf):
    # State paths end in the Variable's `.value`; the name is the last dict key.
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    if name in ("scale", "var"):
      return np.ones(leaf.shape, leaf.dtype)
    if name in ("bias", "mean") or leaf.ndim < 2:
      return np.zeros(leaf.shape, leaf.dtype)
    fan_in = int(np.prod(leaf.shape[:-1]))
    return (rng.standard_normal(leaf.shape) / np.sqrt(fan_in)).astype(leaf.dtype)

  state = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.asarray(init(path, x)), state)
  return nnx.merge(graphdef, state)


def _rel_err(a, b):
  """Per-leaf relative L2 error of `a` against the reference `b`."""
  return jax.tree.map(
      lambda x, y: float(jnp.linalg.norm((x - y).ravel().astype(F32))
                         / (jnp.linalg.norm(y.ravel().astype(F32)) + 1e-12)),
      a, b)


def _assert_rel_close(a, b, tol):
  errs = jax.tree.leaves(_rel_err(a, b))
  assert max(errs) < tol, _rel_err(a, b)


FRAGILE_MODEL = ("exp", "log", "reduce_sum", "reduce_max", "rsqrt")

# The model tests compare whole programs, not codegen: compile them quickly.
_fast_jit = functools.partial(jax.jit, compiler_options={
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True})


@pytest.mark.slow
def test_gpt():
  from flax import nnx
  models = _models()
  # The written-out attention: its contractions are the ops autocast casts
  # (XLA's fused attention on a CPU contracts float32 score gradients).
  model = _build(lambda: models.GPT(vocab_size=32, d_model=16, num_heads=2,
                                    num_layers=1, max_len=8,
                                    attention="einsum", rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)

  def loss_fn(params, tokens):
    return models.lm_loss(nnx.merge(graphdef, params)(tokens), tokens)

  amp_loss = jmp_amp.autocast(loss_fn, MIXED_BF16)
  grad_fn = jax.value_and_grad(amp_loss)
  for jaxpr in (jax.make_jaxpr(amp_loss)(params, tokens),
                jax.make_jaxpr(grad_fn)(params, tokens)):
    assert_amp_jaxpr(jaxpr, fragile=FRAGILE_MODEL)
  report = jmp_amp.matmul_report(grad_fn, params, tokens)
  # qkv, q.k, w.v, out, fc, proj and the tied head, forward and both
  # gradients (no gradient for the tokens' one-hot-free embedding lookup).
  assert len(report) >= 3 * 7 - 1, report
  assert report.all_inputs_in("bf16"), report

  run_both = _fast_jit(lambda *a: (grad_fn(*a), jax.value_and_grad(loss_fn)(*a)))
  (loss, grads), (loss32, grads32) = run_both(params, tokens)
  assert loss.dtype == F32
  chex.assert_trees_all_equal_dtypes(grads, params)
  chex.assert_trees_all_close(loss, loss32, rtol=1e-2)
  _assert_rel_close(grads, grads32, 5e-2)


@pytest.mark.slow
def test_resnet_train_step_with_batch_norm():
  from flax import nnx
  models = _models()
  kw = dict(stage_sizes=(1,), base_width=8, num_classes=4)
  model = _build(lambda: models.ResNet(**kw, rngs=nnx.Rngs(0)))
  graphdef, params, stats = nnx.split(model, nnx.Param, ...)
  # Flax's own half-precision mode (dtype=float16, float32 params) on the
  # same weights: the accuracy autocast should match.
  graphdef16 = nnx.graphdef(nnx.eval_shape(
      lambda: models.ResNet(**kw, dtype=jnp.float16, rngs=nnx.Rngs(0))))
  images = jax.random.normal(jax.random.key(1), (8, 8, 8, 3))
  labels = jnp.arange(8) % 4

  def make_loss(graphdef):
    def loss_fn(params, stats, images, labels):
      m = nnx.merge(graphdef, params, stats, copy=True)
      loss = models.cross_entropy_loss(m(images, train=True), labels)
      return loss, nnx.state(m, nnx.BatchStat)
    return loss_fn

  loss_fn = make_loss(graphdef)
  amp_loss = jmp_amp.autocast(loss_fn, "p=f32,c=f16,o=f32")
  grad = lambda f: jax.value_and_grad(f, has_aux=True)
  jaxpr = jax.make_jaxpr(grad(amp_loss))(params, stats, images, labels)
  assert_amp_jaxpr(jaxpr, half=F16, fragile=FRAGILE_MODEL)
  # stem + 2 block convs, forward and two gradients each, less the gradient
  # for the images.
  assert len(dtypes_of(jaxpr, "conv_general_dilated")) >= 3 * 3 - 1

  run_all = _fast_jit(lambda *a: [grad(f)(*a) for f in (
      amp_loss, loss_fn, make_loss(graphdef16))])
  ((loss, new_stats), grads), ((loss32, stats32), grads32), (_, grads16) = (
      run_all(params, stats, images, labels))
  # Running statistics stay float32 (the policy's output dtype) and match.
  chex.assert_trees_all_equal_dtypes(new_stats, stats32)
  chex.assert_trees_all_close(new_stats, stats32, rtol=1e-2, atol=1e-3)
  chex.assert_trees_all_close(loss, loss32, rtol=1e-3)
  chex.assert_trees_all_equal_dtypes(grads, params)
  # Small-batch BatchNorm gradients amplify float16 rounding (up to ~9%
  # relative error at the stem here), for Flax's float16 mode just the same.
  for err, ref in zip(jax.tree.leaves(_rel_err(grads, grads32)),
                      jax.tree.leaves(_rel_err(grads16, grads32))):
    assert err <= 1.25 * ref + 2e-3, (err, ref)


def test_mlp_nnx_and_linen():
  from flax import nnx
  models = _models()
  model = _build(lambda: models.MLP(16, 8, num_layers=3, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  x = jax.random.normal(jax.random.key(1), (4, 16))
  y = jax.random.normal(jax.random.key(2), (4, 8))

  def loss_fn(params, x, y):
    return models.mse_loss(nnx.merge(graphdef, params)(x), y)

  grad_fn = jax.grad(jmp_amp.autocast(loss_fn, MIXED_BF16))
  assert_amp_jaxpr(jax.make_jaxpr(grad_fn)(params, x, y), fragile=())
  linen = models.LinenMLP(16, 8, num_layers=3)
  variables = models.linen_params_from_nnx(model)
  apply = jmp_amp.autocast(linen.apply, "mixed_bfloat16")
  assert_amp_jaxpr(jax.make_jaxpr(apply)(variables, x), fragile=())

  grads, grads32, out, out32 = _fast_jit(lambda: (
      grad_fn(params, x, y), jax.grad(loss_fn)(params, x, y),
      apply(variables, x), linen.apply(variables, x)))()
  _assert_rel_close(grads, grads32, 3e-2)
  assert out.dtype == BF16
  chex.assert_trees_all_close(out.astype(F32), out32, rtol=5e-2, atol=5e-2)


def _raw_out_dtypes(jaxpr):
  """Output dtypes before autocast's final cast to the policy's output dtype."""
  producers = {v: e for e in jaxpr.jaxpr.eqns for v in e.outvars}
  dts = []
  for v in jaxpr.jaxpr.outvars:
    eqn = producers.get(v)
    if eqn is not None and eqn.primitive.name == "convert_element_type":
      v = eqn.invars[0]
    dts.append(np.dtype(v.aval.dtype))
  return dts


@pytest.mark.slow
def test_gpt_activations_between_layers_stay_half():
  # Biases and residuals added to half matmuls stay half (torch's addmm), so
  # what flows from block to block is half; norms, softmax and loss are not.
  from flax import nnx
  models = _models()
  # The written-out attention: its contractions are the ops autocast casts
  # (XLA's fused attention on a CPU contracts float32 score gradients).
  model = _build(lambda: models.GPT(vocab_size=32, d_model=16, num_heads=2,
                                    num_layers=2, max_len=8,
                                    attention="einsum", rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)

  def forward(params, tokens):
    m = nnx.merge(graphdef, params)
    x = m.embed(tokens) + m.pos_embed(jnp.arange(tokens.shape[1]))
    between = []
    for block in m.blocks:
      x = block(x)
      between.append(x)
    normed = m.ln_f(x)
    logits = m.embed.attend(normed)
    return between, normed, logits, models.lm_loss(logits, tokens)

  for half in HALF:
    amp = jmp_amp.autocast(forward, jmp_amp.Policy(F32, half, F32))
    jaxpr = jax.make_jaxpr(amp)(params, tokens)
    assert _raw_out_dtypes(jaxpr) == [half, half, F32, half, F32]
    # Norm statistics, softmax and loss in float32; every matmul in half.
    assert_amp_jaxpr(jaxpr, half=half, fragile=FRAGILE_MODEL)
    assert dtypes_of(jaxpr, "rsqrt") and dtypes_of(jaxpr, "exp")
    # Backward: half GEMMs, float32 reductions (bias gradients included).
    grad_fn = jax.grad(lambda p, t: amp(p, t)[-1])
    assert_amp_jaxpr(jax.make_jaxpr(grad_fn)(params, tokens), half=half,
                     fragile=FRAGILE_MODEL)

  loss_fn = lambda p, t: forward(p, t)[-1]
  (loss, grads), (loss32, grads32) = _fast_jit(lambda *a: (
      jax.value_and_grad(lambda *b: amp(*b)[-1])(*a),
      jax.value_and_grad(loss_fn)(*a)))(params, tokens)
  chex.assert_trees_all_close(loss, loss32, rtol=1e-2)
  _assert_rel_close(grads, grads32, 1e-2)  # float16 (the last `half`)


@pytest.mark.parametrize("mask_value", [-1e9, float(np.finfo(np.float32).min),
                                        -np.inf])
def test_keep_half_add_saturates(mask_value):
  # A float32 mask added to half attention scores is cast saturating: a fully
  # masked row gives float32's uniform softmax (NaN for a -inf mask, as in
  # float32), not the NaN of a finite mask overflowing to -inf.
  def attend(q, k, mask):
    return jax.nn.softmax(q @ k.T + mask, axis=-1)

  q, k = jnp.ones((3, 4)), jnp.ones((5, 4))
  mask = jnp.zeros((3, 5)).at[0].set(mask_value).at[1, 2:].set(mask_value)
  amp = jmp_amp.autocast(attend, "p=f32,c=f16,o=f32")
  jaxpr = jax.make_jaxpr(amp)(q, k, mask)
  assert dtypes_of(jaxpr, "add") == [[F16, F16]]
  expected = attend(q, k, mask)
  assert np.isnan(expected[0]).all() == (mask_value == -np.inf)
  chex.assert_trees_all_close(amp(q, k, mask), expected, atol=1e-3)
  # NaN is not hidden by the saturation.
  assert np.isnan(amp(q, k, mask.at[2, 0].set(np.nan))[2]).all()


def test_keep_half_rule_is_editable(mlp):
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(mlp_loss, MIXED_BF16))(*mlp)
  assert [d[0] for d in dtypes_of(jaxpr, "add")][:2] == [BF16, BF16]
  rules = jmp_amp.AutocastRules().with_promote("add")
  assert rules.rule_for("add") == "promote" and not rules.keep_half
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(mlp_loss, MIXED_BF16, rules=rules))(
      *mlp)
  # Promoted, the float32 bias makes the sum and tanh float32 (the old rule).
  assert [d[0] for d in dtypes_of(jaxpr, "add")][:2] == [F32, F32]
  assert dtypes_of(jaxpr, "tanh") == [[F32]]
  # keep_half on mul: a float32 scale keeps a half matmul result half.
  f = lambda x, w, s: (x @ w) * s
  x, w, s = jnp.ones((2, 3)), jnp.ones((3, 3)), jnp.ones(3)
  rules = jmp_amp.AutocastRules().with_keep_half("mul")
  jaxpr = jax.make_jaxpr(jmp_amp.autocast(f, MIXED_BF16, rules=rules))(x, w, s)
  assert dtypes_of(jaxpr, "mul") == [[BF16, BF16]]
