"""Autocast of higher-order primitives: calls, remat, loops, custom rules.

These primitives hold jaxprs of their own. Each handler rebuilds the
primitive with JAX's public API (`lax.scan`, `jax.checkpoint`,
`jax.custom_vjp`, ...) around an evaluation of its inner jaxprs under the
same rules, so that the result composes with every JAX transformation. A
handler gets that evaluation as a function, `evaluate(jaxpr, args)`, from the
interpreter.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax import lax
import numpy as np

from jmp_amp._src.autocast.casting import aval_struct
from jmp_amp._src.autocast.casting import bind
from jmp_amp._src.autocast.casting import bind_as_traced
from jmp_amp._src.autocast.casting import cast_all
from jmp_amp._src.autocast.casting import dtype_of
from jmp_amp._src.autocast.casting import is_float
from jmp_amp._src.autocast.casting import join_dtypes
from jmp_amp._src.autocast.casting import scan_counts
from jmp_amp._src.autocast.casting import struct

# Evaluates a Jaxpr or ClosedJaxpr on a list of values under the rules.
Evaluate = Callable[[Any, Sequence[Any]], list]


def _split(values: Sequence, *sizes: int) -> list:
  """`values` cut into pieces of `sizes`, then the rest."""
  pieces = []
  for size in sizes:
    pieces.append(list(values[:size]))
    values = values[size:]
  return [*pieces, list(values)]


def _convert_element_type(evaluate: Evaluate, eqn, invals) -> list:
  del evaluate
  (x,), (v,) = invals, eqn.invars
  if v.aval.dtype == eqn.params["new_dtype"] and is_float(v.aval.dtype):
    # Only the weak type changed when traced: not a cast the user asked for,
    # so the value keeps its autocast dtype.
    return [x]
  # A real cast written in the function (x.astype(f32)) is honoured.
  return bind(eqn, [x])


def _inline(evaluate: Evaluate, eqn, invals) -> list:
  """jit / closed_call: evaluate the callee in place, under the same rules."""
  return evaluate(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")),
                  invals)


def _remat(evaluate: Evaluate, eqn, invals) -> list:
  params = eqn.params
  fn = lambda *xs: evaluate(params["jaxpr"], xs)
  return jax.checkpoint(fn, prevent_cse=params["prevent_cse"],
                        policy=params["policy"])(*invals)


# ---- Loops and conditionals. ------------------------------------------------


def _fixed_carry_dtypes(body: Callable[[list, list], list], init: list,
                        xs: Sequence[jax.ShapeDtypeStruct] = ()) -> list:
  """Carry dtypes that `body(carry, xs)` maps to themselves, widening as needed.

  The carry starts in the dtypes of `init`; while the body returns a carry in
  a wider (or different half) dtype, the carry is widened and the body traced
  again. Dtypes only widen, so this stops after a few steps.
  """
  carry_dtypes = [dtype_of(c) for c in init]
  for _ in range(8):
    structs = [jax.ShapeDtypeStruct(np.shape(c), d)
               for c, d in zip(init, carry_dtypes)]
    outs = jax.eval_shape(body, structs, list(xs))
    new = [join_dtypes(d, o.dtype) for d, o in zip(carry_dtypes, outs)]
    if new == carry_dtypes:
      return carry_dtypes
    carry_dtypes = new
  raise AssertionError(f"carry dtypes did not settle: {carry_dtypes}")


def _scan(evaluate: Evaluate, eqn, invals) -> list:
  params = eqn.params
  n_consts, n_carry = scan_counts(params)
  consts, init, xs = _split(invals, n_consts, n_carry)

  def step(carry, x):
    return _split(evaluate(params["jaxpr"], [*consts, *carry, *x]), n_carry)

  x_slice = [jax.ShapeDtypeStruct(np.shape(x)[1:], dtype_of(x)) for x in xs]
  carry_dtypes = _fixed_carry_dtypes(lambda c, x: step(c, x)[0], init,
                                     x_slice)

  def fixed_step(carry, x):
    new_carry, ys = step(carry, x)
    return cast_all(new_carry, carry_dtypes), ys

  carry, ys = lax.scan(fixed_step, cast_all(init, carry_dtypes), xs,
                       length=params["length"], reverse=params["reverse"],
                       unroll=params["unroll"])
  return [*carry, *ys]


def _while(evaluate: Evaluate, eqn, invals) -> list:
  params = eqn.params
  cond_consts, body_consts, init = _split(
      invals, params["cond_nconsts"], params["body_nconsts"])

  def body(carry):
    return evaluate(params["body_jaxpr"], [*body_consts, *carry])

  def cond(carry):
    return evaluate(params["cond_jaxpr"], [*cond_consts, *carry])[0]

  carry_dtypes = _fixed_carry_dtypes(lambda c, _: body(c), init)
  out = lax.while_loop(cond, lambda c: cast_all(body(c), carry_dtypes),
                       cast_all(init, carry_dtypes))
  return list(out)


def _cond(evaluate: Evaluate, eqn, invals) -> list:
  index, *operands = invals
  branches = eqn.params["branches"]

  def run(branch):
    return lambda *xs: evaluate(branch, xs)

  structs = [struct(x) for x in operands]
  shapes = [jax.eval_shape(run(b), *structs) for b in branches]
  # Branches must agree on output dtypes: take the widest of each output.
  out_dtypes = [functools.reduce(join_dtypes, [np.dtype(s[i].dtype)
                                               for s in shapes])
                for i in range(len(eqn.outvars))]
  fns = [lambda *xs, b=b: cast_all(run(b)(*xs), out_dtypes) for b in branches]
  return list(lax.switch(index, fns, *operands))


# ---- custom_jvp and custom_vjp. ---------------------------------------------


class _CustomCall(NamedTuple):
  """A custom_jvp/custom_vjp call, split for rebuilding it under the rules.

  The first `num_consts` operands are the values the function closes over.
  They stay closed over in the rebuilt function: JAX differentiates custom
  functions with respect to their explicit arguments only.
  """
  primal: Callable[..., tuple]  # The function, evaluated under the rules.
  consts: list
  args: list
  out_dtypes: list  # The dtypes `primal` returns.
  const_structs: list  # Shapes and dtypes of the consts as traced,
  arg_structs: list  # and of the args.


def _as_traced(eqn, consts) -> Callable[..., list]:
  """The call of `eqn` as traced (custom rules included), a function of args."""
  return lambda *xs: bind(eqn, [*consts, *xs])


def _split_custom_call(evaluate: Evaluate, eqn, invals):
  """The `_CustomCall` of `eqn`; None if an input or output is not floating."""
  n = eqn.params.get("num_consts", 0)
  if not all(is_float(v.aval.dtype) for v in [*eqn.invars[n:], *eqn.outvars]):
    return None  # float0 tangents: keep it simple.
  consts, args = _split(invals, n)
  call = eqn.params["call_jaxpr"]

  def primal(*xs):
    return tuple(evaluate(call, [*consts, *xs]))

  out_dtypes = [o.dtype for o in jax.eval_shape(primal, *map(struct, args))]
  # Named after the original function, for readable jaxprs.
  debug_info = getattr(call.jaxpr, "debug_info", None)
  primal.__name__ = getattr(debug_info, "func_name", None) or primal.__name__
  return _CustomCall(primal, consts, args, out_dtypes,
                     [aval_struct(v.aval) for v in eqn.invars[:n]],
                     [aval_struct(v.aval) for v in eqn.invars[n:]])


def _custom_jvp_call(evaluate: Evaluate, eqn, invals) -> list:
  """Keeps the custom JVP rule; runs both the function and the rule autocast.

  The rule is traced at the original dtypes (by differentiating the original
  call with respect to its arguments) and that jaxpr is evaluated under the
  rules like any other.
  """
  call = _split_custom_call(evaluate, eqn, invals)
  if call is None:
    return bind_as_traced(eqn, invals)
  n_out = len(eqn.outvars)

  def replay_jvp(cs, primals, tangents):
    return jax.jvp(_as_traced(eqn, cs), primals, tangents)

  def fn_jvp(primals, tangents):
    jvp_jaxpr = jax.make_jaxpr(replay_jvp)(call.const_structs,
                                           call.arg_structs, call.arg_structs)
    outs = evaluate(jvp_jaxpr, [*call.consts, *primals, *tangents])
    outs, tangents_out = _split(outs, n_out)
    return (tuple(cast_all(outs, call.out_dtypes)),
            tuple(cast_all(tangents_out, call.out_dtypes)))

  fn = jax.custom_jvp(call.primal)
  fn.defjvp(fn_jvp)
  return list(fn(*call.args))


def _custom_vjp_call(evaluate: Evaluate, eqn, invals) -> list:
  """Keeps the custom VJP rule; runs function, fwd and bwd autocast.

  The original fwd and bwd are traced at the original dtypes (through
  `jax.vjp` of the original call with respect to its arguments, whose
  pullback is a pytree of residuals) and both jaxprs are evaluated under the
  rules. The user's bwd rule is what the pullback runs.
  """
  call = _split_custom_call(evaluate, eqn, invals)
  if call is None:
    return bind_as_traced(eqn, invals)
  out_structs = [aval_struct(v.aval) for v in eqn.outvars]
  arg_dtypes = [dtype_of(x) for x in call.args]

  def replay_vjp(cs, xs):
    return jax.vjp(_as_traced(eqn, cs), *xs)

  @functools.cache
  def traced_fwd():
    return jax.make_jaxpr(replay_vjp, return_shape=True)(call.const_structs,
                                                         call.arg_structs)

  def fwd(*xs):
    closed, shape = traced_fwd()
    outs, pullback = jax.tree.unflatten(
        jax.tree.structure(shape), evaluate(closed, [*call.consts, *xs]))
    return (tuple(cast_all(outs, call.out_dtypes)),
            tuple(jax.tree.leaves(pullback)))

  def bwd(residuals, cts):
    _, (_, pullback_shape) = traced_fwd()
    res_tree = jax.tree.structure(pullback_shape)

    def traced_bwd(res, cts):
      return jax.tree.unflatten(res_tree, res)(list(cts))

    closed = jax.make_jaxpr(traced_bwd)(jax.tree.leaves(pullback_shape),
                                        out_structs)
    in_cts = evaluate(closed, [*residuals, *cts])
    return tuple(cast_all(in_cts, arg_dtypes))

  fn = jax.custom_vjp(call.primal)
  fn.defvjp(fwd, bwd)
  return list(fn(*call.args))


# The primitives rules.py calls structural, by name.
HANDLERS: dict[str, Callable[[Evaluate, Any, list], list]] = {
    "convert_element_type": _convert_element_type,
    "jit": _inline, "pjit": _inline, "closed_call": _inline,
    "core_call": _inline, "call": _inline,
    "remat2": _remat, "checkpoint": _remat,
    "custom_jvp_call": _custom_jvp_call,
    "custom_vjp_call": _custom_vjp_call,
    "scan": _scan, "while": _while, "cond": _cond,
}
