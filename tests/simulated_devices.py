"""The environment of the check scripts that run on simulated CPU devices.

Call `simulate` before JAX starts its backend (before the first array):
XLA reads the device count from XLA_FLAGS only then.
"""

import os


def simulate(num_devices: int) -> None:
  """`num_devices` XLA:CPU devices, at backend optimisation level 0.

  Level 0 (as the tests' FAST_COMPILE): these small programs compile in
  about half the time, and every run and its one-device reference compile
  alike.
  """
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={num_devices}"
      + " --xla_backend_optimization_level=0")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
