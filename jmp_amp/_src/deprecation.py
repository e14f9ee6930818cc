"""Deprecated aliases: old names that keep working for one release.

A function that moved or was renamed stays reachable under its old name as a
wrapper that warns (`DeprecationWarning`, naming what to
use instead) and then calls the new function. Classes and constants stay as
plain aliases (a warning would need a module-level ``__getattr__``, which
this package does not use); they are the same object as their replacement.
Neither appears in an ``__all__``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar
import warnings

F = TypeVar("F", bound=Callable[..., Any])


def deprecated(fn: F, old: str, new: str) -> F:
  """`fn` under its old name `old`: warns that `new` replaces it, then calls it.

  Example:
    >>> import warnings
    >>> from jmp_amp._src import deprecation
    >>> twice = deprecation.deprecated(lambda x: 2 * x, "pkg.double",
    ...                                "pkg.twice")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   value = twice(3)
    >>> value, str(caught[0].message)
    (6, 'pkg.double is deprecated and will be removed in the next release;
    instead use pkg.twice.')

  Args:
    fn: the function that replaces the old name (the old behaviour).
    old: the deprecated name, as users spell it (``"jmp_amp.flax.set_fp8"``).
    new: what to use instead, as users would write it.

  Returns:
    A wrapper with `fn`'s signature and a one-line docstring naming `new`.
  """
  message = (f"{old} is deprecated and will be removed in the next release; "
             f"instead use {new}.")

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    return fn(*args, **kwargs)

  wrapper.__doc__ = f"Deprecated: use {new}."
  wrapper.__name__ = wrapper.__qualname__ = old.rsplit(".", 1)[-1]
  wrapper.deprecated_replacement = new
  return wrapper


def also_as(wrapper: F, old: str) -> F:
  """The deprecated `wrapper` under another old name, with its replacement."""
  return deprecated(wrapper.__wrapped__, old, wrapper.deprecated_replacement)
