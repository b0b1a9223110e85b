"""What the elastic cluster tests share: ds-run in the background (:class:`Job`), its fast
elastic flags, and the comparison of the final parameters with the one-process reference
(:func:`tests.cluster.elastic_train.reference`)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from tests.cluster.elastic_train import reference
from tests.helpers import ROOT

__all__ = ["FAST", "TRAIN", "Job", "close_to", "no_job_process", "reference"]

TRAIN = str(ROOT / "tests" / "cluster" / "elastic_train.py")
FAST = ("--elastic_training", "--elastic_probe_interval", "0.5", "--monitor_timeout", "3",
        "--max_restarts", "2")


class Job:
    """ds-run in the background, its stderr and stdout collected line by line."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out),
                                      (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def wait_for(self, text: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.out + self.err):
            assert self.proc.poll() is None or any(text in x for x in self.out + self.err), \
                self.dump()
            assert time.monotonic() < deadline, f"no {text!r} in time: {self.dump()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def dump(self) -> str:
        return "".join(self.err[-40:]) + "".join(self.out[-20:])

    def steps(self) -> list[tuple[int, int]]:
        return [(int(p[2]), int(p[4])) for line in self.out
                if len(p := line.split()) == 5 and p[1] == "STEP"]

    def final(self) -> dict:
        line = next(x for x in self.out if " FINAL " in x)
        return json.loads(line.split(" FINAL ", 1)[1])


def close_to(got: dict, want: dict, tol: float = 1e-5) -> bool:
    flat = [(g, w) for k in want for g, w in zip(_flat(got[k]), _flat(want[k]), strict=True)]
    return all(abs(g - w) <= tol * max(1.0, abs(w)) for g, w in flat)


def _flat(value) -> list[float]:
    return [x for v in value for x in _flat(v)] if isinstance(value, list) else [value]


def no_job_process(marker: str) -> list[int]:
    """Processes on this machine (every namespace shares its /proc) whose command line
    names ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmd:
                found.append(int(entry.name))
    return found
