"""The platform checks of ``jaxext.opcheck``: the op lowers for CPU, CUDA, ROCm and TPU.

Cross-platform lowering, as ``jax.export.export(jax.jit(f), platforms=[p])`` does it
(``jax.jit(f).trace(...).lower(lowering_platforms=(p,))``), makes a program for
platform ``p`` on any machine, without that platform's hardware or plugin: one row
per platform lowers the op's jitted forward, VJP and (where the op has forward mode)
JVP for it, at each dtype the op takes: its own (float64), and float32 and bfloat16
where it lowers for this machine's backend (a kernel's Triton or Mosaic lowering may
take float32 and bfloat16 only; a TPU's refusal of 64-bit types where a narrower
dtype lowers is noted in the row, not failed). Lowering only: nothing is compiled,
run or serialized (so neither the ``flatbuffers`` package that serialization needs
nor its checks, which the ``export`` check covers, come into it). To
keep it cheap, each part is first lowered for every selected platform in one export
(``platforms=[...]``, about a third of the cost of one export per platform); only
where that fails is it lowered for each platform alone, to say which refuses it.

An op that holds a Pallas kernel (a ``pallas_call``) says what its rows lowered: the
Triton or Mosaic custom calls found for each part, or none. A ``cuda``, ``rocm`` or
``tpu`` row whose parts hold a ``pallas_call`` but lowered no kernel custom call (Pallas's
interpreter loop, from ``interpret=True`` picked on the machine's backend rather than per
platform with ``lax.platform_dependent``) FAILs: the op would run the emulation there.

A call of a C++ kernel of :mod:`jaxext.cpp_extension` lowers for every platform (it
is a custom call by name), but runs only where its handler is registered: a kernel
with CPU handlers only makes the op CPU-only. That row is a SKIP naming the kernels,
or a FAIL where the caller asked for the platform (``opcheck(..., platforms=...)``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import partial_eval as pe

from ..._jaxpr import inner_jaxprs
from .._backward import complex_counterpart
from .._settings import Settings
from ._common import Skip
from ._common import first_line as _message_line
from ._common import fresh as _fresh
from ._common import vjp as _vjp
from ._interpreter import interpreter_limit
from ._kernels import kernel_targets, target_platforms
from ._op import CheckFailed, OpUnderTest

__all__ = ["PLATFORMS", "PLATFORM_CHECKS", "check_platforms"]

PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")
_NAMES = {"cpu": "CPU", "cuda": "CUDA", "rocm": "ROCm", "tpu": "TPU"}


def check_platforms(platforms: Any) -> frozenset[str]:
    """``opcheck``'s ``platforms`` argument, checked: the platforms the op must run on.

    Raises:
        TypeError: if it is not a sequence of strings.
        ValueError: for a platform other than ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``.
    """
    if platforms is None:
        return frozenset()
    if not isinstance(platforms, (list, tuple, set, frozenset)) or not all(
        isinstance(p, str) for p in platforms
    ):
        raise TypeError(f"`platforms` must be a sequence of platform names; got {platforms!r}.")
    unknown = sorted(set(platforms) - set(PLATFORMS))
    if unknown:
        raise ValueError(f"`platforms`: unknown platforms {unknown}; expected some of {PLATFORMS}.")
    return frozenset(platforms)


def _parts(op: OpUnderTest, settings: Settings) -> dict[str, Any]:
    """What every platform row lowers, made once per op: ``{dtypes: {part: function}}``
    for each set of input dtypes the op takes (``_dtypes``), the argument specs of each,
    the C++ kernels each part calls, and why the JVP is left out."""
    cached = op.cache.get("platform_parts")
    if cached is not None:
        return cached
    rng = np.random.default_rng(settings.seed + 12)
    primals, u, v = op.primals, op.cotangent(rng), op.tangents(rng)
    fresh = _fresh(op)
    jvp_skipped = None
    if op.forward_error is not None:
        jvp_skipped = f"no forward mode (jax.jvp raises {op.forward_error})"
    selected = op.cache.get("selected", frozenset(f"platform_{p}" for p in PLATFORMS))
    together = [p for p in PLATFORMS if f"platform_{p}" in selected]
    specs = _dtypes(op, together)
    variants = {label: _functions(op, fresh, specs[label], u, v) for label in specs}
    own = next(iter(specs))
    kernels: dict[str, list[str]] = {}
    pallas: dict[str, set[str]] = {p: set() for p in PLATFORMS}  # parts with a pallas_call
    for part, fn in variants[own].items():
        try:
            kernels[part] = kernel_targets(fn, *primals)
            jaxpr = jax.make_jaxpr(fn)(*primals).jaxpr
            # Dead code first: a kernel whose result the part does not use lowers to nothing.
            live = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]
            for platform, parts in pallas.items():
                if _holds_pallas(live, platform):
                    parts.add(part)
        except Exception:  # noqa: BLE001 -- the lowering below reports it
            kernels[part] = []
    lowered = set()  # the (dtypes, part) that lowered for every selected platform at once
    for label, functions in variants.items():
        for part, fn in functions.items():
            if any(part in parts for parts in pallas.values()):
                continue  # a Pallas part is lowered per platform, to read its kernels
            try:
                _lower(fn, specs[label], together)
                lowered.add((label, part))
            except Exception:  # noqa: BLE001 -- each platform alone below, to say which
                pass
    cached = {
        "variants": variants,
        "specs": specs,
        "kernels": kernels,
        "jvp_skipped": jvp_skipped,
        "lowered": lowered,
        "pallas": pallas,
    }
    op.cache["platform_parts"] = cached
    return cached


def _dtypes(op: OpUnderTest, platforms: list[str]) -> dict[str, list[jax.ShapeDtypeStruct]]:
    """``{label: argument specs}``: the op's own dtypes (float64, or those it takes
    without a float64 path) first, then float32 and bfloat16 where the op takes them
    (it lowers there for this machine's backend; for a kernel compiled only for
    accelerators, which lowers here at no dtype, for one of ``platforms``; complex inputs
    as complex64); ``label`` names the dtypes."""
    found: dict[str, list[jax.ShapeDtypeStruct]] = {}
    own = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in op.primals]
    where = [] if _takes(op.call, own, []) else platforms  # [] : this machine's backend
    for dtype in (None, jnp.float32, jnp.bfloat16):
        specs = [
            jax.ShapeDtypeStruct(
                p.shape, p.dtype if dtype is None else complex_counterpart(p.dtype, dtype)
            )
            for p in op.primals
        ]
        label = "/".join(sorted({np.dtype(s.dtype).name for s in specs}))
        if label in found:
            continue
        if dtype is not None and not _takes(op.call, specs, where):
            continue
        found[label] = specs
    return found


def _takes(fn: Callable, specs: list, platforms: list[str]) -> bool:
    """Whether ``fn`` takes arguments of ``specs``: it lowers for this machine's backend
    (``platforms`` empty), or for one of ``platforms`` (a Pallas kernel compiled for GPU or
    TPU, no interpret mode, lowers for no CPU)."""
    if not platforms:
        try:
            jax.jit(fn).trace(*specs).lower()
            return True
        except Exception:  # noqa: BLE001 -- a dtype the op does not take here
            return False
    for platform in platforms:
        try:
            _lower(fn, specs, [platform])
            return True
        except Exception:  # noqa: BLE001 -- a dtype the op does not take there either
            continue
    return False


def _functions(op: OpUnderTest, fresh: Callable, specs: list, u: Any, v: Any) -> dict:
    """The forward, VJP and (with forward mode) JVP of the op at inputs of ``specs``'
    dtypes, the cotangent and tangents cast to the dtypes they pair with there."""
    outputs = jax.eval_shape(fresh, *specs)
    u = jax.tree_util.tree_map(
        lambda c, o: jnp.asarray(c, o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact) else c,
        u,
        outputs,
    )
    v = tuple(jnp.asarray(t, s.dtype) for t, s in zip(v, specs, strict=True))
    functions: dict[str, Callable] = {
        "forward": fresh,
        "VJP": lambda *p: _vjp(fresh, p, u),
    }
    if op.forward_error is None:
        functions["JVP"] = lambda *p: jax.jvp(fresh, p, v)[1]
    return functions


# What lowering raises for an op that lowers only for the backend of the machine it
# runs on (a host callback): this machine cannot tell whether it lowers elsewhere.
_LOCAL_ONLY = "the platform for the specified backend"


def _lower(
    fn: Callable, specs: list, platforms: list[str], x64_only_fails: list[str] | None = None
) -> Any:
    """Lowers ``jax.jit(fn)`` at ``specs`` for ``platforms``; raises what lowering raises.

    This is the lowering of ``jax.export.export(jax.jit(fn), platforms=platforms)``
    without its serialization checks (a host callback or a custom call of JAX's own
    without a compatibility guarantee limits saved programs, not where the op runs;
    the ``export`` check covers serialization). Specs of 32 bits or fewer that do not lower
    under the checks' ``jax_enable_x64`` are lowered as such a program runs, with it off (a
    Pallas TPU kernel whose index arithmetic mixes int64 and int32 under x64); the error
    under x64 is appended to ``x64_only_fails``.
    """
    try:
        return _lower_here(fn, specs, platforms)
    except Exception as err:
        if any(np.dtype(s.dtype).itemsize > 4 and s.dtype != jnp.complex64 for s in specs):
            raise
        try:
            with jax.enable_x64(False):
                lowered = _lower_here(fn, specs, platforms)
        except Exception:  # noqa: BLE001 -- not x64's doing: the error under x64 stands
            raise err from None
        if x64_only_fails is not None:
            x64_only_fails.append(_first_line(err))
        return lowered


def _lower_here(fn: Callable, specs: list, platforms: list[str]) -> Any:
    traced = jax.jit(fn).trace(*specs)
    try:
        return traced.lower(lowering_platforms=tuple(platforms))
    except RuntimeError as err:
        # Newer JAX lowers a GPU kernel (Pallas's Triton) only for a named GPU model: where
        # none is present, one platform at a time is lowered for a representative one.
        device_kind = _GPU_MODELS.get(platforms[0]) if len(platforms) == 1 else None
        if device_kind is None or "AbstractDevice" not in str(err):
            raise
        device = jax.sharding.AbstractDevice(
            device_kind=device_kind, num_cores=None, platform=platforms[0]
        )
        mesh = jax.sharding.AbstractMesh((1,), ("_opcheck",), abstract_device=device)
        with jax.sharding.use_abstract_mesh(mesh):
            return jax.jit(fn).trace(*specs).lower(lowering_platforms=tuple(platforms))


# The GPU a kernel is lowered for where the machine has none and JAX asks for a model.
_GPU_MODELS = {"cuda": "NVIDIA H100 80GB HBM3", "rocm": "gfx942"}

# The custom calls a compiled Pallas kernel lowers to, by target name.
_KERNEL_CALLS = {
    "__gpu$xla.gpu.triton": "Triton",
    "tpu_custom_call": "Mosaic",
    "mosaic_gpu": "Mosaic GPU",
    "mosaic_gpu_v2": "Mosaic GPU",
}


def _holds_pallas(jaxpr: Any, platform: str) -> bool:
    """Whether ``jaxpr`` holds a ``pallas_call`` (at any depth) that lowers for ``platform``.

    Of a ``lax.platform_dependent`` (a ``cond`` with ``branches_platforms``), only the
    branch chosen for ``platform`` counts: an op may pick plain XLA there on purpose.
    """
    return any(
        eqn.primitive.name == "pallas_call"
        or any(_holds_pallas(body.jaxpr, platform) for body in _bodies_for(eqn, platform))
        for eqn in jaxpr.eqns
    )


def _bodies_for(eqn: Any, platform: str) -> list:
    """The inner jaxprs of ``eqn`` that lower for ``platform``."""
    bodies = list(inner_jaxprs(eqn))
    chosen = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    if not chosen or len(chosen) != len(bodies):
        return bodies
    named = [i for i, names in enumerate(chosen) if names is not None and platform in names]
    default = [i for i, names in enumerate(chosen) if names is None]
    picked = (named or default)[:1]
    return [bodies[i] for i in picked] if picked else bodies


def _kernel_calls(lowered: Any) -> dict[str, int]:
    """``{"Triton" or "Mosaic" or "Mosaic GPU": count}``: the kernel custom calls in a
    lowered program."""
    found: dict[str, int] = {}
    for target in re.findall(r"custom_call @([\w$.]+)", lowered.as_text()):
        if target in _KERNEL_CALLS:
            found[_KERNEL_CALLS[target]] = found.get(_KERNEL_CALLS[target], 0) + 1
    return found


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {_message_line(err)}"[:300]


def _union(lists: Any) -> list[str]:
    """The items of ``lists`` in first-seen order, once each."""
    return list(dict.fromkeys(item for items in lists for item in items))


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _platform_check(platform: str) -> Callable[[OpUnderTest, Settings], str]:
    name = _NAMES[platform]

    def check(op: OpUnderTest, settings: Settings) -> str:
        parts = _parts(op, settings)
        required = platform in op.cache.get("platforms", frozenset())
        # C++ kernels without a handler for this platform: the op cannot run there.
        handlers = target_platforms()
        missing: dict[str, set[str]] = {}
        for targets in parts["kernels"].values():
            for target in targets:
                has = handlers.get(target, set())
                if platform not in has:
                    missing[target.rsplit(".", 1)[-1]] = has
        if missing:
            where = sorted({p for has in missing.values() for p in has})
            only = "/".join(_NAMES.get(p, p) for p in where) or "no platform"
            message = (
                f"{only}-only: its C++ kernels ({', '.join(missing)}) have handlers for "
                f"{only} only, none for {name}"
            )
            if required:
                raise CheckFailed(f"{message} (asked for with `platforms`)")
            raise Skip(f"{message} (pass platforms=[{platform!r}] to require it)")
        errors: dict[str, dict[str, list[str]]] = {}  # error -> {part: its dtypes}
        unknown = []
        found: dict[str, dict[str, int]] = {}  # Pallas part -> its kernel custom calls
        no_64_bit = []  # dtypes with 64-bit types a TPU cannot lower (it has none)
        interpreted: dict[str, str] = {}  # part -> the TPU interpreter's defect it meets
        x64_only: list[str] = []  # errors of 32-bit parts lowered with jax_enable_x64 off only
        own = next(iter(parts["specs"]))
        for label, functions in parts["variants"].items():
            for part, fn in functions.items():
                if (label, part) in parts["lowered"]:
                    continue
                try:
                    lowered = _lower(fn, parts["specs"][label], [platform], x64_only)
                    if part in parts["pallas"][platform] and (label == own or not found.get(part)):
                        found[part] = _kernel_calls(lowered)
                except Exception as err:  # noqa: BLE001 -- reported, not raised
                    if _LOCAL_ONLY in str(err):
                        unknown.append(part)
                    elif (limit := interpreter_limit(err)) is not None:
                        interpreted.setdefault(part, limit)
                    elif platform == "tpu" and "64" in label and "64-bit" in str(err):
                        # A TPU has no 64-bit types: a limit of the platform, noted, where
                        # the op lowers at a narrower dtype it takes; else the row's FAIL.
                        if len(parts["specs"]) == 1:
                            errors.setdefault(_first_line(err), {}).setdefault(part, [label])
                        no_64_bit.append(label)
                    else:
                        errors.setdefault(_first_line(err), {}).setdefault(part, []).append(label)
        unknown, no_64_bit = _union([unknown]), _union([no_64_bit])
        if errors:
            raise CheckFailed(
                "; ".join(
                    f"the {_listed(list(which))} {'does' if len(which) == 1 else 'do'} not "
                    f"lower for {name} (at {_listed(_union(which.values()))}): {error}"
                    for error, which in errors.items()
                )
            )
        if unknown:
            backend = jax.default_backend()
            raise Skip(
                f"the {_listed(unknown)} lower only for this machine's backend "
                f"({backend}), as a host callback does: whether they lower for {name} "
                f"cannot be told here"
            )
        functions = [part for part in parts["variants"][own] if part not in interpreted]
        if not functions:
            raise Skip("; ".join(f"the {part}: {why}" for part, why in interpreted.items()))
        no_kernel = [part for part in functions if part in found and not found[part]]
        if no_kernel and platform != "cpu":
            raise CheckFailed(
                f"the {_listed(no_kernel)} {'holds' if len(no_kernel) == 1 else 'hold'} a "
                f"Pallas kernel but lowered none for {name}: no Triton or Mosaic custom call, "
                "only Pallas's interpreter loop (interpret mode; pick it per platform with "
                "lax.platform_dependent, not by the machine's backend)"
            )
        detail = f"jitted {_listed(functions)} lower for {name}"
        if found:
            kinds = sorted({kind for calls in found.values() for kind in calls})
            counts = ", ".join(f"{part} {sum(calls.values())}" for part, calls in found.items())
            detail += (
                f"; Pallas kernels lowered to {'/'.join(kinds)} custom calls ({counts})"
                if kinds
                else "; Pallas parts lowered no kernel custom call (XLA or interpret mode)"
            )
        if parts["jvp_skipped"] is not None:
            detail += f"; JVP: SKIP, {parts['jvp_skipped']}"
        for part, limit in interpreted.items():
            detail += f"; {part}: not lowered, {limit}"
        if x64_only:
            detail += (
                "; at 32-bit inputs some parts lower with jax_enable_x64 off only (under x64: "
                f"{_union([x64_only])[0]})"
            )
        taken = [label for label in parts["specs"] if label not in no_64_bit]
        detail += f"; at {_listed(taken)} inputs"
        if no_64_bit:
            detail += f" ({_listed(no_64_bit)}: not lowered, TPUs have no 64-bit types)"
        return detail

    check.__name__ = f"platform_{platform}"
    check.__doc__ = f"The op's jitted forward, VJP and JVP lower for {name} (jax.export)."
    return check


PLATFORM_CHECKS: dict[str, Callable[[OpUnderTest, Settings], str]] = {
    f"platform_{p}": _platform_check(p) for p in PLATFORMS
}
