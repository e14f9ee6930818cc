"""Tests for the H100 compile-only report (`jmp_amp.gpu_report`).

The fixture tests read real XLA:GPU output committed under tests/fixtures/
and always run. The compile tests need the CUDA plugin (the ``gpu-audit``
extra) with ``JAX_PLATFORMS=cpu`` on a machine without a GPU, and are
skipped otherwise.
"""

import json
import os

import jax
import pytest

import helpers
import jmp_amp
from jmp_amp.tools import gpu_target

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
PROGRAMS = ("bf16_mlp_grad", "fp16_dots", "bf16_conv_grad", "f32_scan")
# Each program compiled with XLA's default options and with Triton GEMMs off.
NAMES = PROGRAMS + tuple(f"{n}_cublas" for n in PROGRAMS)
LABEL = ("compiled for H100, no GPU, XLA's default options: compiler figures, "
         "not timings")
CUBLAS_LABEL = ("compiled for H100, no GPU, Triton GEMMs off "
                "(xla_gpu_enable_triton_gemm=False): compiler figures, not "
                "timings")


def gemm_of(name):
  return "cublas" if name.endswith("_cublas") else "default"
HAS_PLUGIN = gpu_target.has_cuda_plugin()


def fixture_text(name):
  with open(os.path.join(FIXTURES, f"h100_{name}.hlo.txt")) as f:
    return f.read()


def recorded(name):
  with open(os.path.join(FIXTURES, "h100_fixtures.json")) as f:
    return json.load(f)[name]


def memory_of(summary):
  return {k: summary[k] for k in ("temp_bytes", "argument_bytes",
                                  "output_bytes", "alias_bytes")}


@pytest.mark.parametrize("name", NAMES)
def test_fixture_report_matches_what_was_recorded_at_compile_time(name):
  want = recorded(name)
  report = gpu_target.report_from_hlo(fixture_text(name), memory_of(want),
                                      gemm=gemm_of(name))
  got = report.summary()
  # The fixtures were made with jax 0.10.2; the report names the JAX at hand.
  assert got.pop("jax_version") == jax.__version__
  assert want.pop("jax_version") == "0.10.2"
  assert got == want, (got, want)
  label = CUBLAS_LABEL if gemm_of(name) == "cublas" else LABEL
  assert got["label"] == label and report.label == label


def test_kernels_and_bytes_of_two_gemms_by_hand():
  # a (16, 32) f16 and b (32, 64) f16 feed two cuBLAS calls, one writing
  # f16 (16, 64), one f32 (16, 64); nothing else launches.
  report = gpu_target.report_from_hlo(fixture_text("fp16_dots_cublas"))
  assert report.kernels == 2
  assert report.kernels_by_kind == {"__cublas$lt$matmul": 2}
  a, b = 16 * 32 * 2, 32 * 64 * 2
  assert report.bytes_estimate == (a + b + 16 * 64 * 2) + (a + b + 16 * 64 * 4)
  assert report.memory == dict.fromkeys(
      ("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes"))
  assert report.gemms_by_dtype() == {"f16 x f16 -> f16": 1,
                                     "f16 x f16 -> f32": 1}


def test_scan_kernels_count_the_loop_body_once_and_not_the_loop():
  report = gpu_target.report_from_hlo(fixture_text("f32_scan_cublas"))
  # Entry: 2 copies; body: slice fusion, counter fusion, GEMM, tanh; the
  # condition's compare fusion. The while itself launches nothing.
  assert report.kernels_by_kind == {"kLoop": 3, "copy": 2,
                                    "__custom_fusion": 1,
                                    "__cublas$lt$matmul": 1}
  assert "while" not in report.kernels_by_kind
  # By default the GEMM is a Triton fusion, named by its kind.
  report = gpu_target.report_from_hlo(fixture_text("f32_scan"))
  assert report.kernels_by_kind["__triton_nested_gemm_fusion"] == 1
  assert "__cublas$lt$matmul" not in report.kernels_by_kind


def test_str_carries_the_label_and_figures():
  text = str(gpu_target.report_from_hlo(
      fixture_text("bf16_conv_grad"), memory_of(recorded("bf16_conv_grad"))))
  assert text.splitlines()[0] == f"GpuReport [{LABEL}; jax {jax.__version__}]"
  assert "GEMMs/convs: 3 (3 x bf16 x bf16 -> bf16)" in text
  assert "kernels: 6 (" in text and "__cudnn$convForward: 1" in text
  assert "temp 17.8 KiB" in text


def test_bad_target_and_gemm_names():
  with pytest.raises(ValueError,
                     match=r"target must be one of 'h100'; got 'a100'"):
    jmp_amp.gpu_report(lambda x: x, 1.0, target="a100")
  with pytest.raises(ValueError,
                     match=r"gemm must be one of 'default', 'cublas'; got 'x'"):
    gpu_target.compile_for_gpu(lambda x: x, 1.0, gemm="x")


@pytest.mark.skipif(HAS_PLUGIN, reason="the CUDA plugin is installed")
def test_missing_plugin_names_the_extra():
  with pytest.raises(ImportError, match=r'pip install "jmp-amp\[gpu-audit\]"'):
    jmp_amp.gpu_report(lambda x: x @ x, jax.ShapeDtypeStruct((4, 4), "float32"))


def _target_or_skip():
  if not HAS_PLUGIN:
    pytest.skip("needs the CUDA plugin (pip install 'jmp-amp[gpu-audit]')")
  try:
    gpu_target.target_device("h100")
  except RuntimeError as e:
    pytest.skip(f"CUDA plugin gave no compile-only target: {e}")


@pytest.mark.parametrize("name", NAMES)
def test_compiling_the_fixture_programs_again_gives_the_recorded_figures(name):
  _target_or_skip()
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, FIXTURES)
  try:
    import make_gpu_fixtures  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(FIXTURES)
  fn, args = make_gpu_fixtures.PROGRAMS[name.removesuffix("_cublas")]
  report = jmp_amp.gpu_report(fn, *args, gemm=gemm_of(name))
  got, want = report.summary(), recorded(name)
  for key in ("gemms_by_dtype", "gemm_flops_by_input_dtype", "kernels",
              "kernels_by_kind", "temp_bytes", "argument_bytes", "label"):
    assert got[key] == want[key], (key, got[key], want[key])


def test_donated_train_step_aliases_its_state():
  _target_or_skip()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def step(w, x):
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g

  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  x = jax.ShapeDtypeStruct((32, 64), jnp.bfloat16)
  kept = jmp_amp.gpu_report(step, w, x)
  donated = jmp_amp.gpu_report(step, w, x, donate_argnums=0)
  assert kept.memory["alias_bytes"] == 0
  assert donated.memory["alias_bytes"] == 64 * 64 * 4
  assert len(donated.matmuls) >= 2


def test_bench_target_without_the_plugin_says_what_to_install(capsys):
  if HAS_PLUGIN:
    pytest.skip("the CUDA plugin is installed")
  from jmp_amp.tools.bench import cli  # pylint: disable=g-import-not-at-top
  assert cli.main(["--target", "h100"]) == 2
  assert 'pip install "jmp-amp[gpu-audit]"' in capsys.readouterr().err


def _bench_h100(tmp_path, capsys, *policies):
  """Runs the bench CLI for an H100 on a small MLP: its table (whitespace
  collapsed, as it wraps to the terminal), its rows."""
  from jmp_amp.tools.bench import cli  # pylint: disable=g-import-not-at-top
  out = tmp_path / "bench.jsonl"
  argv = ["bench", "--target", "h100", "--width", "64", "--batch-size", "16",
          "--json", str(out)]
  for policy in policies:
    argv += [policy] if policy.startswith("-") or argv[-1] == "--gemm" else [
        "--policy", policy]
  assert cli.main(argv) == 0
  return (" ".join(capsys.readouterr().out.split()),
          [json.loads(line) for line in out.read_text().splitlines()])


def test_bench_target_h100_table_and_json(tmp_path, capsys):
  _target_or_skip()
  text, rows = _bench_h100(tmp_path, capsys, "float32", "mixed_bfloat16")
  assert LABEL in text and "8 x f32 x f32 -> f32" in text
  assert [r["mode"] for r in rows] == ["float32", "mixed_bfloat16"]
  f32, mixed = rows
  assert f32["label"] == LABEL and f32["temp_bytes_vs_float32"] == 1.0
  assert f32["gemms_by_dtype"] == {"f32 x f32 -> f32": 8}
  assert mixed["half_gemm_flops"] == 1.0 and mixed["gemms"] == 8
  assert mixed["argument_bytes"] == f32["argument_bytes"]  # f32 master params


def test_bench_target_h100_fp8_modes_count_the_f8_gemms(tmp_path, capsys):
  _target_or_skip()
  text, (rules, autocast) = _bench_h100(tmp_path, capsys, "float8",
                                       "autocast-float8")
  assert "FP8 FLOPs" in text
  assert "1 x float8_e4m3fn x float8_e4m3fn -> " in text
  # "float8" rules keep the first and last of the 3 layers in bf16: the middle
  # layer's forward, input-gradient and weight-gradient GEMMs are FP8.
  assert helpers.fp8_gemm_kinds(rules["gemms_by_dtype"]) == {
      "bf16 x bf16 -> bf16": 5, "forward": 1, "backward": 2}
  assert rules["fp8_gemm_flops"] == pytest.approx(3 / 8)
  # The audit per FP8 layer: layers/1 compiled to FP8 GEMMs only.
  assert rules["fp8_layers"] == 1 and rules["fp8_fallbacks"] == {}
  assert "float8: every FP8 layer (1) runs FP8 GEMMs" in text
  assert "fp8_layers" not in autocast  # no FP8 layers: ops, not modules
  # autocast float8 takes every float32 matmul (the first layer's input
  # gradient is not computed).
  assert helpers.fp8_gemm_kinds(autocast["gemms_by_dtype"]) == {
      "forward": 3, "backward": 5}
  assert autocast["fp8_gemm_flops"] == 1.0
  assert autocast["half_gemm_flops"] == 0.0


def _fp8_and_bf16_layers(x, w, v):
  with jax.named_scope("fp8[proj]"):
    y = jmp_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ())))
  with jax.named_scope("fp8[other]"):  # asked as FP8, written in bf16
    return jax.numpy.tanh(y) @ v.astype(jax.numpy.bfloat16)


def test_fp8_check_fails_a_mode_whose_layers_compiled_to_bf16_gemms():
  _target_or_skip()
  from jmp_amp.tools.bench import timing  # pylint: disable=g-import-not-at-top
  w = jax.ShapeDtypeStruct((64, 64), jax.numpy.float32)
  x = jax.ShapeDtypeStruct((32, 64), jax.numpy.float32)
  report = jmp_amp.gpu_report(_fp8_and_bf16_layers, x, w, w)
  assert timing.fp8_check("float8", report.matmuls, report.lowered) == (
      "other: 1 of 1 ops not FP8 (1 x bf16 x bf16 -> bf16)")
  assert timing.fp8_check("autocast-float8", report.matmuls,
                          report.lowered).startswith(
                              "not every GEMM is FP8: 1 x bf16 x bf16 -> bf16")
  assert timing.fp8_check("mixed_bfloat16", report.matmuls,
                          report.lowered) is None
  only_fp8 = jmp_amp.gpu_report(
      lambda x, w: jmp_amp.fp8.dot_general(x, w, (((1,), (0,)), ((), ()))),
      x, w)
  assert timing.fp8_check("autocast-float8", only_fp8.matmuls,
                          only_fp8.lowered) is None


def test_gpu_report_refuses_a_program_built_for_the_cpu():
  _target_or_skip()
  f = lambda x: x @ x
  x = jax.numpy.ones((8, 8))
  lowered = jax.jit(f).lower(x)
  for staged in (lowered, lowered.compile()):
    with pytest.raises(ValueError, match=r"built for cpu, not for H100.*"
                       r"jmp_amp.gpu_report\(step, \*args\)"):
      jmp_amp.gpu_report(staged)


def test_bench_target_cublas_is_labelled(tmp_path, capsys):
  _target_or_skip()
  text, (row,) = _bench_h100(tmp_path, capsys, "mixed_bfloat16", "--gemm",
                             "cublas")
  assert CUBLAS_LABEL in text and row["label"] == CUBLAS_LABEL
  assert row["gemms_by_dtype"] == {"bf16 x bf16 -> bf16": 8}
