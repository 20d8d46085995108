"""jaxext: PyTorch's "Extending PyTorch" toolkit, done the JAX way.

``custom_vjp``, a drop-in for ``jax.custom_vjp`` that adds forward mode (``jvp``,
``jacfwd``, ``hessian``) derived from the hand-written backward; ops built on it
(``linear``, ``mul_constant``, and ``rms_norm`` with Pallas kernels); ``gradcheck``,
``gradgradcheck`` and ``opcheck`` with PyTorch-style diagnostics; Flax NNX and Linen
layers on the ops; ``Function`` for porting ``torch.autograd.Function`` code; and
``cpp_extension`` for C++ (XLA FFI) kernels compiled at first use.
"""

# The op-writing API first: the ops below are built on it (`from jaxext import ...`).
from . import _custom_vjp, _eager_cache
from ._custom_vjp import custom_vjp as custom_vjp
from ._grad_type import grad_type as grad_type
from ._rule_contracts import RuleTypeError as RuleTypeError
from ._rule_contracts import RuleValueError as RuleValueError
from ._validation import check_array as check_array

# isort: split
from ._checks import CHECK_NAMES as CHECK_NAMES
from ._checks import CheckResult as CheckResult
from ._checks import GradcheckError as GradcheckError
from ._checks import GradcheckUnresolvedWarning as GradcheckUnresolvedWarning
from ._checks import OpcheckError as OpcheckError
from ._checks import OpcheckReport as OpcheckReport
from ._checks import gradcheck as gradcheck
from ._checks import gradgradcheck as gradgradcheck
from ._checks import opcheck as opcheck
from ._function import Function as Function
from ._function import FunctionCtx as FunctionCtx
from ._function import VmapInfo as VmapInfo
from ._function import once_differentiable as once_differentiable
from ._linear import linear as linear
from ._mul_constant import mul_constant as mul_constant
from ._rms_norm import rms_norm as rms_norm
from ._torch_interop import export_torch_linear as export_torch_linear
from ._torch_interop import load_torch_linear as load_torch_linear
from ._torch_interop import torch_linear_to_params as torch_linear_to_params

# Eager calls take the steps that reuse eager work (the core runs every step as written;
# `_custom_vjp.STEPS = _custom_vjp.Steps()` turns the caches off).
_custom_vjp.STEPS = _eager_cache.CachedSteps()

__version__ = "0.2.0"

# Flax layer namespaces and C++ extensions load lazily: `import jaxext` imports neither flax
# nor anything of the C++ machinery.
_LAZY_SUBMODULES = ("nnx", "linen", "cpp_extension")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
