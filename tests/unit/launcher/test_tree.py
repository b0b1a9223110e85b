"""The tree fan-out's planning, its channel framing and its flag (the tree itself runs in
tests/cluster/test_tree_launch.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepshard import contract
from deepshard.errors import UsageError
from deepshard.launcher.cli import remote_backend
from deepshard.launcher.options import LaunchOptions
from deepshard.launcher.plan import LaunchPlan, NodePlan
from deepshard.launcher.tree import TREE_ABOVE, Share, plan_tree, relay_count, tree_note


def test_flat_up_to_the_threshold_then_sqrt_relays():
    assert relay_count(TREE_ABOVE, None) == 0
    assert relay_count(TREE_ABOVE + 1, None) == 9
    assert relay_count(128, None) == 12
    assert relay_count(4096, None) == 64
    assert relay_count(128, 0) == 0
    assert relay_count(3, 1) == 1
    assert relay_count(3, 3) == 0  # every host a relay of nothing: flat


def test_shares_are_contiguous_and_the_larger_come_first():
    hosts = tuple(f"h{i}" for i in range(7))
    assert plan_tree(hosts, 3) == (Share("h0", ("h1", "h2")), Share("h3", ("h4",)),
                                   Share("h5", ("h6",)))
    with pytest.raises(ValueError):
        plan_tree(hosts, 8)


@given(n=st.integers(1, 3000), k=st.integers(1, 3000))
def test_every_host_is_in_exactly_one_share(n, k):
    hosts = tuple(f"h{i}" for i in range(n))
    k = min(k, n)
    shares = plan_tree(hosts, k)
    flat = [h for s in shares for h in (s.relay, *s.children)]
    assert tuple(flat) == hosts and len(shares) == k
    sizes = [1 + len(s.children) for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_relayed_lines_name_their_host_and_keep_their_text():
    line = contract.encode_relayed(contract.RELAY_LINE, "gpu-7", "o 3 hello world\n")
    assert contract.decode_relayed(line) == ("c", "gpu-7", "o 3 hello world\n")
    end = contract.encode_relayed(contract.RELAY_END, "gpu-7", '{"code": 0}')
    assert contract.decode_relayed(end) == ("x", "gpu-7", '{"code": 0}\n')
    # the relay's own lines, and whatever else a process prints, are not relayed
    for own in ('e {"kind":"alive"}\n', "o 0 \x1dc gpu-1 x\n", "\x1d", ""):
        assert contract.decode_relayed(own) is None


def test_fanout_is_refused_for_launchers_with_their_own():
    plan = LaunchPlan("run", "10.0.0.1", 29500, 1,
                      (NodePlan("gpu-1", 0, False, "/w", (), ()),))
    options = LaunchOptions(user_script="t.py", launcher="pdsh", fanout=4)
    with pytest.raises(UsageError, match="--fanout is for --launcher ssh, not pdsh"):
        remote_backend(options, plan)


def test_the_dry_run_names_the_relays():
    hosts = tuple(f"h{i}" for i in range(7))
    assert tree_note(plan_tree(hosts, 3)) == (
        "ssh through 3 relay(s), each starting 1-2 other host(s): h0, h3, h5 (--fanout; a "
        "host reached through ProxyJump makes it flat)")
