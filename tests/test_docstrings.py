"""Every docstring example in the package runs (doctest), on the 8 fake devices."""

import doctest
import importlib
import pkgutil

import pytest

import trainkit

MODULES = sorted(m.name for m in pkgutil.walk_packages(trainkit.__path__, prefix="trainkit."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failures in {name}"
