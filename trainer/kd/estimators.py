"""KD estimators: pure functions of the student's logits and the teacher's targets.

Notation: student logits s (N, V), teacher logits z (N, V) over N token positions, temperature tau;
p = softmax(z / tau) (the teacher), q = softmax(s / tau) (the student at the same temperature). Every loss is in
nats per position, averaged over positions, scaled by tau**2 so gradients keep their magnitude across tau
(Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural Network", section 2).

- `full_kl`: tau**2 * KL(p || q) = tau**2 * sum_i p_i (log p_i - log q_i), the full-vocabulary target.
- `sampled_ce`: S ids i_1..i_S ~ p with replacement; tau**2 * (1/S) sum_s -log q(i_s). Its expectation is
  tau**2 * CE(p, q) = tau**2 * (KL(p || q) + H(p)); H(p) does not depend on the student, so value - H(p) and the
  gradient are unbiased for full_kl's (a Monte Carlo estimate of an expectation under p; the unbiasedness of
  sampled-id KD is Anshumann et al. 2025, "Sparse Logit Sampling: Accelerating Knowledge Distillation in LLMs",
  arXiv:2503.16870, section 3).
- `topk_ce`: the teacher's k most probable ids, probabilities renormalised over them, p~_i = p_i / sum_{j in K} p_j;
  tau**2 * sum_{i in K} -p~_i log q_i. Biased (the tail is dropped); the same paper, section 2.2, names this bias
  and measures it.
- `kd_loss`: (1 - alpha) * CE(labels) + alpha * KD.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wire.kd_targets import KDTargets


def full_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """tau**2 * mean over positions of KL(softmax(z/tau) || softmax(s/tau)); logits (..., V), returns a scalar."""
    s = student_logits.reshape(-1, student_logits.shape[-1]).float() / temperature
    z = teacher_logits.reshape(-1, teacher_logits.shape[-1]).float() / temperature
    logq, logp = F.log_softmax(s, -1), F.log_softmax(z, -1)
    return temperature**2 * (logp.exp() * (logp - logq)).sum(-1).mean()


def full_ce(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """tau**2 * mean over positions of CE(softmax(z/tau), softmax(s/tau)) = full_kl + tau**2 * H(p); scalar."""
    s = student_logits.reshape(-1, student_logits.shape[-1]).float() / temperature
    z = teacher_logits.reshape(-1, teacher_logits.shape[-1]).float() / temperature
    return temperature**2 * -(F.softmax(z, -1) * F.log_softmax(s, -1)).sum(-1).mean()


def sparse_ce(student_logits: torch.Tensor, targets: KDTargets) -> torch.Tensor:
    """The sparse estimator for `targets.kind`: `sampled` -> mean of -log q over the S ids (weights 1/S each);
    `topk` -> -sum p~ log q with p~ = exp(logp) renormalised over the k ids. Scaled by tau**2.

    student_logits: (B, T, V) any float dtype; targets.ids/logp: (B, T, K). Returns a float32 scalar.
    """
    tau = targets.temperature
    v = student_logits.shape[-1]
    logq = F.log_softmax(student_logits.reshape(-1, v).float() / tau, -1)
    ids = targets.ids.reshape(-1, targets.ids.shape[-1]).to(logq.device)
    picked = logq.gather(-1, ids)  # (N, K)
    if targets.kind == "sampled":
        w = torch.full_like(picked, 1.0 / ids.shape[-1])
    else:
        w = torch.softmax(targets.logp.reshape(ids.shape).to(logq.device), -1)  # renormalised over the k ids
    return tau**2 * -(w * picked).sum(-1).mean()


def kd_loss(ce: torch.Tensor, kd: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """(1 - alpha) * ce + alpha * kd; `kd` None (targets missing or rejected) -> ce alone."""
    if kd is None:
        return ce
    return (1.0 - alpha) * ce + alpha * kd
