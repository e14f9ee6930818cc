"""benchmarks/gpu_check.py, the device check, in its small CPU mode."""

import importlib.util
import json

import pytest

import helpers

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _gpu_check():
  return helpers.benchmark("gpu_check")


def _run(tmp_path, *argv):
  out = tmp_path / "check.json"
  code = _gpu_check().main(["--small", "--repeats", "2", "--out", str(out),
                            *argv])
  return code, json.loads(out.read_text())


@pytest.mark.bench
def test_small_mlp_modes_are_compiled_timed_and_audited(tmp_path):
  # Without the torch rows, which run where torch is installed (an extra).
  code, result = _run(tmp_path, "--workloads", "mlp", "--modes", "float32",
                      "mixed_bfloat16", "float8-all", "--no-torch")
  assert code == 0, result
  assert result["small"] and "make_train_step" in result["compiler_options"]
  assert {r["workload"] for r in result["rows"]} == {"mlp"}
  rows = {r["mode"]: r for r in result["rows"]}
  assert sorted(rows) == ["float32", "float8-all", "mixed_bfloat16"]
  for name, row in rows.items():
    assert row["ms_per_step"] > 0 and row["compile_s"] > 0, row
    assert len(row["repeat_ms"]) == 2 and row["memory_bytes"] > 0, row
    assert row["gemm_stage"] == "compiled" and row["gemms"], row
    assert row["fp8_problem"] is None  # not judged on a CPU
    # FP8 steps compile as make_train_step's do: Triton GEMMs off.
    assert row["compiler_options"] == (
        {"xla_gpu_enable_triton_gemm": False} if name == "float8-all"
        else "XLA defaults"), row
  ratio = (rows["mixed_bfloat16"]["ms_per_step"]
           / rows["float8-all"]["ms_per_step"])
  assert result["summary"]["mlp float8-all speed vs mixed_bfloat16"] == (
      pytest.approx(ratio))
  # The losses of the three modes are close: one MLP, the same batches.
  losses = [r["final_loss"] for r in rows.values()]
  assert max(losses) - min(losses) < 0.05 * max(losses), losses


def test_summary_ratios_and_fp8_failures():
  rows = [dict(workload="gpt", mode="mixed_bfloat16", ms_per_step=30.0,
               compile_s=10.0),
          dict(workload="gpt", mode="float8", ms_per_step=25.0, compile_s=12.0,
               fp8_problem="attn: 1 of 3 ops not FP8"),
          dict(workload="gpt", mode="float8-rowwise", ms_per_step=30.0,
               compile_s=20.0),
          dict(workload="mlp", mode="mixed_bfloat16", error="RuntimeError: x")]
  got = _gpu_check().summary(rows)
  assert got["gpt float8 speed vs mixed_bfloat16"] == pytest.approx(1.2)
  assert got["gpt float8-rowwise speed vs mixed_bfloat16"] == pytest.approx(
      1.0)
  assert got["gpt compile s vs mixed_bfloat16"] == {
      "float8": pytest.approx(1.2), "float8-rowwise": pytest.approx(2.0)}
  assert got["mlp float8-all speed vs mixed_bfloat16"] is None  # never ran
  assert got["fp8 modes whose device GEMMs are not all FP8"] == ["gpt/float8"]


@pytest.mark.bench
def test_small_check_runs_every_mode_of_both_workloads(tmp_path):
  code, result = _run(tmp_path)
  assert code == 0, result
  check = _gpu_check()
  for workload in ("mlp", "gpt"):
    timed = {r["mode"] for r in result["rows"]
             if r["workload"] == workload and r.get("ms_per_step")}
    # torch's rows join where torch is installed (--small: the MLP's only).
    torch = {m for m in timed if m.startswith("torch")}
    assert timed - torch == set(check.modes_for(workload)), (workload, timed)
    assert torch == ({"torch-float32", "torch-autocast+scaler"}
                     if HAS_TORCH and workload == "mlp" else set()), torch


def test_processes_run_slow_compiles_last_and_isolate_every_mode():
  check = _gpu_check()
  plan = check.groups(["mlp", "gpt"], ["mixed_bfloat16", "float8-rowwise"])
  assert plan == [("mlp", ["mixed_bfloat16", "float8-rowwise"]),
                  ("gpt", ["mixed_bfloat16"]), ("gpt", ["float8-rowwise"])]
  plan = check.groups(["gpt"], ["float8", "mixed_bfloat16", "float8-rowwise"],
                      isolate=True)
  assert plan == [("gpt", ["float8"]), ("gpt", ["mixed_bfloat16"]),
                  ("gpt", ["float8-rowwise"])]
