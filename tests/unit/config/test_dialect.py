"""Reading config text in DeepSpeed's dialect: JSON with comments, YAML, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepshard.config.dialect import (
    parse_json,
    read_config_source,
    strip_comments,
    strip_trailing_commas,
)
from deepshard.errors import UsageError


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def read_error(source: object) -> UsageError:
    with pytest.raises(UsageError) as info:
        read_config_source(source)
    return info.value


# ---- comments -----------------------------------------------------------------------------

def test_all_three_comment_styles_are_ignored(tmp_path):
    path = write(tmp_path, "ds.json", """{
      // a line comment
      "train_batch_size": 8,  # a hash comment
      /* a block
         comment */ "steps_per_print": 5
    }""")
    assert read_config_source(path) == ({"train_batch_size": 8, "steps_per_print": 5},
                                        str(path))


def test_comment_markers_inside_strings_are_kept(tmp_path):
    path = write(tmp_path, "ds.json", '{"path": "a//b#c", "glob": "/*x*/", "q": "say \\"#\\""}')
    data, _ = read_config_source(path)
    assert data == {"path": "a//b#c", "glob": "/*x*/", "q": 'say "#"'}


def test_stripping_keeps_every_line_and_column():
    text = '{"a": 1, // note\n "b": /* x\n y */ 2 # end\n}'
    stripped = strip_comments(text)
    assert len(stripped) == len(text)
    assert [len(line) for line in stripped.split("\n")] == \
        [len(line) for line in text.split("\n")]
    assert json.loads(stripped) == {"a": 1, "b": 2}


def test_trailing_commas_are_accepted_as_hjson_does(tmp_path):
    path = write(tmp_path, "ds.json", '{"a": [1, 2,], "b": {"c": 1,},}')
    assert read_config_source(path)[0] == {"a": [1, 2], "b": {"c": 1}}
    assert strip_trailing_commas('{"s": ",}"}') == '{"s": ",}"}'


def test_syntax_error_names_file_and_line_after_comments(tmp_path):
    """(Without the closing brace: a missing comma alone is HJSON, which DeepSpeed reads.)"""
    path = write(tmp_path, "ds.json", '{\n  // comment\n  "a": 1\n  "b": 2\n')
    err = read_error(path)
    assert err.where == f"{path}:4"
    assert "column 3" in err.message
    assert "comma is missing" in err.hint


def test_unquoted_true_gets_a_hint(tmp_path):
    path = write(tmp_path, "ds.json", '{"a": True}')
    err = read_error(path)
    assert err.where == f"{path}:1"
    assert "lower case" in err.hint


def test_duplicate_key_is_an_error_naming_its_line(tmp_path):
    path = write(tmp_path, "ds.json", '{\n "fp16": {"enabled": true},\n "x": 1,\n'
                                      ' "fp16": {"enabled": false}\n}')
    err = read_error(path)
    assert err.where == f"{path}:4"
    assert "duplicate key 'fp16'" in err.message and "line 2" in err.message
    assert "HINT" in str(err)


def test_nested_duplicate_key_names_the_nested_line(tmp_path):
    path = write(tmp_path, "ds.json", '{"zero_optimization": {\n  "stage": 2,\n'
                                      '  "sub": {"stage": 1},\n  "stage": 3\n}}')
    err = read_error(path)
    assert err.where == f"{path}:4"
    assert "'stage'" in err.message


def test_same_key_in_sibling_objects_is_not_a_duplicate(tmp_path):
    path = write(tmp_path, "ds.json", '{"fp16": {"enabled": true}, "bf16": {"enabled": false}}')
    assert read_config_source(path)[0]["bf16"] == {"enabled": False}


# ---- YAML ---------------------------------------------------------------------------------

def test_yaml_config(tmp_path):
    path = write(tmp_path, "ds.yaml", "train_batch_size: 8\nzero_optimization:\n  stage: 2\n"
                                      "  reduce_bucket_size: 5e8\n")
    data, origin = read_config_source(path)
    assert data == {"train_batch_size": 8,
                    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}
    assert origin == str(path)


def test_yaml_duplicate_key_names_its_line(tmp_path):
    path = write(tmp_path, "ds.yml", "fp16:\n  enabled: true\n  enabled: false\n")
    err = read_error(path)
    assert err.where == f"{path}:3"
    assert "duplicate key 'enabled'" in err.message and "line 2" in err.message


def test_yaml_syntax_error_names_its_line(tmp_path):
    path = write(tmp_path, "ds.yaml", "a: 1\nb: [1, 2\nc: 3\n")
    err = read_error(path)
    assert err.where.startswith(f"{path}:")
    assert err.message.startswith("invalid YAML")


def test_yaml_needs_a_mapping_at_the_top(tmp_path):
    err = read_error(write(tmp_path, "ds.yaml", "- 1\n- 2\n"))
    assert "mapping" in err.message and "list" in err.message
    err = read_error(write(tmp_path, "empty.yaml", ""))
    assert "got nothing" in err.message


# ---- sources ------------------------------------------------------------------------------

def test_dict_source_is_copied():
    source = {"fp16": {"enabled": True}}
    data, origin = read_config_source(source)
    data["fp16"]["enabled"] = False
    assert source["fp16"]["enabled"] is True
    assert origin == "<dict>"


def test_missing_file_names_it(tmp_path):
    err = read_error(tmp_path / "nope.json")
    assert err.where == str(tmp_path / "nope.json")
    assert err.message == "config file not found"


def test_directory_and_wrong_source_type(tmp_path):
    assert "directory" in read_error(tmp_path).message
    assert "dict or a path" in read_error(42).message


def test_json_top_level_must_be_an_object(tmp_path):
    err = read_error(write(tmp_path, "ds.json", "[1, 2]"))
    assert err.where == str(tmp_path / "ds.json")
    assert "top level" in err.message


# ---- properties ---------------------------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                | st.text(alphabet=st.sampled_from('ab/#*"\\ \t:,{}[]é'), max_size=12))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=20)


@settings(max_examples=100, deadline=None)
@given(json_values, st.sampled_from([None, 1]))
def test_stripping_is_identity_on_comment_free_json(value, indent):
    text = json.dumps(value, indent=indent, ensure_ascii=False)
    assert strip_comments(text) == text
    assert strip_trailing_commas(text) == text


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=6), json_values, max_size=5),
       st.sampled_from(["// c", "# c", "/* c */", "/* a\nb */"]))
def test_comments_after_every_line_do_not_change_the_value(value, comment):
    text = json.dumps(value, indent=1, ensure_ascii=False)
    commented = "\n".join(f"{line} {comment}" for line in text.split("\n"))
    assert parse_json(commented, "<test>") == value
