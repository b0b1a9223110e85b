"""DeepSpeed 0.19.8's own selector tests (tests/unit/launcher/test_run.py), on deepshard.

Every ``parse_resource_filter`` / ``parse_inclusion_exclusion`` case of that file, in its
order, with DeepSpeed's expected result. Where DeepSpeed raises ``ValueError`` deepshard
raises a one-line :class:`UsageError` naming the flag. The one deliberate difference: an
exclusion that leaves no slot is an error here (DeepSpeed returns ``{}`` and then fails
later, or launches nothing).
"""

from __future__ import annotations

import pytest

from deepshard.errors import UsageError
from deepshard.launcher.placement import select
from deepshard.launcher.resources import Host, Resources


def parse_resource_filter(host_info: dict[str, list[int]], include_str: str = "",
                          exclude_str: str = "") -> dict[str, list[int]]:
    """DeepSpeed's ``parse_resource_filter(host_info, include_str, exclude_str)`` ("" is
    "not given", as there), answered by deepshard's :func:`select`."""
    res = Resources(tuple(Host(name, tuple(slots), f"hf:{i + 1}")
                          for i, (name, slots) in enumerate(host_info.items())), "hf")
    return select(res, include_text=include_str or None,
                  exclude_text=exclude_str or None).as_dict()


def parse_inclusion_exclusion(pool: dict[str, int], inclusion: str,
                              exclusion: str) -> dict[str, list[int]]:
    """DeepSpeed's ``parse_inclusion_exclusion``: the pool holds slot counts."""
    return parse_resource_filter({h: list(range(n)) for h, n in pool.items()},
                                 inclusion, exclusion)


def raises_usage(flag: str | None, func, *args, **kwargs) -> UsageError:
    with pytest.raises(UsageError) as info:
        func(*args, **kwargs)
    err = info.value
    line = str(err)
    assert "\n" not in line and "HINT: " in line
    if flag is not None:
        assert err.where == flag and line.startswith(f"{flag}: ")
    return err


def test_parser_mutual_exclusive():
    err = raises_usage(None, parse_resource_filter, {}, include_str="A", exclude_str="B")
    assert "--include and --exclude" in err.message


def test_parser_local():
    hosts = {"worker-0": [0, 1, 2, 3]}
    assert parse_resource_filter(hosts) == hosts
    # exclude slots
    assert parse_resource_filter(hosts, exclude_str="worker-0:1") == {"worker-0": [0, 2, 3]}
    assert parse_resource_filter(hosts, exclude_str="worker-0:1,2") == {"worker-0": [0, 3]}
    # only use one slot
    assert parse_resource_filter(hosts, include_str="worker-0:1") == {"worker-0": [1]}
    # including slots multiple times shouldn't break things
    assert parse_resource_filter(hosts, include_str="worker-0:1,1") == {"worker-0": [1]}
    assert parse_resource_filter(hosts, include_str="worker-0:1@worker-0:0,1") == {
        "worker-0": [0, 1]}
    # including just 'worker-0' without : should still use all GPUs
    assert parse_resource_filter(hosts, include_str="worker-0") == hosts


@pytest.mark.parametrize("exclude_str", ["worker-0", "worker-0:0,1,2,3"])
def test_parser_local_exclude_everything(exclude_str):
    """DeepSpeed returns {} ("should eliminate everything"); deepshard stops there."""
    err = raises_usage("--exclude", parse_resource_filter, {"worker-0": [0, 1, 2, 3]},
                       exclude_str=exclude_str)
    assert "leaves no slot" in err.message


def test_parser_multinode():
    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert parse_resource_filter(hosts) == hosts
    # include a node
    assert parse_resource_filter(hosts, include_str="worker-1:0,3") == {"worker-1": [0, 3]}
    # exclude a node
    assert parse_resource_filter(hosts, exclude_str="worker-1") == {"worker-0": [0, 1, 2, 3]}
    # exclude part of each node
    assert parse_resource_filter(hosts, exclude_str="worker-0:0,1@worker-1:3") == {
        "worker-0": [2, 3], "worker-1": [0, 1, 2]}


def test_parse_inclusion_exclusion():
    pool = {"worker-0": 4, "worker-1": 4}
    assert parse_inclusion_exclusion(pool, "", "") == {
        "worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    # a bare hostname means every slot on that node
    assert parse_inclusion_exclusion(pool, "worker-0", "") == {"worker-0": [0, 1, 2, 3]}
    # the example from parse_resource_filter's own docstring
    assert parse_inclusion_exclusion(pool, "worker-0@worker-1:0,2", "") == {
        "worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}
    assert parse_inclusion_exclusion(pool, "worker-1:0,2", "") == {"worker-1": [0, 2]}
    assert parse_inclusion_exclusion(pool, "", "worker-0:1") == {
        "worker-0": [0, 2, 3], "worker-1": [0, 1, 2, 3]}


@pytest.mark.parametrize("spec", ["worker-0:4", "worker-0:99", "worker-0:0,4"])
def test_parse_inclusion_exclusion_errors(spec):
    """An out-of-range slot is rejected for --include, not just --exclude."""
    pool = {"worker-0": 4}
    slot = spec.rsplit(",", 1)[-1].rsplit(":", 1)[-1]
    err = raises_usage("--include", parse_inclusion_exclusion, pool, spec, "")
    assert f"no slot {slot}" in err.message
    err = raises_usage("--exclude", parse_inclusion_exclusion, pool, "", spec)
    assert f"no slot {slot}" in err.message


def test_parse_inclusion_exclusion_unknown_host():
    err = raises_usage("--include", parse_inclusion_exclusion, {"worker-0": 4}, "jeff", "")
    assert "unknown host 'jeff'" in err.message


@pytest.mark.parametrize(
    ("flag", "spec", "fragment"),
    [
        # host does not exist
        ("--include", "jeff", "unknown host 'jeff'"),
        ("--exclude", "jeff", "unknown host 'jeff'"),
        # slot does not exist
        ("--include", "worker-1:4", "no slot 4"),
        ("--exclude", "worker-1:4", "no slot 4"),
        # formatting: '5' is read as a host name
        ("--exclude", "worker-1@worker-0:1@5", "unknown host '5'"),
    ],
)
def test_parser_errors(flag, spec, fragment):
    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    kwargs = {"include_str" if flag == "--include" else "exclude_str": spec}
    err = raises_usage(flag, parse_resource_filter, hosts, **kwargs)
    assert fragment in err.message


@pytest.mark.parametrize("flag", ["--include", "--exclude"])
@pytest.mark.parametrize("counts", [{"num_nodes": 1}, {"num_nodes": 1, "num_gpus": 1},
                                    {"num_gpus": 1}])
def test_num_plus_parser(flag, counts):
    """``--num_nodes``/``--num_gpus`` with ``-i``/``-e`` is refused (DeepSpeed: ValueError)."""
    res = Resources((Host("localhost", (0, 1)),), "this machine")
    text = {"include_text" if flag == "--include" else "exclude_text": "localhost"}
    err = raises_usage(None, select, res, **text, **counts)
    assert f"{flag} cannot be combined with --num_nodes/--num_gpus" in err.message
