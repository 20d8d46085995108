"""opcheck's tables for JAX's own Pallas ops built on ``jax.custom_vjp``, and their buggy twins
(issue #43).

``jax.custom_vjp = jaxext.custom_vjp`` is swapped in before JAX's Pallas ops are imported (as
``tests/_libraries_worker.py`` does for other libraries), and each op runs on CPU in interpret
mode at tiny shapes (TPU kernels in ``pltpu.force_tpu_interpret_mode()``, Pallas's TPU
interpreter). Each op is judged against JAX's own plain-JAX reference where JAX ships one
(``reference=``: the kernel's values, VJPs and JVPs against autodiff of the reference in
float64). Interpret mode is how this script runs a kernel on a CPU, not a property of JAX's op,
so the accelerator platform rows (``platform_cuda``, ``platform_rocm``, ``platform_tpu``) lower
the op as compiled (no interpret mode, outside the TPU interpreter); ``platform_cpu`` lowers the
interpreted op. A GPU kernel's ``platform_tpu`` and a TPU kernel's ``platform_cuda`` and
``platform_rocm`` FAIL: Triton kernels do not lower for TPU, Mosaic TPU kernels not for GPU
(true properties of the kernels, printed but not counted against them). Flash and splash
attention's Mosaic kernels lower for TPU at float32 and bfloat16 only with ``jax_enable_x64``
off (under x64 Pallas's own verification rejects them, "please file a bug"), and splash
attention's JVP (its backward batched) not at all, for the same internal error: JAX's bugs,
noted in the row, not the op's FAILs.

What the tables show (``benchmarks/results/pallas_ops_tables_cpu.md``, the latest run):

- ``gpu_rms_norm``, ``gpu_layer_norm``, ``gpu_mha``, ``tpu_mha_reference``, ``tpu_gmm``: no FAIL
  on the platforms their kernels are written for; ``gradcheck`` and ``jvp`` PASS against the
  reference. The four second-order rows SKIP with one reason each: the backward is a Pallas
  kernel that JAX cannot differentiate again (plain JAX, the custom rules stripped, refuses it
  the same way), or JAX's op raises ``NotImplementedError`` itself when differentiated again
  (``mha_reference``'s residual call; ``gmm``: the interpreter's "dynamic grid bounds").
  ``gpu_mha`` and ``tpu_gmm`` have no float64 path (a float32 loop carry; a kernel that takes
  bfloat16 or float32 only), so every row runs in float32 and ``low_precision`` SKIPs.
- ``tpu_gmm`` runs with ``jax_enable_x64`` off inside the op, and its rows that need the
  kernel batched (``jvp``, ``jvp_vjp``, ``vmap``: forward mode is derived from the backward by
  batching it) or a backward traced later under x64 (``jit_reuse``) SKIP naming the TPU
  interpreter's own defects: under ``jax.vmap`` its batched grid is zipped with
  ``dimension_semantics`` one shorter (``safe_zip`` raises, with plain ``jax.custom_vjp`` too),
  and under x64 it hands the ``tgmm`` kernel an int64 value where the kernel's jaxpr says int32
  (the compiled kernel lowers for TPU under x64: its ``platform_tpu`` row). ``checkpoint`` and
  ``export`` SKIP: JAX's checkpoint and serialization refuse the interpreter's host callbacks;
  ``export_symbolic``: the kernel needs rows divisible by its tile.
- ``tpu_flash_attention`` and ``tpu_splash_attention`` run in the TPU interpreter, one grid step
  a host callback, at the kernels' smallest blocks (a sequence of 128): their whole battery
  took over 30 minutes there, so they run the rows in ``HEAVY_CHECKS`` (first-order gradients
  against the reference, ``jit``, ``vmap`` and the platform rows), a minute each. Flash
  attention's ``jvp``, ``jvp_vjp`` and ``vmap`` SKIP for the interpreter's batched-grid
  defect; splash attention has no forward mode through ``jaxext`` (JAX cannot transpose a
  ``pallas_call``, and evaluating its backward once per output element would take 16384
  passes, over ``forward_mode_max_outputs``), and its ``vmap`` SKIPs as plain JAX's.
- Every twin, JAX's own forward and backward functions in a ``jaxext.custom_vjp`` whose
  backward perturbs them (``NAME/scaled_gradient``: one gradient 1% off; ``NAME/missing_term``:
  a term of the backward dropped; ``NAME/swapped_residuals``: two residuals swapped), FAILs
  ``gradcheck`` and ``jvp`` against the reference (``gmm``'s and flash attention's twins:
  ``gradcheck``, their ``jvp`` SKIPs for the interpreter's batched-grid defect; splash
  attention's: ``gradcheck``, their ``jvp`` SKIPs "no forward mode" as the op's does), while
  ``NAME/faithful``, the same wrapping with JAX's backward unchanged, passes them: the FAILs
  are the perturbations'. Flash and splash attention's twins take seconds each (three rows).

Usage: ``python benchmarks/pallas_ops_tables.py [--twins] [--json PATH] [--markdown PATH]
[--checks CHECK ...] [--] [NAME ...]`` (default:
every op; names: ``gpu_rms_norm``, ``gpu_layer_norm``, ``gpu_mha``, ``tpu_flash_attention``,
``tpu_mha_reference``, ``tpu_splash_attention``, ``tpu_gmm``; ``NAME/KIND``, say
``tpu_flash_attention/missing_term``, runs that twin alone, without the op's own table).
``--twins`` also runs each named op's buggy twins (where it has them); ``--json`` writes every
table's rows (``tests/test_pallas_ops.py`` reads it), ``--markdown`` the tables as a results page;
``--checks`` runs only those rows. Slow on CPU: one to two minutes per op on a loaded 2-core
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

import jaxext

jax.custom_vjp = jaxext.custom_vjp  # before any Pallas op below is imported
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

ACCELERATORS = ("cuda", "rocm", "tpu")
# The TPU interpreter runs a kernel's grid one host callback per step: flash and splash
# attention's whole battery takes tens of minutes there, so they run these rows.
HEAVY_CHECKS = ("forward_rule", "gradcheck", "jvp", "jvp_vjp", "jit", "vmap", "platform_cpu",
                "platform_cuda", "platform_rocm", "platform_tpu")  # fmt: skip
# The rows that judge the gradient (a twin must FAIL them).
GRADIENT_CHECKS = ("gradcheck", "jvp")
# The twins: JAX's backward as it is (a control), one gradient 1% off, a term dropped, two
# residuals swapped.
TWINS = ("faithful", "scaled_gradient", "missing_term", "swapped_residuals")


@dataclasses.dataclass
class Case:
    """One op: ``op`` runs in interpret mode, ``kernel`` is the op compiled for ``targets``
    (the accelerators its kernels are written for); ``twin`` builds its buggy twins."""

    op: Callable[..., Any]
    kernel: Callable[..., Any]
    args: tuple
    reference: Callable[..., Any] | None
    targets: tuple[str, ...]
    tpu_interpreter: bool = False
    checks: tuple[str, ...] | None = None
    twins: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)


def _normal(seed, shape, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def _twins(fwd: Callable, bwd: Callable, perturbed: dict[str, Callable]) -> dict[str, Callable]:
    """``{kind: op}``: JAX's ``fwd`` and ``bwd`` (``bwd(res, g)`` -> gradients) in a
    ``jaxext.custom_vjp`` whose backward is ``perturbed[kind](res, g)`` (built on ``bwd``)."""

    def make(backward):
        @jaxext.custom_vjp
        def twin(*args):
            return fwd(*args)[0]

        twin.defvjp(fwd, backward)
        return twin

    # The control: JAX's backward unchanged, whose table must be clean.
    return {kind: make(backward) for kind, backward in {"faithful": bwd, **perturbed}.items()}


def _norm_twins(m, fwd_name, bwd_name, with_mean):
    """The twins of a GPU normalization (``rms_norm`` or ``layer_norm``)."""
    statics = (None, 3, 1e-5, "triton", True)

    def fwd(x, w, b):
        return getattr(m, fwd_name)(x, w, b, *statics)

    def bwd(res, g):
        return getattr(m, bwd_name)(*statics, res, g)

    def scaled(res, g):  # the weight's gradient 1% too large
        dx, dw, db = bwd(res, g)
        return dx, 1.01 * dw, db

    def missing(res, g):  # dx without the term through the statistics: x at its mean
        x, *rest = res
        centred = jnp.broadcast_to(res[3][..., None], x.shape) if with_mean else 0 * x
        dx, _, _ = bwd((centred, *rest), g)
        return dx, *bwd(res, g)[1:]

    def swapped(res, g):  # layer_norm: mean and rstd swapped; rms_norm: weight and bias
        if with_mean:
            x, w, b, mean, rstd = res
            return bwd((x, w, b, rstd, mean), g)
        x, w, b, rstd = res
        return bwd((x, b, w, rstd), g)

    return _twins(
        fwd, bwd, {"scaled_gradient": scaled, "missing_term": missing, "swapped_residuals": swapped}
    )


def gpu_rms_norm() -> Case:
    from jax.experimental.pallas.ops.gpu import rms_norm as m

    def op(x, w, b):
        return m.rms_norm(x, w, b, None, 3, 1e-5, "triton", True)

    def kernel(x, w, b):
        return m.rms_norm(x, w, b, None, 3, 1e-5, "triton", False)

    args = (_normal(0, (2, 3, 8)), 1 + _normal(1, (8,), 0.1), _normal(2, (8,), 0.1))
    twins = _norm_twins(m, "rms_norm_forward", "rms_norm_backward", False)
    return Case(op, kernel, args, m.rms_norm_reference, ("cuda", "rocm"), twins=twins)


def gpu_layer_norm() -> Case:
    from jax.experimental.pallas.ops.gpu import layer_norm as m

    def op(x, w, b):
        return m.layer_norm(x, w, b, None, 3, 1e-5, "triton", True)

    def kernel(x, w, b):
        return m.layer_norm(x, w, b, None, 3, 1e-5, "triton", False)

    args = (_normal(0, (2, 3, 8)), 1 + _normal(1, (8,), 0.1), _normal(2, (8,), 0.1))
    twins = _norm_twins(m, "layer_norm_forward", "layer_norm_backward", True)
    return Case(op, kernel, args, m.layer_norm_reference, ("cuda", "rocm"), twins=twins)


def _attention_twins(fwd, bwd, out_at, swap_at):
    """Attention twins: residuals ``(..., q, k, ...)`` at ``swap_at``, the output at
    ``out_at``; ``bwd`` returns ``(dq, dk, dv, *rest)``."""

    def scaled(res, g):  # dv 1% too large
        dq, dk, dv, *rest = bwd(res, g)
        return dq, dk, 1.01 * dv, *rest

    def missing(res, g):  # the softmax backward without its row-sum term (sum(o * do) = 0)
        res = list(res)
        res[out_at] = jnp.zeros_like(res[out_at])
        return bwd(tuple(res), g)

    def swapped(res, g):  # q and k swapped
        res = list(res)
        i, j = swap_at
        res[i], res[j] = res[j], res[i]
        return bwd(tuple(res), g)

    perturbed = {"scaled_gradient": scaled, "missing_term": missing, "swapped_residuals": swapped}
    return _twins(fwd, bwd, perturbed)


def _tpu_layout_reference(q, k, v, causal=False):
    """JAX's plain-JAX attention (``mha_reference_no_custom_vjp``), batch, heads, sequence,
    head dim."""
    from jax.experimental.pallas.ops.tpu import flash_attention as f

    return f.mha_reference_no_custom_vjp(q, k, v, causal=causal)


def gpu_mha() -> Case:
    from jax.experimental.pallas.ops.gpu import attention as m

    sizes = m.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16,
                         block_q_dq=16, block_kv_dq=16)  # fmt: skip
    statics = (1.0, False, sizes, "triton", None, 2, None)  # sm_scale ... grid

    def op(q, k, v):
        return m.mha(q, k, v, None, block_sizes=sizes, interpret=True, backward_pass_impl="triton")

    def kernel(q, k, v):
        return m.mha(q, k, v, None, block_sizes=sizes, backward_pass_impl="triton")

    def reference(q, k, v):  # batch, sequence, heads, head dim
        heads_first = [a.swapaxes(1, 2) for a in (q, k, v)]
        return _tpu_layout_reference(*heads_first).swapaxes(1, 2)

    def fwd(q, k, v):
        return m._mha_forward(q, k, v, None, *statics, True, False, False)

    def bwd(res, g):
        return m._mha_backward(*statics, True, False, False, res, g)[:3]  # no segment ids

    shape = (1, 16, 1, 16)  # batch, sequence, heads, head dim
    args = (_normal(0, shape, 0.5), _normal(1, shape, 0.5), _normal(2, shape))
    twins = _attention_twins(fwd, bwd, out_at=4, swap_at=(0, 1))  # (q, k, v, segments, o, lse)
    return Case(op, kernel, args, reference, ("cuda", "rocm"), twins=twins)


def tpu_mha_reference() -> Case:
    from jax.experimental.pallas.ops.tpu import flash_attention as m

    def op(q, k, v):
        return m.mha_reference(q, k, v, None)

    statics = (False, m.DEFAULT_MASK_VALUE, 1.0, False)  # causal, mask, sm_scale, residuals

    def fwd(q, k, v):
        return m._mha_reference_fwd(q, k, v, None, None, *statics)

    def bwd(res, g):
        return m._mha_reference_bwd(*statics, res, g)[:3]

    shape = (1, 1, 8, 8)
    args = (_normal(0, shape, 0.5), _normal(1, shape, 0.5), _normal(2, shape))
    twins = _attention_twins(fwd, bwd, out_at=5, swap_at=(0, 1))  # (q, k, v, ab, seg, o, l, m)
    return Case(op, op, args, _tpu_layout_reference, ACCELERATORS, twins=twins)  # plain JAX


def tpu_flash_attention() -> Case:
    from jax.experimental.pallas.ops.tpu import flash_attention as m

    blocks = m.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1,
                          block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128,
                          block_q_dkv=128, block_k_major_dq=128, block_k_dq=128,
                          block_q_dq=128)  # fmt: skip

    def op(q, k, v):
        return m.flash_attention(q, k, v, block_sizes=blocks)  # 128: the kernel's smallest

    statics = (False, False, 1.0, blocks, False)  # residuals, causal, sm_scale, blocks, debug

    def fwd(q, k, v):
        return m._flash_attention_fwd(q, k, v, None, None, *statics)

    def bwd(res, g):
        return m._flash_attention_bwd(*statics, res, g)[:3]  # no bias, no segment ids

    shape = (1, 1, 128, 8)  # batch, heads, sequence, head dim
    args = (_normal(0, shape, 0.5), _normal(1, shape, 0.5), _normal(2, shape))
    twins = _attention_twins(fwd, bwd, out_at=5, swap_at=(0, 1))  # (q, k, v, ab, seg, o, l, m)
    return Case(op, op, args, _tpu_layout_reference, ("tpu",), True, HEAVY_CHECKS, twins)


# ``_splash_attention_fwd``'s and ``_splash_attention_bwd``'s static arguments, in order.
_SPLASH_STATICS = ("save_residuals", "mask_value", "is_mqa", "block_sizes",
                   "residual_checkpoint_name", "mask_function", "attn_logits_soft_cap",
                   "interpret")  # fmt: skip


def tpu_splash_attention() -> Case:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as m

    heads, length, dim = 1, 128, 128  # the kernel's smallest blocks
    mask = np.tril(np.ones((heads, length, length), bool))
    interpreted = m.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=True)
    compiled = m.make_splash_mha(mask, head_shards=1, q_seq_shards=1)

    def op(q, k, v):
        return interpreted(q, k, v)

    def kernel(q, k, v):
        return compiled(q, k, v)

    def reference(q, k, v):
        return _tpu_layout_reference(q[None], k[None], v[None], causal=True)[0]

    # The twins call JAX's forward and backward functions with the kernel's own mask
    # information and options (``interpreted``'s), as ``_splash_attention`` does.
    infos = (interpreted.fwd_mask_info, interpreted.dq_mask_info, interpreted.dkv_mask_info)
    options = dict(interpreted.kwargs, save_residuals=False)
    statics = tuple(options[name] for name in _SPLASH_STATICS)

    def fwd(q, k, v):
        return m._splash_attention_fwd(*infos, q, k, v, None, None, *statics)

    def bwd(res, g):
        return m._splash_attention_bwd(*statics, res, g)[3:6]  # dq, dk, dv

    shape = (heads, length, dim)
    args = (_normal(0, shape, 0.1), _normal(1, shape, 0.1), _normal(2, shape))
    # residuals (q, k, v, segment ids, sinks, o, logsumexp, dq mask info, dkv mask info)
    twins = _attention_twins(fwd, bwd, out_at=5, swap_at=(0, 1))
    return Case(op, kernel, args, reference, ("tpu",), True, HEAVY_CHECKS, twins)


def tpu_gmm() -> Case:
    from jax.experimental.pallas.ops.tpu.megablox import ops as m

    tiling = (16, 16, 16)
    statics = (jnp.float32, tiling, False, False)  # preferred type, tiling, transposed, interpret

    # x64 off inside: the interpreters' copy of tgmm mixes int64 and int32 under x64.
    def op(lhs, rhs, group_sizes):
        with jax.enable_x64(False):
            return m.gmm(lhs, rhs, group_sizes, jnp.float32, tiling, None, None, False, False)

    def kernel(lhs, rhs, group_sizes):
        return m.gmm(lhs, rhs, group_sizes, jnp.float32, tiling, None, None, False, False)

    def reference(lhs, rhs, group_sizes):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    def fwd(lhs, rhs, group_sizes):
        with jax.enable_x64(False):
            out, res = m._gmm_fwd(lhs, rhs, group_sizes, jnp.float32, tiling, None, None)
        return out, res

    def bwd(res, g):
        with jax.enable_x64(False):
            grad_lhs, grad_rhs, *_ = m._gmm_bwd(*statics, res, g)
        return grad_lhs, grad_rhs, None

    def scaled(res, g):  # the weights' gradient 1% too large
        grad_lhs, grad_rhs, _ = bwd(res, g)
        return grad_lhs, 1.01 * grad_rhs, None

    def missing(res, g):  # the weights' gradient without the last token's term
        lhs, *rest = res
        grad_lhs = bwd(res, g)[0]
        return grad_lhs, bwd((lhs.at[-1].set(0), *rest), g)[1], None

    def swapped(res, g):  # the two groups' weights swapped
        lhs, rhs, *rest = res
        return bwd((lhs, rhs[::-1], *rest), g)

    args = (_normal(0, (32, 16)), _normal(1, (2, 16, 16)), np.array([8, 24], np.int32))
    perturbed = {"scaled_gradient": scaled, "missing_term": missing, "swapped_residuals": swapped}
    twins = _twins(fwd, bwd, perturbed)
    return Case(op, kernel, args, reference, ("tpu",), True, twins=twins)


OPS = {
    f.__name__: f
    for f in (gpu_rms_norm, gpu_layer_norm, gpu_mha, tpu_flash_attention, tpu_mha_reference,
              tpu_splash_attention, tpu_gmm)
}  # fmt: skip


def _interpreter(case: Case):
    # TPU kernels run in Pallas's TPU interpreter on a machine without a TPU.
    return pltpu.force_tpu_interpret_mode() if case.tpu_interpreter else contextlib.nullcontext()


def table(case: Case, op: Callable | None = None, checks=None) -> jaxext.OpcheckReport:
    """The op's (or a twin's) report: its rows in interpret mode, the accelerator platform
    rows of the compiled kernel."""
    everything = jaxext.CHECK_NAMES if checks is None else checks
    interpreted = [c for c in everything if c not in {f"platform_{p}" for p in ACCELERATORS}]
    results: tuple = ()
    if interpreted:
        with _interpreter(case):
            results = jaxext.opcheck(
                op or case.op, case.args, checks=interpreted, reference=case.reference,
                raise_exception=False,
            ).results  # fmt: skip
    platform_rows = [c for c in everything if c not in interpreted]
    if op is None and platform_rows:
        compiled = jaxext.opcheck(
            case.kernel, case.args, checks=platform_rows, raise_exception=False
        )
        results += compiled.results
    return jaxext.OpcheckReport("twin" if op is not None else "op", results)


def _rows(report) -> dict[str, dict[str, str]]:
    return {r.name: {"status": r.status, "detail": r.detail} for r in report.results}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names",
        nargs="*",
        help=f"some of {', '.join(OPS)} (default: all), or NAME/KIND: that twin alone",
    )
    parser.add_argument("--twins", action="store_true", help="also each op's buggy twins")
    parser.add_argument("--json", type=Path, help="write every table's rows here")
    parser.add_argument("--checks", nargs="+", help="only these rows (default: each op's)")
    parser.add_argument("--markdown", type=Path, help="write the tables here, as a results page")
    options = parser.parse_args(argv)
    twins_alone = {f"{name}/{kind}" for name in OPS for kind in TWINS}
    unknown = sorted(set(options.names) - set(OPS) - twins_alone)
    if unknown:
        parser.error(f"unknown ops {unknown}; expected some of {list(OPS)} or NAME/KIND")
    found: dict[str, Any] = {}
    printed: list[str] = []
    for given in options.names or list(OPS):
        name, _, alone = given.partition("/")
        runs: list[tuple[str, Callable[[Case], Any]]] = []
        if not alone:
            runs.append((name, lambda case: table(case, checks=options.checks or case.checks)))
        for kind in TWINS:
            if kind == alone or (options.twins and not alone):
                runs.append((f"{name}/{kind}", _twin_table(kind)))
        case = None
        for title, run in runs:
            start = time.perf_counter()
            try:
                case = case or OPS[name]()
                if title != name and not case.twins:
                    continue
                report = run(case)
            except Exception as err:  # noqa: BLE001 -- the op does not build or run here
                line = str(err).splitlines()[0][:200] if str(err) else ""
                printed.append(f"{title}: not run ({type(err).__name__}: {line})")
                print(printed[-1], flush=True)
                found[title] = {"error": f"{type(err).__name__}: {line}"}
                continue
            seconds = time.perf_counter() - start
            printed.append(f"== {title} ({seconds:.0f} s)\n{report}")
            print(printed[-1], flush=True)
            found[title] = {"seconds": seconds, "targets": case.targets, "rows": _rows(report)}
    if options.json is not None:
        options.json.write_text(json.dumps(found, indent=1))
    if options.markdown is not None:
        command = " ".join(["python benchmarks/pallas_ops_tables.py", *argv])
        options.markdown.write_text(
            "# opcheck on JAX's own Pallas ops, and their buggy twins (CPU, interpret mode)\n\n"
            f"`{command}` with jax {jax.__version__} on {jax.default_backend()}; what the tables "
            "show, and why each SKIP is truthful: the script's docstring.\n\n"
            "```\n" + "\n\n".join(printed) + "\n```\n"
        )


def _twin_table(kind: str) -> Callable[[Case], Any]:
    def run(case: Case):
        return table(case, case.twins[kind], checks=("forward_rule", *GRADIENT_CHECKS))

    return run


if __name__ == "__main__":
    main(sys.argv[1:])
