"""The committed H100 figures come from XLA's default options.

Every file of benchmarks/results/ made through the compile-only H100 target
(`jmp_amp.tools.gpu_target`) records the compiler options it was compiled
with. The committed ones must be XLA's default options, as a GPU compiles
unless told otherwise; figures with Triton GEMMs off (``--gemm cublas``) go to
files of their own and say so.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from jmp_amp.tools import gpu_target

RESULTS = (pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
           / "results")
DEFAULT = gpu_target.label("h100", "default")


def _load(name):
  return json.loads((RESULTS / name).read_text())


# file -> where its record of the options is: (label, gemm field) getters.
LABELLED = {
    "h100_compiled.json": lambda d: (d["label"], d["gemm"]),
    "fp8_h100.json": lambda d: (d["label"], d["gemm"]),
    "gpt_memory_h100.json": lambda d: (d["label"], d["gemm"]),
    "numerics_bytes_h100.json": lambda d: (d["label"], d["gemm"]),
    "low_precision.json": lambda d: (d["memory"]["label"],
                                     d["memory"]["gemm"]),
    "overhead_h100.json": lambda d: (d["env"]["target"], d["env"]["gemm"]),
    **{name: lambda d: (d["env"]["target"], d["env"]["gemm"])
       for name in ("compile_time_h100.json", "compile_time_features_h100.json",
                    "compile_time_scanned_features_h100.json",
                    "compile_time_loss_floor_h100.json",
                    "compile_time_floors_h100.json")},
}


@pytest.mark.parametrize("name", sorted(LABELLED))
def test_committed_h100_results_use_xla_default_options(name):
  label, gemm = LABELLED[name](_load(name))
  assert gemm == "default", (name, gemm)
  assert gpu_target.GEMM_BACKENDS[gemm] == {}
  assert "XLA's default options" in label, (name, label)
  assert "xla_gpu_enable_triton_gemm" not in label, (name, label)


def test_h100_compiled_label_is_the_targets():
  assert _load("h100_compiled.json")["label"] == DEFAULT
  assert _load("gpt_memory_h100.json")["label"] == DEFAULT
  assert _load("numerics_bytes_h100.json")["label"] == DEFAULT


def test_cublas_figures_say_so():
  """Files made with Triton GEMMs off, if any are committed, are labelled."""
  for path in RESULTS.glob("*_cublas.json"):
    data = json.loads(path.read_text())
    assert data["gemm"] == "cublas", path.name
    assert data["label"] == gpu_target.label("h100", "cublas"), path.name


def _variants(data):
  workloads = data.get("workloads", [data])
  return [name for w in workloads for name in w.get("results", {})]


@pytest.mark.parametrize("name", sorted(
    p.name for p in RESULTS.glob("compile_time*_h100.json")))
def test_fp8_variants_say_which_options_they_compiled_with(name):
  """FP8 steps compile as make_train_step compiles them, with
  `jmp_amp.fp8.compiler_options()` for a CUDA GPU: a file with FP8
  variants records those options and says so in its label."""
  data = _load(name)
  env = data["env"]
  if not any(v.startswith("fp8") for v in _variants(data)):
    assert "fp8_gemm_options" not in env, name
    return
  assert env["fp8_gemm_options"] == {"xla_gpu_enable_triton_gemm": False}
  assert "FP8 variants with Triton GEMMs off" in env["target"], name
