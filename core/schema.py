"""The config schema: every setting's type, range or allowed values, default and one-line meaning, declared once.

Each node of the config is a pydantic model (:class:`Settings`) declared next to the code that reads it:
the top-level settings in ``bench/validate.py`` (``RunSettings``), a method's in its own file
(``Method.Config``), a pair's model specs in ``bench/models.py``, a dataset source's in ``bench/data.py``,
the teacher store's and training recipes next to their builders. Hydra composes the config (groups, overrides, sweeps, launchers); :func:`check` then validates
each node against its model, before any model loads, and turns the first problem into one sentence that
names the key, the value given and what is allowed. Method settings and the top-level defaults reach Hydra
through its ConfigStore (:func:`register_configs`), so no YAML repeats them; ``python -m bench show`` prints
any node from the same declarations.

Rules every node gets from :class:`Settings`: unknown keys are refused (naming the node's keys), NaN and
infinity are refused for every float, and a cross-key rule is a small named ``model_validator``.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    model_validator,
)

from core.errors import BenchError


class Settings(BaseModel):
    """A config node: unknown keys and non-finite floats are refused, and values are taken as typed (strict: a
    string is never read as a number or a boolean, ``yes`` is not ``true``); ``Field(description=...)`` is the
    meaning."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def numbers_as_text(cls, data):
        """Hydra reads ``resume=2024`` as a number; a setting that takes only text takes what was typed."""
        if not isinstance(data, dict):
            return data
        text = {n for n, f in cls.model_fields.items() if f.annotation in (str, str | None, typing.Optional[str])}
        return {k: str(v) if k in text and isinstance(v, (int, float)) and not isinstance(v, bool) else v
                for k, v in data.items()}


# --------------------------------------------------------------------------------------- validation


def check(model: type[Settings], data: Any, where: str, label: str | None = None) -> Settings:
    """``data`` (a plain dict from the composed config) validated as ``model``; the first problem becomes a
    :class:`BenchError` of one sentence. ``where``: the node's dotted key (``method``); ``label``: how the
    node is named to the user (``method=medusa``), default ``where``."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise BenchError(sentence(model, data, err.errors()[0], where, label or where)) from None


def sentence(model: type[Settings], data: Any, error: dict, where: str, label: str) -> str:
    """One pydantic error as one sentence: the key, the value given and what the schema allows."""
    loc = _data_loc(error["loc"], data)
    key = ".".join(str(p) for p in (where.split(".") if where else []) + loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        parent = _model_at(model, data, loc[:-1])
        node = ".".join(p for p in [where, *map(str, loc[:-1])] if p) if loc[:-1] else label
        keys = ", ".join(listed(parent)) if parent else "(none)"
        return f"unknown key {key}; {node} has: {keys or '(no settings)'}."
    if kind == "value_error":  # a named cross-key validator: its message says what is wrong, in bare keys
        node = ".".join(p for p in [where, *map(str, loc)] if p) if loc else label
        return f"{node}: {str(error['msg']).removeprefix('Value error, ')}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # e.g. pair.target.source
        tag = error.get("ctx", {}).get("discriminator", "'source'").strip("'")
        tags = [typing.get_args(m.model_fields[tag].annotation)[0]
                for m in _models_in(getattr(_field_at(model, data, loc), "annotation", None))]
        given = error["input"].get(tag) if isinstance(error.get("input"), dict) else None
        if given is None:
            return f"{key}.{tag} is missing; it takes one of: {', '.join(tags)}."
        return f"{key}.{tag}={_show(given)} is not allowed; it takes one of: {', '.join(tags)}."
    field = _field_at(model, data, loc)
    if kind == "missing":
        allowed = f"; it takes {describe_type(field)}" if field else ""
        return f"{key} is missing{allowed}."
    allowed = describe_type(field) if field else str(error["msg"]).replace("Input should be ", "")
    meaning = f" ({field.description})" if field and field.description else ""
    return f"{key}={_show(error.get('input'))} is not allowed; it takes {allowed}{meaning}."


def _show(value: Any) -> str:
    """A value as it is written on the command line: ``null``, ``true``, ``'text'``, ``nan``."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return repr(value) if isinstance(value, str) else str(value)


def _data_loc(loc: tuple, data: Any) -> list:
    """The error's location as keys of ``data``: pydantic adds the tag of a tagged union (and the type's
    name for a plain union) to the path, which the user never wrote; those steps are dropped."""
    out, node = [], data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict):
            if part in node:
                out.append(part)
                node = node[part]
            elif last:
                out.append(part)  # a missing key
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            out.append(part)
            node = node[part]
    return out


def _models_in(annotation) -> list[type[Settings]]:
    """The :class:`Settings` classes an annotation may hold (``X``, ``X | None``, ``list[X]``, unions of X)."""
    if isinstance(annotation, type) and issubclass(annotation, Settings):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _model_at(model: type[Settings], data: Any, loc: list) -> type[Settings] | None:
    """The model class of the node at ``loc`` (a union of models is resolved by the data's ``source``)."""
    node, candidates = data, [model]
    for part in loc:
        if isinstance(part, int):  # an item of a list of models
            node = node[part] if isinstance(node, list) and part < len(node) else None
        else:
            field = model.model_fields.get(part) if model else None
            node = node.get(part) if isinstance(node, dict) else None
            candidates = _models_in(field.annotation) if field else []
        model = _pick(candidates, node)
    return model


def _pick(candidates: list[type[Settings]], node: Any) -> type[Settings] | None:
    if len(candidates) > 1 and isinstance(node, dict):
        for c in candidates:
            src = c.model_fields.get("source")
            if src is not None and typing.get_args(src.annotation) == (node.get("source"),):
                return c
    return candidates[0] if candidates else None


def _field_at(model: type[Settings], data: Any, loc: list):
    """The declaration of the last key in ``loc`` (list indices after it are items of that field)."""
    keys = [i for i, p in enumerate(loc) if not isinstance(p, int)]
    if not keys:
        return None
    parent = _model_at(model, data, loc[: keys[-1]])
    return parent.model_fields.get(loc[keys[-1]]) if parent else None


# --------------------------------------------------------------------------------------- description

_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def bounds(metadata) -> dict[str, float]:
    """``{'ge': 1, ...}``: the numeric bounds in a field's (or an ``Annotated`` type's) metadata."""
    found = {}
    for meta in metadata:
        for name in _BOUNDS:
            if getattr(meta, name, None) is not None:
                found[name] = getattr(meta, name)
    return found


def _bounded(text: str, b: dict) -> str:
    """``text`` with its bounds: ``an integer >= 1``, ``a number in (0, 1]`` (``or null`` stays last)."""
    core, null = (text.removesuffix(" or null"), " or null") if text.endswith(" or null") else (text, "")
    if {"ge", "gt"} & b.keys() and {"le", "lt"} & b.keys():
        lo = f"[{b['ge']}" if "ge" in b else f"({b['gt']}"
        hi = f"{b['le']}]" if "le" in b else f"{b['lt']})"
        return f"{core} in {lo}, {hi}{null}"
    if b:
        (name, value), = b.items()
        return f"{core} {_BOUNDS[name]} {value}{null}"
    return text


def describe_type(field) -> str:
    """What a field takes, in words: ``an integer >= 1``, ``a number in (0, 1]``, ``one of: top1, teacher``."""
    text = _bounded(_describe(field.annotation), bounds(field.metadata))
    pattern = next((m.pattern for m in field.metadata if getattr(m, "pattern", None)), None)
    lengths = next((m.min_length for m in field.metadata if getattr(m, "min_length", None)), None)
    if lengths:
        text = text.replace("a string", "a non-empty string", 1) if text.startswith("a string") else \
            f"{text} (at least {lengths} item{'s' if lengths > 1 else ''})"
    return text + (f" matching {pattern}" if pattern else "")


def _describe(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if all(_models_in(a) for a in rest):
            return "a group of settings"
        text = " or ".join(_describe(a) for a in rest)
        return text + " or null" if len(rest) < len(args) else text
    if origin is list:
        inner = _describe(args[0]) if args else ""
        if inner.startswith("one of: "):
            return f"a list drawn from: {inner.removeprefix('one of: ')}"
        return f"a list of {_plural(inner)}" if args else "a list"
    if origin is dict:
        return "a mapping"
    if origin is typing.Annotated:
        return _bounded(_describe(args[0]), bounds(args[1:]))
    if isinstance(annotation, type) and issubclass(annotation, Settings):
        return "a group of settings"
    return _NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _plural(text: str) -> str:
    for a in ("an ", "a "):
        if text.startswith(a):
            word, _, rest = text[len(a):].partition(" ")
            return f"{word}s {rest}".strip()
    return text


def listed(model: type[Settings]) -> dict:
    """``model``'s fields in the order people read them: as declared, less those declared
    ``json_schema_extra={"listed": "last"}`` (every method's ``by_batch``, declared on their common base), which follow
    the node's own."""
    fields = model.model_fields
    last = [n for n, f in fields.items() if (f.json_schema_extra or {}).get("listed") == "last"]
    return {n: fields[n] for n in [*(n for n in fields if n not in last), *last]}


def rows(settings: Settings, prefix: str = "", nested: bool = False) -> list[dict]:
    """Every leaf setting of a validated node: ``{key, type, value, meaning}`` (what ``show`` prints), less the fields
    declared with ``json_schema_extra={"shown": False}`` (a method's name, which ``method=<name>`` sets), and, in a
    node nested in another (``nested``), those declared ``{"nested": False}`` (read from the outermost node only)."""
    out = []
    for name, field in listed(type(settings)).items():
        extra = field.json_schema_extra or {}
        if extra.get("shown") is False or (nested and extra.get("nested") is False):
            continue
        value = getattr(settings, name)
        key = f"{prefix}{name}"
        if isinstance(value, Settings):
            out += rows(value, f"{key}.", nested=True)
        elif isinstance(value, list) and value and all(isinstance(v, Settings) for v in value):
            for i, v in enumerate(value):
                out += rows(v, f"{key}.{i}.", nested=True)
        else:
            out.append({"key": key, "type": describe_type(field), "value": value, "meaning": field.description or ""})
    return out


def as_config(settings: Settings):
    """A validated node as the ``DictConfig`` the rest of the harness reads (plain JSON-able values)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(settings.model_dump(mode="json"))
