"""deepshard.errors: UsageError's one line, and the exit hooks a worker installs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepshard.errors import UsageError, render
from tests.helpers import ROOT

PRELUDE = "from deepshard.errors import UsageError, install_exit_hooks\ninstall_exit_hooks()\n"


def _run(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRELUDE + body], cwd=ROOT, text=True,
                          capture_output=True, timeout=60)


def test_render_is_one_line_with_where_and_hint():
    exc = UsageError("bad\nvalue", where="cfg.json:3", hint="fix it")
    assert render(exc) == "deepshard: error: cfg.json:3: bad value. HINT: fix it"


def test_an_uncaught_usage_error_is_one_line_exit_2_after_the_exit_handlers():
    result = _run("import atexit\natexit.register(lambda: print('handler ran'))\n"
                  "install_exit_hooks()\nraise UsageError('no', where='x', hint='y')\n")
    assert result.returncode == 2
    assert result.stderr == "deepshard: error: x: no. HINT: y\n"
    assert result.stdout == "handler ran\n"


def test_a_usage_error_in_a_thread_ends_the_process_with_exit_2():
    result = _run("import threading, time\n"
                  "def work():\n    raise UsageError('in a thread')\n"
                  "t = threading.Thread(target=work)\nt.start()\nt.join()\ntime.sleep(30)\n")
    assert result.returncode == 2
    assert result.stderr == "deepshard: error: in a thread\n"


@pytest.mark.parametrize("where", ["main", "thread"])
def test_other_exceptions_keep_their_traceback(where):
    body = "raise ValueError('boom')\n" if where == "main" else (
        "import threading\nt = threading.Thread(target=lambda: 1 / 0)\nt.start()\nt.join()\n")
    result = _run(body)
    assert result.returncode == (1 if where == "main" else 0)
    assert "Traceback" in result.stderr and "deepshard: error" not in result.stderr
