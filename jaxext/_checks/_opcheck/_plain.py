"""Whether a check that raised met JAX's own limit or the op's bug: decided by evidence.

A check raises (not a mismatch: an exception) for one of two reasons: the op is wrong
(its rules return the wrong shape, leak a tracer ...), or JAX itself cannot run that
composition for this math (``jax.checkpoint(policy=everything_saveable)`` over complex
intermediates raises ``reduce_precision does not accept dtype complex128`` in any
program). The evidence is the same check run on the op's *plain twin*: the op's primal
with every custom rule stripped (``custom_jvp``/``custom_vjp``/``custom_vmap``
calls replaced by the functions they wrap), so JAX differentiates and batches the
primal itself. If the twin raises the same way, the limit is JAX's and the check is a
SKIP that names it; otherwise the op's rules are the cause, and the check FAILs.

This costs nothing on a check that passes: the twin runs only after an exception.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..._jaxpr import call_body, evaluate
from ._op import CheckFailed, OpUnderTest, forward_mode_error

__all__ = ["jax_limit", "plain_twin", "same_failure", "strip_custom_rules", "underlying_error"]


def strip_custom_rules(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with its custom derivative and batching rules stripped.

    ``func`` is traced to a jaxpr at the arguments it is called with; the jaxpr is then
    evaluated with each ``custom_jvp_call``, ``custom_vjp_call`` (and other
    ``custom_*`` call carrying the function it wraps) replaced by that function, and
    each ``jit`` inlined (a custom rule may sit inside). Rules inside control flow
    (``cond``, ``scan``, ``while_loop``) stay. Array leaves of the arguments are the
    jaxpr's inputs; other leaves (Python scalars, strings ...) stay static.
    """

    def plain(*args: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        arrays = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def traced(*values):
            new = list(leaves)
            for i, value in zip(arrays, values, strict=True):
                new[i] = value
            return func(*jax.tree_util.tree_unflatten(treedef, new))

        closed, shapes = jax.make_jaxpr(traced, return_shape=True)(*[leaves[i] for i in arrays])
        outs = _evaluate(closed.jaxpr, closed.consts, [leaves[i] for i in arrays])
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), outs)

    plain.__name__ = getattr(func, "__name__", "op")
    return plain


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


# The calls whose body the plain twin runs in their place: custom rules' calls (the
# function they wrap, `call_jaxpr`), and plain calls, in which a custom rule may sit.
# Where the body lives is `jaxext/_jaxpr.call_body`'s business; which calls to open is
# this module's (not `checkpoint`, `shard_map`, control flow: they stay as they are).
_PLAIN_CALLS = ("jit", "pjit", "closed_call", "core_call")


def _inlined(eqn: Any) -> bool:
    name, params = eqn.primitive.name, eqn.params
    if name.startswith("custom_"):
        return "call_jaxpr" in params
    return name in _PLAIN_CALLS and "jaxpr" in params


def _evaluate(jaxpr: Any, consts: Any, args: list) -> list:
    """``jaxpr`` evaluated op by op (traced by the caller's transformation), custom
    rules replaced by the functions they wrap, ``jit`` calls inlined."""
    return evaluate(
        jaxpr, consts, args, opened=lambda eqn: call_body(eqn) if _inlined(eqn) else None
    )


def plain_twin(op: OpUnderTest) -> OpUnderTest:
    """The op under test with its custom rules stripped (``strip_custom_rules``): the
    same arguments, the same selected checks, nothing cached."""
    twin = dataclasses.replace(op, func=strip_custom_rules(op.func), cache={})
    twin.cache["selected"] = op.cache.get("selected", frozenset())
    return dataclasses.replace(twin, forward_error=forward_mode_error(twin))


def underlying_error(failure: Exception) -> Exception | None:
    """The exception a check raised: ``failure`` itself, or for a ``CheckFailed`` that
    reports an exception (``raise CheckFailed(...) from err``) that exception;
    ``None`` for a mismatch (a wrong value is never JAX's limit)."""
    if not isinstance(failure, CheckFailed):
        return failure
    cause = failure.__cause__
    return cause if isinstance(cause, Exception) and not isinstance(cause, CheckFailed) else None


# Errors of code that is not traceable (a Python branch on a traced value, a NumPy
# call on a tracer, a tracer leaked out of its trace): the op's own, whatever its twin
# does, since stripping the rules leaves the op's own code as it is.
_OPS_OWN = (jax.errors.JAXTypeError, jax.errors.JAXIndexError)


def jax_limit(op: OpUnderTest, err: Exception, rerun: Callable[[OpUnderTest], Any]) -> str | None:
    """Why ``err`` is JAX's limit, not the op's bug, or ``None`` (then it is a FAIL).

    Args:
        op: the op under test.
        err: what the computation raised on the op.
        rerun: the same computation (a whole check, or one part of it), given an op.

    Returns:
        A SKIP reason naming the limit, when ``rerun`` on the op's plain twin
        (``plain_twin``) raises an exception of the same class with the same message
        (numbers and shapes aside); else ``None``.
    """
    if isinstance(err, _OPS_OWN):
        return None
    # An error the twin did not raise in one check is the op's in the others too: a
    # backward of the wrong shape raises the same in a dozen checks, judged once.
    key = (type(err).__name__, _gist(err))
    judged = op.cache.setdefault("ops_own_errors", set())
    if key in judged:
        return None
    limit = _judge(op, err, rerun)
    if limit is None:
        judged.add(key)
    return limit


def _judge(op: OpUnderTest, err: Exception, rerun: Callable[[OpUnderTest], Any]) -> str | None:
    """``jax_limit``'s verdict on one error, from a run of ``rerun`` on the twin."""
    try:
        if "plain_twin" not in op.cache:  # one twin for all checks: its programs are shared
            op.cache["plain_twin"] = plain_twin(op)
        twin = op.cache["plain_twin"]
    except Exception:  # noqa: BLE001 -- no twin to compare with: no evidence
        return None
    try:
        rerun(twin)
    except Exception as plain_err:  # noqa: BLE001 -- the evidence itself
        plain_err = underlying_error(plain_err)
        if plain_err is not None and same_failure(err, plain_err):
            return (
                "JAX's own limit, not the op's: the same computation on the op's math in "
                "plain JAX (custom rules stripped, JAX's own autodiff) raises it too: "
                f"{type(plain_err).__name__}: {_gist(plain_err, exact=True)}"
            )
    return None


def _mask(text: str) -> str:
    """``text`` with names in backticks or quotes, shapes and numbers masked."""
    text = re.sub(r"`[^`]*`|'[^']*'", "_", text)
    return re.sub(r"\[[^\]]*\]|\d+", "#", text)


def _gist(err: Exception, *, exact: bool = False) -> str:
    """The first line of ``err``'s message; masked (``_mask``) unless ``exact``: the class
    of the message, not its instance."""
    text = str(err).strip()
    line = text.splitlines()[0][:300] if text else ""
    return line if exact else _mask(line)


def same_failure(err: Exception, plain_err: Exception) -> bool:
    """The same exception class (one a subclass of the other) and the same message class
    (the op's message may wrap JAX's, as jaxext's errors do)."""
    if not (isinstance(err, type(plain_err)) or isinstance(plain_err, type(err))):
        return False
    plain = _gist(plain_err)
    return bool(plain) and (_gist(err) == plain or plain in _mask(str(err)))
