"""The tiny Llama under `jax.set_mesh` with Explicit fsdp x tensor axes.

`llama_mesh_check.py` runs `jmp_amp.models.Llama` (tiny, scanned,
rematerialised) through both runners (bfloat16 by make_train_step with
telemetry; float16 with loss scaling by hand, a skip and a checkpoint)
on 8 simulated CPU devices, a (2, 4) mesh made as a user makes it,
``jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(Explicit,) * 2)``,
the batch split over "fsdp"; each against the same run on one device. It
runs in its own process (the device count must be set before JAX
initialises); one run serves every test here.

The model's own ``self.embed(tokens)`` gives its gather no ``out_sharding``,
which Explicit axes ask for batch-split ids: the user's code swaps in an
`nnx.Embed` subclass that says the rows keep the batch's sharding (the
check's ``RowsEmbed``; models/llama.py is unchanged). With it, every layout
tried traces its forward and backward pass (where Explicit axes refuse a
sharding), and the blocks' kernels split fsdp x tensor train.
"""

import os

import jax
import pytest

import helpers

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "llama_mesh_check.py")

pytestmark = [
    pytest.mark.slow,  # one subprocess, ~1.5 min of CPU
    pytest.mark.skipif(
        not all(hasattr(jax, n) for n in ("set_mesh", "typeof", "make_mesh"))
        or not all(hasattr(jax.sharding, n) for n in (
            "AxisType", "reshard", "get_abstract_mesh")),
        reason="needs sharding in types (jax.set_mesh, jax.sharding."
        "AxisType.Explicit, reshard): this jax has not all of them"),
]

# Params after 3 steps of SGD (lr 0.1, momentum 0.9) and the 3 losses (about
# 4.1), against one device. The sharded matmuls sum in another order
# (XLA:CPU); a bfloat16 or float16 pass rounds those sums to its own
# precision and the steps carry the difference, largest in the embedding.
# Measured (params, losses): bf16 1.4e-2, 7.8e-3; fp16 4.7e-4, 1.4e-4. On
# one device, the same 3 steps against float32 differ by 2.1e-2 (bf16): the
# mesh moves it less than bfloat16 itself moves float32. (FP8 and 16-bit
# optimizer state under Explicit axes: test_fp8_sharding.py and
# test_explicit_sharding.py.)
TOLERANCE = {"bf16/make_train_step": (3e-2, 2e-2),
             "fp16/hand_written": (2e-3, 1e-3)}


@pytest.fixture(scope="module")
def results():
  got = helpers.run_check_script(SCRIPT, timeout=1500)
  if "skipped" in got:  # flax 0.12.3
    pytest.skip(got["skipped"])
  return got


def _get(results, name):
  """`results[name]`; if the check that sets it raised, its error."""
  assert name in results, (name, sorted(results))
  value = results[name]
  assert not (isinstance(value, str) and value.startswith("error")), value
  return value


def test_runs_on_eight_devices(results):
  assert results["devices"] == 8


def test_which_layouts_run_the_model(results):
  # The model as it is, with the batch split over "fsdp": its embedding's
  # gather cannot tell its output's sharding.
  assert "out_sharding" in results["layouts/as_is/replicated"]
  # With the user's RowsEmbed: Megatron's column/row split; and every
  # kernel fsdp x tensor, the head's vocabulary and the embedding's
  # features over "tensor", on which every feature below trains.
  assert _get(results, "layouts/megatron") == "ok"
  assert results["layout"] == "fsdp_x_tensor"


@pytest.mark.parametrize("name", sorted(TOLERANCE))
def test_each_feature_trains_as_on_one_device(results, name):
  # mixed_bfloat16 through make_train_step; float16 with a dynamic loss
  # scale in a hand-written nnx.jit step.
  run = _get(results, name)
  params, losses = TOLERANCE[name]
  assert run["max_diff"] <= params, run
  assert run["loss_diff"] <= losses, run
  assert run["finite"], run  # every step applied or skipped as on one
  assert run["sharded"], run  # the params kept their fsdp x tensor layout
  assert run["scale_replicated"], run


def test_an_inf_step_is_skipped_bitwise_on_every_shard(results):
  run = _get(results, "fp16_skip")
  assert run == {"skipped": True, "params_bitwise": True,
                 "state_bitwise": True, "scale_halved": True,
                 "scale_replicated": True}


def test_telemetry_matches_one_device(results):
  run = _get(results, "telemetry")
  assert run["paths"], run
  assert run["stats_close"], run
  assert run["blocks"][0] == "blocks/0"  # per block, through scan and remat


def test_checkpoint_resumes_bitwise(results):
  assert _get(results, "checkpoint") == {
      "restored_bitwise": True, "resumed_bitwise": True, "sharded": True}
