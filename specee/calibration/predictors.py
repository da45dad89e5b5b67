"""Training the per-layer exit predictors (step (d)): many small MLPs at once, on the CPU."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class _Adam:
    """Plain Adam (L2 weight decay). torch.optim's constructor costs seconds of imports on
    first use, longer than this whole training run on small data."""

    def __init__(self, params: list[torch.Tensor], lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.params, self.lr, self.wd, self.betas, self.eps = params, lr, weight_decay, betas, eps
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad if not self.wd else p.grad + self.wd * p
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.addcdiv_(m, (v / c2).sqrt_().add_(self.eps), value=-self.lr / c1)


def train_predictors(X: torch.Tensor, y: torch.Tensor, masks: torch.Tensor, hidden: int, steps: int, lr: float,
                     seed: int, bar, minibatch: int = 1024,
                     weight_decay: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train G = len(masks) sets of per-layer MLPs at once.

    X [L, N, F] float32, y [L, N] float, masks [G, N] bool: which positions each set trains
    on (the cross-fitting folds and the final set share one run). The G sets of one layer
    are one wide first layer ([F, G*hidden]: a single bmm over layers), minibatches of
    positions, Adam, BCE with logits. Features are standardised (statistics of all
    positions: preconditioning only, no labels involved) and the standardisation is folded
    into the returned w1 [G, L, F, h], b1 [G, L, h]; also returns w2 [G, L, h], b2 [G, L].
    """
    L, N, Fdim = X.shape
    G = masks.shape[0]
    g = torch.Generator().manual_seed(seed)
    mu = X.mean(1, keepdim=True)  # [L, 1, F]
    sd = X.std(1, keepdim=True).nan_to_num(1.0).clamp_min(1e-4)
    Xs = (X - mu) / sd
    wm = masks.float()  # [G, N]
    w1 = (torch.randn(L, Fdim, G * hidden, generator=g) * math.sqrt(2.0 / Fdim)).requires_grad_()
    b1 = torch.zeros(L, 1, G * hidden, requires_grad=True)
    w2 = (torch.randn(L, 1, G, hidden, generator=g) * math.sqrt(1.0 / hidden)).requires_grad_()
    rate = ((wm.unsqueeze(0) * y.unsqueeze(1)).sum(2) / wm.sum(1).clamp_min(1)).clamp(1e-3, 1 - 1e-3)  # [L, G]
    b2 = torch.log(rate / (1 - rate)).view(L, 1, G).clone().requires_grad_()
    params = [w1, b1, w2, b2]
    adam = _Adam(params, lr, weight_decay)
    bs = min(minibatch, N)
    with torch.enable_grad():
        for _ in range(steps):
            idx = torch.randint(0, N, (bs,), generator=g) if bs < N else torch.arange(N)
            z = torch.baddbmm(b1, Xs[:, idx], w1).relu().view(L, bs, G, hidden)
            logit = (z * w2).sum(-1) + b2  # [L, bs, G]
            mb = wm[:, idx].T  # [bs, G]
            loss = F.binary_cross_entropy_with_logits(logit, y[:, idx].unsqueeze(-1).expand(L, bs, G),
                                                      reduction="none")
            loss = ((loss * mb).sum(1) / mb.sum(0).clamp_min(1)).sum()
            for p_ in params:
                p_.grad = None
            loss.backward()
            adam.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item() / (G * L):.4f}", refresh=False)
    with torch.no_grad():
        w1g = w1.view(L, Fdim, G, hidden).permute(2, 0, 1, 3)  # [G, L, F, h]
        b1g = b1.view(L, G, hidden).transpose(0, 1)  # [G, L, h]
        w1f = w1g / sd.view(1, L, Fdim, 1)
        b1f = b1g - torch.einsum("lf,glfh->glh", (mu / sd).view(L, Fdim), w1g)
        w2g = w2.view(L, G, hidden).transpose(0, 1)
        b2g = b2.view(L, G).T
        return tuple(t.detach().contiguous() for t in (w1f, b1f, w2g, b2g))


def mlp_probs(w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
              X: torch.Tensor) -> torch.Tensor:
    """[L, N] probabilities of one set of per-layer MLPs on features X [L, N, F]."""
    with torch.no_grad():
        z = torch.baddbmm(b1.unsqueeze(1), X, w1).relu()
        return torch.sigmoid(torch.bmm(z, w2.unsqueeze(-1)).squeeze(-1) + b2.unsqueeze(1))
