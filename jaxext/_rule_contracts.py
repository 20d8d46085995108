"""The contract of a ``jaxext.custom_vjp``'s rules with the core, and its error messages.

A leaf module under the custom_vjp core: the errors a broken contract raises
(:class:`RuleTypeError`, :class:`RuleValueError`, :class:`ClosedOverValueError`), how an
argument is named in them (:func:`arg_label`, :func:`name_user_function`), how a call's
arguments are resolved to positions (:func:`resolve_kwargs`, :func:`positions_of`), and the
checks of what the rules return: :func:`fwd_pair` and :func:`check_fwd_output` for ``fwd``,
:func:`check_bwd_output` for ``bwd`` (one pass, as JAX's ``_flatten_bwd``), and
:func:`check_leaf` for one gradient or ``jvp`` output tangent.

Each message says what is wrong in jaxext's words (naming the op and the argument), then
keeps JAX's own sentence for the same failure, which users' code may match on, through one
helper (:func:`jax_wording`).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ._avals import as_array, as_dtype, dtype_of, is_array_leaf, match_type, py_float, short, zeros

__all__ = [
    "ClosedOverValueError",
    "RuleTypeError",
    "RuleValueError",
    "arg_label",
    "broadcast_prefix",
    "check_bwd_output",
    "check_fwd_output",
    "check_leaf",
    "fwd_pair",
    "jax_wording",
    "name_user_function",
    "positions_of",
    "resolve_kwargs",
    "stale_closure_error",
    "the_output",
]


class RuleTypeError(TypeError):
    """A ``jaxext.custom_vjp`` rule (``fwd``, ``bwd``, ``jvp``, a vmap rule) broke its
    contract with a value of the wrong kind, count or structure.

    Raised at trace time, naming the op and the argument. A ``TypeError``, so code
    written for ``jax.custom_vjp`` that catches ``TypeError`` keeps working.
    """


class RuleValueError(ValueError):
    """A ``jaxext.custom_vjp`` rule returned a value of the wrong shape (a ``ValueError``)."""


# Tracebacks show the names users can import and catch, not this private module's.
RuleTypeError.__module__ = RuleValueError.__module__ = "jaxext"

try:  # where JAX defines it (not exported publicly)
    from jax._src.interpreters.ad import CustomVJPException as _JaxCustomVJPException
except ImportError:  # pragma: no cover -- a JAX that moved it: the RuleTypeError alone
    _JaxCustomVJPException = RuleTypeError


class ClosedOverValueError(RuleTypeError, _JaxCustomVJPException):
    """Rules that close over a differentiated (or otherwise traced, now stale) value.

    A :class:`RuleTypeError` and JAX's ``CustomVJPException``, which ``jax.custom_vjp``
    raises for the same case and which code (diffrax's tests) catches.
    """

    def __init__(self, message: str):
        TypeError.__init__(self, message)


ClosedOverValueError.__module__ = "jaxext"


def positions_of(signature: inspect.Signature | None, names: Sequence[str]) -> list[int]:
    """The positions of the parameters ``names`` in ``signature`` (``nondiff_argnames``)."""
    if isinstance(names, str):
        names = (names,)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [] if signature is None else list(signature.parameters.values())
    positions = {p.name: i for i, p in enumerate(params) if p.kind in positional}
    for name in names:
        if name not in positions:
            raise ValueError(
                f"`nondiff_argnames` must name positional parameters of the function "
                f"({', '.join(positions) or 'it has none that can be inspected'}); "
                f"got {name!r}."
            )
    return [positions[name] for name in names]


def resolve_kwargs(
    signature: inspect.Signature | None, name: str, args: tuple, kwargs: dict
) -> tuple:
    """Positional arguments with keywords and defaults filled in, as ``jax.custom_vjp`` does."""
    if signature is None:
        if kwargs:
            raise TypeError(f"`{name}`: keyword arguments need a function with a signature.")
        return args
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"`{name}`: {err}") from None
    bound.apply_defaults()
    # Keyword-only parameters left at their defaults are simply not passed (the function
    # uses its defaults), as with jax.custom_vjp; passing one explicitly is an error.
    passed = sorted(k for k in bound.kwargs if k in kwargs)
    if passed:
        raise TypeError(
            f"`{name}`: keyword-only arguments {passed} cannot be resolved to positions; "
            "custom_vjp functions take positional arguments. "
            + jax_wording(
                "The following keyword arguments could not be resolved to positions: "
                + ", ".join(passed)
            )
        )
    return tuple(bound.args)


def arg_label(fun: Callable[..., Any], position: int, skip: int = 0) -> str:
    """``argument 2 (`bias`)`` when ``fun``'s signature, after ``skip`` leading
    parameters (a ``ctx``), names ``position``; ``argument 2`` otherwise."""
    try:
        params = list(inspect.signature(fun).parameters.values())[skip:]
    except (TypeError, ValueError):
        params = []
    if position < len(params) and params[position].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return f"argument {position} (`{params[position].name}`)"
    return f"argument {position}"


def name_user_function(
    err: jax.errors.ConcretizationTypeError,
    fun: Callable[..., Any],
    diff: Sequence[int] | None,
) -> None:
    """Rewrites ``err``'s message (same exception, same type) to lead with the user's
    function and name its arguments where JAX's names jaxext's internals.

    JAX describes the function it traced, which may be jaxext's wrapper of ``fun``
    (``.../jaxext/_custom_vjp.py:...``, ``custom_jvp fun``), and its arguments
    ``diff_values[k]``: the ``k``-th differentiable one, ``diff[k]`` of ``fun``'s
    (``diff=None``: no such names to map). ``fun._jaxext_origin`` (a
    ``jaxext.Function``'s ``forward``) is the function the user wrote, where ``fun``
    stands for it. Called at each boundary the error passes, innermost first: the
    innermost names the function, each adds the argument names it can map.
    """
    if not err.args or not isinstance(err.args[0], str):
        return
    origin = getattr(fun, "_jaxext_origin", fun)
    if not hasattr(err, "_jaxext_where"):
        where = getattr(origin, "__qualname__", None) or getattr(origin, "__name__", "")
        try:
            code = inspect.unwrap(origin).__code__
            location = f"{code.co_filename}:{code.co_firstlineno}"
        except AttributeError:
            location = None
        err._jaxext_where = (where or repr(origin), location)  # type: ignore[attr-defined]
        err._jaxext_body = err.args[0]  # type: ignore[attr-defined]
        err._jaxext_names = []  # type: ignore[attr-defined]
    where, location = err._jaxext_where
    body: str = err._jaxext_body
    names: list[str] = err._jaxext_names
    if diff is not None:
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []

        def rename(match: re.Match) -> str:
            k = int(match[1])
            position = diff[k] if k < len(diff) else k
            name = f"args[{position}]"
            if position < len(params) and params[position].kind in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                name = params[position].name
            names.append(name)
            return name

        body = re.sub(r"\bdiff_values\[(\d+)\]", rename, body)
    at = where if location is None else f"{where} at {location}"

    def relocate(match: re.Match) -> str:  # only where JAX names jaxext's own wrapper
        inside = os.path.abspath(match[1]).startswith(_PACKAGE_DIR + os.sep)
        return f"the function {at}" if inside else match[0]

    body = re.sub(r"the function \S+ at (\S+?):\d+(?: for [\w ]+)?", relocate, body)
    named = ", ".join(f"`{n}`" for n in dict.fromkeys(names))
    what = f"the concrete value of {named}, which is" if named else "a concrete value of an array"
    lead = (
        f"`{where}`{'' if location is None else f' ({location})'} needs {what} traced here "
        "(under jax.jit, jax.vmap or another transformation): branch with jnp.where or "
        "jax.lax.cond rather than a Python `if`."
    )
    err._jaxext_body = body  # type: ignore[attr-defined]
    err.args = (f"{lead}\n{body}", *err.args[1:])


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _bwd_checks_disabled() -> bool:
    """JAX's ``jax_disable_bwd_checks`` option (absent in some releases: then False)."""
    return bool(getattr(jax.config, "jax_disable_bwd_checks", False))


def broadcast_prefix(grad: Any, tree: Any) -> list[Any]:
    """The leaves of ``grad`` broadcast to the leaves of ``tree``, of which it is a prefix.

    As in ``jax.custom_vjp``: a ``None`` (or one array) where the argument has a
    subtree stands for every leaf of that subtree, none where that subtree has no leaves
    (JAX's Pallas ``megablox.gmm`` returns a gradient for an argument that may be ``None``).
    """
    if tree.num_leaves == 1 and jax.tree_util.treedef_is_leaf(tree):
        return [grad]  # an array argument: whatever bwd gave is checked as its gradient
    dummy = jax.tree_util.tree_unflatten(tree, [object()] * tree.num_leaves)
    # Flattened, not mapped: mapping would rebuild bwd's pytree with placeholder children,
    # which a user's unflatten may refuse.
    g_leaves, g_tree = jax.tree_util.tree_flatten(grad, is_leaf=lambda x: x is None)
    flat: list[Any] = []
    for g, sub in zip(g_leaves, g_tree.flatten_up_to(dummy), strict=True):
        flat.extend([g] * len(jax.tree_util.tree_leaves(sub)))
    return flat


def jax_wording(sentence: str) -> str:
    """``(JAX: sentence)``: JAX's own wording of an error, which users' code may match on.

    Every message of a broken rule contract says what is wrong in jaxext's words, then
    keeps JAX's sentence for the same failure through this one helper.
    """
    return f"(JAX: {sentence})"


def _bwd_tuple_wording() -> str:
    return jax_wording(
        "Custom VJP bwd rule must produce an output with the same container (pytree) "
        "structure as the args tuple of the primal function, and in particular must produce a "
        "tuple of length equal to the number of arguments to the primal function."
    )


def _fwd_wording(name: str, fwd: Any, instead: str = "") -> str:
    """JAX's wording of a wrong fwd output.

    ``instead`` completes JAX's sentence (what fwd's output was instead); without it, the
    sentence stops after its key phrase.
    """
    fwd_name = getattr(fwd, "__name__", "fwd")
    sentence = (
        f"Custom VJP fwd rule {fwd_name} for function {name} must produce a pair "
        "(list or tuple of length two) where the first element represents the primal "
        "output"
    )
    if not instead:
        return jax_wording(f"{sentence}.")
    return jax_wording(
        f"{sentence} (equal to the output of the custom_vjp-decorated function "
        f"{name}) and the second element represents residuals (i.e. values stored "
        "from the forward pass for use on the backward pass), but instead the fwd rule "
        f"output's first element had {instead}"
    )


def _fwd_mismatch_wording(name: str, fwd: Any, what: str, got: Any, expected: Any) -> str:
    """JAX's full sentence for a fwd output of the wrong ``what`` (structure or type)."""
    kind = "container/pytree structure:" if what == "structure" else "shapes/dtypes of:"
    got_s, exp_s = (
        str(jax.tree_util.tree_map(short, tree)).replace("'", "") for tree in (got, expected)
    )
    end = "." if what == "structure" else ""
    return _fwd_wording(
        name,
        fwd,
        f"{kind}\n    {got_s}\nwhile the custom_vjp-decorated function {name} had "
        f"output {kind}\n    {exp_s}{end}",
    )


def fwd_pair(result: Any, name: str, fwd: Any) -> tuple[Any, Any]:
    """``fwd``'s result ``(output, residuals)``; raises unless it is a pair."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(
            f"`{name}`: fwd must return a pair (output, residuals); got "
            f"{type(result).__name__}. {_fwd_wording(name, fwd)}"
        )
    out, res = result
    return out, res


def check_fwd_output(out: Any, expected: Any, name: str, fwd: Any) -> None:
    """Raises unless ``fwd``'s output ``out`` has the primal's output type ``expected``
    (``None``: not known, nothing to check)."""
    if expected is None:
        return
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    exp_leaves, exp_tree = jax.tree_util.tree_flatten(expected)
    if out_tree == exp_tree and all(
        np.shape(o) == e.shape and dtype_of(o) == e.dtype
        for o, e in zip(out_leaves, exp_leaves, strict=True)
    ):
        return
    got = jax.tree_util.tree_map(
        lambda o: jax.ShapeDtypeStruct(np.shape(o), jnp.result_type(o)), out
    )
    exp_tree, got_tree = (
        jax.tree_util.tree_structure(expected),
        jax.tree_util.tree_structure(got),
    )
    if exp_tree != got_tree:
        raise TypeError(
            f"`{name}`: fwd's output must have the primal's structure {exp_tree}; "
            f"got {got_tree}. {_fwd_mismatch_wording(name, fwd, 'structure', got, expected)}"
        )
    exp_leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, e), g in zip(exp_leaves, jax.tree_util.tree_leaves(got), strict=True):
        if e.shape != g.shape or as_dtype(e.dtype) != as_dtype(g.dtype):
            # JAX's sentence, then its newer custom_vjp's wording of the same mismatch.
            raise TypeError(
                f"`{name}`: fwd's output must have the primal's shapes and dtypes "
                f"{e.dtype}{list(e.shape)}; got {g.dtype}{list(g.shape)}. "
                f"{_fwd_mismatch_wording(name, fwd, 'type', got, expected)} "
                + jax_wording(
                    f"at output{jax.tree_util.keystr(path)}, got fwd output type {short(g)} "
                    f"which doesn't match primal output type {short(e)}."
                )
            )


def stale_closure_error(name: str) -> ClosedOverValueError:
    """The error for rules that close over a value of a trace that has ended."""
    return ClosedOverValueError(
        f"`{name}`: its rules close over a traced value (one being differentiated, or "
        f"one computed inside a `jit`, `scan` or other traced function around the call "
        f"of `{name}`) that they cannot read when JAX differentiates that traced "
        "function after tracing it: the rules only give derivatives with respect to "
        f"explicit arguments. Pass the value to `{name}` as an argument, and return "
        "its gradient from bwd (None where it needs none). "
        + jax_wording(
            "Detected differentiation of a custom_vjp function with respect to a closed-over "
            "value. That isn't supported because the custom VJP rule only specifies how to "
            "differentiate the custom_vjp function with respect to explicit input parameters."
        )
    )


def check_bwd_output(
    grads: Any,
    name: str,
    label: Callable[[int], str],
    in_tree: Any,
    in_avals: Sequence[Any],
    perturbed: Sequence[bool],
) -> list[jax.Array]:
    """The gradients of the perturbed input leaves from ``bwd``'s output ``grads``, checked.

    As JAX's ``_flatten_bwd``, in one pass: the tuple of one gradient per differentiable
    argument (extra trailing ``None`` allowed), each a prefix of its argument's structure
    (``None`` or one array standing for a subtree), then each leaf against its input's
    type, named by the argument (``label(k)``) and JAX's keypath (``output[k]...``), both
    made only for an error message.

    Raises:
        RuleTypeError: a wrong container, count, structure, kind or dtype.
        RuleValueError: a wrong shape, or extra gradients that are not None.
    """
    arg_trees = in_tree.children()
    n = len(arg_trees)
    if not isinstance(grads, (tuple, list)):
        raise RuleTypeError(
            f"`{name}`: bwd must return a tuple with one gradient per differentiable "
            f"argument ({n}); got {type(grads).__name__}. {_bwd_tuple_wording()}"
        )
    grads = tuple(grads)
    if len(grads) > n and any(g is not None for g in grads[n:]):
        raise RuleValueError(
            f"`{name}`: bwd returned {len(grads)} gradients; expected {n}, one per "
            f"differentiable argument (extra trailing values must be None). {_bwd_tuple_wording()}"
        )
    if len(grads) < n:
        missing = ", ".join(label(k) for k in range(len(grads), n))
        raise RuleTypeError(
            f"`{name}`: bwd returned {len(grads)} gradient(s); expected {n}, one per "
            f"differentiable argument: none for {missing}. Return None for an argument "
            f"whose gradient is zero. {_bwd_tuple_wording()}"
        )
    flat: list[Any] = []
    owner: list[int] = []  # the argument of each input leaf
    for k, (grad, tree) in enumerate(zip(grads[:n], arg_trees, strict=True)):
        try:
            leaves = broadcast_prefix(grad, tree)
        except (ValueError, TypeError):
            raise RuleTypeError(
                f"`{name}`: bwd's gradient for {label(k)} must have the argument's "
                f"structure {tree} (or a prefix of it); got "
                f"{jax.tree_util.tree_structure(grad)}."
            ) from None
        flat.extend(leaves)
        owner.extend([k] * tree.num_leaves)

    def where(i: int, with_path: bool = False) -> tuple[str, str | None]:
        if not with_path:
            return label(owner[i]), None
        k = owner[i]
        tree = arg_trees[k]
        paths = jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(tree, range(tree.num_leaves))
        )[0]
        path = paths[i - owner.index(k)][0]
        return label(k), f"output[{k}]{jax.tree_util.keystr(path)}"

    result = []
    for i, (grad, aval, q) in enumerate(zip(flat, in_avals, perturbed, strict=True)):
        if not q:
            if isinstance(grad, SymbolicZero):  # checked even where no gradient is needed
                check_leaf(grad, aval.to_tangent_aval(), functools.partial(where, i), name)
            continue
        # A gradient has its input's cotangent type (a reduced input's is unreduced).
        ct_aval = aval.to_ct_aval() if hasattr(aval, "to_ct_aval") else aval
        result.append(check_leaf(grad, ct_aval, functools.partial(where, i, True), name))
    return result


def the_output() -> tuple[str, None]:
    """What a ``jvp`` rule's output tangent is called in an error message."""
    return "the output", None


def _bwd_type_wording(name: str, jax_path: str, got: Any, aval: Any) -> str:
    """JAX's sentence for a gradient ``got`` of the wrong shape or dtype for an input of
    type ``aval``, then its newer custom_vjp's (``jax_custom_vjp3``) wording of it, as the
    installed JAX words them (a JAX newer than 0.11.0 names the primal function:
    ``attached to f``)."""
    attached = f" attached to {name}" if jax.__version_info__ > (0, 11, 0) else ""
    mismatches = [
        f"the {what}s do not match"
        for what, differ in (
            ("dtype", as_dtype(got.dtype) != as_dtype(aval.dtype)),
            ("shape", tuple(got.shape) != tuple(aval.shape)),
        )
        if differ
    ]
    so = ", so " + ", and ".join(mismatches) if mismatches else ""  # as JAX joins two
    return " ".join(
        jax_wording(sentence)
        for sentence in (
            f"Custom VJP bwd rule{attached} must produce an output with the same type as the "
            f"args tuple of the primal function, but at {jax_path} the bwd rule produced an "
            f"output of type {short(got)} corresponding to an input of type {short(aval)}{so}.",
            f"at {jax_path} the bwd rule{attached} produced an output of type {short(got)} "
            f"which doesn't match expected type {short(aval)}.",
        )
    )


def check_leaf(
    grad: Any,
    aval: Any,
    where: Callable[[], tuple[str, str | None]],
    name: str,
    rule: str = "bwd",
) -> jax.Array:
    """Checks one gradient (``rule="bwd"``) or output tangent (``rule="jvp"``) of op ``name``.

    ``where()`` gives, for an error message only, the label of what is checked and
    JAX's path (``output[k]...``, or ``None``) that adds JAX's wording of a
    shape/dtype mismatch.
    """
    value, side = ("gradient", "input") if rule == "bwd" else ("tangent", "output")

    def jax_phrase(got: Any, jax_path: str | None) -> str:
        if jax_path is None:
            return ""
        return " " + _bwd_type_wording(name, jax_path, got, aval)

    if isinstance(grad, SymbolicZero) and (
        tuple(grad.shape) != tuple(aval.shape) or as_dtype(grad.dtype) != as_dtype(aval.dtype)
    ):
        label, _ = where()
        raise RuleValueError(
            f"`{name}`: {rule} returned a SymbolicZero for {label} of shape/dtype "
            f"{as_dtype(grad.dtype)}{list(grad.shape)}; the {side} has "
            f"{as_dtype(aval.dtype)}{list(aval.shape)}. Consider just returning a None here "
            "instead of a SymbolicZero object."
        )
    if grad is None or isinstance(grad, SymbolicZero):
        return zeros(aval)
    if _bwd_checks_disabled() and is_array_leaf(grad):
        # As jax.custom_vjp with jax_disable_bwd_checks: the gradient as bwd made it.
        grad = jnp.asarray(grad)
        if tuple(grad.shape) == tuple(aval.shape):
            return match_type(grad.astype(aval.dtype), aval)
        return grad
    if not is_array_leaf(grad):
        if isinstance(grad, (int, float)) and not isinstance(grad, bool) and aval.shape == ():
            if rule == "bwd" and isinstance(grad, float) and aval.dtype == py_float():
                # As jax.custom_vjp: a Python float gradient is returned as bwd made it
                # (a float from an eager grad or vjp; an array under jit).
                return grad
            return jnp.asarray(grad, aval.dtype)
        label, _ = where()
        raise RuleTypeError(
            f"`{name}`: {rule}'s {value} for {label} must be an array or None; got "
            f"{type(grad).__name__}."
        )
    if tuple(grad.shape) != tuple(aval.shape):
        label, jax_path = where()
        raise RuleValueError(
            f"`{name}`: {rule}'s {value} for {label} must have the {side}'s shape "
            f"{tuple(aval.shape)}; got shape {tuple(grad.shape)}.{jax_phrase(grad, jax_path)}"
        )
    if as_dtype(grad.dtype) != as_dtype(aval.dtype):
        if rule == "bwd" and _other_dtype_accepted(aval.dtype, grad.dtype):
            # As jax.custom_vjp: a gradient of another dtype for a float input is returned
            # as bwd made it (float32 for a bfloat16 input: Pallas' attention does so).
            return match_type(as_array(grad), aval)
        label, jax_path = where()
        raise RuleTypeError(
            f"`{name}`: {rule}'s {value} for {label} must have the {side}'s dtype "
            f"{as_dtype(aval.dtype)}; got {as_dtype(grad.dtype)} (cast it with .astype)."
            f"{jax_phrase(grad, jax_path)}"
        )
    return match_type(as_array(grad), aval)


def _other_dtype_accepted(input_dtype: Any, grad_dtype: Any) -> bool:
    """Whether ``jax.custom_vjp`` takes a gradient of ``grad_dtype`` for an input of
    ``input_dtype`` (JAX's ``_temporary_dtype_exception``: an inexact input, or an
    extended gradient dtype)."""
    return jax.dtypes.issubdtype(grad_dtype, jax.dtypes.extended) or jax.dtypes.issubdtype(
        input_dtype, np.inexact
    )
