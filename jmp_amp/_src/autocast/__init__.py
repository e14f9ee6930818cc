"""Op-level autocast: `torch.autocast` semantics for any JAX function."""

from jmp_amp._src.autocast.interpreter import autocast
from jmp_amp._src.autocast.interpreter import AutocastRules
from jmp_amp._src.autocast.interpreter import DEFAULT_AUTOCAST_RULES
