"""``python -m jaxext``: what jaxext ships and where it runs, opcheck tables of the ops, a demo."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import jax
import numpy as np

import jaxext


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jaxext",
        description="List jaxext's ops and layers, opcheck the ops (linear, mul_constant, "
        "rms_norm), then train an MLP of jaxext layers (Linear, RMSNorm, MulConstant) on "
        f"scikit-learn's 8x8 digits (needs the demo extra: {_DEMO_INSTALL}).",
    )
    parser.add_argument(
        "--epochs", type=_positive_int, default=20, help="training epochs (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="init and shuffling seed (default: %(default)s)"
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write loss/accuracy curves to this PNG (needs matplotlib; default: no plot)",
    )
    return parser.parse_args(argv)


_DEMO_INSTALL = "pip install 'jaxext[demo]'"

# The demo's optional dependencies: import name -> the package that provides it.
_DEMO_PACKAGES = {"optax": "optax", "sklearn": "scikit-learn"}
_PLOT_PACKAGES = {"matplotlib": "matplotlib"}
# Where to read on: the guides for writing kernels and for using jaxext inside other libraries.
_GUIDES = (
    "guides/pallas_kernels.md (Pallas kernels)",
    "guides/libraries.md (Equinox, diffrax, Flax)",
)


def _missing_packages(plot: bool) -> list[str]:
    """The packages of the demo extra that this run needs and cannot import."""
    needed = {**_DEMO_PACKAGES, **(_PLOT_PACKAGES if plot else {})}
    missing = []
    for module, package in needed.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    return missing


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _opcheck_cases() -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
    """Each built-in op with small float64 arguments for ``jaxext.opcheck``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3))
    return [
        (jaxext.linear, (x, rng.standard_normal((2, 3)), rng.standard_normal(2))),
        (jaxext.mul_constant, (x, rng.standard_normal(3))),
        (jaxext.rms_norm, (x, rng.standard_normal(3))),
    ]


def _layer_names(namespace: ModuleType) -> str:
    """The layer classes a Flax namespace of jaxext exports, comma-separated."""
    return ", ".join(n for n in namespace.__all__ if isinstance(getattr(namespace, n), type))


def _rms_norm_placement(backend: str) -> str:
    """Where ``jaxext.rms_norm`` runs by default on ``backend``."""
    if backend == "tpu":
        return "its Pallas kernels (Mosaic)"
    return (
        "plain XLA; its Pallas kernels run by default on TPU, and on GPU (Triton) when\n"
        '  asked for with implementation="pallas" (XLA measured faster on an H200);\n'
        '  implementation="interpret" runs them anywhere, in interpret mode, for testing'
    )


def _report_environment() -> None:
    import jaxext.linen
    import jaxext.nnx

    backend = jax.default_backend()
    print(f"jaxext {jaxext.__version__}, jax {jax.__version__}")
    print(f"backend: {backend}")
    for device in jax.devices():
        print(f"  device {device.id}: {device.device_kind} ({device.platform})")
    print("ops: " + ", ".join(f"jaxext.{op.__name__}" for op, _ in _opcheck_cases()))
    print(f"layers: jaxext.nnx: {_layer_names(jaxext.nnx)}")
    print(f"        jaxext.linen: {_layer_names(jaxext.linen)}")
    print(f"rms_norm on {backend}: {_rms_norm_placement(backend)}")
    print(f"guides (in the repository's docs/): {', '.join(_GUIDES)}")


def _run_opchecks() -> bool:
    """Runs ``jaxext.opcheck`` on the built-in ops; prints one table each."""
    all_ok = True
    for op, args in _opcheck_cases():
        try:
            report = jaxext.opcheck(op, args)
            print(report)
        except jaxext.OpcheckError as err:
            print(err)
            all_ok = False
        print()
    return all_ok


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    missing = _missing_packages(plot=args.plot is not None)
    if missing:  # before any work: the checks take half a minute
        print(
            f"python -m jaxext: the training demo needs {', '.join(missing)}, not installed; "
            f"install the demo extra: {_DEMO_INSTALL} (from a clone: pip install '.[demo]')",
            file=sys.stderr,
        )
        return 2
    _report_environment()
    print()
    if not _run_opchecks():
        print("opcheck failed: not training.", file=sys.stderr)
        return 1

    from ._demo import save_plot, train_digits

    def on_epoch(epoch: int, loss: float, train_acc: float, test_acc: float) -> None:
        print(
            f"epoch {epoch:3d}/{args.epochs}  loss {loss:.4f}  "
            f"train acc {train_acc:.4f}  test acc {test_acc:.4f}",
            flush=True,
        )

    print(f"training DigitsMLP on 8x8 digits (seed {args.seed}, {_plural(args.epochs, 'epoch')})")
    result = train_digits(epochs=args.epochs, seed=args.seed, on_epoch=on_epoch)
    print(f"trained in {result.seconds:.1f} s")
    if args.plot:
        save_plot(result, args.plot)
        print(f"plot written to {args.plot}")
    print(f"test accuracy: {result.final_test_accuracy:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
