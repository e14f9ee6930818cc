"""benchmarks/gpt_bench.py: the GPT pieces of the device check, at CPU size."""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import gpt_bench  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_model_flops_reproduce_the_issues_figures():
  # d 2048, 4 blocks: 4 * 50.35M block params + the 32768 x 2048 tied table.
  d, v, layers = 2048, 32768, 4
  block = (d * 3 * d + 3 * d) + (d * d + d) + 2 * (d * 4 * d) + 5 * d + 4 * d
  assert gpt_bench.matmul_params("gpu") == layers * block + v * d + 2 * d
  tokens = 8 * 1024
  want = tokens * (6 * gpt_bench.matmul_params("gpu") + 12 * 4 * d * 1024)
  assert gpt_bench.model_flops_per_step("gpu") == want == 14_024_209_072_128
  # Issue #34, on an H200: 30.1 ms a step is 466 TFLOP/s, 47 % of the peak.
  assert round(want / 30.1e-3 / 1e12) == 466
  share = gpt_bench.peak_share(30.1, "gpu", "NVIDIA H200")
  assert round(100 * share) == 47


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H200", 989.4e12),
    ("NVIDIA H100 PCIe", 756.5e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("cpu", None), ("TFRT_CPU_0", None)])
def test_peak_table(kind, peak):
  assert gpt_bench.peak_bf16_flops(kind) == peak


def test_bad_size_and_mode_name_the_choices():
  with pytest.raises(ValueError, match=r"size must be one of \['cpu', 'gpu'\], "
                     "got 'tpu'"):
    gpt_bench.model_flops_per_step("tpu")
  with pytest.raises(ValueError, match=r"mode must be one of \['float32', "
                     r".*got 'bf32'"):
    gpt_bench.build_step("bf32", "cpu")


@pytest.mark.bench
def test_cpu_step_trains_and_times():
  row = gpt_bench.time_jax("mixed_bfloat16", "cpu", steps=2, warmup=1)
  assert row["name"] == "jax mixed_bfloat16" and row["ms_per_step"] > 0
  # Fresh weights: about log(vocab) on random tokens.
  assert abs(row["loss"] - math.log(256)) < 0.3
  assert row["model_flops_per_step"] == gpt_bench.model_flops_per_step("cpu")
  assert row["peak_share"] is None  # no bf16 peak for a CPU
  assert row["peak_bytes"] is None  # XLA:CPU keeps no peak counter


def test_torch_rows_without_torch_say_why(monkeypatch):
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch fails
  rows, why = gpt_bench.torch_rows("cpu")
  assert rows == [] and why.startswith("torch is not importable")


@pytest.mark.bench
def test_torch_gpt_is_the_same_model_and_runs_eager_on_cpu():
  pytest.importorskip("torch")
  assert gpt_bench.torch_param_count("cpu") == gpt_bench.matmul_params("cpu")
  assert gpt_bench.torch_param_count("gpu") == gpt_bench.matmul_params("gpu")
  rows, why = gpt_bench.torch_rows("cpu", ["torch-eager-sdpa"], steps=2,
                                   warmup=1)
  assert why is None and [r["mode"] for r in rows] == ["torch-eager-sdpa"]
  assert rows[0]["ms_per_step"] > 0 and np.isfinite(rows[0]["loss"])
  assert abs(rows[0]["loss"] - math.log(256)) < 0.3
  with pytest.raises(ValueError, match="torch modes are"):
    gpt_bench.torch_rows("cpu", ["torch-jit"])
