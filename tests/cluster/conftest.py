"""The cluster fixture: real sshd hosts in network namespaces (see simcluster.py)."""

from __future__ import annotations

import os

import pytest

from tests.cluster.simcluster import SimCluster, missing_tools
from tests.helpers import require


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three hosts, dsh1..dsh3, each with its own sshd, address and hostname."""
    require(missing_tools(), "the cluster tests", "openssh-server and iproute2")
    sim = SimCluster(3, tmp_path_factory.mktemp("cluster"))
    try:
        yield sim.start()
    finally:
        sim.stop()


@pytest.fixture
def cluster_env(cluster):
    """The environment for ds-run: the cluster's HOME (ssh config, key, known_hosts) and no
    ssh agent, so only what the test configures is used."""
    env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
    env["HOME"] = str(cluster.home)
    return env


@pytest.fixture(autouse=True)
def no_strays_after(request):
    """No process may outlive a job on any host."""
    yield
    if "cluster" in request.fixturenames:
        sim = request.getfixturevalue("cluster")
        stray = sim.wait_no_strays()
        assert not stray, f"processes left on hosts: {stray}"
