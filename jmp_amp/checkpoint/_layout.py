"""How a jmp_amp checkpoint sits in orbax, and how it is read back.

Steps are orbax's, named by its standard name format; only the steps orbax
committed count (`CommittedSteps`). A step holds two orbax items: ``state``
(the arrays, `StandardSave`) and ``jmp_amp`` (the description from
`describe`, with the checksums, as JSON).
Restore reads the arrays in their *saved* dtypes (so that checksums are
verified before any cast) and the target's shapes and shardings. A checkpoint
without the ``jmp_amp`` item (plain orbax, or a jmp run) is read by orbax's
own paths alone (`plain_layout`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import jmp_amp
from jmp_amp.checkpoint import _compat
from jmp_amp.checkpoint import _errors

STATE = "state"
META = "jmp_amp"
# JsonCheckpointHandler's file in the META item.
META_FILE = f"{META}/metadata"
# The file in which orbax records a step's init and commit times.
_STEP_METADATA = "_CHECKPOINT_METADATA"


def _committed(step: ocp.step.Metadata) -> bool:
  if step.commit_timestamp_nsecs is not None:
    return True
  # Step metadata that does not parse is damage, which restore then names
  # (rather than silently skipping the step); a missing one, or one with no
  # commit time, is a directory orbax never committed.
  return (step.init_timestamp_nsecs is None
          and (step.path / _STEP_METADATA).exists())


class CommittedSteps(ocp.step.NameFormat[ocp.step.Metadata]):
  """Orbax's standard step names; only the steps orbax committed count.

  On a local disk orbax commits a step by renaming its temporary directory,
  so any directory named like a step passes its standard name format: an
  empty one, or a copy cut short. Orbax's `all_steps` and `latest_step` use
  this format, so they skip those too.
  """

  def __init__(self):
    self._standard = ocp.step.standard_name_format()

  def build_name(self, step: int) -> str:
    return self._standard.build_name(step)

  def find_all(self, base_path: Any) -> Iterator[ocp.step.Metadata]:
    return (s for s in self._standard.find_all(base_path) if _committed(s))

  def find_step(self, base_path: Any, step: int) -> ocp.step.Metadata:
    found = self._standard.find_step(base_path, step)
    if not _committed(found):
      raise ValueError(f"step {step} in {base_path} was never committed")
    return found


def item_handlers() -> dict[str, Any]:
  # Registered up front so that orbax's metadata can read plain orbax
  # checkpoints too (verify=False).
  return {STATE: ocp.StandardCheckpointHandler(),
          META: ocp.JsonCheckpointHandler()}


def save_args(saveable: Any, meta: dict[str, Any]) -> ocp.args.Composite:
  return ocp.args.Composite(**{STATE: ocp.args.StandardSave(saveable),
                               META: ocp.args.JsonSave(meta)})


def meta_restore_args() -> ocp.args.Composite:
  return ocp.args.Composite(**{META: ocp.args.JsonRestore()})


def state_restore_args(target: Any, saved_leaves: Optional[dict[str, Any]]
                       ) -> ocp.args.Composite:
  """Orbax's restore of `target`: its shapes and shardings, the *saved*
  dtypes; Python numbers come back as the target's Python type."""
  leaves, treedef = jax.tree_util.tree_flatten(target)
  names = [name for name, _ in _compat.named_leaves(target)]

  def leaf(name, x):
    if _compat.is_python_scalar(x):
      return x
    if not isinstance(x, jax.ShapeDtypeStruct):
      x = ocp.tree.to_shape_dtype_struct(x)
    if not isinstance(x, jax.ShapeDtypeStruct):  # a NumPy scalar
      x = jax.ShapeDtypeStruct((), np.result_type(x))
    mesh = jax.sharding.get_mesh()  # `jax.set_mesh`'s, or an empty one
    if not mesh.empty and isinstance(
        x.sharding, (type(None), jax.sharding.SingleDeviceSharding)):
      # Under `jax.set_mesh`, an array on one device (a fresh target's loss
      # scale, made before any step) is restored replicated on the mesh, as
      # the steps there return it: committed to one device, a step under
      # the mesh would refuse it.
      x = x.update(sharding=jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec()))
    if x.sharding is None:
      # Orbax needs a sharding to place the restored array; this process's
      # first device is what an unsharded run would use (in a multi-process
      # run each process restores its own whole copy there; jax.devices()[0]
      # is process 0's and no other process can place an array on it).
      x = x.update(sharding=jax.sharding.SingleDeviceSharding(
          jax.local_devices()[0]))
    saved = (saved_leaves or {}).get(name)
    if saved is not None and saved["dtype"] != str(x.dtype):
      try:
        x = x.update(dtype=jnp.dtype(saved["dtype"]))
      except TypeError:  # an extended dtype (PRNG keys): keep the target's
        pass
    return x
  abstract = jax.tree_util.tree_unflatten(
      treedef, [leaf(n, x) for n, x in zip(names, leaves)])
  return ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract)})


def cast_like(restored: Any, target: Any) -> Any:
  """`restored` in the dtypes of `target`'s leaves (Python numbers as read)."""
  def cast(r, t):
    if _compat.is_python_scalar(t):
      return r
    return r if r.dtype == t.dtype else r.astype(t.dtype)
  return jax.tree_util.tree_map(cast, restored, target)


def _paths(tree: Any) -> set[tuple[str, ...]]:
  return set(ocp.tree.to_flat_dict(tree))


def check_empty_nodes(saved_tree: Any, saveable: Any, step: int) -> None:
  """Raises `CheckpointError` ("mismatch") if the target's empty nodes differ
  from the checkpoint's (orbax saves each as None).

  For checkpoints saved before the state's types were recorded: another
  optimizer with the same leaves, such as ``optax.adamw`` against
  ``optax.adam`` (one more ``EmptyState``), would otherwise reach orbax's
  own structure check, whose error reads like damaged files.
  """
  saved = set(ocp.tree.to_flat_dict(saved_tree, keep_empty_nodes=True))
  want = set(ocp.tree.to_flat_dict(saveable, keep_empty_nodes=True))
  if saved == want:
    return
  fmt = lambda ks: _compat.listing(["/".join(k) for k in sorted(ks)])
  msg = ("checkpoint does not match the restore target: its empty (leafless) "
         "state nodes differ (another optimizer, e.g. optax.adamw against "
         "optax.adam?):")
  if saved - want:
    msg += f"\n    in the checkpoint, not in the target: {fmt(saved - want)}"
  if want - saved:
    msg += f"\n    in the target, not in the checkpoint: {fmt(want - saved)}"
  raise _errors.mismatch(msg, step)


def plain_layout(saved_tree: Any, saveable: Any
                 ) -> tuple[Any, Optional[Callable[[Any], Any]]]:
  """How to read a checkpoint without jmp_amp metadata into `saveable`.

  Args:
    saved_tree: orbax's tree metadata of the ``state`` item.
    saveable: the restore target, NNX objects replaced by their state.

  Returns:
    ``(tree to restore into, None)`` when orbax's paths match the target's,
    or ``(tree, rebuild)`` for jmp's layout: a jmp 0.0.4 `DynamicLossScale`
    is stored as its leaves ``[loss_scale, counter]`` by index, read here into
    jmp_amp's `DynamicLossScale` (``overflows``, which jmp lacks, starts at 0).

  Raises:
    CheckpointError: neither layout matches (reason "mismatch"), naming the
      paths.
  """
  saved, want = _paths(saved_tree), _paths(saveable)
  if saved == want:
    return saveable, None

  def jmp_leaves(x):
    if not isinstance(x, jmp_amp.DynamicLossScale):
      return x
    return tuple(leaf for name, leaf in _compat.named_leaves(x)
                 if not name.endswith(".overflows"))
  jmp_like = jax.tree_util.tree_map(jmp_leaves, saveable,
                                    is_leaf=_compat.is_loss_scale)
  if _paths(jmp_like) == saved:
    def rebuild(restored):
      def put(target, value):
        if not isinstance(target, jmp_amp.DynamicLossScale):
          return value
        values = iter(value)
        leaves = [jnp.zeros(np.shape(leaf), leaf.dtype)
                  if name.endswith(".overflows") else next(values)
                  for name, leaf in _compat.named_leaves(target)]
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(target), leaves)
      return jax.tree_util.tree_map(put, saveable, restored,
                                    is_leaf=_compat.is_loss_scale)
    return jmp_like, rebuild

  fmt = lambda ks: _compat.listing(["/".join(k) for k in sorted(ks)])
  msg = "checkpoint does not match the restore target (orbax paths):"
  if saved - want:
    msg += f"\n    in the checkpoint, not in the target: {fmt(saved - want)}"
  if want - saved:
    msg += f"\n    in the target, not in the checkpoint: {fmt(want - saved)}"
  raise _errors.mismatch(msg)
