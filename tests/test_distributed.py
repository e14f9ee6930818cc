"""Several processes with JAX's distributed runtime: loss scaling, FP8 state
and checkpoints agree on every process.

`distributed_check.py` runs as N processes on localhost
(`jax.distributed.initialize`, gloo CPU collectives, L simulated devices each,
one global mesh), and once as a single process holding N x L devices, the
reference (one run on 4 devices serves every launch; a launch on 2 devices
is compared with its cases on 2 of them). Each process writes what it saw;
these tests compare. Every test here is slow (several processes, each
compiling): 2 processes x 2 devices (the MLP data-parallel under float16
dynamic loss scaling and FSDP-sharded under bfloat16, on a mesh with an
Auto and with an Explicit axis; checkpoint and resume, a process killed
mid-save, an FP8 MLP); each model, layout and precision with one device per
process (bitwise against one process); and 4 processes.

Every launch has a deadline; a process that fails or is killed takes the
others down with it (a peer blocked in a collective would wait for it), so a
hang costs at most `TIMEOUT` seconds, never the CI job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import filelock
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # several processes: ~4 min of CPU in all

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "distributed_check.py")
ROOT = os.path.dirname(os.path.dirname(SCRIPT))
TIMEOUT = 300  # seconds, per launch
SLOW_TIMEOUT = 900  # the slow runs' launches: up to 2 cases, 4 processes
GRACE = 5  # seconds the others get once one process has died
FAULT_STEPS = (1, 4)
STEPS = 6
# 2 processes x 2 devices: both layouts, both precisions, on the MLP (the
# GPT compiles for twice as long; it runs with one device per process), and
# the same two on the mesh with its axis Explicit (under jax.set_mesh).
FAST_CASES = ("mlp-dp-fp16", "mlp-fsdp-bf16")
EXPLICIT_CASES = tuple(f"{case}-explicit" for case in FAST_CASES)
# One device per process (2 processes; the reference's cases on 2 of its
# devices, "@2"): each model, layout and precision once.
ONE_CASES = ("mlp-dp-fp16@2", "gpt-fsdp-bf16@2")
# Four processes, one device each ("%4": the reference's fault in the 4th
# process's rows): the MLP FSDP-split over them under bfloat16 (the GPT,
# which compiles for twice as long in each process, runs on two). Resuming
# on more than one process is `two`'s. Four processes sum in another order
# than one process with 4 devices: the reorder bound. (Under float16, with
# a batch of 8, the bound's "1 % of the elements more than 1e-3 apart" was
# measured 1.2 %: Adam moves an element whose gradient is near 0 by about
# lr either way; float16 with loss scaling across processes is `two`'s and
# the one device per process runs'.)
FOUR_CASES = ("mlp-fsdp-bf16%4",)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(num_processes: int, port: str | None) -> dict[str, str]:
  env = dict(os.environ)
  if port is not None:  # what docs/multi-host.md tells a launcher to set
    env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
  else:
    env.pop("JAX_COORDINATOR_ADDRESS", None)
  env.pop("XLA_FLAGS", None)  # the script sets its own device count
  env["JAX_PLATFORMS"] = "cpu"
  env["DISTRIBUTED_CHECK_AS_PROCESSES"] = str(num_processes)
  # The checkout under test, not whichever jmp_amp the venv has installed.
  env["PYTHONPATH"] = os.pathsep.join(
      [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
  return env


def _kill(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)  # its own session: it and its children
    except ProcessLookupError:
      pass
  proc.wait()


def launch(out, num_processes: int, local_devices: int, *args: str,
           reference: bool = False, killed: int | None = None,
           timeout: float = TIMEOUT) -> list[int]:
  """Runs the script as `num_processes` processes (or as the one-process
  reference on as many devices) and returns their exit codes.

  Raises (with every process's log tail) if one fails, or the launch passes
  its deadline; process `killed` is expected to kill itself, and the others
  are then stopped after `GRACE` seconds.
  """
  out = str(out)
  os.makedirs(out, exist_ok=True)
  if reference:
    port = None
    commands = [["--num-processes", "1",
                 "--local-devices", str(num_processes * local_devices)]]
  else:
    port = str(_free_port())
    commands = [["--process-id", str(i), "--num-processes",
                 str(num_processes), "--local-devices", str(local_devices)]
                for i in range(num_processes)]
  procs, logs = [], []
  try:
    for i, command in enumerate(commands):
      log = os.path.join(out, f"log.{'ref' if reference else i}.txt")
      logs.append(log)
      with open(log, "w") as f:
        procs.append(subprocess.Popen(
            [sys.executable, SCRIPT, "--out", out, *command, *args],
            stdout=f, stderr=subprocess.STDOUT, env=_env(num_processes, port),
            cwd=os.path.dirname(SCRIPT), start_new_session=True))
    deadline = time.monotonic() + timeout
    died_at = None
    while any(p.poll() is None for p in procs):
      now = time.monotonic()
      if died_at is None and any(p.poll() not in (None, 0) for p in procs):
        died_at = now
      if now > deadline or (died_at is not None and now > died_at + GRACE):
        break
      time.sleep(0.05)
  finally:
    for p in procs:
      _kill(p)
  codes = [p.returncode for p in procs]
  with open(os.path.join(out, "codes.json"), "w") as f:
    json.dump(codes, f)
  expected = [-signal.SIGKILL if i == killed else 0
              for i in range(len(procs))]
  if killed is not None:
    ok = codes[killed] == -signal.SIGKILL
  else:
    ok = codes == expected
  if not ok:
    tails = "\n".join(f"--- process {i} (exit {c}):\n{_tail(log)}"
                      for i, (c, log) in enumerate(zip(codes, logs)))
    raise AssertionError(f"launch {args} failed or timed out:\n{tails}")
  return codes


def _tail(path: str, lines: int = 25) -> str:
  with open(path, errors="replace") as f:
    return "".join(f.readlines()[-lines:])


def load(out, case: str, num: int):
  """Each process's (record, arrays) for `case`."""
  result = []
  for i in range(num):
    with open(os.path.join(str(out), f"{case}.p{i}.json")) as f:
      record = json.load(f)
    path = os.path.join(str(out), f"{case}.p{i}.npz")
    arrays = None
    if os.path.exists(path):
      with np.load(path) as z:
        arrays = [z[f"arr_{j}"] for j in range(len(z.files))]
    result.append((record, arrays))
  return result


def _shared_run(tmp_path_factory, name: str, runs) -> str:
  """Runs `runs(out)` once per test session, even with several xdist
  workers (the others wait for it and read its output)."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent
  out = base / f"distributed-{name}"
  with filelock.FileLock(str(out) + ".lock"):
    done = out / "done"
    if not done.exists():
      if out.exists():
        raise AssertionError(f"an earlier launch of {name} failed; see {out}")
      runs(out)
      done.write_text("ok")
  return str(out)


# FSDP: the histories (history_len 4) are split over the 4 devices, so
# restoring them gathers them to check them.
FP8_CASE = "mlp-fsdp-fp8"


def _train(out, processes, local_devices, cases, resume_cases, kill=False,
           timeout=TIMEOUT):
  """The run (saving at step 3; then, with `kill`, process 1 killed during a
  save) and the run resumed from it (and reading the killed save, then
  the processes given different loss scales)."""
  ckpt = os.path.join(str(out), "ckpt")
  launch(out, processes, local_devices, "--cases", ",".join(cases),
         "--ckpt", ckpt, "--save-at", "3",
         *(["--then", "kill"] if kill else []), killed=1 if kill else None,
         timeout=timeout)
  launch(os.path.join(str(out), "resumed"), processes, local_devices,
         "--cases", ",".join(resume_cases), "--ckpt", ckpt, "--resume",
         *(["--then", "after-kill", "--then", "disagree"] if kill else []),
         timeout=timeout)


def _reference(out, processes, local_devices, cases, timeout=TIMEOUT):
  launch(out, processes, local_devices, "--cases", ",".join(cases),
         reference=True, timeout=timeout)


TWO_CASES = FAST_CASES + EXPLICIT_CASES + (FP8_CASE,)
# Resumed: each layout and precision once, on the Explicit axis (the Auto
# axis's cases differ by the axis type only), and FP8 (on the Auto axis).
RESUME_CASES = EXPLICIT_CASES + (FP8_CASE,)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
  """2 processes x 2 devices: the fast cases (on an Auto and an Explicit
  axis) and FP8, saved at step 3, then a save killed in process 1; a fresh
  run resumes from step 3, reads the killed save's directory, then starts
  process 0 at loss scale 2**15 and process 1 at 2**10 (a save and a linen
  train step)."""
  return _shared_run(tmp_path_factory, "two", lambda out: _train(
      out, 2, 2, TWO_CASES, RESUME_CASES, kill=True))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One process with the 4 devices of `two` and of the slow runs (the one
  device per process cases on 2 of them), the fault in the rows of the
  last of 2 processes (of 4 for the four processes' case)."""
  return _shared_run(tmp_path_factory, "reference", lambda out: (
      _reference(out, 2, 2, FAST_CASES + (FP8_CASE,) + ONE_CASES
                 + FOUR_CASES)))


def _same_bytes(a, b) -> bool:
  return len(a) == len(b) and all(
      x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def _scaling(record):
  """What the loss scaling decided at each step (exact, rounding-free)."""
  return [(s["grads_finite"], s["loss_scale"], s["skipped_steps"], s["steps"])
          for s in record["steps"]]


def check_skips_and_agreement(out, case, num):
  runs = load(out, case, num)
  records = [r for r, _ in runs]
  # The NaN is in the last process's shard of the batch, and only there.
  assert [r["fault_rows_here"] for r in records] == (
      [False] * (num - 1) + [True])
  assert all(r["processes"] == num for r in records)
  for r in records:
    finite = [s["grads_finite"] for s in r["steps"]]
    assert [i for i, f in enumerate(finite) if not f] == list(FAULT_STEPS)
    assert r["steps"][-1]["skipped_steps"] == len(FAULT_STEPS)
    assert r["steps"][-1]["steps"] == STEPS
    assert r["compiles"] == 1  # skipping is data flow: one program
  # Every process saw the same steps, scale, counters and losses, and
  # holds the same final state, bit for bit.
  for r, arrays in runs[1:]:
    assert r["steps"] == records[0]["steps"]
    assert _same_bytes(arrays, runs[0][1])
  return runs


# The one-process run on the same devices, when the reduction order differs
# (2 devices per process: XLA adds each process's two partial gradients, then
# gloo adds the processes' sums, (g0 + g1) + (g2 + g3), where one process
# with 4 devices adds them in its own order). The gradients then differ in
# their last bits; float16 compute can round an activation the other way,
# which changes a gradient a little more. Adam divides by sqrt(v): it moves
# an element by about lr per step whatever the size of its gradient, so an
# element whose gradient is near 0 can move the other way in one run. Hence
# three bounds after the 4 applied steps (lr 1e-2):
#   every element: 2 * lr * 4 (the two runs moving apart at every step);
#   measured at most 0.04 (the GPT under float16, 4 processes, when this
#   file ran it there), 7e-5 for the MLP under float16, 6e-8 under
#   bfloat16;
#   relative L2 norm of the difference: 1e-4 (measured at most 6e-6);
#   elements more than 1e-3 apart: 1% (measured at most 0.09%);
# and the losses agree to 1e-3 relative (measured at most 5e-5). A skipped
# step or a wrong scale changes every element by a whole step. With one
# device per process the orders agree and the runs are bitwise equal (the
# slow test).
LR, APPLIED = 1e-2, STEPS - len(FAULT_STEPS)


def check_reorder_bound(runs, ref_record, ref_arrays):
  record, arrays = runs[0]
  assert _scaling(record) == _scaling(ref_record)  # exact
  for s, t in zip(record["steps"], ref_record["steps"]):
    assert np.isnan(s["loss"]) == np.isnan(t["loss"])
    assert np.isnan(s["loss"]) or abs(s["loss"] - t["loss"]) <= 1e-3 * abs(
        t["loss"])
  diffs = [np.abs(x.astype(np.float64) - y.astype(np.float64))
           for x, y in zip(arrays, ref_arrays)]
  assert max(float(np.max(d)) for d in diffs) <= 2 * LR * APPLIED
  norm = np.sqrt(sum(float(np.sum(y.astype(np.float64) ** 2))
                     for y in ref_arrays))
  assert np.sqrt(sum(float(np.sum(d ** 2)) for d in diffs)) <= 1e-4 * norm
  far = sum(int(np.sum(d > 1e-3)) for d in diffs)
  assert far <= 0.01 * sum(d.size for d in diffs)


@pytest.mark.parametrize("case", FAST_CASES)
def test_every_process_skips_exactly_the_nan_steps(two, case):
  check_skips_and_agreement(two, case, 2)


@pytest.mark.parametrize("case", FAST_CASES)
def test_matches_the_single_process_run(two, reference, case):
  runs = load(two, case, 2)
  ref_record, ref_arrays = load(reference, case, 1)[0]
  assert ref_record["processes"] == 1 and ref_record["devices"] == 4
  assert runs[0][0]["devices"] == 4
  # The skip decisions, scales and counters are exact; the losses and
  # params differ by the reduction order only.
  check_reorder_bound(runs, ref_record, ref_arrays)
  if "fsdp" in case:
    assert any(runs[0][0]["state_sharded"])  # really split over processes


@pytest.mark.parametrize("case", (FP8_CASE,))
def test_resumes_bitwise_from_a_multiprocess_checkpoint(two, case):
  # (FSDP under bfloat16 and data parallel under float16: on the Explicit
  # axis, test_explicit_mesh_across_processes.)
  check_resume(two, case)


def check_resume(out, case):
  full = load(out, case, 2)
  resumed = load(os.path.join(out, "resumed"), case, 2)
  for (r, arrays), (full_r, full_arrays) in zip(resumed, full):
    assert r["first_step"] == 3
    assert r["steps"] == full_r["steps"][3:]  # faults after the resume too
    assert _same_bytes(arrays, full_arrays)


@pytest.mark.parametrize("case", EXPLICIT_CASES)
def test_explicit_mesh_across_processes(two, case):
  # bf16 (FSDP) and float16 with loss scaling (data parallel) over an
  # Explicit axis spanning both processes: every process skips the NaN steps
  # together, and the run resumes bit for bit from its checkpoint.
  check_skips_and_agreement(two, case, 2)
  check_resume(two, case)


def test_fp8_amax_histories_are_global(two, reference):
  runs = check_skips_and_agreement(two, FP8_CASE, 2)
  ref_record, ref_arrays = load(reference, FP8_CASE, 1)[0]
  assert all(runs[0][0]["fp8_histories_split"])  # over the processes
  histories = [r["fp8_histories"] for r, _ in runs]
  assert histories[0] == histories[1] == ref_record["fp8_histories"]
  # Layer 0's newest input amax is the global batch's (bfloat16-rounded),
  # which lives on process 1: not process 0's own.
  newest = histories[0]["layers/0"]["lhs"][0]
  global_amax = runs[0][0]["fp8_global_input_amax"]
  local = runs[0][0]["fp8_process_input_amax"]
  assert abs(newest - global_amax) <= 2**-7 * global_amax
  assert local[1] == global_amax and local[0] < global_amax / 2
  check_reorder_bound(runs, ref_record, ref_arrays)


def test_a_process_killed_mid_save_leaves_the_last_committed_step(two):
  with open(os.path.join(two, "codes.json")) as f:
    codes = json.load(f)
  # Process 1 killed itself once step 2's temporary directory existed;
  # process 0 was still waiting for it, and never finished the save.
  assert codes[1] == -signal.SIGKILL and codes[0] != 0
  with open(os.path.join(two, "kill.p1.json")) as f:
    assert json.load(f)["saw"] == ["2.orbax-checkpoint-tmp"]
  assert not os.path.exists(os.path.join(two, "kill.p0.json"))
  for record, _ in load(os.path.join(two, "resumed"), "after-kill", 2):
    assert record["latest_step"] == 1 and record["restored_step"] == 1
    assert "2" not in record["listing"]
    assert "2.orbax-checkpoint-tmp" in record["listing"]
    assert record["restored_equal"] and all(record["restored_equal"])
    # Into a target without shardings: each process its own whole copy.
    assert record["unsharded_equal"] and all(record["unsharded_equal"])


def test_replicated_arrays_are_checksummed_across_processes(two):
  record, _ = load(os.path.join(two, "resumed"), "after-kill", 2)[0]
  # The loss scale and counters, replicated over both processes, get their
  # CRC-32; the split params and moments are checked by orbax alone.
  assert "['opt_state'].loss_scale.loss_scale" in record["checksummed"]
  assert not any(name.startswith("['params']")
                 for name in record["checksummed"])


def test_split_arrays_are_checksummed_shard_by_shard(two):
  records = [r for r, _ in load(os.path.join(two, "resumed"), "after-kill", 2)]
  # ['params']['w'] (512 x 512) is split over the 4 devices of 2 processes:
  # one CRC-32 per shard, gathered from the processes that hold them.
  shards = records[0]["shards_checksummed"]["['params']['w']"]
  assert shards == sorted(f"{i * 128}:{(i + 1) * 128},0:512"
                          for i in range(4))
  assert records[1]["shards_checksummed"] == records[0]["shards_checksummed"]
  # Another save's array files in place of the step's: every process
  # refuses the restore, naming the array and the shard.
  # Into the saved shardings, and whole into each process.
  errors = [r["errors"] for r, _ in load(os.path.join(two, "resumed"),
                                         "swapped", 2)]
  assert errors[0] == errors[1]
  assert len(errors[0]) == 2 and all(errors[0]), errors
  for e in errors[0]:
    assert e["step"] == 1 and e["where"] == (
        "['params']['w'] (shard [0:128,0:512])")
    assert "does not match its checksum" in e["message"]


def test_save_refuses_arrays_of_one_process(two):
  for record, _ in load(two, "local-save", 2):
    assert record["error"] and "multi-process run (2 processes)" in (
        record["error"])
    assert ".loss_scale.loss_scale" in record["error"]


def test_processes_that_disagree_on_the_loss_scale_are_refused(two):
  # (#35) They trained on without a word; the save succeeded and its
  # restore either blamed damaged files or kept process 0's scale.
  records = [r for r, _ in load(os.path.join(two, "resumed"), "disagree", 2)]
  assert records[0] == records[1]
  save = records[0]["save"]
  # (#49) The one error checkpoint promises, with its reason.
  assert save["type"] == "CheckpointError" and save["reason"] == "mismatch"
  assert save["message"].startswith("cannot save checkpoint step 0 in ")
  assert ("the processes hold different copies of state that is replicated "
          "over them (one value to JAX): ['opt_state'].loss_scale.loss_scale:"
          " process 0 = 32768 vs process 1 = 1024") in save["message"]
  assert "['params']" not in save["message"]  # The params agree.
  assert "Start every process from the same state" in save["message"]
  step = records[0]["linen_step"]
  assert step.startswith("the train step's first call: the processes hold "
                         "different copies"), step
  assert ".loss_scale.loss_scale: process 0 = 32768 vs process 1 = 1024" in (
      step)
  # (#49) A hand-written step's init, outside jit, refuses the two scales
  # before any step (they trained 12 steps apart without a word).
  init = records[0]["init"]
  assert init.startswith("loss_scaling(...).init: the processes were given "
                         "different settings: loss_scale: process 0 = 32768 "
                         "vs process 1 = 1024. Each process would train "
                         "apart"), init
  # With the same scale, the same save, step and init go through.
  assert records[0]["agree_steps"] == 1
  assert records[0]["agree_init"] == 0


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory):
  def runs(out):
    # One device per process: the same reduction order as one process.
    launch(os.path.join(str(out), "one"), 2, 1, "--cases",
           ",".join(ONE_CASES), timeout=SLOW_TIMEOUT)
    # Four processes, one device each.
    launch(os.path.join(str(out), "four"), 4, 1, "--cases",
           ",".join(FOUR_CASES), timeout=SLOW_TIMEOUT)
  return _shared_run(tmp_path_factory, "slow", runs)


@pytest.mark.parametrize("case", ONE_CASES)
def test_one_device_per_process_is_bitwise_the_single_process_run(
    slow_runs, reference, case):
  # (FP8's histories against one process, bit for bit: `two`'s.)
  runs = check_skips_and_agreement(os.path.join(slow_runs, "one"), case, 2)
  ref_record, ref_arrays = load(reference, case, 1)[0]
  assert ref_record["devices"] == runs[0][0]["devices"] == 2
  assert ref_record["steps"] == runs[0][0]["steps"]
  assert _same_bytes(runs[0][1], ref_arrays)


@pytest.mark.parametrize("case", FOUR_CASES)
def test_four_processes(slow_runs, reference, case):
  runs = check_skips_and_agreement(os.path.join(slow_runs, "four"), case, 4)
  ref_record, ref_arrays = load(reference, case, 1)[0]
  assert ref_record["devices"] == runs[0][0]["devices"] == 4
  check_reorder_bound(runs, ref_record, ref_arrays)
