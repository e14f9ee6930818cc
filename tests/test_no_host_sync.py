"""The jitted train step never syncs with the host and compiles once.

Every step, skipped (inf/NaN) or growing the loss scale, runs under
``jax.transfer_guard("disallow")`` with its inputs already on the device, and
the step is traced exactly once across all of them (with either skip mechanism,
``lax.cond`` or selects): the skip/scale decisions
are data flow, not Python control flow on device values.
"""

import contextlib

import jax
from jax._src import array as jarray
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
import reliability_helpers as rh

NUM_STEPS = 40
FAULTS = np.array([3, 4, 11, 20, 21, 22, 30], np.int32)


@contextlib.contextmanager
def no_host_sync():
  """Refuses implicit transfers between host and device, in both directions.

  `jax.transfer_guard` catches host-to-device copies everywhere, but on CPU
  a device array already lives in host memory, so reading one (``float(x)``,
  ``bool(x)``, ``x.item()``) is no transfer and the guard stays silent. The
  second half closes that gap for tests: it makes the host-side read of any
  jax.Array's value raise. (NumPy's C buffer protocol, ``np.asarray(x)``,
  still gets through; the train steps here have no reason to use it.)
  """
  value = getattr(jarray.ArrayImpl, "_value", None)
  if not isinstance(value, property):
    pytest.skip("jax.Array internals changed: no device-to-host detector")

  def refuse(self):
    raise RuntimeError("device-to-host read of a jax.Array inside "
                       "no_host_sync()")
  with jax.transfer_guard("disallow"):
    jarray.ArrayImpl._value = property(refuse)
    try:
      yield
    finally:
      jarray.ArrayImpl._value = value


def _count_traces(fn):
  """`fn` plus a counter that its (Python) body bumps each time it is traced."""
  count = [0]

  def counted(*args, **kwargs):
    count[0] += 1
    return fn(*args, **kwargs)
  return counted, count


def _scale_history(metrics):
  finite = np.array([bool(m["grads_finite"]) for m in metrics])
  scale = np.array([float(m["loss_scale"]) for m in metrics])
  return finite, scale


SKIP_WITH = ["auto", "cond", "select"]


@pytest.mark.parametrize("skip_with", [
    s if s == "auto" else pytest.param(s, marks=pytest.mark.slow)
    for s in SKIP_WITH])
def test_plain_jax_step_no_transfers_one_compile(skip_with):
  # bfloat16 compute: no overflow of its own, so skipped steps are exactly
  # the injected faults however high the scale grows.
  opt = jmp_amp.loss_scaling(
      optax.adam(1e-2), jmp_amp.DynamicLossScale(2.0**15, period=2),
      skip_with=skip_with)
  # No fault key: a jax.Array closed over by the step would be read on the
  # host once, to embed it as a constant when the step compiles.
  train_step, traces = _count_traces(rh.make_train_step(opt, rh.BF16))
  step = jax.jit(train_step, donate_argnums=0)
  xs, ys = rh.make_batches(0, NUM_STEPS)

  # Everything the loop touches goes to the device before the guard.
  device = jax.devices()[0]
  state = jax.device_put(rh.init_state(0, opt), device)
  batches = [jax.device_put((np.asarray(xs[i]), np.asarray(ys[i])), device)
             for i in range(NUM_STEPS)]
  step_ids = [jax.device_put(np.int32(i), device) for i in range(NUM_STEPS)]
  faults = jax.device_put(FAULTS, device)

  metrics = []
  with no_host_sync():
    for i in range(NUM_STEPS):
      state, m = step(state, batches[i], step_ids[i], faults)
      metrics.append(m)
  jax.block_until_ready(state)

  assert traces[0] == 1
  assert step._cache_size() == 1
  finite, scale = _scale_history(metrics)
  np.testing.assert_array_equal(np.flatnonzero(~finite), FAULTS)
  assert np.sum(np.diff(scale) > 0) >= 5   # scale-growth steps ran too
  assert np.sum(np.diff(scale) < 0) == len(FAULTS)
  assert jmp_amp.all_finite(state["params"])


@pytest.mark.parametrize("sync", [
    lambda x: x + 1.0,                    # a Python scalar sent to the device
    lambda x: jnp.sum(np.ones(3)),        # a NumPy array sent to the device
    lambda x: float(x[0]),                # a value read on the host
    lambda x: bool(jnp.all(x > 0)),       # Python control flow on a value
    lambda x: x.tolist(),
])
def test_no_host_sync_catches_syncs(sync):
  # The guard is live in both directions, so silence above means something.
  x = jax.device_put(np.ones(3, np.float32))
  jax.block_until_ready(x[0])  # compile the indexing outside the guard
  with pytest.raises(Exception, match="[Dd]isallowed|device-to-host"):
    with no_host_sync():
      sync(x)


def _batches_with_nan(xs, ys, bad_steps):
  out = []
  for i in range(len(xs)):
    x = np.asarray(xs[i]).copy()
    if i in bad_steps:
      x[0, 0] = np.nan
    out.append(jax.device_put((x, np.asarray(ys[i]))))
  return out


def test_nnx_train_step_no_transfers_one_compile():
  nnx = pytest.importorskip("flax.nnx")
  jflax = pytest.importorskip("jmp_amp.flax")
  init = {"kernel_init": rh.numpy_init}
  model = nnx.Sequential(nnx.Linear(8, 16, **init, rngs=nnx.Rngs(0)),
                         nnx.relu, nnx.Linear(16, 4, **init, rngs=nnx.Rngs(1)))
  jflax.set_policies(model, "p=f32,c=f16,o=f32")
  optimizer = nnx.Optimizer(
      model, rh.make_optimizer(init_scale=2.0**4, period=3), wrt=nnx.Param)

  def loss_fn(m, batch):
    x, y = batch
    return jnp.mean((m(x).astype(jnp.float32) - y) ** 2)
  counted, traces = _count_traces(loss_fn)
  step = jflax.make_train_step(counted)

  xs, ys = rh.make_batches(0, 20)
  batches = _batches_with_nan(xs, ys, {3, 9, 10})
  metrics = []
  with no_host_sync():
    for batch in batches:
      metrics.append(step(model, optimizer, batch))
  finite, scale = _scale_history(metrics)
  assert traces[0] == 1
  np.testing.assert_array_equal(np.flatnonzero(~finite), [3, 9, 10])
  assert np.any(np.diff(scale) > 0)


def test_linen_train_step_no_transfers_one_compile():
  nn = pytest.importorskip("flax.linen")
  jflax = pytest.importorskip("jmp_amp.flax")

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(16, dtype=jnp.float16,
                           dot_general=jmp_amp.dot_general)(x))
      return nn.Dense(4, dtype=jnp.float16,
                      dot_general=jmp_amp.dot_general)(x)

  net = Net()
  xs, ys = rh.make_batches(0, 20)
  params = jax.jit(net.init)(jax.random.key(0), xs[0])["params"]
  state = jflax.train.TrainState.create(
      apply_fn=net.apply, params=params,
      tx=rh.make_optimizer(init_scale=2.0**4, period=3))
  state = jax.device_put(state)

  def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)
  counted, traces = _count_traces(loss_fn)
  step = jflax.make_linen_train_step(counted)

  batches = _batches_with_nan(xs, ys, {2, 13})
  metrics = []
  with no_host_sync():
    for batch in batches:
      state, m = step(state, batch)
      metrics.append(m)
  finite, scale = _scale_history(metrics)
  assert traces[0] == 1
  assert step._cache_size() == 1
  np.testing.assert_array_equal(np.flatnonzero(~finite), [2, 13])
  assert np.any(np.diff(scale) > 0)


@pytest.mark.parametrize("skip_with", SKIP_WITH)
def test_loss_scaling_update_alone_no_transfers(small_params, skip_with):
  # The transformation by itself (no model): skip and growth branches.
  opt = jmp_amp.loss_scaling(optax.adam(1e-3),
                             jmp_amp.DynamicLossScale(2.0**4, period=1),
                             skip_with=skip_with)
  update, traces = _count_traces(opt.update)
  update = jax.jit(update)
  state = jax.device_put(opt.init(small_params))
  params = jax.device_put(small_params)
  good = jax.device_put(jax.tree_util.tree_map(jnp.ones_like, small_params))
  bad = jax.device_put(jax.tree_util.tree_map(
      lambda x: jnp.full_like(x, jnp.nan), small_params))
  history = []
  with no_host_sync():
    for grads in (good, bad, good, good, bad):
      _, state = update(grads, state, params)
      history.append(state.loss_scale.loss_scale)
  assert traces[0] == 1
  assert [float(s) for s in history] == [32.0, 16.0, 32.0, 64.0, 32.0]
