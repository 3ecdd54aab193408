import sys

from aiogguf.cli import main

sys.exit(main())
