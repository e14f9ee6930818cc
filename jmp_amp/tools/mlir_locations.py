"""Op names and source frames from the locations of a StableHLO module.

Read by `jmp_amp.tools.report` for its lowered-stage records.
"""

from __future__ import annotations

from typing import Optional

from jax.extend.mlir import ir

if hasattr(ir, "NameLoc"):
  _LOCATION_KINDS = (("name", ir.NameLoc), ("callsite", ir.CallSiteLoc),
                     ("fused", ir.FusedLoc), ("file", ir.FileLineColLoc))

  def _location_kind(loc):
    for kind, cls in _LOCATION_KINDS:
      if loc.typeid == cls.static_typeid:
        return kind, cls(loc)
    return None, loc
else:  # MLIR bindings of jaxlib < 0.9: Location.is_a_*(), same accessors.

  def _location_kind(loc):
    for kind, test in (("name", loc.is_a_name), ("callsite", loc.is_a_callsite),
                       ("fused", loc.is_a_fused), ("file", loc.is_a_file)):
      if test():
        return kind, loc
    return None, loc


def location(loc, depth: int = 0) -> tuple[Optional[str], list]:
  """(op name, [(file, line)] innermost first) of an MLIR location."""
  kind, loc = _location_kind(loc) if depth <= 100 else (None, loc)
  if kind == "name":
    return loc.name_str, location(loc.child_loc, depth + 1)[1]
  if kind == "callsite":
    return None, (location(loc.callee, depth + 1)[1] +
                  location(loc.caller, depth + 1)[1])
  if kind == "fused":
    name, frames = None, []
    for part in loc.locations:
      n, f = location(part, depth + 1)
      name, frames = name or n, frames + f
    return name, frames
  if kind == "file":
    return None, [(loc.filename, loc.start_line)]
  return None, []
