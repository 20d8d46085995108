"""The training demo behind ``python -m jaxext``: an MLP of jaxext layers on 8x8 digits.

The data set ships with scikit-learn (no network). The train/test split is fixed;
``seed`` drives the parameter initialisation and the minibatch order only, so a
given seed reproduces the same run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import nnx as jnnx

__all__ = ["DigitsMLP", "TrainResult", "load_digits_split", "train_digits"]

_SPLIT_SEED = 0  # the train/test split never changes with --seed
_TEST_FRACTION = 0.25


def load_digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns ``(x_train, y_train, x_test, y_test)`` from scikit-learn's bundled digits.

    Pixels stay raw (0..16); the model's first layer rescales them.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=_TEST_FRACTION, random_state=_SPLIT_SEED, stratify=y
    )
    return x_train, y_train, x_test, y_test


class DigitsMLP(nnx.Module):
    """``MulConstant(1/16) -> Linear -> RMSNorm -> relu -> Linear -> RMSNorm -> relu -> Linear``.

    Every layer is one of jaxext's. The constant maps the raw 0..16 pixel
    intensities into [0, 1], the job a fixed preprocessing scale does, here as a
    layer with a custom backward; each ``RMSNorm`` runs :func:`jaxext.rms_norm`.
    """

    def __init__(self, hidden: int = 128, *, rngs: nnx.Rngs) -> None:
        self.scale = jnnx.MulConstant(1.0 / 16.0)
        self.fc1 = jnnx.Linear(64, hidden, rngs=rngs)
        self.norm1 = jnnx.RMSNorm(hidden, rngs=rngs)
        self.fc2 = jnnx.Linear(hidden, hidden, rngs=rngs)
        self.norm2 = jnnx.RMSNorm(hidden, rngs=rngs)
        self.out = jnnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.scale(x)
        x = jax.nn.relu(self.norm1(self.fc1(x)))
        x = jax.nn.relu(self.norm2(self.fc2(x)))
        return self.out(x)


@dataclasses.dataclass
class TrainResult:
    """Per-epoch history and the final test accuracy of :func:`train_digits`."""

    loss: list[float]
    train_accuracy: list[float]
    test_accuracy: list[float]
    seconds: float

    @property
    def final_test_accuracy(self) -> float:
        return self.test_accuracy[-1]


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


@nnx.jit
def _train_step(model, optimizer, x, y):
    def loss_fn(model):
        return _cross_entropy(model(x), y)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def _accuracy(model, x, y):
    return jnp.mean(jnp.argmax(model(x), axis=-1) == y)


def train_digits(
    *,
    epochs: int = 20,
    seed: int = 0,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    on_epoch: Callable[[int, float, float, float], None] | None = None,
) -> TrainResult:
    """Trains :class:`DigitsMLP` with Adam under ``jit`` and returns its history.

    Args:
        epochs: passes over the training set.
        seed: seeds parameter initialisation and minibatch shuffling.
        batch_size: minibatch size.
        learning_rate: Adam step size.
        on_epoch: called after each epoch with ``(epoch, loss, train_acc, test_acc)``.

    Returns:
        A :class:`TrainResult` with one entry per epoch.

    Raises:
        ValueError: if ``epochs`` or ``batch_size`` is not positive.

    Example:
        >>> from jaxext._demo import train_digits
        >>> result = train_digits(epochs=1, seed=0)
        >>> len(result.loss), result.final_test_accuracy > 0.5
        (1, True)
    """
    import optax

    if epochs < 1:
        raise ValueError(f"`epochs` must be >= 1; got {epochs}.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1; got {batch_size}.")

    x_train, y_train, x_test, y_test = load_digits_split()
    model = DigitsMLP(rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    order_rng = np.random.default_rng(seed)
    n_batches = len(x_train) // batch_size  # drop the ragged tail: one compiled shape

    history = TrainResult(loss=[], train_accuracy=[], test_accuracy=[], seconds=0.0)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = order_rng.permutation(len(x_train))
        losses = []
        for i in range(n_batches):
            idx = order[i * batch_size : (i + 1) * batch_size]
            losses.append(_train_step(model, optimizer, x_train[idx], y_train[idx]))
        epoch_loss = float(jnp.mean(jnp.stack(losses)))
        train_acc = float(_accuracy(model, x_train, y_train))
        test_acc = float(_accuracy(model, x_test, y_test))
        history.loss.append(epoch_loss)
        history.train_accuracy.append(train_acc)
        history.test_accuracy.append(test_acc)
        if on_epoch is not None:
            on_epoch(epoch, epoch_loss, train_acc, test_acc)
    history.seconds = time.perf_counter() - start
    return history


def save_plot(result: TrainResult, path: str) -> None:
    """Writes a PNG with the loss curve and the train/test accuracy curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = np.arange(1, len(result.loss) + 1)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_loss.plot(epochs, result.loss, marker="o")
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="Loss")
    ax_acc.plot(epochs, result.train_accuracy, marker="o", label="train")
    ax_acc.plot(epochs, result.test_accuracy, marker="s", label="test")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="Accuracy", ylim=(0.0, 1.0))
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
