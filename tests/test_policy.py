"""Tests for Policy, get_policy and floating-leaf casting."""

import dataclasses

import chex
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_amp
from jmp_amp._src import dtypes
from jmp_amp._src import policy as policy_lib

FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
# Without jax_enable_x64, jax arrays cannot hold float64.
ARRAY_FLOATS = (jnp.float16, jnp.bfloat16, jnp.float32)


def test_policy_is_frozen_hashable_and_static_for_jit():
  policy = jmp_amp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.compute_dtype = jnp.float16  # type: ignore[misc]
  assert hash(policy) == hash(jmp_amp.get_policy("p=f32,c=bf16,o=f32"))

  f = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
  assert f(jnp.ones(2), policy).dtype == jnp.bfloat16
  assert f(jnp.ones(2),
           policy.with_compute_dtype(jnp.float16)).dtype == jnp.float16


@pytest.mark.parametrize("name, expected", [
    ("float32", ("f32", "f32", "f32")),
    ("f32", ("f32", "f32", "f32")),
    ("full", ("f32", "f32", "f32")),
    ("bf16", ("bf16", "bf16", "bf16")),
    ("bfloat16", ("bf16", "bf16", "bf16")),
    ("half", ("f16", "f16", "f16")),  # CPU: half is float16, as in jmp.
    ("mixed_float16", ("f32", "f16", "f16")),
    ("mixed_bfloat16", ("f32", "bf16", "bf16")),
    ("params=float32,compute=bfloat16,output=float32", ("f32", "bf16", "f32")),
    ("p=f32,c=bf16,o=f32", ("f32", "bf16", "f32")),
    ("c=f16", ("f32", "f16", "f16")),
    ("p=f16,c=bf16", ("f16", "bf16", "bf16")),
    (" P = f32 , C = Half ", ("f32", "f16", "f16")),
    # jmp_amp's own dtype names: alone, that dtype for all three, as jmp's.
    ("fp32", ("f32", "f32", "f32")),
    ("Single", ("f32", "f32", "f32")),
    ("double", ("f64", "f64", "f64")),
    ("c=fp16,o=fp32", ("f32", "f16", "f32")),
])
def test_get_policy_grammar(name, expected):
  policy = jmp_amp.get_policy(name)
  assert str(policy) == "p={},c={},o={}".format(*expected)


@pytest.mark.parametrize("name, message", [
    ("compute_float16", "Unknown dtype 'compute_float16'"),
    ("p=f32,c=int8", "Unknown dtype 'int8'"),
    ("p=f32,x=bf16", "Unknown key 'x'"),
    ("p=f32,c", "Malformed part 'c'"),
    ("p=f32,p=bf16", "given twice"),
    ("mixed_float8", "Unknown dtype 'mixed_float8'"),
    ("", "Unknown dtype ''"),
])
def test_get_policy_rejects_bad_strings_naming_the_part(name, message):
  with pytest.raises(ValueError, match=message) as info:
    jmp_amp.get_policy(name)
  # The error lists what is accepted.
  assert "mixed_bfloat16" in str(info.value)
  assert "bfloat16" in str(info.value)


def test_get_policy_rejects_non_strings():
  with pytest.raises(TypeError, match="Policy or a str"):
    jmp_amp.get_policy(32)


@pytest.mark.parametrize("bad", [jnp.int32, np.bool_, bool, "int8", object,
                                 None, jnp.complex64, complex, int])
def test_policy_rejects_non_float_dtypes(bad):
  with pytest.raises((TypeError, ValueError), match="compute_dtype"):
    jmp_amp.Policy(jnp.float32, bad, jnp.float32)


def test_policy_of_nones_raises_instead_of_float64():
  with pytest.raises(TypeError, match=r"param_dtype must be a floating-point "
                     r"dtype .* got None \(NumPy would read None as float64\)"):
    jmp_amp.Policy(None, None, None)


@pytest.mark.parametrize("spelling", [np.float16, np.dtype("float16"),
                                      jnp.float16, "float16", "f16"])
def test_policy_dtypes_are_callable_scalar_types_equal_to_np_dtypes(spelling):
  policy = jmp_amp.Policy(jnp.float32, spelling, jnp.float32)
  assert policy.compute_dtype is jnp.float16
  assert policy.compute_dtype == np.dtype(np.float16)
  assert np.dtype(np.float16) == policy.compute_dtype
  assert policy.compute_dtype != np.dtype(np.float32)
  assert policy == jmp_amp.get_policy("p=f32,c=f16,o=f32")
  assert hash(policy) == hash(jmp_amp.get_policy("p=f32,c=f16,o=f32"))
  # jmp code calls the dtypes: policy.compute_dtype(x), half_dtype()(2 ** 15).
  x = policy.compute_dtype(np.array([1.5, 2.0]))
  assert isinstance(x, jax.Array) and x.dtype == np.float16
  np.testing.assert_array_equal(np.asarray(x, np.float32), [1.5, 2.0])
  assert jnp.zeros(2, policy.compute_dtype).dtype == np.float16
  assert np.zeros(2, policy.compute_dtype).dtype == np.float16


def test_half_dtype_is_callable_like_jmps():
  half = jmp_amp.half_dtype()
  assert half is jnp.float16  # CPU; bfloat16 on TPU.
  scale = half(2**15)
  assert scale.dtype == np.float16 and float(scale) == 2.0**15


def test_jmp_readme_recipe_runs():
  # jmp's README, with `import jmp_amp as jmp`.
  jmp = jmp_amp
  half = jmp.half_dtype()
  full = jnp.float32
  my_policy = jmp.Policy(compute_dtype=half, param_dtype=full,
                         output_dtype=half)
  assert my_policy == jmp.get_policy("params=float32,compute=half,output=half")
  params = {"w": jnp.ones((3, 2))}
  x = jnp.ones((4, 3))

  def loss_fn(params, loss_scale):
    params, x_ = my_policy.cast_to_compute((params, x))
    y = my_policy.cast_to_output(x_ @ params["w"])
    loss = jnp.mean(my_policy.cast_to_param(y) ** 2)
    return loss_scale.scale(loss)

  def train_step(params, loss_scale):
    grads = jax.grad(loss_fn)(params, loss_scale)
    grads = my_policy.cast_to_param(grads)
    grads = loss_scale.unscale(grads)
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    new_params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    params = jmp.select_tree(grads_finite, new_params, params)
    return params, loss_scale, grads

  loss_scale = jmp.DynamicLossScale(jmp.half_dtype()(2**15))
  # 3.0 * 2**15 overflows float16 in the backward matmul: the step is skipped
  # and the scale halves; at 2**14 the gradients fit.
  params, loss_scale, grads = train_step(params, loss_scale)
  assert not bool(jmp.all_finite(grads))
  np.testing.assert_array_equal(params["w"], np.ones((3, 2)))
  assert loss_scale.loss_scale.dtype == np.float16
  assert float(loss_scale.loss_scale) == 2.0**14
  params, loss_scale, grads = train_step(params, loss_scale)
  np.testing.assert_allclose(grads["w"], np.full((3, 2), 3.0), rtol=1e-3)
  np.testing.assert_allclose(params["w"], np.full((3, 2), 0.7), rtol=1e-3)
  assert (float(loss_scale.loss_scale), int(loss_scale.counter)) == (2.0**14, 1)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(FLOATS), st.sampled_from(FLOATS),
       st.sampled_from(FLOATS))
def test_str_round_trips_through_get_policy(p, c, o):
  policy = jmp_amp.Policy(p, c, o)
  assert jmp_amp.get_policy(str(policy)) == policy


def test_with_methods_replace_one_field():
  policy = jmp_amp.get_policy("float32")
  assert policy.with_param_dtype(jnp.bfloat16).param_dtype == jnp.bfloat16
  assert policy.with_compute_dtype("f16").compute_dtype == jnp.float16
  changed = policy.with_output_dtype(jnp.bfloat16)
  assert (changed.param_dtype, changed.compute_dtype, changed.output_dtype) == (
      jnp.float32, jnp.float32, jnp.bfloat16)


_LEAVES = st.one_of(
    st.sampled_from(["float32", "float16", "bfloat16"]).map(
        lambda d: ("float", d)),
    st.sampled_from(["int32", "int8", "uint8", "bool"]).map(
        lambda d: ("int", d)),
    st.just(("key", None)),
    st.sampled_from([1.5, 3, "name", None]).map(lambda v: ("py", v)),
)


def _make_leaf(kind, arg):
  if kind in ("float", "int"):
    return jnp.zeros((2,), dtype=arg)
  if kind == "key":
    return jax.random.key(0)
  return arg


@settings(max_examples=50, deadline=None)
@given(st.lists(_LEAVES, min_size=1, max_size=6),
       st.sampled_from(ARRAY_FLOATS), st.booleans())
def test_casting_touches_only_floating_array_leaves(specs, dtype, use_numpy):
  tree = {f"leaf{i}": _make_leaf(*spec) for i, spec in enumerate(specs)}
  if use_numpy:
    tree = {k: np.asarray(v) if isinstance(v, jax.Array) and
            not jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v
            for k, v in tree.items()}
  policy = jmp_amp.Policy(jnp.float32, dtype, jnp.float32)
  cast = policy.cast_to_compute(tree)
  for (kind, _), (key, before) in zip(specs, tree.items()):
    after = cast[key]
    if kind == "float":
      assert after.dtype == dtype
      np.testing.assert_array_equal(np.asarray(after, np.float32),
                                    np.asarray(before, np.float32))
    else:
      assert after is before


def test_casting_abstract_trees_and_structure_preserved():
  abstract = {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32),
              "step": jax.ShapeDtypeStruct((), jnp.int32)}
  cast = jmp_amp.get_policy("bf16").cast_to_param(abstract)
  assert cast["w"].dtype == jnp.bfloat16 and cast["w"].shape == (3, 2)
  assert cast["step"] is abstract["step"]


def test_cast_to_full_and_half():
  tree = {"a": jnp.ones(2, jnp.bfloat16), "i": jnp.ones(2, jnp.int8)}
  chex.assert_trees_all_equal_dtypes(
      jmp_amp.cast_to_full(tree), {"a": jnp.ones(2), "i": tree["i"]})
  assert jmp_amp.cast_to_half(tree)["a"].dtype == jmp_amp.half_dtype()


def test_import_jmp_amp_is_light():
  import subprocess
  import sys
  code = ("import sys, jmp_amp; bad = [m for m in ('flax', 'models', 'torch', "
          "'orbax') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, check=False)
  assert result.returncode == 0, result.stdout + result.stderr


def _jmp_strings(jmp_policy) -> list[str]:
  """Strings jmp 0.0.4's get_policy accepts: each of its dtype names alone,
  and as each part, with every spelling of the keys."""
  names = list(jmp_policy.name_to_dtype) + ["half"]
  strings = list(names)
  for name in names:
    strings += [f"c={name}", f"p={name}", f"o={name}", f"p=f32,c={name}",
                f"params={name},compute=bf16,output=full",
                f"compute={name},output=f32", f"p={name},c=half,o={name}"]
  return strings


def test_every_string_jmp_accepts_means_what_it_means_in_jmp():
  jmp_policy = pytest.importorskip("jmp._src.policy")
  strings = _jmp_strings(jmp_policy)
  assert len(strings) == 80  # 10 names (9 and "half"), 8 forms each
  for text in strings:
    theirs, ours = jmp_policy.get_policy(text), jmp_amp.get_policy(text)
    assert [np.dtype(getattr(ours, f)) for f in _FIELDS] == [
        np.dtype(getattr(theirs, f)) for f in _FIELDS], text


_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")


@pytest.mark.parametrize("name", ["fp16", " FP16 "])
def test_fp16_alone_is_refused_naming_both_policies_it_could_mean(name):
  # accelerate's "fp16" is mixed precision; by jmp's rule a dtype name alone
  # is all three in that dtype. Neither is chosen silently.
  with pytest.raises(ValueError) as err:
    jmp_amp.get_policy(name)
  assert str(err.value) == (
      f"{name.strip()!r} alone is not a policy name: for mixed precision "
      "(float32 params, accelerate's 'fp16') write 'mixed_float16', for "
      "float16 everywhere 'float16'; as a part ('c=fp16') it is the float16 "
      "dtype.")
  assert str(jmp_amp.get_policy("c=fp16")) == "p=f32,c=f16,o=f16"


def test_every_dtype_name_alone_means_that_dtype_everywhere_or_is_refused():
  # One meaning per name: a dtype name alone is the policy of that dtype for
  # all three (as in jmp), unless it is refused; no name is in two rows.
  table = policy_lib.POLICY_NAMES
  names = [n for row in table for n in row]
  assert len(names) == len(set(names)), names
  for name in dtypes.ACCEPTED_DTYPE_NAMES:
    if name in policy_lib.NOT_POLICY_NAMES:
      assert name not in names
      continue
    assert jmp_amp.get_policy(name) == jmp_amp.get_policy(
        f"p={name},c={name},o={name}"), name
  for row, parts in table.items():
    for name in row:
      assert jmp_amp.get_policy(name) == jmp_amp.get_policy(
          "p={},c={},o={}".format(*parts)), name
  assert set(names) - set(dtypes.ACCEPTED_DTYPE_NAMES) == {
      "mixed_bfloat16", "mixed_float16"}


def test_unknown_name_lists_the_policy_names_and_the_dtypes():
  with pytest.raises(ValueError) as err:
    jmp_amp.get_policy("no_such_policy")
  text = str(err.value)
  names = text.split("a policy name (")[1].split(")")[0].split(", ")
  assert names == [n for row in policy_lib.POLICY_NAMES for n in row]
  assert "fp16" not in names and "fp16" in text.split("the dtypes ")[1]
