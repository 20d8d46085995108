"""opcheck's rows about first derivatives.

``forward_rule`` (the primal of ``jax.vjp``/``jax.jvp``), ``grad_dtypes``, ``zero_cotangent``,
``reentrancy``, ``gradcheck`` and ``jvp`` (the Jacobian from VJPs and from JVPs against
central differences) and ``jvp_vjp`` (forward against reverse mode).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._backward import (
    dtype_refusal,
    gradient_dtypes,
    zero_like,
)
from .._backward import reentrancy as reentrancy_mismatches
from .._backward import zero_cotangent as zero_cotangent_mismatches
from .._compare import unravel
from .._dtype_tolerance import narrowest
from .._settings import Settings
from ._common import (
    Skip,
    first_line,
    gradient_check,
    inner_product,
    jitted_together,
    no_kernel,
    reference_check,
    require_forward_mode,
    vjp,
)
from ._op import (
    CheckFailed,
    OpUnderTest,
    assert_trees_close,
    float_output_leaves,
    mismatch_text,
)

__all__ = [
    "forward_rule",
    "grad_dtypes",
    "gradcheck",
    "jvp",
    "jvp_vjp",
    "reentrancy",
    "zero_cotangent",
]


def forward_rule(op: OpUnderTest, settings: Settings) -> str:
    primals = op.primals
    plain = op.jitted(*primals)
    primal_of = {"jax.vjp": lambda *p: jax.vjp(op.call, *p)[0]}
    if op.forward_error is None:
        primal_of["jax.jvp"] = lambda *p: jax.jvp(op.call, p, p)[0]
    for how, primal in jitted_together(op, primal_of, *primals).items():
        assert_trees_close(primal, plain, what=f"primal output of {how} vs the op", rtol=op.rtol)
    if op.forward_error is not None:
        return "jax.vjp's primal equals the op's output (no forward mode to compare)"
    return "the primal outputs of jax.vjp and jax.jvp equal the op's output"


def gradcheck(op: OpUnderTest, settings: Settings) -> str:
    if op.reference is not None:
        return reference_check(op, settings, 1, "rev")
    gradient_check(op, settings, 1, "rev")
    return f"full Jacobian from VJPs matches central differences{_differenced(op)}"


def jvp(op: OpUnderTest, settings: Settings) -> str:
    require_forward_mode(op)
    if op.reference is not None:
        return reference_check(op, settings, 1, "fwd")
    gradient_check(op, settings, 1, "fwd")
    return f"full Jacobian from JVPs matches central differences{_differenced(op)}"


def _differenced(op: OpUnderTest) -> str:
    """How the differences ran, for an op checked in the dtypes it takes."""
    low = narrowest(op.computes_in)
    if op.narrow is None and (low is None or jnp.finfo(low).bits >= 64):
        return ""
    why = f"{op.precision}: {op.narrow}" if op.narrow else f"the op computes in {low.name}"
    return f" at a step for {low.name} ({why}; no reference= given)"


def jvp_vjp(op: OpUnderTest, settings: Settings) -> str:
    require_forward_mode(op)
    rng = np.random.default_rng(settings.seed + 1)
    primals, u, v = op.primals, op.cotangent(rng), op.tangents(rng)
    both = {"jv": lambda *p: jax.jvp(op.call, p, v)[1], "jtu": lambda *p: vjp(op.call, p, u)}
    got = jitted_together(op, both, *primals)
    jv, jtu = got["jv"], got["jtu"]
    left = float(inner_product(u, jv))
    right = float(sum(np.real(np.sum(np.asarray(a) * b)) for a, b in zip(jtu, v, strict=True)))
    scale = float(inner_product(u, jv, absolute=True))
    scale += float(sum(np.sum(np.abs(np.asarray(a) * b)) for a, b in zip(jtu, v, strict=True)))
    if not abs(left - right) <= op.rtol * scale:
        raise CheckFailed(
            f"u . (J v) = {left:.12g} from jax.jvp but (J^T u) . v = {right:.12g} from jax.vjp "
            f"(random u, v; abs difference {abs(left - right):.3e}, "
            f"allowed {op.rtol * scale:.3e}): "
            "forward and reverse mode disagree."
        )
    return "u . (J v) from jax.jvp equals (J^T u) . v from jax.vjp"


def zero_cotangent(op: OpUnderTest, settings: Settings) -> str:
    primals = op.primals
    zero = jax.tree_util.tree_map(zero_like, op.output_shapes())
    for m in zero_cotangent_mismatches(lambda _: op.pullback(primals, zero), zero)[:1]:
        element = unravel(m.in_element, primals[m.in_block].shape)
        raise CheckFailed(
            f"gradient of {op.labels[m.in_block]} for a zero cotangent is not zero: element "
            f"{element} is {m.actual:.10g} ({m.count} of {m.total} elements nonzero)."
        )
    outputs = float_output_leaves(op.output_shapes())
    if len(outputs) < 2:
        return "a zero cotangent gives zero gradients"
    rng = np.random.default_rng(settings.seed + 5)
    u = op.cotangent(rng)
    for keep, (path, _) in enumerate(outputs):
        # Only output `keep` is used: JAX passes symbolic zeros for the others.
        def loss(*p, keep=keep):
            return inner_product(
                [leaf for i, (_, leaf) in enumerate(float_output_leaves(u)) if i == keep],
                [leaf for i, (_, leaf) in enumerate(float_output_leaves(op.call(*p))) if i == keep],
            )

        got = op.quick_jit(jax.grad(loss, argnums=tuple(range(len(primals)))))(*primals)
        only = _only_float_leaf(u, keep)
        expected = op.quick_jit(lambda *p, only=only: vjp(op.call, p, only))(*primals)
        for label, a, e in zip(op.labels, got, expected, strict=True):
            what = f"gradient of {label} with only output {path or keep} used (symbolic zeros)"
            assert_trees_close(a, e, what=what, rtol=op.rtol)
    return "a zero cotangent gives zero gradients; unused outputs (symbolic zeros) work"


def _only_float_leaf(tree: Any, keep: int) -> Any:
    """``tree`` with every float leaf but the ``keep``-th replaced by zeros."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    index = -1
    for position, leaf in enumerate(leaves):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            index += 1
            if index != keep:
                leaves[position] = np.zeros_like(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def grad_dtypes(op: OpUnderTest, settings: Settings) -> str:
    checked, unsupported, not_taken = [], [], []
    for dtype in (jnp.float64, jnp.float32, jnp.bfloat16):
        if dtype == jnp.float64 and op.narrow is not None:
            not_taken.append("float64")  # its float64 call raised: `op.narrow`
            continue
        if dtype != jnp.float64 and dtype_refusal(op, dtype) is not None:
            not_taken.append(jnp.dtype(dtype).name)  # nothing to check: what the op takes is
            continue
        try:
            found = gradient_dtypes(op, dtype)
        except NotImplementedError as err:  # no kernel for this dtype: what the op cannot do
            unsupported.append(no_kernel(err, dtype))
            continue
        except Exception as err:
            if dtype == jnp.float64:
                raise
            # Not a refusal (`dtype_refusal` found no evidence of one): the op's own error
            # at this dtype, whatever its plain twin does (the twin runs the same code).
            raise CheckFailed(
                f"{jnp.dtype(dtype).name} inputs: tracing the gradients raises "
                f"{type(err).__name__}: {first_line(err)} (float64 runs; not a refusal of the "
                "dtype: no deliberate check of the op's, and JAX runs the op's math with every "
                "float value in it)"
            ) from None
        if found is not None:
            primal, grad, shape = found.primal, found.grad, tuple(found.primal.shape)
            raise CheckFailed(
                f"gradient of {found.label} is {np.dtype(grad.dtype)}{tuple(grad.shape)} for an "
                f"input of {np.dtype(primal.dtype)}{shape}; expected {found.expected}{shape} "
                "(JAX does not check a custom_vjp backward's dtypes)."
            )
        checked.append(jnp.dtype(dtype).name)
    if unsupported:
        raise Skip(f"{', '.join(checked)} checked; not run: {'; '.join(unsupported)}")
    refused = f"; the op does not take {', '.join(not_taken)}" if not_taken else ""
    return f"gradients have their inputs' dtypes and shapes ({', '.join(checked)} inputs{refused})"


def reentrancy(op: OpUnderTest, settings: Settings) -> str:
    rng = np.random.default_rng(settings.seed + 7)
    primals, u = op.primals, op.cotangent(rng)
    runs = {
        "under jit": lambda: op.pullback(primals, u),
        "eagerly": lambda: vjp(op.call, primals, u),
    }
    found = reentrancy_mismatches(runs, settings.nondet_tol)
    if found is not None:
        how, (m, *_) = found
        what = f"gradient of {op.labels[m.in_block]}, second run of the backward {how} vs the first"
        raise CheckFailed(mismatch_text(what, m, unravel(m.in_element, primals[m.in_block].shape)))
    return f"two runs of the backward agree within nondet_tol={settings.nondet_tol:g}"
