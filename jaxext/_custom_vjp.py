"""`custom_vjp`: ``jax.custom_vjp`` with forward mode, safe residuals and clear errors.

How it works. A call is a ``jax.custom_jvp`` whose JVP rule runs the user's
``fwd`` and returns as output tangent ``tangent_p.bind(*residuals, *tangents)``,
a primitive that is *linear* in the tangents:

* its transpose rule is the user's ``bwd``: reverse mode (``grad``, ``vjp``,
  ``jacrev``) transposes the linearised program and so runs the hand-written
  backward on the residuals ``fwd`` saved, as ``jax.custom_vjp`` does;
* evaluated (``jvp``, ``jacfwd``, ``linearize``), it computes ``J t`` as the
  transpose of the backward (``jax.linear_transpose``; every correct backward is
  linear in its cotangent), or with a user-given ``jvp`` rule;
* its JVP rule covers higher orders (``hessian``, ``jacrev(jacfwd)``) and its
  batching rule vmaps the backward.

Because the JVP rule is traced per set of perturbed inputs (JAX caches jitted
functions' JVPs by that set), ``fwd`` may save different residuals for different
sets; there is no residual structure recorded once and reused.

Every step here runs as written (``_Plain``). Eager calls may reuse work per abstract
signature instead: the JVP rule asks ``_eager_cache.lookup`` once per call which steps to
take, and that module holds every cache (see its docstring).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend.core import Primitive, primal_dtype_to_tangent_dtype, take_current_trace
from jax.interpreters import ad, batching, mlir

from . import _eager_cache
from . import _forward_mode as _jvp_from_vjp
from ._linearity import Kind, nonlinearities
from ._remat import rematerialized, run_fwd, saved

__all__ = ["RuleTypeError", "RuleValueError", "custom_vjp"]

ReturnValue = TypeVar("ReturnValue")


class custom_vjp(Generic[ReturnValue]):  # noqa: N801 -- the name mirrors jax.custom_vjp
    """A drop-in for ``jax.custom_vjp`` that also supports forward-mode AD.

    Decorate the primal function, then attach ``fwd`` and ``bwd`` with
    ``defvjp``, exactly as with ``jax.custom_vjp``. Reverse mode runs the
    hand-written ``bwd``. Forward mode (``jax.jvp``, ``jax.jacfwd``,
    ``jax.linearize``, ``jax.hessian``) is derived by transposing ``bwd``, which
    is linear in its cotangent, or comes from an optional ``jvp`` rule.

    On top of ``jax.custom_vjp``:

    * with ``symbolic_zeros=True``, ``fwd`` sees which inputs are differentiated
      (``CustomVJPPrimal.perturbed``, PyTorch's ``needs_input_grad``) and may
      save different residuals depending on it, also inside a reused ``jit``;
    * residuals may hold Python values (flags, dtypes, shapes): they are kept as
      static data, never traced;
    * ``bwd`` may return ``None`` for an input (a zero gradient) and extra
      trailing ``None``; a missing gradient, or one of the wrong shape, dtype or
      structure, is a clear error at trace time naming the op and the input
      (:class:`jaxext.RuleTypeError` / :class:`jaxext.RuleValueError`);
    * inside ``shard_map``, a gradient that varies over mesh axes its input does
      not vary over is summed over them, as autodiff does.

    Args:
        fun: the primal function.
        nondiff_argnums: positions of non-differentiable arguments (Python
            values, static configuration). They are passed first to ``bwd`` and
            ``jvp``, as with ``jax.custom_vjp``.
        nondiff_argnames: names of non-differentiable arguments, taken as the
            positions of those parameters in ``fun``'s signature (joined with
            ``nondiff_argnums``), as with ``jax.custom_vjp``.
        forward_mode_hint: for libraries built on ``custom_vjp``: what to tell a
            user whose ``bwd`` forward mode cannot transpose (in place of the
            advice to pass ``defvjp(..., jvp=...)``).
        no_derivatives_message: for a ``bwd`` that must not be differentiated
            (``jaxext.once_differentiable``): forward mode's ``J t``, the
            transpose of ``bwd``, then raises ``RuntimeError`` with this message
            when it is differentiated in turn (reverse mode's ``bwd`` guards
            itself). ``None`` (the default): no such guard.
        hoist_closures: whether forward mode may dry-run ``bwd``/``jvp`` at trace
            time to hoist the tracers they close over. ``jaxext.Function`` turns
            it off: its rules re-run the user's ``forward``, which a port may
            count on running once per differentiation.
        forward_mode_max_outputs: where JAX cannot transpose ``bwd`` (it has a
            ``while_loop``, a host callback, an FFI kernel), forward mode
            evaluates ``bwd`` once per output element (batched with ``vmap``) and
            contracts the rows of the Jacobian with the tangent; up to this many
            output elements (a complex element counts twice). Beyond it, forward
            mode raises. Default 4096.
        differentiate_fwd: forward mode differentiates ``fwd`` with JAX's
            autodiff (its output, discarding the residuals) instead of deriving
            ``J t`` from ``bwd``, as proposed upstream in jax-ml/jax#17840; calls of
            the op inside ``fwd`` then run the primal as written. Right for a
            ``custom_vjp`` that exists to save memory (checkpointing, implicit
            differentiation) and whose ``fwd`` JAX can differentiate; wrong for
            one whose ``bwd`` changes the gradient (a straight-through estimator,
            a gradient clip). Reverse mode runs ``bwd`` either way; a ``jvp``
            rule, when given, takes precedence.

    Raises:
        TypeError: if ``fun`` is not callable, ``nondiff_argnums`` holds
            something else than non-negative ints, ``forward_mode_hint`` or
            ``no_derivatives_message`` is neither a string nor None,
            ``hoist_closures`` or ``differentiate_fwd`` is not a bool, or
            ``forward_mode_max_outputs`` is not a non-negative int.
        ValueError: if a name of ``nondiff_argnames`` is not a positional
            parameter of ``fun``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import jaxext
        >>> @jaxext.custom_vjp
        ... def f(x, y):
        ...     return jnp.sin(x) * y
        >>> def f_fwd(x, y):
        ...     return f(x, y), (jnp.cos(x), jnp.sin(x), y)
        >>> def f_bwd(res, g):
        ...     cos_x, sin_x, y = res
        ...     return (cos_x * g * y, sin_x * g)
        >>> f.defvjp(f_fwd, f_bwd)
        >>> x, y = jnp.float32(0.0), jnp.float32(2.0)
        >>> jax.grad(f)(x, y)
        Array(2., dtype=float32)
        >>> jax.jvp(f, (x, y), (jnp.float32(1.0), jnp.float32(0.0)))  # forward mode
        (Array(0., dtype=float32), Array(2., dtype=float32))
    """

    def __init__(
        self,
        fun: Callable[..., ReturnValue],
        nondiff_argnums: Sequence[int] = (),
        nondiff_argnames: Sequence[str] = (),
        *,
        forward_mode_hint: str | None = None,
        no_derivatives_message: str | None = None,
        hoist_closures: bool = True,
        forward_mode_max_outputs: int = _jvp_from_vjp.DEFAULT_MAX_OUTPUTS,
        differentiate_fwd: bool = False,
    ):
        if not callable(fun):
            raise TypeError(f"`fun` must be callable; got {type(fun).__name__}.")
        for option, value in (
            ("forward_mode_hint", forward_mode_hint),
            ("no_derivatives_message", no_derivatives_message),
        ):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"`{option}` must be a string or None; got {type(value).__name__}.")
        if not isinstance(hoist_closures, bool):
            raise TypeError(
                f"`hoist_closures` must be a bool; got {type(hoist_closures).__name__}."
            )
        if not isinstance(differentiate_fwd, bool):
            raise TypeError(
                f"`differentiate_fwd` must be a bool; got {type(differentiate_fwd).__name__}."
            )
        _jvp_from_vjp.check_max_outputs(forward_mode_max_outputs)
        functools.update_wrapper(self, fun)
        self.fun = fun
        argnums = tuple(nondiff_argnums)
        for i in argnums:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
                raise TypeError(
                    f"`nondiff_argnums` must hold non-negative ints; got {nondiff_argnums!r}."
                )
        named = _positions_of(self._signature(), nondiff_argnames)
        self.nondiff_argnums = tuple(sorted({int(i) for i in argnums} | set(named)))
        self.fwd: Callable[..., Any] | None = None
        self.bwd: Callable[..., Any] | None = None
        self.jvp: Callable[..., Any] | None = None
        self.symbolic_zeros = False
        self.optimize_remat = False
        self.remat_rules: tuple[Callable[..., Any], ...] | None = None
        # The constructor's options (see Args), read in forward mode; set here only.
        self.forward_mode_hint = forward_mode_hint
        self.no_derivatives_message = no_derivatives_message
        self.hoist_closures = hoist_closures
        self.forward_mode_max_outputs = forward_mode_max_outputs
        self.differentiate_fwd = differentiate_fwd
        self.vmap_rule: Callable[..., tuple[Any, Any]] | None = None

    def _signature(self) -> inspect.Signature | None:
        if not hasattr(self, "_cached_signature"):
            try:
                self._cached_signature = inspect.signature(self.fun)
            except (TypeError, ValueError):
                self._cached_signature = None
        return self._cached_signature

    def _arity(self) -> int:
        """How many arguments ``fun`` takes when it takes positional ones only (else -1).

        A call with that many positional arguments and no keywords is already resolved.
        """
        if not hasattr(self, "_positional_arity"):
            signature = self._signature()
            params = [] if signature is None else signature.parameters.values()
            positional = (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            )
            simple = signature is not None and all(p.kind in positional for p in params)
            self._positional_arity = len(params) if simple else -1
        return self._positional_arity

    def defvjp(
        self,
        fwd: Callable[..., tuple[ReturnValue, Any]],
        bwd: Callable[..., Any],
        symbolic_zeros: bool = False,
        optimize_remat: bool = False,
        generic_batching: bool = False,
        *,
        jvp: Callable[..., Any] | None = None,
    ) -> None:
        """Defines the forward and backward rules (and, optionally, a JVP rule).

        Args:
            fwd: takes the primal's arguments; returns ``(output, residuals)``.
                With ``symbolic_zeros=True`` each differentiable array leaf
                arrives as a ``jax.custom_derivatives.CustomVJPPrimal`` with
                ``.value`` and ``.perturbed``.
            bwd: ``bwd(*nondiff_args, residuals, cotangent)`` returns a tuple
                with one gradient per differentiable argument (``None`` for
                zero). With ``symbolic_zeros=True`` a zero cotangent leaf
                arrives as a ``jax.custom_derivatives.SymbolicZero``.
            symbolic_zeros: as for ``jax.custom_vjp``.
            optimize_remat: as for ``jax.custom_vjp``: under ``jax.checkpoint``
                (remat), the forward pass runs the primal function instead of
                ``fwd`` when it needs no residuals, so an opaque ``fwd`` (one FFI
                call or ``pure_callback`` returning output and residuals together)
                is not run twice. ``fwd`` is then traced abstractly when its inputs
                are traced; a ``fwd`` that branches in Python on its inputs' values,
                or that has side effects, runs as without the option. Unlike
                ``jax.custom_vjp``, it combines with ``symbolic_zeros``, forward mode
                and higher-order derivatives.
            generic_batching: accepted for compatibility with ``jax.custom_vjp``
                (JAX 0.12 and later); it has no effect. Under ``vmap``, an output
                shared across the batch (one that depends on unbatched inputs
                only) already gets its cotangent counted once.
            jvp: optional ``jvp(*nondiff_args, residuals, tangents)`` returning
                the output tangent; ``tangents`` has one entry per
                differentiable argument (zeros where not perturbed). It must be
                linear in ``tangents``. Needed for forward mode only when JAX
                cannot transpose ``bwd`` (it calls ``pure_callback`` or an FFI
                kernel, say); otherwise forward mode is derived from ``bwd``.

        Raises:
            TypeError: if a rule is not callable.
        """
        del generic_batching
        for name, rule in (("fwd", fwd), ("bwd", bwd)):
            if not callable(rule):
                raise TypeError(f"`{name}` must be callable; got {type(rule).__name__}.")
        if jvp is not None and not callable(jvp):
            raise TypeError(f"`jvp` must be callable or None; got {type(jvp).__name__}.")
        if self.remat_rules is not None:
            return  # defremat's rules stay in force (see defremat)
        self.fwd, self.bwd, self.jvp = fwd, bwd, jvp
        self.symbolic_zeros = bool(symbolic_zeros)
        self.optimize_remat = bool(optimize_remat)

    def defremat(
        self,
        fwd: Callable[..., tuple[ReturnValue, Any]],
        rem: Callable[..., tuple[ReturnValue, Any]],
        bwd: Callable[..., Any],
        generic_batching: bool = False,
    ) -> None:
        """Defines rematerialization rules, as JAX 0.12's ``jax.custom_vjp.defremat``.

        Under ``jax.checkpoint`` (remat), the forward pass runs ``fwd`` and saves
        its residuals ``res`` whatever the checkpoint policy; the backward pass
        runs ``rem(res, *args)`` for the residuals ``res2`` of ``bwd``, instead of
        running ``fwd`` again. Outside remat, ``rem`` runs right after ``fwd`` on
        the forward pass. Works on every supported JAX release (JAX 0.12 needs the
        ``jax_custom_vjp3`` option for it), and forward mode is derived from
        ``bwd`` as with ``defvjp``.

        Where JAX uses ``defvjp``'s rules outside remat when both are given,
        jaxext uses ``defremat``'s everywhere (the gradients are the same), in
        whichever order they were given.

        Args:
            fwd: as for ``defvjp`` (without symbolic zeros): takes the primal's
                arguments; returns ``(output, res)``.
            rem: ``rem(res, *args) -> (output, res2)``: recomputes the output and
                the residuals for ``bwd`` from ``fwd``'s residuals and the
                arguments.
            bwd: as for ``defvjp``, receiving ``res2`` as its residuals.
            generic_batching: accepted for compatibility with ``jax.custom_vjp``;
                it has no effect (see ``defvjp``).

        Raises:
            TypeError: if a rule is not callable.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> import jaxext
            >>> @jaxext.custom_vjp
            ... def f(x):
            ...     return jnp.sin(x) ** 2
            >>> def f_fwd(x):
            ...     s = jnp.sin(x)
            ...     return s**2, s  # saved: sin(x)
            >>> def f_rem(s, x):
            ...     return s**2, 2 * s * jnp.cos(x)  # recomputed on the backward pass
            >>> f.defremat(f_fwd, f_rem, lambda d, g: (g * d,))
            >>> g = jax.grad(jax.checkpoint(f))(jnp.float32(0.5))
            >>> bool(jnp.isclose(g, jnp.sin(1.0)))  # 2 sin(x) cos(x) = sin(2x)
            True
        """
        del generic_batching
        for name, rule in (("fwd", fwd), ("rem", rem), ("bwd", bwd)):
            if not callable(rule):
                raise TypeError(f"`{name}` must be callable; got {type(rule).__name__}.")

        op_name = getattr(self.fun, "__name__", repr(self.fun))

        def remat_fwd(*args: Any) -> tuple[Any, Any]:
            out, res = fwd(*args)
            pair = rem(saved(res), *args)
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise RuleTypeError(
                    f"`{op_name}`: rem must return a pair (output, residuals for bwd); "
                    f"got {type(pair).__name__}."
                )
            rem_out, res2 = pair
            out_tree = jax.tree_util.tree_structure(out)
            if jax.tree_util.tree_structure(rem_out) != out_tree:
                raise RuleTypeError(
                    f"`{op_name}`: rem's output must have fwd's output structure "
                    f"{out_tree}; got {jax.tree_util.tree_structure(rem_out)}."
                )
            # Under jax.checkpoint, the backward pass takes the output from rem too.
            return rematerialized(out, rem_out), res2

        functools.update_wrapper(remat_fwd, fwd)
        self.remat_rules = (fwd, rem, bwd)
        self.fwd, self.bwd, self.jvp = remat_fwd, bwd, None
        self.symbolic_zeros = self.optimize_remat = False

    def def_vmap(self, rule: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
        """Defines the batching rule ``vmap`` uses for the function (usable as a decorator).

        Without a rule, ``vmap`` batches the primal function's operations, as JAX
        does for any function. A rule is what a function JAX cannot batch needs
        (one that calls ``jax.pure_callback`` without a ``vmap_method``, or a C++
        kernel), or one with a better batched form. It has the signature of
        ``jax.custom_batching.custom_vmap``'s rules:
        ``rule(axis_size, in_batched, *args) -> (out, out_batched)``. ``args``
        are the function's arguments with the batch axis first on those whose
        ``in_batched`` flag is True (``nondiff_argnums`` arguments are never
        batched); ``out_batched`` tells which leaves of ``out`` carry the batch
        axis first. The rule is applied at each level of nested ``vmap``.

        The rule covers evaluation: under ``grad``, ``jvp`` and the other
        transformations, the result is batched by the rule wherever ``fwd``
        computes it by calling the decorated function (as in the example), and
        ``bwd`` is batched by JAX. (``jax.custom_batching.custom_vmap`` cannot be
        combined with ``jax.custom_vjp``; this rule composes with every
        transformation.)

        Args:
            rule: the batching rule.

        Returns:
            ``rule``, so that ``def_vmap`` can decorate it.

        Raises:
            TypeError: if ``rule`` is not callable.

        Example:
            >>> import jax, jax.numpy as jnp, numpy as np
            >>> import jaxext
            >>> @jaxext.custom_vjp
            ... def host_sin(x):  # NumPy on the host: JAX can neither batch nor differentiate it
            ...     out = jax.ShapeDtypeStruct(x.shape, x.dtype)
            ...     return jax.pure_callback(lambda a: np.sin(a).astype(a.dtype), out, x)
            >>> @host_sin.def_vmap
            ... def host_sin_vmap(axis_size, in_batched, x):
            ...     return host_sin(x), in_batched[0]  # elementwise: a batch is more elements
            >>> host_sin.defvjp(lambda x: (host_sin(x), jnp.cos(x)), lambda cos_x, g: (g * cos_x,))
            >>> x = jnp.ones((3, 2))
            >>> jax.vmap(jax.grad(lambda x: host_sin(x).sum()))(x)[0]
            Array([0.5403023, 0.5403023], dtype=float32)
        """
        if not callable(rule):
            raise TypeError(f"`rule` must be callable; got {type(rule).__name__}.")
        if isinstance(self.fun, custom_batching.custom_vmap):
            # As jax.custom_vjp forwards `def*` to the function it wraps: the rule is the
            # wrapped custom_vmap's, which the primal applies under vmap.
            return self.fun.def_vmap(rule)
        self.vmap_rule = rule
        return rule

    def __getattr__(self, name: str) -> Any:
        # `def*` methods of the wrapped function (custom_vmap's def_vmap, custom_jvp's
        # defjvp ...) are forwarded to it, as jax.custom_vjp forwards them.
        if name in _JAX_ONLY_METHODS:
            raise AttributeError(
                f"jaxext.custom_vjp has no {name!r}: backward-pass logs and accumulators "
                "(JAX 0.12) live in JAX's internal reverse-mode machinery, which jaxext's "
                "rules do not go through. Use jax.custom_vjp for a function that needs them."
            )
        if name.startswith("def") and "fun" in self.__dict__:
            return getattr(self.fun, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> ReturnValue:
        name = getattr(self.fun, "__name__", _NO_NAME)
        if name is _NO_NAME:
            name = repr(self.fun)
        if self.fwd is None or self.bwd is None:
            raise AttributeError(
                f"No VJP defined for custom_vjp function {name} using defvjp: call "
                f"`{name}.defvjp(fwd, bwd)`."
            )
        if kwargs or len(args) != self._arity():
            args = _resolve_kwargs(self._signature(), name, args, kwargs)
        if self.differentiate_fwd and _jvp_from_vjp.runs_plain(self):
            return self.fun(*args)  # inside its own fwd, differentiated by JAX
        for i in self.nondiff_argnums:
            if i >= len(args):
                raise TypeError(
                    f"`{name}`: nondiff_argnums={self.nondiff_argnums} names argument {i}, but "
                    f"only {len(args)} were given."
                )
            if any(
                isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(args[i])
            ):
                raise jax.errors.UnexpectedTracerError(
                    f"`{name}`: found a JAX Tracer object passed as an argument to a "
                    f"custom_vjp function in a position indicated by nondiff_argnums as "
                    f"non-differentiable ({arg_label(self.fun, i)}). Tracers cannot be passed "
                    "as non-differentiable arguments to custom_vjp functions; nondiff_argnums "
                    "is for Python values (flags, shapes, functions). Pass an array as a "
                    "differentiable argument and return None as its gradient."
                )
        diff = [i for i in range(len(args)) if i not in self.nondiff_argnums]
        diff_args = tuple(args[i] for i in diff)
        if not any(
            isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(diff_args)
        ):
            # Nothing can differentiate or batch a value that is not traced.
            return self.fun(*args)
        op = _Op(self, name, args, tuple(diff))
        primal = jax.custom_jvp(
            op.named_primal(True) if self.vmap_rule is None else op.batched_primal(True)
        )
        primal.defjvp(op.jvp_rule, symbolic_zeros=True)
        return primal(*diff_args)


_NO_NAME = object()  # a function without a __name__ is named by its repr

# jax.custom_vjp methods (JAX 0.12) that jaxext.custom_vjp does not provide.
_JAX_ONLY_METHODS = frozenset({"defvjp_with_logs", "defvjp_with_accums", "defremat_with_logs"})


def _positions_of(signature: inspect.Signature | None, names: Sequence[str]) -> list[int]:
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


def _resolve_kwargs(
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
            "custom_vjp functions take positional arguments. (JAX: The following keyword "
            f"arguments could not be resolved to positions: {', '.join(passed)})"
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


_JAX_BWD_TUPLE = (  # JAX's wording, which users' code may match on
    "(JAX: Custom VJP bwd rule must produce an output with the same container (pytree) "
    "structure as the args tuple of the primal function, and in particular must produce a "
    "tuple of length equal to the number of arguments to the primal function.)"
)


def _broadcast_prefix(grad: Any, tree: Any) -> list[Any]:
    """The leaves of ``grad`` broadcast to the leaves of ``tree``, of which it is a prefix.

    As in ``jax.custom_vjp``: a ``None`` (or one array) where the argument has a
    subtree stands for every leaf of that subtree.
    """
    if tree.num_leaves == 0:  # an argument without arrays (None, an empty tuple)
        if jax.tree_util.tree_leaves(grad):
            raise TypeError("a gradient for an argument without arrays")
        return []
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


def without_derivatives(call: Callable[..., Any], message: str) -> custom_vjp:
    """``call`` as a ``custom_vjp`` whose every derivative rule raises ``RuntimeError(message)``.

    Evaluating it runs ``call``; differentiating it, in reverse or forward mode,
    raises at trace time. Every array ``call`` reads must be one of its
    arguments, so that no derivative can bypass the rules. Transposing it (when
    ``call`` is linear) is not differentiating it and works.
    """

    def refuse(*_: Any) -> Any:
        raise RuntimeError(message)

    blocked = custom_vjp(call)
    blocked.defvjp(lambda *args: (call(*args), None), refuse, jvp=refuse)
    return blocked


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


def _is_array_leaf(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _dtype(value: Any) -> Any:
    """``jnp.result_type(value)``, read directly off an array."""
    return value.dtype if isinstance(value, jax.Array) else jnp.result_type(value)


def _is_float(dtype: Any) -> bool:
    """Whether values of ``dtype`` are differentiated, as JAX decides: their tangent dtype
    is not ``float0`` (floats, complex numbers, and extended dtypes with a tangent dtype,
    such as Flax's FP8 ``fp32_max_grad``, whose tangent dtype is itself)."""
    return primal_dtype_to_tangent_dtype(dtype) != jax.dtypes.float0


def _as_dtype(dtype: Any) -> Any:
    """``jnp.dtype(dtype)``; an extended dtype (which NumPy cannot interpret) as it is."""
    return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jnp.dtype(dtype)


def _zeros_like(value: Any) -> jax.Array:
    """A zero tangent for ``value`` (see :func:`_zeros`)."""
    aval = jax.typeof(value)
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return _zeros(aval.to_tangent_aval())
    return jnp.zeros_like(value)


def _zeros(aval: Any) -> jax.Array:
    """Zeros of type ``aval``; for an extended dtype, the zero of its own rules (as JAX's)."""
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return ad.instantiate_zeros(ad.Zero(aval))
    return jnp.zeros(aval.shape, aval.dtype)


class _Op:
    """One call of a :class:`custom_vjp`: its arguments split into static and traced."""

    def __init__(self, spec: custom_vjp, name: str, args: tuple, diff: tuple[int, ...]):
        self.spec, self.name, self.args, self.diff = spec, name, args, diff
        # The primal's output type, recorded when JAX traces the primal (see output_type).
        self.traced_output: Any = None

    def merge(self, diff_values: Sequence[Any]) -> list[Any]:
        full = list(self.args)
        for i, value in zip(self.diff, diff_values, strict=True):
            full[i] = value
        return full

    def nondiff(self) -> list[Any]:
        return [self.args[i] for i in self.spec.nondiff_argnums]

    def label(self, k: int) -> str:
        return arg_label(self.spec.fun, self.diff[k])

    def primal(self, *diff_values: Any) -> Any:
        try:
            out = self.spec.fun(*self.merge(diff_values))
        except jax.errors.ConcretizationTypeError as err:
            name_user_function(err, self.spec.fun, self.diff)
            raise
        return out

    def named_primal(self, record: bool = False) -> Callable[..., Any]:
        """The primal, named after the user's function (for jaxprs and profiles).

        ``record``: for the function JAX traces as the call's primal, which notes the output
        type it found (``traced_output``).
        """

        def primal(*diff_values: Any) -> Any:
            out = self.primal(*diff_values)
            if record:
                self.traced_output = _output_type(out)
            return out

        primal.__name__ = primal.__qualname__ = self.name
        primal.__signature__ = _PRIMAL_SIGNATURE  # what inspect finds, without looking
        return primal

    def batched_primal(self, record: bool = False) -> Callable[..., Any]:
        """The primal with the user's batching rule, as a ``custom_vmap`` (``record``: as
        for :meth:`named_primal`)."""
        batched = custom_batching.custom_vmap(self.named_primal(record))

        @batched.def_vmap
        def rule(axis_size: int, in_batched: Sequence[Any], *diff_values: Any) -> Any:
            flags: list[Any] = [False] * len(self.args)
            for i, b in zip(self.diff, in_batched, strict=True):
                flags[i] = b
            out, out_batched = self.spec.vmap_rule(axis_size, flags, *self.merge(diff_values))
            try:
                jax.tree_util.tree_structure(out).flatten_up_to(out_batched)
            except (ValueError, TypeError):
                raise RuleTypeError(
                    f"`{self.name}`: the vmap rule must return `(out, out_batched)` with one "
                    f"bool of out_batched per leaf of out; got out_batched={out_batched!r}."
                ) from None
            return out, out_batched

        return batched

    def jvp_rule(self, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
        in_leaves, in_tree = jax.tree_util.tree_flatten(primals)
        t_leaves = in_tree.flatten_up_to(tangents)
        perturbed = tuple(
            not isinstance(t, SymbolicZero) and _is_float(_dtype(p))
            for p, t in zip(in_leaves, t_leaves, strict=True)
        )
        t_in = [t for t, q in zip(t_leaves, perturbed, strict=True) if q]
        # The one question to the eager cache: which steps to take (``None``: as written).
        eager = _eager_cache.lookup(self) or _PLAIN
        return eager.jvp(self, primals, in_leaves, in_tree, perturbed, t_in)

    def traced_jvp(
        self,
        primals: tuple,
        in_leaves: list[Any],
        in_tree: Any,
        perturbed: tuple,
        t_in: list,
        eager: Any,
    ) -> tuple[Any, Any]:
        """The JVP rule's work: ``fwd``, then the output tangent as ``tangent_p``.

        ``eager`` takes the steps that eager calls may take faster (see :class:`_Plain`).
        """
        if self.spec.symbolic_zeros:
            wrapped = [CustomVJPPrimal(p, q) for p, q in zip(in_leaves, perturbed, strict=True)]
            fwd_args = jax.tree_util.tree_unflatten(in_tree, wrapped)
        else:
            fwd_args = primals
        if self.spec.optimize_remat:
            result = run_fwd(self, fwd_args)
        else:
            result = eager.fwd(self, fwd_args, in_leaves)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(
                f"`{self.name}`: fwd must return a pair (output, residuals); got "
                f"{type(result).__name__}. {self.jax_fwd_phrase()}"
            )
        out, res = result
        if self.traced_output is not None:  # the JVP rule runs after the primal's trace
            self.check_no_stale_closure()
        self.check_fwd_output(out, self.output_type(primals, eager))
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        res_leaves, res_tree = jax.tree_util.tree_flatten(res)
        res_is_array = tuple(_is_array_leaf(leaf) for leaf in res_leaves)
        res_arrays = [_as_array(r) for r, a in zip(res_leaves, res_is_array, strict=True) if a]
        res_static = tuple(None if a else r for r, a in zip(res_leaves, res_is_array, strict=True))
        out_float = tuple(_is_float(_dtype(o)) for o in out_leaves)
        lin = _Linear(
            op=self,
            in_tree=in_tree,
            in_avals=tuple(jax.typeof(p) for p in in_leaves),
            perturbed=perturbed,
            res_tree=res_tree,
            res_is_array=res_is_array,
            res_static=res_static,
            out_tree=out_tree,
            out_avals=tuple(jax.typeof(o) for o in out_leaves),
            out_float=out_float,
            eager=eager,
        )
        staged = _jvp_from_vjp.staged(in_leaves, res_arrays, t_in)
        if t_in and staged and self.spec.hoist_closures:
            res_arrays = [*res_arrays, *lin.hoist(res_arrays)]  # staged: see _Linear.hoist
        if t_in and self.spec.differentiate_fwd and self.spec.jvp is None:
            res_arrays = [*res_arrays, *lin.fwd_operands(in_leaves, staged)]
        float_tangents = iter(tangent_p.bind(*res_arrays, *t_in, lin=lin) if t_in else [])
        out_tangents = []
        for o, is_float in zip(out_leaves, out_float, strict=True):
            if not is_float:
                out_tangents.append(np.zeros(np.shape(o), jax.dtypes.float0))
            elif t_in:
                out_tangents.append(next(float_tangents))
            else:
                out_tangents.append(_zeros_like(o))
        return out, jax.tree_util.tree_unflatten(out_tree, out_tangents)

    def call_fwd(self, fwd_args: Sequence[Any]) -> Any:
        """Runs ``fwd`` on ``fwd_args`` (the differentiable arguments) and the nondiff ones."""
        return self.spec.fwd(*self.merge(fwd_args))

    def jax_fwd_phrase(self, instead: str = "") -> str:
        """JAX's wording of a wrong fwd output, which users' code may match on.

        ``instead`` completes JAX's sentence (what fwd's output was instead); without it, the
        sentence stops after its key phrase.
        """
        fwd_name = getattr(self.spec.fwd, "__name__", "fwd")
        sentence = (
            f"Custom VJP fwd rule {fwd_name} for function {self.name} must produce a pair "
            "(list or tuple of length two) where the first element represents the primal "
            "output"
        )
        if not instead:
            return f"(JAX: {sentence}.)"
        return (
            f"(JAX: {sentence} (equal to the output of the custom_vjp-decorated function "
            f"{self.name}) and the second element represents residuals (i.e. values stored "
            "from the forward pass for use on the backward pass), but instead the fwd rule "
            f"output's first element had {instead})"
        )

    def jax_fwd_mismatch(self, what: str, got: Any, expected: Any) -> str:
        """JAX's full sentence for a fwd output of the wrong ``what`` (structure or type)."""
        kind = "container/pytree structure:" if what == "structure" else "shapes/dtypes of:"
        got_s, exp_s = (
            str(jax.tree_util.tree_map(_short, tree)).replace("'", "") for tree in (got, expected)
        )
        end = "." if what == "structure" else ""
        return self.jax_fwd_phrase(
            f"{kind}\n    {got_s}\nwhile the custom_vjp-decorated function {self.name} had "
            f"output {kind}\n    {exp_s}{end}"
        )

    def check_no_stale_closure(self) -> None:
        """Raises where ``fwd`` read a value traced by a transformation that has ended.

        JAX traces the JVP rule of a primal it traced earlier (under ``jit``, ``scan``
        ...) when it differentiates that traced program, after the trace the primal ran
        in. A value of that trace the rules close over (a model a diffrax vector field
        closes over, under ``jit``) is stale there; JAX would fail later, when it lowers
        the program, with "No constant handler for type: ...Tracer".
        """
        if not _stale_tracers():
            return
        name = self.name
        raise RuleTypeError(
            f"`{name}`: its rules close over a traced value (one being differentiated, or "
            f"one computed inside a `jit`, `scan` or other traced function around the call "
            f"of `{name}`) that they cannot read when JAX differentiates that traced "
            "function after tracing it: the rules only give derivatives with respect to "
            f"explicit arguments. Pass the value to `{name}` as an argument, and return "
            "its gradient from bwd (None where it needs none). (JAX: Detected "
            "differentiation of a custom_vjp function with respect to a closed-over value. "
            "That isn't supported because the custom VJP rule only specifies how to "
            "differentiate the custom_vjp function with respect to explicit input "
            "parameters.)"
        )

    def output_type(self, primals: tuple, eager: Any) -> Any:
        """The primal's output type, to check ``fwd``'s against (``None``: not known).

        Where JAX traced the primal (under ``jit``, ``scan`` and the like, before it
        linearizes the traced program), the type it found: the JVP rule may run later,
        outside the context the primal was called in (Flax NNX's update context), where
        the primal cannot be traced again. Otherwise (eager ``grad``, ``jvp``) the primal
        is traced abstractly here, as ``eager`` does it.
        """
        if self.traced_output is not None:
            return self.traced_output
        return eager.expected_output(self, primals)

    def abstract_output(self, primals: tuple) -> Any:
        """The primal's output type for ``primals`` (``None``: it cannot be traced abstractly).

        Python numbers among ``primals`` (an eager ``grad`` hands a Python float input to
        the rules as one) stay Python numbers, as ``fwd`` sees them: a library may treat
        them apart from arrays (Equinox keeps them as static data, out of the pytree).
        """
        leaves, tree = jax.tree_util.tree_flatten(primals)
        is_array = [_is_array_leaf(leaf) for leaf in leaves]

        def primal(*arrays: Any) -> Any:
            it = iter(arrays)
            merged = [next(it) if a else leaf for leaf, a in zip(leaves, is_array, strict=True)]
            return self.primal(*jax.tree_util.tree_unflatten(tree, merged))

        try:
            return jax.eval_shape(primal, *[x for x, a in zip(leaves, is_array, strict=True) if a])
        except jax.errors.ConcretizationTypeError:
            # The primal branches in Python on its inputs' values: it cannot be traced
            # abstractly, and JAX itself never traces it when differentiating eagerly. Trust
            # fwd's output, as jax.custom_vjp does there.
            return None

    def check_fwd_output(self, out: Any, expected: Any) -> None:
        """Raises unless ``fwd``'s output ``out`` has the primal's output type ``expected``."""
        if expected is None:
            return
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        exp_leaves, exp_tree = jax.tree_util.tree_flatten(expected)
        if out_tree == exp_tree and all(
            np.shape(o) == e.shape and _dtype(o) == e.dtype
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
                f"`{self.name}`: fwd's output must have the primal's structure {exp_tree}; "
                f"got {got_tree}. {self.jax_fwd_mismatch('structure', got, expected)}"
            )
        exp_leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
        for (path, e), g in zip(exp_leaves, jax.tree_util.tree_leaves(got), strict=True):
            if e.shape != g.shape or _as_dtype(e.dtype) != _as_dtype(g.dtype):
                # JAX's sentence, then its newer custom_vjp's wording of the same mismatch.
                raise TypeError(
                    f"`{self.name}`: fwd's output must have the primal's shapes and dtypes "
                    f"{e.dtype}{list(e.shape)}; got {g.dtype}{list(g.shape)}. "
                    f"{self.jax_fwd_mismatch('type', got, expected)} (JAX: at output"
                    f"{jax.tree_util.keystr(path)}, got fwd output type {_short(g)} which "
                    f"doesn't match primal output type {_short(e)}.)"
                )


def _stale_tracers() -> list[Any]:
    """Tracers among the constants of the jaxpr being traced that belong to no enclosing trace.

    Reads JAX's tracing state through attributes it does not document (``frame``,
    ``parent_trace``, ``_trace``): where they are missing, it finds nothing.
    """
    with take_current_trace() as trace:
        pass
    values = getattr(getattr(trace, "frame", None), "constvar_to_val", None)
    if not values:
        return []
    enclosing = set()
    while trace is not None:
        enclosing.add(id(trace))
        trace = getattr(trace, "parent_trace", None)
    foreign = [
        v
        for v in list(values.values())
        if isinstance(v, jax.core.Tracer) and hasattr(v, "_trace") and id(v._trace) not in enclosing
    ]
    # JAX does not link every trace to the one around it: a jaxpr trace still being built
    # (its tracing function is on the call stack) takes its tracers back when the jaxpr
    # being traced now is inlined into it. Any other foreign tracer (of a jaxpr trace that
    # has ended, or an autodiff tracer) would be taken for a constant.
    return [v for v in foreign if not (hasattr(v._trace, "frame") and _on_call_stack(v._trace))]


def _on_call_stack(trace: Any) -> bool:
    """Whether a function running now is building ``trace`` (JAX's tracing functions hold
    the trace they build in a local variable named ``trace``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_locals.get("trace") is trace:
            return True
        frame = frame.f_back
    return False


def _output_type(out: Any) -> Any:
    """``out`` with each leaf replaced by its shape and dtype (a ``jax.ShapeDtypeStruct``)."""
    return jax.tree_util.tree_map(lambda o: jax.ShapeDtypeStruct(np.shape(o), _dtype(o)), out)


def _primal_template(*diff_values: Any) -> Any:
    """Has the signature of :meth:`_Op.named_primal`'s functions."""
    del diff_values


# JAX inspects the signature of the functions a custom_jvp gets at every call (for debug
# information); these are what it finds, precomputed.
_PRIMAL_SIGNATURE = inspect.signature(_primal_template)
_Op.jvp_rule.__signature__ = inspect.signature(_Op.jvp_rule)  # type: ignore[attr-defined]


class _Plain:
    """The steps of a call that eager work may take faster, taken as written.

    The JVP rule takes these unless :func:`jaxext._eager_cache.lookup` gives steps of
    the same meaning that reuse eager work; every value and error is the same either way.
    """

    def jvp(
        self,
        op: _Op,
        primals: tuple,
        in_leaves: list[Any],
        in_tree: Any,
        perturbed: tuple,
        t_in: list,
    ) -> tuple[Any, Any]:
        """The JVP rule's output (primal output, output tangent)."""
        return op.traced_jvp(primals, in_leaves, in_tree, perturbed, t_in, self)

    def fwd(self, op: _Op, fwd_args: Sequence[Any], in_leaves: Sequence[Any]) -> Any:
        """``fwd``'s result for ``fwd_args``, whose array leaves are ``in_leaves``."""
        del in_leaves
        return op.call_fwd(fwd_args)

    def expected_output(self, op: _Op, primals: tuple) -> Any:
        """The primal's output type for ``primals`` (``None``: not traceable abstractly)."""
        return op.abstract_output(primals)

    def tangent(self, lin: _Linear, args: Sequence[Any]) -> list[jax.Array]:
        """``J t`` evaluated on concrete operands ``args`` (the tangent primitive's impl)."""
        return lin.apply(args)


_PLAIN = _Plain()


class _Linear:
    """Static description of ``t -> J t`` for one traced call (a primitive parameter).

    Hashed by identity, as primitive parameters holding functions must be.
    """

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)
        self.n_res = self.n_own = sum(self.res_is_array)
        self.hoisted_bwd: Callable[..., Any] | None = None
        self.traced_bwd: Callable[..., Any] | None = None  # bwd as hoist traced it
        self.hoisted_jvp: Callable[..., Any] | None = None
        self.hoisted_fwd: Callable[..., Any] | None = None
        self.n_bwd_consts = self.n_jvp_consts = 0
        self.fwd_start = self.n_fwd_consts = 0  # differentiate_fwd: see fwd_operands
        self.ct_avals = tuple(
            a.to_tangent_aval() for a, f in zip(self.out_avals, self.out_float, strict=True) if f
        )

    @functools.cached_property
    def t_avals(self) -> tuple[Any, ...]:
        """The types of the tangent operands (made when asked: eager ``grad`` never asks)."""
        return tuple(
            a.to_tangent_aval() for a, q in zip(self.in_avals, self.perturbed, strict=True) if q
        )

    def __repr__(self) -> str:
        return f"<jaxext.custom_vjp {self.op.name}>"

    def apply(self, args: Sequence[Any]) -> list[jax.Array]:
        """``J t`` for the primitive's operands ``args`` (residuals, then tangents)."""
        res, t = _split(args, self)
        return self.tangent(res, t)

    # -- residuals ---------------------------------------------------------------------

    def residuals(self, res_arrays: Sequence[Any]) -> Any:
        arrays = iter(res_arrays)
        leaves = [
            next(arrays) if is_array else static
            for is_array, static in zip(self.res_is_array, self.res_static, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.res_tree, leaves)

    # -- the backward: cotangents of the float outputs -> gradients of perturbed inputs --

    def hoist(self, res_arrays: Sequence[Any]) -> list[Any]:
        """Makes the tracers ``bwd`` and ``jvp`` close over explicit operands; returns them.

        The tangent primitive runs ``bwd`` (transposed) or ``jvp`` when it is evaluated or
        lowered, after the trace that made it has ended. Tracers of that trace that the
        rules close over (a traced scale under ``jit``, a ``scan`` carry) would be stale
        there, so they travel as operands, after the residuals, as ``jax.closure_convert``
        arranges. A rule that cannot be traced abstractly (Python control flow on a
        residual's value) is left as it is.
        """
        cts = [jnp.zeros(a.shape, a.dtype) for a in self.ct_avals]
        t_in = [jnp.zeros(a.shape, a.dtype) for a in self.t_avals]
        own = list(res_arrays)
        consts: list[Any] = []
        try:
            bwd, bwd_consts = _jvp_from_vjp.closure_convert(self.own_backward, own, cts)
        except Exception:  # noqa: BLE001 -- a dry run: the rule itself runs (and raises) later
            bwd, bwd_consts = None, []
        self.traced_bwd = bwd  # reverse mode reuses it (see backward)
        if bwd_consts:
            self.hoisted_bwd, self.n_bwd_consts = bwd, len(bwd_consts)
            consts += bwd_consts
        if self.op.spec.jvp is not None:
            try:
                jvp, jvp_consts = _jvp_from_vjp.closure_convert(self.own_user_jvp, own, t_in)
            except Exception:  # noqa: BLE001 -- as above
                jvp, jvp_consts = None, []
            if jvp_consts:
                self.hoisted_jvp, self.n_jvp_consts = jvp, len(jvp_consts)
                consts += jvp_consts
        self.n_res = self.n_own + len(consts)
        return consts

    def fwd_operands(self, in_leaves: Sequence[Any], staged: bool) -> list[Any]:
        """With ``differentiate_fwd``: the operands ``J t`` needs, after the others.

        The input leaves (``fwd`` is differentiated at them), then, when staged, the
        tracers ``fwd`` closes over (hoisted as in :meth:`hoist`).
        """
        primals = [_as_array(p) for p in in_leaves]
        consts: list[Any] = []
        if staged:
            try:
                fwd, consts = _jvp_from_vjp.closure_convert(
                    _jvp_from_vjp.fwd_outputs(self), *primals
                )
            except Exception:  # noqa: BLE001 -- a dry run: fwd itself runs (and raises) later
                fwd, consts = None, []
            if consts:
                self.hoisted_fwd = fwd
        self.fwd_start, self.n_fwd_consts = self.n_res, len(consts)
        self.n_res += len(primals) + len(consts)
        return [*primals, *consts]

    def backward(self, res_arrays: Sequence[Any], cts: Sequence[Any]) -> list[jax.Array]:
        """Runs ``bwd`` (reverse mode); ``cts`` has one entry (``None`` for zero) per float output.

        Reverse mode transposes the tangent primitive inside the trace that made it, so
        ``bwd`` runs as written, on its own residuals, with symbolic zeros as it asked.
        Where :meth:`hoist` already traced ``bwd`` (on every cotangent), that trace is
        reused, so that ``bwd`` is traced once per compilation, as with
        ``jax.custom_vjp`` (code counting its traces, or printing at trace time, sees one).
        """
        dense = not self.op.spec.symbolic_zeros or all(ct is not None for ct in cts)
        # hoist traced on cotangents that vary over no shard_map axis: not reused inside one
        plain = not any(_varying_axes(a) for a in self.ct_avals)
        # nor on operands split over several devices: hoist traced on unsplit cotangents, and
        # what bwd does can depend on the split (a C++ kernel's partition rule reads it)
        whole = not _split_over_devices([*res_arrays[: self.n_own], *cts])
        if self.traced_bwd is not None and dense and plain and whole:
            return self.staged_backward(res_arrays, cts, self.traced_bwd)
        return self.own_backward(res_arrays[: self.n_own], cts)

    def staged_backward(
        self, res_arrays: Sequence[Any], cts: Sequence[Any], traced: Any = None
    ) -> list[jax.Array]:
        """``bwd`` for forward mode, which may run after the trace: with hoisted closures.

        ``traced``: a closure-converted ``bwd`` to run (:meth:`hoist`'s), when not
        ``hoisted_bwd``.
        """
        traced = traced or self.hoisted_bwd
        if traced is None:
            return self.own_backward(res_arrays[: self.n_own], cts)
        own, hoisted = res_arrays[: self.n_own], res_arrays[self.n_own :]
        cts = [
            jnp.zeros(a.shape, a.dtype) if ct is None else ct
            for ct, a in zip(cts, self.ct_avals, strict=True)
        ]
        return list(traced(list(own), list(cts), *hoisted[: self.n_bwd_consts]))

    def own_backward(self, res_arrays: Sequence[Any], cts: Sequence[Any]) -> list[jax.Array]:
        """``bwd`` itself, on the op's own residuals."""
        spec = self.op.spec
        ct_iter = iter(cts)
        leaves = []
        for aval, is_float in zip(self.out_avals, self.out_float, strict=True):
            ct = next(ct_iter) if is_float else None
            if ct is None:
                tangent_aval = aval.to_tangent_aval()
                ct = SymbolicZero(tangent_aval) if spec.symbolic_zeros else _zeros(tangent_aval)
            leaves.append(ct)
        g = jax.tree_util.tree_unflatten(self.out_tree, leaves)
        grads = spec.bwd(*self.op.nondiff(), self.residuals(res_arrays), g)
        return self.check_grads(grads)

    def check_grads(self, grads: Any) -> list[jax.Array]:
        name, n = self.op.name, len(self.op.diff)
        if not isinstance(grads, (tuple, list)):
            raise RuleTypeError(
                f"`{name}`: bwd must return a tuple with one gradient per differentiable "
                f"argument ({n}); got {type(grads).__name__}. {_JAX_BWD_TUPLE}"
            )
        grads = tuple(grads)
        if len(grads) > n and any(g is not None for g in grads[n:]):
            raise RuleValueError(
                f"`{name}`: bwd returned {len(grads)} gradients; expected {n}, one per "
                f"differentiable argument (extra trailing values must be None). {_JAX_BWD_TUPLE}"
            )
        if len(grads) < n:
            missing = ", ".join(self.op.label(k) for k in range(len(grads), n))
            raise RuleTypeError(
                f"`{name}`: bwd returned {len(grads)} gradient(s); expected {n}, one per "
                f"differentiable argument: none for {missing}. Return None for an argument "
                f"whose gradient is zero. {_JAX_BWD_TUPLE}"
            )
        grads = grads[:n]
        arg_trees = self.in_tree.children()
        flat: list[Any] = []
        for k, (grad, tree) in enumerate(zip(grads, arg_trees, strict=True)):
            try:
                flat.extend(_broadcast_prefix(grad, tree))
            except (ValueError, TypeError):
                raise RuleTypeError(
                    f"`{name}`: bwd's gradient for {self.op.label(k)} must have the argument's "
                    f"structure {tree} (or a prefix of it); got "
                    f"{jax.tree_util.tree_structure(grad)}."
                ) from None
        result = []
        for i, (grad, aval, q) in enumerate(zip(flat, self.in_avals, self.perturbed, strict=True)):
            if not q:
                if isinstance(grad, SymbolicZero):  # checked even where no gradient is needed
                    self.finish(grad, aval.to_tangent_aval(), functools.partial(self.where, i))
                continue
            # A gradient has its input's cotangent type (a reduced input's is unreduced).
            ct_aval = aval.to_ct_aval() if hasattr(aval, "to_ct_aval") else aval
            where = functools.partial(self.where, i, with_path=True)
            result.append(self.finish(grad, ct_aval, where))
        return result

    def where(self, leaf: int, with_path: bool = False) -> tuple[str, str | None]:
        """Input leaf ``leaf``'s argument label and, ``with_path``, JAX's ``output[k]...`` path."""
        labels, paths = self.leaf_labels()
        return labels[leaf], paths[leaf] if with_path else None

    def leaf_labels(self) -> tuple[list[str], list[str]]:
        """Per input leaf: the argument's label and JAX's ``output[k]...`` path.

        Made only for an error message (it inspects the function's signature).
        """
        labels, paths = [], []
        for k, tree in enumerate(self.in_tree.children()):
            labels.extend([self.op.label(k)] * tree.num_leaves)
            leaves = jax.tree_util.tree_flatten_with_path(
                jax.tree_util.tree_unflatten(tree, range(tree.num_leaves))
            )[0]
            paths.extend(f"output[{k}]{jax.tree_util.keystr(p)}" for p, _ in leaves)
        return labels, paths

    def finish(
        self,
        grad: Any,
        aval: Any,
        where: Callable[[], tuple[str, str | None]],
        rule: str = "bwd",
    ) -> jax.Array:
        """Checks one gradient (``rule="bwd"``) or output tangent (``rule="jvp"``).

        ``where()`` gives, for an error message only, the label of what is checked and
        JAX's path (``output[k]...``, or ``None``) that adds JAX's wording of a
        shape/dtype mismatch.
        """
        value, side = ("gradient", "input") if rule == "bwd" else ("tangent", "output")
        name = self.op.name

        def jax_phrase(got: Any, jax_path: str | None) -> str:
            if jax_path is None:
                return ""
            return (
                " (JAX: Custom VJP bwd rule must produce an output with the same type as the "
                f"args tuple of the primal function, but at {jax_path} the bwd rule produced "
                f"an output of type {_short(got)} corresponding to an input of type "
                f"{_short(aval)}.)"
            )

        if isinstance(grad, SymbolicZero) and (
            tuple(grad.shape) != tuple(aval.shape) or _as_dtype(grad.dtype) != _as_dtype(aval.dtype)
        ):
            label, _ = where()
            raise RuleValueError(
                f"`{name}`: {rule} returned a SymbolicZero for {label} of shape/dtype "
                f"{_as_dtype(grad.dtype)}{list(grad.shape)}; the {side} has "
                f"{_as_dtype(aval.dtype)}{list(aval.shape)}. Consider just returning a None here "
                "instead of a SymbolicZero object."
            )
        if grad is None or isinstance(grad, SymbolicZero):
            return _zeros(aval)
        if _bwd_checks_disabled() and _is_array_leaf(grad):
            # As jax.custom_vjp with jax_disable_bwd_checks: the gradient as bwd made it.
            grad = jnp.asarray(grad)
            if tuple(grad.shape) == tuple(aval.shape):
                return _match_type(grad.astype(aval.dtype), aval)
            return grad
        if not _is_array_leaf(grad):
            if isinstance(grad, (int, float)) and not isinstance(grad, bool) and aval.shape == ():
                if rule == "bwd" and isinstance(grad, float) and aval.dtype == _PY_FLOAT():
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
        if _as_dtype(grad.dtype) != _as_dtype(aval.dtype):
            label, jax_path = where()
            raise RuleTypeError(
                f"`{name}`: {rule}'s {value} for {label} must have the {side}'s dtype "
                f"{_as_dtype(aval.dtype)}; got {_as_dtype(grad.dtype)} (cast it with .astype)."
                f"{jax_phrase(grad, jax_path)}"
            )
        return _match_type(_as_array(grad), aval)

    # -- forward mode ------------------------------------------------------------------

    def tangent(self, res_arrays: Sequence[Any], t_in: Sequence[Any]) -> list[jax.Array]:
        """``J t`` for the float outputs: from the user's ``jvp``, by differentiating
        ``fwd`` (``differentiate_fwd``) or from ``bwd`` (see ``_jvp_from_vjp``)."""
        if self.op.spec.jvp is not None:
            return self.user_jvp(res_arrays, t_in)
        if self.op.spec.differentiate_fwd:
            start, n_in = self.fwd_start, len(self.in_avals)
            primals = res_arrays[start : start + n_in]
            consts = res_arrays[start + n_in : start + n_in + self.n_fwd_consts]
            return _jvp_from_vjp.tangent_of_fwd(self, primals, consts, t_in)
        message = self.op.spec.no_derivatives_message
        if message is not None:
            # The backward must not be differentiated (once_differentiable): transposing it
            # is fine, differentiating that transpose (reverse over forward) is not.
            return without_derivatives(self.transposed, message)(list(res_arrays), list(t_in))
        return self.transposed(res_arrays, t_in)

    def transposed(self, res_arrays: Sequence[Any], t_in: Sequence[Any]) -> list[jax.Array]:
        """``J t`` as the transpose of ``bwd``."""
        examples = [_jvp_from_vjp.stand_in(a) for a in self.ct_avals]
        hint = self.op.spec.forward_mode_hint or (
            f"give a JVP rule: `{self.op.name}.defvjp(fwd, bwd, jvp=jvp)` with "
            "`jvp(*nondiff_args, residuals, tangents) -> output tangent`"
        )
        self.check_linear(res_arrays, examples, hint)
        return _jvp_from_vjp.tangent_from_backward(self, res_arrays, t_in)

    def check_linear(self, res_arrays: Sequence[Any], examples: list[Any], hint: str) -> None:
        """Raises unless ``bwd`` is linear in its cotangent, as transposing it assumes.

        ``jax.linear_transpose`` silently drops a term that does not depend on the
        cotangent, so this is checked on the backward's jaxpr first.
        """
        kinds = nonlinearities(lambda *cts: self.staged_backward(res_arrays, list(cts)), examples)
        labels = [
            self.op.label(k)
            for k, tree in enumerate(self.in_tree.children())
            for _ in range(tree.num_leaves)
        ]
        labels = [label for label, q in zip(labels, self.perturbed, strict=True) if q]
        for (kind, where), label in zip(kinds, labels, strict=True):
            if kind in (Kind.CONST, Kind.AFFINE):
                problem = "has a term that does not depend on the cotangent"
            elif kind == Kind.NONLINEAR:
                problem = f"uses the cotangent nonlinearly (in {where})"
            else:
                continue
            raise RuleTypeError(
                f"`{self.op.name}`: forward-mode differentiation (jvp, jacfwd, linearize, "
                "hessian) of a jaxext.custom_vjp function is derived by transposing its bwd, "
                f"which must be linear in its cotangent; bwd's gradient for {label} {problem}. "
                f"A correct bwd computes g -> J^T g; if this one is meant, {hint}."
            )

    def user_jvp(self, res_arrays: Sequence[Any], t_in: Sequence[Any]) -> list[jax.Array]:
        if self.hoisted_jvp is None:
            return self.own_user_jvp(res_arrays, t_in)
        own, hoisted = res_arrays[: self.n_own], res_arrays[self.n_own + self.n_bwd_consts :]
        return list(self.hoisted_jvp(list(own), list(t_in), *hoisted))

    def own_user_jvp(self, res_arrays: Sequence[Any], t_in: Sequence[Any]) -> list[jax.Array]:
        """The user's ``jvp`` rule itself, on the op's own residuals."""
        name = self.op.name
        t_iter = iter(t_in)
        leaves = [
            next(t_iter) if q else jnp.zeros(a.to_tangent_aval().shape, a.to_tangent_aval().dtype)
            for a, q in zip(self.in_avals, self.perturbed, strict=True)
        ]
        tangents = tuple(jax.tree_util.tree_unflatten(self.in_tree, leaves))
        out = self.op.spec.jvp(*self.op.nondiff(), self.residuals(res_arrays), tangents)
        try:
            flat = self.out_tree.flatten_up_to(out)
        except (ValueError, TypeError):
            raise RuleTypeError(
                f"`{name}`: jvp must return a tangent with the output's structure "
                f"{self.out_tree}; got {jax.tree_util.tree_structure(out)}."
            ) from None
        result = []
        for t, aval, is_float in zip(flat, self.out_avals, self.out_float, strict=True):
            if is_float:
                result.append(self.finish(t, aval.to_tangent_aval(), _the_output, "jvp"))
        return result


def _the_output() -> tuple[str, None]:
    """What a ``jvp`` rule's output tangent is called in an error message."""
    return "the output", None


def _as_array(value: Any) -> Any:
    """``jnp.asarray(value)``; a concrete JAX array is returned as it is (what that gives)."""
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        return value
    return jnp.asarray(value)


def _PY_FLOAT() -> Any:  # noqa: N802 -- reads like the constant it stands for
    """The dtype a Python float takes (float32, or float64 with ``jax_enable_x64``)."""
    return jnp.result_type(float)


def _short(value: Any) -> str:
    """``float32[3]``: a value's dtype and shape, as JAX's messages write them."""
    return f"{_as_dtype(value.dtype).name}[{','.join(str(d) for d in value.shape)}]"


def _match_type(grad: jax.Array, aval: Any) -> jax.Array:
    """Sums over mesh axes ``grad`` varies over but its input does not; reshards like it."""
    extra = tuple(sorted(_varying_axes(jax.typeof(grad)) - _varying_axes(aval), key=str))
    if extra:
        grad = jax.lax.psum(grad, extra)
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())
    if explicit and jax.typeof(grad).sharding != sharding:
        grad = jax.sharding.reshard(grad, sharding)
    return grad


def _varying_axes(aval: Any) -> frozenset[Any]:
    """Manual (``shard_map``) mesh axes a value varies over; empty outside one."""
    varying = getattr(aval, "vma", None)  # JAX releases before 0.10
    if varying is None:  # JAX 0.10
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(varying)


# -- the tangent primitive: linear in its tangent operands ----------------------------

tangent_p = Primitive("jaxext_custom_vjp_tangent")
tangent_p.multiple_results = True


def _split(args: Sequence[Any], lin: _Linear) -> tuple[list[Any], list[Any]]:
    return list(args[: lin.n_res]), list(args[lin.n_res :])


def _tangent_apply(*args: Any, lin: _Linear) -> list[jax.Array]:
    return lin.apply(args)


def _tangent_impl(*args: Any, lin: _Linear) -> list[jax.Array]:
    """Eager ``J t``, by the steps of the call that made ``lin`` (see :class:`_Plain`)."""
    return lin.eager.tangent(lin, args)


def _tangent_abstract_eval(*args: Any, lin: _Linear) -> list[Any]:
    del args
    return list(lin.ct_avals)


def _tangent_transpose(cts: Sequence[Any], *args: Any, lin: _Linear) -> list[Any]:
    res, t = _split(args, lin)
    if any(ad.is_undefined_primal(r) for r in res):
        raise TypeError(f"`{lin.op.name}`: the residuals of a custom_vjp cannot be linear inputs.")
    if all(type(ct) is ad.Zero for ct in cts):
        grads = [None] * len(t)
    else:
        grads = lin.backward(res, [None if type(ct) is ad.Zero else ct for ct in cts])
    out: list[Any] = [None] * len(res)
    for value, grad in zip(t, grads, strict=True):
        if not ad.is_undefined_primal(value):
            out.append(None)
        elif grad is None:
            out.append(ad.Zero(value.aval))
        else:
            out.append(grad)
    return out


def _tangent_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, lin: _Linear):
    res, t = _split(primals, lin)
    d_res, d_t = _split(tangents, lin)
    out = tangent_p.bind(*primals, lin=lin)
    terms = []
    if any(type(d) is not ad.Zero for d in d_t):
        terms.append(tangent_p.bind(*res, *map(ad.instantiate_zeros, d_t), lin=lin))
    if any(type(d) is not ad.Zero for d in d_res):
        # The map t -> J(res) t also depends on the residuals (second-order terms).
        _, through_res = jax.jvp(
            lambda r: lin.tangent(r, t), (res,), (list(map(ad.instantiate_zeros, d_res)),)
        )
        terms.append(through_res)
    if not terms:
        return out, [ad.Zero(a) for a in lin.ct_avals]
    return out, [functools.reduce(jnp.add, parts) for parts in zip(*terms, strict=True)]


def _tangent_batch(args: Sequence[Any], dims: Sequence[Any], *, lin: _Linear):
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    res, t = _split(args, lin)
    res_dims, t_dims = _split(dims, lin)
    res = [r if d is None else jnp.moveaxis(r, d, 0) for r, d in zip(res, res_dims, strict=True)]
    # Every tangent operand is batched (broadcast if need be), so the batched
    # backward maps batched cotangents to batched gradients.
    t = [
        jnp.broadcast_to(x, (size, *np.shape(x))) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(t, t_dims, strict=True)
    ]
    res_axes = [None if d is None else 0 for d in res_dims]
    # On an explicit mesh, every operand mapped by the batched rules carries the batch
    # axis sharded alike (vmap requires it): as the batched residuals have it.
    entry = _batch_entry([r for r, d in zip(res, res_dims, strict=True) if d is not None] + t)
    t = [_with_batch_entry(x, entry) for x in t]
    outs = tangent_p.bind(*res, *t, lin=_Batched(lin, size, res_axes, entry))
    if all(d is not None for d in t_dims):
        return outs, [0] * len(outs)
    # An output tangent that varies with no batched operand stays unbatched, as its primal
    # output does (vmap's out_axes=None, and JAX's merge of primal and tangent batching).
    res_avals = [
        jax.typeof(r) if d is None else _unbatched_aval(r)
        for r, d in zip(res, res_dims, strict=True)
    ]
    batched = _jvp_from_vjp.batched_outputs(
        lin.backward,
        res_avals,
        [d is not None for d in res_dims],
        lin.ct_avals,
        [d is not None for d in t_dims],
    )
    outs = [o if b else o[0] for o, b in zip(outs, batched, strict=True)]
    return outs, [0 if b else None for b in batched]


def _split_over_devices(values: Sequence[Any]) -> bool:
    """Whether any of ``values`` is split over several devices: a concrete array placed on
    more than one, or a traced one whose type names mesh axes (explicit sharding)."""
    for value in values:
        if value is None:
            continue
        if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
            if len(value.sharding.device_set) > 1:
                return True
            continue
        spec = getattr(getattr(jax.typeof(value), "sharding", None), "spec", None)
        if spec is None:
            continue
        partitions = getattr(spec, "partitions", ())  # not `*spec`: refused for reduced specs
        if any(e is not None for e in partitions) or getattr(spec, "unreduced", None):
            return True
        if getattr(spec, "reduced", None):
            return True
    return False


def _unbatched_aval(value: Any) -> Any:
    """The type of one element of ``value``'s leading batch axis."""
    return jax.ShapeDtypeStruct(np.shape(value)[1:], _dtype(value))


def _explicit_spec(value: Any) -> Any:
    """The ``PartitionSpec`` of ``value`` on an explicit mesh (``None`` elsewhere)."""
    sharding = getattr(jax.typeof(value), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    if jax.sharding.AxisType.Explicit not in getattr(mesh, "axis_types", ()):
        return None
    return sharding.spec


def _batch_entry(values: Sequence[Any]) -> Any:
    """How the batch axis (axis 0) of ``values`` is sharded over an explicit mesh.

    The entry of the batched residuals' specs (the batch the user sharded, say over
    ``"data"``) when they all agree, else ``None`` (unsharded): the operands are then all
    resharded to it.
    """
    entries = set()
    for value in values:
        spec = _explicit_spec(value)
        if spec is None:
            continue
        entries.add(spec[0] if len(spec) else None)
    return entries.pop() if len(entries) == 1 else None


def _with_batch_entry(value: Any, entry: Any) -> Any:
    """``value`` with its axis 0 sharded as ``entry`` (on an explicit mesh; else as it is)."""
    spec = _explicit_spec(value)
    if spec is None or np.ndim(value) == 0:
        return value
    rest = tuple(spec[1:]) + (None,) * (np.ndim(value) - max(len(spec), 1))
    if (spec[0] if len(spec) else None) == entry:
        return value
    return jax.sharding.reshard(value, jax.sharding.PartitionSpec(entry, *rest))


class _Batched:
    """``lin`` under ``vmap``: the same map, with batched residuals and tangents."""

    def __init__(self, inner: Any, size: int, res_axes: list[Any], entry: Any = None):
        self.inner, self.size, self.res_axes = inner, size, res_axes
        self.op, self.n_res = inner.op, inner.n_res
        self.entry = entry  # the batch axis's sharding on an explicit mesh (_batch_entry)
        self.t_avals = tuple(_batched_aval(a, size, entry) for a in inner.t_avals)
        self.ct_avals = tuple(_batched_aval(a, size, entry) for a in inner.ct_avals)
        self.eager = _PLAIN  # a batched tangent is evaluated as written

    def mapped(self, res_arrays: Sequence[Any], other: Sequence[Any]) -> tuple[list, list]:
        """The operands of the batched rules, their batch axes sharded alike (``entry``)."""
        res = [
            r if axis is None else _with_batch_entry(r, self.entry)
            for r, axis in zip(res_arrays, self.res_axes, strict=True)
        ]
        return res, [_with_batch_entry(x, self.entry) for x in other]

    def apply(self, args: Sequence[Any]) -> list[jax.Array]:
        """``J t`` for the primitive's operands ``args`` (residuals, then tangents)."""
        res, t = _split(args, self)
        return self.tangent(res, t)

    def __repr__(self) -> str:
        return f"<jaxext.custom_vjp {self.op.name} batched {self.size}>"

    def backward(self, res_arrays: Sequence[Any], cts: Sequence[Any]) -> list[jax.Array]:
        res_arrays, _ = self.mapped(res_arrays, [])
        cts = [None if c is None else _with_batch_entry(c, self.entry) for c in cts]
        return jax.vmap(self.inner.backward, in_axes=(self.res_axes, 0))(list(res_arrays), cts)

    def tangent(self, res_arrays: Sequence[Any], t_in: Sequence[Any]) -> list[jax.Array]:
        res_arrays, t_in = self.mapped(res_arrays, t_in)
        return jax.vmap(self.inner.tangent, in_axes=(self.res_axes, 0))(
            list(res_arrays), list(t_in)
        )


def _batched_aval(aval: Any, size: int, entry: Any = None) -> Any:
    """``aval`` with a leading batch axis of ``size`` sharded as ``entry`` (``None``:
    unsharded), keeping its variance."""
    shape = (size, *aval.shape)
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return jax.core.ShapedArray(shape, aval.dtype, weak_type=aval.weak_type)
    spec = jax.sharding.PartitionSpec(entry, *sharding.spec)
    return aval.update(shape=shape, sharding=jax.sharding.NamedSharding(sharding.mesh, spec))


tangent_p.def_impl(_tangent_impl)
tangent_p.def_abstract_eval(_tangent_abstract_eval)
ad.primitive_jvps[tangent_p] = _tangent_jvp
ad.primitive_transposes[tangent_p] = _tangent_transpose
batching.primitive_batchers[tangent_p] = _tangent_batch
mlir.register_lowering(tangent_p, mlir.lower_fun(_tangent_apply, multiple_results=True))
