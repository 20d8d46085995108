"""Checking custom ops: ``gradcheck`` / ``gradgradcheck`` and ``opcheck``.

One idea per module; data flows down this list:

* ``_precision``: float64 numerics on any backend.
* ``_leaves``: the caller's function as a function of its float array leaves
  (which are checked, how messages name them), for both entry points.
* ``_problem``: the caller's function and pytrees as a flat ``R^n -> R^m``.
* ``_jacobians``: numerical and automatic Jacobians, a chunk at a time (the reference
  path: plain ``jax.jit`` programs).
* ``_chunks``: where the full method's chunks come from (``ChunkSource``), and the
  reference path's source.
* ``_compare``: the entrywise comparison, block by block, into ``Mismatch`` records
  (one worst-entry scan for every check; ``full_mismatches``, the one skeleton of the
  full method, whatever the engine).
* ``_engines``: which engine runs a check (``choose``, the one reader of the
  thresholds that pick it), and the engines that only make it faster: ``_quick``
  (programs compiled quickly, ahead of their first use, merged for small problems)
  and ``_screened`` (large problems' chunks screened on the device, by worker
  threads, before the host comparison).
* ``_backward``: the checks of a backward both entry points run (zero cotangent,
  reentrancy, batched gradients, gradient dtypes), each once, with its tolerance rule.
* ``_gradcheck_report``: ``GradcheckError`` and its message.
* ``_settings``: the validated settings (``Settings``, ``as_args``).
* ``_gradients``: the gradient core (``check_gradients``), which ``gradcheck``,
  ``gradgradcheck`` and opcheck's gradient rows run.
* ``_gradcheck``: the ``gradcheck`` / ``gradgradcheck`` entry points.
* ``_opcheck``: ``opcheck``: the op under test (``_op``), its plain twin (``_plain``),
  the hook into ``jaxext.cpp_extension`` (``_kernels``), the rows by family
  (``kernels``, ``first_order``, ``second_order``, ``transforms``, ``export``,
  ``precision``, ``platforms``; shared helpers in ``_common``), the run order (its
  ``__init__``: ``CHECKS``, ``CHECK_NAMES``), the report (``_report``) and the entry
  point (``_entry``).
"""

from ._gradcheck import GradcheckError as GradcheckError
from ._gradcheck import GradcheckUnresolvedWarning as GradcheckUnresolvedWarning
from ._gradcheck import gradcheck as gradcheck
from ._gradcheck import gradgradcheck as gradgradcheck
from ._opcheck import CHECK_NAMES as CHECK_NAMES
from ._opcheck._entry import opcheck as opcheck
from ._opcheck._report import CheckResult as CheckResult
from ._opcheck._report import OpcheckError as OpcheckError
from ._opcheck._report import OpcheckReport as OpcheckReport
