"""benchmarks/compile_time.py: the report a run of the whole-step feature
pairs writes (issue #33), also part-way, the workloads it refuses, and the
loss-scaling steps it compiles."""

import json

import pytest

import helpers
import jmp_amp


@pytest.fixture(scope="module")
def script():
  return helpers.benchmark("compile_time")


def test_a_pair_is_reported_once_both_of_its_variants_are_compiled(script):
  seconds = {"bf16": [10.0, 8.0], "telemetry": [12.0],
             "fp8 current": [], "by hand (plain adamw)": [9.0]}
  report = script._features_report(
      seconds, {"bf16": [40.0, 41.0], "telemetry": [50.0],
                "fp8 current": [], "by hand (plain adamw)": [39.0]}, rounds=2)
  assert set(report["results"]) == {"bf16", "telemetry",
                                    "by hand (plain adamw)"}
  assert report["results"]["bf16"]["seconds_best"] == 8.0
  assert report["results"]["bf16"]["cpu_seconds_all"] == [40.0, 41.0]
  assert set(report["pairs"]) == {"telemetry"}  # loss scaling: not yet
  assert report["pairs"]["telemetry"]["ratio_best"] == pytest.approx(1.5)
  assert report["pairs"]["telemetry"]["limit"] == 1.3
  assert report["floors"] == {}  # 16-bit state: neither side yet
  json.dumps(report)


def test_a_floor_is_reported_against_its_features_baseline(script):
  seconds = {"bf16": [10.0], "16-bit state and params": [20.0],
             "16-bit, round to nearest": [11.0]}
  report = script._features_report(seconds, None, rounds=1,
                                   workload="gpt16-scanned-features")
  floor = report["floors"]["16-bit state and params"]
  assert floor == {"variant": "16-bit, round to nearest", "without": "bf16",
                   "ratio_best": pytest.approx(1.1)}
  assert report["pairs"]["16-bit state and params"]["ratio_best"] == 2.0
  assert report["workload"] == "gpt16-scanned-features"
  assert "nnx.scan" in report["step"]


def test_each_compile_rewrites_the_partial_report(script, monkeypatch):
  times = iter(range(10, 100))
  monkeypatch.setattr(script, "feature_compile_seconds",
                      lambda name, target, scan_layers: float(next(times)))
  seen = []
  report = script.run_features(1, "cpu", partial=seen.append)
  variants = script.feature_variants()
  assert set(variants) >= {v for pair in script.FEATURE_PAIRS.values()
                           for v in pair} | set(script.FEATURE_FLOORS.values())
  assert len(seen) == len(variants)
  assert [len(r["results"]) for r in seen] == list(range(1, len(variants) + 1))
  assert seen[-1] == report and set(report["pairs"]) == set(
      script.FEATURE_PAIRS)
  assert set(report["floors"]) == set(script.FEATURE_FLOORS)
  assert "cpu_seconds_all" not in report["results"]["bf16"]


@pytest.mark.parametrize("argv, named", [
    (["--workloads", "gpt16"], "unknown workload 'gpt16'"),
    (["--workloads", "gpt16-features", "--variants", "bf16,fp16"],
     "unknown --variants 'fp16': it takes .*finite check only"),
    (["--workloads", "adam300", "--variants", "bf16"],
     "--variants needs --workloads gpt16-features"),
    (["--target", "gpu", "--workloads", "adam300"], "--target gpu measures"),
])
def test_a_workload_it_cannot_run_is_refused_by_name(script, argv, named):
  with pytest.raises(SystemExit, match=named):
    script.main(argv)


def test_a_run_of_some_variants_reports_the_pairs_they_make(script,
                                                           monkeypatch):
  compiled = []
  monkeypatch.setattr(script, "feature_compile_seconds",
                      lambda name, target, scan_layers: compiled.append(name)
                      or 10.0 + len(compiled))
  report = script.run_features(2, "cpu", variants=[
      "loss scaling", "by hand (plain adamw)", "finite check only"])
  assert sorted(compiled) == sorted(["loss scaling", "by hand (plain adamw)",
                                     "finite check only"] * 2)
  assert set(report["pairs"]) == {"loss scaling"}
  assert set(report["floors"]) == {"loss scaling"}


@pytest.mark.bench
def test_loss_scalings_floor_checks_every_gradient_and_never_skips(script):
  # One block: the floor's step has the finite check (an is_finite per
  # gradient, beside the loss's own) that the step by hand lacks, and not
  # the conditional that skips (on a CPU a cond) that the bf16 step has.
  def lowered(variant):
    jitted, args = script._feature_step(variant, num_layers=1)
    return jitted.lower(*args).as_text()
  text = {v: lowered(v) for v in ("by hand (plain adamw)",
                                  "finite check only", "bf16")}
  count = lambda op: {v: t.count(op) for v, t in text.items()}
  checks, conds = count("stablehlo.is_finite"), count("stablehlo.case")
  assert checks["finite check only"] > checks["by hand (plain adamw)"]
  assert checks["finite check only"] == checks["bf16"]
  assert (conds["finite check only"] == conds["by hand (plain adamw)"]
          < conds["bf16"])


@pytest.mark.bench
def test_loss_scalings_kernels_on_an_h100_do_not_grow_with_depth(script):
  # The check's unscale and the update's are one value; merged into one
  # HLO, XLA wrote it out as a kernel of its own per weight gradient (a
  # 16-block GPT: 18 more kernels than the bf16 step; 8 blocks: 7 more than
  # 2 blocks). What loss scaling adds is the scale's few scalar kernels.
  helpers.h100_target_or_skip()

  def kernels(variant, blocks):
    jitted, args = script._feature_step(variant, num_layers=blocks)
    return jmp_amp.gpu_report(jitted, *args, gemm="default").kernels
  added = {blocks: kernels("loss scaling", blocks) - kernels("bf16", blocks)
           for blocks in (2, 8)}
  assert added[8] <= added[2] + 2, added
