"""loss_scaling + DynamicLossScale follow torch.amp.GradScaler step for step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp

torch = pytest.importorskip("torch")


def _data(steps, faults, seed=0):
  rng = np.random.default_rng(seed)
  xs = rng.normal(size=(steps, 8, 5)).astype(np.float32)
  ys = rng.normal(size=(steps, 8, 2)).astype(np.float32)
  for step, kind in faults.items():
    xs[step, 0, 0] = np.inf if kind == "inf" else np.nan
  return xs, ys


def _run_torch(xs, ys, w0, b0, lr, init_scale, interval):
  model = torch.nn.Linear(5, 2)
  with torch.no_grad():
    model.weight.copy_(torch.from_numpy(w0.T))
    model.bias.copy_(torch.from_numpy(b0))
  opt = torch.optim.SGD(model.parameters(), lr=lr)
  scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0,
                                backoff_factor=0.5, growth_interval=interval)
  scales, skipped = [], []
  for x, y in zip(xs, ys):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x)),
                                        torch.from_numpy(y))
    scaler.scale(loss).backward()
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    skipped.append(bool(torch.equal(before, model.weight.detach())))
    scales.append(scaler.get_scale())
  return (model.weight.detach().numpy().T, model.bias.detach().numpy(),
          scales, skipped)


def _run_jax(xs, ys, w0, b0, lr, init_scale, interval):
  opt = jmp_amp.loss_scaling(
      optax.sgd(lr),
      jmp_amp.DynamicLossScale(init_scale, period=interval, factor=2,
                               backoff_factor=0.5))

  def step(carry, batch):
    params, state = carry
    x, y = batch
    loss_scale = jmp_amp.get_loss_scale(state)

    def loss_fn(p):
      return loss_scale.scale(jnp.mean((x @ p["w"] + p["b"] - y) ** 2))

    updates, state = opt.update(jax.grad(loss_fn)(params), state, params)
    params = optax.apply_updates(params, updates)
    return (params, state), (state.loss_scale.loss_scale,
                             jnp.logical_not(state.grads_finite))

  params = {"w": jnp.asarray(w0), "b": jnp.asarray(b0)}
  (params, _), (scales, skipped) = jax.jit(
      lambda c, d: jax.lax.scan(step, c, d))((params, opt.init(params)),
                                             (jnp.asarray(xs), jnp.asarray(ys)))
  return (np.asarray(params["w"]), np.asarray(params["b"]),
          [float(s) for s in scales], [bool(s) for s in skipped])


@pytest.mark.parametrize("steps, interval, faults", [
    # torch's defaults: init 2**16, growth 2, backoff 0.5, interval 2000.
    (2110, 2000, {3: "inf", 4: "nan", 50: "inf", 60: "nan", 2090: "inf"}),
    (40, 3, {0: "inf", 1: "inf", 7: "nan", 8: "inf", 20: "inf", 21: "nan"}),
])
def test_matches_torch_grad_scaler_step_for_step(steps, interval, faults):
  xs, ys = _data(steps, faults)
  rng = np.random.default_rng(1)
  w0 = rng.normal(size=(5, 2)).astype(np.float32) * 0.1
  b0 = np.zeros(2, np.float32)
  tw, tb, t_scales, t_skipped = _run_torch(xs, ys, w0, b0, 1e-2, 2.0**16, interval)
  jw, jb, j_scales, j_skipped = _run_jax(xs, ys, w0, b0, 1e-2, 2.0**16, interval)

  assert j_scales == t_scales  # exact: powers of two
  assert j_skipped == t_skipped
  assert [i for i, s in enumerate(j_skipped) if s] == sorted(faults)
  # The runs exercise both directions: back-off and growth.
  assert any(b > a for a, b in zip(j_scales, j_scales[1:]))
  assert any(b < a for a, b in zip(j_scales, j_scales[1:]))
  np.testing.assert_allclose(jw, tw, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(jb, tb, rtol=1e-4, atol=1e-6)
