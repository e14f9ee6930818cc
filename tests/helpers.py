"""Assertion helpers shared by the tests (importable: tests/ is on the
pythonpath)."""

import functools
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
from jmp_amp.models import data as data_lib
import numpy as np


def tree_bytes_equal(a, b) -> bool:
  """Bit-for-bit equality of two pytrees (NaNs included)."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  if ta != tb:
    return False
  return all(np.asarray(x).dtype == np.asarray(y).dtype
             and np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(la, lb))


def _ulp(x: np.ndarray, dtype) -> np.ndarray:
  """The spacing of `dtype` at the float64 magnitudes `x` (ml_dtypes too)."""
  info = jnp.finfo(dtype)
  _, exp = np.frexp(x)  # x = m * 2**exp, 0.5 <= m < 1
  return np.maximum(np.ldexp(1.0, exp - 1 - int(info.nmant)),
                    float(info.smallest_subnormal))


def assert_trees_within_ulps(a, b, ulps: int = 4) -> None:
  """Two pytrees of the same structure and dtypes agree within `ulps` units
  in the last place: for results of two differently compiled programs.

  XLA picks fusion, vector width and FMA contraction per CPU and per
  version, so two programs that compute the same formula may round an ulp
  apart on one machine and alike on another. An element's ulp is its
  dtype's spacing at the larger of the two magnitudes, or at its leaf's
  largest magnitude, whichever is wider: an element that comes out of a
  cancellation carries the rounding of the larger terms it came from.
  NaNs and infinities must match exactly; non-floating leaves too.
  """
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, (ta, tb)
  for i, (x, y) in enumerate(zip(la, lb)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (i, x.dtype, y.dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.size == 0:
      np.testing.assert_array_equal(x, y, err_msg=f"leaf {i}")
      continue
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    finite = np.isfinite(xf) & np.isfinite(yf)
    np.testing.assert_array_equal(np.where(finite, 0, xf),
                                  np.where(finite, 0, yf),
                                  err_msg=f"leaf {i}: inf/NaN differ")
    big = np.where(finite, np.maximum(np.abs(xf), np.abs(yf)), 0.0)
    ulp = np.maximum(_ulp(big, x.dtype), _ulp(np.max(big), x.dtype))
    off = np.abs(np.where(finite, xf - yf, 0.0)) / ulp
    assert np.all(off <= ulps), (
        f"leaf {i} ({x.dtype}): {np.max(off):g} ulps apart, at most {ulps}")


def pure(tree):
  """`tree` with its `nnx.Variable`s replaced by their values.

  What `nnx.as_pure` does from Flax 0.12.7 on, with public APIs of every
  supported Flax (the optax state inside an `nnx.Optimizer`, for instance).
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return jax.tree_util.tree_map(
      lambda x: x.get_value() if isinstance(x, nnx.Variable) else x, tree,
      is_leaf=lambda x: isinstance(x, nnx.Variable))


@functools.lru_cache(maxsize=None)
def digits():
  """`jmp_amp.models.data.digits()`, loaded once per test process."""
  return data_lib.digits()


def fp8_gemm_kinds(counts) -> dict:
  """GEMM counts by signature (``"lhs x rhs -> out": n``) as FP8 kinds.

  "forward": E4M3 x E4M3; "backward": an E5M2 operand (the output
  gradient) and an E4M3 one, in either order (XLA may swap them); anything
  else under its own signature. The result dtype is left out: a Triton
  GEMM accumulates and returns float32 in its fusion, a cuBLAS one may
  return bf16.
  """
  out = {}
  for sig, n in counts.items():
    operands = tuple(sorted(sig.split(" -> ")[0].split(" x ")))
    kind = {("float8_e4m3fn", "float8_e4m3fn"): "forward",
            ("float8_e4m3fn", "float8_e5m2"): "backward"}.get(operands, sig)
    out[kind] = out.get(kind, 0) + n
  return out


def h100_target_or_skip():
  """Skips the calling test unless the compile-only H100 target is here."""
  import pytest  # pylint: disable=import-outside-toplevel

  from jmp_amp.tools import gpu_target  # pylint: disable=import-outside-toplevel
  if not gpu_target.has_cuda_plugin():
    pytest.skip("needs the CUDA plugin (pip install 'jmp-amp[gpu-audit]')")
  try:
    gpu_target.target_device("h100")
  except RuntimeError as e:
    pytest.skip(f"CUDA plugin gave no compile-only target: {e}")


def benchmark(name: str):
  """The script benchmarks/`name`.py, loaded as a module."""
  path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / (
      name + ".py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_check_script(script, *args, timeout=900):
  """The JSON of the last line a check script (tests/*_check.py) prints,
  run in a process of its own on the CPU with the device count it sets
  itself, importing this checkout's jmp_amp rather than an installed one."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the script sets its own device count
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(script))
  env["PYTHONPATH"] = os.pathsep.join(
      [root] + [p for p in [env.get("PYTHONPATH")] if p])
  proc = subprocess.run([sys.executable, script, *args], capture_output=True,
                        text=True, env=env, timeout=timeout,
                        cwd=os.path.dirname(script))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])
