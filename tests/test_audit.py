"""Tests for the matmul-dtype audit (`jmp_amp.matmul_report`)."""

import gzip
import json
import os
import pathlib
import subprocess
import sys

import jax
from jax import lax
import jax.numpy as jnp
import pytest

import jmp_amp
from jmp_amp import matmul_report
from jmp_amp.tools import fp8_layers
from jmp_amp.tools import MatmulReport
from jmp_amp.tools.report import MatmulRecord

BF16 = jnp.bfloat16
DN = (((1,), (0,)), ((), ()))  # plain (M, K) x (K, N) matmul
HERE = os.path.basename(__file__)

# A 3-layer MLP: batch 3, widths 4 -> 8 -> 8 -> 2.
WIDTHS = (4, 8, 8, 2)
BATCH = 3


def mlp_params(dtype=BF16):
  return [jnp.ones((a, b), dtype) for a, b in zip(WIDTHS[:-1], WIDTHS[1:])]


def mlp_loss(ws, x):
  for w in ws:
    x = jnp.tanh(x @ w)
  return x.sum()


def layer_flops():
  return [2 * BATCH * a * b for a, b in zip(WIDTHS[:-1], WIDTHS[1:])]


def test_mlp_forward_has_one_bf16_dot_per_layer_with_exact_flops():
  report = matmul_report(mlp_loss, mlp_params(), jnp.ones((BATCH, 4), BF16))
  assert isinstance(report, MatmulReport) and report.stage == "lowered"
  assert len(report) == 3 and report.dots == tuple(report)
  assert [r.signature for r in report] == ["bf16 x bf16 -> bf16"] * 3
  assert [r.flops for r in report] == layer_flops()
  assert [(r.lhs_shape, r.rhs_shape, r.result_shape) for r in report] == [
      ((3, 4), (4, 8), (3, 8)), ((3, 8), (8, 8), (3, 8)),
      ((3, 8), (8, 2), (3, 2))]
  assert report.input_dtypes() == {"bf16"}
  assert report.all_inputs_in("bf16") and report.all_inputs_in(jnp.bfloat16)
  assert not report.all_inputs_in("f32")


def test_mlp_grad_has_three_forward_and_five_backward_dots():
  # Backward: 3 weight-gradient dots, and input-gradient dots for layers 2
  # and 3 only (x is not differentiated, so layer 1's is dead code).
  report = matmul_report(jax.grad(mlp_loss), mlp_params(),
                         jnp.ones((BATCH, 4), BF16))
  assert len(report) == 8
  forward = [r for r in report if "transpose" not in r.name]
  backward = [r for r in report if "transpose" in r.name]
  assert len(forward) == 3 and len(backward) == 5
  assert report.summary() == {
      "records": 8,
      "total_flops": 3 * sum(layer_flops()) - layer_flops()[0],
      "by_signature": {"bf16 x bf16 -> bf16": 8},
      "flops_by_input_dtype": {"bf16": 3 * sum(layer_flops()) - layer_flops()[0]},
  }


def test_batched_dot_flops_are_2mnk_per_batch():
  b, m, k, n = 2, 3, 5, 7
  report = matmul_report(lambda a, c: jnp.einsum("bmk,bkn->bmn", a, c),
                         jnp.ones((b, m, k)), jnp.ones((b, k, n)))
  (rec,) = report
  assert rec.flops == 2 * b * m * n * k == report.total_flops
  assert rec.signature == "f32 x f32 -> f32"


def test_multiple_contracting_dims_and_vector_dot():
  rec, = matmul_report(lambda a, c: jnp.tensordot(a, c, axes=2),
                       jnp.ones((3, 4, 5)), jnp.ones((4, 5, 6)))
  assert rec.flops == 2 * 3 * 6 * (4 * 5)
  rec, = matmul_report(jnp.dot, jnp.ones((9,)), jnp.ones((9,)))
  assert rec.result_shape == () and rec.flops == 2 * 9


def test_preferred_element_type_shows_f32_result():
  report = matmul_report(
      lambda a, c: lax.dot_general(a, c, DN, preferred_element_type=jnp.float32),
      jnp.ones((3, 4), BF16), jnp.ones((4, 8), BF16))
  (rec,) = report
  assert (rec.lhs_dtype, rec.rhs_dtype, rec.result_dtype) == ("bf16", "bf16", "f32")
  assert report.counts_by_signature() == {"bf16 x bf16 -> f32": 1}
  assert report.flops_by_input_dtype() == {"bf16": 2 * 3 * 4 * 8}


def _sq_loss(dot):
  return lambda x, w: jnp.sum(dot(x, w) ** 2)


def test_lax_preferred_f32_backward_runs_in_f32_but_jmp_dot_general_in_bf16():
  x, w = jnp.ones((3, 4), BF16), jnp.ones((4, 8), BF16)
  lax_dot = lambda a, c: lax.dot_general(a, c, DN,
                                         preferred_element_type=jnp.float32)
  jmp_dot = lambda a, c: jmp_amp.dot_general(a, c, DN)

  plain = matmul_report(jax.grad(_sq_loss(lax_dot), argnums=(0, 1)), x, w)
  assert plain.counts_by_signature() == {"f32 x f32 -> f32": 2,
                                         "bf16 x bf16 -> f32": 1}

  mixed = matmul_report(jax.grad(_sq_loss(jmp_dot), argnums=(0, 1)), x, w)
  assert mixed.all_inputs_in("bf16")
  forward = [r for r in mixed if "transpose" not in r.name]
  backward = [r for r in mixed if "transpose" in r.name]
  assert [r.signature for r in forward] == ["bf16 x bf16 -> f32"]
  assert [r.signature for r in backward] == ["bf16 x bf16 -> bf16"] * 2
  assert mixed.flops_by_input_dtype() == {"bf16": 3 * 2 * 3 * 4 * 8}
  # The op is built inside jmp_amp; the location names the caller (here).
  assert all(os.path.basename(r.location).startswith(HERE + ":") for r in mixed)


def conv(x, k, groups=1):
  return lax.conv_general_dilated(
      x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=groups)


@pytest.mark.parametrize("groups", [1, 2])
def test_convolution_records_and_flops(groups):
  n, h, w, c, o, kh, kw = 2, 8, 8, 4, 6, 3, 3
  x, k = jnp.ones((n, h, w, c), BF16), jnp.ones((kh, kw, c // groups, o), BF16)
  report = matmul_report(conv, x, k, groups=groups, static_argnames="groups")
  (rec,) = report
  assert report.convolutions == (rec,) and report.dots == ()
  assert rec.kind == "convolution" and rec.signature == "bf16 x bf16 -> bf16"
  assert (rec.lhs_shape, rec.rhs_shape, rec.result_shape) == (
      (n, h, w, c), (kh, kw, c // groups, o), (n, h, w, o))
  assert rec.flops == 2 * (n * h * w * o) * (kh * kw) * (c // groups)


def test_convolution_grad_and_jmp_conv_backward_in_bf16():
  x, k = jnp.ones((2, 8, 8, 4), BF16), jnp.ones((3, 3, 4, 6), BF16)
  loss = lambda x, k: jnp.sum(conv(x, k) ** 2)
  report = matmul_report(jax.grad(loss, argnums=(0, 1)), x, k)
  assert len(report.convolutions) == 3 and len(report) == 3
  # Stride 1 and SAME padding: input and filter gradients cost the forward's.
  forward_flops = 2 * (2 * 8 * 8 * 6) * 9 * 4
  assert [r.flops for r in report] == [forward_flops] * 3

  jmp_conv = lambda x, k: jnp.sum(jmp_amp.conv_general_dilated(
      x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2)
  report = matmul_report(jax.grad(jmp_conv, argnums=(0, 1)), x, k)
  assert report.counts_by_signature() == {"bf16 x bf16 -> bf16": 2,
                                          "bf16 x bf16 -> f32": 1}


def test_nested_jit_counts_each_call_site():
  @jax.jit
  def inner(a, b):
    return a @ b

  def outer(a, b):
    return inner(a, b) + inner(a, b.T)

  report = matmul_report(outer, jnp.ones((4, 4)), jnp.ones((4, 4)))
  assert len(report) == 2
  assert {r.function for r in report} == {"inner"}


def test_scan_body_dot_is_found_once():
  def f(a, bs):
    return lax.scan(lambda c, b: (jnp.tanh(c @ b), None), a, bs)[0]

  for stage in ("lowered", "compiled"):
    report = matmul_report(f, jnp.ones((4, 4)), jnp.ones((5, 4, 4)), stage=stage)
    assert len(report) == 1, stage
    assert report[0].flops == 2 * 4 * 4 * 4


def test_every_branch_of_a_conditional_is_listed_at_both_stages():
  def f(p, a, b):
    return lax.cond(p, lambda: a @ b, lambda: (a * 2) @ b.T)

  args = (True, jnp.ones((4, 6)), jnp.ones((6, 6)))
  lowered = matmul_report(f, *args)
  compiled = matmul_report(f, *args, stage="compiled")
  for report in (lowered, compiled):
    assert [r.flops for r in report] == [2 * 4 * 6 * 6] * 2, report
  # StableHLO keeps branches as regions of main; HLO as computations.
  assert [r.function for r in lowered] == ["main", "main"]
  assert len({r.function for r in compiled} - {"main"}) == 2


def test_compiled_stage_finds_the_dots_on_cpu():
  ws, x = mlp_params(), jnp.ones((BATCH, 4), BF16)
  lowered = matmul_report(jax.grad(mlp_loss), ws, x)
  compiled = matmul_report(jax.grad(mlp_loss), ws, x, stage="compiled")
  assert compiled.stage == "compiled" and len(compiled) == 8
  assert compiled.total_flops == lowered.total_flops
  # XLA may keep or upcast bf16 dots; whatever it reports must be a float.
  assert compiled.input_dtypes() <= {"bf16", "f32"}
  assert all(r.name and "dot_general" in r.name for r in compiled)


def test_accepts_jitted_lowered_and_compiled():
  a = jnp.ones((2, 3))
  fn = jax.jit(lambda a, n: a @ a.T * n, static_argnames="n")
  for report in (matmul_report(fn, a, n=2),
                 matmul_report(fn.lower(a, n=2)),
                 matmul_report(fn.lower(a, n=2), stage="compiled"),
                 matmul_report(fn.lower(a, n=2).compile())):
    assert len(report) == 1 and report[0].flops == 2 * 2 * 2 * 3
  assert matmul_report(fn.lower(a, n=2).compile()).stage == "compiled"


def test_accepts_shape_dtype_structs_and_dynamic_dims_give_no_flops():
  b, = jax.export.symbolic_shape("b")
  rec, = matmul_report(lambda a, w: a @ w, jax.ShapeDtypeStruct((b, 4), BF16),
                       jax.ShapeDtypeStruct((4, 8), BF16))
  assert rec.lhs_shape == (None, 4) and rec.result_shape == (None, 8)
  assert rec.flops is None and rec.signature == "bf16 x bf16 -> bf16"


def test_integer_and_fp8_dtype_names():
  rec, = matmul_report(
      lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.int32),
      jnp.ones((2, 3), jnp.int8), jnp.ones((3, 4), jnp.int8))
  assert rec.signature == "int8 x int8 -> int32"
  rec, = matmul_report(jnp.dot, jnp.ones((2, 3), jnp.float8_e4m3fn),
                       jnp.ones((3, 4), jnp.float8_e4m3fn))
  assert rec.lhs_dtype == "float8_e4m3fn"


def test_nnx_module_argument_lowers_through_nnx_jit():
  from flax import nnx

  class MLP(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(4, 8, dtype=BF16, dot_general=jmp_amp.dot_general,
                           rngs=rngs)
      self.l2 = nnx.Linear(8, 2, dtype=BF16, rngs=rngs)

    def __call__(self, x):
      return self.l2(nnx.relu(self.l1(x)))

  model = MLP(nnx.Rngs(0))
  report = matmul_report(lambda m, x: m(x), model, jnp.ones((3, 4)))
  assert [r.signature for r in report] == ["bf16 x bf16 -> f32",
                                           "bf16 x bf16 -> bf16"]
  loss = lambda m, x: jnp.mean(m(x) ** 2)
  report = matmul_report(lambda m, x: nnx.grad(loss)(m, x), model,
                         jnp.ones((3, 4)))
  assert len(report) == 5 and report.all_inputs_in("bf16")
  # The module itself can be `fn`.
  report = matmul_report(model, jnp.ones((3, 4)))
  assert len(report) == 2 and report[0].rhs_shape == (4, 8)


def test_pytree_leaves_that_are_no_arrays_are_static():
  # A layer as a plain pytree: its activation function, name and size are no
  # arrays; jit alone refuses the function ("as an abstract array").
  layer = {"w": jnp.ones((4, 8), BF16), "act": jnp.tanh, "name": "dense",
           "width": 8}

  def apply(layer, x, scale):
    assert layer["name"] == "dense" and layer["width"] == 8
    y = layer["act"](x @ layer["w"]) * jnp.ones(layer["width"], BF16)
    return {"y": y * scale, "act": layer["act"]}  # a callable output, too

  x = jnp.ones((3, 4), BF16)
  with pytest.raises(TypeError, match="as an abstract array"):
    jax.jit(apply).lower(layer, x, 2.0)
  for stage in ("lowered", "compiled"):
    rec, = matmul_report(apply, layer, x, 2.0, stage=stage)
    assert rec.lhs_shape == (3, 4) and rec.rhs_shape == (4, 8)
  rec, = matmul_report(lambda x, layer: apply(layer, x, 1.0), x, layer=layer)
  assert rec.signature == "bf16 x bf16 -> bf16"
  # A number passed as an argument stays traced, as jax.jit has it: both
  # branches of the conditional are in the program.
  report = matmul_report(lambda p, layer: lax.cond(
      p, lambda: x @ layer["w"], lambda: (2 * x) @ layer["w"]), True, layer)
  assert len(report) == 2


def test_import_does_not_import_flax():
  code = ("import sys, jmp_amp; jmp_amp.matmul_report; "
          "assert 'flax' not in sys.modules, 'flax imported'")
  subprocess.run([sys.executable, "-c", code], check=True,
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_str_table_and_record_fields():
  report = matmul_report(
      lambda a, c: lax.dot_general(a, c, DN, preferred_element_type=jnp.float32),
      jnp.ones((3, 4), BF16), jnp.ones((4, 8), BF16))
  text = str(report)
  assert text.splitlines()[0] == "MatmulReport(stage=lowered): 1 ops, 192 FLOPs"
  assert "bf16 x bf16 -> f32" in text and "3x4" in text and HERE in text
  assert "FLOPs by input dtype: bf16: 192 (100.0%)" in text
  assert repr(report) == "MatmulReport(stage='lowered', records=1)"
  rec = report[0]
  assert isinstance(rec, MatmulRecord)
  assert rec.function == "main" and rec.target is None
  assert rec.name.endswith("dot_general") and rec.input_dtype == "bf16"
  assert str(MatmulReport([])) == "MatmulReport(stage=lowered): 0 ops, 0 FLOPs"


def test_bad_input_raises_clear_errors():
  with pytest.raises(TypeError, match=r"callable.*got int: 3"):
    matmul_report(3)
  with pytest.raises(ValueError, match=r"'lowered', 'compiled'; got 'hlo'"):
    matmul_report(jnp.dot, jnp.ones(2), jnp.ones(2), stage="hlo")
  lowered = jax.jit(jnp.dot).lower(jnp.ones(2), jnp.ones(2))
  with pytest.raises(TypeError, match="Lowered"):
    matmul_report(lowered, jnp.ones(2))
  with pytest.raises(TypeError, match="static_argnames"):
    matmul_report(jax.jit(jnp.dot), jnp.ones(2), jnp.ones(2),
                  static_argnames="precision")

  class OwnJit:  # a wrapper whose `lower` gives no JAX stage

    def __call__(self, x):
      return x

    def lower(self, x):
      return "module @f {}"

  with pytest.raises(TypeError, match=r"returned a str, not a jax.stages.Lowered"):
    matmul_report(OwnJit(), jnp.ones(2))


# Text fixtures: what matmul_report parses, for forms CPU runs cannot produce.

MIXED_STABLEHLO = """
module @jit_f {
  func.func public @main(%arg0: tensor<3x4xbf16>, %arg1: tensor<4x8xf32>) -> (tensor<3x8xf32>) {
    %0 = "stablehlo.dot_general"(%arg0, %arg1) <{dot_dimension_numbers = #stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>}> : (tensor<3x4xbf16>, tensor<4x8xf32>) -> tensor<3x8xf32>
    %1 = stablehlo.dot %arg0, %arg1 : (tensor<3x4xbf16>, tensor<4x8xf32>) -> tensor<3x8xf32>
    return %0 : tensor<3x8xf32>
  }
}
"""


def test_stablehlo_text_without_visibility_and_private_callee():
  text = """
  func.func @f(%a: tensor<2x3xf16>, %b: tensor<3x5xf16>) -> tensor<2x5xf32> {
    %0 = call @g(%a, %b) : (tensor<2x3xf16>, tensor<3x5xf16>) -> tensor<2x5xf32>
    return %0 : tensor<2x5xf32>
  }
  func.func private @g(%a: tensor<2x3xf16>, %b: tensor<3x5xf16>) -> tensor<2x5xf32> {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2x3xf16>, tensor<3x5xf16>) -> tensor<2x5xf32>
    return %0 : tensor<2x5xf32>
  }
  """
  (rec,) = MatmulReport.from_stablehlo(text)
  assert rec.function == "g" and rec.signature == "f16 x f16 -> f32"
  assert rec.flops == 2 * 2 * 5 * 3 and rec.name is None


def test_mixed_operands_and_generic_mlir_syntax():
  report = MatmulReport.from_stablehlo(MIXED_STABLEHLO)
  assert len(report) == 2
  assert report.counts_by_signature() == {"bf16 x f32 -> f32": 2}
  assert report.flops_by_input_dtype() == {"bf16 x f32": 2 * 2 * 3 * 4 * 8}
  assert report.input_dtypes() == {"bf16", "f32"}
  assert report.all_inputs_in("bf16", "f32") and not report.all_inputs_in("bf16")


# Real XLA:GPU output: tiny programs compiled for an H100 without a GPU by
# tests/fixtures/make_gpu_fixtures.py (GEMMs as cuBLAS calls, convolutions as
# cuDNN calls, a scan as a while loop).
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def gpu_fixture(name):
  with open(os.path.join(FIXTURES, f"h100_{name}.hlo.txt")) as f:
    return f.read()


def test_gpu_bf16_grad_gemms_are_cublas_calls_in_bf16():
  # ws (32, 64), (64, 16); x (8, 32) not differentiated: 2 forward GEMMs,
  # 2 weight gradients, 1 input gradient (of layer 2).
  report = MatmulReport.from_hlo(gpu_fixture("bf16_mlp_grad_cublas"))
  assert report.stage == "compiled" and len(report) == 5
  assert {r.target for r in report} == {"__cublas$lt$matmul"}
  assert report.counts_by_signature() == {"bf16 x bf16 -> bf16": 5}
  assert [r.flops for r in report] == [2 * 8 * 64 * 32, 2 * 8 * 16 * 64,
                                       2 * 8 * 64 * 16, 2 * 64 * 16 * 8,
                                       2 * 32 * 64 * 8]
  assert [r.result_shape for r in report] == [(8, 64), (8, 16), (8, 64),
                                              (64, 16), (32, 64)]
  # Forward, then backward (XLA folded the transposes into the GEMMs and
  # kept one op's metadata).
  assert [r.name.startswith("jit(mlp_grad)/transpose(jvp())/")
          for r in report] == [False, False, True, True, True]
  assert all(r.location.endswith("make_gpu_fixtures.py:32") for r in report)


def test_gpu_triton_gemms_are_found_inside_their_fusions():
  # XLA's default options: each GEMM a Triton fusion, the dot inside it.
  report = MatmulReport.from_hlo(gpu_fixture("bf16_mlp_grad"))
  assert len(report) == 5
  assert {r.target for r in report} == {"__triton_nested_gemm_fusion"}
  assert report.counts_by_signature() == {"bf16 x bf16 -> bf16": 5}
  assert sorted(r.flops for r in report) == sorted(
      [2 * 8 * 64 * 32, 2 * 8 * 16 * 64, 2 * 8 * 64 * 16, 2 * 64 * 16 * 8,
       2 * 32 * 64 * 8])


def test_gpu_fp16_gemm_with_f32_result():
  report = MatmulReport.from_hlo(gpu_fixture("fp16_dots_cublas"))
  assert [r.signature for r in report] == ["f16 x f16 -> f16",
                                           "f16 x f16 -> f32"]
  assert [r.flops for r in report] == [2 * 16 * 64 * 32] * 2
  assert report.all_inputs_in("float16") and not report.all_inputs_in("bf16")


def test_gpu_convolutions_are_cudnn_calls_with_forward_flops():
  # x (2, 8, 8, 16), kernel 3x3 16 -> 32, stride 1, SAME: the input and
  # filter gradients cost what the forward conv does.
  report = MatmulReport.from_hlo(gpu_fixture("bf16_conv_grad"))
  assert [(r.kind, r.target) for r in report] == [
      ("convolution", "__cudnn$convForward"),
      ("convolution", "__cudnn$convBackwardInput"),
      ("convolution", "__cudnn$convBackwardFilter")]
  assert report.counts_by_signature() == {"bf16 x bf16 -> bf16": 3}
  assert [r.flops for r in report] == [2 * (2 * 8 * 8 * 32) * 9 * 16] * 3
  # cuDNN wants the kernel as OHWI: the compiled program says so.
  assert report[0].rhs_shape == (32, 3, 3, 16)


def test_gpu_scan_body_gemm_found_once_inside_the_while_body():
  report = MatmulReport.from_hlo(gpu_fixture("f32_scan_cublas"))
  (rec,) = report
  assert rec.signature == "f32 x f32 -> f32" and rec.flops == 2 * 16 * 16 * 16
  assert rec.target == "__cublas$lt$matmul" and rec.function.startswith("region")
  assert "while/body" in rec.name


def test_hlo_text_without_instructions_gives_an_empty_report():
  assert len(MatmulReport.from_hlo("HloModule m\n")) == 0
  with pytest.raises(ValueError, match="no HLO text"):
    MatmulReport.from_hlo("")


def test_fp8_gemms_of_a_real_h200_program():
  # The all-FP8 MLP step (width 8192) as a real H200 compiled it under XLA's
  # default options (benchmarks/gpu_check.py --dump, jax 0.11.2): the
  # autotuner chose cuBLAS's FP8 GEMM for each of the 8 GEMMs, and the
  # report finds them as the device check recorded them.
  with gzip.open(os.path.join(
      FIXTURES, "h200_device_mlp_float8-all.hlo.txt.gz"), "rt") as f:
    report = MatmulReport.from_hlo(f.read())
  recorded = json.loads((pathlib.Path(FIXTURES).parent.parent / "benchmarks"
                         / "results" / "gpu_check_nvidia-h200.json"
                         ).read_text())
  row, = [r for r in recorded["rows"]
          if (r["workload"], r["mode"]) == ("mlp", "float8-all")]
  assert report.stage == "compiled" and len(report) == 8
  assert {r.target for r in report} == {"__cublas$lt$matmul$f8"}
  assert report.counts_by_signature() == row["gemms"]
  assert all(fp8_layers.is_fp8_signature(s) for s in row["gemms"])
  # Three FP8 layers, each with its forward and gradient GEMMs (the first
  # layer's input gets no gradient): 3 + 3 + 2.
  assert sorted(sum(ops.values()) for ops in report.fp8_layers().values()
                ) == [2, 3, 3]
