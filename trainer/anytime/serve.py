"""The anytime model of a run: keep the last k versions, choose a candidate at every evaluation, serve it.

`Anytime` is the training loop's one handle (trainer.train): `publish(step, model)` after each step,
`evaluate(step, model, evaluate_fn)` at each evaluation. Candidates are scored by a `Score` callback: the
default, `InProcessScorer`, builds θ(c) from the ring into a scratch copy of the model and evaluates it on
the selection split here; with a fleet, fleet.anytime.FleetScorer sends the same candidates as eval rounds
whose weights are the mixture, built on the workers from their weight caches by the same
`trainer.anytime.ring.build_mixture` and scored by the same loss code, so the choice is the same bit for bit. The served weights go to `RUN_DIR/served.safetensors`
(`sparecycles export RUN_DIR OUT --best` writes them as a transformers folder).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.anytime.ring import CandidateSpec, VersionRing
from trainer.anytime.select import Score, Selection, select_candidate
from trainer.anytime.settings import AnytimeSettings
from trainer.data import iter_eval_batches

SERVED_NAME = "served.safetensors"


def save_served(path: Path, model: torch.nn.Module, meta: dict[str, Any]) -> None:
    """Write `model`'s parameters as `model/<name>` fp32 tensors (the checkpoint's layout, so
    trainer.export reads both alike) with `meta` as JSON under the "sparecycles" metadata key; atomic."""
    from safetensors.torch import save_file

    tensors = {f"model/{n}": p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"sparecycles": json.dumps(meta)})
    tmp.replace(path)


class InProcessScorer:
    """Scores candidates here: θ(c) built from `ring` into a scratch model, mean loss per selection batch.

    Args:
        ring: the versions (VersionRing).
        scratch: a model of the trained architecture whose weights are overwritten (eval mode).
        batches: the selection batches, a list of (x, y) int64 (B, T) tensors on the model's device.
        loss: loss(model, x, y) -> scalar tensor (nats/token).
    """

    def __init__(self, ring: VersionRing, scratch: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.ring, self.scratch, self.batches, self.loss = ring, scratch, batches, loss

    @torch.no_grad()
    def __call__(self, cands: Sequence[tuple[str, tuple[float, ...]]]) -> list[torch.Tensor]:
        out = []
        for name, coefs in cands:
            self.scratch.load_state_dict(self.ring.build(self.ring.spec(name, coefs)))
            out.append(torch.tensor([float(self.loss(self.scratch, x, y)) for x, y in self.batches],
                                    dtype=torch.float64))
        return out


class Anytime:
    """The anytime model of one run (settings: trainer.anytime.settings.AnytimeSettings).

    Args:
        settings: what to keep and score.
        select_tokens: the corpus's selection split, (N,) uint16 token ids (never the reported split).
        batch_size, seq_len: selection windows (trainer.data.iter_eval_batches), `settings.select_batches` of them.
        device: where the scratch model and the batches live.
        run_path: the run folder (served.safetensors).
        score: a fleet's scorer; None scores in process.

    Raises:
        ValueError: no selection split (`select_tokens` None).
    """

    def __init__(self, settings: AnytimeSettings, select_tokens, *, batch_size: int, seq_len: int, device: str,
                 run_path: Path, loss: Callable[..., torch.Tensor], score: Score | None = None) -> None:
        if select_tokens is None:
            raise ValueError("the anytime model needs a corpus with a selection split (e.g. --corpus "
                             "classics-large): choosing on the validation split would bias what it reports")
        self.settings, self.select_tokens = settings, select_tokens
        self.batch_size, self.seq_len = batch_size, seq_len  # the selection windows' (a fleet scorer's too)
        self.ring = VersionRing(settings.k)
        self.batches = [(x.to(device), y.to(device))
                        for x, y in iter_eval_batches(select_tokens, batch_size, seq_len, settings.select_batches)]
        self.run_path, self.loss, self._score = Path(run_path), loss, score
        self.scratch: torch.nn.Module | None = None
        self.last: Selection | None = None

    def score_with(self, score: Score) -> None:
        """Score candidates with `score` from now on (a fleet's: fleet.anytime.FleetScorer) instead of in process."""
        self._score = score

    def publish(self, step: int, model: torch.nn.Module) -> None:
        """Keep the weights after `step` optimizer steps as a version when step % publish_every == 0."""
        if step % self.settings.publish_every == 0:
            self.ring.publish(step, model.state_dict())

    def evaluate(self, step: int, model: torch.nn.Module,
                 evaluate_fn: Callable[[torch.nn.Module], dict[str, float]]) -> dict[str, Any]:
        """Choose and serve a candidate at `step` (the current weights are published first if they are not
        the newest version); returns the fields to log beside the raw evaluation:

        served_val_loss (the winner's reported validation loss, from `evaluate_fn`), served (its name),
        served_coefs / served_versions, served_sel_loss and raw_sel_loss (selection split), served_z (paired
        z of served vs raw on the selection batches), quad_ok / quad_resid / quad_pred / quad_meas (the fit),
        pulled (1 when `pull` moved the trainer to the served weights).
        """
        if not self.ring.versions or self.ring.versions[-1] != step:
            self.ring.publish(step, model.state_dict())
        if self.scratch is None:
            self.scratch = copy.deepcopy(model).eval()
        score = self._score or InProcessScorer(self.ring, self.scratch, self.batches, self.loss)
        sel = select_candidate(len(self.ring), self.settings, score)
        self.last = sel
        spec = self.ring.spec(sel.winner.name, sel.winner.coefs)
        with torch.no_grad():
            self.scratch.load_state_dict(self.ring.build(spec))
        served_val = evaluate_fn(self.scratch)["val_loss"]
        rec: dict[str, Any] = {
            "served_val_loss": served_val, "served": sel.winner.name, "served_sel_loss": sel.winner.mean,
            "raw_sel_loss": sel.raw.mean, "served_z": _finite(sel.paired_z()),
            "served_versions": list(spec.versions), "served_coefs": [round(c, 6) for c in spec.coefs],
            "candidates": len(sel.scored),
        }
        if sel.fit is not None:
            rec.update(quad_ok=int(sel.fit.ok), quad_resid=sel.fit.residual_rms, quad_anchors=list(sel.anchors))
            if sel.quad_pred is not None:
                rec.update(quad_pred=sel.quad_pred, quad_meas=sel.quad_meas)
        save_served(self.run_path / SERVED_NAME, self.scratch,
                    {"step": step, "candidate": sel.winner.name, "versions": list(spec.versions),
                     "coefs": list(spec.coefs), "served_val_loss": served_val})
        if self.settings.pull and sel.winner.name != "raw" and sel.paired_z() > self.settings.pull_z:
            self._pull(model, spec)
            rec["pulled"] = 1
        return rec

    @torch.no_grad()
    def _pull(self, model: torch.nn.Module, spec: CandidateSpec) -> None:
        """Move the trainer's weights to the served candidate in place (optimizer state kept: the parameter
        tensors stay the same objects); the ring restarts from the new weights."""
        weights = self.ring.build(spec)
        for name, p in model.named_parameters():
            p.copy_(weights[name])
        step = self.ring.versions[-1]
        self.ring.clear()
        self.ring.publish(step, model.state_dict())


def _finite(z: float) -> float:
    return z if math.isfinite(z) else 1e9
