"""jaxext's ``mul_constant`` and ``linear`` with C++ kernels, forward and backward.

Built with :func:`jaxext.cpp_extension.load` from ``jaxext/csrc/jaxext_ops.cc``
at the first call (a few seconds, once per machine: the build is cached). A
template for your own kernels: see ``jaxext/cpp_extension/_ops.py``.
"""

from ._ops import SOURCE as SOURCE
from ._ops import extension as extension
from ._ops import linear as linear
from ._ops import mul_constant as mul_constant

__all__ = ["SOURCE", "extension", "linear", "mul_constant"]
