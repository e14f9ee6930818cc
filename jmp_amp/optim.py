"""Optimizer state and master weights in 16 bits.

`compress_state` keeps any optax optimizer's state (Adam's moments, momentum,
accumulators) in bfloat16; `low_precision_params`, chained last, updates
bfloat16 params with stochastic rounding or Kahan compensation;
`stochastic_round` is the rounding itself. See
docs/low-precision-optimizer.md for when to use which.

Example (Adam, bfloat16 params and moments: 6 bytes per parameter instead of
12):
  >>> opt = optax.chain(jmp_amp.optim.compress_state(optax.adam(1e-3)),
  ...                   jmp_amp.optim.low_precision_params("stochastic"))
  >>> params = {"w": jnp.ones(4, jnp.bfloat16)}
  >>> state = opt.init(params)
  >>> updates, state = opt.update({"w": jnp.ones(4, jnp.bfloat16)}, state,
  ...                             params)
  >>> params = optax.apply_updates(params, updates)
  >>> params["w"].dtype, state[0].inner_state[0].nu["w"].dtype
  (dtype(bfloat16), dtype(bfloat16))
"""

from jmp_amp._src.low_precision import compress_state
from jmp_amp._src.low_precision import low_precision_params
from jmp_amp._src.low_precision import stochastic_round

__all__ = ("compress_state", "low_precision_params", "stochastic_round")
