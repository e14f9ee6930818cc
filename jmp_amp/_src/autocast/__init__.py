"""Op-level autocast: `torch.autocast` semantics for any JAX function.

`rules` says which primitive runs in which dtype (`AutocastRules`);
`interpreter` traces the function and evaluates its jaxpr equation by
equation under those rules (`autocast`); `structural` rebuilds the
higher-order primitives (calls, remat, loops, custom rules) around their
inner jaxprs; `casting` holds the casts and re-binding both share.
"""

from jmp_amp._src.autocast.interpreter import autocast
from jmp_amp._src.autocast.rules import AutocastRules
