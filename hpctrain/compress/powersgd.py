"""PowerSGD (Vogels et al. 2019): rank-r approximations of each layer's gradient matrix.

For a layer's M (n x m) on rank i, with error feedback (M_i = gradient + residual_i) and Q (m x r)
kept from the previous step (the first Gaussian, seeded alike on every rank):

    P   = sum_i(M_i Q)             all-reduce of n x r
    P^  = orthonormal basis of P   (QR; identical on every rank)
    Q   = sum_i(M_i^T P^)          all-reduce of m x r
    S~  = P^ Q^T                   approximates sum_i M_i, the same on every rank (exactly when r >= its rank)
    residual_i = M_i - S~ / p      (the residuals add up to sum_i M_i - S~)

A 3-D layer (n, k, c) is k matrices n x c side by side (a fused QKV weight): each part gets its own
P and Q; their P's travel in one all-reduce (n x kr), their Q's stacked in another (kc x r).
Vectors, matrices that rank r would not shrink (r (n + m) >= n m), and everything before
``start_step`` are all-reduced uncompressed. With momentum correction (base.py) the velocity takes
the gradient's place and the sent subspace is masked out of it: u_i -= P^ (P^T u_i).
"""

from __future__ import annotations

import numpy as np

from .base import Compressor, momentum_update, zeros_kept


class PowerSGD(Compressor):
    combine, error_feedback = "lowrank", True

    def __init__(self, rank: int, start_step: int = 0):
        if rank < 1 or start_step < 0:
            raise ValueError(f"powersgd({rank}, {start_step}): rank >= 1 and start_step >= 0 required")
        self.rank, self.start_step = rank, start_step
        self.name = f"powersgd({rank},{start_step})"
        self.q: dict = {}          # (bucket, layer) -> Q, kept between steps
        self.residuals: dict = {}  # (bucket, layer) -> residual (n x m)
        self.velocities: dict = {}  # (bucket, layer) -> velocity (momentum correction only)

    @staticmethod
    def parts(shape) -> tuple[int, int, int]:
        """(n, k, c) of a layer that is k matrices n x c side by side: (n, 1, m) for a matrix n x m."""
        return (shape[0], 1, shape[1]) if len(shape) == 2 else tuple(shape)

    def compresses(self, shape) -> bool:
        if len(shape) not in (2, 3):
            return False
        n, k, c = self.parts(shape)
        r = min(self.rank, n, c)
        return r * (n + c) < n * c

    @staticmethod
    def initial_q(ctx, layer, m, r) -> np.ndarray:
        """The first Q (m x r) of a layer: Gaussian, the same on every rank (and on every device)."""
        return np.random.default_rng([ctx.seed, ctx.bucket, layer, 0x9D]).standard_normal((m, r)).astype(np.float32)

    @staticmethod
    def orthonormal_parts(p, k: int, r: int) -> np.ndarray:
        """P^ (n x kr, float32): each part's r columns of the summed P orthonormalised on
        their own (QR in float64: the Gram-Schmidt of float32 columns loses orthogonality)."""
        return np.concatenate([np.linalg.qr(p[:, j * r:(j + 1) * r].astype(np.float64))[0]
                               for j in range(k)], axis=1).astype(np.float32)

    def reduce(self, matrices, ctx, allreduce_sum, size: int = 1, momentum: float = 0.0) -> list:
        """Every rank calls this with its per-layer gradients (2-D or 1-D arrays) of one bucket.

        ``allreduce_sum(a)`` must sum ``a`` (float32) over the ``size`` ranks in
        place and return it. Returns the summed (approximated) gradient per layer,
        or with ``momentum`` > 0 the summed velocity (module doc).
        """
        out = []
        for layer, g in enumerate(matrices):
            g = np.asarray(g, np.float32)
            shape = g.shape                 # (n, k, c): k parts
            if g.ndim == 3:                 # state and arithmetic on the n x kc matrix
                g = g.reshape(shape[0], -1)
            key = (ctx.bucket, layer)
            u = None
            if momentum:
                u = zeros_kept(self.velocities, key, g.shape)
                momentum_update(u, g, momentum)
                g = u
            if ctx.step < self.start_step or not self.compresses(shape):
                out.append(allreduce_sum(g.copy()))
                continue
            n, k, c = self.parts(shape)
            r = min(self.rank, n, c)
            resid = zeros_kept(self.residuals, key, g.shape)
            q = self.q.get(key)
            if q is None or q.shape != (k * c, r):
                q = self.q[key] = self.initial_q(ctx, layer, k * c, r)
            mat = g + resid
            part = [slice(j * c, (j + 1) * c) for j in range(k)]  # part j: columns and Q's rows
            p = allreduce_sum(np.concatenate([mat[:, cj] @ q[cj] for cj in part], axis=1))
            p_hat = self.orthonormal_parts(p, k, r)
            p_hats = [np.ascontiguousarray(p_hat[:, j * r:(j + 1) * r]) for j in range(k)]  # BLAS as before
            q_new = allreduce_sum(np.concatenate([mat[:, cj].T @ p_hat for cj, p_hat in zip(part, p_hats)]))
            approx = np.concatenate([p_hat @ q_new[cj].T for cj, p_hat in zip(part, p_hats)], axis=1)
            np.subtract(mat, approx / size, out=resid)
            if u is not None:
                for cj, p_hat in zip(part, p_hats):
                    u[:, cj] -= p_hat @ (p_hat.T @ u[:, cj])
            self.q[key] = q_new
            out.append(approx)
        return out

    def payload_bytes(self, shapes, step) -> int:
        """Bytes one rank sends for layers of these shapes at ``step`` (P and Q, or the raw layer)."""
        total = 0
        for shape in shapes:
            if step >= self.start_step and self.compresses(shape):
                n, k, c = self.parts(shape)
                r = min(self.rank, n, c)
                total += 4 * k * r * (n + c)
            else:
                total += 4 * int(np.prod(shape))
        return total

    def state(self) -> dict:
        out = {}
        for (b, layer), v in sorted(self.residuals.items()):
            out[f"residual/{b}/{layer}"] = v
        for (b, layer), v in sorted(self.q.items()):
            out[f"q/{b}/{layer}"] = v
        for (b, layer), v in sorted(self.velocities.items()):
            out[f"velocity/{b}/{layer}"] = v
        return out

    def load_state(self, state: dict) -> None:
        """Residuals, Q and velocities from ``state()``'s keys; an empty dict resets them all."""
        self.residuals, self.q, self.velocities = {}, {}, {}
        targets = {"residual": self.residuals, "q": self.q, "velocity": self.velocities}
        for k, v in state.items():
            kind, b, layer = k.split("/")
            if kind in targets:
                targets[kind][(int(b), int(layer))] = np.asarray(v, np.float32).copy()
