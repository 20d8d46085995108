"""Benchmark forward mode through jaxext ops (and reverse-mode parity) against plain autodiff.

Run from the repository root::

    python benchmarks/bench_forward_mode.py           # full run (CPU: several minutes)
    python benchmarks/bench_forward_mode.py --quick   # small sizes, few rounds
    python benchmarks/bench_forward_mode.py --render benchmarks/results/forward_mode_cpu.json

For ``jaxext.linear``, ``jaxext.mul_constant`` (static and array constant) and a
``jaxext.Function``-defined linear, each compared with the same math in plain
``jax.numpy`` differentiated by JAX:

* jitted ``jax.jvp``, ``jax.jacfwd``, a Hessian-vector product (``jvp`` of
  ``grad``, forward-over-reverse), ``jax.hessian`` of a small model's loss, and
  ``jax.grad`` (reverse-mode parity);
* the eager (un-jitted) call of each op against its plain expression.

Each jitted pair is also compiled ahead of time and its optimised HLO compared:
the number of ``dot`` instructions, XLA's flop estimate and the whole opcode
histogram. Equal programs explain a ratio near 1; a ratio far from 1 with equal
programs is noise. Writes ``benchmarks/results/forward_mode_cpu.json`` and
``.md`` (``forward_mode_cpu_quick.*`` with ``--quick``). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import io
import json
import os
import pstats
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: import jaxext without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxext  # noqa: E402

sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402
import report  # noqa: E402

Size = tuple[int, int, int]  # (batch, in_features, out_features)

JIT_TARGET = 1.05  # jvp, jacfwd, HVP, hessian: jaxext / autodiff (issue 11, item 5)
GRAD_TARGET = 1.02  # reverse mode "stays at parity": bench_linear.py's fwd+bwd target
EAGER_TARGET = 1.30  # eager op / eager plain expression (issue 11, item 5)
MODES = ("jvp", "jacfwd", "hvp", "hessian", "grad")


@dataclasses.dataclass
class Settings:
    quick: bool
    sizes: list[Size]  # jvp, jacfwd, hvp, grad and eager rows
    hessian_sizes: list[Size]  # full Hessians: small models only
    rounds: int
    min_rounds: int
    warmup: int
    target_s: float
    budget_s: float  # measured time allowed per comparison
    families: list[str]
    modes: list[str]
    eager: bool
    control: bool
    profile_calls: int


def make_settings(args: argparse.Namespace) -> Settings:
    sizes = [(32, 64, 64), (256, 512, 512), (1024, 1024, 1024)]
    hessian_sizes = [(32, 8, 8), (64, 16, 16)]
    if args.quick:
        sizes, hessian_sizes = sizes[:2], hessian_sizes[:1]
    return Settings(
        quick=args.quick,
        sizes=sizes,
        hessian_sizes=hessian_sizes,
        rounds=args.rounds or (7 if args.quick else 30),
        min_rounds=3 if args.quick else 8,
        warmup=2 if args.quick else 3,
        target_s=0.01 if args.quick else 0.025,
        budget_s=1.5 if args.quick else 4.0,
        families=args.only or list(FAMILIES),
        modes=args.modes or list(MODES),
        eager=not args.no_eager,
        control=not args.no_control,
        profile_calls=0 if args.no_profile else (300 if args.quick else 2000),
    )


# -- the ops under test, each next to the plain jnp expression of the same math -----------


class LinearFunction(jaxext.Function):
    """``x @ weight.T + bias`` written the PyTorch way (the "Extending PyTorch" example)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_output @ weight
        if ctx.needs_input_grad[1]:
            grad_weight = grad_output.T @ x
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0)
        return grad_x, grad_weight, grad_bias


def _plain_linear(x, w, b):
    return x @ w.T + b


def _mlp(linear: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """Two layers, ``linear(tanh(linear(x, w1, b1)), w2, b2)``: second derivatives are not 0."""

    def model(x, w1, b1, w2, b2):
        return linear(jnp.tanh(linear(x, w1, b1)), w2, b2)

    return model


def _mlp_args(key: int, size: Size) -> list[jax.Array]:
    batch, fin, fout = size
    shapes = [(batch, fin), (fout, fin), (fout,), (fout, fout), (fout,)]
    arrays = _normal(key, shapes)
    arrays[1] /= np.sqrt(fin)  # unit-scale pre-activations: tanh neither saturated nor linear
    arrays[3] /= np.sqrt(fout)
    return arrays


def _mul_static_model(mul: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    def model(x):
        return mul(jnp.tanh(mul(x, 2.0)), 0.5)

    return model


def _mul_array_model(mul: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    def model(x, c):
        return mul(jnp.tanh(mul(x, c)), c)

    return model


def _times(x, c):
    return x * c


@dataclasses.dataclass(frozen=True)
class Family:
    """One op under test: a small model built from it, and the same model in plain jnp."""

    label: str
    jaxext_model: Callable[..., jax.Array]
    plain_model: Callable[..., jax.Array]
    make_args: Callable[[int, Size], list[jax.Array]]  # argument 0 is the model's input x
    param_argnums: tuple[int, ...]  # what grad, HVP and hessian differentiate
    eager: tuple[Callable[..., jax.Array], Callable[..., jax.Array], str] | None


FAMILIES: dict[str, Family] = {
    "linear": Family(
        "jaxext.linear",
        _mlp(jaxext.linear),
        _mlp(_plain_linear),
        _mlp_args,
        (1, 2, 3, 4),
        (jaxext.linear, _plain_linear, "x @ w.T + b"),
    ),
    "Function": Family(
        "Function linear",
        _mlp(LinearFunction.apply),
        _mlp(_plain_linear),
        _mlp_args,
        (1, 2, 3, 4),
        (LinearFunction.apply, _plain_linear, "x @ w.T + b"),
    ),
    "mul_constant": Family(
        "mul_constant(x, 2.0)",
        _mul_static_model(jaxext.mul_constant),
        _mul_static_model(_times),
        lambda key, size: _normal(key, [size[:2]]),
        (0,),
        (lambda x: jaxext.mul_constant(x, 2.0), lambda x: x * 2.0, "x * 2.0"),
    ),
    "mul_constant_array": Family(
        "mul_constant(x, c array)",
        _mul_array_model(jaxext.mul_constant),
        _mul_array_model(_times),
        lambda key, size: _normal(key, [size[:2], size[1:2]]),
        (0, 1),
        None,  # its eager call is the static case's plus one dispatch: not a separate row
    ),
}


def _normal(key: int, shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(key), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


# -- the differentiated programs ------------------------------------------------------------


def _program(mode: str, fam: Family, model: Callable[..., jax.Array]):
    """``(function, example arguments maker)`` for one mode; the function is jitted by the caller.

    Every program takes the model's arguments plus what the mode needs (tangents,
    targets) as positional arrays, so jit specialises on shapes only.
    """
    argnums = fam.param_argnums

    def loss(args, y):
        return jnp.mean((model(*args) - y) ** 2)

    def with_params(args, params):
        full = list(args)
        for i, p in zip(argnums, params, strict=True):
            full[i] = p
        return full

    if mode == "jvp":  # every argument perturbed: the output tangent

        def jvp(args, tangents):
            return jax.jvp(model, tuple(args), tuple(tangents))

        return jvp, lambda args, y, t: (args, t)
    if mode == "jacfwd":  # Jacobian of one example's output w.r.t. its input

        def jacfwd(args):
            x, *rest = args
            return jax.jacfwd(lambda v: model(v[None], *rest)[0])(x[0])

        return jacfwd, lambda args, y, t: (args,)
    if mode == "grad":

        def grad(args, y):
            params = [args[i] for i in argnums]
            return jax.grad(lambda p: loss(with_params(args, p), y))(params)

        return grad, lambda args, y, t: (args, y)
    if mode in ("hvp", "hessian"):

        def grad_of(args, y):
            return lambda p: jax.grad(lambda q: loss(with_params(args, q), y))(p)

        if mode == "hvp":  # forward-over-reverse: jvp of grad

            def hvp(args, y, v):
                params = [args[i] for i in argnums]
                return jax.jvp(grad_of(args, y), (params,), (v,))[1]

            return hvp, lambda args, y, t: (args, y, [t[i] for i in argnums])

        def hessian(args, y):
            params = [args[i] for i in argnums]
            return jax.hessian(lambda p: loss(with_params(args, p), y))(params)

        return hessian, lambda args, y, t: (args, y)
    raise ValueError(f"unknown mode {mode!r}")


def _inputs(fam: Family, size: Size) -> tuple[list[jax.Array], jax.Array, list[jax.Array]]:
    """Model arguments, a regression target and one tangent per argument."""
    args = fam.make_args(0, size)
    y = jax.eval_shape(fam.plain_model, *args)
    (y_arr,) = _normal(1, [y.shape])
    tangents = _normal(2, [a.shape for a in args])
    return args, y_arr, tangents


# -- compiled-program comparison --------------------------------------------------------------

# An HLO instruction: `name = type opcode(`, where type is a shape or a tuple of shapes.
_INSTRUCTION = re.compile(r"=\s+(\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")


def _hlo_summary(fn: Callable[..., Any], args: tuple[Any, ...]) -> dict[str, Any]:
    """Opcode histogram (all computations, fused ones included) and XLA's flop estimate.

    ``signature`` is the multiset of (opcode, result shape) pairs, layouts left out:
    a stricter test of "the same program" than the opcode counts.
    """
    compiled = jax.jit(fn).lower(*args).compile()
    found = _INSTRUCTION.findall(compiled.as_text())
    counts = collections.Counter(op for _, op in found)
    signature = collections.Counter(f"{op} {re.sub(r'{[^}]*}', '', ty)}" for ty, op in found)
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float(cost.get("flops")) if cost and "flops" in cost else None
    except Exception:  # a backend without a cost model
        flops = None
    return {
        "dots": counts.get("dot", 0),
        "flops": flops,
        "opcodes": dict(sorted(counts.items())),
        "signature": dict(sorted(signature.items())),
    }


def _opcode_diff(a: dict[str, int], b: dict[str, int]) -> dict[str, list[int]]:
    """Opcodes whose counts differ: ``{opcode: [jaxext count, autodiff count]}``."""
    return {k: [a.get(k, 0), b.get(k, 0)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _compare(s: Settings, fns: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Interleaved timing of ``jaxext`` against ``autodiff``; ratio = median per-round ratio."""
    res = benchlib.interleaved_times(
        fns,
        rounds=s.rounds,
        warmup=s.warmup,
        target_s=s.target_s,
        budget_s=s.budget_s,
        min_rounds=s.min_rounds,
    )
    t = res["times"]
    return {
        "rounds": res["rounds"],
        "inner": res["inner"],
        "time": {name: benchlib.time_summary(ts) for name, ts in t.items()},
        "ratio": benchlib.ratio_summary(t["jaxext"], t["autodiff"]),
        # Fastest measurement against fastest: on a loaded machine the least disturbed
        # round of each side; a second view of the same data, not the target's statistic.
        "min_ratio": min(t["jaxext"]) / min(t["autodiff"]),
        "times_s": t,
    }


def bench_jitted(s: Settings, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for fam_name in s.families:
        fam = FAMILIES[fam_name]
        for mode in s.modes:
            for size in s.hessian_sizes if mode == "hessian" else s.sizes:
                rows.append(_bench_one(s, fam_name, fam, mode, size, log))
    return rows


def _bench_one(s, fam_name, fam, mode, size, log) -> dict[str, Any]:
    args, y, tangents = _inputs(fam, size)
    f_j, make = _program(mode, fam, fam.jaxext_model)
    f_p, _ = _program(mode, fam, fam.plain_model)
    call_args = make(args, y, tangents)
    row: dict[str, Any] = {"family": fam_name, "op": fam.label, "mode": mode, "size": list(size)}
    row["loadavg_before"] = benchlib.loadavg()
    hlo = {"jaxext": _hlo_summary(f_j, call_args), "autodiff": _hlo_summary(f_p, call_args)}
    row["hlo"] = {
        "dots": {k: v["dots"] for k, v in hlo.items()},
        "flops": {k: v["flops"] for k, v in hlo.items()},
        "same_opcodes": hlo["jaxext"]["opcodes"] == hlo["autodiff"]["opcodes"],
        "opcode_diff": _opcode_diff(hlo["jaxext"]["opcodes"], hlo["autodiff"]["opcodes"]),
        "same_signature": hlo["jaxext"]["signature"] == hlo["autodiff"]["signature"],
        "opcodes": {k: v["opcodes"] for k, v in hlo.items()},
    }
    jj, jp = jax.jit(f_j), jax.jit(f_p)
    row["max_rel_err_vs_autodiff"] = benchlib.max_rel_err(jj(*call_args), jp(*call_args))
    row.update(
        _compare(
            s,
            {
                "jaxext": lambda: jax.block_until_ready(jj(*call_args)),
                "autodiff": lambda: jax.block_until_ready(jp(*call_args)),
            },
        )
    )
    target = GRAD_TARGET if mode == "grad" else JIT_TARGET
    row["target"] = target
    row["met"] = row["ratio"]["median"] <= target
    r, d = row["ratio"], row["hlo"]["dots"]
    log(
        f"{fam.label:26s} {mode:8s} {report.fm_size(size):15s} ratio {r['median']:.3f} "
        f"[{r['p25']:.2f}-{r['p75']:.2f}] dots {d['jaxext']}/{d['autodiff']} "
        f"same_hlo={row['hlo']['same_opcodes'] and row['hlo']['same_signature']} "
        f"load={row['loadavg_before'][0]:.1f}"
    )
    return row


def bench_control(s: Settings, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """A/A control: the autodiff program timed against a second ``jit`` of itself.

    Both sides run the same executable, so the spread of these ratios is the noise
    floor of this machine at the time of the run.
    """
    fam = FAMILIES["linear"]
    rows = []
    for mode in ("jvp", "hvp"):
        for size in s.sizes:
            args, y, tangents = _inputs(fam, size)
            f_p, make = _program(mode, fam, fam.plain_model)
            call_args = make(args, y, tangents)
            a, b = jax.jit(f_p), jax.jit(f_p)
            row: dict[str, Any] = {
                "mode": mode,
                "size": list(size),
                "loadavg_before": benchlib.loadavg(),
            }
            row["note"] = "both contenders run the plain-autodiff program"
            row.update(
                _compare(
                    s,
                    {
                        "jaxext": lambda a=a, c=call_args: jax.block_until_ready(a(*c)),
                        "autodiff": lambda b=b, c=call_args: jax.block_until_ready(b(*c)),
                    },
                )
            )
            r = row["ratio"]
            log(
                f"control autodiff/autodiff {mode:4s} {report.fm_size(size):15s} "
                f"ratio {r['median']:.3f} "
                f"[{r['p25']:.2f}-{r['p75']:.2f}]"
            )
            rows.append(row)
    return rows


def bench_eager(s: Settings, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for fam_name in s.families:
        fam = FAMILIES[fam_name]
        if fam.eager is None:
            continue
        op, plain, plain_label = fam.eager
        for size in s.sizes:
            args = fam.make_args(0, size)[: 3 if fam_name in ("linear", "Function") else 1]
            row: dict[str, Any] = {
                "family": fam_name,
                "op": fam.label,
                "against": plain_label,
                "size": list(size),
                "loadavg_before": benchlib.loadavg(),
                "max_rel_err_vs_plain": benchlib.max_rel_err(op(*args), plain(*args)),
            }
            row.update(
                _compare(
                    s,
                    {
                        "jaxext": lambda op=op, args=args: jax.block_until_ready(op(*args)),
                        "autodiff": lambda plain=plain, args=args: jax.block_until_ready(
                            plain(*args)
                        ),
                    },
                )
            )
            row["target"] = EAGER_TARGET
            row["met"] = row["ratio"]["median"] <= EAGER_TARGET
            r = row["ratio"]
            log(
                f"eager {fam.label:20s} {report.fm_size(size):15s} "
                f"{row['time']['jaxext']['median_ms']:.3f}"
                f" ms vs {row['time']['autodiff']['median_ms']:.3f} ms ratio {r['median']:.3f} "
                f"load={row['loadavg_before'][0]:.1f}"
            )
            rows.append(row)
    return rows


def profile_eager(calls: int) -> dict[str, Any]:
    """cProfile of eager ``jaxext.linear`` and ``Function.apply`` calls at 32x64 -> 64."""
    x, w, b = _mlp_args(0, (32, 64, 64))[:3]
    ops = {"jaxext.linear": jaxext.linear, "Function.apply": LinearFunction.apply}
    return {name: _profile(op, (x, w, b), calls) for name, op in ops.items()}


def _profile(op: Callable[..., Any], args: tuple[Any, ...], calls: int) -> dict[str, Any]:
    for _ in range(50):
        jax.block_until_ready(op(*args))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        jax.block_until_ready(op(*args))
    profiler.disable()
    stats = pstats.Stats(profiler)
    root = str(HERE.parent) + os.sep
    top = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        where = re.sub(r".*site-packages/", "", path.replace(root, ""))
        top.append(
            {
                "function": f"{where}:{line}({func})",
                "calls_per_op": ncalls / calls,
                "self_us_per_op": tottime / calls * 1e6,
                "cum_us_per_op": cumtime / calls * 1e6,
            }
        )
    top.sort(key=lambda e: -e["cum_us_per_op"])
    by_self = sorted(top, key=lambda e: -e["self_us_per_op"])
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
    return {
        "calls": calls,
        "top_cumulative": top[:30],
        "top_self": by_self[:15],
        "pstats_text": text.getvalue(),
    }


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per comparison")
    parser.add_argument("--only", choices=list(FAMILIES), action="append", help="ops (repeatable)")
    parser.add_argument("--modes", choices=MODES, action="append", help="modes (repeatable)")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager rows")
    parser.add_argument("--no-control", action="store_true", help="skip the A/A control rows")
    parser.add_argument("--no-profile", action="store_true", help="skip the eager cProfile")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    parser.add_argument("--stem", default=None, help="output file name without extension")
    parser.add_argument("--note", default="", help="free text stored with the results")
    parser.add_argument(
        "--render", type=Path, default=None, help="only re-write the .md of this results JSON"
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        results = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(report.render_forward_mode(results))
        return results
    s = make_settings(args)
    stem = args.stem or ("forward_mode_cpu_quick" if s.quick else "forward_mode_cpu")
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    results: dict[str, Any] = {
        "machine": benchlib.machine_info(),
        "settings": dataclasses.asdict(s),
        "note": args.note,
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
    }
    log(
        f"load average at start {report.fmt_load(results['machine']['loadavg_start'])}: "
        "results on a "
        "shared machine are noisy; compare ratios, not milliseconds"
    )
    results["jitted"] = bench_jitted(s, log)
    results["eager"] = bench_eager(s, log) if s.eager else []
    results["control"] = bench_control(s, log) if s.control else []
    if s.profile_calls:
        results["eager_profile"] = profile_eager(s.profile_calls)
    results["machine"]["loadavg_end"] = benchlib.loadavg()
    results["wall_s"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md = report.render_forward_mode(results)
    (args.out / f"{stem}.md").write_text(md)
    print(md)
    log(f"wrote {json_path} and {stem}.md")
    return results


if __name__ == "__main__":
    main()
