"""deepshard.hostlist.expand_hostlist: SLURM hostlist expressions."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepshard.errors import UsageError
from deepshard.hostlist import expand_hostlist


def test_ranges_lists_and_groups():
    assert expand_hostlist("node[01-04,07],gpu-a[1-2]") == [
        "node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]


def test_cartesian_product_left_slowest():
    assert expand_hostlist("rack[1-2]-n[01-02]") == [
        "rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]


def test_three_groups():
    assert expand_hostlist("a[1-2]b[3]c[5-6]") == ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6"]


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node1,node2,login.example.com", ["node1", "node2", "login.example.com"]),
        ("  node1  ", ["node1"]),
        ("n[3]", ["n3"]),
        ("n[007]", ["n007"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[0-0]", ["n0"]),
        ("[1-2]x", ["1x", "2x"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("n[1, 3]", ["n1", "n3"]),
        ("n[3,1]", ["n3", "n1"]),
        ("a,n[1-2],b", ["a", "n1", "n2", "b"]),
        ("n[1-2],", ["n1", "n2"]),
        ("", []),
    ],
)
def test_expansions(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text",
    ["n[1-2", "n1-2]", "n[]", "n[a]", "n[1-]", "n[-2]", "n[2-1]", "n[1,,2]", "n[1-2-3]",
     "n[[1]]", "n[1]]", "n]1[", "n[1-2]x]", "n[+1]", "n[1.5]", "n[²]"],
)
def test_malformed(text):
    with pytest.raises(UsageError) as info:
        expand_hostlist(text)
    assert info.value.where == "SLURM_JOB_NODELIST"
    assert repr(text) in info.value.message
    assert "HINT: " in str(info.value)


# --- property: compare with a reference expansion -------------------------------------------

_prefix = st.from_regex(r"[a-z][a-z0-9\-]{0,5}", fullmatch=True)
_suffix = st.from_regex(r"[a-z\-]{0,3}", fullmatch=True)


@st.composite
def _range(draw):
    width = draw(st.integers(1, 4))
    lo = draw(st.integers(0, 10**width - 1))
    hi = draw(st.one_of(st.none(), st.integers(lo, lo + 12)))
    return width, lo, hi


def _range_text(width: int, lo: int, hi: int | None) -> str:
    text = f"{lo:0{width}d}"
    return text if hi is None else f"{text}-{hi}"


def _reference_group(ranges) -> list[str]:
    out = []
    for w, lo, hi in ranges:
        for n in range(lo, (lo if hi is None else hi) + 1):
            out.append(str(n).zfill(w))
    return out


@st.composite
def _item(draw):
    prefix = draw(_prefix)
    groups = draw(st.lists(st.lists(_range(), min_size=1, max_size=3), max_size=2))
    suffixes = draw(st.lists(_suffix, min_size=len(groups), max_size=len(groups)))
    text = prefix
    pieces = [[prefix]]
    for ranges, suffix in zip(groups, suffixes, strict=True):
        text += "[" + ",".join(_range_text(*r) for r in ranges) + "]" + suffix
        pieces.append(_reference_group(ranges))
        pieces.append([suffix])
    return text, ["".join(p) for p in itertools.product(*pieces)]


@given(st.lists(_item(), min_size=1, max_size=4))
def test_matches_reference_expansion(items):
    text = ",".join(t for t, _ in items)
    expected = [name for _, names in items for name in names]
    assert expand_hostlist(text) == expected
