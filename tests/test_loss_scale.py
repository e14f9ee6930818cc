"""Tests for NoOpLossScale, StaticLossScale and DynamicLossScale."""

import dataclasses
import math
import warnings

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_amp


def reference_rule(flags, scale, period, factor, backoff, min_scale, max_scale,
                   hysteresis):
  """The dynamic loss-scale rule in plain Python, one step per flag."""
  counter = overflows = 0
  trajectory = []
  for finite in flags:
    if finite:
      overflows = 0
      counter += 1
      if counter == period:
        counter = 0
        grown = scale * factor
        if max_scale is not None:
          grown = min(grown, max_scale)
        if math.isfinite(grown):
          scale = grown
    else:
      counter = 0
      overflows += 1
      if overflows >= hysteresis:
        overflows = 0
        scale = max(min_scale, scale * backoff)
    trajectory.append(scale)
  return trajectory


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=60),
       period=st.integers(1, 5),
       factor=st.sampled_from([2, 4]),
       backoff=st.sampled_from([0.5, 0.25]),
       min_scale=st.sampled_from([1.0, 8.0]),
       max_scale=st.sampled_from([None, 2.0**18]),
       hysteresis=st.integers(1, 3))
def test_dynamic_scale_follows_reference_rule(flags, period, factor, backoff,
                                              min_scale, max_scale, hysteresis):
  ls = jmp_amp.DynamicLossScale(
      jnp.float32(2.0**15), period=period, factor=factor,
      backoff_factor=backoff, min_loss_scale=min_scale,
      max_loss_scale=max_scale, hysteresis=hysteresis)
  adjust = jax.jit(lambda ls, f: ls.adjust(f))
  got = []
  for flag in flags:
    ls = adjust(ls, jnp.bool_(flag))
    got.append(float(ls.loss_scale))
  expected = reference_rule(flags, 2.0**15, period, factor, backoff, min_scale,
                            max_scale, hysteresis)
  assert got == expected  # Powers of two: exact.


def test_backoff_then_growth_trajectory():
  ls = jmp_amp.DynamicLossScale(jnp.float32(1024.0), period=3, factor=2)
  flags = [False, False, True, True, True, True, True, True, False]
  scales = []
  for f in flags:
    ls = ls.adjust(jnp.bool_(f))
    scales.append(float(ls.loss_scale))
  assert scales == [512, 256, 256, 256, 512, 512, 512, 1024, 512]


def test_min_and_max_bounds():
  ls = jmp_amp.DynamicLossScale(jnp.float32(8.0), period=1, min_loss_scale=2.0,
                                max_loss_scale=32.0)
  for _ in range(5):
    ls = ls.adjust(jnp.bool_(False))
  assert float(ls.loss_scale) == 2.0
  for _ in range(10):
    ls = ls.adjust(jnp.bool_(True))
  assert float(ls.loss_scale) == 32.0


def test_growth_stops_at_float32_overflow():
  ls = jmp_amp.DynamicLossScale(jnp.float32(2.0**127), period=1)
  ls = ls.adjust(jnp.bool_(True))
  assert float(ls.loss_scale) == 2.0**127


def test_min_loss_scale_zero_never_reaches_zero():
  ls = jmp_amp.DynamicLossScale(jnp.float32(1.0), min_loss_scale=0.0)
  for _ in range(200):
    ls = ls.adjust(jnp.bool_(False))
  assert float(ls.loss_scale) > 0


def test_hysteresis_needs_consecutive_overflows():
  ls = jmp_amp.DynamicLossScale(jnp.float32(64.0), hysteresis=2)
  scales = []
  for f in [False, True, False, False, False, False]:
    ls = ls.adjust(jnp.bool_(f))
    scales.append(float(ls.loss_scale))
  # A finite step resets the run; every second consecutive overflow backs off.
  assert scales == [64, 64, 64, 32, 32, 16]


def test_static_fields_survive_jit_and_tree_round_trip():
  # jmp 0.0.4 lost min_loss_scale here and silently reset it to 1.
  ls = jmp_amp.DynamicLossScale(jnp.float32(8.0), period=7, factor=4,
                                min_loss_scale=4.0, backoff_factor=0.5,
                                max_loss_scale=2.0**20, hysteresis=3)
  rebuilt = jax.tree_util.tree_map(lambda x: x, ls)
  through_jit = jax.jit(lambda s: s)(ls)
  for other in (rebuilt, through_jit):
    assert (other.period, other.factor, other.min_loss_scale,
            other.backoff_factor, other.max_loss_scale, other.hysteresis) == (
                7, 4, 4.0, 0.5, 2.0**20, 3)

  @jax.jit
  def back_off_many(ls):
    for _ in range(30):
      ls = ls.adjust(jnp.bool_(False))
    return ls
  assert float(back_off_many(ls).loss_scale) == 4.0


@pytest.mark.parametrize("hysteresis, n_leaves", [(1, 2), (3, 3)])
def test_unflatten_accepts_placeholders(hysteresis, n_leaves):
  ls = jmp_amp.DynamicLossScale(jnp.float32(8.0), hysteresis=hysteresis)
  treedef = jax.tree_util.tree_structure(ls)
  assert treedef.num_leaves == n_leaves
  for placeholder in (None, object(), jax.ShapeDtypeStruct((), jnp.float32),
                      0.0, jnp.float32(jnp.nan)):
    rebuilt = jax.tree_util.tree_unflatten(treedef, [placeholder] * n_leaves)
    assert rebuilt.loss_scale is placeholder
    assert rebuilt.counter is placeholder
  shapes = jax.eval_shape(lambda s: s.adjust(jnp.bool_(True)), ls)
  assert shapes.loss_scale.dtype == jnp.float32
  # orbax maps a tree of Nones as a prefix of the state: same structure.
  nones = jax.tree_util.tree_map(lambda x: None, ls)
  assert jax.tree_util.tree_map(lambda x, a: x, ls, nones) == ls
  # optax-style tree utilities rebuild the state with zeros: no validation.
  zeros = jax.tree_util.tree_map(jnp.zeros_like, ls)
  assert float(zeros.loss_scale) == 0.0


def test_adjust_keeps_leaf_types_stable():
  for ls in (jmp_amp.DynamicLossScale(2.0**15),
             jmp_amp.DynamicLossScale(jnp.asarray(2.0**15))):
    nxt = ls.adjust(jnp.bool_(False))
    for a, b in zip(jax.tree_util.tree_leaves(ls),
                    jax.tree_util.tree_leaves(nxt)):
      assert jnp.asarray(a).dtype == jnp.asarray(b).dtype


@pytest.mark.parametrize("cls", [jmp_amp.StaticLossScale,
                                 jmp_amp.DynamicLossScale])
def test_scale_unscale_round_trip(cls):
  ls = cls(2.0**10)
  tree = {"a": jnp.array([1.5, -3.0]), "b": jnp.array(0.25)}
  scaled = ls.scale(tree)
  np.testing.assert_array_equal(scaled["a"], [1.5 * 2**10, -3.0 * 2**10])
  back = ls.unscale(scaled)
  np.testing.assert_array_equal(back["a"], tree["a"])
  np.testing.assert_array_equal(back["b"], tree["b"])


def test_noop_and_static_have_no_leaves_and_do_not_adjust():
  for ls in (jmp_amp.NoOpLossScale(), jmp_amp.StaticLossScale(128.0)):
    assert jax.tree_util.tree_leaves(ls) == []
    assert ls.adjust(jnp.bool_(False)) is ls
    assert jax.jit(lambda s: s)(ls) == ls
  assert jmp_amp.NoOpLossScale().loss_scale == 1


@pytest.mark.parametrize("make, message", [
    (lambda: jmp_amp.DynamicLossScale(0.0),
     "loss_scale must be a finite number > 0, got 0.0"),
    (lambda: jmp_amp.DynamicLossScale(-2.0), "got -2.0"),
    (lambda: jmp_amp.DynamicLossScale(jnp.float32(jnp.inf)), "got inf"),
    (lambda: jmp_amp.DynamicLossScale(jnp.float32(jnp.nan)), "got nan"),
    (lambda: jmp_amp.StaticLossScale(0), "StaticLossScale.loss_scale must be"),
    (lambda: jmp_amp.StaticLossScale(-1.0), "got -1.0"),
    (lambda: jmp_amp.DynamicLossScale(8.0, period=0),
     "period must be an integer >= 1, got 0"),
    (lambda: jmp_amp.DynamicLossScale(8.0, period=2.5),
     "period must be an integer"),
    (lambda: jmp_amp.DynamicLossScale(8.0, factor=1),
     "factor must be a finite number > 1, got 1"),
    (lambda: jmp_amp.DynamicLossScale(8.0, factor=0.5), "factor must be"),
    (lambda: jmp_amp.DynamicLossScale(8.0, backoff_factor=1.0),
     r"backoff_factor must be in \(0, 1\)"),
    (lambda: jmp_amp.DynamicLossScale(8.0, backoff_factor=0.0),
     "backoff_factor"),
    (lambda: jmp_amp.DynamicLossScale(8.0, min_loss_scale=-1.0),
     "min_loss_scale must be"),
    (lambda: jmp_amp.DynamicLossScale(8.0, min_loss_scale=64.0,
                                      max_loss_scale=32.0),
     r"min_loss_scale \(64.0\) must not exceed max_loss_scale \(32.0\)"),
    (lambda: jmp_amp.DynamicLossScale(8.0, hysteresis=0),
     "hysteresis must be an integer >= 1"),
])
def test_bad_hyper_parameters_raise_clear_errors(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_adjust_requires_scalar_flag():
  ls = jmp_amp.DynamicLossScale(8.0)
  with pytest.raises(ValueError, match="boolean scalar"):
    ls.adjust(jnp.array([True, False]))


def test_dynamic_loss_scale_is_a_frozen_dataclass():
  ls = jmp_amp.DynamicLossScale(8.0)
  assert dataclasses.is_dataclass(ls)
  with pytest.raises(dataclasses.FrozenInstanceError, match="period"):
    ls.period = 3
  assert ls.replace(period=3).period == 3
  assert dataclasses.replace(ls, period=3) == ls.replace(period=3)
  with pytest.raises(ValueError, match="period must be an integer >= 1, got 0"):
    dataclasses.replace(ls, period=0)
  with pytest.raises(ValueError,
                     match="loss_scale must be a finite number > 0"):
    dataclasses.replace(ls, loss_scale=np.float32(np.inf))
  # jmp users replace the scale of a state; the counter comes along.
  moved = dataclasses.replace(ls.adjust(jnp.bool_(True)),
                              loss_scale=jnp.float32(4.0))
  assert (float(moved.loss_scale), int(moved.counter)) == (4.0, 1)
  static = jmp_amp.StaticLossScale(2.0)
  assert (dataclasses.replace(static, loss_scale=4)
          == jmp_amp.StaticLossScale(4.0))
  with pytest.raises(ValueError, match="StaticLossScale.loss_scale"):
    dataclasses.replace(static, loss_scale=0)


def test_leaves_are_jmps_unless_hysteresis():
  ls = jmp_amp.DynamicLossScale(jnp.float32(8.0), jnp.int32(3), period=5)
  assert ls.overflows is None
  leaves = jax.tree_util.tree_leaves(ls)
  assert len(leaves) == 2 and leaves[0] is ls.loss_scale
  assert leaves[1] is ls.counter
  # No key names, as jmp: checkpoint paths are the same as jmp's.
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
  assert paths == [(jax.tree_util.FlattenedIndexKey(0),),
                   (jax.tree_util.FlattenedIndexKey(1),)]
  with_h = ls.replace(hysteresis=3)
  assert len(jax.tree_util.tree_leaves(with_h)) == 3
  assert with_h.overflows.dtype == np.int32 and int(with_h.overflows) == 0
  with_h = with_h.adjust(jnp.bool_(False))
  assert int(with_h.overflows) == 1
  assert with_h.replace(hysteresis=1).overflows is None


class _Jmp004DynamicLossScale:
  """jmp 0.0.4's DynamicLossScale pytree registration, verbatim in substance."""

  def __init__(self, loss_scale, counter, period=2000, factor=2):
    self.loss_scale, self.counter = loss_scale, counter
    self.period, self.factor = period, factor


jax.tree_util.register_pytree_node(
    _Jmp004DynamicLossScale,
    lambda x: ((x.loss_scale, x.counter), (x.period, x.factor)),
    lambda aux, leaves: _Jmp004DynamicLossScale(*leaves, *aux))


def test_jmp_checkpoint_restores_into_jmp_amp(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  saved = {"step": jnp.int32(7),
           "loss_scale": _Jmp004DynamicLossScale(jnp.float32(2.0**12),
                                                 jnp.int32(1234))}
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "ckpt", saved)
  checkpointer.wait_until_finished()
  target = {"step": jnp.int32(0),
            "loss_scale": jmp_amp.DynamicLossScale(jnp.float32(2.0**15))}
  restored = checkpointer.restore(tmp_path / "ckpt", target)
  ls = restored["loss_scale"].validate()
  assert isinstance(ls, jmp_amp.DynamicLossScale)
  assert (float(ls.loss_scale), int(ls.counter)) == (2.0**12, 1234)
  assert ls.period == 2000 and ls.overflows is None
  assert float(ls.adjust(jnp.bool_(False)).loss_scale) == 2.0**11


def test_eq_is_python_bool_outside_jit_and_array_inside():
  a = jmp_amp.DynamicLossScale(jnp.float32(8.0))
  b = jmp_amp.DynamicLossScale(np.float32(8.0))
  assert (a == b) is True
  assert (a == a.adjust(jnp.bool_(False))) is False
  assert (a == a.replace(period=7)) is False  # static fields: Python bool
  assert a != jmp_amp.StaticLossScale(8.0)

  # Under jit the leaf values are unknown: == raises rather than returning
  # an array (which `if a == b:` would then fail on, less clearly).
  with pytest.raises(TypeError, match="needs concrete values"):
    jax.jit(lambda x, y: x == y)(a, b)
  # Static fields differ: that is known under jit too.
  same = jax.jit(lambda x: jnp.bool_(x == x.replace(period=7)))(a)
  assert same.item() is False
  assert (jmp_amp.NoOpLossScale() == jmp_amp.NoOpLossScale()) is True


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=80),
       dtype=st.sampled_from([jnp.float32, jnp.float16, jnp.bfloat16,
                              jnp.int32]),
       init=st.sampled_from([1.0, 2.0**4, 2.0**14, 2.0**15]),
       min_scale=st.sampled_from([0.0, 1.0]),
       factor=st.sampled_from([2, 1024]),
       period=st.integers(1, 3))
def test_adjust_never_reaches_zero_inf_or_nan(flags, dtype, init, min_scale,
                                             factor, period):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # int32 scales warn, as in jmp.
    ls = jmp_amp.DynamicLossScale(jnp.asarray(init, dtype), period=period,
                                  factor=factor, min_loss_scale=min_scale)
  adjust = jax.jit(lambda ls, f: ls.adjust(f))
  for flag in flags:
    ls = adjust(ls, jnp.bool_(flag))
    scale = np.asarray(ls.loss_scale)
    assert scale.dtype == np.dtype(dtype)
    value = float(scale)
    assert math.isfinite(value) and value > 0, (flag, value)
    inverse = np.asarray(ls.unscale(jnp.ones([], jnp.float32)))
    assert np.isfinite(inverse)


def test_int32_scale_with_zero_floor_stops_at_one():
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
    ls = jmp_amp.DynamicLossScale(jnp.int32(4), min_loss_scale=0)
  for _ in range(5):
    ls = ls.adjust(jnp.bool_(False))
  assert ls.loss_scale.dtype == jnp.int32 and int(ls.loss_scale) == 1
  assert float(ls.unscale(jnp.float32(3.0))) == 3.0


def test_int32_scale_growth_stops_below_int32_max():
  with pytest.warns(UserWarning):
    ls = jmp_amp.DynamicLossScale(jnp.int32(2**30), period=1)
  for _ in range(3):
    ls = ls.adjust(jnp.bool_(True))
  assert int(ls.loss_scale) == 2**30  # 2**31 does not fit in int32.


def test_float16_scale_floors_and_caps_in_float16():
  # jmp's README: DynamicLossScale(jmp.half_dtype()(2 ** 15)).
  ls = jmp_amp.DynamicLossScale(jmp_amp.half_dtype()(2**15), period=1,
                                min_loss_scale=0)
  ls = ls.adjust(jnp.bool_(True))
  assert ls.loss_scale.dtype == jnp.float16
  assert float(ls.loss_scale) == 2.0**15  # 2**16 is inf in float16.
  for _ in range(60):
    ls = ls.adjust(jnp.bool_(False))
  assert float(ls.loss_scale) == float(jnp.finfo(jnp.float16).tiny)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 0.0, -8.0])
def test_broken_scale_built_under_jit_is_reset_to_the_floor(bad):
  @jax.jit
  def build_and_step(value, finite):
    # Under jit the value cannot be checked, so the constructor accepts it.
    ls = jmp_amp.DynamicLossScale(value, period=4, min_loss_scale=2.0)
    return ls, ls.adjust(finite)
  for finite in (True, False):
    broken, ls = build_and_step(jnp.float32(bad), jnp.bool_(finite))
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0, 0)
    with pytest.raises(ValueError,
                       match="loss_scale must be a finite number > 0"):
      broken.validate()
    # From the floor it grows back as usual.
    for _ in range(4):
      ls = ls.adjust(jnp.bool_(True))
    assert float(ls.loss_scale) == 4.0


@pytest.mark.parametrize("leaves, message", [
    ((np.float32(np.nan), np.int32(0)), r"loss_scale must be a finite number "
     r"> 0, got nan"),
    ((np.float32(0.0), np.int32(0)), r"got 0.0"),
    ((np.float32(-4.0), np.int32(0)), r"got -4.0"),
    ((np.float32(8.0), np.int32(5)), r"counter must be an integer scalar in "
     r"\[0, 5\), got 5"),
    ((np.float32(8.0), np.int32(-1)), r"counter must be an integer scalar"),
    ((np.float32(8.0), np.float32(1.0)), r"counter must be an integer scalar"),
    ((np.float32(0.5), np.int32(0)), r"loss_scale \(0.5\) must not be below "
     r"min_loss_scale \(1.0\)"),
    ((jax.ShapeDtypeStruct((), jnp.float32), np.int32(0)),
     r"loss_scale must be concrete"),
])
def test_validate_rejects_restored_garbage(leaves, message):
  treedef = jax.tree_util.tree_structure(
      jmp_amp.DynamicLossScale(8.0, period=5))
  restored = jax.tree_util.tree_unflatten(treedef, leaves)
  with pytest.raises(ValueError, match=message):
    restored.validate()


def test_validate_checks_overflows_and_static():
  ls = jmp_amp.DynamicLossScale(8.0, hysteresis=2)
  assert ls.validate() is ls
  bad = jax.tree_util.tree_map(lambda x: x, ls)
  bad = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(ls),
                                     [ls.loss_scale, ls.counter, np.int32(2)])
  with pytest.raises(ValueError,
                     match=r"overflows must be an integer scalar in "
                     r"\[0, 2\), got 2"):
    bad.validate()
  assert jmp_amp.NoOpLossScale().validate() == jmp_amp.NoOpLossScale()
  assert jmp_amp.StaticLossScale(2.0).validate() == jmp_amp.StaticLossScale(2.0)


@pytest.mark.filterwarnings("ignore:Expected floating type")
@pytest.mark.parametrize("value", [2.0**-126, 2.0**127, 1, np.float64(3e38),
                                   np.int64(2**20), jnp.bfloat16(2.0**100)])
def test_float32_normal_range_is_accepted(value):
  assert float(jmp_amp.StaticLossScale(value).loss_scale) == float(value)
  dynamic = jmp_amp.DynamicLossScale(value, min_loss_scale=0)
  assert float(dynamic.loss_scale) == pytest.approx(float(value), rel=1e-7)
