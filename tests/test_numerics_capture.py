"""Telemetry on models written the way LLM code is written, not by us.

Each model runs its blocks through a Flax transform (`nnx.remat`,
`nnx.cond`, `nnx.scan` over `nnx.vmap`-built blocks, a `jax.lax.scan` over
`nnx.split` state); each test checks that every module that ran has its
``out`` and ``grad`` entries, equal (within float32 rounding) to those of
the same model run plainly, block by block in Python.
"""

import json

from flax import nnx
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_amp
import jmp_amp.flax
import jmp_amp.flax.numerics as fnum
import jmp_amp.numerics

D = 8


class Dense(nnx.Module):
  """A user's own layer, as LLM code writes them."""

  def __init__(self, d_in, d_out, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out))
                            / np.sqrt(d_in))

  def __call__(self, x):
    return x @ self.kernel[...].astype(x.dtype)


class RMSNorm(nnx.Module):
  """A user's own norm (Gemma's, say)."""

  def __init__(self, d):
    self.scale = nnx.Param(jnp.ones((d,)))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-6)
    return x32 * self.scale[...]


class Block(nnx.Module):

  def __init__(self, rngs):
    self.fc = Dense(D, D, rngs=rngs)
    self.norm = RMSNorm(D)

  def __call__(self, x):
    return (x + self.norm(jax.nn.gelu(self.fc(x)))).astype(x.dtype)


def stacked_blocks(n, seed=0):
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return Block(nnx.Rngs(key))
  return make(jax.random.split(jax.random.key(seed), n))


def unstacked(stack, n):
  """The blocks of an nnx.vmap-built stack as a list of plain blocks."""
  blocks = []
  for i in range(n):
    block = Block(nnx.Rngs(0))
    nnx.update(block, jax.tree.map(lambda v: v[i], nnx.state(stack)))
    blocks.append(block)
  return nnx.List(blocks)


def telemetry(model, x, numerics="**"):
  """`metrics["numerics"]` of one train step, on the host."""
  opt = nnx.Optimizer(model, jmp_amp.loss_scaling(
      optax.sgd(0.0), jmp_amp.NoOpLossScale()), wrt=nnx.Param)
  step = jmp_amp.flax.make_train_step(
      lambda m, x: jnp.mean(m(x) ** 2), numerics=numerics)
  return jax.device_get(step(model, opt, x)["numerics"])


def assert_same_stats(got, want, only=None):
  """Every entry of `want` (of the paths `only`) is in `got`, alike."""
  paths = sorted(want) if only is None else only
  for path in paths:
    assert path in got, (path, sorted(got))
    assert sorted(got[path]) == sorted(want[path]), path
    for kind, stats in want[path].items():
      for name, value in stats.items():
        if name == "nonfinite":
          assert got[path][kind][name] == value, (path, kind)
        else:
          np.testing.assert_allclose(got[path][kind][name], value,
                                     rtol=2e-5, atol=1e-7,
                                     err_msg=f"{path} {kind} {name}")


X = jax.random.normal(jax.random.key(1), (4, D))


class TwoBlocks(nnx.Module):
  """The second block under nnx.remat, as LLM code saves memory."""

  def __init__(self, remat, rngs):
    self.a = Block(rngs)
    self.b = Block(rngs)
    self.remat = remat

  def __call__(self, x):
    x = self.a(x)
    if self.remat:
      return nnx.remat(lambda m, x: m(x))(self.b, x)
    return self.b(x)


def test_a_block_under_nnx_remat_reports_every_module():
  got = telemetry(TwoBlocks(True, nnx.Rngs(0)), X)
  want = telemetry(TwoBlocks(False, nnx.Rngs(0)), X)
  assert {"b", "b/fc", "b/norm"} <= set(want)
  assert_same_stats(got, want)
  assert sorted(got) == sorted(want)


class Branches(nnx.Module):
  """One of two blocks, chosen on device by nnx.cond."""

  def __init__(self, use_cond, rngs):
    self.a = Block(rngs)
    self.b = Block(rngs)
    self.use_cond = use_cond

  def __call__(self, x):
    if self.use_cond:
      return nnx.cond(jnp.sum(x) > 0, lambda a, b, x: a(x),
                      lambda a, b, x: b(x), self.a, self.b, x)
    return self.a(x)  # what the cond picks for the inputs below


def test_a_branch_under_nnx_cond_reports_the_modules_that_ran():
  x = jnp.abs(X)  # the branch of block a runs
  got = telemetry(Branches(True, nnx.Rngs(0)), x)
  want = telemetry(Branches(False, nnx.Rngs(0)), x)
  ran = ["", "a", "a/fc", "a/norm"]
  assert_same_stats(got, want, only=ran)
  # The branch that did not run: no element seen, zero gradients.
  assert got["b/fc"]["out"]["max_abs"] == 0
  assert got["b/fc"]["grad"]["zeros"] == 1


class Scanned(nnx.Module):
  """An embedding layer, a stack of blocks run by nnx.scan (each block
  rematerialised, as in LLM training), a head."""

  def __init__(self, n, rngs, scan=True):
    self.embed = nnx.Linear(D, D, rngs=rngs)
    self.blocks = stacked_blocks(n)
    if not scan:
      self.blocks = unstacked(self.blocks, n)
    self.head = nnx.Linear(D, 2, rngs=rngs)
    self.scan = scan

  def __call__(self, x):
    x = self.embed(x)
    if self.scan:
      @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
      @nnx.remat
      def run(block, x):
        return block(x)
      x = run(self.blocks, x)
    else:
      for block in self.blocks:
        x = block(x)
    return self.head(x)


def test_nnx_scan_over_vmap_built_blocks_reports_each_block():
  got = telemetry(Scanned(3, nnx.Rngs(0)), X)
  want = telemetry(Scanned(3, nnx.Rngs(0), scan=False), X)
  assert {"blocks/0/fc", "blocks/2/norm", "head"} <= set(want)
  assert_same_stats(got, want)
  assert sorted(got) == sorted(want)


class LaxScanned(nnx.Module):
  """A hand-written jax.lax.scan over the blocks' split state, which
  returns each block's state, as Flax's docs write it."""

  def __init__(self, n, rngs):
    self.embed = nnx.Linear(D, D, rngs=rngs)
    self.blocks = stacked_blocks(n)

  def __call__(self, x):
    x = self.embed(x)
    graphdef, state = nnx.split(self.blocks)

    def body(x, state):
      block = nnx.merge(graphdef, state)
      return block(x), nnx.state(block)

    x, state = jax.lax.scan(body, x, state)
    nnx.update(self.blocks, state)
    return x


class LaxUnrolled(nnx.Module):

  def __init__(self, scanned, n):
    self.embed = scanned.embed
    self.blocks = unstacked(scanned.blocks, n)

  def __call__(self, x):
    x = self.embed(x)
    for block in self.blocks:
      x = block(x)
    return x


def test_a_lax_scan_over_split_state_reports_each_block():
  model = LaxScanned(3, nnx.Rngs(0))
  want = telemetry(LaxUnrolled(model, 3), X)
  got = telemetry(model, X)
  assert {"blocks/1/fc", "blocks/1/norm"} <= set(want)
  assert_same_stats(got, want)


class OnlyAStack(nnx.Module):
  """A model that is nothing but its stack of blocks."""

  def __init__(self, n):
    self.blocks = stacked_blocks(n)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(block, x):
      return block(x)
    return run(self.blocks, x)


class OnlyUnrolled(nnx.Module):

  def __init__(self, stack, n):
    self.blocks = unstacked(stack, n)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def test_a_model_that_is_only_a_stack_matches_block_patterns():
  model = OnlyAStack(2)
  want = telemetry(OnlyUnrolled(model.blocks, 2), X, "blocks/*/fc")
  got = telemetry(model, X, "blocks/*/fc")
  assert sorted(got) == sorted(want) == ["blocks/0/fc", "blocks/1/fc"]
  assert_same_stats(got, want)


class WithHelpers(nnx.Module):
  """Public helper methods beside __call__, as model code has."""

  def __init__(self, rngs):
    self.fc = nnx.Linear(D, D, rngs=rngs)

  def logits_scale(self):
    return jnp.full((D,), 1e4)

  def features(self, x):
    return self.fc(x) * 1e3

  def __call__(self, x):
    return self.features(x) / self.logits_scale()


def test_helper_methods_do_not_count_as_outputs():
  model = WithHelpers(nnx.Rngs(0))
  got = telemetry(model, X)
  out = model(X)
  want = jmp_amp.numerics.tensor_stats(out)
  assert sorted(got) == ["", "fc"]
  np.testing.assert_allclose(got[""]["out"]["max_abs"], want["max_abs"],
                             rtol=1e-6)
  # Asked for, the helpers' outputs join __call__'s.
  _, stats = fnum.output_stats(lambda m, x: m(x), model, X,
                               methods=("__call__", "features"))
  assert stats[""]["out"]["max_abs"] > 100 * want["max_abs"]


def test_numerics_is_plain_data_for_logging():
  stats = telemetry(Scanned(2, nnx.Rngs(0)), X)
  flat = traverse_util.flatten_dict(stats, sep="/")
  assert "blocks/1/fc/grad/max_abs" in flat
  as_floats = jax.tree.map(float, stats)
  assert as_floats["blocks/1/fc"]["out"]["nonfinite"] == 0.0
  text = json.dumps(jax.tree.map(lambda v: v.item(), stats))
  assert json.loads(text)["head"]["grad"]["nonfinite"] == 0
  assert stats["head"]["out"]["nonfinite"].dtype == np.uint32


def test_counts_stay_exact_integers_past_2_to_the_24():
  nans = jnp.full((2**24 + 1,), jnp.nan, jnp.float32)
  s = jax.jit(jmp_amp.numerics.tensor_stats)(nans)
  assert s["nonfinite"].dtype == jnp.uint32
  assert int(s["nonfinite"]) == 2**24 + 1


@pytest.mark.slow  # the op-by-op replay: ~20 s each
@pytest.mark.filterwarnings("ignore:jmp_amp.flax. .* has no dtype knob")
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_find_nonfinite_names_the_block_of_a_rematted_scanned_stack(scan):
  model = Scanned(3, nnx.Rngs(0), scan=scan)
  rules = jmp_amp.flax.mixed_rules("float16")
  jmp_amp.flax.set_policies(model, rules)
  if scan:
    kernel = model.blocks.fc.kernel
    kernel[...] = kernel[...].at[1].multiply(1e5)  # block 1's fc overflows
  else:
    kernel = model.blocks[1].fc.kernel
    kernel[...] = kernel[...] * 1e5
  loss_fn = lambda m, x: jnp.mean(m(x.astype(jnp.float16)).astype(
      jnp.float32))
  report = jmp_amp.numerics.find_nonfinite(loss_fn, model, X * 10,
                                           rules=rules)
  assert report is not None
  assert (report.module, report.direction) == ("blocks/1/fc", "forward")
  assert report.suggested_rule == {
      "blocks/*/fc" if scan else "blocks/1/fc": "float32"}
