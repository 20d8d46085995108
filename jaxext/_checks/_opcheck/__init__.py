"""The rows of ``jaxext.opcheck``, one module per family, and the order they run in.

Each check takes the op under test and the settings, and returns a short detail for
the report, raises ``Skip`` with the reason it does not apply, or raises
``CheckFailed`` with the diagnostic. Comparisons of two programs that compute
the same math (jit against eager, vmap against a loop, checkpointed against plain ...)
use ``op.rtol``, a normwise relative tolerance from the dtypes the op computes in
(``_dtype_tolerance``): for an op computing in float64 only, ``TIGHT`` (1e-9), far
above float64 rounding and far below any bug; for a float32 kernel, 1e-5.

The checks are grouped by family: ``kernels`` (C++ kernels' unwritten results),
``first_order``, ``linearity`` (the backward linear in its cotangent), ``second_order``,
``transforms`` (jit, vmap, checkpoint), ``export``, ``precision`` (lower-precision
runs) and ``platforms`` (lowering for each platform);
``_common`` holds what several families share. The order they run in lives here, in
``CHECKS`` and ``ALL_CHECKS``, and nowhere else: cheap structural checks first, then
derivatives, transformations, export, lower precision and, last, the platform rows.
The entry point, ``opcheck``, is in ``_entry``.
"""

from collections.abc import Callable

from .._settings import Settings
from ._op import OpUnderTest
from .export import export, export_symbolic
from .first_order import (
    forward_rule,
    grad_dtypes,
    gradcheck,
    jvp,
    jvp_vjp,
    reentrancy,
    zero_cotangent,
)
from .kernels import unwritten_outputs
from .linearity import linearity
from .platforms import PLATFORM_CHECKS
from .precision import low_precision
from .second_order import fwd_over_fwd, fwd_over_rev, gradgradcheck, rev_over_fwd
from .transforms import checkpoint, jit, jit_reuse, vmap

__all__ = ["ALL_CHECKS", "CHECKS", "CHECK_NAMES"]

# The checks of the op's own computations, in the order they run (a check that raises
# is rerun on the op's plain twin, `_plain.jax_limit`, to tell JAX's limit from a bug).
CHECKS: dict[str, Callable[[OpUnderTest, Settings], str]] = {
    "unwritten_outputs": unwritten_outputs,
    "forward_rule": forward_rule,
    "grad_dtypes": grad_dtypes,
    "zero_cotangent": zero_cotangent,
    "linearity": linearity,
    "reentrancy": reentrancy,
    "gradcheck": gradcheck,
    "gradgradcheck": gradgradcheck,
    "jvp": jvp,
    "jvp_vjp": jvp_vjp,
    "fwd_over_rev": fwd_over_rev,
    "rev_over_fwd": rev_over_fwd,
    "fwd_over_fwd": fwd_over_fwd,
    "jit": jit,
    "jit_reuse": jit_reuse,
    "vmap": vmap,
    "checkpoint": checkpoint,
    "export": export,
    "export_symbolic": export_symbolic,
    "low_precision": low_precision,
}
# Every row, in run order: the checks above, then one per platform (`platform_cpu`, ...).
ALL_CHECKS: dict[str, Callable[[OpUnderTest, Settings], str]] = {**CHECKS, **PLATFORM_CHECKS}
CHECK_NAMES: tuple[str, ...] = tuple(ALL_CHECKS)
