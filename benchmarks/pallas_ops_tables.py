"""opcheck's tables for JAX's own Pallas ops built on ``jax.custom_vjp`` (issue #43).

``jax.custom_vjp = jaxext.custom_vjp`` is swapped in before JAX's Pallas ops are
imported (as ``tests/_libraries_worker.py`` does for other libraries), and each op runs
on CPU in interpret mode at tiny shapes. Prints each table; an op that does not import
or build here is named with the error.

Usage: ``python benchmarks/pallas_ops_tables.py [NAME ...]`` (default: every op;
names: ``gpu_rms_norm``, ``gpu_layer_norm``, ``gpu_mha``, ``tpu_flash_attention``,
``tpu_mha_reference``, ``tpu_splash_attention``, ``tpu_gmm``). TPU kernels run in
``pltpu.force_tpu_interpret_mode()``. Slow on CPU: about two minutes per op on a loaded
2-core machine; flash attention's whole battery at its smallest blocks (a sequence of 128)
took over 30 minutes in the TPU interpreter there.
"""

from __future__ import annotations

import sys
import time

import jax

import jaxext

jax.custom_vjp = jaxext.custom_vjp  # before any Pallas op below is imported
jax.config.update("jax_enable_x64", True)

import contextlib  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

_nothing = contextlib.nullcontext


def _normal(seed, shape, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def gpu_rms_norm():
    from jax.experimental.pallas.ops.gpu import rms_norm as m

    def op(x, w, b):
        return m.rms_norm(x, w, b, None, 3, 1e-5, "triton", True)

    return op, (_normal(0, (2, 3, 8)), 1 + _normal(1, (8,), 0.1), _normal(2, (8,), 0.1))


def gpu_layer_norm():
    from jax.experimental.pallas.ops.gpu import layer_norm as m

    def op(x, w, b):
        return m.layer_norm(x, w, b, None, 3, 1e-5, "triton", True)

    return op, (_normal(0, (2, 3, 8)), 1 + _normal(1, (8,), 0.1), _normal(2, (8,), 0.1))


def gpu_mha():
    from jax.experimental.pallas.ops.gpu import attention as m

    sizes = m.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_kv_dkv=16,
                         block_q_dq=16, block_kv_dq=16)  # fmt: skip

    def op(q, k, v):
        return m.mha(q, k, v, None, block_sizes=sizes, interpret=True, backward_pass_impl="triton")

    shape = (1, 16, 1, 16)  # batch, sequence, heads, head dim
    return op, (_normal(0, shape, 0.5), _normal(1, shape, 0.5), _normal(2, shape))


def tpu_flash_attention():
    from jax.experimental.pallas.ops.tpu import flash_attention as m

    def op(q, k, v):
        return m.flash_attention(q, k, v)  # default blocks: 128, the kernel's smallest

    shape = (1, 1, 128, 8)  # batch, heads, sequence, head dim
    return op, (_normal(0, shape, 0.5), _normal(1, shape, 0.5), _normal(2, shape))


def tpu_splash_attention():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as m

    heads, length, dim = 1, 128, 128  # the kernel's smallest blocks
    mask = np.tril(np.ones((heads, length, length), bool))
    kernel = m.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=True)

    def op(q, k, v):
        return kernel(q, k, v)

    shape = (heads, length, dim)
    return op, (_normal(0, shape, 0.1), _normal(1, shape, 0.1), _normal(2, shape))


def tpu_gmm():
    from jax.experimental.pallas.ops.tpu.megablox import ops as m

    groups = np.array([8, 24], np.int32)

    def op(lhs, rhs, group_sizes):
        return m.gmm(lhs, rhs, group_sizes, jnp.float32, (16, 16, 16), None, None, True)

    return op, (_normal(0, (32, 16)), _normal(1, (2, 16, 16)), groups)


def tpu_mha_reference():
    from jax.experimental.pallas.ops.tpu import flash_attention as m

    def op(q, k, v):
        return m.mha_reference(q, k, v, None)

    shape = (1, 1, 8, 8)
    return op, (_normal(0, shape, 0.5), _normal(1, shape, 0.5), _normal(2, shape))


OPS = {
    f.__name__: f
    for f in (gpu_rms_norm, gpu_layer_norm, gpu_mha, tpu_flash_attention, tpu_mha_reference,
              tpu_splash_attention, tpu_gmm)
}  # fmt: skip


def main(names: list[str]) -> None:
    for name in names or list(OPS):
        start = time.perf_counter()
        try:
            op, args = OPS[name]()
            # TPU kernels run in Pallas's TPU interpreter on a machine without a TPU.
            with pltpu.force_tpu_interpret_mode() if name.startswith("tpu") else _nothing():
                report = jaxext.opcheck(op, args, raise_exception=False)
        except Exception as err:  # noqa: BLE001 -- the op does not build or run here
            line = str(err).splitlines()[0][:200] if str(err) else ""
            print(f"{name}: not run ({type(err).__name__}: {line})", flush=True)
            continue
        print(f"== {name} ({time.perf_counter() - start:.0f} s)")
        print(report, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
