"""ds_report --slurm without a SLURM: the plan, the srun lines and the reading of a step's
result are pure; the runner is driven by a scripted srun (and scancel) on PATH."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time

import pytest

from deepshard.errors import UsageError
from deepshard.hostlist import expand_hostlist
from deepshard.launcher.report import main
from deepshard.launcher.report.preflight import PROBE, expected_versions
from deepshard.launcher.report.slurm import (
    SlurmPreflight,
    StepResult,
    cancel_command,
    plan_slurm_preflight,
    run_slurm_preflight,
    srun_command,
    step_check,
)

JOB = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-3]"}
EXPECTED = {"python": "3.11.7", "deepshard": "0.1.0", "torch": "2.13.0"}


def plan(environ=None, nodelist=None, **kw) -> SlurmPreflight:
    args = {"python": "/venv/bin/python", "cwd": "/work", "master_port": 29500,
            "timeout": 2.5, **kw}
    return plan_slurm_preflight(JOB if environ is None else environ, nodelist=nodelist,
                                expand=expand_hostlist, **args)


# -- the plan ---------------------------------------------------------------------------------
def test_inside_an_allocation_its_nodes_with_the_jobs_gpus_as_slots():
    p = plan({**JOB, "SLURM_JOB_GPUS": "0,1,2,3"})
    assert p.nodes == ("node1", "node2", "node3") and p.in_allocation
    assert p.slots == 4 and p.source == "SLURM job 42"
    assert p.deadline == 2.5  # no allocation to wait for


def test_inside_an_allocation_w_picks_some_of_its_nodes_once_each():
    assert plan(nodelist="node[3,1],node3").nodes == ("node3", "node1")


def test_w_outside_an_allocation_is_new_jobs():
    p = plan({}, nodelist="gpu[07-08],cpu1", launcher_args="--partition debug")
    assert p.nodes == ("gpu07", "gpu08", "cpu1") and not p.in_allocation
    assert p.slots == 1 and p.source == "-w gpu[07-08],cpu1"
    assert p.launcher_args == ("--partition", "debug")
    assert p.immediate == 3 and p.deadline == 5.5  # allocated within 3 s, then 2.5 s


@pytest.mark.parametrize(("environ", "nodelist", "where", "words"), [
    ({}, None, "--slurm", "not inside a SLURM allocation"),
    (JOB, "node[2-4]", "-w", "node4 not in SLURM job 42 (node[1-3])"),
    ({}, "node[1-", "-w", "malformed hostlist"),
    ({}, " , ", "-w", "names no node"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[2-1]"}, None, "SLURM_JOB_NODELIST",
     "malformed hostlist"),
])
def test_plan_errors_say_where_and_how_to_fix(environ, nodelist, where, words):
    with pytest.raises(UsageError) as info:
        plan(environ, nodelist)
    assert info.value.where == where and words in info.value.message and info.value.hint


# -- the srun lines ---------------------------------------------------------------------------
def test_a_step_of_the_allocation_per_node_the_first_checks_the_port():
    p = plan(launcher_args="--mpi=none")
    first, second = srun_command(p, 0), srun_command(p, 1)
    assert first[:6] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=node1", "--overlap",
                         "--quiet"]
    assert first[6:] == ["--mpi=none", "/venv/bin/python", "-c", PROBE, "/work", "29500"]
    assert second[3] == "--nodelist=node2" and second[-1] == "0"
    assert not any(a.startswith(("--immediate", "--job-name")) for a in first)
    assert cancel_command(p, 0) is None  # a step ends with its job


def test_outside_an_allocation_a_bounded_job_per_node_cancelled_by_name():
    p = plan({}, "gpu7", job_name="ds_report-ab12cd")
    assert srun_command(p, 0)[4:7] == ["--immediate=3", "--job-name=ds_report-ab12cd-gpu7",
                                       "--quiet"]
    assert cancel_command(p, 0) == ["scancel", "--name=ds_report-ab12cd-gpu7"]


# -- one node's row from its srun's result ----------------------------------------------------
def facts(**kw) -> str:
    return json.dumps({**EXPECTED, "cwd": True, "gpus": 0, "time": 100.5,
                       "port_free": True, **kw})


def check(stdout="", stderr="", code: int | None = 0, index=0, start=100.0, end=101.0):
    return step_check(plan(), index, StepResult(stdout, stderr, code, start, end), EXPECTED)


def test_a_probe_that_answers_is_judged_like_an_ssh_host():
    row = check("slurmstepd noise\n" + facts() + "\n")
    assert row.ok and row.host == "node1" and row.facts["skew"] == 0.0
    assert row.facts["port_free"] is True


def test_skew_is_only_what_lies_outside_the_srun_window():
    row = check(facts(time=97.0), index=1)
    assert not row.ok and row.problems == ["clock -3.0 s off"]
    assert check(facts(time=101.2)).facts["skew"] == pytest.approx(0.2)


def test_versions_and_port_are_judged():
    row = check(facts(torch="2.12.0", port_free=False))
    assert row.problems == ["torch 2.12.0 (here 2.13.0)", "master port 29500 in use"]


def test_a_node_that_does_not_answer_in_time():
    row = check(code=None)
    assert not row.reachable and not row.ok
    assert row.problems == ["no answer within 2.5 s (srun killed)"]
    assert "scontrol show node node1" in row.fixes[0]


@pytest.mark.parametrize(("stderr", "problem", "fix"), [
    ("srun: error: Task launch for StepId=9.1 failed on node node1: Communication connection "
     "failure\nsrun: error: Application launch failed: Communication connection failure\n",
     "srun: Task launch for StepId=9.1 failed on node node1: Communication connection failure",
     "its slurmd does not answer"),
    ("srun: error: Unable to allocate resources: Requested nodes are busy\n",
     "srun: Unable to allocate resources: Requested nodes are busy", "sinfo -n node1"),
    ("srun: error: Unable to allocate resources: Invalid node name specified\n",
     "srun: Unable to allocate resources: Invalid node name specified", "sinfo -N"),
    ("srun: fatal: Could not establish a configuration source\n",
     "srun: fatal: Could not establish a configuration source", "scontrol show node"),
])
def test_srun_that_could_not_start_the_probe_gives_its_reason(stderr, problem, fix):
    row = check(stderr=stderr, code=1)
    assert not row.reachable and row.problems == [problem] and fix in row.fixes[0]


@pytest.mark.parametrize(("stderr", "problem"), [
    ("srun: error: node1: task 0: Exited with exit code 2\nslurmstepd-node1: error: execve(): "
     "/venv/bin/python: No such file or directory\n",
     "probe failed: execve(): /venv/bin/python: No such file or directory"),
    ("Traceback (most recent call last):\nImportError: bad\nsrun: error: node1: task 0: "
     "Exited with exit code 1\n", "probe failed: ImportError: bad"),
    ("srun: error: node1: task 0: Killed\n", "probe failed: node1: task 0: Killed"),
])
def test_a_probe_that_started_and_failed_is_reachable(stderr, problem):
    row = check(stderr=stderr, code=1)
    assert row.reachable and not row.ok and row.problems == [problem]
    assert "/venv/bin/python" in row.fixes[0]


def test_a_probe_that_printed_nothing_failed():
    row = check(stdout="not json\n", code=0)
    assert row.reachable and row.problems == ["probe failed: srun exit 0"]


# -- the runner, with a scripted srun ---------------------------------------------------------
FAKE_SRUN = """#!/bin/sh
for a; do case "$a" in --nodelist=*) node="${a#--nodelist=}";; esac; done
case "$node" in
  good*) while [ "${1#-}" != "$1" ]; do shift; done; exec "$@";;
  hang) trap '' TERM; exec sleep 30;;
  *) echo "srun: error: Task launch for StepId=1.0 failed on node $node: Communication \
connection failure" >&2; exit 1;;
esac
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """srun and scancel on PATH: srun runs the probe here for nodes good*, hangs ignoring
    SIGTERM (as real srun does while it launches) for node hang, else fails to launch;
    scancel writes its arguments to a file."""
    for name, text in (("srun", FAKE_SRUN),
                       ("scancel", f'#!/bin/sh\necho "$@" >> {tmp_path}/cancelled\n')):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_every_node_its_row_in_order_and_a_hung_srun_killed_and_cancelled(fake_slurm):
    p = plan_slurm_preflight({}, nodelist="good1,hang,gone,good2", expand=expand_hostlist,
                             python=sys.executable, cwd=str(fake_slurm), master_port=0,
                             timeout=0.5, job_name="ds_report-t")
    start = time.monotonic()
    rows = run_slurm_preflight(p)
    took = time.monotonic() - start
    assert [r.host for r in rows] == ["good1", "hang", "gone", "good2"]
    assert [r.ok for r in rows] == [True, False, False, True], rows
    assert rows[0].facts["python"] == expected_versions()["python"]
    assert rows[1].problems == ["no answer within 1.5 s (srun killed)"]
    assert "Communication connection failure" in rows[2].problems[0]
    assert (fake_slurm / "cancelled").read_text() == "--name=ds_report-t-hang\n"
    assert took < 4, f"the nodes were not probed in parallel: {took:.1f} s"


# -- the command line -------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "words"), [
    (["--slurm", "-H", "hostfile"], "--slurm: -H is for the ssh preflight"),
    (["-w", "n1", "--ssh_port", "2222"], "--slurm: --ssh_port is for the ssh preflight"),
    (["--slurm"], "--slurm: not inside a SLURM allocation"),
    (["-w", "n[1-"], "-w: malformed hostlist 'n[1-'"),
    (["--launcher_args", "-p x"], "--launcher_args: only srun takes extra arguments"),
])
def test_mistakes_are_one_line_with_a_hint_and_exit_2(fake_slurm, capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(f"ds_report: error: {words}") and "HINT: " in err
    assert err.count("\n") == 1


def test_no_srun_on_path_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as info:
        main(["-w", "n1"])
    assert info.value.code == 2
    assert "srun is not on PATH. HINT:" in capsys.readouterr().err


def test_the_json_has_one_row_per_node_and_the_exit_code_follows_them(fake_slurm, capsys,
                                                                        monkeypatch):
    monkeypatch.chdir(fake_slurm)
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["--json", "-w", "good[1-2],gone", "--master_port", str(port)])
    data = json.loads(capsys.readouterr().out)
    assert [(c["host"], c["ok"]) for c in data["preflight"]] == \
        [("good1", False), ("good2", True), ("gone", False)]
    assert data["preflight"][0]["problems"] == [f"master port {port} in use"]
    assert info.value.code == 1
    assert data["torch"] is None  # a preflight imports no torch here
