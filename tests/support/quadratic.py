"""A quadratic "model" for ZO tests: L(θ) = ½θᵀHθ + bᵀθ over named parameter blocks, computed in float64."""

from __future__ import annotations

import torch


class QuadraticModel(torch.nn.Module):
    """Parameters p0, p1, ... (block sizes `sizes`, dtype `dtype`) owned by this module; forward(batch) = L(θ).

    H (n, n) and b (n,) are float64 buffers; `batch` is unused (the loss is deterministic in θ).
    """

    def __init__(self, sizes: list[int], seed: int, dtype: torch.dtype = torch.float32, coupling: float = 0.3):
        super().__init__()
        n = sum(sizes)
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(n, n, generator=g, dtype=torch.float64)
        h = coupling * a @ a.T / n + torch.diag(torch.rand(n, generator=g, dtype=torch.float64) * 4 + 0.5)
        self.register_buffer("h", h)
        self.register_buffer("b", torch.randn(n, generator=g, dtype=torch.float64))
        self.sizes = sizes
        for i, k in enumerate(sizes):
            init = (torch.randn(k, generator=g) * 0.5).to(dtype)
            setattr(self, f"p{i}", torch.nn.Parameter(init))

    def theta(self) -> torch.Tensor:
        """Current θ as (n,) float64 (canonical order)."""
        return torch.cat([p.detach().double().reshape(-1) for p in self.parameters()])

    def forward(self, batch=None) -> torch.Tensor:
        t = torch.cat([p.double().reshape(-1) for p in self.parameters()])
        return 0.5 * t @ self.h @ t + self.b @ t

    def grad_at(self, theta: torch.Tensor) -> torch.Tensor:
        """∇L(θ) = Hθ + b, (n,) float64."""
        return self.h @ theta + self.b


def quad_loss(model: QuadraticModel, batch) -> torch.Tensor:
    """loss_fn(model, batch) for ProbeEvaluator / InProcessBackend."""
    return model(batch)
