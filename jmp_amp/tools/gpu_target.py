"""Compile for an NVIDIA H100 without a GPU: XLA's own figures for a program.

The jax CUDA plugin can compile for a GPU that is not there (a compile-only
topology built from a target description). `gpu_report` compiles a function
that way and reads what XLA:GPU made of it: its GEMMs (cuBLAS calls or dots)
with dtypes, its kernels (fusions and library calls), the GPU memory
`memory_analysis()` assigns and an estimate of the bytes its kernels move.
These are compiler figures, not timings: nothing runs.

It compiles with XLA's default options, as a GPU does unless told otherwise
(``gemm="cublas"`` turns Triton GEMMs off, a configuration to ask for and
label). It needs the optional extra ``pip install "jmp-amp[gpu-audit]"``
(the CUDA plugin, ``nvidia-cuda-nvcc-cu12`` and, for cuDNN's fused attention,
``nvidia-cudnn-cu12``; about 1.3 GB installed). On a machine without a
GPU, start Python with ``JAX_PLATFORMS=cpu`` (``jmp-amp bench --target h100``
does it for you): the plugin then registers its compile-only target without
looking for a GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
from typing import Any, Optional

import jax
from jax.experimental import topologies

from jmp_amp.tools import audit
from jmp_amp.tools import hlo_text
from jmp_amp.tools.report import MatmulReport

EXTRA = "gpu-audit"
# From openxla/xla xla/backends/gpu/target_config/specs/h100_sxm.txtpb
# (Apache-2.0, Copyright 2024 The OpenXLA Authors), less the field
# collective_memory_granularity that the XLA in jaxlib 0.10 does not know.
_H100_SXM = r"""
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
    feature_extension: ACCELERATED_FEATURES
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  scalar_unit_description {
    rate_infos { key: 4  value { clock_rate_ghz: 1.98 units_per_core: 64  ops_per_clock: 1 } }
    rate_infos { key: 8  value { clock_rate_ghz: 1.98 units_per_core: 64  ops_per_clock: 1 } }
    rate_infos { key: 10 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 2 } }
    rate_infos { key: 11 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 1 } }
    rate_infos { key: 12 value { clock_rate_ghz: 1.98 units_per_core: 64  ops_per_clock: 1 } }
    rate_infos { key: 16 value { clock_rate_ghz: 1.98 units_per_core: 128 ops_per_clock: 2 } }
  }
  matrix_unit_description {
    rate_infos { key: 2  value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 6  value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 10 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 512 } }
    rate_infos { key: 11 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 256 } }
    rate_infos { key: 12 value { clock_rate_ghz: 1.98      units_per_core: 4 ops_per_clock: 32 } }
    rate_infos { key: 16 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 512 } }
    rate_infos { key: 19 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 20 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 23 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 24 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 25 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 28 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 29 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 33 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 35 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
    rate_infos { key: 36 value { clock_rate_ghz: 1.8295201 units_per_core: 4 ops_per_clock: 1024 } }
  }
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  model_str: "sm_9.0a with 84942979072B RAM, 132 cores, 1980000KHz clock, 2619000KHz mem clock, 52428800B L2$"
  device_address_bits: 64
  pcie_bandwidth: 34359738368
  ecc_enabled: true
  name: "NVIDIA H100 80GB HBM3"
  driver_version: "13.0.0"
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0"
  cub_version: "3.1.2"
  device_interconnect_info {
    active_links: 18
  }
}
platform_name: "CUDA"
dnn_version_info {
  major: 8
  minor: 9
  patch: 4
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""
TARGETS = {"h100": _H100_SXM}
_TARGET_NAMES = {"h100": "H100"}
# The compiler options of each `gemm` choice. "default": XLA's own options,
# what a GPU compiles with unless told otherwise (Triton GEMMs on; without a
# GPU to autotune on, each Triton GEMM keeps its default tiling, and no
# GEMM is moved to cuBLAS by the autotuner). "cublas": Triton GEMMs off,
# every GEMM a cuBLAS(Lt) call: a configuration no GPU has unless asked
# for, kept to compare with figures made that way.
GEMM_BACKENDS = {"default": {},
                 "cublas": {"xla_gpu_enable_triton_gemm": False}}
_GEMM_LABELS = {"default": "XLA's default options",
                "cublas": "Triton GEMMs off (xla_gpu_enable_triton_gemm=False)"}
_GPU_PLATFORMS = ("cuda", "gpu")


def label(target: str = "h100", gemm: str = "default") -> str:
  """The line every figure of this module carries."""
  return (f"compiled for {_TARGET_NAMES.get(target, target)}, no GPU, "
          f"{_GEMM_LABELS.get(gemm, gemm)}: compiler figures, not timings")


@dataclasses.dataclass(frozen=True)
class GpuReport:
  """What XLA:GPU compiled a program into, for a target it did not run on.

  Attributes:
    target: the target name ("h100").
    gemm: the compiler options it was compiled with (`GEMM_BACKENDS`).
    matmuls: the GEMMs, convolutions and fused attention calls (cuDNN's
      flash attention, kind "attention") of the optimized program
      (`MatmulReport` at the compiled stage; ``target`` names library calls).
    kernels: kernel launches in the program text: fusions, library calls and
      unfused ops; a loop body counts once.
    kernels_by_kind: the same, by fusion kind ("kLoop", "kInput",
      "kCustom"), custom-call target ("__cublas$lt$matmul") or opcode.
    memory: GPU bytes from `memory_analysis()`: "temp_bytes",
      "argument_bytes", "output_bytes", "alias_bytes" (None when the
      compiler gave no analysis).
    bytes_estimate: bytes the kernels move if each reads its operands and
      writes its result once (a loop body once): an estimate of HBM traffic.
    jax_version: the JAX that compiled it.
    lowered: the dots and convolutions of the program as JAX lowered it
      (`MatmulReport` at the lowered stage: what it asks for), when known.

  Example (needs the ``gpu-audit`` extra; without a GPU, JAX_PLATFORMS=cpu):
    >>> f8 = jmp_amp.autocast(lambda w, x: jnp.sum(x @ w), "float8")
    >>> report = jmp_amp.gpu_report(jax.grad(f8, argnums=(0, 1)),
    ...                             jnp.ones((256, 128)), jnp.ones((64, 256)))
    >>> for gemm in sorted(report.gemms_by_dtype()): print(gemm)
    float8_e4m3fn x float8_e5m2 -> f32
    float8_e5m2 x float8_e4m3fn -> f32
    >>> report.fp8_fallbacks()  # the FP8 layers whose GEMMs are not FP8
    {}
  """

  target: str
  matmuls: MatmulReport
  kernels: int
  kernels_by_kind: dict[str, int]
  memory: dict[str, Optional[int]]
  bytes_estimate: int
  jax_version: str = jax.__version__
  lowered: Optional[MatmulReport] = dataclasses.field(default=None,
                                                      compare=False)
  gemm: str = "default"

  @property
  def label(self) -> str:
    return label(self.target, self.gemm)

  def gemms_by_dtype(self) -> dict[str, int]:
    """Number of GEMMs and convolutions per ``"lhs x rhs -> result"``, and
    of fused attention calls per ``"attention q x k -> result"``."""
    return self.matmuls.counts_by_signature()

  def fp8_layers(self) -> dict[str, dict[str, int]]:
    """The GEMMs each FP8 layer compiled to, by signature (see
    `MatmulReport.fp8_layers`)."""
    return self.matmuls.fp8_layers()

  def fp8_fallbacks(self) -> dict[str, str]:
    """The FP8 layers whose matmuls did not all become FP8 GEMMs, and why.

    Compares the compiled program with the lowered one (see
    `MatmulReport.fp8_fallbacks`): a layer with a GEMM whose operands are
    not FP8, or with fewer GEMMs than the matmuls it asked for (XLA merged
    them into a GEMM that is not FP8, or removed them), is flagged. Empty
    when none is.
    """
    return self.matmuls.fp8_fallbacks(expected=self.lowered)

  def summary(self) -> dict[str, Any]:
    """The figures as a JSON-friendly dict, labelled."""
    return {
        "label": self.label, "target": self.target, "gemm": self.gemm,
        "jax_version": self.jax_version,
        "gemms": len(self.matmuls) - len(self.matmuls.attention),
        "attention_calls": len(self.matmuls.attention),
        "gemms_by_dtype": self.gemms_by_dtype(),
        "gemm_flops_by_input_dtype": self.matmuls.flops_by_input_dtype(),
        "kernels": self.kernels, "kernels_by_kind": dict(self.kernels_by_kind),
        **self.memory, "bytes_estimate": self.bytes_estimate,
    }

  def __str__(self) -> str:
    gemms = ", ".join(f"{n} x {s}" for s, n in self.gemms_by_dtype().items())
    kinds = ", ".join(f"{k}: {v}" for k, v in self.kernels_by_kind.items())
    return "\n".join((
        f"GpuReport [{self.label}; jax {self.jax_version}]",
        f"  GEMMs/convs: {len(self.matmuls) - len(self.matmuls.attention)}"
        f"{f', fused attention calls: {len(self.matmuls.attention)}' if self.matmuls.attention else ''}"
        f" ({gemms or 'none'})",
        f"  kernels: {self.kernels} ({kinds})",
        f"  GPU memory: temp {_size(self.memory.get('temp_bytes'))}, "
        f"arguments {_size(self.memory.get('argument_bytes'))}, "
        f"outputs {_size(self.memory.get('output_bytes'))}",
        f"  bytes moved (estimate): {_size(self.bytes_estimate)}"))


def _size(n: Optional[int]) -> str:
  if n is None:
    return "?"
  for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if n >= 2**shift:
      return f"{n / 2**shift:,.1f} {unit}"
  return f"{n} B"


def report_from_hlo(text: str, memory: Optional[dict[str, Optional[int]]] = None,
                    target: str = "h100",
                    lowered: Optional[MatmulReport] = None,
                    gemm: str = "default") -> GpuReport:
  """A `GpuReport` from the optimized HLO text of a GPU program."""
  module = hlo_text.HloModule(text)
  by_kind: collections.Counter = collections.Counter()
  moved = 0
  for comp, instr in module.kernels():
    if instr.opcode == "fusion":
      by_kind[module.fusion_kind(instr) or "fusion"] += 1
      written = hlo_text.nbytes(instr.type)
    elif instr.opcode == "custom-call":
      by_kind[instr.attr("custom_call_target") or "custom-call"] += 1
      # Library calls return (result, scratch): the scratch is not traffic.
      written = hlo_text.nbytes(instr.type, first_only=True)
    else:
      by_kind[instr.opcode] += 1
      written = hlo_text.nbytes(instr.type)
    moved += module.operand_bytes(comp, instr) + written
  return GpuReport(target, MatmulReport.from_hlo(text), sum(by_kind.values()),
                   dict(by_kind.most_common()),
                   memory or dict.fromkeys(_MEMORY_FIELDS), moved,
                   lowered=lowered, gemm=gemm)


_MEMORY_FIELDS = ("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes")


def _check_target(target: str) -> None:
  if target not in TARGETS:
    raise ValueError(f"target must be one of {', '.join(map(repr, TARGETS))}; "
                     f"got {target!r}")


@functools.lru_cache(maxsize=None)
def has_cuda_plugin() -> bool:
  """Whether a jax CUDA plugin (CUDA 12 or 13) is installed."""
  return any(importlib.util.find_spec(f"jax_cuda{v}_plugin") is not None
             for v in (12, 13))


def target_device(target: str = "h100"):
  """A compile-only device of `target` (no GPU needed).

  Raises:
    ImportError: the CUDA plugin (the ``gpu-audit`` extra) is not installed.
    RuntimeError: it is installed but registered no compile-only target.
  """
  _check_target(target)
  if not has_cuda_plugin():
    raise ImportError(
        f"compiling for {_TARGET_NAMES[target]} needs the CUDA plugin: "
        f'pip install "jmp-amp[{EXTRA}]" (jax-cuda12-plugin and '
        f"jax-cuda12-pjrt {jax.__version__}, nvidia-cuda-nvcc-cu12)")
  try:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=TARGETS[target], topology="1x1x1")
  except NotImplementedError as e:
    raise RuntimeError(
        "the CUDA plugin is installed but gave no compile-only target "
        f"({e}). On a machine without a GPU, start Python with "
        "JAX_PLATFORMS=cpu so that the plugin registers it without looking "
        "for a GPU") from e
  return topology.devices[0]


def compile_for_gpu(fn: Any, *args: Any, target: str = "h100",
                    gemm: str = "default", static_argnums=(), static_argnames=(),
                    donate_argnums=(), **kwargs: Any) -> jax.stages.Compiled:
  """Compiles `fn(*args, **kwargs)` for `target` on a machine without one.

  Args:
    fn: a function (an Equinox or Flax NNX module too) or an already-jitted
      function (its own jit options hold).
    *args: pytrees of arrays or `jax.ShapeDtypeStruct`; only shapes and
      dtypes are used. Other leaves are static (see `matmul_report`).
    target: "h100".
    gemm: "default" (XLA's default options, as a GPU compiles: Triton
      GEMMs, untuned) or "cublas" (Triton GEMMs off, every GEMM a cuBLAS
      call); see `GEMM_BACKENDS`.
    static_argnums: for the `jax.jit` applied when `fn` is not jitted yet.
    static_argnames: likewise.
    donate_argnums: likewise; donated buffers are reused for outputs, as in
      a train step.
    **kwargs: keyword arguments of `fn`.

  Returns:
    A `jax.stages.Compiled` for the target (it cannot run here).
  """
  return _compile(_lower_for_gpu(
      fn, *args, target=target, gemm=gemm, static_argnums=static_argnums,
      static_argnames=static_argnames, donate_argnums=donate_argnums,
      **kwargs), gemm)


def _compile(staged, gemm: str) -> jax.stages.Compiled:
  if isinstance(staged, jax.stages.Compiled):
    return staged
  return staged.compile(compiler_options=GEMM_BACKENDS[gemm] or None)


def _lower_for_gpu(fn, *args, target, gemm, static_argnums, static_argnames,
                   donate_argnums, **kwargs) -> jax.stages.Lowered:
  if gemm not in GEMM_BACKENDS:
    raise ValueError(f"gemm must be one of {', '.join(map(repr, GEMM_BACKENDS))}; "
                     f"got {gemm!r}")
  if isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled)):
    _check_gpu_program(fn, target)
  sharding = jax.sharding.SingleDeviceSharding(target_device(target))
  static = set((static_argnums,) if isinstance(static_argnums, int)
               else static_argnums)

  def place(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x

  args = tuple(a if i in static else jax.tree.map(place, a)
               for i, a in enumerate(args))
  kwargs = {k: v if k in (static_argnames or ()) else jax.tree.map(place, v)
            for k, v in kwargs.items()}
  return audit.lower(fn, *args, static_argnums=static_argnums,
                     static_argnames=static_argnames,
                     jit_kwargs={"donate_argnums": donate_argnums}, **kwargs)


def _check_gpu_program(staged, target: str) -> None:
  """Refuses a Lowered/Compiled built for a platform other than a GPU."""
  compiled = (staged if isinstance(staged, jax.stages.Compiled)
              else staged.compile())
  shardings = jax.tree.leaves((compiled.input_shardings,
                               compiled.output_shardings))
  platforms = {d.platform for s in shardings for d in s.device_set}
  wrong = sorted(platforms - set(_GPU_PLATFORMS))
  if wrong:
    kind = type(staged).__name__
    raise ValueError(
        f"gpu_report got a jax.stages.{kind} built for {', '.join(wrong)}, "
        f"not for {_TARGET_NAMES[target]}: its GEMMs would be that "
        f"platform's. Pass the function and its arguments instead "
        f"(jmp_amp.gpu_report(step, *args)), and it is lowered and compiled "
        f"for {_TARGET_NAMES[target]}; for the program as this machine "
        f"compiled it, use jmp_amp.matmul_report.")


def gpu_report(fn: Any, *args: Any, target: str = "h100", gemm: str = "default",
               static_argnums=(), static_argnames=(), donate_argnums=(),
               **kwargs: Any) -> GpuReport:
  """Compiles `fn(*args, **kwargs)` for an H100 without a GPU and reports it.

  The figures are the compiler's, not timings: GEMMs by dtype, kernels, GPU
  memory and an estimate of bytes moved. Compare modes of one program by
  their ratios (float32 vs bf16...), not with measurements.

  Example (needs the ``gpu-audit`` extra; without a GPU, JAX_PLATFORMS=cpu):
    >>> w = x = jnp.ones((256, 256), jnp.bfloat16)
    >>> report = jmp_amp.gpu_report(lambda w, x: x @ w, w, x)
    >>> print(report)  # GEMMs by dtype, kernels, memory, bytes moved
    GpuReport [compiled for H100, no GPU, XLA's default options: ...]
      GEMMs/convs: 1 (1 x bf16 x bf16 -> f32)
    ...

  Args:
    fn: a function (an Equinox or Flax NNX module too) or an already-jitted
      function.
    *args: pytrees of arrays or `jax.ShapeDtypeStruct`; other leaves are
      static (see `matmul_report`).
    target: "h100" (an H100 SXM 80GB).
    gemm: "default" (XLA's default options) or "cublas" (Triton GEMMs
      off), see `compile_for_gpu`.
    static_argnums: see `compile_for_gpu`.
    static_argnames: likewise.
    donate_argnums: likewise.
    **kwargs: keyword arguments of `fn`.

  Returns:
    A `GpuReport`.

  Raises:
    ImportError: the ``gpu-audit`` extra (the CUDA plugin) is not installed.
    RuntimeError: the plugin gave no compile-only target (set
      ``JAX_PLATFORMS=cpu`` on a machine without a GPU).
    ValueError: `target` or `gemm` is not a known name, or `fn` is a
      `jax.stages.Lowered`/`Compiled` built for another platform (a CPU
      one, say).
  """
  _check_target(target)
  lowered = _lower_for_gpu(
      fn, *args, target=target, gemm=gemm, static_argnums=static_argnums,
      static_argnames=static_argnames, donate_argnums=donate_argnums, **kwargs)
  compiled = _compile(lowered, gemm)
  if isinstance(lowered, jax.stages.Compiled):
    lowered = None
  return report_from_compiled(compiled, target, lowered, gemm)


def report_from_compiled(compiled: jax.stages.Compiled,
                         target: str = "h100",
                         lowered: Optional[jax.stages.Lowered] = None,
                         gemm: str = "default") -> GpuReport:
  """The `GpuReport` of a program `compile_for_gpu` compiled for `target`
  (for a caller that also wants the compiled program, e.g. its HLO text);
  with its `lowered` program, the report can check FP8 layers
  (`GpuReport.fp8_fallbacks`)."""
  analysis = compiled.memory_analysis()
  memory = dict.fromkeys(_MEMORY_FIELDS)
  if analysis is not None:
    memory = {f: int(getattr(analysis, f.replace("_bytes", "_size_in_bytes")))
              for f in _MEMORY_FIELDS}
  asked = None if lowered is None else MatmulReport.from_stablehlo(
      lowered.compiler_ir("stablehlo"))
  return report_from_hlo(compiled.as_text(), memory, target, asked, gemm)
