"""varbench._util.imports: ``MODULE:ATTR`` references, imported only when named."""

from __future__ import annotations

import os.path

import pytest

from varbench._util.checks import UsageError
from varbench._util.imports import import_object, is_reference
from varbench.report.result import Headline


def test_reference_form():
    for good in ("os:path", "os.path:join", "mypkg.adv:fn", "_x:Y.z", "a:b.c.d"):
        assert is_reference(good), good
    for bad in ("os", "os:", ":fn", "os::fn", "1os:fn", "os:1fn", "os:fn()", "os: fn",
                "os.path:join:x", None, 3, "a-b:c"):
        assert not is_reference(bad), bad


def test_import_object_good_references_and_dotted_attributes():
    assert import_object("os.path:join") is os.path.join
    assert import_object("os:path.join") is os.path.join  # dotted ATTR walks attributes
    assert import_object("varbench.report.result:Headline.to_dict") is Headline.to_dict
    assert import_object("_fixtures_testing:not_a_function") == 3  # any object, not only code


def test_import_object_bad_references_name_what_and_why():
    with pytest.raises(UsageError, match=r"estimator='os\.path' is not valid; expected "
                                         r"MODULE:ATTR"):
        import_object("os.path", what="estimator")
    with pytest.raises(UsageError, match=r"reference='no_such_module_xyz:fn': cannot import "
                                         r"module 'no_such_module_xyz'") as err:
        import_object("no_such_module_xyz:fn")
    # the ImportError stays the context (callers name the missing module from it)
    assert isinstance(err.value.__context__, ModuleNotFoundError)
    assert err.value.__context__.name == "no_such_module_xyz"
    with pytest.raises(UsageError, match=r"module 'os' has no attribute 'nope'"):
        import_object("os:nope")
    with pytest.raises(UsageError, match=r"module 'os' has no attribute 'path\.nope'"):
        import_object("os:path.nope")
