"""Precision policies: which dtype parameters, computation and outputs use."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, Union

import numpy as np

from jmp_amp._src import dtypes
from jmp_amp._src.tree import cast_floating

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Policy:
  """Declares the dtypes of parameters, computation and outputs.

  A frozen, hashable dataclass, so it can be a static argument of `jax.jit`.
  Dtypes may be given as dtypes, scalar types or names ("bf16") and must be
  floating point. They are stored as JAX's scalar types, as in jmp: callable
  (``policy.compute_dtype(x)`` makes an array) and equal to the `np.dtype`.

  Example:
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from jmp_amp import Policy, get_policy
    >>> policy = Policy(jnp.float32, "bf16", np.float32)
    >>> str(policy)
    'p=f32,c=bf16,o=f32'
    >>> get_policy(str(policy)) == policy
    True
    >>> policy.compute_dtype(1.5).dtype == np.dtype(jnp.bfloat16)
    True

  Attributes:
    param_dtype: storage dtype of parameters (master weights).
    compute_dtype: dtype in which inputs and parameters enter computation.
    output_dtype: dtype of the values returned.
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __post_init__(self):
    # Policy is not a pytree node, so normalising here is safe.
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      value = dtypes.scalar_type(getattr(self, field), field)
      object.__setattr__(self, field, value)

  def cast_to_param(self, x: T) -> T:
    """Casts the floating-point leaves of `x` to the param dtype."""
    return cast_floating(x, self.param_dtype)

  def cast_to_compute(self, x: T) -> T:
    """Casts the floating-point leaves of `x` to the compute dtype."""
    return cast_floating(x, self.compute_dtype)

  def cast_to_output(self, x: T) -> T:
    """Casts the floating-point leaves of `x` to the output dtype."""
    return cast_floating(x, self.output_dtype)

  def with_param_dtype(self, param_dtype: Any) -> Policy:
    return dataclasses.replace(self, param_dtype=param_dtype)

  def with_compute_dtype(self, compute_dtype: Any) -> Policy:
    return dataclasses.replace(self, compute_dtype=compute_dtype)

  def with_output_dtype(self, output_dtype: Any) -> Policy:
    return dataclasses.replace(self, output_dtype=output_dtype)

  @property
  def is_mixed(self) -> bool:
    """Whether computation runs in a narrower dtype than the parameters."""
    return (np.dtype(self.compute_dtype).itemsize
            < np.dtype(self.param_dtype).itemsize)

  def __str__(self) -> str:
    return "p={},c={},o={}".format(
        dtypes.dtype_name(self.param_dtype),
        dtypes.dtype_name(self.compute_dtype),
        dtypes.dtype_name(self.output_dtype))


# The one policy-name table: every name that is a whole policy, and its
# (params, compute, output) dtypes. A dtype name alone is that dtype for all
# three, as in jmp ("bf16" is all bfloat16); Keras's names are the mixed
# recipes, float32 master weights and outputs in the compute dtype (pin a
# final layer to "float32" for float32 outputs). README.md and
# docs/policies-and-flax.md show this table; the tests check that they do.
POLICY_NAMES: dict[tuple[str, ...], tuple[str, str, str]] = {
    ("float32", "f32", "fp32", "full", "single"): ("f32", "f32", "f32"),
    ("mixed_bfloat16",): ("f32", "bf16", "bf16"),
    ("mixed_float16",): ("f32", "f16", "f16"),
    ("bfloat16", "bf16"): ("bf16", "bf16", "bf16"),
    ("float16", "f16"): ("f16", "f16", "f16"),
    ("half",): ("half", "half", "half"),
    ("float64", "f64", "fp64", "double"): ("f64", "f64", "f64"),
}
# Dtype names that are no policy alone. As a whole policy "fp16" is mixed
# precision in torch's tools (accelerate, Lightning) but would be all float16
# by the rule above: either meaning would surprise half its users silently.
NOT_POLICY_NAMES = {
    "fp16": ("for mixed precision (float32 params, accelerate's 'fp16') "
             "write 'mixed_float16', for float16 everywhere 'float16'; as a "
             "part ('c=fp16') it is the float16 dtype."),
}
_BY_NAME = {name: parts for names, parts in POLICY_NAMES.items()
            for name in names}
_KEYS = {"p": "p", "params": "p", "param": "p",
         "c": "c", "compute": "c",
         "o": "o", "output": "o"}


def _grammar_help() -> str:
  return ("Accepted: a policy name (" + ", ".join(_BY_NAME) + ") or "
          "comma-separated key=dtype parts with keys params/p, compute/c, "
          "output/o and the dtypes " + ", ".join(dtypes.ACCEPTED_DTYPE_NAMES)
          + ", e.g. 'params=float32,compute=bfloat16,output=float32' or "
          "'p=f32,c=bf16,o=f32'.")


def _parse_part_dtype(value: str, policy_name: str) -> np.dtype:
  try:
    return dtypes.parse_dtype(value)
  except ValueError:
    raise ValueError(
        f"Unknown dtype {value.strip()!r} in policy {policy_name!r}. "
        + _grammar_help()) from None


def get_policy(policy_name: Union[str, Policy]) -> Policy:
  """Parses a policy name or jmp's key=dtype grammar.

  A name is one of `POLICY_NAMES` (README.md's policy-name table): a dtype
  name alone is that dtype for all three, as in jmp ("bf16" is
  "p=bf16,c=bf16,o=bf16"); Keras's "mixed_bfloat16" and "mixed_float16" are
  float32 params with bfloat16 or float16 compute and outputs. "fp16" alone
  is refused (say "mixed_float16" or "float16"). In key=dtype parts, left-out
  parts default as in jmp: params to float32, compute to params, output to
  compute ("c=bf16" is "p=f32,c=bf16,o=bf16").

  Example:
    >>> import jmp_amp
    >>> str(jmp_amp.get_policy("c=bf16,o=f32"))
    'p=f32,c=bf16,o=f32'
    >>> str(jmp_amp.get_policy("mixed_float16"))
    'p=f32,c=f16,o=f16'
    >>> str(jmp_amp.get_policy("bf16"))
    'p=bf16,c=bf16,o=bf16'

  Args:
    policy_name: e.g. "p=f32,c=bf16,o=f32", "params=float32,compute=float16",
      "bf16", "half", "full", "mixed_bfloat16". A `Policy` is returned as is.

  Returns:
    The `Policy`.

  Raises:
    TypeError: if `policy_name` is neither a str nor a `Policy`.
    ValueError: naming the part that is not understood.
  """
  if isinstance(policy_name, Policy):
    return policy_name
  if not isinstance(policy_name, str):
    raise TypeError(
        f"policy must be a Policy or a str, got {type(policy_name).__name__}: "
        f"{policy_name!r}")
  name = policy_name.strip()
  if "=" not in name:
    if name.lower() in NOT_POLICY_NAMES:
      raise ValueError(f"{name!r} alone is not a policy name: "
                       + NOT_POLICY_NAMES[name.lower()])
    parts = _BY_NAME.get(name.lower())
    if parts is None:
      raise ValueError(f"Unknown dtype {name!r} in policy {policy_name!r}. "
                       + _grammar_help())
    return Policy(*(dtypes.parse_dtype(part) for part in parts))

  parsed: dict[str, np.dtype] = {}
  for part in name.split(","):
    if part.count("=") != 1:
      raise ValueError(f"Malformed part {part.strip()!r} in policy "
                       f"{policy_name!r}: expected key=dtype. " + _grammar_help())
    key, value = (s.strip() for s in part.split("="))
    if key.lower() not in _KEYS:
      raise ValueError(
          f"Unknown key {key!r} in policy {policy_name!r}; keys are "
          "'params' (p), 'compute' (c) and 'output' (o). " + _grammar_help())
    short = _KEYS[key.lower()]
    if short in parsed:
      raise ValueError(f"Key {key!r} given twice in policy {policy_name!r}. "
                       + _grammar_help())
    parsed[short] = _parse_part_dtype(value, policy_name)
  param = parsed.get("p", np.dtype(np.float32))
  compute = parsed.get("c", param)
  output = parsed.get("o", compute)
  return Policy(param, compute, output)


def cast_to_full(tree: T) -> T:
  """Casts floating leaves of `tree` to float32."""
  return cast_floating(tree, np.float32)


def cast_to_half(tree: T) -> T:
  """Casts floating leaves of `tree` to `half_dtype()`."""
  return cast_floating(tree, dtypes.half_dtype())
