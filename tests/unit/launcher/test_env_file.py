"""deepshard.launcher.env_file: ``.deepspeed_env`` files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepshard.errors import UsageError
from deepshard.launcher.env_file import (
    DEFAULT_NAME,
    ENV_FILE_VAR,
    env_file_paths,
    parse_env_text,
    read_env_files,
)

# --- parse_env_text ------------------------------------------------------------------------


def test_key_value_and_export():
    text = "A=1\nexport B=two\nexport\tC=3\n  export   D=4\n_E9=x\n"
    assert parse_env_text(text, "f") == {"A": "1", "B": "two", "C": "3", "D": "4", "_E9": "x"}


def test_comments_and_blank_lines_are_ignored():
    text = "# comment=1\n\n   \n  # indented=2\n\t\nA=1\n#B=2\n"
    assert parse_env_text(text, "f") == {"A": "1"}


@pytest.mark.parametrize(
    ("line", "value"),
    [
        ("V=a=b=c", "a=b=c"),
        ("V==", "="),
        ("V=", ""),
        ("V=x # not a comment", "x # not a comment"),
        ("V=#hash", "#hash"),
        ("V='single quoted'", "'single quoted'"),
        ('V="double quoted"', '"double quoted"'),
        ("V=it's", "it's"),
        ("V=with spaces inside", "with spaces inside"),
        ("V=trailing   ", "trailing   "),
        ("V=  leading", "  leading"),
        ("V=$HOME `id` $(rm -rf /)", "$HOME `id` $(rm -rf /)"),
        ("V=a\\nb", "a\\nb"),
        ("V=tab\there", "tab\there"),
        ("V=héllo ☃", "héllo ☃"),
    ],
)
def test_values_are_taken_verbatim(line, value):
    assert parse_env_text(line + "\n", "f") == {"V": value}


def test_crlf_lines():
    assert parse_env_text("A=1\r\nB=two words \r\n\r\n# c\r\n", "f") == {
        "A": "1", "B": "two words "}


def test_later_line_wins_within_a_file():
    assert parse_env_text("A=1\nA=2\n", "f") == {"A": "2"}


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("A=1\nNOEQUALS\n", 2),
        ("A=1\n\n# c\nKEY =value\n", 4),
        ("1KEY=v\n", 1),
        ("KE-Y=v\n", 1),
        ("KEY.X=v\n", 1),
        ("=value\n", 1),
        ("export\n", 1),
        ("export KEY\n", 1),
        ("A=1\r\nB C=1\r\n", 2),
        ("KÉY=v\n", 1),
    ],
)
def test_malformed_lines(text, line):
    with pytest.raises(UsageError) as info:
        parse_env_text(text, "/home/u/.deepspeed_env")
    assert info.value.where == f"/home/u/.deepspeed_env:{line}"
    assert str(info.value).startswith(f"/home/u/.deepspeed_env:{line}: ")
    assert "HINT: " in str(info.value)


def test_missing_equals_says_so():
    with pytest.raises(UsageError, match="without '='"):
        parse_env_text("JUSTAWORD\n", "f")


# --- read_env_files ------------------------------------------------------------------------


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    return home, cwd


def test_no_files_is_empty(dirs):
    home, cwd = dirs
    env = read_env_files({}, home, cwd)
    assert env.variables == () and env.sources == ()


def test_home_then_cwd_later_wins(dirs):
    home, cwd = dirs
    (home / DEFAULT_NAME).write_text("A=home\nB=home\n")
    (cwd / DEFAULT_NAME).write_text("B=cwd\nC=cwd\n")
    env = read_env_files({}, home, cwd)
    assert env.as_dict() == {"A": "home", "B": "cwd", "C": "cwd"}
    assert env.sources == (str(home / DEFAULT_NAME), str(cwd / DEFAULT_NAME))


@pytest.mark.parametrize("where", ["home", "cwd"])
def test_only_one_file(dirs, where):
    home, cwd = dirs
    base = home if where == "home" else cwd
    (base / DEFAULT_NAME).write_text("X=1\n")
    env = read_env_files({}, home, cwd)
    assert env.as_dict() == {"X": "1"}
    assert env.sources == (str(base / DEFAULT_NAME),)


def test_same_directory_is_read_once(tmp_path):
    (tmp_path / DEFAULT_NAME).write_text("X=1\n")
    env = read_env_files({}, tmp_path, tmp_path)
    assert env.sources == (str(tmp_path / DEFAULT_NAME),)


def test_relative_ds_env_file_is_looked_up_in_both(dirs):
    home, cwd = dirs
    (home / "my.env").write_text("A=home\nB=home\n")
    (cwd / "my.env").write_text("B=cwd\n")
    (cwd / DEFAULT_NAME).write_text("IGNORED=1\n")
    env = read_env_files({ENV_FILE_VAR: "my.env"}, home, cwd)
    assert env.as_dict() == {"A": "home", "B": "cwd"}
    assert env.sources == (str(home / "my.env"), str(cwd / "my.env"))


def test_relative_ds_env_file_in_cwd_only(dirs):
    home, cwd = dirs
    (cwd / "my.env").write_text("B=cwd\n")
    env = read_env_files({ENV_FILE_VAR: "my.env"}, home, cwd)
    assert env.as_dict() == {"B": "cwd"}


def test_absolute_ds_env_file_is_read_once(dirs, tmp_path):
    home, cwd = dirs
    path = tmp_path / "elsewhere.env"
    path.write_text("A=1\n")
    (home / DEFAULT_NAME).write_text("IGNORED=1\n")
    (cwd / DEFAULT_NAME).write_text("IGNORED=1\n")
    assert env_file_paths({ENV_FILE_VAR: str(path)}, home, cwd) == [path]
    env = read_env_files({ENV_FILE_VAR: str(path)}, home, cwd)
    assert env.as_dict() == {"A": "1"}
    assert env.sources == (str(path),)


def test_missing_ds_env_file_is_an_error(dirs):
    home, cwd = dirs
    (home / DEFAULT_NAME).write_text("A=1\n")
    with pytest.raises(UsageError) as info:
        read_env_files({ENV_FILE_VAR: "missing.env"}, home, cwd)
    message = str(info.value)
    assert "missing.env" in message and str(home) in message and str(cwd) in message
    assert "HINT: " in message


def test_missing_absolute_ds_env_file_is_an_error(dirs, tmp_path):
    home, cwd = dirs
    with pytest.raises(UsageError, match=ENV_FILE_VAR):
        read_env_files({ENV_FILE_VAR: str(tmp_path / "nope.env")}, home, cwd)


def test_malformed_file_error_names_its_path(dirs):
    home, cwd = dirs
    (cwd / DEFAULT_NAME).write_text("A=1\nbad line\n")
    with pytest.raises(UsageError) as info:
        read_env_files({}, home, cwd)
    assert info.value.where == f"{cwd / DEFAULT_NAME}:2"


def test_non_utf8_bytes_survive(dirs):
    home, cwd = dirs
    raw_value = b"caf\xe9 \xff\xfe end"
    (cwd / DEFAULT_NAME).write_bytes(b"A=ascii\nB=" + raw_value + b"\nC=\xc3\xa9\n")
    env = read_env_files({}, home, cwd).as_dict()
    assert env["A"] == "ascii"
    assert os.fsencode(env["B"]) == raw_value
    assert env["C"] == "é"


def test_crlf_file(dirs):
    home, cwd = dirs
    (cwd / DEFAULT_NAME).write_bytes(b"export A=1\r\nB=x y\r\n")
    assert read_env_files({}, home, cwd).as_dict() == {"A": "1", "B": "x y"}


# --- property ------------------------------------------------------------------------------

_key = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
_value = st.text(st.characters(blacklist_characters="\n\r\0", blacklist_categories=("Cs",)),
                 max_size=30)


@given(variables=st.dictionaries(_key, _value, max_size=10),
       exports=st.lists(st.booleans(), min_size=10, max_size=10))
def test_written_lines_parse_back(variables, exports):
    lines = [("export " if exp else "") + f"{k}={v}"
             for (k, v), exp in zip(variables.items(), exports, strict=False)]
    assert parse_env_text("\n".join(lines) + "\n", "f") == variables


@given(variables=st.dictionaries(_key, st.binary(max_size=20).filter(
    lambda b: b"\n" not in b and b"\0" not in b and not b.endswith(b"\r")), max_size=6))
def test_bytes_roundtrip_through_files(tmp_path_factory, variables):
    home = tmp_path_factory.mktemp("home")
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / DEFAULT_NAME).write_bytes(b"".join(k.encode() + b"=" + v + b"\n"
                                              for k, v in variables.items()))
    got = read_env_files({}, home, cwd).as_dict()
    assert {k: os.fsencode(v) for k, v in got.items()} == variables


def test_nul_byte_in_value_is_an_error_with_line():
    with pytest.raises(UsageError) as info:
        parse_env_text("A=1\nB=x\0y\n", "envf")
    assert str(info.value).startswith("envf:2: the value of B contains a NUL byte")
    assert "HINT:" in str(info.value)


def test_no_home_directory_reads_the_working_directory_only(tmp_path, monkeypatch):
    """No HOME and no passwd entry (docker --user 1000): only the cwd's file counts."""
    from deepshard.launcher.env_file import home_dir

    monkeypatch.setattr(os.path, "expanduser", lambda p: p)  # what Python does then
    assert home_dir() is None
    (tmp_path / ".deepspeed_env").write_text("A=1\n")
    assert read_env_files({}, None, tmp_path).as_dict() == {"A": "1"}
