"""Read config text in DeepSpeed's dialect: JSON with comments, or YAML.

DeepSpeed reads its config files with hjson, so the ``ds_config.json`` files users bring
carry ``//``, ``#`` and ``/* */`` comments and, now and then, a trailing comma. We accept
exactly that much of the dialect on top of strict JSON: comments and trailing commas are
blanked out (replaced by spaces, newlines kept) so the JSON decoder's line and column
numbers still point into the user's file. A duplicate key is an error, as it is in
DeepSpeed. ``.yaml``/``.yml`` files are read with PyYAML's safe loader, duplicate keys
again an error. Every problem is a :class:`UsageError` naming ``file:line``.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from json.decoder import JSONObject  # type: ignore[attr-defined]
from json.scanner import py_make_scanner  # type: ignore[attr-defined]
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from deepshard.errors import UsageError

DICT_ORIGIN = "<dict>"
YAML_SUFFIXES = (".yaml", ".yml")

# a JSON string literal (with escapes), or one of the brackets; used to find an object's
# own keys when reporting a duplicate
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]', re.DOTALL)

_JSON_HINTS = MappingProxyType({
    "Expecting ',' delimiter": "a comma is missing between two entries (or a bracket is "
                               "not closed)",
    "Expecting property name enclosed in double quotes": "keys must be in double quotes",
    "Expecting ':' delimiter": "a key must be followed by ':' and its value",
    "Expecting value": "a value is missing or misspelled (JSON writes true, false and "
                       "null in lower case; strings need double quotes)",
    "Unterminated string starting at": "a string's closing double quote is missing",
    "Extra data": "there is text after the closing brace of the top-level object",
})


def read_config_source(source: object) -> tuple[dict[str, Any], str]:
    """The raw config mapping and where it came from.

    Args:
        source: a dict (returned as a deep copy, origin ``"<dict>"``) or a path (``str`` or
            ``os.PathLike``) to a JSON file in DeepSpeed's dialect or a ``.yaml``/``.yml``
            file.

    Returns:
        ``(data, origin)``: the top-level mapping and the origin to name in errors (the
        path as given, or ``"<dict>"``).

    Raises:
        UsageError: the file is missing or unreadable, its syntax is wrong (``where`` is
            ``<path>:<line>``), a key is repeated, or the top level is not a mapping.
    """
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source)), DICT_ORIGIN
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(f"a config must be a dict or a path to a file, got "
                         f"{type(source).__name__}",
                         hint="pass the path to your ds_config.json (or YAML), or a dict")
    path = Path(source)
    origin = os.fspath(source)
    text = _read_text(path, origin)
    if path.suffix.lower() in YAML_SUFFIXES:
        data = parse_yaml(text, origin)
    else:
        data = parse_json(text, origin)
    if not isinstance(data, dict):
        kind = "nothing" if data is None else f"a {type(data).__name__}"
        raise UsageError(f"the config must be a mapping of keys to values at the top level, "
                         f"got {kind}", where=origin,
                         hint='write the config as one object: {"train_batch_size": 8, ...}')
    return data, origin


def _read_text(path: Path, origin: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError("config file not found", where=origin,
                         hint="check the path given to --deepspeed_config / config=") from None
    except IsADirectoryError:
        raise UsageError("the config path is a directory, not a file", where=origin,
                         hint="name the JSON or YAML file inside it") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"config file is not UTF-8 text ({exc.reason} at byte {exc.start})",
                         where=origin, hint="save the file as UTF-8") from None
    except OSError as exc:
        raise UsageError(f"cannot read config file: {exc.strerror or exc}", where=origin,
                         hint="check that the file exists and is readable") from None


# ---- JSON with comments -------------------------------------------------------------------

def strip_comments(text: str) -> str:
    """``text`` with ``//``, ``#`` and ``/* */`` comments outside string literals replaced by
    spaces (newlines kept), so every remaining character keeps its line and column."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            i = _skip_string(text, i)
            continue
        if ch == "#" or text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out[i:end] = " " * (end - i)
            i = end
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out[i:end] = [c if c in "\r\n" else " " for c in text[i:end]]
            i = end
            continue
        i += 1
    return "".join(out)


def strip_trailing_commas(text: str) -> str:
    """``text`` with a comma that directly precedes ``}`` or ``]`` (whitespace between)
    replaced by a space; strings are left alone. Expects comments already stripped."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            i = _skip_string(text, i)
            continue
        if ch == ",":
            j = i + 1
            while j < n and text[j] in " \t\r\n":
                j += 1
            if j < n and text[j] in "}]":
                out[i] = " "
        i += 1
    return "".join(out)


def _skip_string(text: str, start: int) -> int:
    """The index just past the string literal opening at ``start`` (or the end of text)."""
    i, n = start + 1, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"' or ch == "\n":  # a newline ends it: the decoder reports the real error
            return i + 1
        i += 1
    return n


class _DuplicateKey(Exception):
    def __init__(self, key: str, position: int, first: int):
        super().__init__(key)
        self.key, self.position, self.first = key, position, first


class _StrictDecoder(json.JSONDecoder):
    """A JSON decoder whose objects reject a repeated key, reporting where it is."""

    def __init__(self) -> None:
        super().__init__()
        self.parse_object = self._parse_object
        self.scan_once = py_make_scanner(self)

    @staticmethod
    def _parse_object(s_and_end: tuple[str, int], strict: bool, scan_once: Any,
                      object_hook: Any, object_pairs_hook: Any,
                      memo: dict[str, str] | None = None) -> tuple[dict[str, Any], int]:
        text, start = s_and_end
        pairs, end = JSONObject(s_and_end, strict, scan_once, None, list, memo)
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                offsets = [pos for k, pos in _own_keys(text, start - 1, end) if k == key]
                offsets += [start - 1] * (2 - len(offsets))  # not expected: the brace
                raise _DuplicateKey(key, offsets[1], offsets[0])
            seen.add(key)
        return dict(pairs), end


def _own_keys(text: str, start: int, end: int) -> list[tuple[str, int]]:
    """``(key, offset)`` of each key of the object spanning ``text[start:end]`` (its own
    keys, not those of nested objects)."""
    keys, depth = [], 0
    for match in _TOKEN.finditer(text, start, end):
        token = match.group()
        if token in "{[":
            depth += 1
        elif token in "}]":
            depth -= 1
        elif depth == 1 and text[match.end():end].lstrip().startswith(":"):
            keys.append((json.loads(token), match.start()))
    return keys


def parse_json(text: str, origin: str) -> Any:
    """Decode JSON in DeepSpeed's dialect (comments, trailing commas); errors name
    ``origin:line``."""
    clean = strip_trailing_commas(strip_comments(text))
    try:
        return _StrictDecoder().decode(clean)
    except _DuplicateKey as dup:
        line = _line_of(clean, dup.position)
        raise UsageError(f"duplicate key {dup.key!r} (first given on line "
                         f"{_line_of(clean, dup.first)})", where=f"{origin}:{line}",
                         hint="keep one of the two; DeepSpeed rejects duplicate keys "
                              "too") from None
    except json.JSONDecodeError as exc:
        relaxed = _parse_hjson(text, origin)
        if relaxed is not None:
            return relaxed
        hint = next((h for prefix, h in _JSON_HINTS.items() if exc.msg.startswith(prefix)),
                    "fix the JSON syntax near this line")
        raise UsageError(f"invalid JSON: {exc.msg} (column {exc.colno})",
                         where=f"{origin}:{exc.lineno}", hint=hint) from None


def _parse_hjson(text: str, origin: str) -> Any:
    """``text`` as HJSON (unquoted keys and strings, no commas), as DeepSpeed reads every
    config file; None when it is not HJSON either (the JSON error is then the one shown).
    A repeated key is an error here too. Beware HJSON's own rule: an unquoted value runs to
    the end of its line, a ``# comment`` after it included."""
    import hjson

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in items:
            if key in seen:
                raise UsageError(f"duplicate key {key!r}", where=origin,
                                 hint="keep one of the two; DeepSpeed rejects duplicate "
                                      "keys too")
            seen[key] = value
        return seen

    try:
        return hjson.loads(text, object_pairs_hook=pairs)
    except hjson.HjsonDecodeError:
        return None


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# ---- YAML ---------------------------------------------------------------------------------

class _StrictYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with duplicate keys an error, and ``5e8`` read as a number (YAML
    1.1 needs a dot in floats; config files are written as in JSON)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[object, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict)):
                continue  # unhashable: the base class reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line "
                    f"{seen[key].line + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_StrictYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def parse_yaml(text: str, origin: str) -> Any:
    """Load YAML safely; duplicate keys and syntax errors name ``origin:line``."""
    try:
        return yaml.load(text, Loader=_StrictYamlLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{origin}:{mark.line + 1}" if mark else origin
        problem = exc.problem or "invalid YAML"
        column = f" (column {mark.column + 1})" if mark else ""
        duplicate = problem.startswith("duplicate key")
        raise UsageError(f"{problem if duplicate else 'invalid YAML: ' + problem}{column}",
                         where=where,
                         hint="keep one of the two" if duplicate
                         else "fix the YAML syntax near this line (indentation, a missing "
                              "':' or an unclosed quote)") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"invalid YAML: {exc}", where=origin,
                         hint="fix the YAML syntax") from None
