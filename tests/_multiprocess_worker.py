"""One process of ``tests/test_multiprocess.py``'s two-process data-parallel run.

Each of two processes runs this script: it joins the job through
``jax.distributed.initialize`` (coordinator on 127.0.0.1, gloo CPU collectives),
gets two CPU devices of its own (four in the job), feeds its half of the batch,
takes one jitted SGD step of a model (an MLP of ``jaxext.nnx.Linear`` layers, or
the same MLP on the C++ ``jaxext.cpp_extension.ops.linear``) and writes the loss,
gradients and updated parameters as JSON. The test compares them with a float64
single-process reference; this script only measures. A model that raises is
recorded with its traceback instead of ending the run, so the other process is
not left waiting in a collective with no partner: every process runs the same
steps in the same order.

Usage: ``python tests/_multiprocess_worker.py PROCESS_ID PORT INPUTS.npz OUTPUT.json MODEL...``
"""

from __future__ import annotations

import json
import sys
import traceback

import jax

LOCAL_DEVICES = 2
LEARNING_RATE = 0.1


def main(process_id: int, port: int, inputs: str, output: str, models: list[str]) -> None:
    # Both settings must precede any JAX computation, as must `initialize`.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=120,
    )
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxext.nnx
    from jaxext.cpp_extension import ops

    data = dict(np.load(inputs))
    params = {
        layer: {"kernel": data[f"{layer}.kernel"], "bias": data[f"{layer}.bias"]}
        for layer in ("l1", "l2")
    }
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    replicated = NamedSharding(mesh, P())

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = jaxext.nnx.Linear(*params["l1"]["kernel"].shape, rngs=rngs)
            self.l2 = jaxext.nnx.Linear(*params["l2"]["kernel"].shape, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))

    def nnx_apply(params, x):
        traced = jax.tree.map(lambda leaf: leaf, state)  # a copy, to hold the traced values
        nnx.replace_by_pure_dict(traced, params)
        return nnx.merge(graphdef, traced)(x)

    def cpp_apply(params, x):
        # ops.linear takes PyTorch's (out_features, in_features) weight layout.
        h = jnp.tanh(ops.linear(x, params["l1"]["kernel"].T, params["l1"]["bias"]))
        return ops.linear(h, params["l2"]["kernel"].T, params["l2"]["bias"])

    def make_step(apply):
        def loss(params, x, t):
            return jnp.mean((apply(params, x) - t) ** 2)

        def step(params, x, t):
            value, grads = jax.value_and_grad(loss)(params, x, t)
            new = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
            return value, grads, new

        return jax.jit(step, out_shardings=replicated)

    # This process's rows of the global batch; the global arrays span both processes.
    n = data["x"].shape[0] // 2
    rows = slice(process_id * n, (process_id + 1) * n)
    batch_sharding = NamedSharding(mesh, P("data", None))
    x = jax.make_array_from_process_local_data(batch_sharding, data["x"][rows])
    t = jax.make_array_from_process_local_data(batch_sharding, data["t"][rows])
    params_g = jax.tree.map(lambda a: jax.make_array_from_process_local_data(replicated, a), params)

    def local(tree):  # a replicated result: every process holds all of it
        return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)).tolist(), tree)

    results = {
        "process_id": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "x_sharding": str(x.sharding.spec),
        "models": {},
    }
    applies = {"nnx": nnx_apply, "cpp": cpp_apply}
    for name in models:
        try:
            loss, grads, new = make_step(applies[name])(params_g, x, t)
            results["models"][name] = {
                "loss": float(np.asarray(loss.addressable_data(0))),
                "grads": local(grads),
                "params": local(new),
            }
        except Exception:  # recorded, reported by the test that reads it
            results["models"][name] = {"error": traceback.format_exc()}
    with open(output, "w") as f:
        json.dump(results, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
