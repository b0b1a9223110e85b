"""deepshard.launcher.coordinator: how a failure becomes an exit code and a message."""

from __future__ import annotations

import signal

import pytest

from deepshard.launcher.coordinator import Failure, describe_returncode


def failure(returncode: int | None) -> Failure:
    return Failure(host="node-a", rank=None if returncode is None else 2,
                   returncode=returncode, reason="x")


@pytest.mark.parametrize(
    ("returncode", "exit_code"),
    [
        (3, 3),
        (1, 1),
        (255, 255),
        (-9, 128 + 9),
        (-15, 128 + 15),
        (-int(signal.SIGSEGV), 128 + int(signal.SIGSEGV)),
        (0, 1),
        (None, 1),
    ],
)
def test_exit_code(returncode, exit_code):
    assert failure(returncode).exit_code == exit_code


def test_exit_code_never_zero_for_a_failure():
    for rc in [None, *range(-64, 256)]:
        assert failure(rc).exit_code != 0


@pytest.mark.parametrize(("returncode", "text"), [(3, "exit code 3"), (0, "exit code 0"),
                                                  (1, "exit code 1")])
def test_describe_exit(returncode, text):
    assert describe_returncode(returncode) == text


@pytest.mark.parametrize(
    ("returncode", "name", "number"),
    [(-9, "SIGKILL", 9), (-15, "SIGTERM", 15), (-11, "SIGSEGV", 11), (-6, "SIGABRT", 6)],
)
def test_describe_signal(returncode, name, number):
    text = describe_returncode(returncode)
    assert name in text
    assert f"signal {number}" in text
    assert "exit code" not in text


def test_describe_sigkill_exactly():
    assert describe_returncode(-9) == "killed by SIGKILL (signal 9)"


def test_describe_unknown_signal_number():
    text = describe_returncode(-200)
    assert "200" in text
    assert text.startswith("killed by")
