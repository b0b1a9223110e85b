"""What every config section shares: key handling, value types and one-line errors.

Each section is a frozen pydantic model whose attribute names are DeepSpeed's key names.
A section sorts the keys it is given into three kinds before pydantic sees them:

- its own fields (by name or by one of DeepSpeed's aliases): validated;
- keys DeepSpeed knows but deepshard does not implement (``ds_only_keys``): dropped, and
  their dotted paths recorded so the caller can warn once;
- a near miss of a known key: a typo, raised at once as a :class:`UsageError` with "did
  you mean";
- any other key: recorded as unknown, for one warning (DeepSpeed ignores such keys, and
  real configs carry them, e.g. ``cuda_visible_devices`` in DeepSpeedExamples').

The bookkeeping travels in pydantic's validation ``context`` (a fresh :class:`KeyLog` per
call): a field wrap-validator keeps the dotted path of the value being validated, so errors
and recorded keys carry their full path. A pydantic ``ValidationError`` never leaves this
package: :func:`usage_error` turns its first error into a one-line :class:`UsageError`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from typing_extensions import Self

from deepshard.errors import UsageError


@dataclass
class KeyLog:
    """Per-validation bookkeeping, passed as pydantic's ``context={"keys": KeyLog(...)}``."""

    origin: str = "<dict>"
    """Where the config came from, named in errors (a path or ``<dict>``)."""
    path: list[str] = field(default_factory=list)
    """The dotted path of the value being validated, as a stack of keys."""
    unimplemented: list[str] = field(default_factory=list)
    """Dotted paths of keys DeepSpeed knows and deepshard ignores, in the order met."""
    unknown: list[str] = field(default_factory=list)
    """Dotted paths of keys neither knows (and no near miss of a known one)."""

    def where(self, *keys: object) -> str:
        """``<origin>: a.b.c`` for the current path extended by ``keys`` (``a.b.c`` alone
        with no origin: a section a script passed to a library call)."""
        dotted = ".".join([*self.path, *(str(k) for k in keys)])
        if not self.origin:
            return dotted
        return f"{self.origin}: {dotted}" if dotted else self.origin


def key_log(info: ValidationInfo) -> KeyLog | None:
    context = info.context
    return context.get("keys") if isinstance(context, dict) else None


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """The closest of ``choices`` to ``word`` (case-insensitive), or None."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


class Section(BaseModel):
    """Base of every config section: frozen, DeepSpeed key names, typed errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True,
                              validate_default=False, protected_namespaces=())

    ds_only_keys: ClassVar[frozenset[str]] = frozenset()
    """Keys DeepSpeed accepts in this section that deepshard ignores (recorded, no error)."""

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """Pydantic's ``model_validate``, with errors raised as one-line UsageErrors that
        carry the full key path (``context={"keys": KeyLog(...)}`` collects what was
        ignored; a fresh one is used when none is given)."""
        context = kwargs.pop("context", None) or {}
        log = context.setdefault("keys", KeyLog())
        try:
            return super().model_validate(obj, context=context, **kwargs)
        except ValidationError as exc:
            raise usage_error(exc, log) from None

    @classmethod
    def known_keys(cls) -> dict[str, str]:
        """Every accepted spelling of this section's keys, mapped to the field name."""
        known = {}
        for name, info in cls.model_fields.items():
            known[name] = name
            alias = info.validation_alias
            if isinstance(alias, AliasChoices):
                known.update({choice: name for choice in alias.choices
                              if isinstance(choice, str)})
            elif isinstance(alias, str):
                known[alias] = name
        return known

    @classmethod
    def section_of(cls, key: str, data: dict[str, Any]) -> type[Section] | None:
        """The section model that validates ``data[key]``, if it is a section (used to walk a
        raw config along the schema, e.g. to find "auto" values)."""
        name = cls.known_keys().get(key)
        if name is None:
            return None
        return _section_type(cls.model_fields[name].annotation)

    @classmethod
    def coerce(cls, data: Any, log: KeyLog) -> Any:
        """Hook: turn a legacy form of the section (e.g. a bool) into a mapping."""
        return data

    @classmethod
    def prepare(cls, data: dict[str, Any], log: KeyLog) -> dict[str, Any]:
        """Hook: section-specific rewriting of the sorted keys (aliases, nested models)."""
        return data

    @model_validator(mode="before")
    @classmethod
    def _sort_keys(cls, data: Any, info: ValidationInfo) -> Any:
        log = key_log(info) or KeyLog()
        data = cls.coerce(data, log)
        if not isinstance(data, dict):
            return data  # pydantic reports the type error with its location
        known = cls.known_keys()
        kept = {}
        for key, value in data.items():
            if key in known:
                kept[key] = value
            elif key in cls.ds_only_keys:
                log.unimplemented.append(".".join([*log.path, str(key)]))
            elif _suggestion(cls, str(key)) is None or _dotted_path(cls, str(key)):
                # a dotted path as a key ("zero_optimization.reduce_bucket_size", as TRL
                # writes for its reference model): DeepSpeed reads no such key either
                log.unknown.append(".".join([*log.path, str(key)]))
            else:
                raise unknown_key_error(cls, str(key), log)
        return cls.prepare(kept, log)

    @field_validator("*", mode="wrap")
    @classmethod
    def _track_path(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        log = key_log(info)
        if log is None:
            return handler(value)
        log.path.append(info.field_name or "?")
        try:
            return handler(value)
        finally:
            log.path.pop()


def _section_type(annotation: Any) -> type[Section] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None


def _dotted_path(section: type[Section], key: str) -> bool:
    """Whether ``key`` is a dotted path starting with one of the section's keys."""
    head, dot, _ = key.partition(".")
    return bool(dot) and head in section.known_keys()


def _suggestion(section: type[Section], key: str) -> str | None:
    return did_you_mean(key, [*section.known_keys(), *section.ds_only_keys])


def unknown_key_error(section: type[Section], key: str, log: KeyLog) -> UsageError:
    accepted = sorted(section.model_fields)
    suggestion = _suggestion(section, key)
    where = log.where(key)
    scope = ".".join(log.path) or "the top level"
    if suggestion:
        return UsageError(f"unknown key, did you mean {suggestion!r}", where=where,
                          hint=f"rename it to {suggestion!r}; {scope} accepts: "
                               f"{', '.join(accepted)}")
    return UsageError("unknown key", where=where,
                      hint=f"remove it or use one of the keys {scope} accepts: "
                           f"{', '.join(accepted)}")


# ---- value types --------------------------------------------------------------------------
# Pydantic's lax mode would take true as 1 and 5.5 as a float where an int is meant; these
# types keep JSON's 5e8 working as an integer but refuse booleans, with DeepSpeed-style wording.

def _number(kind: str, *, integer: bool, low: float | None = None,
            strict_low: bool = False) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PydanticCustomError("expected", "expected {kind}", {"kind": kind})
        if isinstance(value, float) and not math.isfinite(value):
            raise PydanticCustomError("expected", "expected {kind}", {"kind": kind})
        if integer and value != int(value):
            raise PydanticCustomError("expected", "expected {kind}", {"kind": kind})
        if low is not None and (value <= low if strict_low else value < low):
            raise PydanticCustomError("expected", "expected {kind}", {"kind": kind})
        return int(value) if integer else float(value)
    return BeforeValidator(check)


Int = Annotated[int, _number("an integer", integer=True)]
PosInt = Annotated[int, _number("a positive integer", integer=True, low=0, strict_low=True)]
NonNegInt = Annotated[int, _number("a non-negative integer", integer=True, low=0)]
Float = Annotated[float, _number("a number", integer=False)]
NonNegFloat = Annotated[float, _number("a non-negative number", integer=False, low=0)]
PosFloat = Annotated[float, _number("a positive number", integer=False, low=0,
                                    strict_low=True)]


def _unit_check(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise PydanticCustomError("expected", "expected {kind}",
                                  {"kind": "a number from 0 to 1"})
    return float(value)


def _never_if_infinite(value: Any) -> Any:
    return None if isinstance(value, float) and value == math.inf else value


Interval = Annotated[PosInt | None, BeforeValidator(_never_if_infinite)]
"""A number of steps between two events, or ``float("inf")``/None: never (Accelerate writes
``steps_per_print: inf`` into every config it builds)."""


UnitFloat = Annotated[float, BeforeValidator(_unit_check)]


def _bool_check(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # DeepSpeed's pydantic takes 0/1 too
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise PydanticCustomError("expected", "expected {kind}", {"kind": "true or false"})


Bool = Annotated[bool, BeforeValidator(_bool_check)]


def one_of(*accepted: str, case_insensitive: bool = False) -> BeforeValidator:
    """A before-validator for a string choice; with ``case_insensitive`` the canonical
    spelling of ``accepted`` is stored."""
    def check(value: Any) -> Any:
        if isinstance(value, str):
            for choice in accepted:
                if value == choice or (case_insensitive and value.lower() == choice.lower()):
                    return choice
        listed = ", ".join(repr(a) for a in accepted)
        raise PydanticCustomError("choice", "{given!r} is not one of {accepted}",
                                  {"given": value, "accepted": listed})
    return BeforeValidator(check)


def _lr_check(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return tuple(float(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise PydanticCustomError("expected", "expected {kind}", {
        "kind": "a non-negative number, or a list of numbers (one per parameter group)"})


LearningRate = Annotated[float | tuple[float, ...], BeforeValidator(_lr_check)]
"""A learning rate: one number, or one per parameter group (as DeepSpeed's schedulers take)."""


def _betas_check(value: Any) -> Any:
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1
                    for v in value)):
        return (float(value[0]), float(value[1]))
    raise PydanticCustomError("expected", "expected {kind}",
                              {"kind": "two numbers in [0, 1), e.g. [0.9, 0.999]"})


Betas = Annotated[tuple[float, float], BeforeValidator(_betas_check)]


def doc(text: str, **kwargs: Any) -> Any:
    """A pydantic ``Field`` whose description is the field's one-line docstring."""
    return Field(description=text, **kwargs)


# ---- errors -------------------------------------------------------------------------------

_EXPECTED = {
    "bool_type": "true or false", "bool_parsing": "true or false",
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "string_type": "a string", "model_type": "a mapping of keys to values",
    "dict_type": "a mapping of keys to values", "tuple_type": "a list",
    "list_type": "a list",
}


def usage_error(exc: ValidationError, log: KeyLog) -> UsageError:
    """The first error of ``exc`` as a one-line UsageError naming the key path."""
    first = exc.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    where = log.where(*loc)
    kind, ctx, given = first["type"], first.get("ctx") or {}, first.get("input")
    if kind == "missing":
        parent = ".".join([*log.path, *loc[:-1]]) or "the top level"
        return UsageError("required key is missing", where=where,
                          hint=f"add {loc[-1]!r} to {parent}")
    if kind == "choice":
        return UsageError(f"{given!r} is not an accepted value", where=where,
                          hint=f"use one of: {ctx['accepted']}")
    if kind == "literal_error":
        return UsageError(f"{given!r} is not an accepted value", where=where,
                          hint=f"use one of: {ctx['expected']}")
    if kind == "expected" or kind in _EXPECTED:
        expected = ctx.get("kind") or _EXPECTED[kind]
        return UsageError(f"expected {expected}, got {given!r}", where=where,
                          hint=f"set it to {expected}")
    if kind == "extra_forbidden":  # only reachable by bypassing _sort_keys
        return UsageError("unknown key", where=where, hint="remove it")
    message = first["msg"].removeprefix("Value error, ")
    return UsageError(message, where=where, hint="see the deepshard config reference")


def fail(log: KeyLog, key: str, message: str, hint: str) -> UsageError:
    """A UsageError about ``key`` of the section being validated."""
    return UsageError(message, where=log.where(key), hint=hint)


def validate_section(model: type[Section], data: Any, log: KeyLog, *keys: str) -> Section:
    """Validate ``data`` as ``model`` at the current path extended by ``keys`` (for models
    chosen at run time, e.g. an optimizer's params by its type)."""
    log.path.extend(keys)
    try:
        return model.model_validate(data, context={"keys": log})
    finally:
        del log.path[len(log.path) - len(keys):]
