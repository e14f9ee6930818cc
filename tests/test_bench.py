"""Tests for the `jmp-amp bench` CLI (tiny sizes)."""

import json
import subprocess
import sys

import pytest

from jmp_amp import bench

TINY = ["--width", "32", "--layers", "3", "--batch-size", "8", "--batches",
        "2", "--epochs", "2", "--warmup", "1", "--no-progress"]

RUN_KEYS = {
    "schema", "mode", "framework", "status", "config", "device", "platform",
    "device_count",
    "versions", "compile_s", "median_step_s", "total_s", "steps_per_s",
    "samples_per_s", "peak_memory_bytes", "memory_source", "compiled_memory",
    "final_loss", "skipped_steps", "loss_scale", "matmuls", "tflops",
    "speedup_vs_float32", "memory_ratio_vs_float32",
    "compiled_temp_ratio_vs_float32",
}


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  path = out / "runs.jsonl"
  plot_path = out / "plot.png"
  hlo_dir = out / "hlo"
  code = bench.main(["bench", *TINY, "--json", str(path), "--plot",
                     str(plot_path), "--hlo-dir", str(hlo_dir)])
  runs = [json.loads(line) for line in path.read_text().splitlines()]
  return code, runs, plot_path, hlo_dir


def test_every_default_mode_runs_with_stable_schema(tiny_runs):
  code, runs, plot_path, hlo_dir = tiny_runs
  assert code == 0
  assert [r["mode"] for r in runs] == list(bench.DEFAULT_MODES)
  for r in runs:
    assert r["status"] == "ok", r.get("error")
    assert set(r) == RUN_KEYS, set(r) ^ RUN_KEYS
    assert r["schema"] == bench.SCHEMA
    assert r["versions"]["jax"] and r["device"]
    assert r["median_step_s"] > 0 and r["compile_s"] > 0
  assert plot_path.stat().st_size > 1000
  assert len(list(hlo_dir.iterdir())) == len(bench.DEFAULT_MODES)


def test_half_modes_have_all_dots_in_half_and_fp16_stays_finite(tiny_runs):
  _, runs, _, _ = tiny_runs
  by_mode = {r["mode"]: r for r in runs}
  for mode, half in (("bf16", "bf16"), ("fp16", "f16"), ("fp16-noscale", "f16")):
    inputs = by_mode[mode]["matmuls"]["input_dtypes"]
    assert inputs == [half], (mode, by_mode[mode]["matmuls"])
  assert by_mode["float32"]["matmuls"]["input_dtypes"] == ["f32"]
  fp16 = by_mode["fp16"]
  assert fp16["final_loss"] == pytest.approx(fp16["final_loss"])  # not NaN
  assert fp16["loss_scale"] >= 1.0
  # On CPU the compiled memory ratio is recorded for every mode.
  assert by_mode["bf16"]["compiled_temp_ratio_vs_float32"] is not None
  assert by_mode["float32"]["speedup_vs_float32"] == pytest.approx(1.0)


def test_compare_torch_adds_three_rows(tmp_path):
  pytest.importorskip("torch")
  path = tmp_path / "t.jsonl"
  assert bench.main([*TINY, "--policy", "bf16", "--compare-torch", "--json",
                     str(path)]) == 0
  runs = [json.loads(line) for line in path.read_text().splitlines()]
  assert [r["mode"] for r in runs] == ["bf16", *bench.TORCH_MODES]
  assert all(set(r) == RUN_KEYS for r in runs)
  assert {r["framework"] for r in runs} == {"jax", "torch"}
  assert runs[1]["speedup_vs_float32"] == pytest.approx(1.0)


@pytest.mark.parametrize("flags, message", [
    (["--policy", "fp8"], "invalid choice: 'fp8'"),
    (["--width", "0"], "expected a positive integer, got 0"),
    (["--batch-size", "x"], "expected a positive integer, got 'x'"),
    (["--model", "vgg"], "invalid choice: 'vgg'"),
    (["--steps", "2", "--warmup", "2"], "must be smaller than the number of steps"),
    (["--lr", "-1"], "expected a positive number"),
    (["--model", "gpt", "--compare-torch"], "--model mlp only"),
])
def test_bad_flags_give_argparse_errors(flags, message, capsys):
  with pytest.raises(SystemExit) as info:
    bench.main(flags)
  assert info.value.code == 2
  assert message in capsys.readouterr().err


def test_failing_mode_is_reported_and_others_still_run(monkeypatch, tmp_path):
  original = bench.BUILDERS["mlp"]

  def flaky(mode, cfg):
    if mode is bench.JAX_MODES["bf16"]:
      raise MemoryError("RESOURCE_EXHAUSTED: out of memory (simulated)")
    return original(mode, cfg)

  monkeypatch.setitem(bench.BUILDERS, "mlp", flaky)
  path = tmp_path / "f.jsonl"
  code = bench.main([*TINY, "--policy", "float32", "--policy", "bf16",
                     "--policy", "fp16", "--json", str(path)])
  runs = [json.loads(line) for line in path.read_text().splitlines()]
  assert code == 1
  assert [r["status"] for r in runs] == ["ok", "failed", "ok"]
  assert "out of memory" in runs[1]["error"]


def test_module_entry_point_runs():
  result = subprocess.run(
      [sys.executable, "-m", "jmp_amp.bench", *TINY, "--policy", "bf16"],
      capture_output=True, text=True, check=False, timeout=300)
  assert result.returncode == 0, result.stderr
  assert "bf16" in result.stdout and "step ms" in result.stdout
