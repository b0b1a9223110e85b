"""deepshard.launcher.ssh_config: resolving hosts through ~/.ssh/config."""

from __future__ import annotations

import pytest

from deepshard.errors import UsageError
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

