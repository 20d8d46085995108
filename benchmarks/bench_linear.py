"""Benchmark jaxext.linear / jaxext.nnx.Linear against plain JAX autodiff, Flax and PyTorch.

Run from the repository root::

    python benchmarks/bench_linear.py            # full run (CPU: a few minutes)
    python benchmarks/bench_linear.py --quick    # small sizes, few rounds
    python benchmarks/bench_linear.py --force-gpu-mode   # smoke-test the GPU branch here

It writes ``benchmarks/results/<stem>.json`` (all numbers + machine description),
``<stem>.md`` (the tables) and ``<stem>.png`` (time ratio and throughput vs size),
where ``<stem>`` is ``linear_cpu``, ``linear_gpu``, ``linear_cpu_quick`` ... See
``benchmarks/README.md`` for the protocol. This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: import jaxext without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxext  # noqa: E402

sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402
import report  # noqa: E402
import torch_ref  # noqa: E402

Size3 = tuple[int, int, int]


@dataclasses.dataclass
class Settings:
    mode: str  # "cpu", "gpu" or "gpu-smoke" (the GPU branch forced on a CPU backend)
    quick: bool
    dtype: str
    linear_sizes: list[Size3]  # (batch, in_features, out_features)
    mlp_sizes: list[tuple[int, int]]  # (batch, width)
    mlp_depth: int
    mul_sizes: list[int]  # number of elements
    rounds: int
    min_rounds: int
    warmup: int
    target_s: float
    budget_s: float  # measured time allowed per size and timing group
    compile_repeats: int
    torch_compile: bool
    torch_device: str | None


def make_settings(args: argparse.Namespace) -> Settings:
    backend = jax.default_backend()
    if args.force_gpu_mode:
        mode = "gpu-smoke"
    elif backend == "gpu":
        mode = "gpu"
    else:
        mode = "cpu"
    if mode == "gpu":
        dtype = "bfloat16"
        linear = [(32, 64, 64), (1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192)]
        mlp = [(32, 64), (1024, 1024), (4096, 4096)]
        mul = [2**10, 2**20, 2**28]
    elif mode == "gpu-smoke":
        dtype = "bfloat16"
        linear = [(32, 64, 64), (256, 256, 256)]
        mlp = [(32, 64)]
        mul = [2**10, 2**16]
    else:
        dtype = "float32"
        linear = [(32, 64, 64), (128, 256, 256), (512, 512, 512), (1024, 1024, 1024)]
        linear.append((2048, 2048, 2048))
        mlp = [(32, 64), (256, 256), (1024, 1024)]
        mul = [2**10, 2**16, 2**22, 2**24]
    quick = args.quick or mode == "gpu-smoke"
    if quick:
        linear = linear[:3] if mode != "gpu" else [linear[0], linear[-1]]
        mlp = mlp[:2] if mode != "gpu" else [mlp[0], mlp[-1]]
        mul = [mul[0], mul[-1]] if mode != "cpu" else [mul[0], 2**20]
    if torch_ref.available() and mode == "gpu":
        import torch

        torch_device = "cuda" if torch.cuda.is_available() else None
    else:
        torch_device = "cpu" if torch_ref.available() else None
    torch_compile = args.torch_compile if args.torch_compile is not None else not quick
    return Settings(
        mode=mode,
        quick=quick,
        dtype=dtype,
        linear_sizes=linear,
        mlp_sizes=mlp,
        mlp_depth=3,
        mul_sizes=mul,
        rounds=args.rounds or (7 if quick else 60),
        min_rounds=3 if quick else 10,
        warmup=2 if quick else 3,
        target_s=0.01 if quick else 0.025,
        budget_s=4.0 if quick else 25.0,
        compile_repeats=args.compile_repeats or (3 if quick else 10),
        torch_compile=torch_compile and torch_device is not None,
        torch_device=torch_device,
    )


# -- helpers ------------------------------------------------------------------------


def _arrays(key: int, shapes: list[tuple[int, ...]], dtype: str) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(key), len(shapes))
    return [
        jax.random.normal(k, s, jnp.float32).astype(dtype)
        for k, s in zip(keys, shapes, strict=True)
    ]


def _memory(compiled: Any) -> dict[str, int | None]:
    stats = compiled.memory_analysis()
    out: dict[str, int | None] = {}
    for field in (
        "temp_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
        "peak_memory_in_bytes",
    ):
        try:
            out[field] = int(getattr(stats, field))
        except Exception:  # a field this jaxlib/backend does not report
            out[field] = None
    return out


def _residuals(fn: Callable[..., Any], *primals: Any) -> dict[str, Any]:
    """Arrays held by the closure ``jax.vjp`` returns: what the backward keeps alive.

    ``bytes`` sums them all; ``new_bytes`` leaves out those sharing a buffer with a
    primal input (references to inputs the caller holds anyway).
    """
    _, vjp_fn = jax.vjp(fn, *primals)
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(vjp_fn) if isinstance(leaf, jax.Array)]
    inputs = {_buffer(a) for a in jax.tree_util.tree_leaves(primals) if isinstance(a, jax.Array)}
    return {
        "bytes": int(sum(leaf.nbytes for leaf in leaves)),
        "new_bytes": int(sum(leaf.nbytes for leaf in leaves if _buffer(leaf) not in inputs)),
        "arrays": [f"{leaf.dtype}{list(leaf.shape)}" for leaf in leaves],
    }


def _buffer(array: jax.Array) -> Any:
    try:
        return array.unsafe_buffer_pointer() if array.nbytes else None
    except Exception:  # e.g. an array spread over several devices
        return id(array)


def _compile_times(
    makers: dict[str, Callable[[], Callable[..., Any]]],
    jit: Callable[[Callable[..., Any]], Any],
    args: tuple[Any, ...],
    repeats: int,
) -> dict[str, Any]:
    """Interleaved cold lower+compile times of freshly built functions."""
    names = list(makers)
    times: dict[str, dict[str, list[float]]] = {n: {"lower": [], "compile": []} for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            jax.clear_caches()
            gc.collect()
            fn = makers[name]()  # a new function object: no cache can serve it
            t0 = time.perf_counter()
            lowered = jit(fn).lower(*args)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            times[name]["lower"].append(t1 - t0)
            times[name]["compile"].append(t2 - t1)
    totals = {n: [a + b for a, b in zip(*times[n].values(), strict=True)] for n in names}
    out: dict[str, Any] = {"repeats": repeats}
    for name in names:
        out[name] = {
            "lower_ms": benchlib.median(times[name]["lower"]) * 1e3,
            "compile_ms": benchlib.median(times[name]["compile"]) * 1e3,
            "total_ms": benchlib.median(totals[name]) * 1e3,
        }
    out["ratio"] = benchlib.ratio_summary(totals[names[0]], totals[names[1]])
    return out


def _time_groups(
    s: Settings,
    ref: str,
    jax_fns: dict[str, Callable[[], Any]],
    torch_fns: dict[str, Callable[[], Any]],
    work: dict[str, float],
) -> dict[str, Any]:
    """Times the JAX contenders together, then ``ref`` against the PyTorch ones.

    Two separate interleaved groups: the JAX-vs-JAX comparison (the <= 1.02 target)
    never has a PyTorch call right before one of its two sides, which would bias it.
    ``work[name]`` is the work of one call (e.g. GFLOP); rates are work per second.
    """
    kw = dict(
        rounds=s.rounds,
        warmup=s.warmup,
        target_s=s.target_s,
        budget_s=s.budget_s,
        min_rounds=s.min_rounds,
    )
    g1 = benchlib.interleaved_times(jax_fns, **kw)
    out: dict[str, Any] = {"rounds": {"jax": g1["rounds"]}, "inner": dict(g1["inner"])}
    out["time"] = {n: benchlib.time_summary(ts, work[n]) for n, ts in g1["times"].items()}
    out["ratio"] = {
        f"{ref}/{n}": benchlib.ratio_summary(g1["times"][ref], ts)
        for n, ts in g1["times"].items()
        if n not in (ref, "matmul")
    }
    if torch_fns:
        g2 = benchlib.interleaved_times({ref: jax_fns[ref], **torch_fns}, **kw)
        out["rounds"]["torch"] = g2["rounds"]
        out["inner"].update({n: g2["inner"][n] for n in torch_fns})
        out["ref_time_in_torch_group"] = benchlib.time_summary(g2["times"][ref], work[ref])
        for n in torch_fns:
            out["time"][n] = benchlib.time_summary(g2["times"][n], work[n])
            out["ratio"][f"{ref}/{n}"] = benchlib.ratio_summary(g2["times"][ref], g2["times"][n])
    return out


# -- jaxext.linear vs plain autodiff vs PyTorch ---------------------------------------


def _linear_loss(kind: str) -> Callable[..., jax.Array]:
    if kind == "jaxext":

        def loss(x, w, b, ct):
            return jnp.sum(jaxext.linear(x, w, b) * ct)

    else:

        def loss(x, w, b, ct):
            return jnp.sum((x @ w.T + b) * ct)

    return loss


def _linear_vg(kind: str) -> Callable[..., Any]:
    return jax.value_and_grad(_linear_loss(kind), argnums=(0, 1, 2))


def bench_linear(s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    torch_compile_status: dict[str, Any] = {"requested": s.torch_compile, "ok": None}
    for batch, fin, fout in s.linear_sizes:
        x, w, b, ct = _arrays(0, [(batch, fin), (fout, fin), (fout,), (batch, fout)], s.dtype)
        flops = 6.0 * batch * fin * fout  # forward, grad_x, grad_w matmuls
        jx, jp = jax.jit(_linear_vg("jaxext")), jax.jit(_linear_vg("plain"))
        fns = {
            "jaxext": benchlib.blocking(jx, x, w, b, ct),
            "jax_autodiff": benchlib.blocking(jp, x, w, b, ct),
        }
        row: dict[str, Any] = {"batch": batch, "in": fin, "out": fout, "flops": flops}
        row["loadavg_before"] = benchlib.loadavg()
        row["max_rel_err_vs_autodiff"] = benchlib.max_rel_err(jx(x, w, b, ct), jp(x, w, b, ct))
        if s.mode != "cpu":
            mm = jax.jit(lambda x, w: x @ w.T)
            fns["matmul"] = benchlib.blocking(mm, x, w)
        torch_fns = {}
        if s.torch_device is not None:
            torch_fns = _torch_linear_contenders(s, (x, w, b, ct), row, torch_compile_status, log)
        log(
            f"linear {batch}x{fin}x{fout}: timing {', '.join(fns)} | jaxext, {', '.join(torch_fns)}"
        )
        gflop = {n: flops / 1e9 for n in [*fns, *torch_fns]}
        gflop["matmul"] = 2.0 * batch * fin * fout / 1e9  # one matmul: the GPU-mode reference
        row.update(_time_groups(s, "jaxext", fns, torch_fns, gflop))
        if "matmul" in row["time"]:
            # Throughput of the fwd+bwd (6 flops/MAC-triple) relative to one plain matmul.
            row["efficiency_vs_matmul"] = {
                name: row["time"][name]["rate"] / row["time"]["matmul"]["rate"]
                for name in ("jaxext", "jax_autodiff")
            }
        r = row["ratio"]["jaxext/jax_autodiff"]
        log(f"  jaxext/autodiff median {r['median']:.3f} [{r['p25']:.3f}, {r['p75']:.3f}]")
        rows.append(row)
    return {"rows": rows, "torch_compile": torch_compile_status}


def _torch_linear_contenders(
    s: Settings,
    jax_args: tuple[jax.Array, ...],
    row: dict[str, Any],
    status: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Callable[[], Any]]:
    x, w, b, ct = (
        torch_ref.to_torch(a, s.torch_device, requires_grad=i < 3) for i, a in enumerate(jax_args)
    )
    fns = {
        "torch_function": torch_ref.linear_step("function", x, w, b, ct, s.torch_device),
        "torch_F.linear": torch_ref.linear_step("F.linear", x, w, b, ct, s.torch_device),
    }
    ref = jax.jit(_linear_vg("plain"))(*jax_args)[1]
    row["torch_max_rel_err_vs_jax"] = {
        name: benchlib.max_rel_err([t.float().cpu().numpy() for t in fn()], ref)
        for name, fn in fns.items()
    }
    if s.torch_compile and status["ok"] is not False:
        try:
            start = time.perf_counter()
            step = torch_ref.linear_step("compile", x, w, b, ct, s.torch_device)
            step()
            status.setdefault("first_call_s", {})[f"{row['batch']}x{row['in']}x{row['out']}"] = (
                time.perf_counter() - start
            )
            status["ok"] = True
            fns["torch_compile"] = step
        except Exception as err:  # report why torch.compile is unusable here
            status["ok"] = False
            status["error"] = f"{type(err).__name__}: {err}"[:2000]
            status["traceback_tail"] = traceback.format_exc()[-2000:]
            log(f"  torch.compile failed: {status['error'][:200]}")
    return fns


def linear_costs(s: Settings, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Compile time, compiled temp memory and saved residuals: jaxext vs plain autodiff."""
    rows = []
    for batch, fin, fout in s.linear_sizes:
        log(f"linear {batch}x{fin}x{fout}: compile time / memory / residuals")
        x, w, b, ct = _arrays(0, [(batch, fin), (fout, fin), (fout,), (batch, fout)], s.dtype)
        args = (x, w, b, ct)
        row: dict[str, Any] = {"batch": batch, "in": fin, "out": fout}
        row["compile"] = _compile_times(
            {"jaxext": lambda: _linear_vg("jaxext"), "jax_autodiff": lambda: _linear_vg("plain")},
            jax.jit,
            args,
            s.compile_repeats,
        )
        row["memory"] = {
            name: _memory(jax.jit(_linear_vg(kind)).lower(*args).compile())
            for name, kind in (("jaxext", "jaxext"), ("jax_autodiff", "plain"))
        }
        row["residuals"] = {
            "jaxext": _residuals(jaxext.linear, x, w, b),
            "jax_autodiff": _residuals(lambda x, w, b: x @ w.T + b, x, w, b),
        }
        if s.torch_device is not None:
            tx, tw, tb = (
                torch_ref.to_torch(a, s.torch_device, requires_grad=True) for a in (x, w, b)
            )
            row["torch_saved_bytes"] = {
                "torch_function": torch_ref.saved_bytes("function", tx, tw, tb),
                "torch_F.linear": torch_ref.saved_bytes("F.linear", tx, tw, tb),
            }
        rows.append(row)
    return rows


# -- MLP training step: jaxext.nnx.Linear vs flax.nnx.Linear --------------------------


class MLP(nnx.Module):
    """``depth`` square Linear layers with ReLU between them."""

    def __init__(self, width: int, depth: int, linear_cls: Any, dtype: str, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [linear_cls(width, width, param_dtype=dtype, rngs=rngs) for _ in range(depth)]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.relu(x)
        return x


def _mse(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x).astype(jnp.float32) - y.astype(jnp.float32)) ** 2)


def _make_train_step() -> Callable[..., jax.Array]:
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_mse)(model, x, y)
        optimizer.update(model, grads)
        return loss

    return train_step


def _mlp_pair(s: Settings, width: int) -> dict[str, tuple[MLP, nnx.Optimizer]]:
    import jaxext.nnx

    out = {}
    for name, cls in (("jaxext.nnx", jaxext.nnx.Linear), ("flax.nnx", nnx.Linear)):
        model = MLP(width, s.mlp_depth, cls, s.dtype, nnx.Rngs(0))  # same seed: same weights
        out[name] = (model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    return out


def bench_mlp(s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    try:
        import jaxext.nnx  # noqa: F401
    except ImportError as err:
        return {"skipped": f"jaxext.nnx unavailable: {err}", "rows": []}
    rows, failures = [], []
    for batch, width in s.mlp_sizes:
        try:
            rows.append(_bench_mlp_size(s, batch, width, log))
        except Exception as err:  # recorded in the results, never hidden
            tb = traceback.extract_tb(err.__traceback__)
            where = f" (raised at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
            msg = f"{type(err).__name__}: {err}".strip() + where
            log(f"  MLP {batch}x{width} FAILED: {msg[:300]}")
            failures.append(
                {
                    "batch": batch,
                    "width": width,
                    "error": msg[:2000],
                    "traceback_tail": traceback.format_exc()[-3000:],
                }
            )
    return {"rows": rows, "failures": failures}


def _bench_mlp_size(
    s: Settings, batch: int, width: int, log: Callable[[str], None]
) -> dict[str, Any]:
    x, y = _arrays(1, [(batch, width), (batch, width)], s.dtype)
    d = s.mlp_depth
    # Forward 2*B*W^2 per layer; backward 4*B*W^2 per layer, minus grad_x of layer 1.
    flops = 2.0 * batch * width * width * (3 * d - 1)
    row: dict[str, Any] = {"batch": batch, "width": width, "depth": d, "flops": flops}
    row["loadavg_before"] = benchlib.loadavg()
    pair = _mlp_pair(s, width)
    # Same weights: the losses and parameter gradients must agree before timing.
    (mj, _), (mf, _) = pair["jaxext.nnx"], pair["flax.nnx"]
    row["init_loss"] = {"jaxext.nnx": float(_mse(mj, x, y)), "flax.nnx": float(_mse(mf, x, y))}
    gj, gf = (nnx.state(nnx.grad(_mse)(m, x, y), nnx.Param) for m in (mj, mf))
    row["max_rel_err_grads"] = benchlib.max_rel_err(gj, gf)
    fns: dict[str, Callable[[], Any]] = {}
    for name, (model, opt) in pair.items():
        fns[name] = benchlib.blocking(nnx.jit(_make_train_step()), model, opt, x, y)
    torch_fns: dict[str, Callable[[], Any]] = {}
    if s.torch_device is not None:
        tx, ty = (torch_ref.to_torch(a, s.torch_device) for a in (x, y))
        torch_fns["torch_nn.Linear"] = torch_ref.mlp_step(width, d, tx, ty, s.torch_device)
    log(f"mlp {batch}x{width}x{d}: timing {', '.join(fns)} | jaxext.nnx, {', '.join(torch_fns)}")
    gflop = {n: flops / 1e9 for n in [*fns, *torch_fns]}
    row.update(_time_groups(s, "jaxext.nnx", fns, torch_fns, gflop))
    r = row["ratio"]["jaxext.nnx/flax.nnx"]
    log(f"  jaxext.nnx/flax.nnx median {r['median']:.3f} [{r['p25']:.3f}, {r['p75']:.3f}]")
    row.update(_mlp_costs(s, batch, width, x, y))
    return row


def _mlp_costs(s: Settings, batch: int, width: int, x: jax.Array, y: jax.Array) -> dict:
    """Compile time, compiled temp memory and residuals of the MLP train step / loss."""
    pair = _mlp_pair(s, width)
    names = list(pair)
    lower: dict[str, list[float]] = {n: [] for n in names}
    total: dict[str, list[float]] = {n: [] for n in names}
    for r in range(s.compile_repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            model, opt = pair[name]
            jax.clear_caches()
            gc.collect()
            fn = _make_train_step()  # a new function object: no cache can serve it
            t0 = time.perf_counter()
            lowered = nnx.jit(fn).lower(model, opt, x, y)
            t1 = time.perf_counter()
            lowered.compile()
            t2 = time.perf_counter()
            lower[name].append(t1 - t0)
            total[name].append(t2 - t0)
    out: dict[str, Any] = {}
    out["compile"] = {
        "repeats": s.compile_repeats,
        **{
            n: {
                "lower_ms": benchlib.median(lower[n]) * 1e3,
                "compile_ms": benchlib.median(
                    [t - lo for t, lo in zip(total[n], lower[n], strict=True)]
                )
                * 1e3,
                "total_ms": benchlib.median(total[n]) * 1e3,
            }
            for n in names
        },
        "ratio": benchlib.ratio_summary(total["jaxext.nnx"], total["flax.nnx"]),
        "lower_ratio": benchlib.ratio_summary(lower["jaxext.nnx"], lower["flax.nnx"]),
    }
    out["memory"] = {
        name: _memory(nnx.jit(_make_train_step()).lower(m, o, x, y).compile())
        for name, (m, o) in pair.items()
    }
    out["residuals"] = {}
    for name, (m, _) in pair.items():
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        def loss_of_params(p, graphdef=graphdef, rest=rest):
            return _mse(nnx.merge(graphdef, p, rest), x, y)

        out["residuals"][name] = _residuals(loss_of_params, params)
    return out


# -- mul_constant: bandwidth against plain jnp and a measured copy ---------------------


def bench_mul_constant(s: Settings, log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for n in s.mul_sizes:
        (x, ct) = _arrays(2, [(n,), (n,)], s.dtype)

        def bwd(op):
            return jax.jit(lambda primal, cotangent: jax.vjp(op, primal)[1](cotangent)[0])

        def jaxext_op(x):
            return jaxext.mul_constant(x, 2.0)

        def plain_op(x):
            return x * 2.0

        fns = {
            "jaxext_fwd": benchlib.blocking(jax.jit(jaxext_op), x),
            "jnp_fwd": benchlib.blocking(jax.jit(plain_op), x),
            "jaxext_bwd": benchlib.blocking(bwd(jaxext_op), x, ct),
            "jnp_bwd": benchlib.blocking(bwd(plain_op), x, ct),
            "copy": benchlib.blocking(jax.jit(jnp.copy), x),
        }
        log(f"mul_constant n={n}: timing {', '.join(fns)}")
        res = benchlib.interleaved_times(
            fns,
            rounds=s.rounds,
            warmup=s.warmup,
            target_s=s.target_s,
            budget_s=s.budget_s / 2,
            min_rounds=s.min_rounds,
        )
        times = res["times"]
        moved = 2.0 * x.nbytes  # one read + one write of n elements, for every contender
        row: dict[str, Any] = {"n": n, "bytes_moved": moved, "rounds": res["rounds"]}
        row["time"] = {k: benchlib.time_summary(v, moved / 1e9) for k, v in times.items()}
        row["ratio"] = {
            "jaxext_fwd/jnp_fwd": benchlib.ratio_summary(times["jaxext_fwd"], times["jnp_fwd"]),
            "jaxext_bwd/jnp_bwd": benchlib.ratio_summary(times["jaxext_bwd"], times["jnp_bwd"]),
        }
        row["fraction_of_copy"] = {
            k: row["time"][k]["rate"] / row["time"]["copy"]["rate"]
            for k in ("jaxext_fwd", "jaxext_bwd", "jnp_fwd", "jnp_bwd")
        }
        rows.append(row)
    return rows


# -- targets --------------------------------------------------------------------------


def evaluate_targets(s: Settings, results: dict[str, Any]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: str, ok: bool | None) -> None:
        checks.append({"target": name, "value": value, "limit": limit, "met": ok})

    for row in results["linear"]["rows"]:
        label = f"{row['batch']}x{row['in']}x{row['out']}"
        r = row["ratio"]["jaxext/jax_autodiff"]["median"]
        add(f"linear fwd+bwd time jaxext/autodiff {label}", r, "<= 1.02", r <= 1.02)
        if s.mode != "cpu":
            eff = row["efficiency_vs_matmul"]["jaxext"]
            add(f"linear fwd+bwd rate / matmul rate {label}", eff, ">= 0.85", eff >= 0.85)
    for row in results["linear_costs"]:
        label = f"{row['batch']}x{row['in']}x{row['out']}"
        c = row["compile"]["ratio"]["median"]
        add(f"linear compile time jaxext/autodiff {label}", c, "<= 1.10", c <= 1.10)
        tj, ta = (row["memory"][k]["temp_size_in_bytes"] for k in ("jaxext", "jax_autodiff"))
        add(f"linear temp bytes jaxext - autodiff {label}", tj - ta, "== 0", tj == ta)
        rj, ra = (row["residuals"][k]["bytes"] for k in ("jaxext", "jax_autodiff"))
        add(f"linear residual bytes jaxext - autodiff {label}", rj - ra, "== 0", rj == ra)
    for row in results["mlp"].get("rows", []):
        label = f"{row['batch']}x{row['width']}x{row['depth']}"
        r = row["ratio"]["jaxext.nnx/flax.nnx"]["median"]
        add(f"MLP step time jaxext.nnx/flax.nnx {label}", r, "<= 1.02", r <= 1.02)
        c = row["compile"]["ratio"]["median"]
        add(f"MLP compile time jaxext.nnx/flax.nnx {label}", c, "<= 1.10", c <= 1.10)
        tj, tf = (row["memory"][k]["temp_size_in_bytes"] for k in ("jaxext.nnx", "flax.nnx"))
        add(f"MLP temp bytes jaxext.nnx - flax.nnx {label}", tj - tf, "== 0", tj == tf)
        rj, rf = (row["residuals"][k]["bytes"] for k in ("jaxext.nnx", "flax.nnx"))
        add(f"MLP residual bytes jaxext.nnx - flax.nnx {label}", rj - rf, "== 0", rj == rf)
    for fail in results["mlp"].get("failures", []):
        add(f"MLP step runs at {fail['batch']}x{fail['width']}", None, "no error", False)
    if s.mode != "cpu" and results["mul_constant"]:
        row = results["mul_constant"][-1]
        for k in ("jaxext_fwd", "jaxext_bwd"):
            f = row["fraction_of_copy"][k]
            add(f"mul_constant {k} GB/s / copy GB/s n={row['n']}", f, ">= 0.85", f >= 0.85)
    return checks


# -- main -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument(
        "--force-gpu-mode",
        action="store_true",
        help="run the GPU branch (bf16, matmul/copy references) with small sizes on any backend",
    )
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds per size")
    parser.add_argument("--compile-repeats", type=int, default=None)
    tc = parser.add_mutually_exclusive_group()
    tc.add_argument("--torch-compile", dest="torch_compile", action="store_true", default=None)
    tc.add_argument("--no-torch-compile", dest="torch_compile", action="store_false")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    parser.add_argument("--note", default="", help="free text stored with the results")
    parser.add_argument(
        "--only",
        choices=["linear", "mlp", "mul_constant"],
        action="append",
        help="run only these sections (repeatable); default: all",
    )
    args = parser.parse_args(argv)
    s = make_settings(args)
    sections = set(args.only or ["linear", "mlp", "mul_constant"])
    stem = {"cpu": "linear_cpu", "gpu": "linear_gpu", "gpu-smoke": "linear_gpu_smoke"}[s.mode]
    if s.quick and s.mode != "gpu-smoke":
        stem += "_quick"
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    log(f"mode={s.mode} quick={s.quick} dtype={s.dtype} torch={s.torch_device}")
    results: dict[str, Any] = {
        "machine": benchlib.machine_info(),
        "settings": dataclasses.asdict(s),
        "note": args.note,
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
    }
    empty: dict[str, Any] = {"rows": [], "torch_compile": {"requested": False, "ok": None}}
    results["linear"] = bench_linear(s, log) if "linear" in sections else empty
    results["linear_costs"] = linear_costs(s, log) if "linear" in sections else []
    results["mlp"] = bench_mlp(s, log) if "mlp" in sections else {"rows": []}
    results["mul_constant"] = bench_mul_constant(s, log) if "mul_constant" in sections else []
    results["targets"] = evaluate_targets(s, results)
    results["machine"]["loadavg_end"] = benchlib.loadavg()
    results["wall_s"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    md = report.markdown(results)
    (args.out / f"{stem}.md").write_text(md)
    report.plot(results, args.out / f"{stem}.png")
    print(md)
    log(f"wrote {json_path}, {stem}.md, {stem}.png")
    return results


if __name__ == "__main__":
    main()
