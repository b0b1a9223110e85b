"""What every benchmark here needs: the wall time of one command that must succeed."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def time_command(argv: list[str], *, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> float:
    """Seconds ``argv`` took; exits with its stderr's tail when it fails."""
    start = time.perf_counter()
    result = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, check=False)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({result.returncode}): {result.stderr[-800:]}")
    return elapsed
