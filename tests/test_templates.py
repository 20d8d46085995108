"""The op modules are templates for users' ops: they import only jaxext's public names.

``jaxext/_linear.py``, ``jaxext/_mul_constant.py`` and ``jaxext/cpp_extension/_ops.py``
are built on the public op-writing API like any user's op, so a user can copy one
as a starting point. A private import (``from .._validation import ...``) would
break that copy.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ["jaxext/_linear.py", "jaxext/_mul_constant.py", "jaxext/cpp_extension/_ops.py"]


def _private_imports(source: str) -> list[str]:
    """The imports of jaxext names that a user's copy could not make."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [alias.name for alias in node.names]
            if node.level:
                found.append(f"from {'.' * node.level}{module} import {', '.join(names)}")
            elif module.split(".")[0] == "jaxext" and (
                any(part.startswith("_") for part in module.split("."))
                or any(name.startswith("_") for name in names)
            ):
                found.append(f"from {module} import {', '.join(names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "jaxext" and any(p.startswith("_") for p in parts):
                    found.append(f"import {alias.name}")
    return found


@pytest.mark.parametrize("path", TEMPLATES)
def test_template_imports_only_public_names(path):
    assert _private_imports((ROOT / path).read_text()) == []


@pytest.mark.parametrize(
    "source, bad",
    [
        ("from .._validation import is_static_scalar", True),
        ("from jaxext._custom_vjp import custom_vjp", True),
        ("from jaxext import _linear", True),
        ("import jaxext._checks", True),
        ("from jaxext import check_array, custom_vjp", False),
        ("from jaxext.cpp_extension import Extension, load", False),
        ("from jax._src import core", False),  # not jaxext's business here
    ],
)
def test_the_rule_itself(source, bad):
    assert bool(_private_imports(source)) is bad
