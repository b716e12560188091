"""A learnable synthetic classification set: labels from a random teacher network.

x ~ N(0, 1)^D; label = argmax(tanh(x W1 / sqrt(D)) W2 + bias). The teacher
(W1, W2, bias) comes from ``teacher_seed`` alone, so a training file and an
evaluation file made with different ``seed`` but the same ``teacher_seed``
share one labelling function. The bias is tuned on a fixed reference sample
so the classes are roughly balanced (chance accuracy ~ 1/C), and samples
closer than MARGIN to a class boundary are redrawn.
Output is bit-identical for the same arguments.
"""

from __future__ import annotations

import os

import numpy as np

from .tabular import FORMAT_NAME, FORMAT_VERSION

TEACHER_HIDDEN = 64
CHUNK_ROWS = 65536
# Samples whose teacher logits are within MARGIN of a tie are redrawn, so every
# label is unambiguous and a student can approach 100% (about half are redrawn).
MARGIN = 2.0


class Teacher:
    def __init__(self, dim: int, classes: int, teacher_seed: int):
        rng = np.random.default_rng(teacher_seed)
        self.w1 = rng.standard_normal((dim, TEACHER_HIDDEN)) * (1.0 / np.sqrt(dim))
        self.w2 = rng.standard_normal((TEACHER_HIDDEN, classes))
        self.bias = np.zeros(classes)
        reference = rng.standard_normal((20000, dim)).astype(np.float32)
        # nudge each class's bias until argmax picks classes about equally often; only the bias
        # changes, so the reference's logits before it are computed once
        unbiased = self._unbiased(reference)
        for _ in range(50):
            freq = np.bincount((unbiased + self.bias).argmax(axis=1), minlength=classes) / len(reference)
            self.bias -= 0.5 * np.log(np.maximum(freq, 1e-4) * classes)

    def _unbiased(self, x) -> np.ndarray:
        return np.tanh(x.astype(np.float64) @ self.w1) @ self.w2

    def logits(self, x) -> np.ndarray:
        return self._unbiased(x) + self.bias

    def labels(self, x) -> np.ndarray:
        return self.logits(x).argmax(axis=1).astype(np.int64)

    def margins(self, x) -> np.ndarray:
        """Gap between the teacher's two largest logits (small = near a class boundary)."""
        top2 = np.partition(self.logits(x), -2, axis=1)[:, -2:]
        return top2[:, 1] - top2[:, 0]


def write_synthetic(path: str, n: int, dim: int, classes: int, seed: int, teacher_seed: int = 0) -> dict:
    """Write ``n`` samples to ``path`` (atomically: temp file, then rename); return its attributes."""
    import h5py

    if n < 1 or dim < 1 or classes < 2:
        from ..errors import UserError

        raise UserError(f"data synth: need n >= 1, dim >= 1, classes >= 2 (got n={n}, dim={dim}, classes={classes})")
    teacher = Teacher(dim, classes, teacher_seed)
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    counts = np.zeros(classes, dtype=np.int64)
    with h5py.File(tmp, "w") as f:
        xs = f.create_dataset("x", (n, dim), dtype="float32", chunks=(min(n, 4096), dim))
        ys = f.create_dataset("y", (n,), dtype="int64", chunks=(min(n, 4096),))
        start = 0
        while start < n:
            x = rng.standard_normal((CHUNK_ROWS, dim)).astype(np.float32)
            x = x[teacher.margins(x) >= MARGIN][:n - start]  # redraw ambiguous samples
            y = teacher.labels(x)
            xs[start:start + len(x)] = x
            ys[start:start + len(x)] = y
            counts += np.bincount(y, minlength=classes)
            start += len(x)
        attrs = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "n_classes": classes,
                 "n_features": dim, "generator": "teacher-mlp", "seed": seed,
                 "teacher_seed": teacher_seed, "margin": MARGIN, "class_counts": counts}
        f.attrs.update(attrs)
    os.replace(tmp, path)
    return attrs
