"""Checking custom ops: ``gradcheck`` / ``gradgradcheck`` and ``opcheck``.

One idea per module; data flows down this list:

* ``_precision``: float64 numerics on any backend.
* ``_problem``: the caller's function and pytrees as a flat ``R^n -> R^m``.
* ``_jacobians``: numerical and automatic Jacobians, a chunk at a time.
* ``_compare``: the entrywise comparison, block by block, into ``Mismatch`` records.
* ``_report``: ``GradcheckError`` and its message.
* ``_gradcheck``: the ``gradcheck`` / ``gradgradcheck`` entry points.
"""

from ._gradcheck import GradcheckError as GradcheckError
from ._gradcheck import gradcheck as gradcheck
from ._gradcheck import gradgradcheck as gradgradcheck
