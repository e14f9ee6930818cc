"""Which FP8 layers of a compiled program run FP8 GEMMs only.

`MatmulReport.fp8_fallbacks` compares a compiled program's ops with the
matmuls the lowered program asks for, layer by layer (an FP8 layer runs
under ``jax.named_scope("fp8[<path>]")``, see `MatmulRecord.fp8_layer`).
XLA merges matmuls that share an operand (the q, k and v projections of one
input) into one GEMM named after one of them; the FLOPs the other layers
miss then reappear in that GEMM. Such a layer is cleared when the FP8 FLOPs
gained beyond what each layer asked for cover all the others lost.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

Counts = dict[str, dict[str, int]]  # layer -> {signature: ops}


def is_fp8_signature(signature: str) -> bool:
  """Whether both operands of ``"lhs x rhs -> result"`` are FP8."""
  lhs, rhs = signature.split(" -> ")[0].split(" x ")
  return lhs.startswith("float8") and rhs.startswith("float8")


def fallbacks(found: Counts, records: Sequence, want: Optional[Counts],
              asked_records: Optional[Sequence]) -> dict[str, str]:
  """``{layer: reason}`` for the FP8 layers not compiled to FP8 GEMMs only.

  Args:
    found: the compiled program's ops per FP8 layer, by signature.
    records: its `MatmulRecord`s.
    want: the lowered program's (the matmuls asked for), or None.
    asked_records: the lowered program's records, or None.
  """
  want = want or {}
  short = {layer: (sum(ops.values()), sum(found.get(layer, {}).values()))
           for layer, ops in want.items()}
  short = {k: v for k, v in short.items() if v[1] < v[0]}
  merged = bool(short) and _fp8_flops_cover(records, asked_records)
  out = {}
  for layer in list(want) + [k for k in found if k not in want]:
    sigs = found.get(layer, {})
    total = sum(sigs.values())
    bad = {s: n for s, n in sigs.items() if not is_fp8_signature(s)}
    reasons = []
    if bad:
      reasons.append(f"{sum(bad.values())} of {total} ops not FP8 (" +
                     ", ".join(f"{n} x {s}" for s, n in bad.items()) + ")")
    if layer in short and not merged:
      asked, got = short[layer]
      reasons.append(f"{asked} matmuls asked for, {got} compiled (merged "
                     "into a GEMM that is not FP8, or removed)")
    if reasons:
      out[layer] = "; ".join(reasons)
  return out


def _layer_flops(records: Sequence, fp8_only: bool
                 ) -> Optional[dict[str, int]]:
  """FLOPs of each FP8 layer's ops (with FP8 operands only, if `fp8_only`);
  None if one is unknown."""
  out: dict[str, int] = collections.defaultdict(int)
  for r in records:
    if r.fp8_layer is not None and (
        not fp8_only or is_fp8_signature(r.signature)):
      if r.flops is None:
        return None
      out[r.fp8_layer] += r.flops
  return out


def _fp8_flops_cover(compiled: Sequence, lowered: Sequence) -> bool:
  """Whether the FP8 FLOPs that some layers gained in `compiled` (over the
  matmuls `lowered` asks of them) account for all that the others lost:
  their GEMMs were merged into FP8 GEMMs."""
  got = _layer_flops(compiled, fp8_only=True)
  asked = _layer_flops(lowered, fp8_only=False)
  if got is None or asked is None:
    return False
  layers = set(got) | set(asked)
  gained = sum(max(0, got[k] - asked[k]) for k in layers)
  lost = sum(max(0, asked[k] - got[k]) for k in layers)
  return gained >= lost
