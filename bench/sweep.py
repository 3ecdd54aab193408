"""The ``aiogguf bench`` sweep as a script: mode × chunk size × readers × queue depth
against the machine's limits measured in the same run. Takes the same flags.

    python bench/sweep.py [--quick] [--size 1GiB] [--dir DIR] [--cold] [--json F] [--plot F]
"""

from __future__ import annotations

import sys

from aiogguf.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
