"""Checks of user settings: a bad value is one line naming the setting, what it must be and what was given.

Every setting of a method, a policy, a decoding config or a steering run is a field of a dataclass,
and its annotation says what it takes.  ``check_fields(obj)`` (in a ``__post_init__``) and
``check_kwargs(cls, settings)`` (before building ``cls``, whose own checks may assume the types)
read those annotations, so no setting needs a check of its own type.

A bad setting raises ``SettingError``, a ``ValueError`` that names the setting in the caller's
terms: from Python its keyword (``budget=``), from the command line its flag (``--budget``, or
``--set sinks``: ``SettingError.in_terms``).  Light on purpose: no torch, so the CLI can import
it before it decides to load a model.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import types
import typing
from typing import Any


class InputError(ValueError):
    """An input that cannot be used as given (a prompt longer than the model's context, a results
    file with a bad line): the message says which and what to do, so a CLI shows it as one line."""


class SettingError(ValueError):
    """A setting with a value it cannot take.

    ``template`` is the message with ``{name}`` where the setting is named (at the start when it
    has none); ``str(err)`` names it as a Python keyword, ``err.in_terms(flag)`` as a flag.
    """

    def __init__(self, setting: str, template: str):
        self.setting = setting
        self.template = template if "{name}" in template else "{name} " + template
        super().__init__(self.in_terms(f"{setting}="))

    def in_terms(self, name: str) -> str:
        """The message with the setting called ``name`` (a CLI flag such as ``--budget``)."""
        return self.template.replace("{name}", name)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isnan(value))


_SCALARS: dict[Any, tuple[str, Any]] = {  # annotation -> (what it is called, test)
    int: ("an integer", _is_int),
    float: ("a number", _is_number),
    bool: ("true or false", lambda v: isinstance(v, bool)),
    str: ("text", lambda v: isinstance(v, str)),
    type(None): ("none", lambda v: v is None),
    Any: ("anything", lambda v: True),
}
_PLURALS = {"an integer": "integers", "a number": "numbers", "true or false": "true/false values", "text": "texts"}


def describe(annotation) -> str:
    """What a value of ``annotation`` is, in words: ``int | None`` -> "an integer or none"."""
    if annotation in _SCALARS:
        return _SCALARS[annotation][0]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # None stands for "unset": not worth naming
        return " or ".join(describe(a) for a in args if a is not type(None))
    if origin in (tuple, list) and args:
        inner = describe(args[0])
        return f"a list of {_PLURALS.get(inner, inner)}"
    if origin is dict or annotation is dict:
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def matches(value, annotation) -> bool:
    """Whether ``value`` is a ``annotation`` (JSON's lists stand for tuples; an int is a float)."""
    if annotation in _SCALARS:
        return _SCALARS[annotation][1](value)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return all(matches(v, args[0]) for v in value) if args else True
        return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    return True  # an object (a scorer, a vector): duck-typed stand-ins are welcome, so no check


def shown(value) -> str:
    """A value as an error message quotes it: its repr and, where that is ambiguous, its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return text if value is None else f"{text} ({type(value).__name__})"


def check_value(name: str, value, annotation) -> None:
    """Raise ``SettingError`` unless ``value`` is a ``annotation``."""
    if not matches(value, annotation):
        raise SettingError(name, f"{{name}} must be {describe(annotation)}, got {shown(value)}")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of dataclass ``cls``'s init fields (string annotations read once)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and f.name in hints}


def check_kwargs(cls: type, settings: dict[str, Any], prefix: str = "") -> None:
    """Check the given ``settings`` against the annotations of dataclass ``cls``'s fields (names it
    has no field for are left to the caller, which knows what else it takes); ``prefix``: what
    the caller's names start with (``allocator_`` for an allocator's settings)."""
    types_ = field_types(cls)
    for name, value in settings.items():
        if name in types_:
            check_value(prefix + name, value, types_[name])


def check_fields(obj) -> None:
    """Check every init field of dataclass instance ``obj`` against its annotation."""
    check_kwargs(type(obj), {name: getattr(obj, name) for name in field_types(type(obj))})



def check_at_least(name: str, value, least) -> None:
    """Raise ``SettingError`` unless ``value >= least``."""
    if value < least:
        raise SettingError(name, f"{{name}} must be >= {least}, got {value!r}")


def did_you_mean(name: str, known) -> str:
    """`` (did you mean tova?)`` for the name in ``known`` nearest to ``name``, or "" when none is near."""
    near = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {near[0]}?)" if near else ""
