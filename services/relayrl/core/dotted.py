"""Importing operator-configured plug-ins by dotted path (`package.module:Attribute`): the one
way relayrl imports an object by name (plug-ins, transports, the services' entry points).

Only ever called on paths from an operator's config file or relayrl's own code, never on
anything a remote caller sends: services pick plug-ins by configured name, so no request can
make them import code."""

from __future__ import annotations

import importlib
from typing import Any, TypeVar, overload

T = TypeVar("T")

DOTTED_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*$"
"""The form of a plug-in path, for config fields that take one."""


@overload
def import_object(path: str, what: str = ..., *, subclass_of: None = None) -> Any: ...


@overload
def import_object(path: str, what: str = ..., *, subclass_of: type[T]) -> type[T]: ...


def import_object(path: str, what: str = "plug-in", *, subclass_of: type | None = None) -> Any:
    """`package.module:attribute` (the attribute may be dotted) -> the object; with
    `subclass_of`, it must be a class derived from that one. ValueError naming `what`, the path
    and what is wrong otherwise."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"{what} path {path!r} is not of the form package.module:Attribute")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {exc}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(
                f"{what} {path!r}: {module_name} has no attribute {attribute!r}"
            ) from None
    if subclass_of is not None and not (
        isinstance(target, type) and issubclass(target, subclass_of)
    ):
        raise ValueError(f"{what} {path!r} is not a subclass of {subclass_of.__name__}")
    return target
