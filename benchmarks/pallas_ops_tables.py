"""opcheck's tables for JAX's own Pallas ops built on ``jax.custom_vjp`` (issue #43).

``jax.custom_vjp = jaxext.custom_vjp`` is swapped in before JAX's Pallas ops are
imported (as ``tests/_libraries_worker.py`` does for other libraries), and each op runs
on CPU in interpret mode at tiny shapes. Prints each table; an op that does not import
or build here is named with the error.

Usage: ``python benchmarks/pallas_ops_tables.py [NAME ...]`` (default: every op;
names: ``gpu_rms_norm``, ``gpu_layer_norm``, ``gpu_mha``, ``tpu_flash_attention``,
``tpu_mha_reference``). Slow on CPU: about two minutes per op on a loaded 2-core machine.
"""

from __future__ import annotations

import sys
import time

import jax

import jaxext

jax.custom_vjp = jaxext.custom_vjp  # before any Pallas op below is imported
jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402


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
        return m.flash_attention(q, k, v, block_sizes=m.BlockSizes.get_default())

    shape = (1, 1, 16, 16)  # batch, heads, sequence, head dim
    return op, (_normal(0, shape, 0.5), _normal(1, shape, 0.5), _normal(2, shape))


def tpu_mha_reference():
    from jax.experimental.pallas.ops.tpu import flash_attention as m

    shape = (1, 1, 8, 8)
    return m.mha_reference, (_normal(0, shape, 0.5), _normal(1, shape, 0.5), _normal(2, shape))


OPS = {f.__name__: f for f in (gpu_rms_norm, gpu_layer_norm, gpu_mha, tpu_flash_attention,
                                tpu_mha_reference)}  # fmt: skip


def main(names: list[str]) -> None:
    for name in names or list(OPS):
        start = time.perf_counter()
        try:
            op, args = OPS[name]()
            report = jaxext.opcheck(op, args, raise_exception=False)
        except Exception as err:  # noqa: BLE001 -- the op does not build or run here
            print(f"{name}: not run ({type(err).__name__}: {str(err).splitlines()[0][:200]})")
            continue
        print(f"== {name} ({time.perf_counter() - start:.0f} s)")
        print(report)


if __name__ == "__main__":
    main(sys.argv[1:])
