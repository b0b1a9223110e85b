"""The slurm backend's agent handle with real processes: its pings reach the step's stdin,
and a stopped step whose node's slurmd no longer answers is ended and named lost (the
multi-node case runs under a real SLURM in tests/cluster/test_slurm_elastic.py)."""

from __future__ import annotations

import socket
import subprocess
import sys

from deepshard.launcher.backends.slurm import SlurmAgent, slurmd_answers
from deepshard.launcher.plan import NodePlan

# stands in for srun: echoes the plan and the pings, then lingers past stdin's EOF as a
# dead node's srun does
STEP = ("import sys, time\nfor line in sys.stdin:\n    print(repr(line), flush=True)\n"
        "time.sleep(60)\n")


def _agent(slurmd):
    proc = subprocess.Popen([sys.executable, "-c", STEP], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    return SlurmAgent(NodePlan("node-2", 1, False, "/", (), ()), proc, slurmd)


def _closed_port() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()


def test_slurmd_answers_only_where_something_listens():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert slurmd_answers(server.getsockname())
    assert not slurmd_answers(_closed_port(), timeout=1.0)


def test_pings_reach_the_step_and_a_step_on_a_dead_node_is_ended_when_stopped():
    dead = _closed_port()
    agent = _agent(dead)
    lines = agent.lines()
    assert '"node-2"' in next(lines)  # the plan
    agent.ping()
    assert next(lines).strip() == repr("\n")
    agent.stop()
    assert agent.wait(timeout=10) is not None, "the lingering step was not ended"
    assert agent.diagnostics() == [f"its slurmd (127.0.0.1:{dead[1]}) does not answer"]


def test_a_step_whose_slurmd_answers_is_left_to_end_by_itself():
    with socket.create_server(("127.0.0.1", 0)) as server:
        agent = _agent(server.getsockname())
        agent.stop()
        assert agent.wait(timeout=1.5) is None
        assert agent.diagnostics() == []
        agent.kill()
        assert agent.wait(timeout=10) is not None
