"""Integrity: a CRC-32 per array, a well-formed description, a named file.

Orbax and tensorstore catch much damage themselves (a missing file, a
truncated chunk, JSON that does not parse), but not all: a flipped byte in an
uncompressed chunk restores as a changed value. So `save` records a CRC-32 of
every array's bytes and restore verifies it before any cast. CRC-32 is made
for accidental damage: it catches every burst of up to 32 flipped bits (so any
4 damaged bytes), runs ~3x faster than blake2b here, and is in the standard
library. It is no defence against tampering. In a multi-process run an array
split over processes, which no process holds whole, gets a CRC-32 per shard
(`_shard_checksums`); checking them is a collective, so that every process
agrees on the outcome.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional
import zlib

import jax
import numpy as np

from jmp_amp.checkpoint import _compat

CHECKSUM = "crc32"
_WITHOUT_CHECKSUMS = "jmp_amp.checkpoint/1"
_BEFORE_FP8 = (_WITHOUT_CHECKSUMS, "jmp_amp.checkpoint/2")
# orbax's JSON metadata files, parsed to name the damaged one in errors.
_JSON_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "_sharding", "metadata")


def checksum(x: Any) -> Optional[str]:
  """CRC-32 of an array's bytes in C order, or None where none is taken.

  None for abstract leaves, for Python numbers (orbax restores them as the
  target's Python type, whose bytes may differ from the saved ones) and for
  arrays split over several processes, which no process holds whole. A
  replicated array of a multi-process run (a loss scale) is summed from this
  process's copy: every process computes the same sum.
  """
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if not x.is_fully_addressable:
      if not x.is_fully_replicated:
        return None
      x = x.addressable_data(0)
  elif not isinstance(x, (np.ndarray, np.generic)):
    return None
  data = np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
  return f"{zlib.crc32(data):08x}"


def _crc(data: Any) -> int:
  return zlib.crc32(np.ascontiguousarray(np.asarray(data)).reshape(-1).view(
      np.uint8))


def _split(x: Any) -> bool:
  """Whether `x` is split over processes (no process holds it whole)."""
  return (isinstance(x, jax.Array) and not x.is_fully_addressable
          and not x.is_fully_replicated)


def _shard_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> str:
  """A shard's place in its array, e.g. ``"0:256,0:512"``."""
  return ",".join(f"{s.start or 0}:{n if s.stop is None else s.stop}"
                  for s, n in zip(index, shape))


def _local_shards(x: jax.Array) -> dict[str, Any]:
  """``{shard key: data}`` of the shards this process holds."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return {_shard_key(s.index, x.shape): s.data for s in x.addressable_shards}


def _global_keys(x: jax.Array) -> list[str]:
  """The keys of all of `x`'s shards, in every process the same list."""
  return sorted({_shard_key(i, x.shape) for i in
                 x.sharding.devices_indices_map(x.shape).values()})


def _gather(local: np.ndarray) -> np.ndarray:
  """Every process's `local` (uint32), stacked: a collective."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return np.asarray(multihost_utils.process_allgather(local)).reshape(
      jax.process_count(), *local.shape)


def _shard_checksums(split: list[tuple[str, jax.Array]]
                     ) -> dict[str, dict[str, str]]:
  """``{path: {shard key: CRC-32}}`` of arrays split over processes.

  Each process sums the shards it holds; one gather gives every process
  the whole table (a replicated shard is summed by each holder; the copies
  are equal).
  """
  keys = [(name, _global_keys(x)) for name, x in split]
  local = np.zeros((2, sum(len(k) for _, k in keys)), np.uint32)
  col = 0
  for (_, ks), (_, x) in zip(keys, split):
    held = _local_shards(x)
    for k in ks:
      if k in held:
        local[:, col] = (_crc(held[k]), 1)
      col += 1
  everyone = _gather(local)
  table, col = {}, 0
  for name, ks in keys:
    table[name] = {}
    for k in ks:
      holders = np.flatnonzero(everyone[:, 1, col])
      table[name][k] = f"{int(everyone[holders[0], 0, col]):08x}"
      col += 1
  return table


def checksums(saveable: Any) -> dict[str, Any]:
  """The ``checksums`` table `save` stores.

  ``arrays``: a CRC-32 of each whole array. ``shards`` (multi-process runs):
  a CRC-32 of each shard of the arrays split over processes, by its place.
  """
  leaves = _compat.named_leaves(saveable)
  sums = {name: checksum(x) for name, x in leaves}
  table = {"algorithm": CHECKSUM,
           "arrays": {k: v for k, v in sums.items() if v is not None}}
  split = [(name, x) for name, x in leaves if _split(x)]
  if split:
    table["shards"] = _shard_checksums(split)
  return table


def _whole_mismatch(name: str, x: Any, shards: dict[str, str]
                    ) -> Optional[tuple[str, str, str]]:
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if not x.is_fully_addressable:  # replicated over processes
      x = x.addressable_data(0)
  value = np.asarray(x)
  for key, want in sorted(shards.items()):
    index = tuple(slice(*map(int, part.split(":"))) for part in key.split(","))
    got = f"{_crc(value[index]):08x}"
    if got != want:
      return f"{name} (shard [{key}])", want, got
  return None


def first_mismatch(meta: dict[str, Any], state: Any
                   ) -> Optional[tuple[str, str, str]]:
  """``(path, saved, read)`` of the first leaf of `state` that does not match
  its checksum in `meta`, or None.

  An array split over processes is checked shard by shard where the
  restored shards sit where the saved ones did; every process checks its
  own and all agree on the answer (a collective).

  Raises:
    ValueError: `meta` names an unknown checksum algorithm.
  """
  sums = meta.get("checksums")
  if sums is None:  # A jmp_amp.checkpoint/1 checkpoint.
    return None
  if sums.get("algorithm") != CHECKSUM:
    raise ValueError(f"unknown checksum algorithm {sums.get('algorithm')!r}")
  saved = sums["arrays"]
  shards = sums.get("shards", {})
  split = []
  for name, x in _compat.named_leaves(state):
    if _split(x):
      split.append((name, x))
      continue
    want = saved.get(name)
    got = None if want is None else checksum(x)
    if got is not None and got != want:
      return name, want, got
    if want is None and name in shards and checksum(x) is not None:
      # Saved split over processes, read whole: check each saved shard.
      bad = _whole_mismatch(name, x, shards[name])
      if bad:
        return bad
  if not split:
    return None
  # [leaf + 1, shard + 1, saved, read] of this process's first bad shard.
  bad = np.zeros(4, np.uint32)
  for i, (name, x) in enumerate(split):
    want, keys = shards.get(name, {}), _global_keys(x)
    for key, data in sorted(_local_shards(x).items()):
      if key in want and f"{_crc(data):08x}" != want[key]:
        bad[:] = (i + 1, keys.index(key) + 1, int(want[key], 16), _crc(data))
        break
    if bad[0]:
      break
  found = [b for b in _gather(bad) if b[0]]
  if not found:
    return None
  leaf, shard, want, got = (int(v) for v in found[0])
  name, x = split[leaf - 1]
  return (f"{name} (shard [{_global_keys(x)[shard - 1]}])", f"{want:08x}",
          f"{got:08x}")


def metadata_problem(meta: Any) -> Optional[str]:
  """What is wrong with a description read back (bytes flipped in a way that
  still parses), or None."""
  if not isinstance(meta, dict):
    return f"expected a JSON object, got {type(meta).__name__}"
  fmt = meta.get("format")
  if fmt not in _compat.READABLE_FORMATS:
    return f"unknown format {fmt!r}"
  leaves, scales = meta.get("leaves"), meta.get("loss_scales")
  recipes = meta.get("fp8_recipes", {} if fmt in _BEFORE_FP8 else None)
  if not all(isinstance(t, dict) for t in (leaves, scales, recipes)):
    return "no 'leaves' / 'loss_scales' / 'fp8_recipes' tables"
  for name, spec in leaves.items():
    if not (isinstance(spec, dict) and isinstance(spec.get("dtype"), str)
            and isinstance(spec.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in spec["shape"])):
      return f"bad leaf entry {name}: {spec!r}"
  for name, spec in scales.items():
    if not (isinstance(spec, dict) and isinstance(spec.get("type"), str)):
      return f"bad loss scale entry {name}: {spec!r}"
  for name, spec in recipes.items():
    if not isinstance(spec, dict):
      return f"bad FP8 recipe entry {name}: {spec!r}"
  types = meta.get("state_types", None if fmt == _compat.FORMAT else {})
  if not (isinstance(types, dict)
          and all(isinstance(v, str) for v in types.values())):
    return "no 'state_types' table"
  sums = meta.get("checksums")
  if sums is not None and not (
      isinstance(sums, dict) and isinstance(sums.get("arrays"), dict)
      and all(isinstance(v, str) for v in sums["arrays"].values())
      and isinstance(sums.get("shards", {}), dict)
      and all(isinstance(t, dict) and all(isinstance(v, str)
                                          for v in t.values())
              for t in sums.get("shards", {}).values())):
    return "bad 'checksums' table"
  if sums is None and fmt != _WITHOUT_CHECKSUMS:
    return "no 'checksums' table"
  return None


def damaged_file(step_dir: str, error: BaseException) -> Optional[str]:
  """The file under `step_dir` that `error` came from (relative), or None.

  Orbax has no API that names the file a failed read came from: tensorstore's
  message names it after the step directory; a JSON error names none, so the
  first of orbax's JSON files that does not parse is taken.
  """
  found = re.findall(re.escape(step_dir + os.sep) + r"[^\s\"']+", str(error))
  if found:
    return os.path.relpath(max(found, key=len), step_dir)
  for root, _, files in sorted(os.walk(step_dir)):
    for name in sorted(files):
      if name in _JSON_FILES or os.path.basename(root) == "array_metadatas":
        path = os.path.join(root, name)
        try:
          with open(path, "rb") as f:
            json.loads(f.read().decode("utf-8"))
        except (ValueError, OSError):
          return os.path.relpath(path, step_dir)
  return None


def missing_index(state_dir: str) -> Optional[str]:
  """``"manifest.ocdbt"`` if the OCDBT array data in `state_dir` lacks its
  index, else None.

  Checked before orbax reads: without the index every array's read fails at
  once, while TensorStore still completes the others' after orbax's event
  loop has closed, and each of those prints a "RuntimeError: Event loop is
  closed" traceback (one per array).
  """
  try:
    names = os.listdir(state_dir)
  except OSError:
    return None
  ocdbt = "d" in names or any(n.startswith("ocdbt.process_") for n in names)
  if ocdbt and "manifest.ocdbt" not in names:
    return "manifest.ocdbt"
  return None


def first_line(e: BaseException, limit: int = 200) -> str:
  text = (str(e).strip().splitlines() or [""])[0]
  return text if len(text) <= limit else text[:limit] + " ..."
