"""GPT-2 presets, canonical parameter order, deterministic init and safetensors I/O (CPU, fast)."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2LMHeadModel

from trainer.models import (
    PRESETS,
    build_model,
    canonical_parameters,
    flatten_params,
    get_preset,
    load_safetensors_into,
    num_params,
    param_offsets,
    param_order_hash,
    read_safetensors_metadata,
    save_safetensors_model,
    unflatten_into_,
)

# Hand-computed: V*D + P*D + L*(12 D^2 + 13 D) + 2 D with V = 50257.
EXPECTED_COUNTS = {
    "gpt2-tiny": 3_216_448 + 16_384 + 4 * 49_984 + 128,  # = 3,432,896
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}
SHAPES = {  # (n_layer, n_head, n_embd, n_positions)
    "gpt2-tiny": (4, 4, 64, 256),
    "gpt2-small": (12, 12, 768, 1024),
    "gpt2-medium": (24, 16, 1024, 1024),
    "gpt2-large": (36, 20, 1280, 1024),
    "gpt2-xl": (48, 25, 1600, 1024),
}


@pytest.fixture(scope="module")
def tiny() -> GPT2LMHeadModel:
    return build_model("gpt2-tiny", seed=0)


@pytest.mark.parametrize("name", list(EXPECTED_COUNTS))
def test_preset_counts_and_shapes(name: str) -> None:
    assert EXPECTED_COUNTS["gpt2-tiny"] == 3_432_896
    model = build_model(name, device="meta")
    cfg = model.config
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_positions) == SHAPES[name]
    assert cfg.vocab_size == 50257 and cfg.tie_word_embeddings
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.0
    assert num_params(model) == EXPECTED_COUNTS[name] == PRESETS[name].num_params()
    # named_parameters lists the tied lm_head once, under the embedding's name.
    names = [n for n, _ in canonical_parameters(model)]
    assert "lm_head.weight" not in names and names[0] == "transformer.wte.weight"
    assert model.lm_head.weight is model.transformer.wte.weight


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="gpt2-tiny, gpt2-small, gpt2-medium, gpt2-large, gpt2-xl"):
        build_model("gpt3")
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("GPT2-small")
    with pytest.raises(TypeError, match="floating"):
        build_model("gpt2-tiny", dtype=torch.int32, device="meta")


def test_param_order_hash_stable_dtype_free_and_architecture_sensitive(tiny) -> None:
    h = param_order_hash(tiny)
    assert h == param_order_hash(build_model("gpt2-tiny", seed=5))
    assert h == param_order_hash(build_model("gpt2-tiny", dtype=torch.bfloat16))
    assert h == param_order_hash(build_model("gpt2-tiny", device="meta"))
    # The documented format, rebuilt by hand: sha256 of compact JSON [[name, shape], ...] in order.
    d, layers = 64, []
    for i in range(4):
        b = f"transformer.h.{i}."
        layers += [[b + "ln_1.weight", [d]], [b + "ln_1.bias", [d]],
                   [b + "attn.c_attn.weight", [d, 3 * d]], [b + "attn.c_attn.bias", [3 * d]],
                   [b + "attn.c_proj.weight", [d, d]], [b + "attn.c_proj.bias", [d]],
                   [b + "ln_2.weight", [d]], [b + "ln_2.bias", [d]],
                   [b + "mlp.c_fc.weight", [d, 4 * d]], [b + "mlp.c_fc.bias", [4 * d]],
                   [b + "mlp.c_proj.weight", [4 * d, d]], [b + "mlp.c_proj.bias", [d]]]
    desc = ([["transformer.wte.weight", [50257, d]], ["transformer.wpe.weight", [256, d]]] + layers
            + [["transformer.ln_f.weight", [d]], ["transformer.ln_f.bias", [d]]])
    assert h == hashlib.sha256(json.dumps(desc, separators=(",", ":")).encode()).hexdigest()
    # Pinned: manifests written by other components store this value.
    assert h == "615fc4ef6b47becfc04fa0465b1b8e369f4eaca47542f82437ad124d5dd187dd"
    hashes = {param_order_hash(build_model(n, device="meta")) for n in PRESETS}
    assert len(hashes) == len(PRESETS)
    # One changed dimension (n_positions 256 -> 512, only wpe's shape) changes the hash.
    cfg = get_preset("gpt2-tiny").config()
    cfg.n_positions = 512
    with torch.device("meta"):
        other = GPT2LMHeadModel(cfg)
    assert param_order_hash(other) != h
    # An untied head adds lm_head.weight to the canonical order.
    cfg = get_preset("gpt2-tiny").config()
    cfg.tie_word_embeddings = False
    with torch.device("meta"):
        untied = GPT2LMHeadModel(cfg)
    assert param_order_hash(untied) != h


def test_offsets_flatten_unflatten(tiny) -> None:
    params = canonical_parameters(tiny)
    offsets = param_offsets(tiny)
    d = num_params(tiny)
    assert offsets[0] == 0 and len(offsets) == len(params)
    ends = offsets[1:] + [d]
    assert all(e - o == p.numel() for o, e, (_, p) in zip(offsets, ends, params))
    flat = flatten_params(tiny)
    assert flat.shape == (d,) and flat.dtype == torch.float32
    for o, (_, p) in zip(offsets, params):
        assert torch.equal(flat[o : o + p.numel()], p.detach().reshape(-1))

    other = build_model("gpt2-tiny", seed=1)
    assert not torch.equal(flatten_params(other), flat)
    unflatten_into_(other, flat)
    assert torch.equal(flatten_params(other), flat)
    assert other.lm_head.weight is other.transformer.wte.weight
    assert torch.equal(other.lm_head.weight, tiny.transformer.wte.weight)

    with pytest.raises(ValueError, match=f"shape \\({d},\\)"):
        unflatten_into_(other, flat[:-1])
    with pytest.raises(TypeError):
        unflatten_into_(other, flat.numpy())
    other.transformer.ln_f.weight.data = other.transformer.ln_f.weight.data.double()
    with pytest.raises(ValueError, match="mixed dtypes"):
        flatten_params(other)
    assert flatten_params(other, dtype=torch.float32).dtype == torch.float32


def test_build_deterministic_and_rng_neutral(tiny) -> None:
    gen_state = torch.get_rng_state()
    again = build_model("gpt2-tiny", seed=0)
    assert torch.equal(torch.get_rng_state(), gen_state)
    assert torch.equal(flatten_params(again), flatten_params(tiny))
    assert not torch.equal(flatten_params(build_model("gpt2-tiny", seed=1)), flatten_params(tiny))
    # Reduced-precision builds are the fp32 build rounded once.
    bf = build_model("gpt2-tiny", seed=0, dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(flatten_params(bf), flatten_params(tiny).to(torch.bfloat16))
    # After an unrelated draw, the build still does not touch the global RNG.
    torch.rand(3)
    state = torch.get_rng_state()
    build_model("gpt2-tiny", seed=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_init_statistics(tiny) -> None:
    """GPT-2 init: N(0, 0.02^2), residual projections N(0, (0.02/sqrt(2L))^2), LN gain 1, biases 0."""
    p = dict(canonical_parameters(tiny))
    assert p["transformer.wte.weight"].std().item() == pytest.approx(0.02, rel=0.01)  # 6.4M samples
    assert p["transformer.wte.weight"].mean().abs().item() < 1e-4
    proj = torch.cat([p[f"transformer.h.{i}.{m}.c_proj.weight"].reshape(-1) for i in range(4) for m in ("attn", "mlp")])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.01)
    assert p["transformer.h.0.attn.c_attn.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    for name, t in p.items():
        if name.endswith(".bias"):
            assert torch.count_nonzero(t) == 0, name
        elif ".ln_" in name:
            assert torch.all(t == 1.0), name
    # Distinct tensors get distinct streams (no two weights share draws).
    assert not torch.equal(p["transformer.h.0.mlp.c_fc.weight"], p["transformer.h.1.mlp.c_fc.weight"])


def test_forward_deterministic_and_loss_near_uniform(tiny) -> None:
    x = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a = tiny(x).logits
        b = tiny(x).logits
        tiny.train()  # dropout is 0, so train mode is just as deterministic
        c = tiny(x).logits
        tiny.eval()
        loss = tiny(x, labels=x).loss.item()
    assert a.shape == (2, 64, 50257)
    assert torch.equal(a, b) and torch.equal(a, c)
    # labels= is the mean next-token cross-entropy (logits at t predict token t+1).
    ref = torch.nn.functional.cross_entropy(a[:, :-1].reshape(-1, 50257), x[:, 1:].reshape(-1))
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    # Small init -> near-uniform predictions: loss ~ ln(V) = 10.825.
    assert abs(loss - math.log(50257)) < 0.2


def test_gpt2_small_on_cpu() -> None:
    state = torch.get_rng_state()
    model = build_model("gpt2-small", seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert num_params(model) == 124_439_808
    assert model.lm_head.weight is model.transformer.wte.weight
    assert param_order_hash(model) == param_order_hash(build_model("gpt2-small", device="meta"))
    proj = model.transformer.h[11].mlp.c_proj.weight
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(24), rel=0.01)


def test_safetensors_round_trip_bit_exact(tiny, tmp_path) -> None:
    path = save_safetensors_model(tiny, tmp_path / "w.safetensors", metadata={"step": "12"})
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    assert sorted(keys) == sorted(n for n, _ in canonical_parameters(tiny))
    assert "lm_head.weight" not in keys
    meta = read_safetensors_metadata(path)
    assert meta["param_order_hash"] == param_order_hash(tiny) and meta["step"] == "12"

    other = build_model("gpt2-tiny", seed=9)
    assert load_safetensors_into(other, path)["step"] == "12"
    assert torch.equal(flatten_params(other), flatten_params(tiny))
    for (n1, p1), (n2, p2) in zip(canonical_parameters(other), canonical_parameters(tiny)):
        assert n1 == n2 and torch.equal(p1.view(torch.int32), p2.view(torch.int32)), n1  # bitwise
    assert other.lm_head.weight is other.transformer.wte.weight
    assert torch.equal(other.lm_head.weight, tiny.lm_head.weight)

    bf = build_model("gpt2-tiny", seed=9, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="strict_dtype=False"):
        load_safetensors_into(bf, path)
    load_safetensors_into(bf, path, strict_dtype=False)
    assert torch.equal(flatten_params(bf), flatten_params(tiny).to(torch.bfloat16))
    bf_path = save_safetensors_model(tiny, tmp_path / "bf.safetensors", dtype=torch.bfloat16)
    bf2 = build_model("gpt2-tiny", seed=4, dtype=torch.bfloat16)
    load_safetensors_into(bf2, bf_path)
    assert torch.equal(flatten_params(bf2), flatten_params(bf))

    cfg = get_preset("gpt2-tiny").config()
    cfg.n_layer = 3
    with pytest.raises(ValueError, match="missing"):
        load_safetensors_into(GPT2LMHeadModel(cfg), path)
    cfg = get_preset("gpt2-tiny").config()
    cfg.n_positions = 128
    with pytest.raises(ValueError, match="shape"):
        load_safetensors_into(GPT2LMHeadModel(cfg), path)
    with pytest.raises(FileNotFoundError):
        load_safetensors_into(other, tmp_path / "absent.safetensors")
    with pytest.raises(TypeError, match="str to str"):
        save_safetensors_model(tiny, tmp_path / "x.safetensors", metadata={"step": 3})
