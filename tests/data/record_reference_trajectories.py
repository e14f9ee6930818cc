"""Records the loss-scale trajectories that tests/test_migration.py and
tests/test_torch_parity.py compare jmp_amp against, so that the tests need no
torch, keras or jmp installed.

For each scenario (an initial scale, a growth interval and a fault sequence)
it drives each library's own dynamic loss scaler and records the scale after
every step:

* torch: `torch.amp.GradScaler` training a `Linear(5, 2)` with SGD on
  deterministic numpy data (faults are inf/NaN inputs); also records which
  steps were skipped and the final weights.
* keras: `keras.optimizers.LossScaleOptimizer` (JAX backend) on gradients that
  are inf on the faulty steps.
* jmp: jmp 0.0.4's `DynamicLossScale.adjust`.

Run it from the repository root with all three importable, e.g.

  pip install torch==2.13.0 keras==3.15.1 jmp==0.0.4
  KERAS_BACKEND=jax python tests/data/record_reference_trajectories.py

It rewrites tests/data/reference_trajectories.json.
"""

import json
import os
import pathlib
import re
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # pylint: disable=g-import-not-at-top

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # for reference_scenarios
from reference_scenarios import SCENARIOS  # pylint: disable=g-import-not-at-top
from reference_scenarios import torch_run  # pylint: disable=g-import-not-at-top


def keras_run(scenario):
  import keras  # pylint: disable=g-import-not-at-top
  assert keras.backend.backend() == "jax", keras.backend.backend()
  var = keras.Variable(np.zeros((2,), np.float32))
  opt = keras.optimizers.LossScaleOptimizer(
      keras.optimizers.SGD(0.0), initial_scale=scenario["init_scale"],
      dynamic_growth_steps=scenario["interval"])
  opt.build([var])
  # The JAX backend's eager `apply` leaks tracers from its `cond`; the
  # stateless API is what a JAX training loop (and Keras's fit) uses.
  import jax  # pylint: disable=g-import-not-at-top
  opt_values = [v.value for v in opt.variables]
  values = [var.value]
  scale_index = [v.path for v in opt.variables].index(opt.dynamic_scale.path)
  apply = jax.jit(opt.stateless_apply)
  scales = []
  for finite in scenario_finite(scenario):
    grad = np.ones((2,), np.float32) * (1.0 if finite else np.inf)
    values, opt_values = apply(opt_values, [grad], values)
    scales.append(float(opt_values[scale_index]))
  return {"scales": scales, "version": keras.__version__}


def jmp_run(scenario):
  import jmp  # pylint: disable=g-import-not-at-top
  ls = jmp.DynamicLossScale(np.float32(scenario["init_scale"]),
                            period=scenario["interval"], factor=2)
  scales = []
  for finite in scenario_finite(scenario):
    ls = ls.adjust(np.bool_(finite))
    scales.append(float(ls.loss_scale))
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    version = metadata.version("jmp")
  except metadata.PackageNotFoundError:
    version = "0.0.4"
  return {"scales": scales, "version": version}


def scenario_finite(scenario):
  faults = set(scenario["faults"])
  return [i not in faults for i in range(scenario["steps"])]


def main():
  out = {}
  for name, scenario in SCENARIOS.items():
    out[name] = {"scenario": scenario, "torch": torch_run(scenario),
                 "keras": keras_run(scenario), "jmp": jmp_run(scenario)}
  path = HERE / "reference_trajectories.json"
  text = json.dumps(out, indent=1)
  # One line per list of numbers: small, and still diffable per scenario.
  text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]",
                lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
  path.write_text(text + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
