"""The Flax drop-ins against Flax's own layers over the whole constructor grid.

For every combination of ``use_bias``, ``dtype``, ``param_dtype``, ``precision``
and ``preferred_element_type`` (NNX; Linen's ``Dense`` has no
``preferred_element_type``), one jitted program per layer computes the outputs and
all gradients (parameters and inputs) for inputs without batch axes, with one,
with several and with an empty one (in float32, and also in bfloat16 where the
layer's ``dtype`` is None, so that the input's dtype enters the promotion; with a
``dtype``, one bfloat16 input too: mixed precision, bfloat16 inputs cast to the
compute dtype). Linen's initial parameters are compared too.

The claim tested is bit-equality, and it is legitimate only because both sides
compile to the *same* program: jaxext's custom VJP (``jaxext/_dense.py``) emits
the ops Flax's autodiff emits, in the same order with the same dtypes. So each
test first checks that the two optimized XLA programs are identical (up to
instruction names and source locations: a digest of the dataflow graph); equal
programs round identically on any CPU, and then the results must agree bit for
bit. Combinations Flax refuses must
be refused by jaxext with the same exception type.

Where the programs cannot be the same (an ``nnx.vmap`` ensemble with an input
shared by all members: JAX sums the members' input gradients after jaxext's
vmapped backward but inside one dot in Flax's, and with a single member lays out
the kernel gradient differently), both are compared with a float64 reference at
a bound derived from float32's epsilon and the sums' lengths instead.
"""

from __future__ import annotations

import hashlib
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from helpers import grid

import jaxext.linen
import jaxext.nnx

F32, BF16, F16, C64 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64
IN, OUT = 6, 3
BATCHES = [(), (4,), (2, 3), (0,)]  # none, one, several, empty
X_DTYPES = [F32, BF16]
# float16 as a preferred_element_type only: as a compute dtype it is one more
# narrow float like bfloat16 (the ops emitted do not depend on which), and the grid
# is compiled twice per combination.
DTYPES = [None, F32, BF16, C64]
PARAM_DTYPES = [F32, BF16]
PRECISIONS = [None, "highest"]
PREFERRED = [None, F32, BF16, F16]


def _name(value):
    return getattr(value, "__name__", str(value))


def _inputs(dtype):
    """Inputs of every batch shape: float32, and bfloat16 too when the layer's
    ``dtype`` is None (then the input dtype enters the promotion). Otherwise the
    input is only cast to ``dtype``, and one bfloat16 input (several batch axes)
    checks the cast and the input gradient coming back in bfloat16 (bfloat16 or
    float32 compute on bfloat16 inputs, what mixed-precision training does)."""
    rng = np.random.default_rng(0)
    x_dtypes = X_DTYPES if dtype is None else X_DTYPES[:1]
    xs = [
        jnp.asarray(rng.standard_normal((*batch, IN)), x_dtype)
        for batch in BATCHES
        for x_dtype in x_dtypes
    ]
    if dtype is not None:
        xs.append(jnp.asarray(rng.standard_normal((2, 3, IN)), BF16))
    return xs


def _cotangent(y):
    """A fixed cotangent of ``y``'s shape and dtype (a constant of the program)."""
    ramp = jnp.arange(y.size, dtype=F32).reshape(y.shape)
    return jnp.sin(ramp * 0.37 + 0.1).astype(y.dtype)


_INSTRUCTION = re.compile(r"\s*(ROOT )?(%\S+) = (.*)")
_COMPUTATION = re.compile(r"(ENTRY )?(%\S+) .*\{$")


def program_digest(compiled) -> str:
    """A digest of an optimized XLA program's dataflow, blind to names and locations.

    Each instruction is digested from its text (op, result type, attributes) with
    its operands and called computations replaced by their own digests, so two
    programs get the same digest exactly when they compute the same graph of the
    same instructions, whatever the names or the order in which they are printed.
    """
    digests: dict[str, str] = {}
    computation = root = entry = None
    for line in compiled.as_text().splitlines():
        if match := _INSTRUCTION.match(line):
            is_root, name, body = match.groups()
            body = re.sub(r", metadata=\{[^}]*\}", "", body)
            body = re.sub(r", stack_frame_id=\d+", "", body)
            body = re.sub(r"%[\w.\-]+", lambda m: digests.get(m.group(), "?"), body)
            digests[name] = hashlib.sha1(body.encode()).hexdigest()[:16]
            root = digests[name] if is_root else root
        elif match := _COMPUTATION.match(line):
            is_entry, computation = match.groups()
            entry = computation if is_entry else entry
        elif line.startswith("}") and computation is not None:
            digests[computation] = root
            computation = None
    return digests[entry]


def _assert_same_bits(ours, theirs):
    ours_leaves, theirs_leaves = jax.tree.leaves(ours), jax.tree.leaves(theirs)
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(ours_leaves, theirs_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes(), np.max(np.abs(a.astype(complex) - b.astype(complex)))


def _compile_and_run(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return program_digest(compiled), compiled(*args)


def _check_same_program(run_flax, run_ours):
    """Runs Flax's and jaxext's programs; same refusal, or same program and same bits."""
    try:
        theirs_program, theirs = run_flax()
    except Exception as err:  # a combination Flax refuses: jaxext refuses it alike
        with pytest.raises(type(err)):
            run_ours()
        return
    ours_program, ours = run_ours()
    assert ours_program == theirs_program
    _assert_same_bits(ours, theirs)


# -- NNX ---------------------------------------------------------------------------------


def _nnx_program(graphdef):
    def program(state, xs):
        def one(x):
            y, vjp = jax.vjp(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
            return y, vjp(_cotangent(y))

        return [one(x) for x in xs]

    return program


@pytest.mark.parametrize(
    *grid(
        use_bias=[True, False],
        dtype=DTYPES,
        param_dtype=PARAM_DTYPES,
        precision=PRECISIONS,
        preferred=PREFERRED,
        ids=_name,
    )
)
def test_nnx_linear_same_program_and_bits_as_flax(
    use_bias, dtype, param_dtype, precision, preferred
):
    kwargs = dict(
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        precision=precision,
        preferred_element_type=preferred,
    )
    xs = _inputs(dtype)

    def run(cls):
        graphdef, state = nnx.split(cls(IN, OUT, rngs=nnx.Rngs(0), **kwargs))
        return _compile_and_run(_nnx_program(graphdef), state, xs)

    _check_same_program(lambda: run(nnx.Linear), lambda: run(jaxext.nnx.Linear))


# -- Linen -------------------------------------------------------------------------------


def _linen_program(module):
    def program(variables, xs):
        def one(x):
            y, vjp = jax.vjp(module.apply, variables, x)
            return y, vjp(_cotangent(y))

        return [one(x) for x in xs]

    return program


@pytest.mark.parametrize(
    *grid(
        use_bias=[True, False],
        dtype=DTYPES,
        param_dtype=PARAM_DTYPES,
        precision=PRECISIONS,
        ids=_name,
    )
)
def test_linen_dense_same_program_and_bits_as_flax(use_bias, dtype, param_dtype, precision):
    kwargs = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision)
    xs = _inputs(dtype)

    def run(cls):
        module = cls(features=OUT, **kwargs)
        variables = module.init(jax.random.key(0), xs[0])
        program, outputs = _compile_and_run(_linen_program(module), variables, xs)
        return program, (variables, outputs)  # the same initial parameters too

    _check_same_program(lambda: run(nn.Dense), lambda: run(jaxext.linen.Dense))


def test_program_digest_tells_programs_apart():
    # The digest must see what the tests are about: the operand order of the kernel
    # gradient's dot and the dtype of a conversion; and must not see names.
    x, g = jnp.ones((4, 3), BF16), jnp.ones((4, 2), BF16)

    def digest(fn):
        return program_digest(jax.jit(fn).lower(x, g).compile())

    def dot_xg(x, g):
        return jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())))

    def dot_gx_transposed(x, g):
        return jax.lax.dot_general(g, x, (((0,), (0,)), ((), ()))).T

    def dot_xg_again(inputs, cotangent):
        return jax.lax.dot_general(inputs, cotangent, (((0,), (0,)), ((), ())))

    assert digest(dot_xg) != digest(dot_gx_transposed)
    assert digest(dot_xg) != digest(lambda x, g: dot_xg(x, g).astype(F32))
    assert digest(dot_xg) == digest(dot_xg_again)


# -- nnx.vmap ensembles ------------------------------------------------------------------


def _ensemble(cls, members, in_features, out_features):
    @nnx.split_rngs(splits=members)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return cls(in_features, out_features, rngs=rngs)

    return create(nnx.Rngs(0))


def _ensemble_program(graphdef, shared, wrt_inputs):
    in_axes = (0, None if shared else 0)

    def loss(state, x):
        model = nnx.merge(graphdef, state)
        y = nnx.vmap(lambda m, x: m(x), in_axes=in_axes)(model, x)
        return jnp.sum(jnp.sin(y.astype(F32)) * _cotangent(y).astype(F32))

    def program(state, xs):
        argnums = (0, 1) if wrt_inputs else 0
        return [jax.grad(loss, argnums=argnums)(state, x) for x in xs]

    return program


# One member with an input shared by the whole ensemble is left out: there JAX's
# vmap lays out the kernel gradient's transpose differently for the two backwards
# (same dots, different data movement), so it is not the same program; it is
# compared with float64 below.
ENSEMBLE_GRID = [
    (members, shared, features)
    for members, shared, features in itertools.product(
        [1, 3], [True, False], [(6, 3), (16, 1), (5, 8)]
    )
    if not (members == 1 and shared)
]


@pytest.mark.parametrize(
    "members, shared, features",
    ENSEMBLE_GRID,
    ids=[f"{m}members-{'shared' if s else 'own'}-{f[0]}x{f[1]}" for m, s, f in ENSEMBLE_GRID],
)
def test_nnx_vmap_ensemble_same_program_and_bits_as_flax(members, shared, features):
    # Parameter gradients (and, with an input per member, input gradients): the
    # vmapped backward is the program Flax's vmapped autodiff compiles.
    rng = np.random.default_rng(1)
    lead = () if shared else (members,)
    xs = [jnp.asarray(rng.standard_normal((*lead, *b, features[0])), F32) for b in BATCHES]

    def run(cls):
        graphdef, state = nnx.split(_ensemble(cls, members, *features))
        return _compile_and_run(_ensemble_program(graphdef, shared, not shared), state, xs)

    _check_same_program(lambda: run(nnx.Linear), lambda: run(jaxext.nnx.Linear))


@pytest.mark.parametrize("members", [1, 3])
@pytest.mark.parametrize("features", [(6, 3), (16, 5)])
def test_nnx_vmap_ensemble_shared_input_close_to_float64(x64, members, features):
    # With an input shared by all members the programs differ: Flax sums the
    # members' input gradients inside one dot, JAX's vmap of jaxext's backward sums
    # their separate dots after (and with one member, the kernel gradient's layout
    # differs). So each side is compared with the float64 answer instead. The loss
    # is linear in y (cotangent c, |c| <= 1): each gradient element is a float32 sum
    # of n products of size at most B, with a rounding error at most n * eps * n * B:
    # input: n = members * out_features, B = max|kernel|; kernel: n = batch size,
    # B = max|x|; bias: n = batch size, B = 1.
    rng = np.random.default_rng(2)
    xs = [jnp.asarray(rng.standard_normal((*b, features[0])), F32) for b in BATCHES]
    in_axes = (0, None)

    def grads(cls, dtype):
        graphdef, state = nnx.split(_ensemble(cls, members, *features))
        state = jax.tree.map(lambda a: a.astype(dtype), state)

        def loss(state, x):
            y = nnx.vmap(lambda m, x: m(x), in_axes=in_axes)(nnx.merge(graphdef, state), x)
            return jnp.sum(y * _cotangent(y))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        out = []
        for x in xs:
            g_state, g_x = grad(state, x.astype(dtype))
            out.append({"bias": g_state["bias"][...], "kernel": g_state["kernel"][...], "x": g_x})
        return out, np.max(np.abs(np.asarray(state["kernel"][...])))

    expected, max_kernel = grads(nnx.Linear, jnp.float64)
    eps = float(jnp.finfo(F32).eps)
    for cls in (nnx.Linear, jaxext.nnx.Linear):
        for got, want, x in zip(grads(cls, F32)[0], expected, xs, strict=True):
            batch = max(1, x[..., 0].size)
            bounds = {
                "x": (members * features[1], max_kernel),
                "kernel": (batch, float(np.max(np.abs(x), initial=0))),
                "bias": (batch, 1.0),
            }
            for name, (n, scale) in bounds.items():
                assert got[name].dtype == F32
                np.testing.assert_allclose(
                    np.asarray(got[name], np.float64),
                    want[name],
                    rtol=0,
                    atol=n * n * eps * scale,
                    err_msg=f"{cls.__module__} {name}",
                )
