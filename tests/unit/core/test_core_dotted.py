"""`relayrl.core.dotted.import_object`, the one way relayrl imports an object by dotted path:
the object, a nested attribute, a required base class, and one ValueError form naming what
was asked for, the path and what is wrong."""

from __future__ import annotations

import collections
import os.path

import pytest

from relayrl.core.dotted import import_object


def test_a_path_gives_the_object_and_nested_attributes() -> None:
    assert import_object("os.path:join") is os.path.join
    assert import_object("collections:OrderedDict.fromkeys") == collections.OrderedDict.fromkeys


def test_a_required_base_class_is_checked() -> None:
    assert import_object("collections:OrderedDict", subclass_of=dict) is collections.OrderedDict


@pytest.mark.parametrize(
    ("path", "base", "message"),
    [
        ("os.path.join", None, "tool path 'os.path.join' is not of the form package.module:"),
        (":join", None, "is not of the form package.module:Attribute"),
        ("os.path:", None, "is not of the form package.module:Attribute"),
        (
            "relayrl.no_such_module_xyz:f",
            None,
            "tool 'relayrl.no_such_module_xyz:f': cannot import module "
            "'relayrl.no_such_module_xyz': No module named",
        ),
        ("os.path:nope.deeper", None, "tool 'os.path:nope.deeper': os.path has no attribute"),
        ("os.path:join", dict, "tool 'os.path:join' is not a subclass of dict"),
        ("collections:OrderedDict", int, "is not a subclass of int"),
    ],
)
def test_every_failure_is_one_value_error_naming_the_path(
    path: str, base: type | None, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        import_object(path, "tool", subclass_of=base)
    assert message in str(raised.value)
