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


@pytest.fixture(scope="module")
def every_mode(tmp_path_factory):
  """One --small run of every mode of the default workloads (mlp, gpt), the
  torch rows where torch is installed: a process per workload (on a GPU,
  gpt's SLOW_COMPILE mode gets one of its own).
  """
  return _run(tmp_path_factory.mktemp("every_mode"))


@pytest.mark.bench
def test_small_mlp_modes_are_compiled_timed_and_audited(every_mode):
  code, result = every_mode
  assert code == 0, result
  assert result["small"] and "make_train_step" in result["compiler_options"]
  rows = {r["mode"]: r for r in result["rows"] if r["workload"] == "mlp"
          and r["mode"] in ("float32", "mixed_bfloat16", "float8-all")}
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
def test_small_check_runs_every_mode_of_both_workloads(every_mode):
  code, result = every_mode
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
  # --small (a CPU): a process per workload, the slow compile last in it.
  assert check.groups(["mlp", "gpt"], ["float8-rowwise", "mixed_bfloat16"],
                      small=True) == [
                          ("mlp", ["float8-rowwise", "mixed_bfloat16"]),
                          ("gpt", ["mixed_bfloat16", "float8-rowwise"])]
  assert check.groups(["gpt"], ["float8", "float8-rowwise"], isolate=True,
                      small=True) == [("gpt", ["float8"]),
                                      ("gpt", ["float8-rowwise"])]


# --------------------------------------------------------------------------
# The llama workload (issue #53).


def test_llama_runs_its_modes_each_in_a_process_of_its_own():
  check = _gpu_check()
  assert check.modes_for("llama") == [
      "float32", "mixed_bfloat16", "float8", "float8-rowwise",
      "mixed_bfloat16-state16", "mixed_bfloat16-telemetry"]
  plan = check.groups(["gpt", "llama"], ["mixed_bfloat16", "float8",
                                         "mixed_float16"])
  assert plan == [("gpt", ["mixed_bfloat16", "float8", "mixed_float16"]),
                  ("llama", ["mixed_bfloat16"]), ("llama", ["float8"])]
  # --small: llama's tiny modes share one process.
  assert check.groups(["llama"], ["float8", "mixed_bfloat16"],
                      small=True) == [("llama", ["float8", "mixed_bfloat16"])]


def test_llama_flops_and_largest_batch():
  llama_bench = helpers.benchmark("llama_bench")
  # The 1b preset: every parameter but the 32000 x 2048 embedding table.
  assert llama_bench.matmul_params("gpu") == 1_123_117_056 - 32000 * 2048
  want = 8 * 2048 * (6 * llama_bench.matmul_params("gpu")
                     + 12 * 22 * 2048 * 2048)
  assert llama_bench.model_flops_per_step("gpu") == want
  assert llama_bench.model_flops_per_step("gpu", 16) == 2 * want
  tried = []
  fits = lambda b: tried.append(b) or b <= 40
  assert llama_bench.largest_batch(fits, 8, 256) == 32
  assert tried == [8, 16, 32, 64]  # stops at the first that does not fit
  assert llama_bench.largest_batch(lambda b: True, 8, 16) == 16
  assert llama_bench.largest_batch(lambda b: False, 8, 16) is None


def test_llama_summary_gives_the_issues_ratios():
  rows = [dict(workload="llama", mode="mixed_bfloat16", ms_per_step=300.0,
               bf16_peak_share=0.5, peak_bytes=40e9, largest_batch=16),
          dict(workload="llama", mode="float8", ms_per_step=250.0,
               peak_bytes=36e9, largest_batch=16),
          dict(workload="llama", mode="mixed_bfloat16-state16",
               ms_per_step=300.0, largest_batch=32),
          dict(workload="llama", mode="torch-compile-bf16", ms_per_step=330.0,
               peak_bytes=50e9),
          dict(workload="llama", mode="torchao-float8-tensorwise",
               ms_per_step=250.0, peak_bytes=30e9)]
  got = _gpu_check().summary(rows)
  assert got["llama mixed_bfloat16 share of the dense bf16 peak"] == 0.5
  assert got["llama float8 speed vs mixed_bfloat16"] == pytest.approx(1.2)
  assert got["llama largest batch state16 vs mixed_bfloat16"] == 2.0
  assert got["llama mixed_bfloat16 speed vs torch-compile-bf16"] == (
      pytest.approx(1.1))
  assert got["llama float8 peak memory vs torchao-float8-tensorwise"] == (
      pytest.approx(1.2))
  assert got["llama float8-rowwise speed vs torchao-float8-rowwise"] is None


# Every llama mode runs once; --small puts a run's modes in one process.
# The largest-batch search (one more compile: --small caps the batch at 4)
# in one mode only: it runs alone, with --memory-limit, and the other five
# modes in a second process.
LIMIT = 10 * 2**20  # the bytes a step may take in the search
SEARCHED = "mixed_bfloat16-state16"  # its point: a larger batch


@pytest.fixture(scope="module")
def llama_rows(tmp_path_factory):
  rows, codes = {}, []
  for modes, flags in (
      ([SEARCHED], ["--memory-limit", str(LIMIT)]),
      ([m for m in _gpu_check().LLAMA_MODES if m != SEARCHED], [])):
    code, result = _run(tmp_path_factory.mktemp("llama"), "--workloads",
                        "llama", "--no-torch", "--modes", *modes, *flags)
    codes.append(code)
    rows.update({r["mode"]: r for r in result["rows"]
                 if r["workload"] == "llama"})
  return codes, rows


@pytest.mark.bench
def test_small_llama_modes_are_timed_and_their_largest_batch_found(
    llama_rows):
  codes, rows = llama_rows
  assert codes == [0, 0], rows
  assert sorted(rows) == sorted(_gpu_check().LLAMA_MODES)
  for row in rows.values():
    assert row["ms_per_step"] > 0 and row["compile_s"] > 0, row
    assert row["model_tflops"] > 0 and row["memory_bytes"] > 0, row
  # Batches 2 (the timed step's compile) and 4 (the cap: 4 fits, 8 is not
  # tried); memory grows with the batch.
  row = rows[SEARCHED]
  used = row["memory_bytes_by_batch"]
  assert sorted(used, key=int) == ["2", "4"], row
  assert row["largest_batch_cap"] == 4 and used["4"] <= LIMIT, row
  assert used["2"] == row["memory_bytes"] and used["2"] < used["4"], row
  assert row["largest_batch"] == max(
      int(b) for b, n in used.items() if n <= LIMIT), row
  # A CPU has no memory limit: without --memory-limit, no search.
  for name, row in rows.items():
    if name != SEARCHED:
      assert row["largest_batch"] is None and not row[
          "memory_bytes_by_batch"], row
  losses = [rows[m]["final_loss"] for m in (
      "float32", "mixed_bfloat16", SEARCHED, "mixed_bfloat16-telemetry")]
  assert max(losses) - min(losses) < 0.05 * max(losses), losses


@pytest.mark.bench
def test_small_llama_fp8_modes_run_with_their_default_rules(llama_rows):
  _, rows = llama_rows
  for name in ("float8", "float8-rowwise"):
    assert rows[name].get("ms_per_step"), rows[name]
    assert rows[name]["compiler_options"] == {
        "xla_gpu_enable_triton_gemm": False}, rows[name]
