"""Multi-device checks for ``tests/test_sharding.py``, run in a subprocess.

JAX fixes its device count when it is first imported, and the pytest process has
already imported it with one CPU device. ``test_sharding.py`` therefore runs this
script with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and reads the
JSON it writes. The script only measures (losses, gradient differences against
single-device float64 references, shardings, collective counts); the assertions
live in the test module. The references run in float64 (``helpers.in_float64``):
a sharded float32 program and a one-device float32 program reorder their sums
differently, so each float32 result is measured against the float64 answer. A
check that raises is recorded with its traceback instead of aborting the others.

Usage: ``python tests/_sharding_worker.py OUTPUT.json``
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _worker_util import (  # noqa: E402  (tests/, the script's directory)
    collective_counts,
    max_abs,
    max_abs_diff,
    rand,
    run_checks,
    specs,
)
from flax import linen, nnx  # noqa: E402
from helpers import in_float64  # noqa: E402  (tests/, the script's directory)
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxext  # noqa: E402
import jaxext.linen  # noqa: E402
import jaxext.nnx  # noqa: E402

AXES = ("data", "model")


def make_mesh(axis_type):
    return jax.make_mesh((4, 2), AXES, axis_types=(axis_type,) * 2)


def shard_map(f, mesh, in_specs, out_specs, check):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as legacy  # older JAX

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def forward_mode(mapped, reference, arrays, args, n_diff, *, jit=True):
    """Forward mode of ``mapped`` (a shard_map of jaxext ops) against ``reference``.

    Differentiates the first ``n_diff`` arguments: a JVP of the loss, ``jacfwd`` of
    the loss (the gradient, by forward mode) and a Hessian-vector product (forward
    over reverse), jitted or eager, measured against float64 autodiff of ``reference``.
    """
    shardings = [a.sharding for a in args[:n_diff]]
    tangents_np = [rand(70 + i, a.shape) for i, a in enumerate(arrays[:n_diff])]
    tangents = [jax.device_put(t, s) for t, s in zip(tangents_np, shardings, strict=True)]
    argnums = tuple(range(n_diff))

    def measures(fn, primals, tangents, rest):
        def of_diff(*diff):
            return fn(*diff, *rest)

        jvp = jax.jvp(of_diff, primals, tangents)[1]
        jacfwd = jax.jacfwd(of_diff, argnums=argnums)(*primals)
        hvp = jax.jvp(jax.grad(of_diff, argnums=argnums), primals, tangents)[1]
        return jvp, jacfwd, hvp

    run = jax.jit if jit else (lambda fn: fn)
    got = run(lambda p, t, r: measures(mapped, p, t, r))(
        list(args[:n_diff]), tangents, list(args[n_diff:])
    )
    want = in_float64(
        lambda p, t, r: measures(reference, p, t, r),
        list(arrays[:n_diff]),
        tangents_np,
        list(arrays[n_diff:]),
    )
    return {
        "jvp": [float(got[0]), float(want[0])],
        "jacfwd_diff": max_abs_diff(got[1], want[1]),
        "jacfwd_scale": max_abs(want[1]),
        "hvp_diff": max_abs_diff(got[2], want[2]),
        "hvp_scale": max_abs(want[2]),
    }


# --------------------------------------------------------------------------- linear


def _make_loss(kind, out_shardings):
    """MSE of a tanh MLP; layer i's matmul gets ``out_shardings[i]``."""

    def loss(params, x, t):
        h = x
        for (w, b), out_sharding in zip(params, out_shardings, strict=True):
            if kind == "jaxext":
                y = jaxext.linear(h, w, b, out_sharding=out_sharding)
            else:
                y = jnp.matmul(h, w.T, out_sharding=out_sharding) + b
            h = jnp.tanh(y)
        return jnp.mean((h - t) ** 2)

    return loss


def check_linear(axis_type, layout):
    """One SGD step of a jaxext.linear model on sharded arrays vs one device."""
    mesh = make_mesh(axis_type)
    if layout in ("single", "replicated_bias"):  # batch over data, out features over model
        shapes = [(6, 12)]
        w_specs = [(P("model", None), P("model") if layout == "single" else P())]
        x_shape, x_spec = (16, 12), P("data", None)
        t_shape, t_spec = (16, 6), P("data", "model")
    else:  # "mlp": column- then row-parallel (Megatron), 3-D input
        shapes = [(8, 12), (6, 8)]
        w_specs = [(P("model", None), P("model")), (P(None, "model"), P())]
        x_shape, x_spec = (8, 3, 12), P("data", None, None)
        t_shape, t_spec = (8, 3, 6), P("data", None, None)
    # The row-parallel layer contracts a sharded axis: explicit axes ask for its
    # output sharding, for plain jnp and jaxext alike.
    out_shardings = [None] * len(shapes)
    if layout == "mlp" and axis_type == AxisType.Explicit:
        out_shardings[1] = P("data", None, None)
    params = [(rand(i, s), rand(10 + i, s[:1])) for i, s in enumerate(shapes)]
    x, t = rand(20, x_shape), rand(21, t_shape)

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    params_s = [(put(w, ws), put(b, bs)) for (w, b), (ws, bs) in zip(params, w_specs, strict=True)]
    x_s, t_s = put(x, x_spec), put(t, t_spec)

    def make_step(loss):
        def step(params, x, t):
            value, grads = jax.value_and_grad(loss)(params, x, t)
            new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
            return value, grads, new

        return jax.jit(step)

    step_j = make_step(_make_loss("jaxext", out_shardings))
    step_p = make_step(_make_loss("plain", out_shardings))
    with jax.set_mesh(mesh):
        loss_s, grads_s, new_s = step_j(params_s, x_s, t_s)
        loss_p, grads_p, _ = step_p(params_s, x_s, t_s)  # plain autodiff, same shardings
        counts = collective_counts(step_j, params_s, x_s, t_s)
        plain_counts = collective_counts(step_p, params_s, x_s, t_s)
    step_1 = make_step(_make_loss("plain", [None] * len(shapes)))
    loss_1, grads_1, new_1 = in_float64(step_1, params, x, t)  # plain autodiff, one device
    return {
        "loss": [float(loss_s), float(loss_1)],
        "grad_diff": max_abs_diff(grads_s, grads_1),
        "update_diff": max_abs_diff(new_s, new_1),
        "grad_scale": max_abs(grads_1),
        "update_scale": max_abs(new_1),
        "grad_specs": specs(grads_s),
        "plain_grad_specs": specs(grads_p),
        "param_specs": specs(params_s),
        "collectives": counts,
        "plain_collectives": plain_counts,
        "n_devices": len({d for g in jax.tree.leaves(grads_s) for d in g.sharding.device_set}),
    }


# ----------------------------------------------------------------------------- nnx


class MLP(nnx.Module):
    """Two layers of ``linear_cls`` with kernels annotated by ``nnx.with_partitioning``."""

    def __init__(self, linear_cls, second_kernel_spec, first_bias_spec, *, rngs):
        lecun, normal = nnx.initializers.lecun_normal(), nnx.initializers.normal(0.5)
        self.l1 = linear_cls(
            12,
            8,
            kernel_init=nnx.with_partitioning(lecun, (None, "model")),
            bias_init=nnx.with_partitioning(normal, first_bias_spec) if first_bias_spec else normal,
            rngs=rngs,
        )
        self.l2 = linear_cls(
            8, 4, kernel_init=nnx.with_partitioning(lecun, second_kernel_spec), rngs=rngs
        )

    def __call__(self, x, out_sharding=None):
        return self.l2(jnp.tanh(self.l1(x)), out_sharding=out_sharding)


def _model_loss(model, x, t, out_sharding=None):
    return jnp.mean((model(x, out_sharding) - t) ** 2)


def check_nnx(axis_type, row_parallel=False):
    """Sharded jaxext.nnx.Linear / flax.nnx.Linear models vs a one-device flax model."""
    mesh = make_mesh(axis_type)
    # A row-parallel second kernel contracts a sharded axis; explicit axes then ask
    # for the layer's out_sharding (flax's too).
    second = ("model", None) if axis_type == AxisType.Auto or row_parallel else (None, None)
    out_sharding = P("data", None) if row_parallel else None
    # Explicit: a replicated bias on a column-sharded output (its gradient is gathered).
    first_bias = ("model",) if axis_type == AxisType.Auto else None
    x, t = rand(30, (16, 12)), rand(31, (16, 4))
    with nnx.use_eager_sharding(False):
        reference = MLP(nnx.Linear, second, first_bias, rngs=nnx.Rngs(0))
    ref_graphdef, ref_state = nnx.split(reference)
    ref_params = nnx.to_pure_dict(ref_state)

    def reference_loss(params, x, t):
        state = jax.tree.map(lambda leaf: leaf, ref_state)
        nnx.replace_by_pure_dict(state, params)
        return _model_loss(nnx.merge(ref_graphdef, state), x, t)

    # One device, flax's layer, plain autodiff, float64.
    loss_1, grads_1 = in_float64(jax.value_and_grad(reference_loss), ref_params, x, t)
    out = {}
    for name, cls in (("jaxext", jaxext.nnx.Linear), ("flax", nnx.Linear)):
        with jax.set_mesh(mesh):
            model = MLP(cls, second, first_bias, rngs=nnx.Rngs(0))
            x_s = jax.device_put(x, NamedSharding(mesh, P("data", None)))
            t_s = jax.device_put(t, NamedSharding(mesh, P("data", None)))
            loss, grads = nnx.jit(nnx.value_and_grad(_model_loss), static_argnames="out_sharding")(
                model, x_s, t_s, out_sharding=out_sharding
            )
            graphdef, state = nnx.split(model)

            def grad_step(state, x, t, graphdef=graphdef):
                def loss_of_state(s):
                    return _model_loss(nnx.merge(graphdef, s), x, t, out_sharding)

                return jax.value_and_grad(loss_of_state)(state)

            counts = collective_counts(jax.jit(grad_step), state, x_s, t_s)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        grads = nnx.to_pure_dict(grads)
        out[name] = {
            "param_diff": max_abs_diff(params, ref_params),
            "param_scale": max_abs(ref_params),
            "param_specs": specs(params),
            "loss": [float(loss), float(loss_1)],
            "grad_diff": max_abs_diff(grads, grads_1),
            "grad_scale": max_abs(grads_1),
            "grad_specs": specs(grads),
            "collectives": counts,
        }
    return out


# ------------------------------------------------------------------------ shard_map


def check_shard_map(layout, check_vma):
    """jaxext.linear inside shard_map (with psum) vs plain jnp on whole arrays."""
    mesh = make_mesh(AxisType.Explicit)
    x, w, b, t = rand(40, (16, 12)), rand(41, (6, 12)), rand(42, (6,)), rand(43, (16, 6))
    n = x.shape[0]

    def reference(w, b, x, t):
        return jnp.sum((jnp.tanh(x @ w.T + b) - t) ** 2) / n

    if layout == "row":
        # In-features split over `model`: each device computes a partial matmul,
        # psum completes it; the replicated bias is added after the psum.
        in_specs = (P(None, "model"), P(), P("data", "model"), P("data", None))

        def local(w, b, x, t):
            y = jax.lax.psum(jaxext.linear(x, w), "model") + b
            return jax.lax.psum(jnp.sum((jnp.tanh(y) - t) ** 2), "data") / n

    else:
        # Out-features split over `model` (bias too): x is replicated over
        # `model`, so its gradient is a psum of per-shard contributions.
        in_specs = (P("model", None), P("model"), P("data", None), P("data", "model"))

        def local(w, b, x, t):
            y = jaxext.linear(x, w, b)
            return jax.lax.psum(jnp.sum((jnp.tanh(y) - t) ** 2), AXES) / n

    arrays = (w, b, x, t)
    args = [
        jax.device_put(a, NamedSharding(mesh, spec))
        for a, spec in zip(arrays, in_specs, strict=True)
    ]
    mapped = shard_map(local, mesh, in_specs, P(), check_vma)
    loss, grads = jax.jit(jax.value_and_grad(mapped, argnums=(0, 1, 2)))(*args)
    loss_1, grads_1 = in_float64(jax.value_and_grad(reference, argnums=(0, 1, 2)), w, b, x, t)
    return {
        "loss": [float(loss), float(loss_1)],
        "grad_diff": max_abs_diff(grads, grads_1),
        "grad_scale": max_abs(grads_1),
        **forward_mode(mapped, reference, arrays, args, 3),
    }


def check_shard_map_mul_constant(jit):
    """shard_map with linear and an array-constant mul_constant, jitted or eager.

    The constant is replicated (invariant over `data`) while x is sharded, so its
    gradient must be psum-ed over `data` by the backward rule.
    """
    mesh = make_mesh(AxisType.Explicit)
    x, w, c = rand(50, (16, 12)), rand(51, (6, 12)), rand(52, (6,))
    in_specs = (P(), P(), P("data", None))

    def reference(w, c, x):
        return jnp.sum(jnp.tanh(x @ w.T) * c)

    def local(w, c, x):
        return jax.lax.psum(jnp.sum(jaxext.mul_constant(jnp.tanh(jaxext.linear(x, w)), c)), "data")

    run = jax.jit if jit else (lambda fn: fn)
    with jax.set_mesh(mesh):  # an eager shard_map on explicit axes needs the mesh set
        args = [jax.device_put(a, spec) for a, spec in zip((w, c, x), in_specs, strict=True)]
        mapped = shard_map(local, mesh, in_specs, P(), True)
        loss, grads = run(jax.value_and_grad(mapped, argnums=(0, 1, 2)))(*args)
        forward = forward_mode(mapped, reference, (w, c, x), args, 3, jit=jit)
    loss_1, grads_1 = in_float64(jax.value_and_grad(reference, argnums=(0, 1, 2)), w, c, x)
    return {
        "loss": [float(loss), float(loss_1)],
        "grad_diff": max_abs_diff(grads, grads_1),
        "grad_scale": max_abs(grads_1),
        **forward,
    }


def check_forward_mode_sharded(axis_type, jit):
    """Forward mode of jaxext.linear on arrays sharded over a mesh (no shard_map)."""
    mesh = make_mesh(axis_type)
    x, w, b = rand(80, (16, 12)), rand(81, (6, 12)), rand(82, (6,))
    in_specs = (P("data", None), P("model", None), P("model"))

    def reference(x, w, b):
        return jnp.sum(jnp.tanh(x @ w.T + b) ** 2)

    def loss(x, w, b):
        return jnp.sum(jnp.tanh(jaxext.linear(x, w, b)) ** 2)

    with jax.set_mesh(mesh):
        args = [jax.device_put(a, s) for a, s in zip((x, w, b), in_specs, strict=True)]
        return forward_mode(loss, reference, (x, w, b), args, 3, jit=jit)


def check_per_example_vmap(jit):
    """Per-example ``vmap`` of jaxext.linear over a batch sharded on an explicit mesh:
    the gradient (reverse mode) and forward mode of the summed per-example losses."""
    mesh = make_mesh(AxisType.Explicit)
    w, b, x = rand(90, (6, 12)), rand(91, (6,)), rand(92, (16, 12))

    def per_example(layer):
        def loss(w, b, x):
            return jnp.sum(jax.vmap(lambda xi: jnp.sum(jnp.tanh(layer(xi, w, b)) ** 2))(x))

        return loss

    loss = per_example(jaxext.linear)
    reference = per_example(lambda xi, w, b: xi @ w.T + b)
    with jax.set_mesh(mesh):
        specs_ = (P(), P(), P("data", None))
        args = [
            jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((w, b, x), specs_, strict=True)
        ]
        grad = jax.grad(loss, argnums=(0, 1))
        got = (jax.jit(grad) if jit else grad)(*args)
        result = forward_mode(loss, reference, (w, b, x), args, 2, jit=jit)
    want = in_float64(jax.grad(reference, argnums=(0, 1)), w, b, x)
    result.update(grad_diff=max_abs_diff(got, want), grad_scale=max_abs(want))
    return result


# ----------------------------------------------------------------------- placements
# The parameters in the other states plain JAX accepts: never placed on the mesh (made
# with jnp outside it), replicated, resharded to "reduced" over `data` inside the loss,
# or placed reduced with two microbatches' unreduced gradients summed before the one
# reduction (the gradient accumulation of JAX's sharding-and-autodiff docs).

BATCH, FEATURES = 16, (12, 8, 4)


class _NnxMLP(nnx.Module):
    def __init__(self, cls, *, rngs):
        self.l1 = cls(FEATURES[0], FEATURES[1], rngs=rngs)
        self.l2 = cls(FEATURES[1], FEATURES[2], rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.l2(jnp.tanh(self.l1(x))))


class _LinenMLP(linen.Module):
    dense: type

    @linen.compact
    def __call__(self, x):
        return jnp.tanh(self.dense(FEATURES[2])(jnp.tanh(self.dense(FEATURES[1])(x))))


def layer_mlp(layer):
    """A 12 -> 8 -> 4 tanh MLP of ``layer``: (NumPy params, jaxext apply, plain apply).

    The plain model is the same math without jaxext: ``jnp`` matmuls for ``linear``,
    Flax's own layers for ``nnx`` and ``linen``, on the same parameters.
    """
    if layer == "linear":
        sizes = list(zip(FEATURES[1:], FEATURES[:-1], strict=True))  # (out, in)
        params = [(rand(60 + i, s), rand(65 + i, s[:1])) for i, s in enumerate(sizes)]

        def make_apply(affine):
            def apply(params, x):
                for w, b in params:
                    x = jnp.tanh(affine(x, w, b))
                return x

            return apply

        return params, make_apply(jaxext.linear), make_apply(lambda x, w, b: x @ w.T + b)
    if layer == "nnx":
        models = [_NnxMLP(cls, rngs=nnx.Rngs(0)) for cls in (jaxext.nnx.Linear, nnx.Linear)]
        params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(models[0], nnx.Param)))

        def make_apply(model):
            graphdef, state = nnx.split(model)

            def apply(params, x):
                state_copy = jax.tree.map(lambda leaf: leaf, state)
                nnx.replace_by_pure_dict(state_copy, params)
                return nnx.merge(graphdef, state_copy)(x)

            return apply

        return params, make_apply(models[0]), make_apply(models[1])
    modules = [_LinenMLP(cls) for cls in (jaxext.linen.Dense, linen.Dense)]
    params = modules[0].init(jax.random.key(0), jnp.ones((1, FEATURES[0])))
    return jax.tree.map(np.asarray, params), modules[0].apply, modules[1].apply


def param_partitions(params):
    """Per leaf: the first kernel column-parallel over `model`, the rest replicated."""
    leaves, tree = jax.tree.flatten(params)
    kernels = [i for i, leaf in enumerate(leaves) if leaf.ndim == 2]
    out = [(None,) * leaf.ndim for leaf in leaves]
    first = leaves[kernels[0]]
    out_axis = 0 if first.shape == (FEATURES[1], FEATURES[0]) else 1  # (out, in) or (in, out)
    out[kernels[0]] = tuple("model" if a == out_axis else None for a in range(2))
    return jax.tree.unflatten(tree, out)


def _spec(leaf, partitions, reduced):
    # Only kernels are made reduced: a reduced bias cannot meet a batch-sharded result.
    return P(*partitions, reduced={"data"}) if reduced and leaf.ndim == 2 else P(*partitions)


def spec_of(value):
    return jax.typeof(value).sharding.spec


def placement_step(apply, placement, partitions, unreduced_log):
    """A jitted ``(params, x, t) -> (loss, grads)`` for ``placement``."""

    def loss(params, x, t):
        if placement == "reduced":  # the docs' cast: free forward, all-reduce backward
            params = jax.tree.map(
                lambda a, parts: jax.reshard(a, _spec(a, parts, True)), params, partitions
            )
        return jnp.sum((apply(params, x) - t) ** 2) / BATCH

    if placement != "reduced_accumulate":
        return jax.jit(jax.value_and_grad(loss))

    def accumulate(params, xs, ts):  # xs: (microbatch, batch@data, features)
        total, acc = 0.0, None
        for x, t in zip(xs, ts, strict=True):
            value, grads = jax.value_and_grad(loss)(params, x, t)
            unreduced_log[:] = [sorted(spec_of(g).unreduced) for g in jax.tree.leaves(grads)]
            total = total + value
            acc = grads if acc is None else jax.tree.map(jnp.add, acc, grads)
        # The one all-reduce: unreduced gradients -> the parameters' own partitions.
        return total, jax.tree.map(lambda g: jax.reshard(g, P(*spec_of(g).partitions)), acc)

    return jax.jit(accumulate)


def check_placement(axis_type, layer, placement):
    """One gradient step of ``layer``'s MLP with parameters placed as ``placement``."""
    mesh = make_mesh(axis_type)
    params, apply_j, apply_p = layer_mlp(layer)
    partitions = param_partitions(params)
    x, t = rand(90, (BATCH, FEATURES[0])), rand(91, (BATCH, FEATURES[-1]))
    if placement == "unplaced":
        args = jax.tree.map(jnp.asarray, params)  # jnp arrays made outside the mesh
    with jax.set_mesh(mesh):
        if placement == "replicated":
            args = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), params)
        elif placement != "unplaced":  # reduced: placed, resharded to reduced in the loss
            reduced = placement == "reduced_accumulate"
            args = jax.tree.map(
                lambda a, parts: jax.device_put(a, NamedSharding(mesh, _spec(a, parts, reduced))),
                params,
                partitions,
            )
        if placement == "reduced_accumulate":
            shape, spec = (2, BATCH // 2), P(None, "data", None)
        else:
            shape, spec = (BATCH,), P("data", None)
        x_s = jax.device_put(x.reshape(*shape, -1), NamedSharding(mesh, spec))
        t_s = jax.device_put(t.reshape(*shape, -1), NamedSharding(mesh, spec))
        logs = {"jaxext": [], "plain": []}
        steps = {
            kind: placement_step(apply, placement, partitions, logs[kind])
            for kind, apply in (("jaxext", apply_j), ("plain", apply_p))
        }
        (loss, grads), (_, grads_p) = (steps[k](args, x_s, t_s) for k in ("jaxext", "plain"))
        counts = {k: collective_counts(step, args, x_s, t_s) for k, step in steps.items()}

    def reference(params, x, t):
        return jnp.sum((apply_p(params, x) - t) ** 2) / BATCH

    loss_1, grads_1 = in_float64(jax.value_and_grad(reference), params, x, t)
    return {
        "loss": [float(loss), float(loss_1)],
        "grad_diff": max_abs_diff(grads, grads_1),
        "grad_scale": max_abs(grads_1),
        "grad_specs": specs(grads),
        "plain_grad_specs": specs(grads_p),
        "microbatch_unreduced": logs["jaxext"],
        "plain_microbatch_unreduced": logs["plain"],
        "collectives": counts["jaxext"],
        "plain_collectives": counts["plain"],
    }


PLACEMENTS = {
    AxisType.Explicit: ("unplaced", "replicated", "reduced", "reduced_accumulate"),
    AxisType.Auto: ("unplaced", "replicated"),  # reduced shardings need explicit axes
}


CHECKS = {
    "linear_explicit_single": lambda: check_linear(AxisType.Explicit, "single"),
    "linear_explicit_replicated_bias": lambda: check_linear(AxisType.Explicit, "replicated_bias"),
    "linear_auto_single": lambda: check_linear(AxisType.Auto, "single"),
    "linear_auto_mlp": lambda: check_linear(AxisType.Auto, "mlp"),
    "linear_explicit_mlp_out_sharding": lambda: check_linear(AxisType.Explicit, "mlp"),
    "nnx_explicit": lambda: check_nnx(AxisType.Explicit),
    "nnx_explicit_row_out_sharding": lambda: check_nnx(AxisType.Explicit, row_parallel=True),
    "nnx_auto": lambda: check_nnx(AxisType.Auto),
    "shard_map_row_vma": lambda: check_shard_map("row", True),
    "shard_map_row_novma": lambda: check_shard_map("row", False),
    "shard_map_column_vma": lambda: check_shard_map("column", True),
    "shard_map_column_novma": lambda: check_shard_map("column", False),
    "shard_map_with_mul_constant": lambda: check_shard_map_mul_constant(True),
    "shard_map_eager": lambda: check_shard_map_mul_constant(False),
    "forward_explicit_eager": lambda: check_forward_mode_sharded(AxisType.Explicit, False),
    "forward_explicit_jit": lambda: check_forward_mode_sharded(AxisType.Explicit, True),
    "forward_auto_eager": lambda: check_forward_mode_sharded(AxisType.Auto, False),
    "forward_auto_jit": lambda: check_forward_mode_sharded(AxisType.Auto, True),
    "per_example_vmap_eager": lambda: check_per_example_vmap(False),
    "per_example_vmap_jit": lambda: check_per_example_vmap(True),
}
CHECKS.update(
    {
        f"placement_{axis_type.name.lower()}_{layer}_{placement}": (
            lambda a=axis_type, m=layer, p=placement: check_placement(a, m, p)
        )
        for axis_type, placements in PLACEMENTS.items()
        for layer in ("linear", "nnx", "linen")
        for placement in placements
    }
)


# --------------------------------------------------------------------------- rms_norm


def check_rms_norm(mode):
    """jaxext.rms_norm (Pallas kernels, interpret mode here) with its rows split.

    ``shard_map``: each device runs the kernels on its 4 rows; the weight is replicated, so
    its gradient is psum-ed over `data` by the backward. ``check_vma=False``: Pallas's
    interpret mode (JAX 0.10, 0.12) loops from buffers typed as not varying over mesh axes, which
    ``check_vma=True`` refuses. ``jit``: x placed with its rows sharded over `data` on a
    mesh of auto axes, no shard_map (``pallas_call`` refuses explicit mesh axes outside a
    shard_map; XLA partitions the interpreted kernel as it sees fit).
    """
    mesh = make_mesh(AxisType.Explicit if mode == "shard_map" else AxisType.Auto)
    x, w = rand(60, (16, 12)), rand(61, (12,)) + 1.0
    t = rand(62, (16, 12))

    def reference(x, w):
        y = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w
        return jnp.sum(jnp.tanh(y) * t)

    in_specs = (P("data", None), P())
    if mode == "shard_map":

        def local(x, w, t):
            return jax.lax.psum(
                jnp.sum(jnp.tanh(jaxext.rms_norm(x, w, implementation="interpret")) * t), "data"
            )

        with jax.set_mesh(mesh):
            mapped_3 = shard_map(local, mesh, (*in_specs, P("data", None)), P(), False)
        t_sharded = jax.device_put(t, NamedSharding(mesh, P("data", None)))

        def mapped(x, w):
            return mapped_3(x, w, t_sharded)

    else:

        def mapped(x, w):
            return jnp.sum(jnp.tanh(jaxext.rms_norm(x, w, implementation="interpret")) * t)

    with jax.set_mesh(mesh):
        args = [
            jax.device_put(a, NamedSharding(mesh, spec))
            for a, spec in zip((x, w), in_specs, strict=True)
        ]
        loss, grads = jax.jit(jax.value_and_grad(mapped, argnums=(0, 1)))(*args)
        forward = forward_mode(mapped, reference, (x, w), args, 2)
    loss_1, grads_1 = in_float64(jax.value_and_grad(reference, argnums=(0, 1)), x, w)
    return {
        "loss": [float(loss), float(loss_1)],
        "grad_diff": max_abs_diff(grads, grads_1),
        "grad_scale": max_abs(grads_1),
        "x_grad_spec": specs(grads[0]),
        **forward,
    }


CHECKS.update(
    {
        "rms_norm_shard_map": lambda: check_rms_norm("shard_map"),
        "rms_norm_rows_sharded_jit": lambda: check_rms_norm("jit"),
    }
)

if __name__ == "__main__":
    run_checks(CHECKS, sys.argv[1])
