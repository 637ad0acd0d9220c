"""`build_causal_lm`: a run's causal LM from `--model`, a GPT-2 preset name or a local transformers folder.

A folder holds `config.json` (any causal-LM class transformers builds from its config through
`AutoModelForCausalLM`'s mapping: GPT-2, Llama/SmolLM2, Qwen2/Qwen3, Gemma 3, ...), tokenizer files and
optionally safetensors weights (`model.safetensors` or a sharded index). With weights the run continues from
them; without, the model starts from the seeded, counter-based init below. Nothing contacts a model hub
(`local_files_only=True`).

Init without weights (`init_seeded_`): every parameter of two or more dimensions (projections, embeddings,
an untied head) ~ N(0, initializer_range^2), drawn from its own `torch.Generator` seeded by
sha256(seed, parameter name) (trainer.models.gpt2.param_seed), as transformers' `_init_weights` draws them for
Llama-family models (normal(0, config.initializer_range) for nn.Linear and nn.Embedding); one-dimensional
parameters (norm gains, biases) keep the class's own deterministic constant (RMSNorm 1, Gemma's zero-centred
gain 0, biases 0). So a parameter's initial value depends only on (seed, name, config), never on the build
order, the device or the global RNG, which is left untouched.

The fleet builds the same architecture from a version manifest (model_class + model_config_json, written by
fleet.publisher.manifest_config) with `build_from_manifest`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.models.presets import PRESETS

if TYPE_CHECKING:  # torch is imported where a model is built: option checks (check_model_spec) stay light
    import torch

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class ModelFolderError(ValueError):
    """A `--model` folder cannot make a run: no config.json, a class transformers cannot build, no tokenizer,
    a tokenizer larger than the embeddings, unreadable weights. One line naming the folder or file."""


@dataclass(frozen=True, eq=False)
class CausalLMInfo:
    """What `build_causal_lm` built.

    Attributes:
        spec: the `--model` value as given. label: a short printable name (the preset, or the folder's name) for
            run folders and wire messages (<= 64 ASCII characters).
        model_class: the transformers class name (e.g. "LlamaForCausalLM"). config: its `PretrainedConfig`.
        folder: the resolved folder, None for a preset. tokenizer: trainer.data.model_tokenizer.ModelTokenizer
            (loaded lazily by `tokenizer`). vocab_size: rows of the input embedding.
        context: the longest sequence the model takes (n_positions / max_position_embeddings), tokens.
        weights_loaded: True when the folder's weights were loaded, False for the seeded init.
    """

    spec: str
    label: str
    model_class: str
    config: Any
    folder: Path | None
    vocab_size: int
    context: int
    weights_loaded: bool

    @property
    def tokenizer(self):
        """The model's tokenizer (trainer.data.tokenizer_for); raises TokenizerError when it has none."""
        from trainer.data.model_tokenizer import tokenizer_for

        return tokenizer_for(self.spec)


def is_preset(spec: str) -> bool:
    """True when `spec` names a GPT-2 preset (trainer.models.PRESETS) rather than a folder."""
    return spec in PRESETS


def model_label(spec: str) -> str:
    """Short printable name of `--model`: the preset, or the folder's name ([A-Za-z0-9._-], <= 64 chars)."""
    if is_preset(spec):
        return spec
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(spec).rstrip("/")).name).strip("-.")
    return (name or "model")[:64]


def context_of(config: Any) -> int:
    """Longest input of a transformers config in tokens: n_positions (GPT-2) or max_position_embeddings.

    Raises ModelFolderError when the config names neither."""
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelFolderError(f"{type(config).__name__}: no n_positions / max_position_embeddings (the context)")


def _text_config(config: Any) -> Any:
    # Multimodal configs (Gemma 3's 4B+) nest the decoder's config; the causal LM reads that one.
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def causal_lm_class(config: Any) -> type:
    """The transformers causal-LM class `AutoModelForCausalLM` builds for `config` (e.g. LlamaForCausalLM).

    Raises ModelFolderError naming the model type when transformers has no causal LM for it."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ModelFolderError(f"transformers has no causal-LM class for model_type {config.model_type!r} "
                               f"({type(config).__name__}); --model takes causal LMs (GPT-2, Llama, Qwen2/3, "
                               "Gemma 3, ...)") from None


def read_folder_config(folder: Path) -> Any:
    """The `PretrainedConfig` of a model folder, set for training here: SDPA attention, dropout 0 (ZO probes need a
    forward that is a deterministic function of (weights, batch)), no KV cache.

    Raises ModelFolderError: no config.json, or one transformers cannot read."""
    from transformers import AutoConfig

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"--model {folder}: no config.json (save one with config.save_pretrained(folder))")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for unknown types or bad JSON
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelFolderError(f"--model {folder}/config.json: transformers cannot build it "
                               f"({type(e).__name__}: {first})") from None
    for key in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout",
                "dropout", "summary_first_dropout"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def has_weights(folder: Path) -> bool:
    """True when the folder holds safetensors weights (model.safetensors or a sharded index)."""
    return any((Path(folder) / n).is_file() for n in WEIGHT_FILES)


def init_seeded_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter of >= 2 dimensions with N(0, initializer_range^2) from a generator seeded by
    (seed, name) (module docstring); 1-D parameters keep their constant init. Values are drawn in float32 on the
    CPU, then copied into each parameter's dtype and device. Touches no global RNG.

    Raises ValueError when a 1-D parameter is not constant (a class whose init this rule does not cover)."""
    import torch

    from trainer.models.gpt2 import param_seed
    from trainer.models.params import canonical_parameters

    std = float(getattr(_text_config(model.config), "initializer_range", 0.02))
    with torch.no_grad():
        _init_blocks(torch, canonical_parameters(model), seed, std, param_seed)


def _init_blocks(torch, named, seed: int, std: float, param_seed) -> None:
    for name, p in named:
        if p.dim() >= 2:
            gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
        elif p.numel() and not bool((p == p.reshape(-1)[0]).all()):
            raise ValueError(f"{name}: a 1-D parameter with a random init; the seeded init covers constants only")


def _build(cls: type, config: Any, device: str | torch.device) -> torch.nn.Module:
    import torch

    # fork_rng: the class's own random init (overwritten) must not consume the caller's RNG. Built for real on
    # the CPU so computed buffers (rotary frequencies) and constant gains exist, then moved.
    with torch.random.fork_rng(devices=[]):
        model = cls(config)
    model.loss_type = "ForCausalLM"
    return model.to(device)


def build_causal_lm(spec: str, seed: int = 0, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[torch.nn.Module, CausalLMInfo]:
    """Build the model `--model spec` names, in eval mode, and describe it.

    Args:
        spec: a GPT-2 preset (trainer.models.PRESETS: trainer.models.gpt2.build_model) or a transformers folder.
        seed: init seed when there are no weights: same (spec, seed) gives bit-identical weights everywhere.
        device, dtype: where and in which float dtype the parameters live (default float32; weights are read as
            float32).

    Returns:
        (model, CausalLMInfo). The model's forward takes input_ids (B, T) int64, T <= info.context, and returns
        logits (B, T, info.vocab_size).

    Raises:
        ModelFolderError: `spec` is neither a preset nor a folder; see read_folder_config / causal_lm_class; the
            weights do not load. ValueError: unknown preset.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if is_preset(spec):
        from trainer.models.gpt2 import build_model

        model = build_model(spec, seed=seed, dtype=dtype, device=device)
        return model, CausalLMInfo(spec, spec, type(model).__name__, model.config, None,
                                   model.config.vocab_size, model.config.n_positions, False)
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ModelFolderError(f"--model {spec!r} is neither a model preset ({', '.join(PRESETS)}) nor a folder")
    folder = folder.resolve()
    config = read_folder_config(folder)
    cls = causal_lm_class(config)
    loaded = has_weights(folder)
    if loaded:
        try:
            with torch.random.fork_rng(devices=[]):
                model = cls.from_pretrained(folder, config=config, dtype=torch.float32, local_files_only=True)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ModelFolderError(f"--model {folder}: the weights do not load ({type(e).__name__}: {first})") from None
        model.loss_type = "ForCausalLM"
        model.to(device)
    else:
        model = _build(cls, config, device)
        init_seeded_(model, seed)
    model.tie_weights()
    model.to(dtype).eval()
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return model, CausalLMInfo(spec, model_label(spec), type(model).__name__, model.config, folder, vocab,
                               context_of(_text_config(model.config)), loaded)


def build_from_manifest(model_class: str, config_json: dict[str, Any], *, device: str | torch.device = "meta"
                        ) -> torch.nn.Module:
    """The architecture a version manifest names (fleet.publisher: model_class + model_config_json), eval mode.

    `device="meta"` builds shapes only (no memory, no init: the shards fill the values); any other device builds
    for real, so computed buffers (rotary frequencies) exist. The same class and config as the trainer's give the
    same canonical parameter order (trainer.models.params.param_order_hash).

    Raises ValueError: `model_class` is not a transformers PreTrainedModel class, or the config is unknown
    (probe_worker.model_build.model_config's rules: a preset or a Hugging Face config dict with model_type).
    """
    import torch

    cls = transformers_class(model_class)
    config = manifest_model_config(config_json)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        model = cls(config)
    if "ForCausalLM" in model_class or model_class == "GPT2LMHeadModel":
        model.loss_type = "ForCausalLM"
    return model.eval()


def transformers_class(name: str) -> type:
    """The `transformers` model class called `name` (e.g. "LlamaForCausalLM"). Only `PreTrainedModel` subclasses
    are accepted, so a manifest cannot name arbitrary code. Raises ValueError otherwise."""
    import transformers

    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(  # noqa: TRY004 - the name (a str) is the bad value, not its type
            f"model_class {name!r} is not a transformers model class (e.g. 'GPT2LMHeadModel')")
    return cls


def manifest_model_config(config_json: dict[str, Any]):
    """The transformers config of a manifest's `model_config_json`: {"preset": name} -> that GPT-2 preset's; any
    other dict is a Hugging Face config dict (`config.to_dict()`, with `model_type`) built by
    `AutoConfig.for_model`. An optional `attn_implementation` ("sdpa" default, "eager") picks the attention kernel,
    which must match the trainer's for bit-identical losses.

    Raises ValueError for an unknown preset or a dict without `model_type`."""
    cfg = json.loads(json.dumps(config_json))  # a deep copy: the manifest stays untouched
    attn = cfg.pop("attn_implementation", "sdpa")
    if "preset" in cfg:
        from trainer.models.presets import get_preset

        if set(cfg) != {"preset"}:
            raise ValueError(f"a preset config holds only 'preset' (and 'attn_implementation'), got {sorted(cfg)}")
        config = get_preset(str(cfg["preset"])).config()
    else:
        from transformers import AutoConfig

        if "model_type" not in cfg:
            raise ValueError("model_config_json needs 'preset' or a Hugging Face config dict with 'model_type'")
        config = AutoConfig.for_model(**cfg)
    config._attn_implementation = attn
    return config


def check_model_spec(spec: str, seq_len: int) -> None:
    """Refuse a `--model` that cannot run before anything is built or written (trainer.preflight).

    A preset: known, `seq_len` within its context. A folder: config.json readable, a causal-LM class for it, a
    tokenizer (trainer.data.tokenizer_for) whose ids fit the embeddings (len(tokenizer) <= vocab_size), `seq_len`
    within the context.

    Raises:
        ValueError (ModelFolderError / TokenizerError / an unknown preset), one line naming the folder or option.
    """
    if is_preset(spec) or not Path(spec).expanduser().is_dir():
        from trainer.models.presets import get_preset

        if not is_preset(spec) and ("/" in spec or spec.startswith(".")):
            raise ModelFolderError(f"--model {spec!r}: no such folder (and not a preset: {', '.join(PRESETS)})")
        ctx = get_preset(spec).n_positions  # ValueError for an unknown model preset
    else:
        from trainer.data.model_tokenizer import tokenizer_for

        folder = Path(spec).expanduser().resolve()
        config = _text_config(read_folder_config(folder))
        causal_lm_class(read_folder_config(folder))
        tok = tokenizer_for(str(folder))
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and tok.vocab_size > vocab:
            raise ModelFolderError(f"--model {folder}: the tokenizer has {tok.vocab_size} tokens but the model's "
                                   f"embeddings only {vocab} (config.json vocab_size); ids >= {vocab} have no row")
        ctx = context_of(config)
    if seq_len > ctx:
        raise ValueError(f"--seq-len {seq_len} exceeds {spec}'s context of {ctx} tokens")


def check_roles(spec: str) -> None:
    """Refuse, before a run starts, a `--model` whose parameters ZO-Curv's block roles (trainer.zo.groups) cannot
    all place: the message names the first one. The architecture is built on the meta device (no memory).

    Raises ValueError (see trainer.zo.groups.assign_roles), ModelFolderError for an unreadable folder."""
    import torch

    from trainer.models.params import canonical_parameters
    from trainer.zo.groups import assign_roles

    if is_preset(spec):
        from trainer.models.gpt2 import build_model

        model = build_model(spec, device="meta")
    else:
        config = read_folder_config(Path(spec).expanduser().resolve())
        cls = causal_lm_class(config)
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = cls(config)
    try:
        assign_roles(canonical_parameters(model))
    except ValueError as e:
        raise ValueError(f"--model {spec} --optimizer: {e}") from None
