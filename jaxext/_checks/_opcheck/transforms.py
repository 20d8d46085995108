"""opcheck's rows about JAX's transformations.

``jit`` (against eager), ``jit_reuse`` (one jitted op reused with other inputs
differentiated, and used several times in one computation), ``vmap`` (against a loop) and
``checkpoint`` (under each policy, against plain).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._backward import (
    batched_mismatches,
    loop_and_vmap,
    pick,
    stacked,
)
from .._compare import unravel
from .._settings import Settings
from ._common import (
    Skip,
    first_line,
    fresh,
    inner_product,
    vjp,
)
from ._op import (
    CheckFailed,
    OpUnderTest,
    assert_trees_close,
    mismatch_text,
)
from ._plain import jax_limit

__all__ = ["checkpoint", "jit", "jit_reuse", "vmap"]


_BATCH = 3


_POLICIES = {
    "default": None,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def jit(op: OpUnderTest, settings: Settings) -> str:
    rng = np.random.default_rng(settings.seed + 2)
    primals, u = op.primals, op.cotangent(rng)
    eager = op.call(*primals)
    # Compiled as the user's `jax.jit` compiles it (not with the quick engine's options:
    # a float32 op compiled at LLVM -O0 rounds otherwise than at the default).
    function = fresh(op)
    jitted = jax.jit(function)(*primals)
    assert_trees_close(jitted, eager, what="output under jit vs eager", rtol=op.rtol)
    eager_grads = vjp(op.call, primals, u)
    jitted_grads = jax.jit(lambda p, c: vjp(function, p, c))(primals, u)
    for label, a, e in zip(op.labels, jitted_grads, eager_grads, strict=True):
        assert_trees_close(a, e, what=f"gradient of {label} under jit vs eager", rtol=op.rtol)
    return "values and gradients under jit equal eager ones"


def _subsets(count: int) -> list[tuple[int, ...]]:
    """Nonempty subsets of ``count`` inputs covering every pair of inputs in each of the
    ways a subset can hold them (both differentiated, one, the other, neither), as
    ``tests/helpers.py``'s ``grid`` covers pairs of values: a residual-layout bug shows
    between two inputs, so pairs catch it; every subset would grow as ``2**count``.
    Built greedily and deterministically (singletons first: each input alone)."""
    singles = [(i,) for i in range(count)]
    wanted = {
        (i, j, a, b)
        for i, j in itertools.combinations(range(count), 2)
        for a in (True, False)
        for b in (True, False)
        if (a or b or count > 2)
    }

    def covers(subset: tuple[int, ...]) -> set:
        chosen = set(subset)
        return {
            (i, j, i in chosen, j in chosen) for i, j in itertools.combinations(range(count), 2)
        }

    chosen = list(singles)
    for subset in singles:
        wanted -= covers(subset)
    candidates = (
        [s for r in range(2, count + 1) for s in itertools.combinations(range(count), r)]
        if count <= 12
        else [tuple(range(count))]
    )
    while wanted and candidates:
        best = max(candidates, key=lambda s: len(covers(s) & wanted))
        if not covers(best) & wanted:
            break
        chosen.append(best)
        wanted -= covers(best)
        candidates.remove(best)
    return chosen


def jit_reuse(op: OpUnderTest, settings: Settings) -> str:
    primals = op.primals
    if len(primals) < 2:  # its one subset is every input: the `jit` check
        raise Skip(
            f"only one differentiable input ({op.labels[0] if op.labels else 'none'}): no "
            "subset of inputs to leave out"
        )
    rng = np.random.default_rng(settings.seed + 3)
    u, u2, u3, u4, u5 = (op.cotangent(rng) for _ in range(5))
    subsets = _subsets(len(primals))
    everything = tuple(range(len(primals)))
    shared = jax.jit(fresh(op))

    def grads(fn, subset, cotangent):
        return vjp(op.with_only(subset, fn), [primals[i] for i in subset], cotangent)

    # The reference: every input differentiated at once, in a fresh trace.
    fresh_full = op.quick_jit(
        lambda c: (grads(fresh(op), everything, c), inner_product(c, op.call(*primals)))
    )
    full, inner = {}, {}
    for c in (u, u2, u3, u4, u5):
        full[id(c)], inner[id(c)] = fresh_full(c)
    square_weight = 2 * float(inner[id(u5)])

    def expected_uses(i, first, second):
        expected = square_weight * np.asarray(full[id(u5)][i])
        if i in first:
            expected = expected + np.asarray(full[id(u)][i]) + np.asarray(full[id(u3)][i])
        if i in second:
            expected = expected + np.asarray(full[id(u2)][i]) + np.asarray(full[id(u4)][i])
        return expected

    bodies = {  # the jitted runs, each a program of its own, or all in one program
        "in jit": lambda s: grads(shared, s, u),
        "fresh jit": lambda s: grads(fresh(op), s, u),
    }
    merged, merged_error = None, None
    for s in subsets:  # one jitted op, reused across calls with other inputs differentiated
        runs = {"eager": lambda s=s: grads(shared, s, u)}
        runs.update({how: jax.jit(functools.partial(body, s)) for how, body in bodies.items()})
        for how, run in runs.items():
            if how != "eager" and merged is None and merged_error is None:
                # Every subset's jitted runs in one program: one compilation, not two per
                # subset. Should it raise, each subset's runs go alone, to name the subset.
                try:
                    merged = op.quick_jit(
                        lambda: {h: [b(t) for t in subsets] for h, b in bodies.items()}
                    )()
                except Exception as err:  # noqa: BLE001 -- attributed to a subset below
                    merged_error = err
            try:
                got = merged[how][subsets.index(s)] if how != "eager" and merged else run()
            except Exception as err:  # noqa: BLE001 -- attributed to the subset, then reported
                raise CheckFailed(
                    f"differentiating only {[op.labels[j] for j in s]} ({how}) raised "
                    f"{type(err).__name__}: {err}"
                ) from err
            for i, a in zip(s, got, strict=True):
                what = (
                    f"gradient of {op.labels[i]} differentiating only "
                    f"{[op.labels[j] for j in s]} ({how}) vs all inputs at once"
                )
                assert_trees_close(a, full[id(u)][i], what=what, rtol=op.rtol)
    if merged_error is not None:  # raised only with every subset in one program
        raise CheckFailed(
            "differentiating each subset of inputs in turn in one jitted program raised "
            f"{type(merged_error).__name__}: {merged_error}"
        ) from merged_error
    # The uses' outputs weighed by u, u2, u3, u4, and the last squared: one jitted
    # function (differentiated eagerly, op by op, this would compile a dozen programs).
    weigh = jax.jit(
        lambda outs, last: (
            sum(map(inner_product, (u, u2, u3, u4), outs)) + inner_product(u5, last) ** 2
        )
    )
    pairs = [(a, b) for a, b in zip(subsets, subsets[1:] + subsets[:1], strict=True) if a != b]
    for first, second in pairs:
        # The same jitted op several times in one differentiated computation, with other
        # inputs differentiated each time: the form in which a residual-layout bug shows.
        # The inputs left out are cut by stop_gradient, or constants (not perturbed at
        # all: `op(a, c) + op(c, b) + op(a, b) ** 2`, c a constant), and one use has
        # every input differentiated, squared (its cotangent depends on the output).
        def uses(*values, first=first, second=second, shared=shared):
            outs = []
            for subset, cut in ((first, True), (second, True), (first, False), (second, False)):
                kept = [
                    v if i in subset else jax.lax.stop_gradient(v) if cut else primals[i]
                    for i, v in enumerate(values)
                ]
                outs.append(shared(*kept))
            return weigh(outs, shared(*values))

        # The jitted op's cache matters: the one used above, already traced for each
        # subset, and for inputs 0 and 1 a fresh one, called once before (as in an
        # evaluation pass before training).
        caches = {"jitted op reused": shared}
        if first == (0,) and second == (1,):
            warm = jax.jit(fresh(op))
            warm(*primals)
            caches["fresh jitted op, called once before"] = warm
        for how, jitted in caches.items():
            _check_uses(op, uses, jitted, first, second, how, expected_uses)
    return f"{len(subsets)} subsets of differentiated inputs, {len(pairs)} pairs in one computation"


def _check_uses(op, uses, jitted, first, second, how, expected_uses) -> None:
    everything = tuple(range(len(op.primals)))
    try:
        got = jax.grad(functools.partial(uses, shared=jitted), argnums=everything)(*op.primals)
    except Exception as err:  # noqa: BLE001 -- attributed to the pair, then reported
        raise CheckFailed(
            f"the op used several times in one computation ({how}; differentiating "
            f"{[op.labels[j] for j in first]}, then {[op.labels[j] for j in second]}, "
            f"the others cut by stop_gradient or constants) raised "
            f"{type(err).__name__}: {err}"
        ) from err
    for i, label in enumerate(op.labels):
        what = (
            f"gradient of {label} with the op used several times in one computation ({how}; "
            f"differentiating {[op.labels[j] for j in first]}, then "
            f"{[op.labels[j] for j in second]}, the others cut by stop_gradient or "
            "constants, and all of them squared)"
        )
        assert_trees_close(got[i], expected_uses(i, first, second), what=what, rtol=op.rtol)


def _is_key(leaf: Any) -> bool:
    """A typed PRNG key array (``jax.random.key``)."""
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _batched_leaf(leaf: Any, rng: np.random.Generator) -> Any:
    """``_BATCH`` versions of an array leaf, stacked: float ones perturbed, typed PRNG
    keys split (``jax.random.split``: a batch of independent keys), others repeated."""
    if _is_key(leaf):
        keys = jax.vmap(lambda k: jax.random.split(k, _BATCH))(leaf.reshape(-1))
        return keys.T.reshape((_BATCH, *leaf.shape))
    # A JAX array stays a JAX array (the op sees what a user's code passes).
    xp = jnp if isinstance(leaf, jax.Array) else np
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
        # In the leaf's dtype (the random factors are float64: a float32 leaf stays float32).
        return xp.stack(
            [
                (leaf * (1 + 0.1 * rng.standard_normal(leaf.shape))).astype(leaf.dtype)
                for _ in range(_BATCH)
            ]
        )
    return xp.stack([leaf] * _BATCH)


def _is_batchable(leaf: Any) -> bool:
    """An array leaf: what vmap maps over. Python scalars, strings, ``None`` and other
    leaves stay static (``in_axes=None``), closed over rather than passed."""
    return isinstance(leaf, (jax.Array, np.ndarray))


def _on_host(leaf: Any) -> Any:
    """A JAX array of a plain dtype as a NumPy array of the same abstract value."""
    if not isinstance(leaf, jax.Array) or jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
        return leaf  # PRNG keys stay JAX arrays
    if leaf.weak_type:
        return leaf
    return np.asarray(leaf)


def vmap(op: OpUnderTest, settings: Settings) -> str:
    parts, forward = _vmap_parts(op, settings)
    # Every batched input's output, gradient and JVP, looped and vmapped: one program.
    for (index, part), (looped, batched) in loop_and_vmap(parts, op.quick_jit).items():
        what = f"vmap over input {index} vs a loop"
        if isinstance(batched, Exception):
            _skip_if_jax_cannot_vmap(op, settings, (index, part), batched)
            raise batched
        if part != "gradient":
            assert_trees_close(batched, looped, what=f"{what}: {part}", rtol=op.rtol)
            continue
        for m in batched_mismatches(looped, batched, _BATCH, op.rtol)[:1]:
            element = (m.direction, *unravel(m.in_element, op.primals[m.in_block].shape))
            raise CheckFailed(mismatch_text(f"{what}: gradients[{m.in_block}]", m, element))
    checked = sorted({index for index, _ in parts})
    parts = "output, gradient and JVP" if forward else "output and gradient"
    return f"{parts} under vmap over input(s) {checked} equal a loop"


def _skip_if_jax_cannot_vmap(op: OpUnderTest, settings: Settings, key: tuple, err: Exception):
    """A SKIP naming JAX's limit where ``jax.vmap`` of one part (``key``: input index, and
    output, gradient or JVP) raises ``err`` and the same part of the op's plain twin raises
    it too. The part alone: the twin's other parts may fail first for their own reasons (a
    Pallas kernel's gradient, which plain JAX cannot take), which says nothing of this one."""

    def rerun(twin: OpUnderTest) -> None:
        fn, _, batched_args, axes = _vmap_parts(twin, settings)[0][key]
        jax.jit(lambda args: jax.vmap(fn, in_axes=axes)(*args))(batched_args)

    limit = jax_limit(op, err, rerun)
    if limit is not None:
        index, part = key
        raise Skip(f"jax.vmap of the {part} over input {index}: {limit}") from err


def _vmap_parts(op: OpUnderTest, settings: Settings) -> tuple[dict, bool]:
    """``vmap``'s parts for ``loop_and_vmap`` (each input's output, gradient and, with
    forward mode, JVP), the same for the same ``settings``; and whether JVPs are in."""
    rng = np.random.default_rng(settings.seed + 4)
    forward = op.forward_error is None
    parts = {}
    for index, arg in enumerate(op.args):
        leaves, treedef = jax.tree_util.tree_flatten(arg)
        mapped = [i for i, leaf in enumerate(leaves) if _is_batchable(leaf)]
        if not mapped:
            continue  # a static argument cannot be batched
        # Every call of the op below is traced (under jit or vmap): a host copy of the
        # batch gives it the same abstract values, and picking an element of it compiles
        # nothing (of a JAX array, eagerly, two small programs per shape). Only the array
        # leaves are batched (and passed); the others are closed over, as given.
        try:
            batch = [_on_host(_batched_leaf(leaves[i], rng)) for i in mapped]
        except Exception as err:  # noqa: BLE001 -- a leaf that cannot be batched: said why
            raise Skip(
                f"input {index} cannot be batched for vmap ({type(err).__name__}: "
                f"{first_line(err)})"
            ) from err

        def full_args(values, index=index, leaves=leaves, treedef=treedef, mapped=mapped):
            new = list(leaves)
            for i, value in zip(mapped, values, strict=True):
                new[i] = value
            value = jax.tree_util.tree_unflatten(treedef, new)
            return op.args[:index] + (value,) + op.args[index + 1 :]

        def apply(value, full_args=full_args):
            return op.func(*full_args(value))

        def gradient(value, u, full_args=full_args):
            args = full_args(value)
            return vjp(lambda *v: op.func(*op.args_with(v, args)), op.float_leaves(args), u)

        def tangent(value, t, full_args=full_args):
            args = full_args(value)
            fn = lambda *v: op.func(*op.args_with(v, args))  # noqa: E731
            return jax.jvp(fn, tuple(op.float_leaves(args)), tuple(t))[1]

        items = [pick(batch, b) for b in range(_BATCH)]
        us = [op.cotangent(rng) for _ in range(_BATCH)]
        parts[index, "output"] = (apply, [(item,) for item in items], (batch,), 0)
        parts[index, "gradient"] = (
            gradient,
            list(zip(items, us, strict=True)),
            (batch, stacked(us)),
            0,
        )
        if forward:
            ts = [op.tangents(rng) for _ in range(_BATCH)]
            parts[index, "JVP"] = (
                tangent,
                list(zip(items, ts, strict=True)),
                (batch, stacked(ts)),
                0,
            )
    return parts, forward


def _checkpointed_gradients(op: OpUnderTest, u: Any) -> dict[str, Callable]:
    """``{policy name: primals -> gradients under jax.checkpoint with it}``, and the
    gradients without it under ``"reference"``."""
    gradients = {"reference": lambda *p: vjp(op.call, p, u)}
    for name, policy in _POLICIES.items():
        remat = jax.checkpoint(fresh(op), policy=policy)
        gradients[name] = lambda *p, remat=remat: vjp(remat, p, u)
    return gradients


def checkpoint(op: OpUnderTest, settings: Settings) -> str:
    rng = np.random.default_rng(settings.seed + 8)
    primals, u = op.primals, op.cotangent(rng)
    gradients = _checkpointed_gradients(op, u)
    not_run = {}
    try:
        got = op.quick_jit(lambda *p: {name: fn(*p) for name, fn in gradients.items()})(*primals)
    except Exception as err:  # noqa: BLE001 -- each policy alone below, to attribute the error
        _skip_if_effects_refused(err)
        got = {"reference": op.quick_jit(gradients.pop("reference"))(*primals)}
        for name, fn in gradients.items():
            try:
                got[name] = op.quick_jit(fn)(*primals)
            except Exception as err:
                # A policy JAX itself cannot apply to this math (everything_saveable over
                # complex intermediates) is not run; any other error is the op's.
                limit = jax_limit(
                    op,
                    err,
                    lambda twin, name=name: jax.jit(_checkpointed_gradients(twin, u)[name])(
                        *twin.primals
                    ),
                )
                if limit is None:
                    raise
                not_run[name] = limit
    reference = got.pop("reference")
    for name, grads in got.items():
        for label, a, e in zip(op.labels, grads, reference, strict=True):
            what = f"gradient of {label} under jax.checkpoint(policy={name})"
            assert_trees_close(a, e, what=what, rtol=op.rtol)
    if not_run:
        reasons = "; ".join(f"{name}: {why}" for name, why in not_run.items())
        raise Skip(
            f"same gradients under jax.checkpoint with {len(got)} of {len(_POLICIES)} "
            f"policies; not run: {reasons}"
        )
    return f"same gradients under jax.checkpoint with {len(_POLICIES)} policies"


# What JAX's checkpoint raises for a program with side effects it cannot partial-evaluate
# ("in partial-eval of" on jax 0.10, "in AD of" on 0.12).
_EFFECTS_REFUSED = re.compile(r"Effects not supported in (partial-eval|AD) of `checkpoint`/`remat`")


def _skip_if_effects_refused(err: Exception) -> None:
    """A SKIP naming JAX's limit where ``jax.checkpoint`` refuses the side effects of the
    op's program (a host callback: Pallas's TPU interpreter runs each kernel step through
    ``io_callback``): no policy can run, whatever the op computes."""
    if isinstance(err, NotImplementedError) and _EFFECTS_REFUSED.search(str(err)):
        effects = sorted(set(re.findall(r"jax\._src\.\w+\.(\w+) object", str(err))))
        raise Skip(
            "JAX's own limit for this construct: jax.checkpoint does not differentiate the "
            f"side effects of the op's program ({', '.join(effects) or 'effects'}: a host "
            "callback, as Pallas's TPU interpreter runs a kernel through io_callback)"
        ) from err
