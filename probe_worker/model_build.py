"""A probe worker's model of a weight version: the architecture a manifest names, given the version's tensors.

The rules live in trainer.models (causal_lm: which configs and classes a manifest may name; params: the canonical
parameter order and its hash); probe_worker.cache builds every loaded version here, from verified shards or a
ledger replay.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.models.causal_lm import manifest_model_config, transformers_class
from trainer.models.params import canonical_parameters, param_order_hash
from wire.messages import VersionManifest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_config(model_config_json: dict[str, Any]):
    """The `transformers` config a manifest names: trainer.models.causal_lm.manifest_model_config (one place)."""
    return manifest_model_config(model_config_json)


def model_class(name: str) -> type[torch.nn.Module]:
    """The `transformers` model class called `name`: trainer.models.causal_lm.transformers_class (one place).
    Raises ValueError for a name that is not a PreTrainedModel class."""
    return transformers_class(name)


@torch.no_grad()
def build_from_tensors(manifest: VersionManifest, tensors: dict[str, torch.Tensor],
                       device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the manifest's model and give it `tensors` (canonical name -> tensor) as its parameters.

    The model is built on the meta device (no allocation, no init), parameters are assigned, ties are
    re-established; a model with computed buffers (e.g. rotary frequencies) is instead built for real
    on `device` and the parameters copied in. Returns the model in eval mode, requires_grad off.
    Raises ValueError if names, shapes, dtypes or the canonical-order hash differ from the manifest.
    """
    cls, config = model_class(manifest.model_class), model_config(manifest.model_config_json)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = cls(config)
    if param_order_hash(model) != manifest.param_order_hash:
        raise ValueError(f"version {manifest.version}: param_order_hash differs from the model the manifest "
                         "names; the trainer and worker disagree on the architecture")
    params = dict(canonical_parameters(model))
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        raise ValueError(f"version {manifest.version}: shards miss {missing[:3]} / add {extra[:3]}")
    want = _DTYPES[manifest.dtype]
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape) or t.dtype != want:
            raise ValueError(f"version {manifest.version}: {name} is {t.dtype}{tuple(t.shape)}, "
                             f"expected {want}{tuple(p.shape)}")
    if any(b.is_meta for b in model.buffers()):
        with torch.random.fork_rng(devices=[]), torch.device(device):
            model = cls(config)
        for name, p in canonical_parameters(model):
            p.data = tensors[name].to(device)
    else:
        model.load_state_dict({n: tensors[n].to(device) for n in params}, strict=False, assign=True)
        model.tie_weights()
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        raise ValueError(f"{manifest.model_class}: some tensors stayed unmaterialised after loading")
    model.requires_grad_(False)
    return model.eval()
