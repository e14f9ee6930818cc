"""The environment of the check scripts that run on simulated CPU devices.

Call `simulate` before JAX starts its backend (before the first array):
XLA reads the device count from XLA_FLAGS only then.
"""

import os


def simulate(num_devices: int) -> None:
  """`num_devices` XLA:CPU devices, compiling as the tests do.

  The flags conftest.py chose for the run (JMP_AMP_TESTS_XLA_FLAGS; run
  alone, backend optimisation level 0): these small programs compile fast
  (conftest.py says how much faster), and every run and its one-device
  reference compile alike.
  """
  os.environ["XLA_FLAGS"] = " ".join((
      os.environ.get("XLA_FLAGS", ""),
      f"--xla_force_host_platform_device_count={num_devices}",
      os.environ.get("JMP_AMP_TESTS_XLA_FLAGS",
                     "--xla_backend_optimization_level=0")))
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
