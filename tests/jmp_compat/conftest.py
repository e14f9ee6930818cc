"""jmp 0.0.4's own test suite, run against jmp_amp.

The two files beside this one are jmp's `policy_test.py` and
`loss_scale_test.py` from its 0.0.4 wheel (Apache-2.0), unchanged but for the
import line. The tests listed here pin jmp internals or behaviour that jmp_amp
deliberately changes; they are marked as strict expected failures, so a change
that makes one of them pass (or fail for another reason) is noticed.
"""

import pytest

_EXPECTED_FAILURES = {
    # Reads jmp's private `dtype_to_names` table (jmp._src.policy, which the
    # test imports as `jmp`); jmp_amp does not export private tables.
    "test_str": "reads jmp's private dtype_to_names table",
    # Builds StaticLossScale(0): a zero scale makes unscale divide by zero, so
    # jmp_amp rejects it with a ValueError.
    "test_static_empty_trees_StaticLossScale":
        "StaticLossScale(0) is rejected (zero scale)",
}


def pytest_collection_modifyitems(items):
  for item in items:
    base = item.name.split("[")[0]
    reason = _EXPECTED_FAILURES.get(base)
    if reason is None:
      # absl's parameterized names test_str0, test_str1, ...
      stripped = base.rstrip("0123456789")
      reason = (_EXPECTED_FAILURES.get(stripped) if stripped == "test_str"
                else None)
    if reason is not None:
      item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
