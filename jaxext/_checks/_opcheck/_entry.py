"""`opcheck`: one call that checks a custom op under every JAX transformation.

The flow is one way: arguments -> ``OpUnderTest`` -> each check of ``ALL_CHECKS``
(PASS with a detail, SKIP with a reason, FAIL with a diagnostic; an exception
raised by the op inside a check is that check's failure, never a crash) ->
``OpcheckReport`` -> ``OpcheckError`` if anything failed.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .._precision import float64_numerics
from .._settings import Settings, as_args
from . import ALL_CHECKS, CHECK_NAMES, CHECKS
from ._common import Skip, Unresolved, float64_refusal, refused_forward_mode
from ._interpreter import interpreter_limit
from ._kernels import checking_mode
from ._op import CheckFailed, OpUnderTest
from ._plain import jax_limit, underlying_error
from ._report import CheckResult, OpcheckError, OpcheckReport
from .platforms import check_platforms

__all__ = ["opcheck"]


def opcheck(
    func: Callable[..., Any],
    args: Any,
    *,
    checks: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    nondet_tol: float = 0.0,
    raise_exception: bool = True,
    seed: int = 0,
    platforms: Sequence[str] | None = None,
    reference: Callable[..., Any] | None = None,
) -> OpcheckReport:
    """Checks a custom op under JAX's transformations; returns a report.

    The JAX counterpart of ``torch.library.opcheck``, with the checks a custom
    VJP op can get wrong. All run in float64 (but for an op with no float64
    path, below) on ``args`` (keep them small: a
    few elements per dimension), in this order:

    * ``unwritten_outputs``: for an op that calls C++ kernels of
      :mod:`jaxext.cpp_extension`, its output, gradients and JVP computed in
      checking mode (:func:`jaxext.cpp_extension.checking`: the kernels' result
      buffers filled with NaN, integers with a sentinel, before they run) hold no
      NaN that the same computation without it does not: an element a kernel
      never writes fails, naming the output. SKIP for an op without such kernels.
      All the other checks run in checking mode too.
    * ``forward_rule``: the primal outputs of ``jax.vjp`` (and ``jax.jvp``)
      equal the op's output: a ``custom_vjp`` forward rule computes the op.
    * ``grad_dtypes``: each gradient has its input's dtype and shape, for
      float64, float32 and bfloat16 inputs (complex ones complex128, complex64
      and complex64; ``float0`` for integer inputs); JAX itself accepts a float32
      gradient for a float64 input without a word. A
      dtype the op has no kernel for is a SKIP naming it.
    * ``zero_cotangent``: a zero cotangent gives exactly zero gradients, and
      using only one of several outputs (the others symbolic zeros) works.
    * ``linearity``: the backward is linear in its cotangent, as a VJP is:
      ``bwd(3 g1 - 0.5 g2)`` equals ``3 bwd(g1) - 0.5 bwd(g2)`` for random ``g1, g2``
      (a clip of ``g`` that one-hot cotangents never reach fails here). The row names
      the calls in the backward that forward mode trusts to be linear without seeing
      into them (host callbacks, FFI and Pallas kernels).
    * ``reentrancy``: the backward run twice agrees within ``nondet_tol``.
    * ``gradcheck`` / ``gradgradcheck``: first and second derivatives against
      finite differences, entry by entry (``jaxext.gradcheck``). A backward
      declared ``once_differentiable``, or one that runs but that plain JAX
      refuses to differentiate the same way with the custom rules inside it
      stripped (a ``while_loop`` with a dynamic trip count, a Pallas kernel ...), is
      a SKIP of every second-order row it reaches, with one and the same reason
      whatever exception each met; so is an op whose rules raise "Higher-order AD
      not supported" (a declared limit).
    * ``fwd_over_rev``, ``rev_over_fwd``, ``fwd_over_fwd``: the other three
      compositions of second derivatives. ``fwd_over_rev``
      (``jax.jacfwd(jax.jacrev(f))``): the VJP's JVPs against its finite
      differences, entry by entry. ``rev_over_fwd`` (``jax.jacrev(jax.jacfwd(f))``)
      and ``fwd_over_fwd``: ``u . D2f[t, s]`` for random ``u, t, s`` equals that of
      reverse over reverse (which ``gradgradcheck`` checks), a ``jvp`` rule can
      be right at first order and wrong at second; they SKIP for an op without
      forward mode.
    * ``jvp``: forward mode against finite differences; ``jvp_vjp``: ``u . (J v)``
      from ``jax.jvp`` equals ``(J^T u) . v`` from ``jax.vjp``. Both SKIP for an
      op without forward mode (a plain ``jax.custom_vjp``; use
      ``jaxext.custom_vjp`` to get it).
    * ``jit``: values and gradients under ``jit`` equal eager ones.
    * ``jit_reuse``: one jitted op, differentiated with respect to subsets of its
      inputs in turn (each input alone, and subsets covering every pair of inputs
      both in, one in, neither), and used several times in one differentiated
      computation with different inputs differentiated (the others cut by
      ``stop_gradient`` or constants, as in ``op(a, c) + op(c, b) + op(a, b) ** 2``),
      gives the gradients of fresh traces; also with a freshly jitted op called
      once before (as in an evaluation pass before training).
    * ``vmap``: output, gradient and JVP under ``vmap`` over each argument in
      turn equal a Python loop. Only array leaves are batched (Python scalars,
      strings, ``None`` stay as given, as with ``in_axes=None``); typed PRNG
      keys are batched as keys (``jax.random.split``).
    * ``checkpoint``: the same gradients under ``jax.checkpoint`` with the
      standard policies (a policy plain JAX cannot apply to the op's math
      either is not run: a SKIP naming it).
    * ``export``: a ``jax.export`` round trip (serialize, deserialize, call)
      gives the same values and gradients; ``export_symbolic`` exports with a
      symbolic leading dimension on the first input of two or more dimensions,
      or, where the op ties it to other inputs (an elementwise op), on every input
      of that leading dimension, one shared symbol, integer array inputs of that
      leading dimension (token labels) included (SKIP when the op does not trace
      with either, or when that dimension is 0:
      ``jax.export``'s symbolic dimensions are at least 1). Calls of C++ kernels of
      :mod:`jaxext.cpp_extension` are exported with
      ``jax.export.DisabledSafetyCheck.custom_call`` for their targets.
    * ``low_precision``: float32 and bfloat16 inputs run, and outputs and
      gradients stay within ``16 * eps(dtype)`` (normwise) of float64 computed
      at the same rounded inputs (rounding the inputs is not the op's error;
      the cotangent takes each output's dtype, so a float32 output for a
      bfloat16 input is fine); a gradient whose terms cancel is held to 16 eps
      of the size of its terms, estimated in float64 with random-sign cotangents,
      and a gradient may be off by 8 times what residuals off by ``eps`` change in
      its float64 value (the rounding of the values the backward computes from).
      A dtype the op refuses while tracing, with an error naming it whatever its
      class (a ``TypeError`` from an op whose kernels have no handler for that
      dtype, JAX's ``ValueError`` for a bfloat16 FFT), or has no kernel for
      (``NotImplementedError``), is a SKIP with the op's message. Complex inputs
      run as complex64 (there is no complex bfloat16: an op whose inputs are
      all complex runs float32 only).
    * ``platform_cpu``, ``platform_cuda``, ``platform_rocm``, ``platform_tpu``:
      the op's jitted forward, VJP and JVP lower for that platform (lowering
      only, no hardware needed), at each dtype the op takes (float64, and
      float32 and bfloat16 where it lowers for this machine's backend or, for a
      kernel compiled for accelerators only, for a selected platform).

    Complex inputs and outputs are checked in JAX's convention (a cotangent
    ``c`` pairs with a tangent ``t`` as ``Re(c t)``; the VJP of a holomorphic
    ``f`` is ``c * f'(z)``): the gradient checks see each complex element as
    its real and imaginary part, cotangents and tangents are complex, and
    complex results are compared whole.

    An exception raised inside a check is a SKIP naming JAX's limit when the
    same check on the op's math with every custom rule stripped (JAX's own
    autodiff and batching of the primal) raises the same way, or when it is one
    of Pallas's TPU interpreter's own defects (a kernel under ``jax.vmap``, an
    int64 value for a kernel's int32 under x64), recognised where the
    interpreter raises it; otherwise it is that check's FAIL.

    Comparisons of two programs computing the same math (jit and eager, vmap
    and a loop ...) allow a normwise relative error from the dtypes the op
    computes in, read from its programs (its jaxprs' values, kernels' bodies
    included): 1e-9 for an op computing in float64 only, 1e-5 for one that
    computes in float32 (a kernel that casts its inputs), 4e-3 in float16,
    3.2e-2 in bfloat16; NaN in the same places on both sides (``jnp.log`` at
    negative inputs) agrees. The ``jit`` row compiles the op as ``jax.jit``
    does.

    An op with no float64 path (its float64 call raises: a float32 loop
    carry, a kernel that refuses float64) runs every check in the dtypes it
    takes (float32 for float64 ``args``), each row saying so; ``low_precision``
    is then a SKIP. The gradient rows of such an op, or of one that computes in
    float32, are judged against ``reference`` where one is given (values, VJPs
    and JVPs, and those of the VJP at second order, against JAX's autodiff of
    the reference in float64, normwise within 1e-4 for float32), else by
    finite differences at a step for its dtype (``eps(dtype) ** (1/3)``, with
    ``atol`` and ``rtol`` at least ``1000 eps`` and ``100 eps``).

    Args:
        func: the op: a function of the positional arguments ``args``.
        args: tuple (or list) of positional arguments: arrays, pytrees of
            arrays, and static values (Python scalars, strings ...). Float
            array leaves are the differentiable inputs.
        checks: names of the checks to run (default: all, ``jaxext.CHECK_NAMES``, in run
            order).
        skip: names of checks not to run.
        eps: finite-difference step of the gradient checks (scaled down for
            inputs below 0.01, as in ``jaxext.gradcheck``).
        atol: absolute tolerance of the gradient checks.
        rtol: relative tolerance of the gradient checks.
        nondet_tol: how far two runs of the backward may differ.
        raise_exception: raise ``OpcheckError`` if a check fails (else return
            the report with its FAIL rows).
        seed: seed of the random cotangents, tangents and batches.
        platforms: the platforms the op must run on, some of ``"cpu"``, ``"cuda"``,
            ``"rocm"``, ``"tpu"`` (default: none required). A platform named here
            whose C++ kernels have no handler for it is a FAIL of its
            ``platform_<name>`` row instead of a SKIP; its row must be selected.
        reference: the op's math in plain JAX, a function of the same arguments
            (default: none). ``gradcheck``, ``jvp``, ``gradgradcheck`` and
            ``fwd_over_rev`` then compare the op with JAX's autodiff of it in
            float64 instead of finite differences, as kernel libraries test a
            kernel against its XLA reference.

    Returns:
        The ``OpcheckReport``; ``print(report)`` shows the table.

    Raises:
        OpcheckError: if a check fails and ``raise_exception`` is true, naming
            each failed check with its diagnostic.
        TypeError: if ``func`` is not callable or an option has the wrong type.
        ValueError: for an unknown check name or platform, an option out of range,
            a platform in ``platforms`` whose row is not run, or ``args`` without
            a floating-point array.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> x, w = np.ones((2, 3)), np.ones((4, 3))
        >>> report = jaxext.opcheck(jaxext.linear, (x, w), checks=["gradcheck", "vmap"])
        >>> report.failed
        ()

        A float32 kernel, judged against its plain-JAX reference:

        >>> import jax.numpy as jnp
        >>> def kernel(x, w):  # computes in float32 whatever it is given
        ...     return jaxext.linear(x.astype(jnp.float32), w.astype(jnp.float32))
        >>> report = jaxext.opcheck(
        ...     kernel, (x, w), checks=["gradcheck", "jit"], reference=lambda x, w: x @ w.T
        ... )
        >>> print(report["gradcheck"].detail)  # doctest: +NORMALIZE_WHITESPACE
        values and VJPs match the reference's autodiff in float64 (normwise rtol 0.0001;
        the op computes in float32, float64)
    """
    args = as_args(func, args, argument="args")
    selected = _selected(checks, skip)
    settings = Settings.validate(
        eps=eps, atol=atol, rtol=rtol, nondet_tol=nondet_tol, fast_mode=None, modes=("rev",),
        forward=("check_forward_ad", False), backward=("check_backward_ad", True),
        num_directions=3, seed=seed,
    )  # fmt: skip
    if not isinstance(raise_exception, bool):
        raise TypeError(f"`raise_exception` must be True or False; got {raise_exception!r}.")
    if reference is not None and not callable(reference):
        raise TypeError(f"`reference` must be a function or None; got {reference!r}.")
    required = check_platforms(platforms)
    unrun = sorted(p for p in required if f"platform_{p}" not in selected)
    if unrun:
        raise ValueError(
            f"`platforms` names {unrun}, but the check(s) "
            f"{[f'platform_{p}' for p in unrun]} are not run (see `checks` and `skip`)."
        )
    with float64_numerics():
        op = OpUnderTest.build(func, args, reference)
        op.cache["selected"] = frozenset(selected)
        op.cache["platforms"] = required
        results = tuple(_run(name, op, settings) for name in selected)
    report = OpcheckReport(_op_name(func), results)
    if report.failed and raise_exception:
        raise OpcheckError(report)
    return report


def _selected(checks: Sequence[str] | None, skip: Sequence[str]) -> list[str]:
    for name, names in (("checks", checks), ("skip", skip)):
        if names is None:
            continue
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"`{name}` must be a sequence of check names; got {names!r}.")
        unknown = sorted(set(names) - set(CHECK_NAMES))
        if unknown:
            raise ValueError(f"`{name}`: unknown checks {unknown}; expected some of {CHECK_NAMES}.")
    wanted = set(CHECK_NAMES if checks is None else checks) - set(skip)
    if not wanted:
        raise ValueError("no check left to run: `checks` minus `skip` is empty.")
    return [name for name in CHECK_NAMES if name in wanted]


def _run(name: str, op: OpUnderTest, settings: Settings) -> CheckResult:
    start = time.perf_counter()
    try:
        # C++ kernels run in checking mode: results they leave unwritten are NaN.
        with warnings.catch_warnings(), checking_mode():
            warnings.simplefilter("ignore", UserWarning)  # upcasts and the like: not findings
            detail, status = ALL_CHECKS[name](op, settings), "PASS"
            if op.narrow is not None and name not in _SAYS_PRECISION:
                detail = f"{detail} ({op.precision})"
    except Skip as reason:
        detail, status = str(reason), "SKIP"
    except Unresolved as reason:
        detail, status = str(reason), "UNRESOLVED"
    except Exception as err:  # noqa: BLE001 -- an op raising inside a check fails that check
        if isinstance(err, CheckFailed):
            detail, status = str(err), "FAIL"
        else:
            detail, status = f"raised {type(err).__name__}: {str(err).strip()}", "FAIL"
        limit = _jax_limit(name, op, settings, err)
        if limit is not None:
            detail, status = limit, "SKIP"
    return CheckResult(name, status, detail, time.perf_counter() - start)


# The rows whose detail already says the dtypes the op ran in.
_SAYS_PRECISION = frozenset({"gradcheck", "jvp", "low_precision"})


def _jax_limit(name: str, op: OpUnderTest, settings: Settings, err: Exception) -> str | None:
    """Why the exception ``err`` of check ``name`` is JAX's limit (the same check on the
    op's plain twin raises it too, ``_plain.jax_limit``), or ``None``: the op's FAIL."""
    raised = underlying_error(err)
    if raised is None:
        return None
    interpreter = interpreter_limit(raised)
    if interpreter is not None:  # the TPU interpreter's own defect: no plain twin can show it
        return interpreter
    no_float64 = float64_refusal(op, raised)
    if no_float64 is not None:  # one cause, one verdict: every row that meets it
        return no_float64
    no_forward_mode = refused_forward_mode(op, raised)
    if no_forward_mode is not None:  # one cause, one verdict: as the rows that ask first
        return no_forward_mode

    def rerun(twin: OpUnderTest) -> None:
        with warnings.catch_warnings(), checking_mode():
            warnings.simplefilter("ignore", UserWarning)
            CHECKS[name](twin, settings)

    return jax_limit(op, raised, rerun)


def _op_name(func: Callable[..., Any]) -> str:
    """The report's title: a ``jaxext.Function``'s class name for its ``apply`` (``Cube``,
    not ``apply``), else the function's ``__name__``."""
    from ..._function import Function

    owner = getattr(func, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, Function):
        return owner.__name__
    return getattr(func, "__name__", type(func).__name__)
