"""`jmp-amp bench`: the PyTorch AMP recipe's benchmark, for jmp_amp.

`cli` is the command (``python -m jmp_amp.tools.bench`` runs it too); `gpu`
is its ``--target h100``, which compiles the same train steps for an H100
without a GPU. `import jmp_amp` imports neither.
"""
