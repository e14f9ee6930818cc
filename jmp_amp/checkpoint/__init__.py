"""Checkpoint and resume mixed-precision training state with orbax.

A thin layer over `orbax.checkpoint` (no pickle): orbax writes the arrays,
sharded or not, commits each step atomically and lists the committed steps;
this package adds what a resumed mixed-precision run needs to be *the same
run*, and refuses anything else:

* the loss scales' static hyper-parameters (``period``, ``factor``, ...) and
  the FP8 ops' recipes (``margin``, ``history_len``, ...), which are not in
  orbax's array checkpoint, are saved as JSON next to the arrays, with a
  CRC-32 checksum of every array's bytes;
* restore checks the target against what was saved -- tree structure, shapes,
  dtypes, the optimizer state's types (Adam is not AdaBelief, though both
  hold ``count / mu / nu``), loss-scale hyper-parameters, FP8 recipes and
  the step -- and raises a `CheckpointError` naming every mismatch. Orbax
  alone would silently cast float32 params into a bfloat16 target, or
  restore a scale into a loss scale with a new period;
* restore verifies every array against its checksum, the restored loss scales
  (finite, > 0) and FP8 amax histories (finite, >= 0); damaged files raise
  a `CheckpointError` naming the step and the array or file, never changed
  values. `restore_latest` can fall back to the newest intact step;
* saving over an existing step, or below the latest one, raises a
  `CheckpointError` unless ``overwrite=True``.

Every refusal is one `CheckpointError` (a `ValueError`); its ``reason``,
``"mismatch"``, ``"corrupted"`` or ``"exists"``, says which.

Example (a checkpoint in a temporary directory):
  >>> import tempfile
  >>> from jmp_amp import checkpoint
  >>> opt = jmp_amp.loss_scaling(optax.sgd(0.1),
  ...                            jmp_amp.DynamicLossScale(2.0 ** 15))
  >>> params = {"w": jnp.ones(3)}
  >>> state = {"params": params, "opt_state": opt.init(params), "epoch": 2}
  >>> run_dir = tempfile.mkdtemp()
  >>> checkpoint.save(run_dir, state, step=100)
  >>> state, step = checkpoint.restore_latest(run_dir, target=state)
  >>> step, state["epoch"]
  (100, 2)

or, to keep the last few checkpoints of a run::

  with checkpoint.CheckpointManager(run_dir, max_to_keep=3) as mngr:
    mngr.save(step, state)
    state = mngr.restore(state, fallback=True)  # mngr.restored_step says which

`target` is a tree like the saved one: a freshly initialised state, or an
abstract one (`jax.ShapeDtypeStruct` leaves, e.g. from `jax.eval_shape`);
restored arrays take the target leaves' shardings, Python numbers the target's
Python types. Flax NNX modules and `nnx.Optimizer`s may appear in the tree as
they are: their `nnx.state` is saved, and restore updates the target's objects
in place (and checks the optimizer's loss-scale hyper-parameters and the
modules' FP8 recipes, which `nnx.state` alone drops).

Not imported by `import jmp_amp`; needs ``pip install orbax-checkpoint``.
"""

from jmp_amp.checkpoint._errors import CheckpointError
from jmp_amp.checkpoint._manager import CheckpointManager
from jmp_amp.checkpoint._manager import latest_step
from jmp_amp.checkpoint._manager import restore
from jmp_amp.checkpoint._manager import restore_latest
from jmp_amp.checkpoint._manager import save

__all__ = (
    "CheckpointError",
    "CheckpointManager",
    "latest_step",
    "restore",
    "restore_latest",
    "save",
)
