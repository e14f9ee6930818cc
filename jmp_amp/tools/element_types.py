"""Element-type names and matmul FLOPs, as `MatmulRecord` spells them.

Shared by the readers of lowered (StableHLO) and compiled (HLO) programs in
`jmp_amp.tools.report`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import ml_dtypes
import numpy as np

from jmp_amp._src import dtypes

_NUMPY_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32",
                "f64": "float64", "c64": "complex64", "c128": "complex128"}


def short_dtype_name(numpy_name: str) -> str:
  """"bfloat16" -> "bf16", "float32" -> "f32"; other names ("int8") as numpy's."""
  try:
    dt = np.dtype(getattr(ml_dtypes, numpy_name, numpy_name))
  except TypeError:
    return numpy_name
  try:
    return dtypes.dtype_name(dt)
  except KeyError:
    return dt.name


def normalize_dtype(dtype: Any) -> str:
  """The short name of a dtype or dtype name, as records spell it."""
  if isinstance(dtype, str):
    try:
      return dtypes.dtype_name(dtypes.parse_dtype(dtype))
    except ValueError:
      return short_dtype_name(dtype)
  return short_dtype_name(np.dtype(dtype).name)


def hlo_dtype(name: Optional[str]) -> str:
  """Records' name of an HLO element type: "bf16", "f32", "int8", "bool"."""
  if name is None:
    return "?"
  if name in ("pred", "s1", "u1"):
    return "bool"
  if name[0] in "su" and name[1:].isdigit():
    return ("uint" if name[0] == "u" else "int") + name[1:]
  if name[:2] in ("f8", "f6", "f4"):
    return short_dtype_name(f"float{name[1]}_{name[2:]}")
  return short_dtype_name(_NUMPY_NAMES.get(name, name))


def prod(dims) -> Optional[int]:
  dims = list(dims)
  return None if any(d is None for d in dims) else math.prod(dims)


def dot_flops(lhs, result, contracting) -> Optional[int]:
  if contracting is None:
    return None
  k, n = prod(lhs[d] for d in contracting), prod(result)
  return None if k is None or n is None else 2 * n * k


def conv_flops(out, kernel, kernel_out_dim) -> Optional[int]:
  # Each output element reads kernel spatial size * input features per group
  # kernel entries: every kernel dim except the output-feature one.
  n, k = prod(out), prod(kernel)
  if None in (n, k, kernel_out_dim) or not kernel[kernel_out_dim]:
    return None
  return 2 * n * (k // kernel[kernel_out_dim])
