import sys

from aiogguf.cli import console_main

sys.exit(console_main())
