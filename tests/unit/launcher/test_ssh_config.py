"""The pure parts of the remote backends: ssh config resolution, remote command lines."""

from __future__ import annotations

import shlex

import pytest

from deepshard import contract
from deepshard.errors import UsageError
from deepshard.launcher.backends.pdsh import pdsh_command
from deepshard.launcher.backends.ssh import agent_command
from deepshard.launcher.plan import NodePlan, WorkerPlan
from deepshard.launcher.ssh_config import parse_jump, resolve_target

CONFIG = """
Host gpu-*
    User trainer
    Port 2222
    IdentityFile ~/.ssh/cluster_key
Host gpu-1
    HostName 10.0.0.1
    StrictHostKeyChecking accept-new
    UserKnownHostsFile /tmp/kh1 /tmp/kh2
    ProxyJump bastion,admin@jump2:2200
Host lax
    StrictHostKeyChecking no
Host odd
    StrictHostKeyChecking maybe
"""


def test_resolve_target_follows_the_config():
    target = resolve_target("gpu-1", CONFIG, default_user="me")
    assert target.hostname == "10.0.0.1"
    assert target.port == 2222
    assert target.user == "trainer"
    assert target.identity_files[0].endswith("/.ssh/cluster_key")
    assert target.known_hosts_files == ("/tmp/kh1", "/tmp/kh2")
    assert target.strict_host_key_checking == "accept-new"
    assert target.proxy_jump == ("bastion", "admin@jump2:2200")


def test_resolve_target_defaults_and_overrides():
    plain = resolve_target("node7", CONFIG, default_user="me")
    assert (plain.hostname, plain.port, plain.user) == ("node7", 22, "me")
    assert plain.strict_host_key_checking == "yes"  # OpenSSH's default: ask -> refuse
    assert plain.known_hosts_files[0].endswith("/.ssh/known_hosts")
    assert resolve_target("gpu-2", CONFIG, port_override=2022).port == 2022
    assert resolve_target("lax", CONFIG).strict_host_key_checking == "no"


def test_unsupported_policy_is_an_error():
    with pytest.raises(UsageError, match="StrictHostKeyChecking 'maybe' for odd"):
        resolve_target("odd", CONFIG)


def test_parse_jump():
    assert parse_jump("bastion") == (None, "bastion", None)
    assert parse_jump("admin@jump2:2200") == ("admin", "jump2", 2200)


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
