"""Assertion helpers shared by the tests (importable: tests/ is on pythonpath)."""

import functools
import importlib.util
import pathlib

import jax
import numpy as np

from jmp_amp.models import data as data_lib


def tree_bytes_equal(a, b) -> bool:
  """Bit-for-bit equality of two pytrees (NaNs included)."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  if ta != tb:
    return False
  return all(np.asarray(x).dtype == np.asarray(y).dtype
             and np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(la, lb))


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
