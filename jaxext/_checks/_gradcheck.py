"""`gradcheck` / `gradgradcheck`: PyTorch-style gradient checks for JAX functions.

``jax.test_util.check_grads`` compares automatic and numerical derivatives along
one random direction. That catches gross errors but can miss one wrong entry of
one gradient, and its failure names neither the input nor the output. These
checks follow ``torch.autograd.gradcheck`` instead, with its option names: in
float64, the *full* Jacobian from central differences is compared entry by
entry with the Jacobian assembled from one VJP per output element, in chunks,
for problems up to ``FULL_MAX_ENTRIES`` Jacobian entries; larger ones fall back
(with a warning) to a few random directions per (output, input) pair.

The flow is one way: arguments -> ``_problem`` (the caller's function as a flat
``R^n -> R^m``) -> ``_jacobians`` (its Jacobians, a chunk at a time) -> ``_compare``
(mismatches) -> ``_gradcheck_report`` (the error). ``_engines.choose`` picks the engine
that computes and compares them: the reference path, or one that only makes it faster.
This module holds the two entry points only: their settings live in ``_settings``, the
checks they run in ``_gradients``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._gradcheck_report import GradcheckError as GradcheckError
from ._gradcheck_report import GradcheckUnresolvedWarning as GradcheckUnresolvedWarning
from ._gradcheck_report import warn_unresolved
from ._gradients import against_reference, check_gradients
from ._settings import Settings, as_args, validated_flags

__all__ = ["GradcheckError", "GradcheckUnresolvedWarning", "gradcheck", "gradgradcheck"]


def gradcheck(
    func: Callable[..., Any],
    inputs: Any,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    nondet_tol: float = 0.0,
    check_undefined_grad: bool = True,
    check_grad_dtypes: bool = False,
    check_batched_grad: bool = False,
    check_forward_ad: bool = False,
    check_backward_ad: bool = True,
    fast_mode: bool | None = None,
    modes: str | Sequence[str] = ("rev",),
    num_directions: int = 3,
    seed: int = 0,
    reference: Callable[..., Any] | None = None,
) -> bool:
    """Checks ``func``'s first derivatives against central finite differences.

    Everything runs in float64 (the caller's ``jax_enable_x64`` setting is
    restored afterwards). First, the primal output of ``jax.vjp`` must match a
    plain call of ``func``: this catches a ``custom_vjp`` forward rule that
    returns something else than the function. Then, per (output leaf, input
    leaf) pair, every compared entry must satisfy
    ``|analytical - numerical| <= atol + rtol * |numerical| + noise``, where
    ``noise = 4 * 2.2e-16 * |f(x)| / (2 * h)`` is the rounding noise of the
    finite difference (about 1e-9 for outputs of order one; it keeps outputs
    of 1e6 from failing a correct function). For an (output, input) pair whose
    numerical derivatives are all below 1 in magnitude (full method), ``atol``
    is multiplied by the largest of them: a gradient whose entries are all below
    ``atol`` (an L2 penalty of ``1e-6``) is still held to ``rtol`` against its own
    size, so an error of 2x is caught.

    That noise term assumes the values carry a few ulps of ``|f(x)|``; a function
    whose intermediates are larger than its values carries more (``1 - tanh(x)`` at
    ``x = 10`` is ``4e-9`` but carries the ulp of ``tanh(x)``, ``1e-16``: its central
    difference at ``h = 1e-6`` is off by ``1e-10``, 1% of its derivative). So an
    entry that fails is judged again with the finite differences' own error,
    ``E`` estimated from central differences at steps ``h / 10 .. 1000 h`` (full
    method; ``_fd_error``: each step's error comes from the steps on the side where it
    shrinks; ``h`` is one of them, so a derivative wrong by more than the differences
    resolve at ``h`` always fails). It fails if ``|analytical - D| > atol + rtol|D| + E``
    (``D`` the best-resolved difference), passes if not and ``E <= atol + rtol|D|``;
    else it, or an entry no step resolves (a jump) beyond the unscaled ``atol``, is
    *unresolved* (a correct solve with a 5x5 Hilbert matrix): no failure; where nothing
    fails, the check returns ``True`` with a ``jaxext.GradcheckUnresolvedWarning``.
    Only input elements with a failing entry pay for these differences, and only
    where ``func`` computes in float64 (an output that is not float64, or in
    gradgradcheck a float32 gradient, keeps the plain test).

    * Full method (up to ``FULL_MAX_ENTRIES = 2**30`` Jacobian entries, about
      1.07e9, e.g. 41,000 inputs by 25,000 outputs; it costs ``2 n`` calls of
      ``func`` and ``m`` VJPs for ``n`` inputs and ``m`` outputs, and
      ``benchmarks/results/checks_cpu.md`` times it up to 1e9 entries): the
      numerical Jacobian, one central difference per input element, against
      the analytical one built from one VJP per output element with a basis
      cotangent (so a backward that ignores its cotangent fails too); then the VJP of one random
      cotangent ``u`` against ``u^T J`` from the numerical Jacobian (so a
      backward not linear in its cotangent, ``|g|`` for ``g``, fails too:
      ``kind="random_cotangent"``). Both are computed and compared in
      chunks: memory stays bounded (well under 1 GB) whatever the size. From
      ``2**22`` entries up, each chunk is first screened where it was computed
      (on the device) and only a chunk that could fail is compared on the host.
      An output that an input does not touch differences to exactly zero.
    * Directional method (``fast_mode=True``, or larger problems, with a
      warning): it compares ``u . J v`` for ``num_directions`` seeded random
      unit vectors per (output leaf, input leaf) pair. Cheaper, and blind to
      an error small against the whole Jacobian.

    Then, as in PyTorch (reverse mode only): a zero cotangent must give exactly
    zero gradients (``check_undefined_grad``), the backward run twice must agree
    within ``nondet_tol``, gradients computed for a batch of cotangents under
    ``jax.vmap`` must match one at a time (``check_batched_grad``), and each
    gradient must have its input's dtype and shape (``check_grad_dtypes``).

    Floating-point array leaves of ``inputs`` are differentiated; integer and
    boolean arrays, Python/NumPy scalars and other leaves are passed through
    unchanged. Integer and boolean outputs are ignored. Complex inputs and
    outputs are checked in JAX's convention: each complex element is two real
    ones (real and imaginary part) for the finite differences, and a VJP at
    cotangent ``c`` must be ``c * df/dz + conj(c * df/dzbar)`` (``c * f'(z)``
    for holomorphic ``f``; PyTorch's is its conjugate). Complex64 inputs are
    upcast to complex128. On a TPU (or another
    backend without float64) the check runs on the CPU backend; on a GPU the
    default matmul precision is raised to ``"highest"`` while it runs.

    Args:
        func: function of the positional arguments ``inputs``, returning an
            array or a pytree of arrays.
        inputs: tuple (or list) of positional arguments, each an array or a
            pytree of arrays; anything else is taken as the single argument.
        eps: finite-difference step (> 0). It follows the scale of an input
            leaf whose entries are all below 0.01: the step is then
            ``h = eps * max |x| / 0.01`` (a relative step of 1e-4 at the default),
            so that a correct function of inputs of scale ``1e-5`` is not failed
            by truncation error; other leaves get ``h = eps``.
        atol: absolute tolerance (>= 0).
        rtol: relative tolerance (>= 0).
        raise_exception: raise ``GradcheckError`` on failure (``True``) or
            return ``False``.
        nondet_tol: how far two runs of the backward on the same cotangent may
            differ (PyTorch's reentrancy check; 0 means bit-equal).
        check_undefined_grad: check that a zero cotangent gives zero
            gradients (PyTorch's undefined output gradients).
        check_grad_dtypes: check each gradient's dtype and shape against its
            input's (JAX itself accepts a float32 gradient for a float64 input;
            an integer or boolean array input must get a ``float0`` gradient).
        check_batched_grad: check ``jax.vmap`` of the VJP over a batch of
            cotangents against one VJP per cotangent (normwise per gradient,
            within ``rtol``, or 1e-9 if that is larger: a batching bug is an
            error of order one, rounding of a lower precision inside is not).
        check_forward_ad: also check forward mode (adds ``"fwd"`` to ``modes``).
        check_backward_ad: check reverse mode (``False`` removes ``"rev"``).
        fast_mode: ``None`` picks by size as above; ``True`` forces the
            directional method, ``False`` the full one.
        modes: ``"rev"`` (VJPs; works for ``custom_vjp``), ``"fwd"`` (JVPs; for
            plain and ``custom_jvp`` functions, and ``jaxext.custom_vjp``), or both.
        num_directions: random directions per pair in the directional method.
        seed: seed of those directions and of random cotangents.
        reference: the same math in plain JAX (a function of the same arguments),
            for an op that computes in float32 or refuses float64 (a kernel), where
            finite differences cannot judge it. Then ``func`` runs at ``inputs`` in
            their own dtypes, and its values, its VJPs for two random cotangents
            (``"rev"`` in ``modes``) and JVPs for two random tangents (``"fwd"``)
            must match JAX's autodiff of ``reference`` at the same values in
            float64, normwise per leaf within a relative tolerance from the dtypes
            ``func`` computes in (``1e-4`` for float32, ``1e-7`` for float64,
            ``6.4e-2`` for bfloat16), as kernel libraries test a kernel against
            its XLA reference (``kind="reference"`` on failure). No finite
            differences run then (``eps``, ``atol``, ``fast_mode`` and
            ``num_directions`` do not apply). The ``check_*`` options keep their
            meaning, on ``func`` in its inputs' own dtypes: ``check_forward_ad`` /
            ``check_backward_ad`` (and ``modes``) choose the JVPs and VJPs compared;
            with ``"rev"``, ``check_undefined_grad`` (a zero cotangent gives exactly
            zero gradients), the reentrancy check (two runs within ``nondet_tol``)
            and ``check_batched_grad`` (within ``rtol``, or the tolerance between
            two programs in the dtypes ``func`` computes in, if larger) run as
            above, and ``check_grad_dtypes`` holds each gradient to its input's own
            dtype and shape.

    Returns:
        ``True`` if no check failed (unresolved entries: ``GradcheckUnresolvedWarning``);
        ``False`` on failure when ``raise_exception=False``.

    Raises:
        GradcheckError: on failure, naming the check (``kind``), the output,
            input, order, mode and the worst entry.
        TypeError: if ``func`` is not callable, an argument has the wrong type,
            or ``"fwd"`` is asked of a
            function without forward mode (a plain ``jax.custom_vjp``).
        ValueError: if ``eps``/``atol``/``rtol``/``nondet_tol`` are out of range,
            no mode is left, ``inputs`` is empty or has no float array, or
            ``func`` returns no float array.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> x = np.linspace(-1.0, 1.0, 12).reshape(4, 3)  # float64: no upcast warning
        >>> w = np.linspace(0.5, 1.5, 6).reshape(2, 3)
        >>> jaxext.gradcheck(jaxext.linear, (x, w), eps=1e-6, atol=1e-4)
        True

        A float32 kernel against its plain-JAX reference:

        >>> import jax.numpy as jnp
        >>> def kernel(x):  # computes in float32 whatever it is given
        ...     return jnp.tanh(x.astype(jnp.float32)).astype(x.dtype)
        >>> jaxext.gradcheck(kernel, (x,), reference=jnp.tanh, modes=("rev", "fwd"))
        True
    """
    args = as_args(func, inputs)
    settings = Settings.validate(
        eps=eps, atol=atol, rtol=rtol, nondet_tol=nondet_tol, fast_mode=fast_mode, modes=modes,
        forward=("check_forward_ad", check_forward_ad),
        backward=("check_backward_ad", check_backward_ad),
        num_directions=num_directions, seed=seed,
    )  # fmt: skip
    undefined, batched, dtypes = validated_flags(
        check_undefined_grad, check_batched_grad, check_grad_dtypes
    )
    if reference is not None:
        if not callable(reference):
            raise TypeError(f"`reference` must be a function or None; got {reference!r}.")
        error = against_reference(
            func, reference, args, settings, undefined=undefined, batched=batched, dtypes=dtypes
        )
    else:
        error = check_gradients(
            func, args, order=1, settings=settings, undefined=undefined, batched=batched,
            dtypes=dtypes,
        )  # fmt: skip
    error = warn_unresolved(error)
    if error is not None and raise_exception:
        raise error
    return error is None


def gradgradcheck(
    func: Callable[..., Any],
    inputs: Any,
    grad_outputs: Any = None,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    raise_exception: bool = True,
    nondet_tol: float = 0.0,
    check_undefined_grad: bool = True,
    check_batched_grad: bool = False,
    check_fwd_over_rev: bool = False,
    check_rev_over_rev: bool = True,
    fast_mode: bool | None = None,
    modes: str | Sequence[str] = ("rev",),
    num_directions: int = 3,
    seed: int = 0,
    reference: Callable[..., Any] | None = None,
) -> bool:
    """Checks ``func``'s second derivatives against finite differences.

    As in PyTorch, this runs the check of ``gradcheck`` on the function
    ``(inputs, grad_outputs) -> VJP of func at inputs applied to grad_outputs``:
    its Jacobian with respect to both the inputs and the cotangents. A backward
    rule that is right at first order but cuts the gradient through one of its
    residuals (a ``stop_gradient`` on a saved input, say) passes ``gradcheck``
    and fails here. First derivatives are not checked: call ``gradcheck`` too.

    Args:
        func: as for ``gradcheck``.
        inputs: as for ``gradcheck``.
        grad_outputs: cotangents for ``func``'s output, with its structure
            (a 1-tuple is accepted for a single array output); entries for
            integer outputs are ignored. ``None`` draws standard-normal ones
            from ``seed``.
        eps: as for ``gradcheck``.
        atol: as for ``gradcheck``.
        rtol: as for ``gradcheck``.
        raise_exception: as for ``gradcheck``.
        nondet_tol: as for ``gradcheck``, applied to the second-order VJP.
        check_undefined_grad: as for ``gradcheck``, for the VJP function.
        check_batched_grad: as for ``gradcheck``, for the VJP function.
        check_fwd_over_rev: also differentiate the VJP in forward mode (PyTorch's
            name; adds ``"fwd"`` to ``modes``).
        check_rev_over_rev: differentiate the VJP in reverse mode (``False``
            removes ``"rev"``).
        fast_mode: as for ``gradcheck``.
        modes: as for ``gradcheck``: how the VJP function is differentiated.
        num_directions: as for ``gradcheck``.
        seed: as for ``gradcheck``.
        reference: as for ``gradcheck``: the same math in plain JAX, for an op that
            computes in float32 (a kernel). Then the function ``(inputs,
            grad_outputs) -> VJP of func``, run at ``inputs`` and ``grad_outputs`` in
            their own dtypes (``grad_outputs`` cast to the output's), is compared with
            the same function of ``reference`` under JAX's autodiff in float64: its
            values (the first-order VJPs), its VJPs for two random cotangents
            (``"rev"`` in ``modes``: reverse over reverse) and its JVPs for two random
            tangents (``"fwd"``: forward over reverse), normwise per leaf within the
            tolerance of the dtypes ``func``'s second-order programs compute in
            (``kind="reference"`` on failure). No finite differences run;
            ``check_undefined_grad``, the reentrancy check (``nondet_tol``) and
            ``check_batched_grad`` run on the VJP function in those dtypes, as for
            ``gradcheck``.

    Returns:
        ``True`` if no check failed (unresolved entries: ``GradcheckUnresolvedWarning``);
        ``False`` on failure when ``raise_exception=False``.

    Raises:
        GradcheckError: on failure. ``input_index`` counts ``grad_outputs``
            after the positional inputs; ``output_index`` is the index of the
            input whose gradient failed.
        TypeError: as for ``gradcheck``.
        ValueError: as for ``gradcheck``, and if ``grad_outputs`` does not
            match ``func``'s output.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> x, c = np.arange(1.0, 4.0), np.array(2.0)
        >>> jaxext.gradgradcheck(jaxext.mul_constant, (x, c))
        True

        A float32 kernel's second derivatives against its plain-JAX reference:

        >>> import jax.numpy as jnp
        >>> def kernel(x):  # computes in float32 whatever it is given
        ...     return jnp.tanh(x.astype(jnp.float32)).astype(x.dtype)
        >>> jaxext.gradgradcheck(kernel, (x,), reference=jnp.tanh, modes=("rev", "fwd"))
        True
    """
    args = as_args(func, inputs)
    settings = Settings.validate(
        eps=eps, atol=atol, rtol=rtol, nondet_tol=nondet_tol, fast_mode=fast_mode, modes=modes,
        forward=("check_fwd_over_rev", check_fwd_over_rev),
        backward=("check_rev_over_rev", check_rev_over_rev),
        num_directions=num_directions, seed=seed,
    )  # fmt: skip
    undefined, batched, _ = validated_flags(check_undefined_grad, check_batched_grad, False)
    if reference is not None:
        if not callable(reference):
            raise TypeError(f"`reference` must be a function or None; got {reference!r}.")
        error = against_reference(
            func, reference, args, settings, order=2, grad_outputs=grad_outputs,
            undefined=undefined, batched=batched,
        )  # fmt: skip
    else:
        error = check_gradients(
            func, args, order=2, settings=settings, undefined=undefined, batched=batched,
            grad_outputs=grad_outputs,
        )  # fmt: skip
    error = warn_unresolved(error)
    if error is not None and raise_exception:
        raise error
    return error is None
