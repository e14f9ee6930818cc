"""Tests for NoOpLossScale, StaticLossScale and DynamicLossScale."""

import math

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


def test_unflatten_accepts_placeholders():
  ls = jmp_amp.DynamicLossScale(jnp.float32(8.0))
  treedef = jax.tree_util.tree_structure(ls)
  for placeholder in (None, object(), jax.ShapeDtypeStruct((), jnp.float32)):
    rebuilt = jax.tree_util.tree_unflatten(treedef, [placeholder] * 3)
    assert rebuilt.loss_scale is placeholder
  shapes = jax.eval_shape(lambda s: s.adjust(jnp.bool_(True)), ls)
  assert shapes.loss_scale.dtype == jnp.float32


def test_adjust_keeps_leaf_types_stable():
  for ls in (jmp_amp.DynamicLossScale(2.0**15),
             jmp_amp.DynamicLossScale(jnp.asarray(2.0**15))):
    nxt = ls.adjust(jnp.bool_(False))
    for a, b in zip(jax.tree_util.tree_leaves(ls), jax.tree_util.tree_leaves(nxt)):
      assert jnp.asarray(a).dtype == jnp.asarray(b).dtype


@pytest.mark.parametrize("cls", [jmp_amp.StaticLossScale, jmp_amp.DynamicLossScale])
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
    (lambda: jmp_amp.DynamicLossScale(0.0), "loss_scale must be a finite number > 0, got 0.0"),
    (lambda: jmp_amp.DynamicLossScale(-2.0), "got -2.0"),
    (lambda: jmp_amp.DynamicLossScale(jnp.float32(jnp.inf)), "got inf"),
    (lambda: jmp_amp.DynamicLossScale(jnp.float32(jnp.nan)), "got nan"),
    (lambda: jmp_amp.StaticLossScale(0), "StaticLossScale.loss_scale must be"),
    (lambda: jmp_amp.StaticLossScale(-1.0), "got -1.0"),
    (lambda: jmp_amp.DynamicLossScale(8.0, period=0), "period must be an integer >= 1, got 0"),
    (lambda: jmp_amp.DynamicLossScale(8.0, period=2.5), "period must be an integer"),
    (lambda: jmp_amp.DynamicLossScale(8.0, factor=1), "factor must be a finite number > 1, got 1"),
    (lambda: jmp_amp.DynamicLossScale(8.0, factor=0.5), "factor must be"),
    (lambda: jmp_amp.DynamicLossScale(8.0, backoff_factor=1.0), r"backoff_factor must be in \(0, 1\)"),
    (lambda: jmp_amp.DynamicLossScale(8.0, backoff_factor=0.0), "backoff_factor"),
    (lambda: jmp_amp.DynamicLossScale(8.0, min_loss_scale=-1.0), "min_loss_scale must be"),
    (lambda: jmp_amp.DynamicLossScale(8.0, min_loss_scale=64.0, max_loss_scale=32.0),
     r"min_loss_scale \(64.0\) must not exceed max_loss_scale \(32.0\)"),
    (lambda: jmp_amp.DynamicLossScale(8.0, hysteresis=0), "hysteresis must be an integer >= 1"),
])
def test_bad_hyper_parameters_raise_clear_errors(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_adjust_requires_scalar_flag():
  ls = jmp_amp.DynamicLossScale(8.0)
  with pytest.raises(ValueError, match="boolean scalar"):
    ls.adjust(jnp.array([True, False]))


def test_dynamic_loss_scale_is_immutable():
  ls = jmp_amp.DynamicLossScale(8.0)
  with pytest.raises(AttributeError, match="immutable"):
    ls.period = 3
  assert ls.replace(period=3).period == 3
  with pytest.raises(ValueError, match="period"):
    ls.replace(period=0)
