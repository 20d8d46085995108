"""Flax NNX layers built on jaxext's custom-VJP ops.

``jaxext.nnx.Linear`` is a drop-in for ``flax.nnx.Linear``; ``MulConstant``
scales by a constant; ``RMSNorm`` is a drop-in for Flax's whose kernels are in Pallas;
``uniform_range`` is a ``[low, high)`` initializer.
"""

from ._layers import uniform_range as uniform_range
from ._nnx import Linear as Linear
from ._nnx import MulConstant as MulConstant
from ._nnx import RMSNorm as RMSNorm

__all__ = ["Linear", "MulConstant", "RMSNorm", "uniform_range"]
