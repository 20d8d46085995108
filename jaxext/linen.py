"""Flax Linen layers built on jaxext's custom-VJP ops.

``jaxext.linen.Dense`` is a drop-in for ``flax.linen.Dense``; ``MulConstant``
scales by a constant; ``RMSNorm`` is a drop-in for Flax's whose kernels are in Pallas;
``uniform_range`` is a ``[low, high)`` initializer.
"""

from ._layers import uniform_range as uniform_range
from ._linen import Dense as Dense
from ._linen import MulConstant as MulConstant
from ._linen import RMSNorm as RMSNorm

__all__ = ["Dense", "MulConstant", "RMSNorm", "uniform_range"]
