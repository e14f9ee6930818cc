"""Fault sequences shared by the migration/GradScaler tests and the script
that records other libraries' trajectories (tests/data/)."""

import numpy as np

SCENARIOS = {
    # torch's defaults (init 2**16, growth 2, backoff 0.5, interval 2000):
    # backs off, then grows once, then backs off again.
    "torch_defaults": dict(init_scale=2.0**16, interval=2000, steps=2110,
                           faults=[3, 4, 50, 60, 2090], lr=1e-2),
    # A short interval, and a run of faults that takes the scale below 1
    # (where jmp_amp's default floor of 1, and jmp's, differ from torch,
    # Keras and Flax, which have none).
    "below_one": dict(init_scale=4.0, interval=3, steps=40,
                      faults=[0, 1, 2, 3, 4, 10, 17, 18, 30], lr=1e-2),
}


def regression_data(scenario, seed=0):
  """Inputs/targets for a Linear(5, 2), inf/NaN inputs on the faulty steps."""
  rng = np.random.default_rng(seed)
  steps = scenario["steps"]
  xs = rng.normal(size=(steps, 8, 5)).astype(np.float32)
  ys = rng.normal(size=(steps, 8, 2)).astype(np.float32)
  for i, step in enumerate(scenario["faults"]):
    xs[step, 0, 0] = np.inf if i % 2 == 0 else np.nan
  w0 = np.random.default_rng(1).normal(size=(5, 2)).astype(np.float32) * 0.1
  b0 = np.zeros(2, np.float32)
  return xs, ys, w0, b0


def torch_run(scenario):
  """`torch.amp.GradScaler` + SGD on the scenario: scales, skips, final
  weights."""
  import torch  # pylint: disable=g-import-not-at-top
  xs, ys, w0, b0 = regression_data(scenario)
  model = torch.nn.Linear(5, 2)
  with torch.no_grad():
    model.weight.copy_(torch.from_numpy(w0.T.copy()))
    model.bias.copy_(torch.from_numpy(b0))
  opt = torch.optim.SGD(model.parameters(), lr=scenario["lr"])
  scaler = torch.amp.GradScaler(
      "cpu", init_scale=scenario["init_scale"], growth_factor=2.0,
      backoff_factor=0.5, growth_interval=scenario["interval"])
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
    scales.append(float(scaler.get_scale()))
  return {"scales": scales, "skipped": skipped,
          "w": model.weight.detach().numpy().T.tolist(),
          "b": model.bias.detach().numpy().tolist(),
          "version": torch.__version__}
