"""Loss scaling under SPMD sharding (8 simulated CPU devices, in a subprocess).

`sharded_check.py` runs in its own process because the simulated device count
must be set before JAX initialises; this file asserts on the JSON it prints.
"""

import json
import os

import pytest

import helpers

pytestmark = pytest.mark.slow  # a process of its own on 8 devices: ~45 s

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "sharded_check.py")
TOLERANCE = 1e-5


def _run_script():
  return helpers.run_check_script(SCRIPT, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """The script's results, computed once even with several xdist workers."""
  if not os.environ.get("PYTEST_XDIST_WORKER"):
    return _run_script()
  filelock = pytest.importorskip("filelock")
  shared = tmp_path_factory.getbasetemp().parent / "sharded_check.json"
  with filelock.FileLock(str(shared) + ".lock"):
    if not shared.is_file():
      shared.write_text(json.dumps(_run_script()))
    return json.loads(shared.read_text())


def test_runs_on_eight_devices(results):
  assert results["devices"] == 8
  assert "all-reduce" in results["dp_collectives"]
  assert results["fsdp_collectives"]  # gathers/reductions across devices


def test_data_parallel_matches_single_device(results):
  assert results["dp_max_diff"] <= TOLERANCE
  assert results["dp_state_max_diff"] <= TOLERANCE


def test_fsdp_matches_single_device_and_stays_sharded(results):
  assert results["fsdp_max_diff"] <= TOLERANCE
  assert results["fsdp_state_max_diff"] <= TOLERANCE
  assert results["fsdp_params_sharded"]
  assert results["fsdp_opt_state_sharded"]


def test_fp8_histories_and_params_match_single_device(results):
  # Each amax is taken over the whole (global) batch, so the delayed-scaling
  # histories are bit for bit one device's, under data parallelism and FSDP.
  assert results["fp8_dp_histories_equal"]
  assert results["fp8_fsdp_histories_equal"]
  # The newest input amax is the batch's (rounded to bf16), not device 0's.
  assert results["fp8_newest_input_amax"] == pytest.approx(
      results["fp8_global_input_amax"], rel=2**-7)
  assert results["fp8_device0_input_amax"] < (
      results["fp8_global_input_amax"] / 2)
  # The gradients are reduced in another order; a last-bit difference can
  # round to the neighbouring FP8 value (measured: 2e-4 after 3 steps).
  assert results["fp8_dp_max_diff"] <= 1e-3
  assert results["fp8_fsdp_max_diff"] <= 1e-3


def test_loss_scale_is_replicated_and_identical(results):
  assert results["loss_scale_replicated"]
  assert results["loss_scale_grew"]


def test_nan_in_one_gradient_shard_skips_everywhere(results):
  assert len(results["nan_shard_devices"]) == 1  # the NaN lived on one device
  assert results["nan_shard_skipped"]
  assert results["nan_shard_params_unchanged"]
  assert results["nan_shard_inner_state_unchanged"]
  assert results["nan_shard_scale_halved"]
  assert results["nan_shard_scale_replicated"]


def test_nan_in_one_batch_shard_skips_everywhere(results):
  assert results["nan_batch_skipped"]
  assert results["nan_batch_params_unchanged"]
  assert results["nan_batch_scale_replicated"]


def test_skips_do_not_recompile(results):
  assert results["fsdp_compiles"] == 1
  assert results["compiles_after_skips"] == [1, 1]


def test_shard_map_axis_name_reduces_the_finite_flag(results):
  assert results["shard_map_axis_all_skip"]
  assert results["shard_map_axis_params_unchanged"]
  assert results["shard_map_axis_scales"] == [512.0] * 8


def test_shard_map_without_axis_name_diverges(results):
  # What axis_name prevents: only the device with the inf skips, so the
  # replicas' params and loss scales drift apart.
  expected = [True] * 8
  expected[3] = False
  assert results["shard_map_no_axis_finite"] == expected
  assert results["shard_map_no_axis_rows_changed"] == expected
  assert results["shard_map_no_axis_scales"] == [
      512.0 if i == 3 else 1024.0 for i in range(8)]


def test_sharded_checkpoint_round_trip(results):
  assert results["ckpt_sharded_equal"]
  assert results["ckpt_sharded_keeps_shardings"]
  assert results["ckpt_resharded_equal"]
  assert results["ckpt_resharded_replicated"]


def test_finite_check_reads_sharded_gradients_in_place(results):
  # The finite check, on gradients sharded along each axis: the
  # devices exchange their partial results (at most one flag per row of a
  # gradient: 2048 here), never the gradients (2**17 elements each), and a
  # NaN on one shard is seen.
  assert results["finite_check_clean"]
  assert not results["finite_check_nan_shard"]
  sizes = results["finite_check_collective_sizes"]
  assert sizes and max(sizes) <= 2048, sizes
