"""``python -m jmp_amp.tools.bench``: the same as ``jmp-amp bench``."""

import sys

from jmp_amp.tools.bench import cli

if __name__ == "__main__":
  sys.exit(cli.main())
