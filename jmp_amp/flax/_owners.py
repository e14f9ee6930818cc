"""Old name of the owner helpers, now in `jmp_amp.flax._paths`."""

from jmp_amp.flax._paths import CONTAINERS  # noqa: F401
from jmp_amp.flax._paths import own_params  # noqa: F401
from jmp_amp.flax._paths import owner  # noqa: F401
from jmp_amp.flax._paths import owning_paths  # noqa: F401
