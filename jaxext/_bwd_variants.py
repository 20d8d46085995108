"""The backward rules of JAX 0.12's ``jax.custom_vjp`` that log or take accumulators.

JAX 0.12 adds three ways to attach a backward to a ``jax.custom_vjp``:

* ``defvjp_with_logs(fwd, bwd)``: ``bwd`` returns ``(cotangents, logs)``, ``logs`` a dict
  of named pytrees (or ``None``), read with ``f_vjp.with_logs(ct)`` where ``f_vjp`` is
  ``jax.vjp``'s function; a plain ``f_vjp(ct)`` drops them;
* ``defremat_with_logs(fwd, rem, bwd)``: ``defremat`` with such a ``bwd``;
* ``defvjp_with_accums(fwd, bwd)``: ``bwd(res, g, *arg_accums)`` pushes each cotangent
  into the accumulator of its argument (``acc.accum(ct)``) and returns ``None`` or logs.

:class:`BwdVariants` gives ``jaxext.custom_vjp`` those methods, with JAX's meaning, where
the installed JAX has them (on an older JAX they are absent, as on its ``jax.custom_vjp``).
Each rule is brought to the plain convention by :func:`call_bwd` (cotangents, and the logs
apart), so reverse mode runs it as written, and forward mode transposes the cotangent part
(the logs are not a derivative; accumulating is adding, which is linear). The core hands
the logs to JAX's backward pass, which collects them for ``with_logs``.

JAX internals this module reads (pinned by
``tests/test_bwd_variants.py::test_bwd_variant_internals_have_the_forms_this_module_names``
on the JAX it runs with; checked on JAX 0.10 and 0.12):

* ``jax.custom_derivatives.custom_vjp``'s ``defvjp_with_logs``, ``defremat_with_logs``
  and ``defvjp_with_accums`` (:func:`jax_has`): public, but only on JAX 0.12; where one is
  missing, so is jaxext's.
* ``jax._src.interpreters.ad.fancy_transposes``: a dict from primitive to the transpose
  rule JAX's backward pass calls as ``rule(cts, *operands, **params)``, its linear
  operands given as accumulators, and whose returned ``None`` or dict of logs it merges
  into ``f_vjp.with_logs`` (:func:`register_logging_transpose`; :func:`passes_logs`).
  Missing (or without ``defvjp_with_logs``): logs are not collected.
* ``jax._src.interpreters.ad.GradAccum``, the accumulators' base class
  (:func:`is_accumulator`), and of it ``ValAccum(ct_aval)`` (``accum(ct)`` adds,
  ``freeze()`` gives the sum or ``ad.Zero`` when nothing was pushed) and
  ``NullAccum(ct_aval)`` (``accum`` discards) for :func:`call_bwd`'s ``"accums"`` kind;
  an aval's ``to_ct_aval()`` where it has one.
* ``jax._src.interpreters.ad.CustomVJPException`` (read by ``_rule_contracts``, pinned
  beside these): the class ``jax.custom_vjp`` raises for a rule closing over a
  differentiated value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.interpreters import ad

try:  # the accumulators and log-passing transposes (JAX 0.12), which JAX does not export
    from jax._src.interpreters import ad as _jax_ad
except ImportError:  # pragma: no cover -- a JAX that moved them: no logs
    _jax_ad = None

__all__ = [
    "PLAIN",
    "BwdVariants",
    "call_bwd",
    "is_accumulator",
    "jax_has",
    "passes_logs",
    "register_logging_transpose",
]

PLAIN, LOGS, ACCUMS = "plain", "logs", "accums"
_METHODS = ("defvjp_with_logs", "defremat_with_logs", "defvjp_with_accums")


def jax_has(method: str) -> bool:
    """Whether the installed JAX's ``jax.custom_vjp`` has ``method``."""
    return callable(getattr(jax.custom_derivatives.custom_vjp, method, None))


def passes_logs() -> bool:
    """Whether JAX's backward pass collects logs (through the ``fancy_transposes``
    rules' return values), as JAX 0.12 does for ``with_logs``."""
    return jax_has("defvjp_with_logs") and hasattr(_jax_ad, "fancy_transposes")


def register_logging_transpose(primitive: Any, rule: Callable[..., Any]) -> None:
    """Makes ``rule`` the transpose of ``primitive`` that JAX's backward pass runs with
    accumulators for the linear operands, and whose returned logs it collects."""
    _jax_ad.fancy_transposes[primitive] = rule


def is_accumulator(value: Any) -> bool:
    """Whether ``value`` is one of JAX's gradient accumulators (``GradAccum``)."""
    return _jax_ad is not None and isinstance(value, getattr(_jax_ad, "GradAccum", ()))


class BwdVariants:
    """The ``defvjp_with_logs``, ``defremat_with_logs`` and ``defvjp_with_accums`` methods
    of ``jaxext.custom_vjp`` (a mixin: they set the rules through ``defvjp``/``defremat``
    and record which convention ``bwd`` follows in ``bwd_kind``)."""

    bwd_kind: str = PLAIN
    with_logs: bool = False
    with_accums: bool = False

    def _set_kind(self, kind: str) -> None:
        self.bwd_kind = kind
        self.with_logs, self.with_accums = kind == LOGS, kind == ACCUMS

    def _defvjp_as(self, kind: str, fwd: Callable[..., Any], bwd: Callable[..., Any], *flags: bool):
        """``defvjp(fwd, bwd, *flags)`` for a ``bwd`` of convention ``kind``; where
        ``defremat``'s rules stay in force (``defvjp`` leaves them), so does their kind."""
        self.defvjp(fwd, bwd, *flags)
        if getattr(self, "remat_rules", None) is None:
            self._set_kind(kind)

    def defvjp_with_logs(
        self,
        fwd: Callable[..., Any],
        bwd: Callable[..., Any],
        symbolic_zeros: bool = False,
        optimize_remat: bool = False,
        generic_batching: bool = False,
    ) -> None:
        """As ``jax.custom_vjp.defvjp_with_logs`` (JAX 0.12): ``bwd`` returns
        ``(cotangents, logs)``, ``logs`` a dict of named pytrees or ``None``.

        ``f_vjp.with_logs(ct)`` (``f_vjp`` from ``jax.vjp``) returns
        ``(cotangents, logs)``; ``f_vjp(ct)`` drops the logs. Forward mode transposes
        the cotangent part of ``bwd``, as for ``defvjp``.

        Args:
            fwd: as for ``defvjp``.
            bwd: ``bwd(*nondiff_args, residuals, cotangent) -> (gradients, logs)``.
            symbolic_zeros: as for ``defvjp``.
            optimize_remat: as for ``defvjp``.
            generic_batching: as for ``defvjp``.

        Raises:
            TypeError: if a rule is not callable.
        """
        self._defvjp_as(LOGS, fwd, bwd, symbolic_zeros, optimize_remat, generic_batching)

    def defremat_with_logs(
        self,
        fwd: Callable[..., Any],
        rem: Callable[..., Any],
        bwd: Callable[..., Any],
        generic_batching: bool = False,
    ) -> None:
        """As ``jax.custom_vjp.defremat_with_logs`` (JAX 0.12): ``defremat`` whose
        ``bwd`` returns ``(cotangents, logs)`` (see ``defvjp_with_logs``).

        Args:
            fwd: as for ``defremat``.
            rem: as for ``defremat``.
            bwd: ``bwd(res2, cotangent) -> (gradients, logs)``.
            generic_batching: as for ``defremat``.

        Raises:
            TypeError: if a rule is not callable.
        """
        self.defremat(fwd, rem, bwd, generic_batching)
        self._set_kind(LOGS)

    def defvjp_with_accums(
        self,
        fwd: Callable[..., Any],
        bwd: Callable[..., Any],
        symbolic_zeros: bool = False,
        optimize_remat: bool = False,
        generic_batching: bool = False,
    ) -> None:
        """As ``jax.custom_vjp.defvjp_with_accums`` (JAX 0.12): ``bwd`` takes one gradient
        accumulator per argument after its usual two arguments.

        ``bwd(*nondiff_args, residuals, cotangent, *arg_accums)`` pushes each gradient
        into the accumulator of its argument (``acc.accum(g)``; the accumulators have the
        arguments' pytree structure) and returns ``None`` or a dict of logs (see
        ``defvjp_with_logs``). jaxext hands it value accumulators (JAX's ``ValAccum``,
        what JAX hands a rule under a transformation that wraps it), and ``NullAccum`` for
        inputs that are not differentiated. Forward mode transposes the accumulated
        gradients.

        Args:
            fwd: as for ``defvjp``.
            bwd: ``bwd(*nondiff_args, residuals, cotangent, *arg_accums) -> logs``.
            symbolic_zeros: as for ``defvjp``.
            optimize_remat: as for ``defvjp``.
            generic_batching: as for ``defvjp``.

        Raises:
            TypeError: if a rule is not callable.
        """
        self._defvjp_as(ACCUMS, fwd, bwd, symbolic_zeros, optimize_remat, generic_batching)


# An older JAX has none of these methods: neither has jaxext.custom_vjp there (the core's
# __getattr__ then says so).
for _method in _METHODS:
    if not jax_has(_method):
        delattr(BwdVariants, _method)


def call_bwd(
    kind: str,
    bwd: Callable[..., Any],
    args: Sequence[Any],
    name: str,
    in_tree: Any,
    in_avals: Sequence[Any],
    perturbed: Sequence[bool],
) -> tuple[Any, dict | None]:
    """Runs ``bwd(*args)`` and returns ``(gradients, logs)`` in the plain convention.

    ``gradients`` is what a plain ``bwd`` returns (a tuple of one gradient per argument),
    ``logs`` a dict or ``None``. ``in_tree``, ``in_avals`` and ``perturbed`` describe the
    differentiable arguments' leaves (for the accumulators of ``kind`` ``"accums"``).

    Raises:
        TypeError: as JAX's, where a logging ``bwd`` returns no pair, or logs that are
            neither a dict nor ``None``.
    """
    if kind == PLAIN:
        return bwd(*args), None
    if kind == LOGS:
        result = bwd(*args)
        if not (isinstance(result, (list, tuple)) and len(result) == 2):
            raise TypeError(
                f"`{name}`: bwd was registered with defvjp_with_logs, so it must return a "
                f"pair (gradients, logs); got {type(result).__name__}. (JAX: Custom VJP bwd "
                "rule was registered with defvjp_with_logs and so must produce a pair "
                "(in_cts, logs).)"
            )
        grads, logs = result
        return grads, _checked_logs(logs, name, "defvjp_with_logs")
    ct_avals = [a.to_ct_aval() if hasattr(a, "to_ct_aval") else a for a in in_avals]
    accums = [
        _jax_ad.ValAccum(a) if q else _jax_ad.NullAccum(a)
        for a, q in zip(ct_avals, perturbed, strict=True)
    ]
    logs = bwd(*args, *jax.tree_util.tree_unflatten(in_tree, accums))
    leaves = [
        None if isinstance(acc, _jax_ad.NullAccum) or type(v := acc.freeze()) is ad.Zero else v
        for acc in accums
    ]
    grads = tuple(
        jax.tree_util.tree_unflatten(tree, leaves[start : start + tree.num_leaves])
        for tree, start in zip(in_tree.children(), _starts(in_tree), strict=True)
    )
    return grads, _checked_logs(logs, name, "defvjp_with_accums")


def _starts(in_tree: Any) -> list[int]:
    starts, n = [], 0
    for tree in in_tree.children():
        starts.append(n)
        n += tree.num_leaves
    return starts


def _checked_logs(logs: Any, name: str, method: str) -> dict | None:
    if logs is not None and type(logs) is not dict:
        raise TypeError(
            f"`{name}`: bwd was registered with {method}, so its logs must be None or a "
            f"dict of backward-pass log entries; got {type(logs).__name__}."
        )
    return logs
