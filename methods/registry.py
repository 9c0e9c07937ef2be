"""Method registry: ``@register("name")`` on a class in ``methods/`` (or a family's sub-package, e.g.
``methods/heads/``); an unknown name lists the known ones."""

from __future__ import annotations

import importlib
import pkgutil

from core.errors import BenchError

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
    """Import every module of the ``methods`` package and its family sub-packages once, so their ``@register``
    lines run. Modules whose name starts with an underscore are a family's internals, imported by its members."""
    import methods

    for info in pkgutil.walk_packages(methods.__path__, "methods."):
        if not info.name.rpartition(".")[2].startswith("_") and info.name != __name__:
            importlib.import_module(info.name)


def known_methods() -> list[str]:
    _discover()
    return sorted(_METHODS)


def get_method(name: str) -> type:
    _discover()
    if name not in _METHODS:
        raise BenchError(f"unknown method '{name}'; choose one of: {', '.join(sorted(_METHODS))}.")
    return _METHODS[name]
