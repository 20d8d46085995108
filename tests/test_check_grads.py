"""``jax.test_util.check_grads`` as a baseline beside ``jaxext.gradcheck``.

JAX's own checker (order 2, reverse mode, float64) runs on every op and layer of
the library: ``jaxext.linear``, ``jaxext.mul_constant``, the porting guide's
``jaxext.Function`` ports, and the Flax layers as functions of their parameters
and inputs. ``jaxext.gradcheck`` and ``jaxext.gradgradcheck`` run on the very same
functions and arguments, so the two checkers are held to the same cases.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import rand
from jax.test_util import check_grads
from ops_table import OPS

import jaxext

F64 = np.float64


# Every entry point of every op (tests/ops_table.py), each as (function, float64 args).
CASES = [pytest.param(build, id=name) for op in OPS for name, build in op.float64_cases.items()]


@pytest.mark.parametrize("build", CASES)
def test_check_grads_order_2_reverse_mode(build, x64):
    f, args = build()
    assert all(leaf.dtype == F64 for leaf in jax.tree.leaves(args))
    check_grads(f, args, order=2, modes=["rev"])


@pytest.mark.parametrize("build", CASES)
def test_gradcheck_and_gradgradcheck_agree_with_the_baseline(build, x64):
    f, args = build()
    assert jaxext.gradcheck(f, args)
    assert jaxext.gradgradcheck(f, args)


# -- the baseline can fail ------------------------------------------------------------------


def _wrong_backward(scale_grad_w):
    class Linear(jaxext.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.T

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, scale_grad_w * (g.T @ x)

    return Linear.apply


def test_check_grads_rejects_a_wrong_backward(x64):
    # A weight gradient 1% off: both checkers must refuse it, check_grads included
    # (otherwise the baseline above would prove nothing).
    args = (rand(0, (5, 3), F64), rand(1, (4, 3), F64))
    check_grads(_wrong_backward(1.0), args, order=2, modes=["rev"])
    with pytest.raises(AssertionError):
        check_grads(_wrong_backward(1.01), args, order=1, modes=["rev"])
    with pytest.raises(jaxext.GradcheckError):
        jaxext.gradcheck(_wrong_backward(1.01), args)
