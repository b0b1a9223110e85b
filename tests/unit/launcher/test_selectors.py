"""--include/--exclude selectors, --num_nodes/--num_gpus, and rank placement."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepshard.errors import UsageError
from deepshard.launcher.placement import place, select
from deepshard.launcher.resources import Host, Resources
from deepshard.launcher.selectors import Selection, exclude, include, parse_selector


def resources(spec: dict[str, int] | dict[str, tuple[int, ...]]) -> Resources:
    hosts = tuple(
        Host(name, tuple(range(s)) if isinstance(s, int) else tuple(s), f"hf:{i + 1}")
        for i, (name, s) in enumerate(spec.items())
    )
    return Resources(hosts, "hf")


RES = resources({"worker-0": 4, "worker-1": 4, "worker-2": 2})


# --- parse_selector ------------------------------------------------------------------------


def test_parse_deepspeed_grammar():
    assert parse_selector("worker-0:0,2@worker-1", "--include") == (
        Selection("worker-0", (0, 2)),
        Selection("worker-1", None),
    )


def test_parse_sorts_slots_and_strips_spaces():
    assert parse_selector(" w1 : 3, 1 @ w0", "--exclude") == (
        Selection("w1", (1, 3)),
        Selection("w0", None),
    )


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty host"),
        ("@worker-0", "empty host"),
        ("worker-0@", "empty host"),
        ("worker-0@@worker-1", "empty host"),
        (":0", "empty host"),
        ("worker-0:", "''"),
        ("worker-0:0,,1", "''"),
        ("worker-0:0,", "''"),
        ("worker-0:a", "'a'"),
        ("worker-0:-1", "'-1'"),
        ("worker-0:1.0", "'1.0'"),
        ("worker-0:²", "'²'"),
        ("worker-0:0:1", "'0:1'"),
        ("worker-0@worker-0:1", "'worker-0' is named both alone (all its slots) and with "
                                "slots 1"),
        ("worker-0:2,1@worker-1@worker-0", "'worker-0' is named both alone"),
    ],
)
@pytest.mark.parametrize("flag", ["--include", "--exclude"])
def test_parse_errors_name_the_flag(text, fragment, flag):
    with pytest.raises(UsageError) as info:
        parse_selector(text, flag)
    assert info.value.where == flag
    assert str(info.value).startswith(f"{flag}: ")
    assert fragment in info.value.message
    assert "HINT: " in str(info.value)


def test_repeated_slots_and_hosts_are_unions():
    assert parse_selector("worker-0:1,1", "--include") == (Selection("worker-0", (1,)),)
    assert parse_selector("worker-0:0,1,01", "--include") == (Selection("worker-0", (0, 1)),)
    assert parse_selector("worker-0:3@worker-1:0@worker-0:1,3", "--exclude") == (
        Selection("worker-0", (1, 3)),
        Selection("worker-1", (0,)),
    )
    assert parse_selector("worker-0@worker-1@worker-0", "--include") == (
        Selection("worker-0", None),
        Selection("worker-1", None),
    )


# --- include / exclude ---------------------------------------------------------------------


def test_include_selected_slots_and_whole_hosts():
    out = include(RES, parse_selector("worker-0:0,2@worker-2", "--include"), "--include")
    assert out.as_dict() == {"worker-0": [0, 2], "worker-2": [0, 1]}
    assert out.origin == "hf"
    assert out.get("worker-0").where == "hf:1"


def test_include_keeps_hostfile_order():
    out = include(RES, parse_selector("worker-2@worker-0:3,1", "--include"), "--include")
    assert out.names() == ("worker-0", "worker-2")
    assert out.as_dict()["worker-0"] == [1, 3]


def test_host_without_slots_means_all_slots_even_sparse():
    res = resources({"a": (1, 3, 5), "b": 2})
    assert include(res, parse_selector("a", "--include"), "--include").as_dict() == {
        "a": [1, 3, 5]}
    assert exclude(res, parse_selector("a:3", "--exclude"), "--exclude").as_dict() == {
        "a": [1, 5], "b": [0, 1]}


def test_exclude_slots_and_hosts():
    out = exclude(RES, parse_selector("worker-0:1@worker-1", "--exclude"), "--exclude")
    assert out.as_dict() == {"worker-0": [0, 2, 3], "worker-2": [0, 1]}


def test_exclude_drops_host_left_without_slots():
    out = exclude(RES, parse_selector("worker-2:0,1", "--exclude"), "--exclude")
    assert out.names() == ("worker-0", "worker-1")


@pytest.mark.parametrize("selector", ["worker-0@worker-1@worker-2",
                                      "worker-0:0,1,2,3@worker-1@worker-2:1,0"])
def test_exclude_everything_is_an_error(selector):
    with pytest.raises(UsageError, match="no slot") as info:
        exclude(RES, parse_selector(selector, "--exclude"), "--exclude")
    assert info.value.where == "--exclude"


@pytest.mark.parametrize("flag", ["--include", "--exclude"])
@pytest.mark.parametrize(
    ("selector", "fragment"),
    [
        ("worker-9", "unknown host 'worker-9'"),
        ("worker-0@nope:0", "unknown host 'nope'"),
        ("worker-2:2", "no slot 2"),
        ("worker-0:1,7", "no slot 7"),
    ],
)
def test_unknown_hosts_and_slots_are_errors(flag, selector, fragment):
    func = include if flag == "--include" else exclude
    with pytest.raises(UsageError) as info:
        func(RES, parse_selector(selector, flag), flag)
    assert info.value.where == flag
    assert fragment in info.value.message
    assert "HINT: " in str(info.value)


def test_unknown_host_lists_known_hosts():
    with pytest.raises(UsageError) as info:
        include(RES, parse_selector("worker-9", "--include"), "--include")
    assert "worker-0, worker-1, worker-2" in info.value.message


# --- select --------------------------------------------------------------------------------


def test_select_without_arguments_is_identity():
    assert select(RES) == RES


def test_select_include_and_exclude():
    assert select(RES, include_text="worker-1:3").as_dict() == {"worker-1": [3]}
    assert select(RES, exclude_text="worker-0@worker-1").as_dict() == {"worker-2": [0, 1]}


def test_select_errors_carry_the_flag():
    with pytest.raises(UsageError) as info:
        select(RES, include_text="worker-0:9")
    assert info.value.where == "--include"
    with pytest.raises(UsageError) as info:
        select(RES, exclude_text="ghost")
    assert info.value.where == "--exclude"


def test_include_and_exclude_together():
    with pytest.raises(UsageError) as info:
        select(RES, include_text="worker-0", exclude_text="worker-1")
    assert "--include" in info.value.message and "--exclude" in info.value.message
    assert "HINT: " in str(info.value)


@pytest.mark.parametrize("which", ["include_text", "exclude_text"])
@pytest.mark.parametrize("count", [{"num_nodes": 1}, {"num_gpus": 1},
                                   {"num_nodes": 1, "num_gpus": 1}])
def test_selector_with_counts_is_an_error(which, count):
    flag = "--include" if which == "include_text" else "--exclude"
    with pytest.raises(UsageError) as info:
        select(RES, **{which: "worker-0"}, **count)
    assert flag in info.value.message
    assert "--num_nodes/--num_gpus" in info.value.message


def test_num_nodes_keeps_first_hosts():
    assert select(RES, num_nodes=2).names() == ("worker-0", "worker-1")
    assert select(RES, num_nodes=3) == RES


def test_num_nodes_more_than_hosts():
    with pytest.raises(UsageError) as info:
        select(RES, num_nodes=4)
    assert info.value.where == "--num_nodes"
    assert "4" in info.value.message and "3" in info.value.message
    assert "--num_nodes 3" in str(info.value)


def test_num_gpus_keeps_first_slots_of_each_host():
    assert select(RES, num_gpus=2).as_dict() == {
        "worker-0": [0, 1], "worker-1": [0, 1], "worker-2": [0, 1]}
    sparse = resources({"a": (2, 5, 7)})
    assert select(sparse, num_gpus=2).as_dict() == {"a": [2, 5]}


def test_num_gpus_more_than_a_hosts_slots():
    with pytest.raises(UsageError) as info:
        select(RES, num_gpus=3)
    assert info.value.where == "--num_gpus"
    assert "worker-2" in info.value.message and "hf:3" in info.value.message
    assert "--num_gpus 2" in str(info.value)


def test_num_nodes_applies_before_num_gpus():
    # the short host is dropped by --num_nodes, so --num_gpus 4 fits
    assert select(RES, num_nodes=2, num_gpus=4).names() == ("worker-0", "worker-1")


# --- place ---------------------------------------------------------------------------------


def test_place_host_major():
    placement = place(resources({"a": (1, 3), "b": 3}))
    assert placement.world_size == 5
    assert [(n.host, n.node_rank, n.slots, list(n.ranks)) for n in placement.nodes] == [
        ("a", 0, (1, 3), [0, 1]),
        ("b", 1, (0, 1, 2), [2, 3, 4]),
    ]


# --- properties ----------------------------------------------------------------------------


@st.composite
def resources_and_selector(draw):
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9\-]{0,6}", fullmatch=True),
                          min_size=1, max_size=5, unique=True))
    hosts = []
    for i, name in enumerate(names):
        slots = draw(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True))
        hosts.append(Host(name, tuple(sorted(slots)), f"hf:{i + 1}"))
    res = Resources(tuple(hosts), "hf")
    chosen = draw(st.lists(st.sampled_from(hosts), min_size=1, unique=True))
    parts = []
    for host in chosen:
        if draw(st.booleans()):
            parts.append(host.name)
        else:
            picked = draw(st.lists(st.sampled_from(host.slots), min_size=1, unique=True))
            parts.append(host.name + ":" + ",".join(map(str, picked)))
    return res, "@".join(parts)


def slot_set(res: Resources) -> set[tuple[str, int]]:
    return {(h.name, s) for h in res.hosts for s in h.slots}


def host_order_ok(sub: Resources, full: Resources) -> bool:
    order = list(full.names())
    positions = [order.index(n) for n in sub.names()]
    return positions == sorted(positions)


@given(resources_and_selector())
def test_include_exclude_partition_slots(case):
    res, selector = case
    inc = select(res, include_text=selector)
    assert host_order_ok(inc, res)
    assert all(h.slots and list(h.slots) == sorted(h.slots) for h in inc.hosts)
    try:
        exc = select(res, exclude_text=selector)
    except UsageError as err:
        assert err.where == "--exclude"
        assert slot_set(inc) == slot_set(res)
        return
    assert host_order_ok(exc, res)
    assert all(h.slots for h in exc.hosts)
    assert slot_set(inc) | slot_set(exc) == slot_set(res)
    assert not slot_set(inc) & slot_set(exc)


@given(resources_and_selector())
def test_place_ranks_host_major(case):
    res, selector = case
    selected = select(res, include_text=selector)
    placement = place(selected)
    world = sum(len(h.slots) for h in selected.hosts)
    assert placement.world_size == world
    ranks = [r for n in placement.nodes for r in n.ranks]
    assert ranks == list(range(world))
    assert [n.node_rank for n in placement.nodes] == list(range(len(selected.hosts)))
    for node, host in zip(placement.nodes, selected.hosts, strict=True):
        assert node.host == host.name
        assert node.slots == host.slots
        assert len(node.ranks) == len(node.slots)
        local = [r - node.first_rank for r in node.ranks]
        assert local == list(range(len(host.slots)))


@given(resources_and_selector(), st.randoms(use_true_random=False))
def test_repeating_parts_changes_nothing(case, rng):
    """A selector's slot lists split over repeated parts, in any order and with repeats,
    select what the merged selector does (DeepSpeed's union semantics)."""
    res, selector = case
    parts = []
    for part in selector.split("@"):
        host, sep, slots = part.partition(":")
        if not sep:
            parts += [host] * rng.randint(1, 2)
            continue
        items = slots.split(",")
        items += rng.sample(items, rng.randint(0, len(items)))  # some slots twice
        rng.shuffle(items)
        cut = rng.randint(1, len(items))
        parts += [f"{host}:{','.join(items[:cut])}"]
        if items[cut:]:
            parts += [f"{host}:{','.join(items[cut:])}"]
    rng.shuffle(parts)
    split = "@".join(parts)
    assert select(res, include_text=split) == select(res, include_text=selector)
