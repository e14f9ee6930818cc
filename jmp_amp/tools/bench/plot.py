"""`jmp-amp bench --plot`: the runs' step times and memory as bar charts.

matplotlib is imported only here, when a plot is asked for (the ``bench``
extra). `suffix_error` lets the CLI refuse a path matplotlib cannot write
before anything runs.
"""

from __future__ import annotations

import os
from typing import Any, Optional


def supported_suffixes() -> list[str]:
  """The file suffixes matplotlib can write (".png" first), as ".png"."""
  # pylint: disable-next=g-import-not-at-top
  from matplotlib.backend_bases import FigureCanvasBase
  names = sorted(FigureCanvasBase.get_supported_filetypes(),
                 key=lambda name: (name != "png", name))
  return [f".{name}" for name in names]


def suffix_error(path: str) -> Optional[str]:
  """Why matplotlib could not write a plot to `path`, or None if it can."""
  suffix = os.path.splitext(path)[1].lower()
  accepted = supported_suffixes()
  if suffix in accepted:
    return None
  problem = (f"matplotlib cannot write {suffix!r} files" if suffix
             else "the path has no suffix")
  return (f"{problem}; give a path ending in one of {', '.join(accepted)}")


def plot(runs: list[dict[str, Any]], path: str, title: str) -> None:
  """Bar charts of each ok run's step time (with its repeats' range) and
  peak memory, written to `path` in the format its suffix names."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ok = [r for r in runs if r.get("status") == "ok"]
  names = [r["mode"] for r in ok]
  fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(ok)), 4))
  colors = ["tab:orange" if r["framework"] == "torch" else "tab:blue"
            for r in ok]
  ms = [r["median_step_s"] * 1e3 for r in ok]
  err = [[(r["median_step_s"] - min(r["repeat_median_step_s"])) * 1e3
          for r in ok],
         [(max(r["repeat_median_step_s"]) - r["median_step_s"]) * 1e3
          for r in ok]]
  axes[0].bar(names, ms, color=colors, yerr=err, capsize=3)
  axes[0].set_ylabel("median step time (ms), range of repeats")
  mem = [(r.get("peak_memory_bytes") or 0) / 2**20 for r in ok]
  axes[1].bar(names, mem, color=colors)
  axes[1].set_ylabel("peak memory (MiB)")
  for ax in axes:  # long mode names: anchored at their bar's right end
    plt.setp(ax.get_xticklabels(), rotation=40, ha="right")
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
