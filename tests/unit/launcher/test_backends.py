"""deepshard.launcher.backends: the registry behind ``--launcher``, and the pure parts of
the backends (the command lines that start agents)."""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys

import pytest

from deepshard import contract
from deepshard.errors import UsageError
from deepshard.launcher import backends
from deepshard.launcher.backends import (
    BACKENDS,
    DEFAULT_BACKEND,
    Backend,
    default_backend,
    get_backend,
    launcher_help,
)
from deepshard.launcher.backends.local import LocalBackend
from deepshard.launcher.backends.mpi import (
    ImpiBackend,
    MpichBackend,
    MvapichBackend,
    OpenmpiBackend,
)
from deepshard.launcher.backends.pdsh import PdshBackend, pdsh_command
from deepshard.launcher.backends.slurm import SlurmBackend, srun_command
from deepshard.launcher.backends.ssh import SSHBackend, agent_command
from deepshard.launcher.backends.tree import TreeBackend
from deepshard.launcher.cli import ds_run, remote_backend, shown_commands
from deepshard.launcher.options import LaunchOptions
from deepshard.launcher.plan import LaunchPlan, NodePlan, WorkerPlan
from deepshard.launcher.spawn import AGENT_ARGS

ALLOC = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-02]"}


# -- the registry ----------------------------------------------------------------------------

def test_every_registered_backend_resolves_to_its_class():
    expected = {"ssh": TreeBackend, "pdsh": PdshBackend, "slurm": SlurmBackend,
                "openmpi": OpenmpiBackend, "mpich": MpichBackend, "impi": ImpiBackend,
                "mvapich": MvapichBackend, "local": LocalBackend}
    assert set(BACKENDS) == set(expected)
    for name, cls in expected.items():
        assert get_backend(name) is cls
        assert issubclass(cls, Backend) and cls.name == name


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(KeyError, match="ssh, pdsh, slurm, openmpi, mpich, impi, mvapich, local"):
        get_backend("mpi")


def test_launcher_choice_is_the_registry():
    param = next(p for p in ds_run.params if p.name == "launcher")
    assert list(param.type.choices) == list(BACKENDS)
    assert param.help == launcher_help()
    for name, spec in BACKENDS.items():
        assert f"{name}: {spec.summary}" in launcher_help()


def test_remote_backends_import_lazily():
    """Importing the registry (as ds-run does for every job) imports no remote backend."""
    code = ("import sys; import deepshard.launcher.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('deepshard.launcher.backends.')"
            " or m == 'paramiko'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["['deepshard.launcher.backends.base',",
                           "'deepshard.launcher.backends.local']"]


def test_default_backend(monkeypatch):
    assert default_backend(None, ALLOC) == "slurm"
    assert default_backend("hosts", ALLOC) == DEFAULT_BACKEND == "ssh"
    assert default_backend(None, {}) == "ssh"
    monkeypatch.setattr(backends.os.path, "isfile", lambda path: True)  # a /job/hostfile
    assert default_backend(None, ALLOC) == "ssh"


def test_from_options_carries_the_flags():
    options = LaunchOptions(user_script="t.py", remote_python="/opt/py", launcher_args="-x",
                            ssh_port=2222, ssh_connect_timeout=3.0)
    slurm = get_backend("slurm").from_options(options)
    assert isinstance(slurm, SlurmBackend)
    assert (slurm.python, slurm.launcher_args) == ("/opt/py", "-x")
    pdsh = get_backend("pdsh").from_options(options)
    assert isinstance(pdsh, PdshBackend) and pdsh.launcher_args == "-x"
    tree = get_backend("ssh").from_options(dataclasses.replace(options, fanout=4))
    assert isinstance(tree, TreeBackend) and tree.fanout == 4
    ssh = tree.ssh
    assert isinstance(ssh, SSHBackend)
    assert (ssh.ssh_port, ssh.python, ssh.connect_timeout) == (2222, "/opt/py", 3.0)


def _plan(*nodes: NodePlan) -> LaunchPlan:
    return LaunchPlan("run", "10.0.0.1", 29500, 1, nodes)


def test_launcher_args_only_for_backends_that_take_them():
    options = LaunchOptions(user_script="t.py", launcher="ssh", launcher_args="-u 30")
    with pytest.raises(UsageError, match="only used by --launcher pdsh and slurm"):
        remote_backend(options, _plan(_node()))


def test_a_local_only_backend_refuses_remote_hosts():
    options = LaunchOptions(user_script="t.py", launcher="local")
    with pytest.raises(UsageError, match="'gpu-1' is not this machine, and --launcher local"):
        remote_backend(options, _plan(_node()))
    local = NodePlan("localhost", 0, True, "/w", (), ())
    assert remote_backend(options, _plan(local)) is None


def test_dry_run_shows_srun_lines_only():
    node = _node()
    slurm = LaunchOptions(user_script="t.py", launcher="slurm", remote_python="/py")
    assert shown_commands(slurm, _plan(node)) == {"gpu-1": srun_command(node, "/py", "")}
    pdsh = LaunchOptions(user_script="t.py", launcher="pdsh")
    assert shown_commands(pdsh, _plan(node)) == {}


# -- command lines ---------------------------------------------------------------------------
def _node(cwd: str = "/work/my dir") -> NodePlan:
    env = (("SECRET_TOKEN", "$(rm -rf ~)"), ("NCCL_DEBUG", "INFO"))
    worker = WorkerPlan(0, 0, ("python", "-u", "t.py"), (("RANK", "0"),))
    return NodePlan("gpu-1", 0, False, cwd, env, (worker,), lease_timeout=30.0)


def test_ssh_agent_command_carries_no_value_and_quotes_paths():
    command = agent_command(_node("/work/it's here"), "/opt/py env/bin/python")
    words = shlex.split(command)
    assert words[:3] == ["cd", "/work/it's here", "&&"]
    assert words[3:5] == ["exec", "/opt/py env/bin/python"]
    assert "rm -rf" not in command and "NCCL_DEBUG" not in command


def test_pdsh_command_round_trips_every_plan():
    nodes = (_node(), NodePlan("gpu-2", 1, False, "/work/my dir", (), ()))
    argv = pdsh_command(nodes, "/usr/bin/python3", "-u 30")
    assert argv[:5] == ["pdsh", "-S", "-R", "ssh", "-f"]
    assert argv[argv.index("-w") + 1] == "gpu-1,gpu-2"
    assert argv[6:8] == ["-u", "30"]
    remote = shlex.split(argv[-1])
    token = remote[remote.index(contract.PLANS_FLAG) + 1]
    assert remote[remote.index(contract.HOST_FLAG) + 1] == "%h"
    for node in nodes:
        assert NodePlan.from_json(contract.decode_node_plan(token, node.host)) == node
    assert "rm -rf" not in argv[-1]  # values are inside the base64 token, not shell words


def test_srun_command_runs_the_agent_on_its_node():
    argv = srun_command(_node(), "/usr/bin/python3", "--mem=0 --exclusive")
    assert argv[:4] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu-1"]
    assert argv[-4:] == ["--exclusive", "/usr/bin/python3", *AGENT_ARGS]
    assert "rm -rf" not in " ".join(argv)
