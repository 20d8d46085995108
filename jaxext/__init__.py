"""jaxext: PyTorch's "Extending PyTorch" toolkit, done the JAX way.

Custom differentiable ops written as ``jax.custom_vjp`` functions, a gradient
checker with PyTorch-style diagnostics, Flax layers built on the ops, and a
``Function`` class for porting ``torch.autograd.Function`` code.
"""

from ._linear import linear as linear
from ._mul_constant import mul_constant as mul_constant

__version__ = "0.1.0"
