"""Checking custom ops: ``gradcheck`` / ``gradgradcheck`` and ``opcheck``.

One idea per module; data flows down this list:

* ``_precision``: float64 numerics on any backend.
* ``_leaves``: the caller's function as a function of its float array leaves
  (which are checked, how messages name them), for both entry points.
* ``_problem``: the caller's function and pytrees as a flat ``R^n -> R^m``.
* ``_jacobians``: numerical and automatic Jacobians, a chunk at a time (the reference
  path: plain ``jax.jit`` programs).
* ``_compare``: the entrywise comparison, block by block, into ``Mismatch`` records
  (one worst-entry scan for every check; the reference path of the full method).
* ``_quick``: the quick engine: programs compiled quickly (XLA's CPU optimisations
  off for little work), ahead of their first use, merged for small problems.
* ``_screened``: the screened engine: large problems' chunks screened on the device,
  by worker threads, before the host comparison.
* ``_engine``: which engine runs a check (``choose``, the one reader of the
  thresholds that pick it).
* ``_backward``: the checks of a backward both entry points run (zero cotangent,
  reentrancy, batched gradients, gradient dtypes), each once, with its tolerance rule.
* ``_gradcheck_report``: ``GradcheckError`` and its message.
* ``_gradcheck``: the ``gradcheck`` / ``gradgradcheck`` entry points.
* ``_op``: the op under test, as a function of its float array leaves.
* ``_kernels``: the hook into ``jaxext.cpp_extension`` (its kernels in an op,
  checking mode, exporting their calls).
* ``_battery``: the checks of ``opcheck``, one function each.
* ``_opcheck_report``: ``CheckResult``, ``OpcheckReport``, ``OpcheckError``.
* ``_opcheck``: the ``opcheck`` entry point.
"""

from ._gradcheck import GradcheckError as GradcheckError
from ._gradcheck import GradcheckUnresolvedWarning as GradcheckUnresolvedWarning
from ._gradcheck import gradcheck as gradcheck
from ._gradcheck import gradgradcheck as gradgradcheck
from ._opcheck import CHECK_NAMES as CHECK_NAMES
from ._opcheck import opcheck as opcheck
from ._opcheck_report import CheckResult as CheckResult
from ._opcheck_report import OpcheckError as OpcheckError
from ._opcheck_report import OpcheckReport as OpcheckReport
