"""FP8 ops under `jax.set_mesh` with Explicit axes (8 simulated CPU devices,
in a subprocess: `fp8_sharding_check.py`); this file asserts on the JSON it
prints (issue 51)."""

import os

import jax
import pytest

import helpers

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "fp8_sharding_check.py")
RECIPES = ("current", "delayed", "rowwise")
# One step's gradients are reduced across devices in another order; a
# last-bit difference can round to the neighbouring FP8 value, which the
# next steps carry (measured: 2.5e-3 after 3 steps, params of size ~0.2).
PARAM_TOLERANCE = 1e-2

pytestmark = [
    pytest.mark.slow,  # About a minute of CPU time.
    pytest.mark.skipif(
        not all(hasattr(jax, n) for n in ("set_mesh", "typeof"))
        or not all(hasattr(jax.sharding, n) for n in (
            "AxisType", "reshard", "get_abstract_mesh")),
        reason="needs sharding in types (jax.set_mesh, jax.sharding."
        "AxisType.Explicit, reshard): this jax has not all of them"),
]


@pytest.fixture(scope="module")
def results():
  return helpers.run_check_script(SCRIPT, timeout=900)


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemma_kv_projection_honours_out_sharding(results, recipe):
  # x sharded on D by "tensor", the kernel on D by "fsdp": jnp.einsum runs
  # with out_sharding, and so does the FP8 einsum, to the same values.
  key = f"kv_{recipe}"
  assert results[f"{key}_out_spec"] == "(None, 'fsdp', None, None, None)"
  assert results[f"{key}_grad_specs"] == [
      "(None, None, 'tensor')", "(None, None, 'fsdp', None)"]
  assert results[f"{key}_max_diff"] <= 1e-6
  assert results[f"{key}_grad_rel_diff"] <= 1e-5
  assert results[f"{key}_operand_histories_equal"]
  assert results[f"{key}_histories_replicated"]


def test_float8_autocast_of_jnp_einsum_honours_out_sharding(results):
  assert results["kv_autocast_out_spec"] == (
      "(None, 'fsdp', None, None, None)")
  assert results["kv_autocast_grad_specs"] == [
      "(None, None, 'tensor')", "(None, None, 'fsdp', None)"]
  assert results["kv_autocast_loss_rel_diff"] <= 1e-5


# FSDP x tensor parallel for every recipe; data parallel and the 1x1 mesh
# (fp8_sharding_check.MLP_LAYOUTS) once each.
MLP_RUNS = [(recipe, "fsdp_tp2x4") for recipe in RECIPES] + [
    ("delayed", "dp8"), ("current", "1x1")]


@pytest.mark.parametrize(("recipe", "layout"), MLP_RUNS)
def test_mlp_trains_as_on_one_device(results, recipe, layout):
  key = f"mlp_{recipe}_{layout}"
  assert results[f"{key}_max_diff"] <= PARAM_TOLERANCE
  assert results[f"{key}_param_specs"] == (
      ["(None, None)", "(None, None)"] if layout == "dp8"
      else ["(None, 'tensor')", "('tensor', None)"])
  # The amax of a sharded batch is the whole batch's, on every device.
  assert results[f"{key}_input_histories_equal"]
  if layout != "1x1":
    assert results[f"{key}_histories_replicated"]


def test_conv_under_a_batch_sharded_mesh(results):
  assert results["conv_grad_specs"] == [
      "('data', None, None, None)", "(None, None, None, None)"]
  assert results["conv_loss_rel_diff"] <= 5e-3


def test_nnx_fp8_layers_in_a_hand_written_step(results):
  for got, want in zip(results["nnx_losses"], results["nnx_ref_losses"]):
    assert got == pytest.approx(want, rel=1e-2)
  assert results["nnx_params_max_diff"] <= PARAM_TOLERANCE
