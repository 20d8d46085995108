"""The hook into ``jaxext.cpp_extension``: its kernels in an op, checking mode, export.

``opcheck`` does not import ``jaxext.cpp_extension`` (that would load it for every
op): if it is not imported, no extension is loaded and no op can call one of its
kernels. When it is, opcheck runs its checks in its checking mode (kernels' result
buffers filled with NaN before they run), finds which of its FFI targets an op
calls, and lets ``jax.export`` serialize calls to them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax

from ..._jaxpr import inner_jaxprs

__all__ = ["checking_mode", "disabled_safety_checks", "kernel_targets", "target_platforms"]


def _module(name: str) -> Any:
    return sys.modules.get(f"jaxext.cpp_extension.{name}")


def registered_targets() -> set[str]:
    """The FFI targets of the extensions loaded in this process."""
    registry = _module("_registry")
    return set(registry.registered_targets()) if registry is not None else set()


def target_platforms() -> dict[str, set[str]]:
    """``{FFI target: the platforms it has handlers for}`` (``"cpu"``, ``"cuda"``) of the
    loaded extensions."""
    registry = _module("_registry")
    return registry.target_platforms() if registry is not None else {}


@contextlib.contextmanager
def checking_mode(enabled: bool = True) -> Iterator[None]:
    """``jaxext.cpp_extension.checking()`` when enabled and the extension is imported."""
    native = _module("_native")
    if native is None or not enabled:
        yield
        return
    with native.checking():
        yield


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Checking mode off inside (also within an enclosing ``checking()`` block)."""
    native = _module("_native")
    if native is None:
        yield
        return
    with native.suspended():
        yield


def disabled_safety_checks() -> list[Any]:
    """``jax.export.DisabledSafetyCheck.custom_call`` for each loaded extension's target."""
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in sorted(registered_targets())]


def kernel_targets(fn: Callable, *args: Any) -> list[str]:
    """The loaded extensions' FFI targets that ``fn(*args)`` calls, in order of appearance."""
    registered = registered_targets()
    if not registered:
        return []
    found: dict[str, None] = {}

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            target = eqn.params.get("target_name") if eqn.primitive.name == "ffi_call" else None
            if isinstance(target, str) and target in registered:
                found[target.removesuffix(".raw")] = None
            for body in inner_jaxprs(eqn):
                walk(body.jaxpr)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return list(found)
