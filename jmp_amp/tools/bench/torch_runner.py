"""The PyTorch AMP recipe itself, as the bench's torch rows.

`run_torch_mode` trains the recipe's MLP in PyTorch from the same initial
weights, on the same batches and with the same SGD as the JAX rows, in float32,
with autocast to float16, and with autocast + GradScaler, and returns a record
in the JAX rows' format. torch is imported only here, when these rows run.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable

import numpy as np

from jmp_amp.tools.bench import timing
from jmp_amp.tools.bench import workloads


def _torch_device():
  import torch  # pylint: disable=g-import-not-at-top
  return "cuda" if torch.cuda.is_available() else "cpu"


def run_torch_mode(name: str, cfg: workloads.Config,
                   progress: Callable[[], None] = lambda: None
                   ) -> dict[str, Any]:
  """The recipe in PyTorch: the same initial weights and batches as JAX's."""
  import torch  # pylint: disable=g-import-not-at-top

  if cfg.model != "mlp":
    raise ValueError("--compare-torch supports --model mlp only")
  device = _torch_device()
  layers = []
  for i, (kernel, bias) in enumerate(workloads.mlp_initial_weights(cfg)):
    linear = torch.nn.Linear(*kernel.shape)
    with torch.no_grad():
      linear.weight.copy_(torch.from_numpy(kernel.T.copy()))
      linear.bias.copy_(torch.from_numpy(bias.copy()))
    layers += [linear] if i == cfg.layers - 1 else [linear, torch.nn.ReLU()]
  initial = torch.nn.Sequential(*layers).to(device)
  xs, ys = workloads.mlp_data(cfg)
  data = [(torch.from_numpy(np.asarray(x)).to(device),
           torch.from_numpy(np.asarray(y)).to(device)) for x, y in zip(xs, ys)]
  use_amp = name != "torch-float32"
  half = torch.float16  # the recipe's dtype, on every device
  with torch.autocast(device_type=device, dtype=half, enabled=use_amp):
    used = str(initial[0](data[0][0][:1]).dtype).replace("torch.", "")
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  if device == "cuda":
    torch.cuda.reset_peak_memory_stats()

  repeat_medians, total_s = [], 0.0
  for _ in range(cfg.repeats):
    net = copy.deepcopy(initial)  # every repeat from the same weights
    opt = torch.optim.SGD(net.parameters(), lr=cfg.lr)
    scaler = torch.amp.GradScaler(device, init_scale=cfg.init_scale,
                                  enabled=name == "torch-autocast+scaler")
    times, skipped = [], 0
    start = time.perf_counter()
    for i in range(cfg.steps):
      x, y = data[i % len(data)]
      t = time.perf_counter()
      before = scaler.get_scale() if scaler.is_enabled() else None
      with torch.autocast(device_type=device, dtype=half, enabled=use_amp):
        loss = torch.nn.functional.mse_loss(net(x).float(), y)
      scaler.scale(loss).backward()
      scaler.step(opt)
      scaler.update()
      opt.zero_grad(set_to_none=True)
      sync()
      if before is not None and scaler.get_scale() < before:
        skipped += 1
      if i >= cfg.warmup:
        times.append(time.perf_counter() - t)
      progress()
    total_s += time.perf_counter() - start
    repeat_medians.append(statistics.median(times))
  median = statistics.median(repeat_medians)
  flops = 6.0 * cfg.batch_size * cfg.width * cfg.width * cfg.layers
  peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
  return dict(
      status="ok", framework="torch", compile_s=0.0, total_s=total_s,
      **timing.timing_fields(repeat_medians, cfg.batch_size),
      peak_memory_bytes=peak, memory_source="device" if peak else None,
      compiled_memory=None, final_loss=float(loss.detach().float().cpu()),
      skipped_steps=skipped,
      loss_scale=float(scaler.get_scale()) if scaler.is_enabled() else None,
      matmuls={"autocast_dtype": used if use_amp else "float32"},
      tflops=flops / median / 1e12,
  )
