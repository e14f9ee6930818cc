"""jmp_amp.tools: what the compiler makes of a program, and the benchmark CLI.

The layer above the core: it reads programs, it does not change them. The
matmul audit (`jmp_amp.matmul_report`) lists the dtypes every dot and
convolution of a program sees, as a `MatmulReport`; `jmp_amp.gpu_report`
compiles a program for an H100 without a GPU and reads XLA's figures (GEMMs,
kernels, memory, bytes moved) into a `GpuReport`. This package holds the two
report types those functions return; `jmp_amp.tools.bench` is the
`jmp-amp bench` command. The core (`jmp_amp._src`) and the Flax integration
never import this package.
"""

from jmp_amp.tools.gpu_target import GpuReport
from jmp_amp.tools.report import MatmulReport

__all__ = ("GpuReport", "MatmulReport")
