"""The machine-readable record a benchmark writes beside its printed table.

Every script in ``benchmarks/`` that measures something ends by writing one JSON file,
``benchmarks/results/<name>.json`` by default (``--results DIR`` elsewhere), so that the
README's plots (``benchmarks/plot.py``) are drawn from measured numbers and never from
numbers typed by hand. One file per script and run; a new run replaces the file.

Schema (``SCHEMA`` = 1)::

    {"schema": 1, "benchmark": "<name>", "date": "2026-12-02T03:10:00Z",
     "commit": "bf43a20" (git rev-parse --short HEAD),
     "uncommitted": ["deepshard/x.py", ...] (tracked files that differed from it),
     "machine": {"host", "cores", "cpu", "python", "loadavg_start": [1, 5, 15 min],
                 "loadavg_end": [...]},
     "settings": {... the script's arguments and fixed setup ...},
     "rows": [{...}, ...]          every number the table shows, per row, unformatted
     "table": ["| ... |", ...]}    the markdown table as printed

Torch-free and standard library only: ``launch.py`` and ``fanout.py`` must not pay for
torch, and ``plot.py`` reads these files with the same helpers.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
SCHEMA = 1
REQUIRED = ("schema", "benchmark", "date", "commit", "machine", "settings", "rows")


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (``/proc/loadavg``), empty where there is none."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return []


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=10, check=True).stdout


def commit() -> str:
    """``git rev-parse --short HEAD`` of this checkout; ``unknown`` outside a git checkout."""
    try:
        return _git("rev-parse", "--short", "HEAD").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def uncommitted() -> list[str]:
    """The tracked files that differ from HEAD (what ran was HEAD plus these changes)."""
    try:
        out = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return []
    return [line[3:] for line in out.splitlines() if line.strip()]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Run:
    """One benchmark run's record: started when constructed (date, commit, load average),
    completed with rows and a table, then written."""

    def __init__(self, benchmark: str, settings: dict) -> None:
        self.benchmark = benchmark
        self.settings = settings
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.commit = commit()
        self.uncommitted = uncommitted()
        self.loadavg_start = loadavg()

    def to_dict(self, rows: list[dict], table: list[str]) -> dict:
        """The record as written: this run's header plus ``rows`` and ``table``."""
        return {"schema": SCHEMA, "benchmark": self.benchmark,
                "date": self.started.strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": self.commit,
                "uncommitted": self.uncommitted,
                "machine": {"host": platform.node(), "cores": os.cpu_count(), "cpu": _cpu(),
                            "python": platform.python_version(),
                            "loadavg_start": self.loadavg_start, "loadavg_end": loadavg()},
                "settings": self.settings, "rows": rows, "table": table}

    def write(self, rows: list[dict], table: list[str], results: Path | None = None) -> Path:
        """Write ``<results>/<benchmark>.json`` (default ``benchmarks/results``); its path."""
        folder = Path(results) if results else RESULTS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.benchmark}.json"
        path.write_text(json.dumps(self.to_dict(rows, table), indent=1) + "\n")
        print(f"results written to {path}", flush=True)
        return path


class RecordError(Exception):
    """A results file that is missing, not JSON, or not in the schema; the message names it."""


def read(path: Path, benchmark: str | None = None) -> dict:
    """The record in ``path``, checked against the schema (and the benchmark name, if given).

    Raises ``RecordError`` with a one-line message naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RecordError(f"{path}: no such file (run the benchmark first)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"{path}: cannot read it: {exc}") from None
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: expected a JSON object, found {type(data).__name__}")
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise RecordError(f"{path}: missing key {missing[0]!r} (schema {SCHEMA})")
    if data["schema"] != SCHEMA:
        raise RecordError(f"{path}: schema {data['schema']!r}, this reader knows {SCHEMA}")
    if benchmark and data["benchmark"] != benchmark:
        raise RecordError(f"{path}: holds benchmark {data['benchmark']!r}, "
                          f"expected {benchmark!r}")
    if not isinstance(data["rows"], list) or not all(isinstance(r, dict) for r in data["rows"]):
        raise RecordError(f"{path}: 'rows' must be a list of objects")
    return data
