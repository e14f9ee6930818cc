"""A small reader for the HLO text of compiled programs (`Compiled.as_text()`).

JAX's public surface gives a compiled program only as text, so the matmul
audit's compiled stage and the GPU-target report read it here. The reader
knows just enough of the printed format: computations, one instruction per
line (``%name = TYPE opcode(%operands), attributes``), the computations an
instruction calls, its metadata and the source-location tables. It is tested
on real XLA:CPU and XLA:GPU output (tests/fixtures/).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterator, NamedTuple, Optional

_COMP_RE = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_OPCODE_RE = re.compile(r" ([a-z][a-z0-9\-]*)\(")
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,<=?]*)\]")
_CALLED_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition|branch_computations|"
    r"true_computation|false_computation)=(\{[^}]*\}|%[\w.\-]+)")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# Bytes per element of HLO primitive types, for the traffic estimate.
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2,
          "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2,
          "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0}


class Instr(NamedTuple):
  name: str
  type: str       # result type text, an array "f32[2,3]{1,0}" or a tuple
  opcode: str
  operands: tuple[str, ...]  # operand instruction names
  attrs: str      # everything after the operand list

  def attr(self, key: str) -> Optional[str]:
    """The text of a ``key=...`` attribute ({...} and "..." kept whole)."""
    m = re.search(r"\b" + re.escape(key) + r"=", self.attrs)
    if not m:
      return None
    i = m.end()
    if self.attrs[i:i + 1] == '"':
      return self.attrs[i + 1:self.attrs.index('"', i + 1)]
    if self.attrs[i:i + 1] == "{":
      return self.attrs[i:_close(self.attrs, i)]
    return re.match(r"[^\s,]*", self.attrs[i:]).group(0)

  def backend_config(self) -> dict[str, Any]:
    text = self.attr("backend_config")
    try:
      return json.loads(text) if text else {}
    except json.JSONDecodeError:
      return {}


class HloModule:
  """The computations of a printed HLO module."""

  def __init__(self, text: str):
    self.computations: dict[str, list[Instr]] = {}
    self.entry: Optional[str] = None
    tables: dict[str, dict[int, str]] = {t: {} for t in _TABLES}
    current, table = None, None
    for line in text.splitlines():
      stripped = line.strip()
      if stripped in _TABLES:
        table = stripped
      elif table and re.match(r"\d+ ", stripped):
        key, value = stripped.split(" ", 1)
        tables[table][int(key)] = value
      elif (m := _COMP_RE.match(stripped)) and current is None:
        table, current = None, m.group(2)
        self.computations[current] = []
        if m.group(1):
          self.entry = current
      elif stripped == "}":
        current = None
      elif current and (m := _INSTR_RE.match(line)):
        instr = _parse_instr(m.group(1), m.group(2))
        if instr:
          self.computations[current].append(instr)
    self._types = {(c, i.name): i.type for c, instrs in self.computations.items()
                   for i in instrs}
    self._tables = {t: {k: _fields(v) for k, v in d.items()}
                    for t, d in tables.items()}

  def called(self, instr: Instr) -> list[str]:
    """The computations `instr` calls (fusion body, loop body, branches...)."""
    return [n for m in _CALLED_RE.finditer(instr.attrs)
            for n in re.findall(r"%([\w.\-]+)", m.group(1))
            if n in self.computations]

  def fusion_kind(self, instr: Instr) -> Optional[str]:
    """A fusion's kind: its backend config's (``"__triton_gemm"``...) for a
    custom fusion, else the ``kind=`` attribute ("kLoop", "kInput")."""
    kind = instr.attr("kind")
    if kind == "kCustom":
      kind = instr.backend_config().get("fusion_backend_config", {}).get(
          "kind", kind)
    return kind

  def triton_computations(self) -> dict[str, str]:
    """{computation: fusion kind} for the bodies of Triton fusions (GEMMs
    XLA generates code for), nested computations included."""
    found = {}
    for instrs in self.computations.values():
      for instr in instrs:
        kind = self.fusion_kind(instr) if instr.opcode == "fusion" else None
        if kind and kind.startswith("__triton"):
          stack = self.called(instr)
          while stack:
            comp = stack.pop()
            if comp not in found:
              found[comp] = kind
              stack += [c for i in self.computations[comp]
                        for c in self.called(i)]
    return found

  def walk(self) -> Iterator[tuple[str, Instr]]:
    """(computation, instruction) from the entry in program order, each
    called computation expanded where it is called."""
    def visit(comp, stack):
      for instr in self.computations[comp]:
        for callee in self.called(instr):
          if callee not in stack:
            yield from visit(callee, stack + (callee,))
        yield comp, instr
    if self.entry:
      yield from visit(self.entry, (self.entry,))

  def kernels(self) -> list[tuple[str, Instr]]:
    """The instructions that launch work: those outside fusion bodies and
    reducers (control flow bodies included, once each), less the free ones
    (parameters, constants, tuples, bitcasts), control flow itself and the
    waits that close an async pair ("*-done")."""
    inner = {c for instrs in self.computations.values() for i in instrs
             if i.opcode not in ("while", "conditional", "call")
             for c in self.called(i)}
    return [(c, i) for c, i in self.walk() if c not in inner
            and i.opcode not in _FREE and not i.opcode.endswith("-done")]

  def operand(self, comp: str, instr: Instr, index: int):
    """(shape, dtype) of operand `index` of `instr` in `comp`."""
    return array(self._types.get((comp, instr.operands[index]), ""))

  def operand_bytes(self, comp: str, instr: Instr) -> int:
    return sum(nbytes(self._types.get((comp, o), "")) for o in instr.operands)

  def location(self, instr: Instr) -> tuple[Optional[str], list]:
    """(op name, [(file, line)] innermost frame first) from the metadata."""
    meta = instr.attr("metadata") or ""
    name = re.search(r'op_name="([^"]*)"', meta)
    frames = []
    fid = re.search(r"stack_frame_id=(\d+)", meta)
    frame_id, seen = int(fid.group(1)) if fid else 0, set()
    while frame_id in self._tables["StackFrames"] and frame_id not in seen:
      seen.add(frame_id)
      frame = self._tables["StackFrames"][frame_id]
      loc = self._tables["FileLocations"].get(frame.get("file_location_id"), {})
      file = self._tables["FileNames"].get(loc.get("file_name_id"))
      if file:
        frames.append((file, loc.get("line", 0)))
      # XLA prints a parent's id plus one (1 is the root, "no parent").
      frame_id = frame.get("parent_frame_id", 0) - 1
    file = re.search(r'source_file="([^"]*)"', meta)
    if not frames and file:
      line = re.search(r"source_line=(\d+)", meta)
      frames = [(file.group(1), int(line.group(1)) if line else 0)]
    return (name.group(1) if name else None), frames


_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
         "after-all", "partition-id", "replica-id", "while", "conditional",
         "call", "opt-barrier"}


def _fields(text: str) -> Any:
  text = text.strip()
  if text.startswith('"'):
    return text.strip('"')
  return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", text)}


def _close(text: str, i: int) -> int:
  """Index just past the bracket that closes the one at `text[i]`."""
  pair = {"{": "}", "(": ")"}[text[i]]
  depth, quoted = 0, False
  for j in range(i, len(text)):
    c = text[j]
    if c == '"' and text[j - 1] != "\\":
      quoted = not quoted
    elif not quoted and c == text[i]:
      depth += 1
    elif not quoted and c == pair:
      depth -= 1
      if depth == 0:
        return j + 1
  return len(text)


def _parse_instr(name: str, rest: str) -> Optional[Instr]:
  m = _OPCODE_RE.search(" " + rest)
  if not m:
    return None
  start = m.end() - 2  # index of "(" in `rest`
  end = _close(rest, start)
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[start:end]))
  return Instr(name, rest[:m.start()].strip(), m.group(1), operands, rest[end:])


def array(type_text: str):
  """(shape, dtype) of the first array in an HLO type; (None, None) if none.

  Dynamic dimensions ("<=8", "?") give None.
  """
  m = _ARRAY_RE.search(type_text)
  if not m:
    return None, None
  dims = tuple(int(d) if d.isdigit() else None
               for d in m.group(2).split(",") if d)
  return dims, m.group(1)


def nbytes(type_text: str, first_only: bool = False) -> int:
  """Bytes of the arrays in an HLO type (an array or a tuple), or of its first
  array only."""
  total = 0.0
  for dtype, dims in _ARRAY_RE.findall(type_text)[:1 if first_only else None]:
    sizes = [int(d.lstrip("<=")) for d in dims.split(",") if d and d != "?"]
    total += _BYTES.get(dtype, 4) * math.prod(sizes)
  return int(total)
