"""The package's public surface: every public module path imports as a module (``import a.b.c
as m`` gives the module, not a function re-exported under its name), and no package attribute
shadows one of its submodules."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import mtpjax
import pallas_kernels


def _modules(*, public: bool) -> list[str]:
    names = ["mtpjax", "pallas_kernels"]
    for package in (mtpjax, pallas_kernels):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not public or not any(part.startswith("_") for part in info.name.split(".")):
                names.append(info.name)
    return names


@pytest.mark.parametrize("name", _modules(public=True))
def test_import_as_gives_the_module(name):
    module = importlib.import_module(name)
    namespace: dict = {}
    exec(f"import {name} as m", namespace)  # the statement's own attribute walk
    assert isinstance(namespace["m"], types.ModuleType), f"import {name} as m gave {namespace['m']}"
    assert namespace["m"] is module


_PACKAGES = [
    name for name in _modules(public=False) if hasattr(importlib.import_module(name), "__path__")
]


@pytest.mark.parametrize("name", _PACKAGES)
def test_no_package_attribute_shadows_a_submodule(name):
    package = importlib.import_module(name)
    for info in pkgutil.iter_modules(package.__path__):
        submodule = importlib.import_module(f"{name}.{info.name}")
        attribute = getattr(package, info.name)
        assert attribute is submodule, f"{name}.{info.name} is {attribute!r}, not the submodule"


def test_verify_surface():
    """The verify step, the accept function and the metrics live where the docs say."""
    import mtpjax.verify.accept as accept_module
    import mtpjax.verify.metrics as metrics_module

    assert mtpjax.verify is importlib.import_module("mtpjax.verify")
    assert mtpjax.accept is accept_module.accept is mtpjax.verify.accept.accept
    assert mtpjax.verify.metrics is metrics_module
    assert mtpjax.SpecDecodeMetrics is metrics_module.SpecDecodeMetrics
    assert callable(mtpjax.verify.verify) and mtpjax.VerifyOutput is mtpjax.verify.VerifyOutput
    assert not hasattr(mtpjax.verify, "step")
