"""Shared pytest fixtures.

float64 is off by default in JAX; tests that need it ask for the ``x64`` fixture
instead of flipping the flag for the whole session, so the library is also
exercised under the default (float32) configuration.
"""

import jax
import pytest


@pytest.fixture
def x64():
    """Enables ``jax_enable_x64`` for the duration of one test."""
    with jax.enable_x64(True):
        yield


# Run by test_sharding.py in a subprocess with 8 CPU devices; never import it here.
# Nor _libraries_worker.py (test_libraries.py's): it replaces jax.custom_vjp on import.
collect_ignore = ["_sharding_worker.py", "_libraries_worker.py"]
