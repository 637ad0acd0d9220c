"""A quadratic model of the selection loss over mixing coefficients, and its minimiser inside the design.

The coefficient space is parametrised by a few anchor candidates a_0..a_d (coefficient vectors over the k
versions, each summing to 1): c(u) = Σ_j u_j a_j with u on the probability simplex Δ_d (u_j >= 0, Σ u_j = 1),
so every c(u) sums to 1 and the region is the convex hull of the anchors. In the free coordinates
x = (u_1..u_d) (u_0 = 1 - Σ x) the loss is modelled as

    f(x) = f0 + gᵀx + ½ xᵀHx          (1 + d + d(d+1)/2 parameters)

fitted by least squares on a designed set of points (`simplex_lattice`: every u with entries in {0, 1/n,
…, 1}, (d+n choose d) points, covering the whole simplex, vertices included) — a response-surface design
(Box & Draper, "Response Surfaces, Mixtures, and Ridge Analyses", 2007, ch. 16: the {d, n} simplex lattice
for mixture experiments). The fit is refused (`QuadraticFit.ok` False, `why` says which test failed) when

- there are fewer points than parameters + 1 (no residual degree of freedom to judge the fit), or
- the residual RMS exceeds max(z · noise, rel_tol · std(y)): the data are not quadratic within what the
  measurement noise and a relative tolerance allow.

The minimiser is found on the simplex itself (a trust region equal to the region the design covers, never
an extrapolation): every face of Δ_d is tried — on a face the quadratic restricted to it is minimised in
closed form when its Hessian is positive definite there, and kept if it lies inside the face; vertices are
always candidates — and the lowest predicted value wins (exact for small d: 2^{d+1} - 1 faces).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

DTYPE = torch.float64


def simplex_lattice(d: int, n: int) -> torch.Tensor:
    """All points u of the {d, n} simplex lattice: (N, d+1) float64, u_j ∈ {0, 1/n, …, 1}, Σ u_j = 1,
    N = C(d+n, d), in lexicographic order (vertices included).

    Raises:
        ValueError: d < 1 or n < 1.
    """
    if d < 1 or n < 1:
        raise ValueError(f"need d >= 1 and n >= 1, got d={d}, n={n}")
    pts = [c for c in itertools.product(range(n + 1), repeat=d + 1) if sum(c) == n]
    return torch.tensor(sorted(pts, reverse=True), dtype=DTYPE) / n


def _features(x: torch.Tensor) -> torch.Tensor:
    """Design matrix rows [1, x_1..x_d, x_i x_j (i <= j)] of (N, d) free coordinates -> (N, P)."""
    n, d = x.shape
    cols = [torch.ones(n, dtype=DTYPE), *x.T]
    cols += [x[:, i] * x[:, j] for i in range(d) for j in range(i, d)]
    return torch.stack(cols, dim=1)


def n_params(d: int) -> int:
    """Parameters of a full quadratic in d variables: 1 + d + d(d+1)/2."""
    return 1 + d + d * (d + 1) // 2


@dataclass(frozen=True)
class QuadraticFit:
    """A fitted quadratic over the free simplex coordinates x (u_0 = 1 - Σ x).

    Attributes:
        f0, g, H: the model f(x) = f0 + gᵀx + ½ xᵀHx (float, (d,), (d, d) float64).
        residual_rms: RMS of the fit's residuals on the design points (loss units, nats).
        y_std: standard deviation of the fitted values (the scale the residual is judged against).
        ok: whether the fit passed the residual test; `why` names the failed test otherwise.
    """

    f0: float
    g: torch.Tensor
    H: torch.Tensor
    residual_rms: float
    y_std: float
    n_points: int
    ok: bool
    why: str = ""

    def predict(self, u: torch.Tensor) -> torch.Tensor:
        """Predicted loss at simplex points u (N, d+1) or (d+1,) -> (N,) or scalar tensor."""
        x = torch.as_tensor(u, dtype=DTYPE)[..., 1:]
        return self.f0 + x @ self.g + 0.5 * ((x @ self.H) * x).sum(-1)


def fit_quadratic(u: torch.Tensor, y: torch.Tensor, *, noise: float = 0.0, z: float = 3.0,
                  rel_tol: float = 0.05) -> QuadraticFit:
    """Least-squares quadratic through losses `y` (N,) measured at simplex points `u` (N, d+1).

    The residual test: refuse when residual_rms > max(z * noise, rel_tol * std(y)). `noise` is the standard
    error of one measured loss (0 for losses on fixed windows: the same windows for every point make the
    loss a deterministic function of u, so only the model's misfit and rounding remain).

    Returns:
        A QuadraticFit (ok False with a reason when refused; its coefficients are still the LS solution).

    Raises:
        ValueError: shapes disagree, values are non-finite, or points leave the simplex.
    """
    u = torch.as_tensor(u, dtype=DTYPE)
    y = torch.as_tensor(y, dtype=DTYPE)
    if u.ndim != 2 or y.shape != (u.shape[0],) or u.shape[1] < 2:
        raise ValueError(f"need u (N, d+1 >= 2) and y (N,), got {tuple(u.shape)} and {tuple(y.shape)}")
    if not (torch.isfinite(u).all() and torch.isfinite(y).all()):
        raise ValueError("u and y must be finite")
    if (u < -1e-12).any() or ((u.sum(1) - 1).abs() > 1e-9).any():
        raise ValueError("every point u must lie on the simplex (u >= 0, Σ u = 1)")
    if not (math.isfinite(noise) and noise >= 0 and z > 0 and rel_tol > 0):
        raise ValueError(f"need noise >= 0, z > 0, rel_tol > 0; got {noise}, {z}, {rel_tol}")
    d = u.shape[1] - 1
    x = u[:, 1:]
    a = _features(x)
    theta = torch.linalg.lstsq(a, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    resid = y - a @ theta
    p = n_params(d)
    rms = float(resid.pow(2).mean().sqrt())
    y_std = float(y.std()) if y.numel() > 1 else 0.0
    g = theta[1:1 + d].clone()
    h = torch.zeros(d, d, dtype=DTYPE)
    pairs = [(i, j) for i in range(d) for j in range(i, d)]
    for (i, j), v in zip(pairs, theta[1 + d:], strict=True):
        if i == j:
            h[i, i] = 2 * v  # ½ H_ii x_i² = v x_i²
        else:
            h[i, j] = h[j, i] = v
    why = ""
    if u.shape[0] < p + 1:
        why = f"{u.shape[0]} points for {p} parameters: no residual degree of freedom"
    elif torch.linalg.matrix_rank(a) < p:
        why = "the design does not determine every quadratic term"
    else:
        bound = max(z * noise, rel_tol * y_std)
        if rms > bound:
            why = (f"residual RMS {rms:.3g} > max({z:g} x noise {noise:.3g}, {rel_tol:g} x std(y) {y_std:.3g}):"
                   " the loss is not quadratic over this region")
    return QuadraticFit(float(theta[0]), g, h, rms, y_std, int(u.shape[0]), not why, why)


def minimise_on_simplex(fit: QuadraticFit) -> tuple[torch.Tensor, float]:
    """The point u* (d+1,) float64 of the simplex with the lowest predicted loss, and that prediction.

    Exhaustive over faces: for each non-empty subset S of the d+1 vertices, minimise the quadratic on the
    affine hull of S (closed form through the KKT system when the restricted Hessian is positive
    definite), keep the point if it lies inside the face (all weights >= 0). Vertices always qualify.
    """
    d = fit.g.shape[0]
    best_u, best_f = None, math.inf
    eye = torch.eye(d + 1, dtype=DTYPE)
    for r in range(1, d + 2):
        for face in itertools.combinations(range(d + 1), r):
            u = _face_minimum(fit, eye[list(face)])
            if u is None:
                continue
            f = float(fit.predict(u))
            if f < best_f - 1e-15:
                best_u, best_f = u, f
    assert best_u is not None  # vertices (r = 1) always qualify
    return best_u, best_f


def _face_minimum(fit: QuadraticFit, verts: torch.Tensor) -> torch.Tensor | None:
    """Minimiser of the quadratic on the face spanned by `verts` (r, d+1), or None if it is not inside."""
    r = verts.shape[0]
    if r == 1:
        return verts[0]
    # u(w) = Σ w_i verts_i with Σ w = 1: x(w) = V w, V = verts[:, 1:]ᵀ (d, r)
    v = verts[:, 1:].T
    q = v.T @ fit.H @ v  # (r, r): the quadratic form in w
    lin = v.T @ fit.g
    # KKT for min ½ wᵀQw + linᵀw s.t. 1ᵀw = 1; require Q positive definite on {1ᵀw = 0}
    basis = torch.linalg.svd(torch.ones(1, r, dtype=DTYPE)).Vh[1:].T  # (r, r-1), orthonormal null space of 1ᵀ
    if torch.linalg.eigvalsh(basis.T @ q @ basis).min() <= 1e-12:
        return None
    kkt = torch.zeros(r + 1, r + 1, dtype=DTYPE)
    kkt[:r, :r], kkt[:r, r], kkt[r, :r] = q, 1.0, 1.0
    rhs = torch.cat([-lin, torch.ones(1, dtype=DTYPE)])
    w = torch.linalg.solve(kkt, rhs)[:r]
    if (w < -1e-12).any():
        return None
    w = w.clamp_min(0)
    return (w / w.sum()) @ verts


def coefs_at(u: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Coefficients over the k versions of simplex point u (d+1,) given anchors (d+1, k): c = uᵀA (k,).

    Σ c = 1 whenever every anchor sums to 1."""
    return torch.as_tensor(u, dtype=DTYPE) @ torch.as_tensor(anchors, dtype=DTYPE)
