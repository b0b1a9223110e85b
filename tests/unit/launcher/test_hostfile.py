"""deepshard.launcher.hostfile: DeepSpeed's ``hostname slots=N`` format."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepshard.errors import UsageError
from deepshard.launcher.hostfile import parse_hostfile, read_hostfile


def hosts_of(text: str, path: str = "hf") -> list[tuple[str, tuple[int, ...]]]:
    return [(h.name, h.slots) for h in parse_hostfile(text, path).hosts]


# --- valid files ---------------------------------------------------------------------------


def test_simple_file_keeps_order_and_slot_ids():
    res = parse_hostfile("worker-1 slots=4\nworker-0 slots=2\n", "hf")
    assert res.names() == ("worker-1", "worker-0")
    assert res.as_dict() == {"worker-1": [0, 1, 2, 3], "worker-0": [0, 1]}
    assert res.origin == "hf"


def test_where_names_file_and_line_of_each_host():
    res = parse_hostfile("# header\n\nworker-0 slots=1\nworker-1 slots=1\n", "/etc/hf")
    assert [h.where for h in res.hosts] == ["/etc/hf:3", "/etc/hf:4"]


def test_comments_anywhere_blank_lines_and_tabs():
    text = (
        "# a full-line comment\n"
        "\n"
        "   \t  \n"
        "  worker-0\tslots=2   # trailing comment\n"
        "\tworker-1 \t slots=3#glued comment\n"
        "worker-2 slots=1 #\n"
        "    # indented comment slots=9\n"
    )
    assert hosts_of(text) == [
        ("worker-0", (0, 1)),
        ("worker-1", (0, 1, 2)),
        ("worker-2", (0,)),
    ]


def test_crlf_line_endings():
    assert hosts_of("a slots=1\r\nb slots=2\r\n") == [("a", (0,)), ("b", (0, 1))]


def test_ip_addresses_and_dotted_names():
    text = "10.0.0.1 slots=8\n192.168.1.20 slots=1\nnode1.cluster.local slots=2\nfe80::1 slots=1\n"
    assert [name for name, _ in hosts_of(text)] == [
        "10.0.0.1", "192.168.1.20", "node1.cluster.local", "fe80::1"]


def test_loopback_ipv6_address_is_a_valid_host():
    # BUG: the hostname pattern requires the first character to be [A-Za-z0-9_], so "::1"
    # (an address LOCAL_NAMES lists as this machine, and that DeepSpeed's parser accepts)
    # is rejected as "not a hostname".
    assert hosts_of("::1 slots=2\n") == [("::1", (0, 1))]


def test_leading_zeros_in_slots():
    assert hosts_of("a slots=03\n") == [("a", (0, 1, 2))]


def test_no_trailing_newline():
    assert hosts_of("a slots=1") == [("a", (0,))]


# --- errors --------------------------------------------------------------------------------


def error_of(text: str, path: str = "/tmp/hostfile") -> str:
    with pytest.raises(UsageError) as info:
        parse_hostfile(text, path)
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("a slots=1\nb slots=1\n\n# c\na slots=2\n", 5, "line 1"),  # duplicate: both lines
        ("a slots=1\nb\n", 2, "slots=N"),  # missing slots
        ("a slots=0\n", 1, "'0'"),
        ("a slots=-1\n", 1, "'-1'"),
        ("a slots=x\n", 1, "'x'"),
        ("a slots=²\n", 1, "'²'"),
        ("a slots=\n", 1, "positive integer"),
        ("a slots=1.5\n", 1, "'1.5'"),
        ("a slots=2 extra\n", 1, "'extra'"),
        ("a slots=2 slots=2\n", 1, "unexpected"),
        ("a extra slots=2\n", 1, "'extra'"),
        ("a slots = 2\n", 1, "unexpected"),
        ("# ok\n-bad slots=1\n", 2, "'-bad'"),
        ("ok slots=1\nb@d slots=1\n", 2, "'b@d'"),
        ("host/x slots=1\n", 1, "not a hostname"),
    ],
)
def test_errors_name_file_line_and_hint(text, line, fragment):
    message = error_of(text)
    assert f"/tmp/hostfile:{line}: " in message
    assert fragment in message
    assert "HINT: " in message
    assert "\n" not in message


def test_duplicate_host_names_both_lines():
    message = error_of("x slots=1\ny slots=1\nx slots=1\n")
    assert message.startswith("/tmp/hostfile:3: ")
    assert "'x'" in message and "line 1" in message


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n  # and another\n", "   \t\n"])
def test_file_without_hosts_is_an_error(text):
    with pytest.raises(UsageError) as info:
        parse_hostfile(text, "/tmp/hostfile")
    assert info.value.where == "/tmp/hostfile"
    assert str(info.value).startswith("/tmp/hostfile: ")
    assert "HINT: " in str(info.value)


def test_read_hostfile_reads_the_file(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("w0 slots=2\nw1 slots=1\n", encoding="utf-8")
    res = read_hostfile(path)
    assert res.as_dict() == {"w0": [0, 1], "w1": [0]}
    assert res.hosts[1].where == f"{path}:2"


def test_read_hostfile_errors_name_the_path(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("w0 slots=2\nw0 slots=1\n", encoding="utf-8")
    with pytest.raises(UsageError, match="listed twice") as info:
        read_hostfile(path)
    assert str(info.value).startswith(f"{path}:2: ")


def test_missing_hostfile(tmp_path):
    path = tmp_path / "nope"
    with pytest.raises(UsageError) as info:
        read_hostfile(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert "not found" in message
    assert "HINT: " in message and "--hostfile" in message


def test_unreadable_hostfile_is_a_usage_error(tmp_path):
    path = tmp_path / "binary"
    path.write_bytes(b"w0 slots=1\n\xff\xfe\n")
    with pytest.raises(UsageError) as info:
        read_hostfile(path)
    assert str(info.value).startswith(f"{path}: cannot read hostfile")


# --- property: render then parse -----------------------------------------------------------

_name = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)
_hosts = st.lists(
    st.tuples(_name, st.integers(min_value=1, max_value=64)),
    min_size=1, max_size=8, unique_by=lambda t: t[0],
)
_comment = st.text(st.characters(blacklist_categories=("Cs", "Zl", "Zp", "Cc")), max_size=20)
_blank = st.sampled_from(["", " ", "\t", "  \t "])


@given(hosts=_hosts, data=st.data())
def test_render_parse_roundtrip(hosts, data):
    lines: list[str] = []
    for name, slots in hosts:
        for _ in range(data.draw(st.integers(0, 2))):
            lines.append(data.draw(st.one_of(
                _blank, _comment.map(lambda c: data.draw(_blank) + "#" + c))))
        sep = data.draw(st.sampled_from([" ", "\t", "  ", " \t"]))
        lead = data.draw(_blank)
        trail = data.draw(st.one_of(_blank, _comment.map(lambda c: " #" + c)))
        lines.append(f"{lead}{name}{sep}slots={slots}{trail}")
    text = "\n".join(lines) + data.draw(st.sampled_from(["", "\n"]))
    assert hosts_of(text) == [(name, tuple(range(slots))) for name, slots in hosts]
