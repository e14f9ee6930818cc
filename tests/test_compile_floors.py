"""benchmarks/compile_floors.py: its patches still apply to the tree, and
each cuts down what it says it does (issue #33's floors)."""

import os
import pathlib
import subprocess
import sys

import pytest

import helpers

# A tensor's statistics (1e-6 underflows float16; XLA:CPU flushes float32
# subnormals, so these are measured against float16).
STATS = ("from jmp_amp._src import tensor_stats as t; import jax.numpy as jnp; "
         "s = t.tensor_stats(jnp.array([0.0, 1e-6, 3.0, jnp.inf]), "
         "jnp.float16); print(float(s['max_abs']), float(s['zeros']), "
         "float(s['nonfinite']))")
# patch -> (code run against the patched copy, what it prints there, what
# it prints against the library as it is).
CHECKS = {
    "telemetry_max_only.patch": (STATS, "3.0 0.0 0.0", "3.0 0.25 1.0"),
    "telemetry_no_reduction.patch": (STATS, "0.0 0.0 0.0", "3.0 0.25 1.0"),
    "fp8_no_amax.patch": (
        "from jmp_amp._src import fp8; import jax.numpy as jnp; "
        "s, h = fp8.scale_of(jnp.array([896.0]), jnp.array([7.0]), "
        "jnp.float8_e4m3fn, fp8.FP8Recipe()); print(float(s), float(h[0]))",
        "1.0 7.0", "2.0 896.0"),
    "fp8_cast_only.patch": (
        "from jmp_amp._src import fp8; import jax.numpy as jnp; "
        "q = fp8.quantize(jnp.array([1000.0]), jnp.float8_e4m3fn, 1.0); "
        "print(float(q.astype(jnp.float32)[0]))",
        "nan", "448.0"),
}


@pytest.fixture(scope="module")
def script():
  return helpers.benchmark("compile_floors")


def test_every_patch_is_a_floor_and_every_floor_has_its_patch(script):
  on_disk = {p.name for p in pathlib.Path(script.PATCHES).glob("*.patch")}
  named = {patch for _, patch in script.FLOORS.values() if patch}
  assert on_disk == named == set(CHECKS)
  assert script.BASELINE in script.FLOORS


def _run(path, code):
  # In `path` (as the script runs them): the process imports its copy.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=path,
                       check=True, capture_output=True, text=True,
                       timeout=300)
  return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("patch", sorted(CHECKS))
def test_a_patch_applies_to_the_tree_and_cuts_what_it_says(script, patch,
                                                           tmp_path):
  # git apply fails on a patch that no longer matches the library.
  patched = script.patched_copy(patch, tmp_path / "patched")
  code, floor, whole = CHECKS[patch]
  assert _run(patched, code) == floor
  assert _run(script.patched_copy(None, tmp_path / "main"), code) == whole
