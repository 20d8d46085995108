"""Where and how the checks compute: float64, on a backend that has it.

Finite differences need float64. CPUs compute it exactly; GPUs too, except that
matmuls may drop to TF32 unless the precision is raised; TPUs (and backends we
do not know) may lack float64 altogether, so the checks move to the CPU backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax

__all__ = ["NumericsPlan", "float64_numerics", "numerics_plan"]


@dataclasses.dataclass(frozen=True)
class NumericsPlan:
    """How to run a float64 check on one backend."""

    use_cpu: bool
    matmul_precision: str | None


def numerics_plan(platform: str) -> NumericsPlan:
    """The plan for a backend ``platform`` name (``"cpu"``, ``"gpu"``, ``"tpu"`` ...).

    Example:
        >>> from jaxext._checks._precision import numerics_plan
        >>> numerics_plan("tpu")
        NumericsPlan(use_cpu=True, matmul_precision='highest')
    """
    platform = platform.lower()
    if platform == "cpu":
        return NumericsPlan(use_cpu=False, matmul_precision=None)
    if platform in ("gpu", "cuda", "rocm"):
        return NumericsPlan(use_cpu=False, matmul_precision="highest")
    return NumericsPlan(use_cpu=True, matmul_precision="highest")


@contextlib.contextmanager
def float64_numerics(platform: str | None = None) -> Iterator[NumericsPlan]:
    """Enables x64 (restoring the caller's setting on exit) and applies the plan.

    Args:
        platform: backend name; ``None`` means ``jax.default_backend()``.

    Yields:
        The plan applied.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext._checks._precision import float64_numerics
        >>> with float64_numerics():
        ...     print(jnp.zeros(1).dtype)
        float64
    """
    plan = numerics_plan(jax.default_backend() if platform is None else platform)
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.enable_x64(True))
        if plan.matmul_precision is not None:
            stack.enter_context(jax.default_matmul_precision(plan.matmul_precision))
        if plan.use_cpu:
            stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
        yield plan
