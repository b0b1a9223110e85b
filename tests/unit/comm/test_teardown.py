"""The worker's exit handler: which threads are runnable, and the bounded wait on them."""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import sys
import threading
import time

import pytest

from deepshard.comm import teardown

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _own_name() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


def _named_sleeper(name: str, started: threading.Event, stop: threading.Event) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: what /proc shows as comm
    started.set()
    stop.wait()


@contextlib.contextmanager
def _sleeping_thread(name: str):
    """A thread named ``name`` blocked on an event for the duration of the block."""
    started, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=_named_sleeper, args=(name, started, stop))
    t.start()
    try:
        started.wait(5)
        time.sleep(0.05)  # let it block on the event
        yield
    finally:
        stop.set()
        t.join()


def test_the_calling_thread_is_runnable_and_a_waiting_one_is_not():
    with _sleeping_thread("ds-idle (x)"):
        running = teardown.runnable_threads()
        assert _own_name() in running
        assert "ds-idle (x)" not in running  # a name with a space and parentheses


def test_settle_returns_at_once_without_such_threads_and_is_bounded_with_them():
    t0 = time.monotonic()
    teardown.settle("no-such-thread")
    assert time.monotonic() - t0 < 0.25
    t0 = time.monotonic()
    teardown.settle(_own_name(), limit_s=0.1)  # the caller itself never stops running
    assert 0.1 <= time.monotonic() - t0 < 2.0


def test_a_thread_that_never_runs_is_listed_but_not_runnable():
    with _sleeping_thread("ds-listed"):
        assert "ds-listed" in teardown.thread_names()
        assert "ds-listed" not in teardown.runnable_threads()
        t0 = time.monotonic()
        teardown.settle("ds-listed", limit_s=5.0)  # asleep throughout: a clean spell
        assert time.monotonic() - t0 < 2.0


def test_exit_settles_even_after_the_script_destroyed_its_groups(monkeypatch):
    """Most scripts call destroy_process_group() themselves; gloo's threads outlive it
    and may still want the GIL, so the exit handler settles them all the same (the abort
    at exit this prevents shows in about 1 of 20 two-rank jobs without it)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    settled = []
    monkeypatch.setattr(teardown, "settle", settled.append)
    teardown.at_exit()
    assert settled == [teardown.GLOO_WORKER]


def test_registering_twice_runs_the_handler_once():
    """init_distributed registers it, and initialize again: one exit handler."""
    script = ("from deepshard.comm import teardown\n"
              "teardown.settle = lambda name: print('settled', flush=True)\n"
              "teardown.register()\nteardown.register()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.split() == ["settled"]
