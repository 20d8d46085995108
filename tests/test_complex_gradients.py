"""Complex gradients: jaxext's ops against plain autodiff, and the checks on complex ops.

Complex factors and weights on real inputs: plain autodiff's gradients, no warning.

JAX's convention for a real input of a complex function is the real part of the
complex cotangent (the transpose of the real-to-complex cast). jaxext's backwards
must return exactly that, without the complex-to-real cast JAX warns about (a
``DeprecationWarning`` today, an error in a later JAX). The references are plain
``jnp`` autodiff of the same math, in float64.

Then gradcheck, gradgradcheck and opcheck on complex ops in JAX's convention: a grid
of correct ops that pass every check, and buggy backwards that fail.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rounding_tolerance
from ops_table import OPS

import jaxext
import jaxext.linen
import jaxext.nnx

RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 3))

# (name, jaxext function, plain jnp function, primal arguments): tests/ops_table.py
CASES = [case for op in OPS for case in op.complex_cases]


def _vjp(fn, args, seed):
    y, vjp = jax.vjp(fn, *args)
    rng = np.random.default_rng(seed)
    ct = rng.standard_normal(y.shape) + 1j * rng.standard_normal(y.shape)
    return y, vjp(jnp.asarray(ct, y.dtype))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_real_inputs_of_complex_ops_get_autodiff_gradients_without_warning(x64, case, jitted):
    _, ours, plain, args = case
    wrap = jax.jit if jitted else (lambda f: f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # JAX's complex-to-real cast warning included
        y, grads = _vjp(wrap(ours), [jnp.asarray(a) for a in args], seed=1)
        # float32/complex64 too: the warning does not depend on the precision.
        _vjp(wrap(ours), [jnp.asarray(a, np.result_type(a, np.float32)) for a in args], 1)
    y_ref, grads_ref = _vjp(plain, [jnp.asarray(a) for a in args], seed=1)
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    for g, g_ref, a in zip(grads, grads_ref, args, strict=True):
        assert g.dtype == g_ref.dtype == jnp.asarray(a).dtype
        np.testing.assert_allclose(g, g_ref, rtol=1e-13, atol=1e-13)


def _scale_grad_reference():
    """d/ds of sum |x s - 1|^2 at s = 1j, in float64 (jax.grad's complex convention)."""
    return jax.grad(lambda s: jnp.sum(jnp.abs(jnp.asarray(X) * s - 1.0) ** 2))(jnp.complex128(1j))


# The gradient is a float32 sum of X.size = 12 terms, held to the worst case (n * eps,
# not sqrt(n) * eps: the terms' errors do not cancel here): the rule at n = 12**2.
RTOL = rounding_tolerance(jnp.float32, n=12**2)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16, jnp.complex64])
def test_nnx_learnable_complex_constant(x64, param_dtype):
    x = jnp.asarray(X, jnp.float32)
    layer = jaxext.nnx.MulConstant(1j, learnable=True, param_dtype=param_dtype)
    assert layer.scale[...].dtype == jnp.complex64
    assert layer.scale[...] == 1j
    grad = nnx.grad(lambda m: jnp.sum(jnp.abs(m(x) - 1.0) ** 2))(layer)
    np.testing.assert_allclose(grad["scale"][...], _scale_grad_reference(), rtol=RTOL)


def test_linen_learnable_complex_constant(x64):
    x = jnp.asarray(X, jnp.float32)
    layer = jaxext.linen.MulConstant(1j, learnable=True)
    variables = layer.init(jax.random.key(0), x)
    assert variables["params"]["scale"] == 1j
    assert variables["params"]["scale"].dtype == jnp.complex64
    grad = jax.grad(lambda v: jnp.sum(jnp.abs(layer.apply(v, x) - 1.0) ** 2))(variables)
    np.testing.assert_allclose(grad["params"]["scale"], _scale_grad_reference(), rtol=RTOL)


# -- gradcheck, gradgradcheck and opcheck on complex ops (JAX's convention) -------------------
#
# JAX pairs a cotangent c with a tangent t as Re(c t): the VJP of f at cotangent c is
# c * df/dz + conj(c * df/dzbar) (Wirtinger derivatives), so c * f'(z) for holomorphic f,
# and jax.grad of a real function is dL/dx - i dL/dy = 2 dL/dz. For a real input of a
# complex function it is the real part of that. Each op below is a jaxext.custom_vjp
# whose backward is written by hand in that convention; each buggy one gets one thing wrong.


def _op(forward, backward):
    """A jaxext.custom_vjp of ``forward`` whose backward is ``backward(*args, g)``."""
    op = jaxext.custom_vjp(forward)
    op.defvjp(lambda *args: (forward(*args), args), lambda args, g: backward(*args, g))
    return op


def _cis(x):
    return jnp.exp(1j * x)


# (name, forward, hand-written backward, kinds of the arguments: "c" complex, "r" real)
CORRECT = [
    ("square", lambda z: z * z, lambda z, g: (g * 2 * z,), "c"),
    ("exp", jnp.exp, lambda z, g: (g * jnp.exp(z),), "c"),
    ("mul", lambda z, w: z * w, lambda z, w, g: (g * w, g * z), "cc"),
    ("conj", jnp.conj, lambda z, g: (jnp.conj(g),), "c"),
    ("abs2", lambda z: jnp.real(z * jnp.conj(z)), lambda z, g: ((2 * g * jnp.conj(z)),), "c"),
    ("real", jnp.real, lambda z, g: (g.astype(z.dtype),), "c"),
    ("imag", jnp.imag, lambda z, g: (-1j * g.astype(z.dtype),), "c"),
    (
        "z_conj_w",
        lambda z, w: z * jnp.conj(w),
        lambda z, w, g: (g * jnp.conj(w), jnp.conj(g * z)),
        "cc",
    ),
    # (a real input's gradient in its dtype: a bfloat16 x has a complex64 output)
    ("cis", _cis, lambda x, g: (jnp.real(g * 1j * _cis(x)).astype(x.dtype),), "r"),
    (
        "real_times_complex",
        lambda x, z: x * z,
        lambda x, z, g: (jnp.real(g * z).astype(x.dtype), (g * x).astype(z.dtype)),
        "rc",
    ),
]

# (name, forward, wrong backward, kinds): what is wrong, in the comment above each
BUGGY = [
    ("conj_missing_conj", jnp.conj, lambda z, g: (g,), "c"),
    (
        "z_conj_w_missing_conj",
        lambda z, w: z * jnp.conj(w),
        lambda z, w, g: (g * jnp.conj(w), g * z),
        "cc",
    ),
    # d/dzbar instead of d/dz (PyTorch's convention, conj of JAX's)
    ("exp_wrong_wirtinger", jnp.exp, lambda z, g: (g * jnp.conj(jnp.exp(z)),), "c"),
    ("abs2_wrong_wirtinger", lambda z: jnp.real(z * jnp.conj(z)), lambda z, g: (2 * g * z,), "c"),
    # the imaginary part of the gradient dropped
    (
        "square_drops_imag",
        lambda z: z * z,
        lambda z, g: (jnp.real(g * 2 * z).astype(z.dtype),),
        "c",
    ),
    # the imaginary part of the cotangent ignored
    ("cis_ignores_imag_cotangent", _cis, lambda x, g: (jnp.real(jnp.real(g) * 1j * _cis(x)),), "r"),
]

PRECISIONS = {"complex128": (np.complex128, np.float64), "complex64": (np.complex64, np.float32)}


def _args(kinds, precision, seed=0):
    complex_dtype, real_dtype = PRECISIONS[precision]
    rng = np.random.default_rng(seed)
    args = []
    for kind in kinds:
        re, im = rng.uniform(0.5, 1.5, (3, 2)) * rng.choice([-1, 1], (2, 3, 2))
        args.append((re + 1j * im).astype(complex_dtype) if kind == "c" else re.astype(real_dtype))
    return tuple(args)


@pytest.mark.parametrize("case", CORRECT, ids=[c[0] for c in CORRECT])
def test_hand_written_backwards_match_jax_autodiff(x64, case):
    """The references are right: each backward equals jax.vjp of the plain function."""
    name, forward, backward, kinds = case
    args = [jnp.asarray(a) for a in _args(kinds, "complex128")]
    y, pullback = jax.vjp(forward, *args)
    rng = np.random.default_rng(1)
    g = rng.standard_normal(y.shape) + (
        1j * rng.standard_normal(y.shape) if jnp.iscomplexobj(y) else 0
    )
    g = jnp.asarray(g, y.dtype)
    for ours, ref, a in zip(backward(*args, g), pullback(g), args, strict=True):
        assert ours.dtype == ref.dtype == a.dtype
        np.testing.assert_allclose(ours, ref, rtol=1e-14, atol=1e-14)


def test_convention_hand_computed(x64):
    """JAX's convention, written out: grad |z|^2 = 2 conj(z); vjp of z^2 at c is 2 z c;
    vjp of conj at c is conj(c); grad Im(z) = -i."""
    z, c = jnp.complex128(1.5 - 0.5j), jnp.complex128(0.25 + 2j)
    assert jax.grad(lambda z: jnp.abs(z) ** 2)(z) == pytest.approx(3.0 + 1.0j)
    assert jax.vjp(lambda z: z * z, z)[1](c)[0] == pytest.approx(2 * (1.5 - 0.5j) * (0.25 + 2j))
    assert jax.vjp(jnp.conj, z)[1](c)[0] == pytest.approx(0.25 - 2j)
    assert jax.grad(jnp.imag)(z) == pytest.approx(-1j)


def _quiet_gradcheck(check, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "gradcheck: .* not float64", UserWarning)
        return check(*args, **kwargs)


def _each_correct_op_in_each_precision(test):
    """Parametrizes ``test`` over ``case`` (each CORRECT op) and ``precision``."""
    test = pytest.mark.parametrize("case", CORRECT, ids=[c[0] for c in CORRECT])(test)
    return pytest.mark.parametrize("precision", PRECISIONS)(test)


@contextlib.contextmanager
def _no_imaginary_part_dropped():
    with warnings.catch_warnings():
        warnings.simplefilter("error", np.exceptions.ComplexWarning)
        yield


@_each_correct_op_in_each_precision
def test_correct_complex_ops_pass_gradcheck_and_gradgradcheck(case, precision):
    _, forward, backward, kinds = case
    op, args = _op(forward, backward), _args(kinds, precision)
    with _no_imaginary_part_dropped():
        assert _quiet_gradcheck(
            jaxext.gradcheck, op, args, check_grad_dtypes=True, check_batched_grad=True,
            check_forward_ad=True,
        )  # fmt: skip
        assert _quiet_gradcheck(jaxext.gradgradcheck, op, args, check_fwd_over_rev=True)


@_each_correct_op_in_each_precision
def test_correct_complex_ops_pass_every_opcheck_check(case, precision):
    _, forward, backward, kinds = case
    op, args = _op(forward, backward), _args(kinds, precision)
    with _no_imaginary_part_dropped():
        report = jaxext.opcheck(op, args, raise_exception=False)
    # (export_symbolic: a two-input elementwise op gets one symbolic batch on both inputs;
    # jit_reuse leaves out subsets of two or more differentiable inputs)
    expected = ("unwritten_outputs", "jit_reuse") if len(args) < 2 else ("unwritten_outputs",)
    assert report.skipped == expected, str(report)
    assert not report.failed, str(report)
    if "r" not in kinds:
        assert "bfloat16 not run" in report["low_precision"].detail


@pytest.mark.parametrize("case", BUGGY, ids=[c[0] for c in BUGGY])
def test_buggy_complex_backwards_fail_gradcheck_and_opcheck(case):
    name, forward, backward, kinds = case
    op, args = _op(forward, backward), _args(kinds, "complex128")
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(op, args)
    assert info.value.kind == "jacobian"
    assert "part)" in str(info.value)  # the element named with its real or imaginary part
    # (jvp_vjp passes: jaxext.custom_vjp derives forward mode from the same backward)
    report = jaxext.opcheck(op, args, checks=["gradcheck", "jvp"], raise_exception=False)
    assert report.failed == ("gradcheck", "jvp"), str(report)


def _plain_custom_vjp(backward):
    """z * z as a plain jax.custom_vjp (which does not check its backward's dtypes)."""
    square = jax.custom_vjp(lambda z: z * z)
    square.defvjp(lambda z: (z * z, z), backward)
    return square


@pytest.mark.parametrize(
    "backward",
    [
        lambda z, g: (jnp.real(g * 2 * z),),  # real for complex: the imaginary part lost too
        lambda z, g: ((g * 2 * z).astype(jnp.complex64),),  # complex64 for complex128
    ],
    ids=["real_gradient", "complex64_gradient"],
)
def test_wrong_gradient_dtype_for_a_complex_input_fails(backward):
    (z,) = _args("c", "complex128")
    square = _plain_custom_vjp(backward)
    assert not jaxext.gradcheck(square, (z,), check_grad_dtypes=True, raise_exception=False)
    report = jaxext.opcheck(square, (z,), checks=["grad_dtypes"], raise_exception=False)
    assert report.failed == ("grad_dtypes",), str(report)
    assert "expected complex128(3, 2)" in report["grad_dtypes"].detail


def test_a_real_gradient_for_a_complex_input_is_accepted_as_jax_does_and_gradcheck_fails_it(x64):
    """jax.custom_vjp takes a float64 gradient for a complex128 input (its dtype exception
    for inexact inputs), so jaxext.custom_vjp does too (issue #45: the swap must not break
    working code); the imaginary part it drops is a wrong gradient, which gradcheck names."""
    (z,) = _args("c", "complex128")
    square = _op(lambda z: z * z, lambda z, g: (jnp.real(g * 2 * z),))
    plain = jax.custom_vjp(lambda z: z * z)
    plain.defvjp(lambda z: (z * z, z), lambda z, g: (jnp.real(g * 2 * z),))
    ct = jnp.ones(z.shape, z.dtype)
    (expected,) = jax.vjp(plain, z)[1](ct)
    (got,) = jax.vjp(square, z)[1](ct)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(square, (z,))
    assert "(imaginary part)" in str(info.value)


def test_complex_gradcheck_error_names_the_part():
    """abs2 with d/dzbar: the real direction is right, the imaginary one has the wrong sign."""
    op = _op(lambda z: jnp.real(z * jnp.conj(z)), lambda z, g: (2 * g * z,))
    (z,) = _args("c", "complex128")
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradcheck(op, (z,))
    err = info.value
    assert "(imaginary part)" in str(err) and err.input_element == err.output_element
    # d|z|^2/dy = 2y, the analytical value from the wrong backward -2y
    y = z.imag[err.input_element]
    assert err.numerical == pytest.approx(2 * y, rel=1e-6)
    assert err.analytical == pytest.approx(-2 * y, rel=1e-12)


def test_complex_grad_outputs_for_gradgradcheck():
    """grad_outputs for a complex output are complex; a complex one for a real output is
    refused, naming it."""
    op = _op(lambda z: z * z, lambda z, g: (g * 2 * z,))
    (z,) = _args("c", "complex128")
    assert jaxext.gradgradcheck(op, (z,), grad_outputs=(np.full(z.shape, 0.5 - 2j),))
    with pytest.raises(ValueError, match="grad_outputs"):
        jaxext.gradgradcheck(jnp.real, (z,), grad_outputs=(np.full(z.shape, 1j),))


def test_analytical_jacobian_matches_pytorch():
    """PyTorch's gradient is the conjugate of JAX's: vjp_jax(c) = conj(vjp_torch(conj(c)))."""
    torch = pytest.importorskip("torch")
    z, w = _args("cc", "complex128")
    rng = np.random.default_rng(3)
    c = rng.standard_normal(z.shape) + 1j * rng.standard_normal(z.shape)
    op = dict((c_[0], c_) for c_ in CORRECT)["z_conj_w"]
    ours = _op(op[1], op[2])
    with jax.enable_x64(True):
        _, pullback = jax.vjp(ours, jnp.asarray(z), jnp.asarray(w))
        jax_grads = pullback(jnp.asarray(c))
    tz = torch.tensor(z, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    torch_grads = torch.autograd.grad(tz * torch.conj(tw), (tz, tw), torch.tensor(np.conj(c)))
    for ours_g, theirs in zip(jax_grads, torch_grads, strict=True):
        np.testing.assert_allclose(
            np.asarray(ours_g), np.conj(theirs.resolve_conj().numpy()), rtol=1e-14
        )


def test_complex_values_in_opcheck_diagnostics():
    """A complex gradient is reported whole: a backward adding 0.5j fails zero_cotangent
    with the complex value (a real-part-only comparison would see zero and pass)."""
    op = _op(lambda z: z * z, lambda z, g: (g * 2 * z + 0.5j,))
    report = jaxext.opcheck(
        op, _args("c", "complex128"), checks=["zero_cotangent"], raise_exception=False
    )
    assert report.failed == ("zero_cotangent",)
    assert "element (0, 0) is 0+0.5j (6 of 6 elements nonzero)" in report["zero_cotangent"].detail


def test_gradgradcheck_catches_a_complex_backward_cut_from_its_input():
    """A backward right at first order whose own derivative is cut (stop_gradient on z)."""
    op = _op(lambda z: z * z, lambda z, g: (g * 2 * jax.lax.stop_gradient(z),))
    args = _args("c", "complex128")
    assert jaxext.gradcheck(op, args)
    with pytest.raises(jaxext.GradcheckError) as info:
        jaxext.gradgradcheck(op, args)
    assert info.value.kind == "jacobian" and info.value.order == 2
    assert "(the gradient of input 0)" in str(info.value) and "part)" in str(info.value)


def test_complex64_inputs_warn_then_upcast_complex128_ones_do_not():
    square = _op(lambda z: z * z, lambda z, g: (g * 2 * z,))
    with pytest.warns(UserWarning, match=r"input 0 \(complex64\) not float64 \(complex128"):
        assert jaxext.gradcheck(square, _args("c", "complex64"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jaxext.gradcheck(square, _args("c", "complex128"))


def test_mul_constant_with_a_complex_constant_passes_opcheck():
    """jaxext's own op, a real input times a differentiable complex constant (mixed)."""
    x = np.random.default_rng(4).standard_normal((3, 2))
    report = jaxext.opcheck(jaxext.mul_constant, (x, np.asarray(2.0 + 1.0j)), raise_exception=False)
    assert report.skipped == ("unwritten_outputs",) and not report.failed, str(report)
    assert jaxext.gradcheck(jaxext.mul_constant, (x + 0.5j * x[::-1], 2.0 + 1.0j))
