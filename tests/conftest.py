"""Test-session set-up: eight forced host devices for the sharding tests, F32-exact matmuls, and
the ``gpu`` marker (tests that only make sense on a GPU; they skip elsewhere)."""

import os

# Must be set before JAX initialises its backends; tests only, never library code.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU (run there with `pytest -m gpu`)")


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
