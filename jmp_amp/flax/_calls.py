"""Seeing an NNX model's method calls while it is traced.

NNX has no method interceptor (linen has `flax.linen.intercept_methods`), so
telemetry watches the interpreter's calls. Python 3.12+: `sys.monitoring`,
with start and return events on the code of the model's module methods only,
so no other call pays anything, and no other tool's slot is taken (a
debugger, coverage and cProfile keep theirs). Before 3.12: `sys.setprofile`,
which puts the whole trace in the interpreter's slow tracing mode (a no-op
profile function alone adds about a second to tracing a 16-block GPT).
"""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Any, Callable, Iterable

# A profile-style function: hook(frame, "call" or "return", value or None).
Hook = Callable[[Any, str, Any], Any]

_TOOL_NAME = "jmp_amp.flax.numerics"
# 0-2 and 5 are the debugger, coverage, profiler and optimizer ids.
_FREE_TOOL_IDS = (3, 4)


def method_codes(types: Iterable[type]) -> set:
  """The code objects of the ``__call__`` and public methods of `types`
  (their bases' too, through ``functools.wraps`` wrappers), whose first
  argument is ``self``: the frames `follow` reports on Python 3.12+."""
  codes = set()
  for cls in types:
    for klass in cls.__mro__:
      for name, attr in vars(klass).items():
        if name != "__call__" and name.startswith("_"):
          continue
        while attr is not None:
          code = getattr(attr, "__code__", None)
          if (code is not None and code.co_argcount
              and code.co_varnames[0] == "self"):
            codes.add(code)
          attr = getattr(attr, "__wrapped__", None)
  return codes


def follow(hook: Hook, codes: set) -> Callable[[], None]:
  """Calls `hook` on this thread's calls of `codes` (every call before
  Python 3.12) and their returns; returns what stops it.

  A return by exception is reported as a return of None.
  """
  monitoring = getattr(sys, "monitoring", None)
  if monitoring is not None:
    tool = next((i for i in _FREE_TOOL_IDS if monitoring.get_tool(i) is None),
                None)
    if tool is not None:
      return _monitor(monitoring, tool, hook, codes)
  return _profile(hook)


def _monitor(monitoring, tool: int, hook: Hook, codes: set
             ) -> Callable[[], None]:
  events = monitoring.events
  thread = threading.get_ident()

  def caller():  # The frame of the monitored call (this callback's caller).
    return inspect.currentframe().f_back.f_back

  def on_start(code, offset):  # pylint: disable=unused-argument
    if threading.get_ident() == thread:
      hook(caller(), "call", None)

  def on_return(code, offset, value):  # pylint: disable=unused-argument
    if threading.get_ident() == thread:
      hook(caller(), "return", value)

  def on_unwind(code, offset, exception):  # pylint: disable=unused-argument
    if code in codes and threading.get_ident() == thread:
      hook(caller(), "return", None)

  monitoring.use_tool_id(tool, _TOOL_NAME)
  callbacks = {events.PY_START: on_start, events.PY_RETURN: on_return,
               events.PY_UNWIND: on_unwind}
  for event, callback in callbacks.items():
    monitoring.register_callback(tool, event, callback)
  for code in codes:
    monitoring.set_local_events(tool, code, events.PY_START | events.PY_RETURN)
  monitoring.set_events(tool, events.PY_UNWIND)  # Not a local event.

  def stop():
    monitoring.set_events(tool, 0)
    for code in codes:
      monitoring.set_local_events(tool, code, 0)
    for event in callbacks:
      monitoring.register_callback(tool, event, None)
    monitoring.free_tool_id(tool)
  return stop


def _profile(hook: Hook) -> Callable[[], None]:
  """`hook` as this thread's profile function, after any Python profile
  function already there. A C-level profiler there (cProfile before Python
  3.12) cannot be called from Python, so the trace slot is used instead,
  leaving the profiler running; with a trace function (a debugger,
  coverage) there too, no slot is free and this raises."""
  previous = sys.getprofile()
  if previous is None or callable(previous):
    chained = hook if previous is None else (
        lambda frame, event, arg: (hook(frame, event, arg),
                                   previous(frame, event, arg)))
    sys.setprofile(chained)
    return lambda: sys.setprofile(previous)
  if sys.gettrace() is not None:
    raise RuntimeError(
        "jmp_amp.flax.numerics: telemetry follows the model's calls through "
        "sys.setprofile or sys.settrace, but both are taken: by a C-level "
        f"profiler ({type(previous).__name__}; cProfile before Python 3.12) "
        "and by a trace function (a debugger or coverage). Stop one of them "
        "while the step is traced, or use Python 3.12+ (where cProfile "
        "takes neither).")

  def on_return(frame, event, arg):
    if event == "return":
      hook(frame, event, arg)
    return on_return

  def on_call(frame, event, arg):
    hook(frame, event, arg)
    frame.f_trace_lines = False  # Only the frame's "return" is wanted.
    return on_return

  sys.settrace(on_call)
  return lambda: sys.settrace(None)
