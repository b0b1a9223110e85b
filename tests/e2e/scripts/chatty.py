"""Prints many lines, then rank 0 writes 'done' into the file named by its argument."""

import os
import sys
from pathlib import Path

for i in range(2000):
    print(f"line {i}", flush=True)
if os.environ["RANK"] == "0":
    Path(sys.argv[2]).write_text("done")
