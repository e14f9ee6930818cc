"""Root pytest configuration: the namespace every `>>>` example may rely on.

`python -m pytest` collects the doctests of every module under jmp_amp/
(`--doctest-modules` in pyproject.toml). An example is self-contained, or
uses only these names, which every doctest gets without importing them:

  jax, jnp (jax.numpy), np (numpy), optax, nnx (flax.nnx), nn (flax.linen),
  jmp_amp.

An example whose docstring says it "needs the ``gpu-audit`` extra" runs where
the compile-only H100 target is there (the extra, and JAX_PLATFORMS=cpu on a
machine without a GPU) and is skipped elsewhere, as the docs' ``requires
gpu-audit`` blocks are.
"""

import functools
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile


# Every program the tests compile on XLA:CPU is compiled fast (set before
# JAX starts its backend; subprocesses inherit XLA_FLAGS, and the check
# scripts that set their own device count add JMP_AMP_TESTS_XLA_FLAGS):
# - at backend optimisation level 0: LLVM spends far less time on code
#   that runs for milliseconds (the FP8 tests' CPU time fell by 43 %);
# - with XLA:CPU's elemental fusion emitters, from jaxlib 0.10 on and where
#   this XLA still has them (jaxlib 0.12 has only the MLIR ones, and
#   refuses the flag: one probe process decides): a program compiles in
#   about half the time, and the fast suite ran in 214 s instead of 405 s
#   on 2 cores. jaxlib 0.8.2's elemental emitters round float16 to FP8
#   otherwise than its default ones (an FP8 matmul's float16 gradients
#   were 0.8 % off float32's, not 0.02 %); at 0.10 they are the same
#   figures, and one float32 rounding of the scanned GPT differs
#   (test_scanned_gpt says which).
# The results differ from the defaults' only by rounding, so comparisons
# between two programs are within a tolerance anyway (see tests/helpers.py).
# An XLA_FLAGS that already names the level is left as it is.
def _fast_compile_flags() -> str:
  flags = ["--xla_backend_optimization_level=0"]
  elemental = "--xla_cpu_use_fusion_emitters=false"
  major, minor = map(int, importlib.metadata.version("jaxlib").split(".")[:2])
  if (major, minor) < (0, 10):
    return flags[0]
  probe = subprocess.run(
      [sys.executable, "-c", "import jax; jax.devices()"], check=False,
      capture_output=True, env={**os.environ, "XLA_FLAGS": elemental,
                                "JAX_PLATFORMS": "cpu"})
  if probe.returncode == 0:
    flags.append(elemental)
  return " ".join(flags)


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["JMP_AMP_TESTS_XLA_FLAGS"] = _fast_compile_flags()
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (
      os.environ.get("XLA_FLAGS"), os.environ["JMP_AMP_TESTS_XLA_FLAGS"])))

# A persistent compilation cache for the run: a program that several tests
# compile (the same model, step and shapes) compiles once; the fast suite's
# CPU time fell by about 10 %. A fresh directory each run, removed at its
# end, so that no run reads another run's programs; the benchmark tools turn
# it off for their own timed compiles. Each xdist worker has a directory of
# its own, which the subprocesses its tests start inherit: JAX writes an
# entry in place, and a process must not read one another is still writing
# (JAX's file lock, which a size limit turns on, scans the whole directory
# at every write). A JAX_COMPILATION_CACHE_DIR already set is left as it is.
_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _XLA_CACHE = tempfile.mkdtemp(prefix="jmp-amp-tests-xla-")
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_XLA_CACHE,
                    JMP_AMP_TESTS_XLA_CACHE=_XLA_CACHE,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
elif (os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(
    "JMP_AMP_TESTS_XLA_CACHE") == os.environ["JAX_COMPILATION_CACHE_DIR"]):
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
      os.environ["JAX_COMPILATION_CACHE_DIR"],
      os.environ["PYTEST_XDIST_WORKER"])

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp

# The scripts the tests run in subprocesses are not doctest-collected: their
# import has side effects. A check script asks for 8 simulated devices in
# XLA_FLAGS at import, and collected before JAX started its backend it gave
# the collecting process, and every test after, 8 CPU devices. The scripts
# that record reference data import torch/keras and run only as scripts.
collect_ignore = ["tests/data", "tests/fixtures/make_gpu_fixtures.py",
                  "tests/execute_notebooks.py", "tests/distributed_check.py",
                  "tests/explicit_sharding_check.py",
                  "tests/fp8_sharding_check.py", "tests/llama_mesh_check.py",
                  "tests/low_precision_sharded_check.py",
                  "tests/sharded_check.py"]


@pytest.fixture(autouse=True, scope="session")
def _doctest_names(doctest_namespace):
  from flax import linen as nn  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  doctest_namespace.update(jax=jax, jnp=jnp, np=np, optax=optax, nnx=nnx,
                           nn=nn, jmp_amp=jmp_amp)


@functools.cache
def _no_h100_target() -> str:
  """Why the compile-only H100 target is missing, or "" if it is there."""
  from jmp_amp.tools import gpu_target  # pylint: disable=g-import-not-at-top
  try:
    gpu_target.target_device("h100")
  except (ImportError, RuntimeError) as e:
    return str(e)
  return ""


# The files whose slow tests take longest, longest first (from the
# `--durations` .ci/run's slow step prints). That step sends whole files to
# its two workers in collection order (`--dist loadfile
# --no-loadscope-reorder`): with the long ones first, the short ones fill in
# at the end, and neither worker waits long for the other's last file. Only
# the order changes; a file missing here runs after these.
LONGEST_FIRST = ("test_numerics.py", "test_llama.py", "test_notebooks.py",
                 "test_gpu_check.py", "test_explicit_sharding.py",
                 "test_distributed.py", "test_docs.py", "test_scanned_gpt.py",
                 "test_fp8.py", "test_llama_mesh.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  for item in items:
    dtest = getattr(item, "dtest", None)  # a doctest item
    if (dtest is not None and "needs the ``gpu-audit`` extra"
        in (dtest.docstring or "") and _no_h100_target()):
      item.add_marker(pytest.mark.skip(reason=_no_h100_target()))


def pytest_unconfigure(config):
  del config
  if _XLA_CACHE is not None:  # this process made it: the run is over
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)
