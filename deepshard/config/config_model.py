"""DeepSpeed's ``deepspeed.runtime.config_utils``: the pydantic base DeepSpeed's config
classes (and some libraries' own) derive from, and its small dict helpers.

:class:`DeepSpeedConfigModel` validates on construction and on every assignment, forbids
unknown keys, stores enum members as their values, accepts a field by its name or its
alias, and drops ``"auto"`` values unless built with ``strict=True`` (so a Hugging Face
config full of ``"auto"`` takes the defaults). A value pydantic rejects is a one-line
:class:`~deepshard.errors.UsageValueError` naming ``Model.field`` (a ``ValueError``, as
pydantic's own error is). A field declared with
``Field(..., json_schema_extra={"deprecated": True, "new_param": "other"})`` is a deprecated
spelling: setting it logs a warning and moves the value (through ``new_param_fn``, if
given) to ``other``, a dotted path into nested models allowed.

deepshard's own config is the frozen, typed tree of :mod:`deepshard.config.schema`; this
base is for code written against DeepSpeed's classes (:mod:`.precision_models`).
"""

from __future__ import annotations

import collections
import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from deepshard.config.schema_base import KeyLog, usage_error
from deepshard.errors import UsageError, UsageValueError

logger = logging.getLogger("deepshard")

__all__ = ["DeepSpeedConfigModel", "DeepSpeedConfigObject", "dict_raise_error_on_duplicate_keys",
           "get_config_default", "get_dict_param", "get_list_param", "get_scalar_param",
           "pp_int"]


class DeepSpeedConfigModel(BaseModel):
    """The base of DeepSpeed-style config models (see the module docstring).

    Args:
        strict: keep ``"auto"`` values (they then fail validation where a field is typed).
        **data: the fields.
    """

    model_config = ConfigDict(validate_default=True, validate_assignment=True,
                              use_enum_values=True, populate_by_name=True, extra="forbid",
                              arbitrary_types_allowed=True, protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any):
        if not strict:  # "replace_method" is an inference key whose value may be "auto"
            data = {k: v for k, v in data.items() if v != "auto" or k == "replace_method"}
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _one_line(exc, type(self)) from None
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated"):
                self._move_deprecated(name, extra)

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise _one_line(exc, type(self)) from None

    def _move_deprecated(self, name: str, extra: Mapping[str, Any]) -> None:
        """A deprecated field that was set: warn, and move its value to ``new_param``."""
        if name not in self.model_fields_set:
            return
        new = str(extra.get("new_param", ""))
        message = str(extra.get("deprecated_msg", ""))
        logger.warning("Config parameter %s is deprecated%s%s", name,
                       f" use {new} instead" if new else "", f". {message}" if message else "")
        if not new or not extra.get("set_new_param", True):
            return
        convert = extra.get("new_param_fn", lambda value: value)
        value = convert(getattr(self, name))
        *parents, leaf = new.split(".")
        target = functools.reduce(getattr, parents, self)
        if leaf in target.model_fields_set:
            raise UsageError(f"both the deprecated {name!r} and {new!r} are given",
                             where=type(self).__name__, hint=f"remove {name!r}")
        setattr(target, leaf, value)


def _one_line(exc: ValidationError, model: type) -> UsageValueError:
    error = usage_error(exc, KeyLog(origin="", path=[model.__name__]))
    return UsageValueError(error.message, where=error.where, hint=error.hint)


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The default of ``field_name`` in the model ``config``.

    Raises:
        UsageError: no such field, or it is required (has no default).
    """
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    info = fields.get(field_name)
    if info is None or info.is_required():
        why = "is not a field" if info is None else "is required and has no default"
        raise UsageError(f"{field_name!r} {why}", where=getattr(config, "__name__",
                                                                type(config).__name__),
                         hint=f"the fields are {', '.join(fields)}")
    return info.get_default(call_default_factory=True)


def get_scalar_param(param_dict: Mapping[str, Any], param_name: str,
                     param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when the key is absent."""
    return param_dict.get(param_name, param_default_value)


def get_list_param(param_dict: Mapping[str, Any], param_name: str,
                   param_default_value: Any) -> Any:
    """:func:`get_scalar_param` for a list value."""
    return param_dict.get(param_name, param_default_value)


def get_dict_param(param_dict: Mapping[str, Any], param_name: str,
                   param_default_value: Any) -> Any:
    """:func:`get_scalar_param` for a dict value."""
    return param_dict.get(param_name, param_default_value)


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's ``(key, value)`` pairs as a dict, for ``json.load(...,
    object_pairs_hook=...)``.

    Raises:
        UsageValueError: a key appears twice (a ``ValueError``, as DeepSpeed raises).
    """
    counts = collections.Counter(key for key, _ in ordered_pairs)
    repeated = [key for key, n in counts.items() if n > 1]
    if repeated:
        raise UsageValueError(f"Duplicate keys in DeepSpeed config: {repeated}",
                              hint="keep one of each; a later value would silently win")
    return dict(ordered_pairs)


class pp_int(int):
    """An int printed with thousands separators (``1,000,000``), or as ``custom_print_str``:
    for defaults shown in generated documentation."""

    custom_print_str: str | None

    def __new__(cls, val: float, custom_print_str: str | None = None) -> pp_int:
        inst = super().__new__(cls, val)
        inst.custom_print_str = custom_print_str
        return inst

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"


class DeepSpeedConfigObject:
    """A plain config object whose ``repr`` is its attributes as indented JSON."""

    def repr(self) -> dict[str, Any]:
        """The attributes."""
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, default=repr)
