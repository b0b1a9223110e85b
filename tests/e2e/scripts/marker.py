"""Creates the file named by its first argument: proves a worker started."""

import sys
from pathlib import Path

Path(sys.argv[-1]).write_text("started")
