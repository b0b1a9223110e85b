"""Prints lines as fast as it can, forever (a stdout that does not drain must not stall
supervision)."""

import sys
from pathlib import Path

Path(sys.argv[2]).write_text("started")  # argv[1] is --local_rank=N
line = "x" * 100 + "\n"
while True:
    sys.stdout.write(line)
