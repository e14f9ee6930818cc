"""The Llama of issue #53 for the device check: model, FLOPs, batch, torch.

The pieces benchmarks/gpu_check.py calls for its ``llama`` workload:

* `SIZES` / `config(size)`: `jmp_amp.models.Llama`'s ``"1b"`` preset at
  T 2048, batch 8 (``"gpu"``), or its ``"small"`` preset (``"cpu"``); the
  blocks scanned and rematerialised (`REMAT`);
* `model(size)`, `tokens(size, batch_size)`;
* `model_flops_per_step(size, batch_size)`: PaLM's model FLOPs, ``6 N D``
  plus attention's ``12 L H Q T`` per token;
* `largest_batch(fits, start, cap)`: the largest power of two that fits,
  and `memory_fit`, a mode's device peak and largest batch;
* `summary(rows)`: the ratios issue #53 sets targets for;
* `torch_rows(size)`: the same Llama in PyTorch
  (``scaled_dot_product_attention`` with grouped-query heads, fused AdamW)
  under ``torch.compile`` with bf16 autocast, and with torchao's float8
  training (tensorwise and rowwise scaling, the head kept bf16): ms/step
  and peak memory; empty, with the reason, where torch (or torchao) is not
  importable.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_bench  # pylint: disable=g-import-not-at-top,wrong-import-position

# Each block saves its projections' outputs and recomputes the rest (norms,
# rotary, attention, SwiGLU's product) in the backward pass: the 1b model's
# activations at batch 8 x 2048 stay a few GB per mode in bfloat16.
REMAT = "dots_with_no_batch_dims_saveable"
SIZES: dict[str, dict[str, Any]] = {
    "gpu": dict(preset="1b", batch_size=8),
    "cpu": dict(preset="small", batch_size=2),
}
LR, WEIGHT_DECAY = 3e-4, 0.1
peak_bf16_flops = gpt_bench.peak_bf16_flops


def config(size: str):
  from jmp_amp.models import LlamaConfig  # pylint: disable=g-import-not-at-top
  if size not in SIZES:
    raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
  return LlamaConfig.preset(SIZES[size]["preset"])


def model(size: str, seed: int = 0):
  """The scanned, rematerialised `jmp_amp.models.Llama` of `size`."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import Llama  # pylint: disable=g-import-not-at-top
  return Llama(config(size), scan_layers=True, remat=REMAT,
               rngs=nnx.Rngs(seed))


def tokens(size: str, batch_size: Optional[int] = None, seed: int = 0):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmp_amp.models import data as data_lib  # pylint: disable=g-import-not-at-top
  c = config(size)
  return jnp.asarray(data_lib.token_batch(
      batch_size or SIZES[size]["batch_size"], c.max_len, c.vocab_size,
      seed=seed))


def matmul_params(size: str) -> int:
  """N of ``6 N D``: every parameter but the token embedding (a lookup; the
  untied head is a matmul and counts)."""
  c = config(size)
  return c.num_params() - c.vocab_size * c.d_model


def model_flops_per_step(size: str, batch_size: Optional[int] = None) -> int:
  """PaLM's model FLOPs of one train step: ``D (6 N + 12 L d T)`` for
  ``D = batch * T`` tokens (attention's two contractions over the whole
  T x T square, forward and backward; rematerialisation not counted)."""
  c = config(size)
  tokens_per_step = (batch_size or SIZES[size]["batch_size"]) * c.max_len
  attention = 12 * c.num_layers * c.d_model * c.max_len
  return tokens_per_step * (6 * matmul_params(size) + attention)


def largest_batch(fits: Callable[[int], bool], start: int, cap: int
                  ) -> Optional[int]:
  """The largest power of two from `start` to `cap` whose ``fits(batch)``
  holds, trying them in increasing order up to the first that does not; None
  if `start` does not fit."""
  best, batch = None, start
  while batch <= cap and fits(batch):
    best, batch = batch, 2 * batch
  return best


def memory_fit(name: str, step: Any, state: Any, batch: Any,
               sizes: dict[str, Any], memory_limit: Optional[int],
               options: Optional[dict[str, Any]],
               memory_of: Callable[[Any], Optional[int]],
               compiled: Any = None) -> dict[str, Any]:
  """A mode's device peak (its process runs it alone) and its largest batch.

  The largest batch is the largest power of two from ``sizes["batch_size"]``
  up to ``sizes["max_batch"]`` whose step (`step` lowered on `state` and a
  batch of that size, compiled, not run) takes at most `memory_limit` bytes
  by ``memory_of(compiled)``: the device's limit by default; a CPU has none,
  and the search is skipped there unless a limit is given. `compiled`, the
  step already compiled for `batch` (the mode's timed step), gives that
  batch size's bytes without compiling it again.

  Returns:
    The gpu_check record: ``peak_bytes``, ``largest_batch`` and the bytes
    of each batch compiled.
  """
  import jax  # pylint: disable=g-import-not-at-top
  stats = jax.devices()[0].memory_stats() or {}
  limit = memory_limit or stats.get("bytes_limit")
  used = {}

  def fits(batch_size):
    program = compiled if batch_size == batch[0].shape[0] else None
    if program is None:
      shape = jax.ShapeDtypeStruct((batch_size,) + batch[0].shape[1:],
                                   batch[0].dtype)
      try:
        program = step.lower(state, (shape, shape)).compile(
            compiler_options=options or None)
      except Exception as e:  # pylint: disable=broad-except
        if "RESOURCE_EXHAUSTED" in str(e):
          return False
        raise
    used[batch_size] = memory_of(program)
    return used[batch_size] is not None and used[batch_size] <= limit

  largest = None if limit is None else largest_batch(
      fits, sizes["batch_size"], sizes["max_batch"])
  return dict(workload="llama", mode=name, event="memory_fit",
              peak_bytes=stats.get("peak_bytes_in_use"),
              memory_limit_bytes=limit, largest_batch=largest,
              largest_batch_cap=sizes["max_batch"],
              memory_bytes_by_batch=used)


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Issue #53's targets from gpu_check's rows: bf16's share of the peak,
  float8's speed-up, each mode against its torch peer (speed = 1 / ms per
  step, and peak memory), 16-bit state's largest batch against bf16's."""
  row = {r["mode"]: r for r in rows if r["workload"] == "llama"}
  get = lambda mode, key: row.get(mode, {}).get(key)
  ratio = lambda a, b: a / b if a and b else None
  batch = {m: r.get("largest_batch") for m, r in row.items()
           if "largest_batch" in r}
  out = {
      "llama mixed_bfloat16 share of the dense bf16 peak": get(
          "mixed_bfloat16", "bf16_peak_share"),
      "llama float8 speed vs mixed_bfloat16": ratio(
          get("mixed_bfloat16", "ms_per_step"), get("float8", "ms_per_step")),
      "llama largest batch": batch,
      "llama largest batch state16 vs mixed_bfloat16": ratio(
          batch.get("mixed_bfloat16-state16"), batch.get("mixed_bfloat16")),
  }
  for mode, peer in (("mixed_bfloat16", "torch-compile-bf16"),
                     ("float8", "torchao-float8-tensorwise"),
                     ("float8-rowwise", "torchao-float8-rowwise")):
    out[f"llama {mode} speed vs {peer}"] = ratio(get(peer, "ms_per_step"),
                                                 get(mode, "ms_per_step"))
    out[f"llama {mode} peak memory vs {peer}"] = ratio(
        get(mode, "peak_bytes"), get(peer, "peak_bytes"))
  return out


# ---- The same Llama in PyTorch. --------------------------------------------

TORCH_MODES = ("torch-compile-bf16", "torchao-float8-tensorwise",
               "torchao-float8-rowwise")


def _torch_llama(size: str):
  """`jmp_amp.models.Llama` in PyTorch: SDPA with grouped-query heads
  (``enable_gqa``, torch 2.5 on), `torch.nn.RMSNorm` (2.4 on)."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch import nn  # pylint: disable=g-import-not-at-top
  from torch.nn import functional as F  # pylint: disable=g-import-not-at-top
  import torch.utils.checkpoint  # pylint: disable=g-import-not-at-top
  c = config(size)
  d, heads, kv, dim = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
  linear = lambda i, o: nn.Linear(i, o, bias=False)

  def rotary(x):  # [b, heads, t, dim], as models/llama.py's rotary
    t = x.shape[2]
    freqs = c.rope_theta ** (-torch.arange(0, dim, 2, device=x.device,
                                           dtype=torch.float32) / dim)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None]
    angles = angles * freqs
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                     dim=-1).type_as(x)

  class Block(nn.Module):

    def __init__(self):
      super().__init__()
      self.attn_norm = nn.RMSNorm(d, eps=c.norm_eps)
      self.mlp_norm = nn.RMSNorm(d, eps=c.norm_eps)
      self.q, self.k = linear(d, d), linear(d, kv * dim)
      self.v, self.o = linear(d, kv * dim), linear(d, d)
      self.gate, self.up = linear(d, c.mlp_hidden), linear(d, c.mlp_hidden)
      self.down = linear(c.mlp_hidden, d)

    def forward(self, x):
      b, t, _ = x.shape
      h = self.attn_norm(x)
      q = rotary(self.q(h).view(b, t, heads, dim).transpose(1, 2))
      k = rotary(self.k(h).view(b, t, kv, dim).transpose(1, 2))
      v = self.v(h).view(b, t, kv, dim).transpose(1, 2)
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                         enable_gqa=True)
      x = x + self.o(y.transpose(1, 2).reshape(b, t, d))
      h = self.mlp_norm(x)
      return x + self.down(F.silu(self.gate(h)) * self.up(h))

  class Llama(nn.Module):

    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(c.vocab_size, d)
      nn.init.normal_(self.embed.weight, std=0.02)
      self.blocks = nn.ModuleList(Block() for _ in range(c.num_layers))
      self.norm = nn.RMSNorm(d, eps=c.norm_eps)
      self.head = linear(d, c.vocab_size)

    def forward(self, idx):
      x = self.embed(idx)
      for block in self.blocks:
        # As the JAX model's remat: each block recomputed in the backward.
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
      return self.head(self.norm(x))

  return Llama()


def torch_param_count(size: str) -> int:
  return sum(p.numel() for p in _torch_llama(size).parameters())


def torch_rows(size: str = "gpu", modes: Sequence[str] = TORCH_MODES,
               steps: int = 10, warmup: int = 3
               ) -> tuple[list[dict[str, Any]], Optional[str]]:
  """The torch Llama's fused-AdamW step: ms/step and peak memory per mode.

  Each mode from the same initial weights, the model under
  ``torch.compile`` with bf16 autocast; the torchao modes first convert
  every linear layer but the head to float8 training
  (`torchao.float8.convert_to_float8_training`, the recipe
  ``"tensorwise"`` or ``"rowwise"``), as torchtitan does.

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
  torch.manual_seed(0)
  initial = _torch_llama(size).to(device)
  idx = torch.from_numpy(np.array(tokens(size))).long().to(device)
  labels = torch.cat([idx[:, 1:], idx[:, :1]], dim=1)
  weights = torch.ones_like(idx, dtype=torch.float32)
  weights[:, -1] = 0  # as models.lm_loss: the last position has no target
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
  flops = model_flops_per_step(size)
  peak = peak_bf16_flops(name)
  rows = []
  for mode in modes:
    try:
      net = copy.deepcopy(initial)
      if mode.startswith("torchao"):
        # pylint: disable-next=g-import-not-at-top
        # pylint: disable-next=g-import-not-at-top
        from torchao.float8 import convert_to_float8_training
        from torchao.float8 import Float8LinearConfig
        convert_to_float8_training(
            net, config=Float8LinearConfig.from_recipe_name(
                mode.rsplit("-", 1)[1]),
            module_filter_fn=lambda module, fqn: fqn != "head")
      opt = torch.optim.AdamW(net.parameters(), lr=LR,
                              weight_decay=WEIGHT_DECAY,
                              fused=device == "cuda")
      compiled = torch.compile(net)

      def step(compiled=compiled, opt=opt):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
          losses = F.cross_entropy(compiled(idx).float().flatten(0, 1),
                                   labels.flatten(), reduction="none")
          loss = (losses * weights.flatten()).sum() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

      if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
      t0 = time.perf_counter()
      loss = step()
      sync()
      compile_s = time.perf_counter() - t0
      times = []
      for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        if i >= warmup:
          times.append(time.perf_counter() - t0)
      ms = 1e3 * statistics.median(times)
      rows.append({
          "workload": "llama", "mode": mode, "ms_per_step": ms,
          "compile_s": compile_s, "final_loss": float(loss),
          "peak_bytes": (torch.cuda.max_memory_allocated()
                         if device == "cuda" else None),
          "model_tflops": flops / (ms / 1e3) / 1e12,
          "bf16_peak_share": flops / (ms / 1e3) / peak if peak else None,
          "torch_version": torch.__version__})
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(workload="llama", mode=mode,
                       error=f"{type(e).__name__}: {e}"[:2000]))
  return rows, None
