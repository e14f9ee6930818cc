#!/usr/bin/env python3
"""The GPT of issue #34 for the device check: steps, model FLOPs, peaks, torch.

The pieces benchmarks/gpu_check.py calls for the GPT rows:

* `build_step(mode, size)`: the jitted adamw train step of `jmp_amp.models.GPT`
  (flash attention, ``attention="fused"``), its donated state and batch, for
  a mode of `jmp-amp bench` (``"mixed_bfloat16"``, ``"mixed_float16"`` with
  dynamic loss scaling, ``"autocast-mixed_bfloat16"``, ``"float8"``...), at
  the issue's GPU size (``"gpu"``: d_model 2048, 16 heads, 4 blocks, T 1024,
  batch 8, vocab 32768) or a tiny CPU size (``"cpu"``);
* `time_jax(mode, size)`: that step's median ms/step and the device's peak
  memory;
* `model_flops_per_step(size)`: PaLM's model FLOPs, ``6 N D`` plus
  attention's ``12 L H Q T`` per token;
* `PEAK_BF16_FLOPS` / `peak_bf16_flops(device_kind)`: dense bf16 peaks, and
  `peak_share` the model FLOP/s as a share of one;
* `torch_rows(size)`: the same GPT in PyTorch with
  ``scaled_dot_product_attention``, under autocast, eager and under
  ``torch.compile``: ms/step and peak memory; empty, with the reason, where
  torch is not importable.

Run it alone for a quick table (``--size cpu`` on a laptop)::

    python benchmarks/gpt_bench.py --size cpu --modes float32 mixed_bfloat16
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

SIZES: dict[str, dict[str, Any]] = {
    # Issue #34's model (measured there on an H200).
    "gpu": dict(vocab_size=32768, d_model=2048, num_heads=16, num_layers=4,
                max_len=1024, batch_size=8),
    # Head dim 16: a few seconds a step on a CPU.
    "cpu": dict(vocab_size=256, d_model=64, num_heads=4, num_layers=2,
                max_len=64, batch_size=2),
}
LR, WEIGHT_DECAY = 3e-4, 0.1

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from NVIDIA's data
# sheets; matched against `jax.Device.device_kind` / torch's device name,
# first match wins (so "H100 PCIe" before "H100").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4e12),
    ("H200", 989.4e12),      # the H100 SXM's tensor cores, more memory
    ("H100 PCIe", 756.5e12),
    ("H100 NVL", 835.5e12),
    ("H100", 989.4e12),      # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312e12),
    ("L40S", 362.1e12),
)


def peak_bf16_flops(device_kind: str) -> Optional[float]:
  """The dense bf16 peak of a device named `device_kind`, or None if unknown."""
  for name, peak in PEAK_BF16_FLOPS:
    if name.lower() in device_kind.lower():
      return peak
  return None


def config(size: str) -> dict[str, Any]:
  if size not in SIZES:
    raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
  return dict(SIZES[size])


def _model(size: str, attention: str = "fused", seed: int = 0):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import gpt as gpt_lib  # pylint: disable=g-import-not-at-top
  c = config(size)
  return gpt_lib.GPT(c["vocab_size"], c["d_model"], c["num_heads"],
                     c["num_layers"], c["max_len"], attention=attention,
                     rngs=nnx.Rngs(seed))


def matmul_params(size: str) -> int:
  """N of ``6 N D``: the parameters of the GPT but its position table.

  The position embedding is a lookup, no matmul; the token embedding counts
  once, for the tied output head (nanoGPT's convention, and the one that
  gives the issue's 466 TFLOP/s at 30.1 ms).
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model = nnx.eval_shape(functools.partial(_model, size))
  total = sum(int(np.prod(p.shape)) for p in
              jax.tree.leaves(nnx.state(model, nnx.Param)))
  return total - int(np.prod(model.pos_embed.embedding.shape))


def model_flops_per_step(size: str) -> int:
  """PaLM's model FLOPs of one train step (its appendix B).

  ``D (6 N + 12 L H Q T)`` for ``D = batch * T`` tokens: forward and
  backward of every matmul weight (`matmul_params`) plus the attention's
  two contractions per layer (L layers, H heads of dim Q, over T keys),
  the whole T x T square, as PaLM counts it. Rematerialisation is not
  counted: these are model FLOPs, not hardware FLOPs.
  """
  c = config(size)
  tokens = c["batch_size"] * c["max_len"]
  attention = 12 * c["num_layers"] * c["d_model"] * c["max_len"]
  return tokens * (6 * matmul_params(size) + attention)


def peak_share(ms_per_step: float, size: str, device_kind: str
               ) -> Optional[float]:
  """Model FLOP/s of a step of `ms_per_step` as a share of the bf16 peak."""
  peak = peak_bf16_flops(device_kind)
  if peak is None or not ms_per_step:
    return None
  return model_flops_per_step(size) / (ms_per_step / 1e3) / peak


def tokens(size: str, seed: int = 0) -> jax.Array:
  from jmp_amp.models import data as data_lib  # pylint: disable=g-import-not-at-top
  c = config(size)
  return jnp.asarray(data_lib.token_batch(c["batch_size"], c["max_len"],
                                          c["vocab_size"], seed=seed))


def build_step(mode: str, size: str = "gpu", attention: str = "fused",
               loss_fn: Optional[Callable[..., Any]] = None
               ) -> tuple[Any, Any, tuple[jax.Array, jax.Array]]:
  """(jitted step, state, batch) of the GPT's adamw step in `mode`.

  Args:
    mode: a mode of `jmp_amp.tools.bench.workloads.JAX_MODES`.
    size: "gpu" (the issue's model) or "cpu" (tiny).
    attention: the GPT's attention knob, "fused" or "einsum".
    loss_fn: ``(logits, tokens) -> loss``; default `jmp_amp.models.lm_loss`.

  Returns:
    ``step(state, batch) -> (state, metrics)`` (state donated), the initial
    state and the batch ``(tokens, tokens)``.
  """
  from jmp_amp.models import gpt as gpt_lib  # pylint: disable=g-import-not-at-top

  from jmp_amp.tools.bench import workloads  # pylint: disable=g-import-not-at-top
  if mode not in workloads.JAX_MODES:
    raise ValueError(f"mode must be one of {list(workloads.JAX_MODES)}, got "
                     f"{mode!r}")
  batch = tokens(size)
  step, state = workloads.nnx_step(
      _model(size, attention), loss_fn or gpt_lib.lm_loss,
      workloads.JAX_MODES[mode],
      optax.adamw(LR, weight_decay=WEIGHT_DECAY), example_args=(batch,))
  return step, state, (batch, batch)


def _median_ms(run: Callable[[], Any], sync: Callable[[Any], Any],
               steps: int, warmup: int) -> float:
  times = []
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    sync(run())
    if i >= warmup:
      times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def time_jax(mode: str, size: str = "gpu", steps: int = 20, warmup: int = 3,
             attention: str = "fused") -> dict[str, Any]:
  """Median ms/step of the JAX step in `mode`, its peak memory, its loss.

  Every step is synchronised (`block_until_ready`); the peak is the device's
  ``peak_bytes_in_use`` (None on the CPU, which keeps none), so run one
  mode per process for a clean peak.
  """
  from jmp_amp.tools.bench import workloads  # pylint: disable=g-import-not-at-top
  with workloads.precision_context(mode):
    step, state, batch = build_step(mode, size, attention)
    box = [state]

    def run():
      box[0], metrics = step(box[0], batch)
      return metrics

    ms = _median_ms(run, jax.block_until_ready, steps, warmup)
    loss = float(run()["loss"])
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  return {"name": f"jax {mode}", "mode": mode, "size": size,
          "device": device.device_kind, "ms_per_step": ms,
          "peak_bytes": stats.get("peak_bytes_in_use"), "loss": loss,
          "model_flops_per_step": model_flops_per_step(size),
          "peak_share": peak_share(ms, size, device.device_kind)}


# ---- The same GPT in PyTorch. ----------------------------------------------

TORCH_MODES = ("torch-eager-sdpa", "torch-compile-sdpa")


def _torch_gpt(size: str):
  """The GPT of jmp_amp.models in PyTorch, attention through SDPA."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  from torch.nn import functional as F  # pylint: disable=g-import-not-at-top
  c = config(size)
  d, heads = c["d_model"], c["num_heads"]

  class Block(nn.Module):

    def __init__(self):
      super().__init__()
      self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
      self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
      self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
      b, t, _ = x.shape
      q, k, v = (a.view(b, t, heads, d // heads).transpose(1, 2)
                 for a in self.qkv(self.ln1(x)).split(d, dim=-1))
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
      # jax.nn.gelu's default is the tanh approximation.
      return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

  class GPT(nn.Module):

    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(c["vocab_size"], d)
      self.pos_embed = nn.Embedding(c["max_len"], d)
      self.blocks = nn.ModuleList(Block() for _ in range(c["num_layers"]))
      self.ln_f = nn.LayerNorm(d, eps=1e-6)
      for emb in (self.embed, self.pos_embed):
        nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx):
      pos = torch.arange(idx.shape[1], device=idx.device)
      x = self.embed(idx) + self.pos_embed(pos)
      for block in self.blocks:
        x = block(x)
      return self.ln_f(x) @ self.embed.weight.T  # tied head

  return GPT()


def torch_param_count(size: str) -> int:
  """The torch GPT's parameters less its position table (= `matmul_params`)."""
  net = _torch_gpt(size)
  return (sum(p.numel() for p in net.parameters())
          - net.pos_embed.weight.numel())


def torch_rows(size: str = "gpu", modes: Sequence[str] = TORCH_MODES,
               dtype: str = "bfloat16", steps: int = 20, warmup: int = 3
               ) -> tuple[list[dict[str, Any]], Optional[str]]:
  """The torch GPT's adamw step under autocast: ms/step and peak memory.

  Eager and with the model under ``torch.compile``, each from the same
  initial weights, on the issue's model (`size` "gpu") or the tiny one
  ("cpu": eager only makes sense there, inductor compiles for minutes).
  float16 adds a GradScaler, as torch's AMP recipe does.

  Returns:
    (rows, None), or ([], why) when torch is not importable.
  """
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return [], f"torch is not importable: {e}"
  from torch.nn import functional as F  # pylint: disable=g-import-not-at-top
  for mode in modes:
    if mode not in TORCH_MODES:
      raise ValueError(f"torch modes are {TORCH_MODES}, got {mode!r}")
  device = "cuda" if torch.cuda.is_available() else "cpu"
  half = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
  torch.manual_seed(0)
  initial = _torch_gpt(size).to(device)
  idx = torch.from_numpy(np.array(tokens(size))).long().to(device)
  labels = torch.cat([idx[:, 1:], idx[:, :1]], dim=1)
  weights = torch.ones_like(idx, dtype=torch.float32)
  weights[:, -1] = 0  # as models.lm_loss: the last position has no target
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  name = (torch.cuda.get_device_name() if device == "cuda" else "cpu")
  rows = []
  for mode in modes:
    net = copy.deepcopy(initial)
    opt = torch.optim.AdamW(net.parameters(), lr=LR,
                            weight_decay=WEIGHT_DECAY,
                            fused=device == "cuda")
    scaler = torch.amp.GradScaler(device, enabled=half == torch.float16)

    # As nanoGPT does: the model compiled (forward and, through
    # AOTAutograd, backward), the optimizer step eager (fused AdamW on a GPU).
    model = torch.compile(net) if mode == "torch-compile-sdpa" else net

    def step(model=model, opt=opt, scaler=scaler):
      with torch.autocast(device_type=device, dtype=half):
        logits = model(idx)
        losses = F.cross_entropy(logits.float().flatten(0, 1),
                                 labels.flatten(), reduction="none")
        loss = (losses * weights.flatten()).sum() / weights.sum()
      opt.zero_grad(set_to_none=True)
      scaler.scale(loss).backward()
      scaler.step(opt)
      scaler.update()
      return loss.detach()

    if device == "cuda":
      torch.cuda.empty_cache()
      torch.cuda.reset_peak_memory_stats()
    box = [None]

    def run(step=step, box=box):
      box[0] = step()

    ms = _median_ms(run, lambda _: sync(), steps, warmup)
    rows.append({
        "name": f"{mode} ({dtype} autocast)", "mode": mode, "size": size,
        "device": name, "ms_per_step": ms, "loss": float(box[0]),
        "peak_bytes": (torch.cuda.max_memory_allocated()
                       if device == "cuda" else None),
        "torch_version": torch.__version__,
        "model_flops_per_step": model_flops_per_step(size),
        "peak_share": peak_share(ms, size, name)})
  return rows, None


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="gpu", choices=sorted(SIZES))
  from jmp_amp.tools.bench import workloads  # pylint: disable=g-import-not-at-top
  parser.add_argument("--modes", nargs="*", choices=list(workloads.JAX_MODES),
                      default=["mixed_bfloat16", "mixed_float16"])
  parser.add_argument("--torch", nargs="*", default=list(TORCH_MODES),
                      choices=TORCH_MODES)
  parser.add_argument("--steps", type=int, default=20)
  args = parser.parse_args(argv)
  rows = [time_jax(m, args.size, args.steps) for m in args.modes]
  more, why = torch_rows(args.size, args.torch, steps=args.steps)
  rows += more
  print(f"GPT {args.size}: {config(args.size)}; "
        f"{model_flops_per_step(args.size) / 1e12:.2f} TFLOP per step")
  for r in rows:
    share = r["peak_share"]
    peak = r["peak_bytes"]
    print(f"{r['name']:<36}{r['ms_per_step']:>10.2f} ms"
          f"{'' if share is None else f'{100 * share:>8.1f} % of bf16 peak'}"
          f"{'' if peak is None else f'{peak / 1e9:>8.2f} GB'}")
  if why:
    print("no torch rows:", why)


if __name__ == "__main__":
  main()
