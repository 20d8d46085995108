"""Partitioning rules for FFI calls: how a kernel splits over a device mesh.

Experimental: the rules' syntax and what they do may change in a minor release.

A rule names each dimension of each operand and result (einsum-like, names
separated by spaces): ``"b i, o i, o -> b o"``. When the operands carry a
``NamedSharding`` that splits named dimensions over mesh axes, the call runs
inside ``jax.shard_map`` on that mesh: every device calls the kernel on its
shards, and a result that lacks a dimension that is split among the operands is
summed over it (``psum``), as in ``jnp.einsum``. ``"batch"`` is short for the
first operand's and every result's leading dimension.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["BATCH", "check_rule", "partitioned_call"]

BATCH = "batch"
_TOKEN = re.compile(r"\.\.\.|_|[A-Za-z][A-Za-z0-9_]*")
_ELLIPSIS = "..."
_WHOLE = "_"


@dataclass(frozen=True)
class _Rule:
    text: str
    operands: tuple[tuple[str, ...], ...]  # per operand: names, "...", "_"
    results: tuple[tuple[str, ...], ...]


def _error(rule: str, why: str) -> ValueError:
    return ValueError(
        f"`partition` must be None, 'batch' or an einsum-like rule such as "
        f"'b i, o i -> b o'; got {rule!r}: {why}."
    )


def check_rule(rule: object) -> str | None:
    """Checks a ``partition`` argument (syntax only) and returns it. Experimental (see
    the module)."""
    if rule is None:
        return None
    if not isinstance(rule, str):
        raise TypeError(
            f"`partition` must be None, 'batch' or an einsum-like rule string; "
            f"got {type(rule).__name__}."
        )
    if rule.strip() != BATCH:
        _parse(rule)
    return rule


def _terms(rule: str, side: str) -> tuple[tuple[str, ...], ...]:
    terms = []
    for term in side.split(","):
        stripped = term.replace(_ELLIPSIS, f" {_ELLIPSIS} ")
        tokens = stripped.split()
        for token in tokens:
            if not _TOKEN.fullmatch(token):
                raise _error(rule, f"{token!r} is not a dimension name, '_' or '...'")
        if tokens.count(_ELLIPSIS) > 1:
            raise _error(rule, f"'...' appears twice in {term.strip()!r}")
        named = [t for t in tokens if t not in (_ELLIPSIS, _WHOLE)]
        if len(set(named)) != len(named):
            raise _error(rule, f"a name repeats within {term.strip()!r}")
        terms.append(tuple(tokens))
    return tuple(terms)


@functools.lru_cache(maxsize=256)
def _parse(rule: str) -> _Rule:
    if rule.count("->") != 1:
        raise _error(rule, "it needs exactly one '->'")
    lhs, rhs = rule.split("->")
    operands, results = _terms(rule, lhs), _terms(rule, rhs)
    known = {t for term in operands for t in term}
    for term in results:
        for token in term:
            if token != _WHOLE and token not in known:
                raise _error(rule, f"result dimension {token!r} is in no operand")
    return _Rule(rule, operands, results)


def _names(term: tuple[str, ...], rank: int, rule: str, what: str) -> list[str]:
    """One name per dimension: ``...`` expands to ``...k`` (k counted from the right)."""
    fixed = len([t for t in term if t != _ELLIPSIS])
    if _ELLIPSIS not in term:
        if fixed != rank:
            raise _error(rule, f"{what} has rank {rank} but the rule names {fixed} dimensions")
        return list(term)
    if fixed > rank:
        raise _error(rule, f"{what} has rank {rank} but the rule names {fixed} dimensions")
    at = term.index(_ELLIPSIS)
    n = rank - fixed
    expanded = [f"{_ELLIPSIS}{n - 1 - k}" for k in range(n)]
    return [*term[:at], *expanded, *term[at + 1 :]]


def _batch_rule(n_operands: int, operand_ranks, result_ranks) -> _Rule:
    if not operand_ranks or operand_ranks[0] == 0 or 0 in result_ranks:
        raise ValueError(
            "`partition='batch'` needs a first operand and results with a leading "
            f"(batch) dimension; got operand ranks {list(operand_ranks)} and result "
            f"ranks {list(result_ranks)}."
        )

    def term(rank, batched):
        return ("b" if batched else _WHOLE, *(_WHOLE,) * (rank - 1)) if rank else ()

    operands = tuple(term(r, i == 0) for i, r in enumerate(operand_ranks))
    results = tuple(term(r, True) for r in result_ranks)
    return _Rule(BATCH, operands, results)


def _is_tracer(x: Any) -> bool:
    tracer = getattr(getattr(jax, "core", None), "Tracer", None)
    return tracer is not None and isinstance(x, tracer)


def _sharding_of(x: Any) -> tuple[Any, tuple] | None:
    """``(mesh, spec)`` of an operand, or None when it says nothing about a mesh."""
    if isinstance(x, jax.Array) and not _is_tracer(x):
        sharding = getattr(x, "sharding", None)  # concrete: the real layout, any axis type
    else:
        try:
            sharding = getattr(jax.typeof(x), "sharding", None)  # traced: explicit axes only
        except TypeError:
            return None
    if not isinstance(sharding, NamedSharding) or not sharding.mesh.axis_names:
        return None
    return sharding.mesh, tuple(sharding.spec)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def partitioned_call(
    make_call: Callable[[list[Any]], Callable[..., Any]],
    args: Sequence[Any],
    results: Sequence[Any],
    rule: str,
) -> list[Any]:
    """Calls ``make_call(results)(*args)`` (an ``ffi_call``) shard by shard where ``rule`` allows.

    Experimental, as the rules are (see the module).

    ``results`` are the result shapes and dtypes; ``make_call`` gets them, or each
    device's shard of them. Returns the list of results. Without a mesh among the
    operands' shardings, inside a ``shard_map`` (manual axes), or with nothing
    split, the call runs whole.
    """
    shapes = [tuple(getattr(a, "shape", ())) for a in args]
    result_shapes = [tuple(r.shape) for r in results]
    if rule.strip() == BATCH:
        parsed = _batch_rule(len(args), [len(s) for s in shapes], [len(s) for s in result_shapes])
    else:
        parsed = _parse(rule)
    if any(_is_tracer(a) for a in args) and _on_explicit_mesh(args):
        # Traced on an explicit mesh: under vmap the batch axis may itself be split (an
        # ensemble over one mesh axis, rows over another), which the shard_map of one
        # element cannot say; the batched call is partitioned whole instead.
        return list(_vmappable(make_call, results, parsed)(*args))
    return _call(make_call, args, results, parsed)


def _on_explicit_mesh(args: Sequence[Any]) -> bool:
    shardings = [_sharding_of(a) for a in args]
    return any(s is not None and AxisType.Explicit in tuple(s[0].axis_types) for s in shardings)


def _vmappable(
    make_call: Callable[[list[Any]], Callable[..., Any]], results: Sequence[Any], parsed: _Rule
) -> Any:
    """The partitioned call as a ``custom_vmap``: batched, it is the partitioned call of
    the batched operands, whose rule names the batch axis (so that a split batch axis
    stays split), each device's kernel call batched as ``vmap_method`` says."""
    fun = jax.custom_batching.custom_vmap(lambda *args: _call(make_call, args, results, parsed))

    @fun.def_vmap
    def batched(axis_size: int, in_batched: Sequence[Any], *args: Any) -> Any:
        taken = {t for term in (*parsed.operands, *parsed.results) for t in term}
        name = next(f"vmap{k}" for k in range(len(taken) + 1) if f"vmap{k}" not in taken)
        rule = _Rule(
            parsed.text,
            tuple((name, *t) if b else t for t, b in zip(parsed.operands, in_batched, strict=True)),
            tuple((name, *t) for t in parsed.results),
        )
        in_axes = [0 if b else None for b in in_batched]

        def batched_call(shard_results: list[Any]) -> Callable[..., Any]:
            one = make_call([jax.ShapeDtypeStruct(r.shape[1:], r.dtype) for r in shard_results])
            return jax.vmap(lambda *arrays: tuple(_as_list(one(*arrays))), in_axes=in_axes)

        shapes = [jax.ShapeDtypeStruct((axis_size, *r.shape), r.dtype) for r in results]
        outs = list(_vmappable(batched_call, shapes, rule)(*args))
        return outs, [True] * len(outs)

    return fun


def _call(
    make_call: Callable[[list[Any]], Callable[..., Any]],
    args: Sequence[Any],
    results: Sequence[Any],
    parsed: _Rule,
) -> list[Any]:
    """:func:`partitioned_call` with the rule parsed (``parsed``)."""
    rule = parsed.text
    call = make_call(list(results))
    shapes = [tuple(getattr(a, "shape", ())) for a in args]
    result_shapes = [tuple(r.shape) for r in results]
    if len(parsed.operands) != len(args) or len(parsed.results) != len(results):
        raise _error(
            rule,
            f"it has {len(parsed.operands)} operand(s) and {len(parsed.results)} result(s); "
            f"the call has {len(args)} and {len(results)}",
        )
    operand_names = [
        _names(t, len(s), rule, f"operand {i}")
        for i, (t, s) in enumerate(zip(parsed.operands, shapes, strict=True))
    ]
    result_names = [
        _names(t, len(s), rule, f"result {i}")
        for i, (t, s) in enumerate(zip(parsed.results, result_shapes, strict=True))
    ]
    sizes: dict[str, int] = {}
    for names, shape in [
        *zip(operand_names, shapes, strict=True),
        *zip(result_names, result_shapes, strict=True),
    ]:
        for name, size in zip(names, shape, strict=True):
            if name == _WHOLE or size == 1:
                continue
            if sizes.setdefault(name, size) != size:
                raise _error(rule, f"dimension {name!r} has sizes {sizes[name]} and {size}")

    shardings = [_sharding_of(a) for a in args]
    meshes = [s[0] for s in shardings if s is not None]
    if not meshes:
        return _as_list(call(*args))
    mesh = meshes[0]
    same = all(
        m.axis_names == mesh.axis_names and tuple(m.axis_sizes) == tuple(mesh.axis_sizes)
        for m in meshes
    )
    if not same or any(t == AxisType.Manual for t in mesh.axis_types):
        return _as_list(call(*args))  # mixed meshes (JAX reports it) or inside shard_map
    axis_size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))

    # Each name takes the mesh axes of the first operand that splits it, if those
    # axes are still free (one mesh axis splits one name) and divide its size.
    assigned: dict[str, tuple[str, ...]] = {}
    taken: set[str] = set()
    for names, shape, sharding in zip(operand_names, shapes, shardings, strict=True):
        if sharding is None:
            continue
        spec = sharding[1] + (None,) * (len(shape) - len(sharding[1]))
        for name, size, entry in zip(names, shape, spec, strict=True):
            axes = _axes(entry)
            if name == _WHOLE or name in assigned or not axes or size != sizes.get(name):
                continue
            if taken & set(axes) or size % math.prod(axis_size[a] for a in axes):
                continue
            assigned[name] = axes
            taken |= set(axes)
    if not assigned:
        return _as_list(call(*args))

    def spec_for(names: list[str], shape: tuple[int, ...]) -> P:
        return P(
            *(
                _entry(assigned.get(n, ())) if size == sizes.get(n) else None
                for n, size in zip(names, shape, strict=True)
            )
        )

    in_specs = [spec_for(n, s) for n, s in zip(operand_names, shapes, strict=True)]
    out_specs = [spec_for(n, s) for n, s in zip(result_names, result_shapes, strict=True)]
    summed_names = {n for names in operand_names for n in names if n in assigned}
    reductions = [
        tuple(a for n in sorted(summed_names - set(names)) for a in assigned[n])
        for names in result_names
    ]
    args = [_placed(a, s, sh, mesh) for a, s, sh in zip(args, in_specs, shardings, strict=True)]

    def shard_shape(spec: P, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(
            size // math.prod(axis_size[a] for a in _axes(entry))
            for size, entry in zip(shape, tuple(spec) + (None,) * len(shape), strict=False)
        )

    local_call = make_call(
        [
            jax.ShapeDtypeStruct(shard_shape(spec, shape), r.dtype)
            for spec, shape, r in zip(out_specs, result_shapes, results, strict=True)
        ]
    )

    def local(*shards):
        outs = _as_list(local_call(*shards))
        return [
            jax.lax.psum(o, axes) if axes else o for o, axes in zip(outs, reductions, strict=True)
        ]

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False
    )
    return list(mapped(*args))


def _placed(x: Any, spec: P, sharding: tuple | None, mesh: Any) -> Any:
    """``x`` laid out as ``spec`` (a no-op where it already is)."""
    current = tuple(sharding[1]) if sharding is not None else ()
    want = tuple(spec)
    pad = max(len(current), len(want))
    if current + (None,) * (pad - len(current)) == want + (None,) * (pad - len(want)):
        return x
    if isinstance(x, jax.Array) and not _is_tracer(x) and isinstance(mesh, jax.sharding.Mesh):
        return jax.device_put(x, NamedSharding(mesh, spec))
    if sharding is not None and any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, spec)
    return x  # shard_map lays it out as in_specs says


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]
