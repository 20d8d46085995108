"""PyTorch contenders for the jaxext benchmarks (all optional: torch may be missing).

* ``LinearFunction``: a hand-written ``torch.autograd.Function`` (the PyTorch
  counterpart of ``jaxext.linear``), with ``ctx.needs_input_grad`` and support for
  any leading batch dimensions;
* ``torch.nn.functional.linear`` (eager);
* ``torch.compile`` of the same loss (Inductor), when it works on the machine.

Each builder returns a synchronous zero-argument callable doing one forward and
one backward pass of ``sum(linear(x, w, b) * ct)`` with respect to ``x, w, b``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # torch is optional: its columns are skipped
    torch = None
    F = None


def available() -> bool:
    return torch is not None


@functools.cache
def linear_function() -> Any:
    """The hand-written autograd.Function (built lazily so this module imports without torch)."""

    class LinearFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias):
            x2 = x.reshape(-1, x.shape[-1])
            y = x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())
            # Save only what the requested gradients need.
            need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            ctx.save_for_backward(weight if need_x else None, x if need_w else None)
            return y.reshape(*x.shape[:-1], weight.shape[0])

        @staticmethod
        def backward(ctx, grad_out):
            weight, x = ctx.saved_tensors
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_x = (g2 @ weight).reshape(*grad_out.shape[:-1], weight.shape[1])
            if ctx.needs_input_grad[1]:
                grad_w = g2.t() @ x.reshape(-1, x.shape[-1])
            if len(ctx.needs_input_grad) > 2 and ctx.needs_input_grad[2]:
                grad_b = g2.sum(0)
            return grad_x, grad_w, grad_b

    return LinearFunction


def torch_dtype(name: str) -> Any:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def to_torch(array: Any, device: str, *, requires_grad: bool = False) -> Any:
    """A torch copy of a JAX/NumPy array (bfloat16 goes through float32)."""
    host = np.asarray(array)
    dtype = str(host.dtype)
    t = torch.from_numpy(np.array(host, dtype=np.float32)).to(device=device)
    t = t.to(torch_dtype(dtype))
    return t.requires_grad_(requires_grad)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _loss_fn(kind: str) -> Callable[..., Any]:
    if kind == "function":
        apply = linear_function().apply

        def loss(x, w, b, ct):
            return (apply(x, w, b) * ct).sum()

    else:

        def loss(x, w, b, ct):
            return (F.linear(x, w, b) * ct).sum()

    return loss


def linear_step(kind: str, x, w, b, ct, device: str) -> Callable[[], Any]:
    """One fwd+bwd call; ``kind`` is ``"function"``, ``"F.linear"`` or ``"compile"``."""
    if kind == "compile":
        torch._dynamo.reset()
        loss = torch.compile(_loss_fn("F.linear"), dynamic=False)
    else:
        loss = _loss_fn(kind)

    def step():
        grads = torch.autograd.grad(loss(x, w, b, ct), (x, w, b))
        _sync(device)
        return grads

    return step


def saved_bytes(kind: str, x, w, b) -> int:
    """Bytes of the tensors autograd saves for the backward of ``linear(x, w, b)``."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    fn = linear_function().apply if kind == "function" else F.linear
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w, b)
    return total


def mlp_step(width: int, depth: int, x, y, device: str, seed: int = 0) -> Callable[[], Any]:
    """One Adam training step of a ReLU MLP of ``depth`` ``nn.Linear(width, width)`` layers."""
    torch.manual_seed(seed)
    layers: list[Any] = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i < depth - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(device=device, dtype=x.dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        _sync(device)
        return loss

    return step
