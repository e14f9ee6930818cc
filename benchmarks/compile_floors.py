"""Compile-time floors of whole-step features that no option of the library
reaches: the same step compiled with the feature cut down by a patch.

Issue #33 holds telemetry and FP8 to 1.3x the bf16 step's compile time.
`compile_time.py` measures the pairs; this script measures how far down the
features' own work could bring them, by compiling the step with a copy of
`jmp_amp` that a patch in ``benchmarks/floors/`` cuts down:

* ``telemetry_max_only.patch``: each tensor's statistics are one max
  reduction (its largest finite ``|x|``), without the three counts;
* ``telemetry_no_reduction.patch``: no reduction at all (constant
  statistics), what the rest of telemetry costs: the hook, the tables, the
  outputs;
* ``fp8_no_amax.patch``: FP8 GEMMs with their quantize (divide, clamp,
  cast) but scale 1 and no amax;
* ``fp8_cast_only.patch``: FP8 GEMMs on plain casts.

The patches are measurements, not options: they change what the step
computes. Each compile runs in a process of its own, the variants
interleaved in rounds; the process imports the patched (or an unpatched)
copy of `jmp_amp`, and `compile_time.feature_compile_seconds` times it (CPU
seconds of trace, lower and compile; ``--target h100``: the compile-only
H100 target at XLA's default options, a compiler fact, not a GPU timing).
A test checks that every patch still applies to the tree.

Usage:
  python benchmarks/compile_floors.py --rounds 3 \\
      --json benchmarks/results/compile_time_floors_cpu.json
  JAX_PLATFORMS=cpu python benchmarks/compile_floors.py --target h100 \\
      --rounds 3 --json benchmarks/results/compile_time_floors_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PATCHES = os.path.join(HERE, "floors")

# name -> (the compile_time variant compiled, the patch; None: the library
# as it is). Every ratio is against the bf16 step.
FLOORS = {
    "bf16": ("bf16", None),
    "telemetry": ("telemetry", None),
    "telemetry, one max per tensor": ("telemetry", "telemetry_max_only.patch"),
    "telemetry, no reduction": ("telemetry", "telemetry_no_reduction.patch"),
    "fp8 current": ("fp8 current", None),
    "fp8 current, no amax": ("fp8 current", "fp8_no_amax.patch"),
    "fp8 current, cast only": ("fp8 current", "fp8_cast_only.patch"),
}
BASELINE = "bf16"


def patched_copy(patch, into):
  """A copy of the repository's `jmp_amp` (its models in place, as the
  package installs them) under `into`, with `patch` applied (None: as it
  is). Returns the directory a process runs in to import the copy."""
  shutil.copytree(os.path.join(ROOT, "jmp_amp"), os.path.join(into, "jmp_amp"),
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copytree(os.path.join(ROOT, "models"),
                  os.path.join(into, "jmp_amp", "models"),
                  ignore=shutil.ignore_patterns("__pycache__"))
  if patch is not None:
    subprocess.run(["git", "apply", os.path.join(PATCHES, patch)], cwd=into,
                   check=True)
  return into


def compile_seconds(path, variant, target, scan_layers, timeout=900):
  """CPU seconds of `variant`'s step compiled in a fresh process that imports
  `jmp_amp` from `path`."""
  code = ("import json, sys; sys.path.insert(1, sys.argv[1]); "
          "import compile_time, jmp_amp; print(jmp_amp.__file__); "
          "print(json.dumps(compile_time.feature_compile_seconds("
          "sys.argv[2], sys.argv[3], scan_layers=sys.argv[4] == '1')))")
  # Run in `path`: the process imports its copy, not the installed one.
  out = subprocess.run(
      [sys.executable, "-c", code, HERE, variant, target,
       "1" if scan_layers else "0"],
      cwd=path, capture_output=True, text=True, timeout=timeout, check=True)
  where, seconds = out.stdout.strip().splitlines()[-2:]
  if not where.startswith(os.path.join(path, "")):
    raise RuntimeError(f"the process imported {where}, not {path}'s copy")
  return float(seconds)


def run(rounds, target="cpu", scan_layers=False, names=None):
  """Each of `names` (default: every entry of `FLOORS`) compiled `rounds`
  times, interleaved; the seconds, and the ratios of the best to bf16's."""
  names = list(names or FLOORS)
  seconds = {name: [] for name in names}
  with tempfile.TemporaryDirectory() as tmp:
    paths = {patch: patched_copy(patch, os.path.join(tmp, patch or "main"))
             for patch in {FLOORS[n][1] for n in names}}
    for r in range(rounds):
      for name in names[r % len(names):] + names[:r % len(names)]:
        variant, patch = FLOORS[name]
        seconds[name].append(compile_seconds(paths[patch], variant, target,
                                             scan_layers))
        print(f"  {name:32s} {seconds[name][-1]:6.2f} s", flush=True)
  best = {name: min(t) for name, t in seconds.items()}
  results = {name: {"seconds_best": best[name], "seconds_all": t,
                    "patch": FLOORS[name][1]}
             for name, t in seconds.items()}
  ratios = {name: b / best[BASELINE] for name, b in best.items()
            if BASELINE in best and name != BASELINE}
  for name, ratio in ratios.items():
    print(f"{name:32s} {ratio:5.2f}x {BASELINE}", flush=True)
  return {"rounds": rounds, "results": results,
          "ratios_vs_bf16": ratios}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", choices=["cpu", "h100"], default="cpu")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--scan-layers", action="store_true",
                 help="the GPT's blocks stacked under nnx.scan")
  p.add_argument("--floors", nargs="+", choices=list(FLOORS), default=None,
                 help="compile only these (bf16 among them for the ratios)")
  p.add_argument("--json", default=None)
  a = p.parse_args(argv)
  if a.rounds < 1:
    p.error(f"--rounds must be at least 1, got {a.rounds}")
  import compile_time  # pylint: disable=import-outside-toplevel  # beside this
  report = run(a.rounds, a.target, a.scan_layers, a.floors)
  target = compile_time.TARGETS[a.target]
  report = {
      "env": compile_time.overhead.environment(target),
      "target": target,
      "step": ("GPT train step (compile_time.FEATURE_GPT), 16 blocks "
               + ("stacked under nnx.scan" if a.scan_layers else "unrolled")),
      "method": ("CPU seconds of trace, lower and compile "
                 "(compile_time.feature_compile_seconds), each in a fresh "
                 "process importing a copy of jmp_amp with the variant's "
                 "patch from benchmarks/floors/ applied (none: as it is), "
                 "interleaved in rounds; ratio of the best times"),
      **report}
  if a.json:
    with open(a.json, "w") as f:
      json.dump(report, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
  sys.path.insert(0, HERE)
  main()
