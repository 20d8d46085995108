"""jaxext's ops with C++ kernels: ``jaxext/csrc/jaxext_ops.cc`` loaded and given gradients.

This module is also the template for your own kernels (it imports only public names).
It is in five steps:

1. build the handlers with the public :func:`~jaxext.cpp_extension.load`, at the
   first call (not at import);
2. call each handler through ``ffi_call`` with its result shapes and a
   ``vmap_method`` (here ``"expand_dims"``: the handlers broadcast over leading
   batch axes);
3. say how each handler splits over a device mesh (``load``'s ``partition``): on
   a batch-sharded input every device runs the kernels on its rows, and the
   weight gradients are summed across devices;
4. attach the C++ backward with :class:`jaxext.custom_vjp`, and a ``jvp=`` rule
   made of the C++ forward (both ops are linear in each input), because JAX can
   neither differentiate nor transpose an FFI call: ``grad`` runs the C++
   backward, ``jvp``/``jacfwd`` the ``jvp`` rule. The C++ backward is itself a
   ``custom_vjp`` op whose rules call the C++ forward again, and every rule calls
   these ops rather than a bare FFI call, so derivatives of every order work.
   (An array ``constant`` of ``mul_constant`` gets its gradient ``sum(g * x)``
   from ``jnp``.)
5. refuse, with a ``TypeError`` while tracing, the dtypes the kernels have no
   handler for: ``jaxext.opcheck`` reports such a dtype as a SKIP with that message.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxext import check_array, custom_vjp
from jaxext.cpp_extension import Extension, load

__all__ = ["SOURCE", "extension", "linear", "mul_constant"]

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "jaxext_ops.cc"
"""The C++ source of the kernels, shipped in the package (``jaxext/csrc/jaxext_ops.cc``)."""
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# How each kernel splits over a device mesh (the `partition` of load):
# on a batch-sharded x every device runs the kernels on its rows only. A result that
# lacks a split dimension is summed over it (psum): the weight and bias gradients over
# the rows `b` (over the data axis, as autodiff reduces them), grad_x over `o` when w is
# split by rows. The features `_` are never split: the forward adds the bias once, and
# grad_bias does not depend on them, so a sum over their shards would be wrong.
_ELEMENTWISE = "... -> ..."
_MUL_CONSTANT = "..., -> ..."  # x, its 0-d constant (on every device) -> x * constant
_LINEAR = "b _, o _, o -> b o"  # y = x @ w.T + bias
_LINEAR_BWD = "b _, o _, b o -> b _, o _, o"  # grad_x, grad_w, grad_bias from (x, w, g)


@functools.cache
def extension() -> Extension:
    """The compiled ``jaxext_ops`` extension (built at the first call, then cached).

    Returns:
        The :class:`~jaxext.cpp_extension.Extension` with the handlers
        ``jaxext_mul_constant``, ``jaxext_linear_forward`` and ``jaxext_linear_backward``,
        each with its ``partition`` rule (on a batch-sharded input, every device runs
        the kernels on its own rows).
    """
    return load(
        "jaxext_ops",
        [SOURCE],
        partition={
            "jaxext_mul_constant": _MUL_CONSTANT,
            "jaxext_linear_forward": _LINEAR,
            "jaxext_linear_backward": _LINEAR_BWD,
        },
    )


def mul_constant(x: ArrayLike, constant: float | ArrayLike) -> jax.Array:
    """``x * constant`` computed by a C++ kernel, with a C++ backward.

    Args:
        x: float32 or float64 array of any shape.
        constant: a Python or NumPy real scalar (not differentiated), or a 0-d real
            array, traced or not (differentiable: it receives ``sum(g * x)``), so
            ``jax.jit(lambda x, c: ops.mul_constant(x, c))`` compiles once for every
            value of ``c``. Either way it reaches the kernel as a 0-d array of ``x``'s
            dtype (data, not part of the compiled program), so eager calls with new
            values reuse one compiled program.

    Returns:
        ``x * constant`` in ``x``'s dtype.

    Raises:
        TypeError: if ``x`` is not float32/float64 or ``constant`` is not a real scalar
            or a real array.
        ValueError: if ``constant`` is an array that is not 0-d.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext.cpp_extension import ops
        >>> ops.mul_constant(jnp.arange(3.0), 2.0)
        Array([0., 2., 4.], dtype=float32)
        >>> jax.grad(lambda x: ops.mul_constant(x, 3.0).sum())(jnp.ones(2))
        Array([3., 3.], dtype=float32)
        >>> jax.grad(lambda c: ops.mul_constant(jnp.arange(3.0), c).sum())(2.0)
        Array(3., dtype=float32, weak_type=True)
    """
    x = _float_array(x, "x")
    # The constant reaches the kernel as a 0-d operand of x's dtype (the kernel
    # multiplies in x's dtype), never as an FFI attribute: an attribute is compiled
    # into the program, so each new value would compile, and keep, a program of its own.
    if isinstance(constant, (bool, np.bool_)):
        pass  # refused below
    elif isinstance(constant, (int, float, np.integer, np.floating)):
        return _mul_constant(x, np.asarray(float(constant), x.dtype))
    elif isinstance(constant, (jax.Array, np.ndarray)):
        c = check_array(constant, "constant")
        real = jnp.issubdtype(c.dtype, jnp.integer) or jnp.issubdtype(c.dtype, jnp.floating)
        if not real:
            raise TypeError(f"`constant` must have a real dtype; got {c.dtype}.")
        if c.ndim != 0:
            raise ValueError(f"`constant` must be 0-d (a scalar); got shape {c.shape}.")
        return _mul_traced(x, c.astype(x.dtype))
    raise TypeError(
        "`constant` must be a Python or NumPy real scalar or a 0-d real array; "
        f"got {type(constant).__name__}."
    )


def linear(x: ArrayLike, weight: ArrayLike, bias: ArrayLike | None = None) -> jax.Array:
    """``x @ weight.T + bias`` computed by C++ kernels, forward and backward.

    Args:
        x: array of shape ``(..., in_features)``, float32 or float64.
        weight: array of shape ``(out_features, in_features)``, of ``x``'s dtype.
        bias: optional array of shape ``(out_features,)``, of ``x``'s dtype.

    Returns:
        Array of shape ``(..., out_features)``.

    Raises:
        TypeError: if the dtypes are not float32/float64 or differ.
        ValueError: if the shapes do not fit together.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxext.cpp_extension import ops
        >>> x, w, b = jnp.ones((4, 3)), jnp.ones((2, 3)), jnp.arange(2.0)
        >>> ops.linear(x, w, b)[0]
        Array([3., 4.], dtype=float32)
        >>> jax.grad(lambda w: ops.linear(x, w, b).sum())(w)
        Array([[4., 4., 4.],
               [4., 4., 4.]], dtype=float32)
    """
    x = _float_array(x, "x")
    weight = _float_array(weight, "weight")
    if bias is not None:
        bias = _float_array(bias, "bias")
    for arg, value in (("weight", weight), ("bias", bias)):
        if value is not None and value.dtype != x.dtype:
            raise TypeError(
                f"`{arg}` must have `x`'s dtype {x.dtype}; got {value.dtype} (cast explicitly)."
            )
    if weight.ndim != 2:
        raise ValueError(f"`weight` must be 2-D (out_features, in_features); got {weight.shape}.")
    out_features, in_features = weight.shape
    if x.ndim == 0 or x.shape[-1] != in_features:
        raise ValueError(
            f"`x` must have shape (..., {in_features}) to match `weight` {weight.shape}; "
            f"got {x.shape}."
        )
    if bias is None:
        bias = jnp.zeros((out_features,), x.dtype)
    elif bias.shape != (out_features,):
        raise ValueError(f"`bias` must have shape ({out_features},); got {bias.shape}.")
    batch = x.shape[:-1]
    rows = x.reshape(math.prod(batch), in_features)
    return _linear(rows, weight, bias).reshape(*batch, out_features)


def _float_array(value: Any, arg: str) -> jax.Array:
    array = check_array(value, arg)
    if array.dtype not in _DTYPES:
        raise TypeError(f"`{arg}` must be float32 or float64; got {array.dtype}.")
    return array


# -- the FFI calls ---------------------------------------------------------------------


def _call_mul_constant(x, constant):
    return extension().jaxext_mul_constant(
        x,
        constant,  # a 0-d array of x's dtype: an operand, not an attribute
        result_shape_dtypes=jax.ShapeDtypeStruct(x.shape, x.dtype),
        vmap_method="expand_dims",
    )


def _call_linear_forward(x, weight, bias):
    out = jax.ShapeDtypeStruct((x.shape[0], weight.shape[0]), x.dtype)
    return extension().jaxext_linear_forward(
        x, weight, bias, result_shape_dtypes=out, vmap_method="expand_dims"
    )


def _call_linear_backward(x, weight, g):
    shapes = (x, weight, jax.ShapeDtypeStruct(weight.shape[:1], weight.dtype))
    shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes]
    return extension().jaxext_linear_backward(
        x, weight, g, result_shape_dtypes=shapes, vmap_method="expand_dims"
    )


# -- the custom VJPs -------------------------------------------------------------------
#
# Every rule, the forward rules included, is made of these ops themselves (never of a
# bare FFI call, which an outer jvp could not differentiate), so each
# derivative is again differentiable: grad of grad, hessian, jacfwd of jacrev ... work
# to any order. Both ops are linear in each input, so their derivatives are calls of
# the same kernels with other arguments.


@custom_vjp
def _mul_constant(x, constant):
    # `constant` is an array argument (so eager calls with new values reuse one
    # program), built by mul_constant from a Python/NumPy scalar: never traced by
    # the caller, so it gets no gradient (None: zero).
    return _call_mul_constant(x, constant)


def _mul_constant_fwd(x, constant):
    return _mul_constant(x, constant), constant


def _mul_constant_bwd(constant, g):
    return _mul_constant(g, constant), None


def _mul_constant_jvp(constant, tangents):
    x_dot, _ = tangents
    return _mul_constant(x_dot, constant)


_mul_constant.defvjp(_mul_constant_fwd, _mul_constant_bwd, jvp=_mul_constant_jvp)


@custom_vjp
def _mul_traced(x, constant):
    # An array constant (a tracer under jit or grad): differentiable in both inputs.
    return _call_mul_constant(x, constant)


def _mul_traced_fwd(x, constant):
    return _mul_traced(x, constant), (x, constant)


def _mul_traced_bwd(residuals, g):
    # y = c x: grad_x = c g (the C++ kernel), grad_c = sum(g x) (a jnp reduction,
    # which XLA splits over a mesh itself), both differentiable again.
    x, constant = residuals
    return _mul_traced(g, constant), jnp.sum(g * x)


def _mul_traced_jvp(residuals, tangents):
    x, constant = residuals
    x_dot, constant_dot = tangents
    return _mul_traced(x_dot, constant) + _mul_traced(x, constant_dot)


_mul_traced.defvjp(_mul_traced_fwd, _mul_traced_bwd, jvp=_mul_traced_jvp)


def _matmul_t(a, b):
    """``a @ b.T`` (no bias) through the C++ forward: ``_linear(a, b, 0)``."""
    return _linear(a, b, jnp.zeros(b.shape[:1], a.dtype))


@custom_vjp
def _linear(x, weight, bias):
    return _call_linear_forward(x, weight, bias)


def _linear_fwd(x, weight, bias):
    return _linear(x, weight, bias), (x, weight)


def _linear_bwd(residuals, g):
    x, weight = residuals
    return _linear_backward(x, weight, g)  # the C++ backward, itself differentiable


def _linear_jvp(residuals, tangents):
    # y is bilinear in (x, weight) and affine in bias:
    # dy = dx @ w^T + x @ dw^T + db, two calls of the C++ forward.
    x, weight = residuals
    x_dot, weight_dot, bias_dot = tangents
    return _linear(x_dot, weight, bias_dot) + _matmul_t(x, weight_dot)


_linear.defvjp(_linear_fwd, _linear_bwd, jvp=_linear_jvp)


@custom_vjp
def _linear_backward(x, weight, g):
    """``(g @ w, g^T @ x, sum of g's rows)``: linear's gradients, by the C++ backward."""
    return tuple(_call_linear_backward(x, weight, g))


def _linear_backward_fwd(x, weight, g):
    return _linear_backward(x, weight, g), (x, weight, g)


def _linear_backward_bwd(residuals, cotangents):
    # The outputs are bilinear in (g, weight) and (g, x): with cotangents (cx, cw, cb),
    # x gets g @ cw, weight gets g^T @ cx, g gets cx @ w^T + x @ cw^T + cb.
    x, weight, g = residuals
    cx, cw, cb = cotangents
    return (
        _matmul_t(g, cw.T),
        _matmul_t(g.T, cx.T),
        _linear(cx, weight, cb) + _matmul_t(x, cw),
    )


def _linear_backward_jvp(residuals, tangents):
    x, weight, g = residuals
    x_dot, weight_dot, g_dot = tangents
    return (
        _matmul_t(g_dot, weight.T) + _matmul_t(g, weight_dot.T),
        _matmul_t(g_dot.T, x.T) + _matmul_t(g.T, x_dot.T),
        jnp.sum(g_dot, axis=0),
    )


_linear_backward.defvjp(_linear_backward_fwd, _linear_backward_bwd, jvp=_linear_backward_jvp)
