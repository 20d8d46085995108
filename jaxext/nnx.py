"""Flax NNX layers built on jaxext's custom-VJP ops.

``jaxext.nnx.Linear`` is a drop-in for ``flax.nnx.Linear``; ``MulConstant``
scales by a constant; ``uniform_range`` is a ``[low, high)`` initializer.
"""

from ._layers import uniform_range as uniform_range
from ._nnx import Linear as Linear
from ._nnx import MulConstant as MulConstant

__all__ = ["Linear", "MulConstant", "uniform_range"]
