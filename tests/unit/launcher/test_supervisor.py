"""deepshard.launcher.supervisor: the restart policy, driven by scripted outcomes: no
processes (torch elastic's agent tests are the model)."""

from __future__ import annotations

import io

from deepshard.launcher.supervisor import Outcome, backoff, supervise


def run_policy(outcomes: list[Outcome], max_restarts: int) -> tuple[int, list[int], str]:
    calls: list[int] = []
    sleeps: list[float] = []
    err = io.StringIO()

    def attempt(restart: int) -> Outcome:
        calls.append(restart)
        return outcomes[len(calls) - 1]

    code = supervise(attempt, max_restarts, err=err, sleep=sleeps.append)
    assert sleeps == [backoff(k) for k in range(len(calls) - 1)]
    return code, calls, err.getvalue()


def test_success_needs_no_restart():
    assert run_policy([Outcome(0, False)], 3)[:2] == (0, [0])


def test_failures_are_restarted_until_one_succeeds():
    code, calls, err = run_policy([Outcome(137, True), Outcome(1, True), Outcome(0, False)], 3)
    assert (code, calls) == (0, [0, 1, 2])
    assert "restart 1 of 3" in err and "restart 2 of 3" in err


def test_restarts_run_out_and_the_last_code_is_returned():
    code, calls, err = run_policy([Outcome(137, True)] * 3, 2)
    assert (code, calls) == (137, [0, 1, 2])
    assert "giving up after 2 restart(s)" in err


def test_a_stop_the_user_asked_for_is_never_restarted():
    assert run_policy([Outcome(130, False)], 5)[:2] == (130, [0])


def test_no_restarts_by_default():
    code, calls, err = run_policy([Outcome(3, True)], 0)
    assert (code, calls, err) == (3, [0], "")


def test_backoff_grows_and_is_capped():
    assert [backoff(k) for k in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
