"""`jmp-amp bench`: the PyTorch AMP recipe's benchmark, for jmp_amp.

The recipe trains an MLP (width 4096, 3 linear layers, batch 512, 50 batches
x 3 epochs, SGD, MSE loss) in float32, with autocast, and with autocast +
GradScaler. The command runs the same comparison for jmp_amp's precision
modes in one process, and optionally the PyTorch modes on the same device::

    jmp-amp bench                              # small CPU-sized default
    jmp-amp bench --recipe seed --compare-torch --json out.jsonl --plot out.png
    python -m jmp_amp.tools.bench --model resnet --policy mixed_bfloat16 \
        --policy mixed_float16

For every mode it reports the median step time after warm-up over
``--repeats`` interleaved repeats with their spread, samples/s, peak memory,
final loss, skipped steps, final loss scale, the matmul-dtype summary,
achieved TFLOP/s (MLP) and ratios against float32, in a table that fits the
terminal, with a legend and a one-line verdict. ``--target h100`` compiles
the same steps for an H100 without a GPU instead of timing them.

By job: `workloads` (modes, recipes, the jitted train steps), `timing`,
`torch_runner` (the PyTorch rows), `table` (ratios, table, legend, verdict),
`plot`, `gpu` (``--target``) and `cli` (flags, checks, runs, output). These
modules import Flax and the reference models (`jmp_amp.models`) when they run
a workload; `import jmp_amp` imports none of them.
"""
