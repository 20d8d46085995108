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

The JVP rule's work is :meth:`Steps.traced_jvp`, which runs every step as written. A
subclass of :class:`Steps` may take the steps that eager calls repeat faster (with the same
values and errors): the rule takes those of :data:`STEPS`, which the package installs.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import custom_batching
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _forward_mode, _trace_state
from ._avals import (
    as_array,
    batch_entry,
    batched_aval,
    dtype_of,
    is_array_leaf,
    is_differentiable,
    shape_dtypes,
    split_over_devices,
    stand_in,
    unbatched_aval,
    varying_axes,
    with_batch_entry,
    zeros,
    zeros_like,
)
from ._linearity import Kind, nonlinearities
from ._remat import rematerialized, run_fwd, saved
from ._rule_contracts import (
    RuleTypeError,
    RuleValueError,
    arg_label,
    check_bwd_output,
    check_fwd_output,
    check_leaf,
    fwd_pair,
    name_user_function,
    positions_of,
    resolve_kwargs,
    stale_closure_error,
    the_output,
)

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
        forward_mode_max_outputs: int = _forward_mode.DEFAULT_MAX_OUTPUTS,
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
        _forward_mode.check_max_outputs(forward_mode_max_outputs)
        functools.update_wrapper(self, fun)
        self.fun = fun
        argnums = tuple(nondiff_argnums)
        for i in argnums:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
                raise TypeError(
                    f"`nondiff_argnums` must hold non-negative ints; got {nondiff_argnums!r}."
                )
        named = positions_of(self._signature(), nondiff_argnames)
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
            args = resolve_kwargs(self._signature(), name, args, kwargs)
        if self.differentiate_fwd and _forward_mode.runs_plain(self):
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
                self.traced_output = shape_dtypes(out)
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
            not isinstance(t, SymbolicZero) and is_differentiable(dtype_of(p))
            for p, t in zip(in_leaves, t_leaves, strict=True)
        )
        t_in = [t for t, q in zip(t_leaves, perturbed, strict=True) if q]
        return STEPS.jvp(self, primals, in_leaves, in_tree, perturbed, t_in)

    def call_fwd(self, fwd_args: Sequence[Any]) -> Any:
        """Runs ``fwd`` on ``fwd_args`` (the differentiable arguments) and the nondiff ones."""
        return self.spec.fwd(*self.merge(fwd_args))

    def check_no_stale_closure(self) -> None:
        """Raises where ``fwd`` read a value traced by a transformation that has ended.

        JAX traces the JVP rule of a primal it traced earlier (under ``jit``, ``scan``
        ...) when it differentiates that traced program, after the trace the primal ran
        in. A value of that trace the rules close over (a model a diffrax vector field
        closes over, under ``jit``) is stale there; JAX would fail later, when it lowers
        the program, with "No constant handler for type: ...Tracer".
        """
        if _trace_state.stale_tracers():
            raise stale_closure_error(self.name)

    def abstract_output(self, primals: tuple) -> Any:
        """The primal's output type for ``primals`` (``None``: it cannot be traced abstractly).

        Python numbers among ``primals`` (an eager ``grad`` hands a Python float input to
        the rules as one) stay Python numbers, as ``fwd`` sees them: a library may treat
        them apart from arrays (Equinox keeps them as static data, out of the pytree).
        """
        leaves, tree = jax.tree_util.tree_flatten(primals)
        is_array = [is_array_leaf(leaf) for leaf in leaves]

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


def _primal_template(*diff_values: Any) -> Any:
    """Has the signature of :meth:`_Op.named_primal`'s functions."""
    del diff_values


# JAX inspects the signature of the functions a custom_jvp gets at every call (for debug
# information); these are what it finds, precomputed.
_PRIMAL_SIGNATURE = inspect.signature(_primal_template)
_Op.jvp_rule.__signature__ = inspect.signature(_Op.jvp_rule)  # type: ignore[attr-defined]


class Steps:
    """The steps of a call's JVP rule, taken as written.

    :meth:`traced_jvp` is the rule's work; it takes the steps that eager work may take
    faster through :meth:`fwd`, :meth:`expected_output` and (for the tangent primitive's
    eager evaluation) :meth:`tangent`. A subclass may take them faster with the same
    meaning: every value and error is the same either way. The JVP rule takes the steps of
    :data:`STEPS`, which a module above this one may replace by such a subclass.
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
        return self.traced_jvp(op, primals, in_leaves, in_tree, perturbed, t_in)

    def traced_jvp(
        self,
        op: _Op,
        primals: tuple,
        in_leaves: list[Any],
        in_tree: Any,
        perturbed: tuple,
        t_in: list,
    ) -> tuple[Any, Any]:
        """The JVP rule's work: ``fwd``, then the output tangent as ``tangent_p``.

        The template of the rule: the steps eager calls may take faster are this object's
        :meth:`fwd` and :meth:`expected_output` (and, evaluating the tangent, :meth:`tangent`).
        """
        if op.spec.symbolic_zeros:
            wrapped = [CustomVJPPrimal(p, q) for p, q in zip(in_leaves, perturbed, strict=True)]
            fwd_args = jax.tree_util.tree_unflatten(in_tree, wrapped)
        else:
            fwd_args = primals
        if op.spec.optimize_remat:
            result = run_fwd(op, fwd_args)
        else:
            result = self.fwd(op, fwd_args, in_leaves)
        out, res = fwd_pair(result, op.name, op.spec.fwd)
        if op.traced_output is not None:  # the JVP rule runs after the primal's trace
            op.check_no_stale_closure()
        check_fwd_output(out, self.output_type(op, primals), op.name, op.spec.fwd)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        res_leaves, res_tree = jax.tree_util.tree_flatten(res)
        res_is_array = tuple(is_array_leaf(leaf) for leaf in res_leaves)
        res_arrays = [as_array(r) for r, a in zip(res_leaves, res_is_array, strict=True) if a]
        res_static = tuple(None if a else r for r, a in zip(res_leaves, res_is_array, strict=True))
        out_float = tuple(is_differentiable(dtype_of(o)) for o in out_leaves)
        lin = _TangentMap(
            op=op,
            in_tree=in_tree,
            in_avals=tuple(jax.typeof(p) for p in in_leaves),
            perturbed=perturbed,
            res_tree=res_tree,
            res_is_array=res_is_array,
            res_static=res_static,
            out_tree=out_tree,
            out_avals=tuple(jax.typeof(o) for o in out_leaves),
            out_float=out_float,
            steps=self,
        )
        staged = _trace_state.staged(in_leaves, res_arrays, t_in)
        if t_in and staged and op.spec.hoist_closures:
            res_arrays = [*res_arrays, *lin.hoist(res_arrays)]  # staged: see _TangentMap.hoist
        if t_in and op.spec.differentiate_fwd and op.spec.jvp is None:
            res_arrays = [*res_arrays, *lin.fwd_operands(in_leaves, staged)]
        float_tangents = iter(tangent_p.bind(*res_arrays, *t_in, lin=lin) if t_in else [])
        out_tangents = []
        for o, is_float in zip(out_leaves, out_float, strict=True):
            if not is_float:
                out_tangents.append(np.zeros(np.shape(o), jax.dtypes.float0))
            elif t_in:
                out_tangents.append(next(float_tangents))
            else:
                out_tangents.append(zeros_like(o))
        return out, jax.tree_util.tree_unflatten(out_tree, out_tangents)

    def fwd(self, op: _Op, fwd_args: Sequence[Any], in_leaves: Sequence[Any]) -> Any:
        """``fwd``'s result for ``fwd_args``, whose array leaves are ``in_leaves``."""
        del in_leaves
        return op.call_fwd(fwd_args)

    def output_type(self, op: _Op, primals: tuple) -> Any:
        """The primal's output type, to check ``fwd``'s against (``None``: not known).

        Where JAX traced the primal (under ``jit``, ``scan`` and the like, before it
        linearizes the traced program), the type it found: the JVP rule may run later,
        outside the context the primal was called in (Flax NNX's update context), where
        the primal cannot be traced again. Otherwise (eager ``grad``, ``jvp``) the primal
        is traced abstractly here (:meth:`expected_output`).
        """
        if op.traced_output is not None:
            return op.traced_output
        return self.expected_output(op, primals)

    def expected_output(self, op: _Op, primals: tuple) -> Any:
        """The primal's output type for ``primals`` (``None``: not traceable abstractly)."""
        return op.abstract_output(primals)

    def tangent(self, lin: _TangentMap, args: Sequence[Any]) -> list[jax.Array]:
        """``J t`` evaluated on concrete operands ``args`` (the tangent primitive's impl)."""
        return lin.apply(args)


#: The steps every JVP rule takes (``jaxext/__init__.py`` installs faster ones).
STEPS: Steps = Steps()


class _TangentMap:
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
            bwd, bwd_consts = _forward_mode.closure_convert(self.own_backward, own, cts)
        except Exception:  # noqa: BLE001 -- a dry run: the rule itself runs (and raises) later
            bwd, bwd_consts = None, []
        self.traced_bwd = bwd  # reverse mode reuses it (see backward)
        if bwd_consts:
            self.hoisted_bwd, self.n_bwd_consts = bwd, len(bwd_consts)
            consts += bwd_consts
        if self.op.spec.jvp is not None:
            try:
                jvp, jvp_consts = _forward_mode.closure_convert(self.own_user_jvp, own, t_in)
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
        primals = [as_array(p) for p in in_leaves]
        consts: list[Any] = []
        if staged:
            try:
                fwd, consts = _forward_mode.closure_convert(
                    _forward_mode.fwd_outputs(self), *primals
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
        plain = not any(varying_axes(a) for a in self.ct_avals)
        # nor on operands split over several devices: hoist traced on unsplit cotangents, and
        # what bwd does can depend on the split (a C++ kernel's partition rule reads it)
        whole = not split_over_devices([*res_arrays[: self.n_own], *cts])
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
                ct = SymbolicZero(tangent_aval) if spec.symbolic_zeros else zeros(tangent_aval)
            leaves.append(ct)
        g = jax.tree_util.tree_unflatten(self.out_tree, leaves)
        grads = spec.bwd(*self.op.nondiff(), self.residuals(res_arrays), g)
        return check_bwd_output(
            grads, self.op.name, self.op.label, self.in_tree, self.in_avals, self.perturbed
        )

    def tangent(self, res_arrays: Sequence[Any], t_in: Sequence[Any]) -> list[jax.Array]:
        """``J t`` for the float outputs: from the user's ``jvp``, by differentiating
        ``fwd`` (``differentiate_fwd``) or from ``bwd`` (see ``_forward_mode``)."""
        if self.op.spec.jvp is not None:
            return self.user_jvp(res_arrays, t_in)
        if self.op.spec.differentiate_fwd:
            start, n_in = self.fwd_start, len(self.in_avals)
            primals = res_arrays[start : start + n_in]
            consts = res_arrays[start + n_in : start + n_in + self.n_fwd_consts]
            return _forward_mode.tangent_of_fwd(self, primals, consts, t_in)
        message = self.op.spec.no_derivatives_message
        if message is not None:
            # The backward must not be differentiated (once_differentiable): transposing it
            # is fine, differentiating that transpose (reverse over forward) is not.
            return without_derivatives(self.transposed, message)(list(res_arrays), list(t_in))
        return self.transposed(res_arrays, t_in)

    def transposed(self, res_arrays: Sequence[Any], t_in: Sequence[Any]) -> list[jax.Array]:
        """``J t`` as the transpose of ``bwd``."""
        examples = [stand_in(a) for a in self.ct_avals]
        hint = self.op.spec.forward_mode_hint or (
            f"give a JVP rule: `{self.op.name}.defvjp(fwd, bwd, jvp=jvp)` with "
            "`jvp(*nondiff_args, residuals, tangents) -> output tangent`; or, where the "
            "derivative of `fwd` is the one meant (a custom_vjp that saves memory), construct "
            "the op with `jaxext.custom_vjp(..., differentiate_fwd=True)`"
        )
        self.check_linear(res_arrays, examples, hint)
        return _forward_mode.tangent_from_backward(self, res_arrays, t_in)

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
                result.append(check_leaf(t, aval.to_tangent_aval(), the_output, name, "jvp"))
        return result


# -- the tangent primitive: linear in its tangent operands ----------------------------

tangent_p = Primitive("jaxext_custom_vjp_tangent")
tangent_p.multiple_results = True


def _split(args: Sequence[Any], lin: _TangentMap) -> tuple[list[Any], list[Any]]:
    return list(args[: lin.n_res]), list(args[lin.n_res :])


def _tangent_apply(*args: Any, lin: _TangentMap) -> list[jax.Array]:
    return lin.apply(args)


def _tangent_impl(*args: Any, lin: _TangentMap) -> list[jax.Array]:
    """Eager ``J t``, by the steps of the call that made ``lin`` (see :class:`Steps`)."""
    return lin.steps.tangent(lin, args)


def _tangent_abstract_eval(*args: Any, lin: _TangentMap) -> list[Any]:
    del args
    return list(lin.ct_avals)


def _tangent_transpose(cts: Sequence[Any], *args: Any, lin: _TangentMap) -> list[Any]:
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


def _tangent_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, lin: _TangentMap):
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


def _tangent_batch(args: Sequence[Any], dims: Sequence[Any], *, lin: _TangentMap):
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
    entry = batch_entry([r for r, d in zip(res, res_dims, strict=True) if d is not None] + t)
    t = [with_batch_entry(x, entry) for x in t]
    outs = tangent_p.bind(*res, *t, lin=_Batched(lin, size, res_axes, entry))
    if all(d is not None for d in t_dims):
        return outs, [0] * len(outs)
    # An output tangent that varies with no batched operand stays unbatched, as its primal
    # output does (vmap's out_axes=None, and JAX's merge of primal and tangent batching).
    res_avals = [
        jax.typeof(r) if d is None else unbatched_aval(r)
        for r, d in zip(res, res_dims, strict=True)
    ]
    batched = _forward_mode.batched_outputs(
        lin.backward,
        res_avals,
        [d is not None for d in res_dims],
        lin.ct_avals,
        [d is not None for d in t_dims],
    )
    outs = [o if b else o[0] for o, b in zip(outs, batched, strict=True)]
    return outs, [0 if b else None for b in batched]


class _Batched:
    """``lin`` under ``vmap``: the same map, with batched residuals and tangents."""

    def __init__(self, inner: Any, size: int, res_axes: list[Any], entry: Any = None):
        self.inner, self.size, self.res_axes = inner, size, res_axes
        self.op, self.n_res = inner.op, inner.n_res
        self.entry = entry  # the batch axis's sharding on an explicit mesh (batch_entry)
        self.t_avals = tuple(batched_aval(a, size, entry) for a in inner.t_avals)
        self.ct_avals = tuple(batched_aval(a, size, entry) for a in inner.ct_avals)
        self.steps = Steps()  # a batched tangent is evaluated as written

    def mapped(self, res_arrays: Sequence[Any], other: Sequence[Any]) -> tuple[list, list]:
        """The operands of the batched rules, their batch axes sharded alike (``entry``)."""
        res = [
            r if axis is None else with_batch_entry(r, self.entry)
            for r, axis in zip(res_arrays, self.res_axes, strict=True)
        ]
        return res, [with_batch_entry(x, self.entry) for x in other]

    def apply(self, args: Sequence[Any]) -> list[jax.Array]:
        """``J t`` for the primitive's operands ``args`` (residuals, then tangents)."""
        res, t = _split(args, self)
        return self.tangent(res, t)

    def __repr__(self) -> str:
        return f"<jaxext.custom_vjp {self.op.name} batched {self.size}>"

    def backward(self, res_arrays: Sequence[Any], cts: Sequence[Any]) -> list[jax.Array]:
        res_arrays, _ = self.mapped(res_arrays, [])
        cts = [None if c is None else with_batch_entry(c, self.entry) for c in cts]
        return jax.vmap(self.inner.backward, in_axes=(self.res_axes, 0))(list(res_arrays), cts)

    def tangent(self, res_arrays: Sequence[Any], t_in: Sequence[Any]) -> list[jax.Array]:
        res_arrays, t_in = self.mapped(res_arrays, t_in)
        return jax.vmap(self.inner.tangent, in_axes=(self.res_axes, 0))(
            list(res_arrays), list(t_in)
        )


tangent_p.def_impl(_tangent_impl)
tangent_p.def_abstract_eval(_tangent_abstract_eval)
ad.primitive_jvps[tangent_p] = _tangent_jvp
ad.primitive_transposes[tangent_p] = _tangent_transpose
batching.primitive_batchers[tangent_p] = _tangent_batch
mlir.register_lowering(tangent_p, mlir.lower_fun(_tangent_apply, multiple_results=True))
