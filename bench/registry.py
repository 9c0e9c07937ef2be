"""Method registry: ``@register("name")`` on a class in ``methods/``; an unknown name lists the known ones."""

from __future__ import annotations

import importlib
import pkgutil

from bench.errors import BenchError

_METHODS: dict[str, type] = {}


def register(name: str):
    """Class decorator adding a decoding method under ``name``; a duplicate name is a bug and raises."""

    def wrap(cls):
        if name in _METHODS and _METHODS[name] is not cls:
            raise ValueError(f"method '{name}' is registered twice ({_METHODS[name].__module__}, {cls.__module__})")
        cls.name = name
        _METHODS[name] = cls
        return cls

    return wrap


def _discover() -> None:
    """Import every module of the ``methods`` package once, so their ``@register`` lines run."""
    import methods

    for info in pkgutil.iter_modules(methods.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"methods.{info.name}")


def known_methods() -> list[str]:
    _discover()
    return sorted(_METHODS)


def get_method(name: str) -> type:
    _discover()
    if name not in _METHODS:
        raise BenchError(f"unknown method '{name}'; choose one of: {', '.join(sorted(_METHODS))}.")
    return _METHODS[name]
