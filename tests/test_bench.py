"""Tests for the `jmp-amp bench` CLI (tiny sizes)."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jmp_amp
from jmp_amp.tools import gpu_target
from jmp_amp.tools.bench import cli
from jmp_amp.tools.bench import gpu
from jmp_amp.tools.bench import table
from jmp_amp.tools.bench import timing
from jmp_amp.tools.bench import workloads

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--width", "32", "--layers", "3", "--batch-size", "8", "--batches",
        "2", "--epochs", "2", "--warmup", "1", "--no-progress"]

RUN_KEYS = {
    "schema", "mode", "framework", "status", "config", "device", "platform",
    "device_count", "isolated", "baseline",
    "versions", "compile_s", "median_step_s", "repeat_median_step_s",
    "step_spread", "total_s", "steps_per_s",
    "samples_per_s", "peak_memory_bytes", "memory_source", "compiled_memory",
    "final_loss", "skipped_steps", "loss_scale", "matmuls", "tflops",
    "speedup_vs_float32", "memory_ratio_vs_float32",
    "compiled_temp_ratio_vs_float32",
}


def _read(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def _env(**extra):
  env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
  env.pop("COLUMNS", None)
  env.update(extra)
  return env


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  path = out / "runs.jsonl"
  plot_path = out / "plot.png"
  hlo_dir = out / "hlo"
  code = cli.main(["bench", *TINY, "--repeats", "2", "--json", str(path),
                     "--plot", str(plot_path), "--hlo-dir", str(hlo_dir)])
  return code, _read(path), plot_path, hlo_dir


@pytest.mark.bench
def test_every_default_mode_runs_with_stable_schema(tiny_runs):
  code, runs, plot_path, hlo_dir = tiny_runs
  assert code == 0
  assert [r["mode"] for r in runs] == list(workloads.DEFAULT_MODES)
  for r in runs:
    assert r["status"] == "ok", r.get("error")
    assert set(r) == RUN_KEYS, set(r) ^ RUN_KEYS
    assert r["schema"] == cli.SCHEMA
    assert r["versions"]["jax"] and r["device"]
    assert r["median_step_s"] > 0 and r["compile_s"] > 0
    assert len(r["repeat_median_step_s"]) == 2
    assert r["step_spread"] >= 0
    assert r["baseline"] == "float32"
    assert r["isolated"] is False  # the CPU reports no device peak
  assert plot_path.stat().st_size > 1000
  assert len(list(hlo_dir.iterdir())) == len(workloads.DEFAULT_MODES)


@pytest.mark.bench
def test_half_modes_have_all_dots_in_half_and_fp16_stays_finite(tiny_runs):
  _, runs, _, _ = tiny_runs
  by_mode = {r["mode"]: r for r in runs}
  for mode, half in (("mixed_bfloat16", "bf16"), ("mixed_float16", "f16"),
                     ("mixed_float16-noscale", "f16")):
    inputs = by_mode[mode]["matmuls"]["input_dtypes"]
    assert inputs == [half], (mode, by_mode[mode]["matmuls"])
  assert by_mode["float32"]["matmuls"]["input_dtypes"] == ["f32"]
  fp16 = by_mode["mixed_float16"]
  assert fp16["final_loss"] == pytest.approx(fp16["final_loss"])  # not NaN
  assert fp16["loss_scale"] >= 1.0
  assert by_mode["mixed_bfloat16"]["loss_scale"] is None  # no loss scaling
  # On CPU the compiled memory ratio is recorded for every mode.
  assert (by_mode["mixed_bfloat16"]["compiled_temp_ratio_vs_float32"]
          is not None)
  assert by_mode["float32"]["speedup_vs_float32"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", list(workloads.JAX_MODES))
def test_a_mode_is_named_after_its_policy(name):
  # "autocast-" + the policy + "-noscale" (a float16 mode without loss
  # scaling) or "-highest" (float32 matmul precision): nothing else.
  mode = workloads.JAX_MODES[name]
  policy = mode.get("policy") or mode["autocast"]
  float16 = policy != "float8" and (
      jmp_amp.get_policy(policy).compute_dtype == jnp.float16)
  assert mode.get("scale") in (None, "dynamic"), name
  assert (mode.get("scale") == "dynamic") == (
      float16 and not name.endswith("-noscale")), name
  assert name == ("autocast-" if "autocast" in mode else "") + policy + (
      "-noscale" if float16 and mode.get("scale") is None else "") + (
          "-" + mode["precision"] if mode.get("precision") else "")


@pytest.mark.parametrize("rules, autocast", [
    ("float8", None),
    pytest.param("mixed_bfloat16", None, marks=pytest.mark.bench),
    pytest.param(None, "float8", marks=pytest.mark.bench)])
def test_bench_steps_compile_with_make_train_steps_options(rules, autocast):
  # The bench jits its steps itself: with the XLA options make_train_step's
  # own jax.jit gets for the same model (FP8: Triton GEMMs off).
  from unittest import mock  # pylint: disable=g-import-not-at-top

  from flax import nnx  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from jmp_amp import models  # pylint: disable=g-import-not-at-top
  from jmp_amp._src import fp8_compile  # pylint: disable=g-import-not-at-top
  import jmp_amp.flax  # pylint: disable=g-import-not-at-top
  model = models.MLP(8, 2, num_layers=3, width=16, rngs=nnx.Rngs(0))
  if rules is not None:
    jmp_amp.flax.set_policies(model, rules)
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.1), jmp_amp.NoOpLossScale()), wrt=nnx.Param)
  # Compiled for CUDA as far as the options go (XLA:CPU ignores them).
  with mock.patch.object(fp8_compile, "_platform", return_value="cuda"), \
       mock.patch.object(jax, "jit", wraps=jax.jit) as spy:
    step = jmp_amp.flax.make_train_step(
        lambda m, b: models.mse_loss(m(b[0]), b[1]), autocast=autocast)
    step(model, opt, (jnp.ones((4, 8)), jnp.zeros((4, 2))))
  options = [c.kwargs["compiler_options"] for c in spy.call_args_list
             if "compiler_options" in c.kwargs]
  # The step that runs is the last one jitted.
  assert options[-1] == workloads.step_compiler_options(
      model, autocast, platform="cuda")
  assert (options[-1] is not None) == ("float8" in (rules, autocast))


def _report(runs, width):
  cfg = workloads.Config(**runs[0]["config"])
  env = {k: runs[0][k] for k in ("device", "platform")}
  return table.format_report(runs, env, cfg, width=width)


@pytest.mark.bench
def test_report_fits_80_columns_with_legend_verdict_and_cpu_note(tiny_runs):
  _, runs, _, _ = tiny_runs
  text = _report(runs, 80)
  lines = text.splitlines()
  assert max(len(line) for line in lines) <= 80, text
  header = lines[1].split()
  assert header[:2] == ["mode", "step"] and "speed-up" in header, text
  for mode in workloads.DEFAULT_MODES:  # every row, and every row's matmuls
    assert any(line.startswith(mode + " ") for line in lines), mode
    assert any(line.startswith(f"  {mode}: ") for line in lines), mode
  flat = " ".join(text.split())
  assert "speed-up: the float32 row's step time / this row's" in flat
  assert "memory: this row's peak memory / the float32 row's" in flat
  assert "Not shown at this width:" in text
  verdicts = [line for line in lines if line.startswith("Verdict: ")]
  assert len(verdicts) == 1, text
  assert re.match(r"Verdict: (fastest JAX mode|no JAX mode is faster)",
                  verdicts[0]), text
  assert "half precision is not expected to be faster here" in " ".join(
      text.split())


@pytest.mark.bench
def test_wide_terminal_shows_every_column(tiny_runs):
  _, runs, _, _ = tiny_runs
  wide = _report(runs, 250)
  assert wide.splitlines()[1].split("  ")[0] == "mode"
  for column in table.COLUMNS:
    assert column in wide.splitlines()[1], column
  assert "Not shown at this width" not in wide
  assert "f32 x f32 -> f32" in wide.splitlines()[3]  # in the float32 row


def _first_progress_line(stream):
  """The first line of the bench's own progress (JAX may log before it)."""
  for line in stream:
    if line.startswith("jmp-amp bench: "):
      return line
  return ""


def _run_piped(argv, cwd, expected, env):
  """Runs the bench module with stdout and stderr piped, as CI or ``| tee``
  do; checks that the first progress line arrives while it runs and that
  each of `expected` is a progress line on stderr, never on stdout.
  Returns stdout."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "jmp_amp.tools.bench", *argv],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
      env=env)
  try:
    first = _first_progress_line(proc.stderr)
    running = proc.poll() is None
    out, rest = proc.communicate(timeout=300)
  finally:
    proc.kill()
  assert proc.returncode == 0, rest
  assert first == "jmp-amp bench: compiling float32 (1/2)\n", first + rest
  assert running, "the first progress line came only at the end"
  progress = [line for line in rest.splitlines()
              if line.startswith("jmp-amp bench: ")]
  for text in expected:
    assert any(line.startswith("jmp-amp bench: " + text)
               for line in progress), (text, progress)
  assert "jmp-amp bench:" not in out  # stdout holds only the report
  return out


@pytest.mark.bench
def test_module_entry_point_in_a_pipe_fits_80_columns_with_progress(tmp_path):
  # In .ci/run's bench step (#48; #35 had it in the default run): the CLI
  # as a user pipes it (`| tee`, CI), at 80 columns: progress on stderr
  # while it runs, one line per mode as it starts and ends, only the report
  # on stdout. The GPT workload: its one run through the CLI.
  # From a directory holding its own models.py: the bench must use
  # jmp_amp.models, never a top-level `models` found in the current directory.
  (tmp_path / "models.py").write_text(
      "raise ImportError('the user project models.py was imported')\n")
  out = _run_piped(
      ["--model", "gpt", "--policy", "float32", "--policy", "mixed_bfloat16",
       "--batch-size", "2", "--batches", "1", "--epochs", "2", "--warmup",
       "1", "--repeats", "1"], tmp_path,
      ("float32: compiled in ", "compiling mixed_bfloat16 (2/2)",
       "mixed_bfloat16: compiled in ", "timing repeat 1/1 of 2 mode(s)",
       "float32: median step ", "mixed_bfloat16: median step "),
      _env(COLUMNS="80", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
           JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1"))
  # A user's persistent compilation cache neither serves nor keeps the
  # bench's programs: its "compile s" are cold compiles.
  cached = tmp_path / "xla"
  assert not cached.exists() or not any(cached.iterdir()), list(
      cached.iterdir())
  lines = out.splitlines()
  assert "step ms" in out and "Verdict: " in out
  assert max(len(line) for line in lines) <= 80, out


def test_jmp_amp_without_command_prints_help(capsys):
  assert cli.cli([]) == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: jmp-amp")
  assert "bench" in out and "jmp-amp COMMAND --help" in out


def test_unknown_command_names_itself(capsys):
  with pytest.raises(SystemExit) as info:
    cli.cli(["frobnicate"])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert "jmp-amp: error: unknown command 'frobnicate'" in err
  assert "jmp-amp bench" not in err


def test_cli_dispatches_to_bench(monkeypatch):
  seen = []
  monkeypatch.setattr(cli, "main", lambda argv: seen.append(argv) or 0)
  assert cli.cli(["bench", "--policy", "mixed_bfloat16"]) == 0
  assert seen == [["bench", "--policy", "mixed_bfloat16"]]


@pytest.mark.bench
def test_compare_torch_same_weights_and_batches(tmp_path):
  pytest.importorskip("torch")
  path = tmp_path / "t.jsonl"
  assert cli.main([*TINY, "--policy", "float32", "--policy", "mixed_bfloat16",
                   "--compare-torch", "--repeats", "1", "--json",
                   str(path)]) == 0
  runs = _read(path)
  assert [r["mode"] for r in runs] == ["float32", "mixed_bfloat16",
                                       *workloads.TORCH_MODES]
  assert all(set(r) == RUN_KEYS for r in runs)
  by_mode = {r["mode"]: r for r in runs}
  # Same initial weights, same batches, same SGD: the float32 runs agree.
  assert by_mode["torch-float32"]["final_loss"] == pytest.approx(
      by_mode["float32"]["final_loss"], abs=1e-3)
  assert by_mode["torch-float32"]["speedup_vs_float32"] == pytest.approx(1.0)
  assert by_mode["torch-float32"]["baseline"] == "torch-float32"
  for mode in ("torch-autocast", "torch-autocast+scaler"):
    assert by_mode[mode]["matmuls"] == {"autocast_dtype": "float16"}
  assert by_mode["torch-autocast+scaler"]["loss_scale"] >= 1
  text = " ".join(_report(runs, 80).split())
  assert "(torch rows: torch-float32's)" in text
  assert "torch-autocast: torch autocast, really ran float16" in text


@pytest.mark.parametrize("flags, message", [
    (["--policy", "fp4"], "invalid choice: 'fp4'"),
    # A mode is a policy name: the bf16 mode is mixed_bfloat16 (f32 params).
    (["--policy", "bf16"], "invalid choice: 'bf16' (choose from 'float32', "
     "'float32-highest', 'mixed_bfloat16', "),
    (["--width", "0"], "expected a positive integer, got 0"),
    (["--batch-size", "x"], "expected a positive integer, got 'x'"),
    (["--model", "vgg"], "invalid choice: 'vgg'"),
    (["--steps", "2", "--warmup", "2"],
     "must be smaller than the number of steps"),
    (["--lr", "-1"], "expected a positive number"),
    (["--repeats", "0"], "argument --repeats: expected a positive integer"),
    (["--seed", "-3"], "argument --seed: expected an integer from 0 to "
     "2**32 - 1, got -3"),
    (["--seed", "1.5"], "argument --seed: expected an integer"),
    (["--model", "gpt", "--compare-torch"], "--model mlp only"),
])
def test_bad_flags_give_argparse_errors(flags, message, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(flags)
  assert info.value.code == 2
  assert message in capsys.readouterr().err


@pytest.fixture
def nothing_runs(monkeypatch):
  """Fails the test if the bench starts running any mode."""
  def forbidden(*args, **kwargs):
    raise AssertionError("the bench ran before checking its arguments")
  monkeypatch.setattr(cli, "run", forbidden)


def test_bad_destinations_fail_before_running_naming_the_path(
    tmp_path, nothing_runs, capsys):
  a_file = tmp_path / "file.txt"
  a_file.write_text("x")
  cases = [
      (["--json", str(tmp_path / "missing" / "x.jsonl")],
       f"--json {tmp_path / 'missing' / 'x.jsonl'}: the directory "
       f"{tmp_path / 'missing'} does not exist"),
      (["--json", str(tmp_path)], f"--json {tmp_path}: is a directory"),
      (["--plot", str(tmp_path / "no" / "p.png")],
       f"--plot {tmp_path / 'no' / 'p.png'}: the directory"),
      (["--hlo-dir", str(a_file)],
       f"--hlo-dir {a_file}: exists and is not a directory"),
      (["--hlo-dir", str(tmp_path / "a" / "b")],
       f"--hlo-dir {tmp_path / 'a' / 'b'}: the directory {tmp_path / 'a'} "
       "does not exist"),
  ]
  for flags, message in cases:
    with pytest.raises(SystemExit) as info:
      cli.main([*TINY, *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err, flags


def test_missing_optional_dependencies_fail_before_running(
    tmp_path, nothing_runs, monkeypatch, capsys):
  real = importlib.util.find_spec
  monkeypatch.setattr(
      importlib.util, "find_spec",
      lambda name, *a: None if name in ("matplotlib", "torch") else real(name))
  for flags, message in [
      (["--plot", str(tmp_path / "p.png")],
       "--plot needs matplotlib, which is not installed: pip install "
       "'jmp-amp[bench]'"),
      (["--compare-torch"], "--compare-torch needs PyTorch, which is not "
       "installed: pip install 'jmp-amp[torch]'")]:
    with pytest.raises(SystemExit):
      cli.main([*TINY, *flags])
    assert message in capsys.readouterr().err


def test_failing_mode_is_reported_in_full_and_others_still_run(
    monkeypatch, tmp_path, capsys):
  original = workloads.BUILDERS["mlp"]
  long_error = ("RESOURCE_EXHAUSTED: out of memory (simulated) while "
                "allocating " + " ".join(f"buffer{i}" for i in range(40))
                + " END-OF-ERROR")

  def flaky(mode, cfg):
    if mode is workloads.JAX_MODES["mixed_bfloat16"]:
      raise MemoryError(long_error)
    return original(mode, cfg)

  monkeypatch.setitem(workloads.BUILDERS, "mlp", flaky)
  path = tmp_path / "f.jsonl"
  code = cli.main([*TINY, "--policy", "float32", "--policy", "mixed_bfloat16",
                   "--policy", "mixed_float16", "--repeats", "1", "--json",
                   str(path)])
  runs = _read(path)
  assert code == 1
  assert [r["status"] for r in runs] == ["ok", "failed", "ok"]
  assert runs[1]["error"] == f"MemoryError: {long_error}"
  out = capsys.readouterr().out
  # The whole message is printed (wrapped, never cut).
  assert (f"FAILED mixed_bfloat16: MemoryError: {long_error}"
          in " ".join(out.split()))
  assert "1 failed (mixed_bfloat16)" in " ".join(out.split())


@pytest.mark.bench
def test_isolated_modes_match_in_process_and_keep_their_own_memory(
    tmp_path, tiny_runs):
  # In process: the default run (tiny_runs), float32 first, mixed_float16
  # after it and others; its 2 repeats train the steps 1 repeat does (the
  # test below).
  isolated = tmp_path / "i"
  assert cli.main([*TINY, "--policy", "mixed_float16", "--policy", "float32",
                   "--repeats", "1", "--isolate", "yes", "--json",
                   str(isolated)]) == 0
  iso = _read(isolated)
  inp = {r["mode"]: r for r in tiny_runs[1]}
  assert [r["isolated"] for r in iso] == [True, True]
  assert inp["float32"]["isolated"] is False
  assert [r["final_loss"] for r in iso] == [
      inp[m]["final_loss"] for m in ("mixed_float16", "float32")]
  # float32's peak after mixed_float16 ran is float32's own, as in process
  # mixed_float16's after float32's: none inherited.
  assert tiny_runs[1][0] is inp["float32"]
  assert iso[1]["peak_memory_bytes"] == inp["float32"]["peak_memory_bytes"]
  assert iso[0]["peak_memory_bytes"] == (
      inp["mixed_float16"]["peak_memory_bytes"])
  assert iso[0]["peak_memory_bytes"] != iso[1]["peak_memory_bytes"]


@pytest.mark.bench
def test_repeats_train_the_same_steps_each_time(tmp_path, tiny_runs):
  three = tmp_path / "3"
  assert cli.main([*TINY, "--policy", "mixed_float16", "--repeats", "3",
                   "--json", str(three)]) == 0
  # The default run's mixed_float16: 2 repeats, after other modes.
  a = next(r for r in tiny_runs[1] if r["mode"] == "mixed_float16")
  b = _read(three)[0]
  assert a["final_loss"] == b["final_loss"]
  assert a["loss_scale"] == b["loss_scale"]
  assert len(b["repeat_median_step_s"]) == 3
  assert re.fullmatch(r"[0-9.]+", f"{b['step_spread']}")


@pytest.mark.bench
def test_fp8_modes_run_on_cpu_emulated_and_labelled(tmp_path):
  path = tmp_path / "fp8.jsonl"
  assert cli.main(["bench", *TINY, "--policy", "float32", "--policy",
                   "float8", "--policy", "autocast-float8", "--json",
                   str(path)]) == 0
  f32, rules, autocast = _read(path)
  for r in (rules, autocast):
    assert r["status"] == "ok", r.get("error")
    assert set(r) == RUN_KEYS
    # The FP8 GEMMs take FP8 operands (E4M3, and the E5M2 gradient); the
    # CPU multiplies them as it can ("emulated"); other matmuls are bf16.
    assert r["matmuls"]["fp8"] == "emulated"
    dtypes = set(r["matmuls"]["input_dtypes"])
    assert {"float8_e4m3fn", "float8_e5m2"} <= dtypes <= {
        "bf16", "float8_e4m3fn", "float8_e5m2"}, r["matmuls"]
    assert r["loss_scale"] is None and r["skipped_steps"] == 0
    # Same data and steps: a tiny MLP (MSE on random targets) ends within
    # 5 % of float32's loss (measured: under 1 %).
    assert r["final_loss"] == pytest.approx(f32["final_loss"], rel=0.05)
    assert r["final_loss"] != f32["final_loss"]
  text = _report([f32, rules, autocast], 250)
  assert ("FP8 emulated (E4M3/E5M2-rounded operands): 3 x float8_e4m3fn x "
          "float8_e4m3fn") in " ".join(text.split())
  assert "FP8 modes (float8, autocast-float8) are emulated here" in " ".join(
      text.split())


# --------------------------------------------------------------------------
# A newcomer's first runs (issue 23).


def test_plot_path_matplotlib_cannot_write_fails_before_running(
    tmp_path, nothing_runs, capsys):
  pytest.importorskip("matplotlib")
  for name, problem in (("x.txt", "matplotlib cannot write '.txt' files"),
                        ("plot", "the path has no suffix")):
    with pytest.raises(SystemExit) as info:
      cli.main([*TINY, "--plot", str(tmp_path / name)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--plot {tmp_path / name}: {problem}; give a path ending in one " \
        "of .png, " in err, err
    assert ".pdf" in err and ".svg" in err


@pytest.mark.bench
def test_reader_closing_the_pipe_ends_quietly(tmp_path):
  # `jmp-amp bench | head -1`: here the reader is gone before the report is
  # printed, so the report's write always meets a closed pipe.
  read, write = os.pipe()
  os.close(read)
  try:
    result = subprocess.run(
        [sys.executable, "-m", "jmp_amp.tools.bench", *TINY, "--policy",
         "float32", "--repeats", "1"], stdout=write, stderr=subprocess.PIPE,
        text=True, check=False, timeout=300, cwd=tmp_path, env=_env())
  finally:
    os.close(write)
  assert result.returncode == cli.BROKEN_PIPE_EXIT, result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  assert "BrokenPipeError" not in result.stderr, result.stderr


def test_every_step_skipped_is_what_the_verdict_says(tmp_path, capsys):
  # From float32's largest scale, every float16 step overflows and is skipped.
  path = tmp_path / "skipped.jsonl"
  assert cli.main([*TINY, "--policy", "float32", "--policy", "mixed_float16",
                   "--init-scale", "3e38", "--repeats", "1", "--json",
                   str(path)]) == 0
  _, fp16 = _read(path)
  assert fp16["skipped_steps"] == fp16["config"]["steps"] == 4
  verdict = " ".join(capsys.readouterr().out.split("Verdict: ")[1]
                     .split("Note:")[0].split())
  assert "every mode ended with a finite loss" not in verdict, verdict
  assert ("mixed_float16 skipped every step (non-finite gradients), so its "
          "weights never changed") in verdict, verdict


def test_verdict_claims_nothing_when_no_mode_ran():
  failed = dict(mode="float32", framework="jax", status="failed",
                error="MemoryError: simulated")
  assert table.verdict([failed]) == "Verdict: 1 failed (float32)."


def _h100_rows():
  """Rows of the --target table from real XLA:GPU output (tests/fixtures),
  plus an FP8 row, a partly-float32 row and a failed one."""
  fixtures = ROOT / "tests" / "fixtures"
  recorded = json.loads((fixtures / "h100_fixtures.json").read_text())
  rows = []
  for mode, name in (("float32", "f32_scan"),
                     ("mixed_bfloat16", "bf16_mlp_grad"),
                     ("mixed_float16", "fp16_dots")):
    memory = {k: recorded[name][k] for k in ("temp_bytes", "argument_bytes",
                                             "output_bytes", "alias_bytes")}
    report = gpu_target.report_from_hlo(
        (fixtures / f"h100_{name}.hlo.txt").read_text(), memory)
    rows.append(gpu.row_from_report(mode, report))
  rows.append(dict(rows[1], mode="float8", half_gemm_flops=5 / 8,
                   fp8_gemm_flops=3 / 8, gemms_by_dtype={
                       "bf16 x bf16 -> bf16": 5,
                       "float8_e4m3fn x float8_e4m3fn -> bf16": 1,
                       "float8_e5m2 x float8_e4m3fn -> bf16": 1,
                       "float8_e4m3fn x float8_e5m2 -> bf16": 1}))
  rows.append(dict(rows[1], mode="autocast-mixed_bfloat16",
                   half_gemm_flops=0.5))
  rows.append(dict(mode="autocast-mixed_float16", status="failed",
                   error="RuntimeError: simulated"))
  gpu.add_ratios(rows)
  return rows


def test_target_table_fits_the_width_with_legend_and_verdict():
  rows = _h100_rows()
  narrow = gpu.format_report(rows, "mlp, train step compiled for h100", 80)
  lines = narrow.splitlines()
  assert max(len(line) for line in lines) <= 80, narrow
  header = next(line for line in lines if line.startswith("mode "))
  assert "temp ratio" in header, narrow
  for r in rows:
    assert any(line.startswith(r["mode"] + " ") for line in lines), r["mode"]
  failed_row = next(line for line in lines
                    if line.startswith("autocast-mixed_float16"))
  assert failed_row.split()[1] == "FAILED", narrow
  flat = " ".join(narrow.split())
  assert gpu.LEGEND in flat
  assert "GEMMs by dtype (count x operand dtypes -> result dtype):" in narrow
  assert ("float8: 5 x bf16 x bf16 -> bf16, 1 x float8_e4m3fn x "
          "float8_e4m3fn -> bf16") in flat
  verdicts = [line for line in lines if line.startswith("Verdict: ")]
  assert len(verdicts) == 1, narrow
  verdict = " ".join(narrow.split("Verdict: ")[1].split("FAILED")[0].split())
  assert "moves the fewest bytes" in verdict, verdict
  assert ("every GEMM in half precision or FP8 in mixed_bfloat16, "
          "mixed_float16, float8" in verdict), verdict
  assert ("float32 GEMMs left in autocast-mixed_bfloat16 (50% of GEMM FLOPs "
          "half or FP8)") in verdict, verdict
  assert "1 failed (autocast-mixed_float16)" in verdict, verdict
  assert "FAILED autocast-mixed_float16: RuntimeError: simulated" in narrow
  wide = gpu.format_report(rows, "title", 400)
  assert "GEMMs by dtype" in next(line for line in wide.splitlines()
                                  if line.startswith("mode "))
  assert "Not shown at this width" not in wide


def _timed(mode, speedup, spread):
  return dict(mode=mode, framework="jax", status="ok", final_loss=1.0,
              skipped_steps=0, config={"steps": 4}, step_spread=spread,
              speedup_vs_float32=speedup)


def test_verdict_names_no_winner_within_the_spread():
  # (#35) "fastest JAX mode float32-highest at 1.02x" with a 3 % spread.
  runs = [_timed("float32", 1.0, 0.01), _timed("float32-highest", 1.02, 0.03),
          _timed("mixed_bfloat16", 0.9, 0.01)]
  text = table.verdict(runs)
  assert "fastest JAX mode" not in text, text
  assert text.startswith(
      "Verdict: no JAX mode is faster than float32 beyond the timing spread "
      "(the best, float32-highest, at 1.02x with spread ±3%, float32's ±1%);")


def test_verdict_names_a_winner_beyond_the_spread_and_its_ties():
  runs = [_timed("float32", 1.0, 0.01), _timed("mixed_bfloat16", 1.5, 0.02),
          _timed("mixed_float16", 1.48, 0.01), _timed("float8", 1.2, 0.01)]
  assert table.verdict(runs).startswith(
      "Verdict: fastest JAX mode mixed_bfloat16 at 1.50x float32's speed "
      "(spread ±2%; mixed_float16 within the spread);")
  alone = table.verdict([_timed("float32", 1.0, 0.0),
                         _timed("mixed_bfloat16", 0.5, 0)])
  assert alone.startswith("Verdict: no JAX mode is faster than float32;")


def test_cold_compiles_bypass_the_persistent_cache_and_restore_it():
  # The suite runs with a persistent compilation cache that keeps every
  # program (conftest.py), and this process has compiled before: JAX has
  # decided to use the cache already.
  if (jax.config.jax_compilation_cache_dir is None
      or jax.config.jax_persistent_cache_min_compile_time_secs > 0
      or jax.config.jax_persistent_cache_min_entry_size_bytes > 0):
    pytest.skip("needs conftest.py's cache, which keeps every program")
  cache = pathlib.Path(jax.config.jax_compilation_cache_dir)
  jax.jit(lambda x: x + 1)(jnp.ones(3))

  def written(name, before):
    return {p.name for p in cache.iterdir()
            if p.name.startswith(f"jit_{name}-")} - before

  def timed_by_the_bench(x):
    return x * 3.0

  def compiled_after(x):
    return x * 5.0

  before = set(os.listdir(cache))
  with timing.cold_compiles():
    jax.jit(timed_by_the_bench)(jnp.ones(3)).block_until_ready()
  assert not written("timed_by_the_bench", before)  # compiled, not kept
  jax.jit(compiled_after)(jnp.ones(3)).block_until_ready()
  assert written("compiled_after", before)  # the cache is on again
