"""Test-session set-up: eight forced host devices for the sharding tests, F32-exact matmuls."""

import os

# Must be set before JAX initialises its backends; tests only, never library code.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax

jax.config.update("jax_default_matmul_precision", "highest")
