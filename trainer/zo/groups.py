"""Parameter groups by ROLE for transformers decoders (ZO-Curv second generation, DESIGN.md §2 (d)).

Roles are the block types of Wang et al., "The Sharpness Disparity Principle in Transformers for
Accelerating Language Model Pre-Training" (ICML 2025): embeddings (Emb), attention query-key (QK),
attention value-output (VO), feed-forward (FFN), normalisation (Norm), plus an untied output head (Head).
Assignment is by module / parameter *name* and *shape*, never by tensor index, so it holds for any depth:

| role | GPT2LMHeadModel | LlamaForCausalLM (SmolLM2, Mistral, Qwen2/3 share the names) | OPTForCausalLM |
| --- | --- | --- | --- |
| embed | transformer.wte, transformer.wpe | model.embed_tokens | embed_tokens, embed_positions |
| qk | attn.c_attn output columns [0, 2D) (weight) / entries [0, 2D) (bias) | self_attn.q_proj, k_proj | q_proj, k_proj |
| vo | attn.c_attn columns [2D, 3D) + attn.c_proj | self_attn.v_proj, o_proj | v_proj, out_proj |
| ffn | mlp.c_fc, mlp.c_proj | mlp.gate_proj, up_proj, down_proj | fc1, fc2 |
| norm | ln_1, ln_2, ln_f | input_layernorm, post_attention_layernorm, model.norm (Qwen3: + q_norm, k_norm) | *_layer_norm |
| head | lm_head when untied (tied: it *is* wte, listed once, role embed) | lm_head when untied | lm_head when untied |

GPT-2's fused `c_attn` is a Conv1D (y = x·W + b, W of shape (D, 3D)): the output features are W's
*columns*, ordered [q | k | v] (transformers' GPT2Attention splits `c_attn(x)` along the last dim into
three D-wide chunks). So QK is columns [0, 2D) and V is columns [2D, 3D), split along dim 1; the bias
(3D,) splits the same way along dim 0. A `Segment` records such a slice of one canonical block.

Canonical blocks are `list(model.named_parameters())` (tied weights once), as everywhere in trainer.zo.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch


class Role(str, Enum):
    """Block type of a parameter (Wang et al. 2025, plus an untied head)."""

    EMBED = "embed"
    QK = "qk"
    VO = "vo"
    FFN = "ffn"
    NORM = "norm"
    HEAD = "head"


@dataclass(frozen=True)
class Segment:
    """Part of canonical block `block` (parameter `name`): elements with index in [start, stop) along `dim`,
    or the whole tensor when dim is None. `numel` counts the segment's elements."""

    block: int
    name: str
    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        if self.dim is None:
            return n
        return n // self.shape[self.dim] * (self.stop - self.start)

    def mask(self, device=None) -> torch.Tensor | None:
        """Bool tensor of the block's shape, True on the segment; None for a whole-tensor segment."""
        if self.dim is None:
            return None
        m = torch.zeros(self.shape, dtype=torch.bool, device=device)
        idx = [slice(None)] * len(self.shape)
        idx[self.dim] = slice(self.start, self.stop)
        m[tuple(idx)] = True
        return m


@dataclass(frozen=True)
class GroupMap:
    """Role -> segments of canonical blocks. Every element of every block belongs to exactly one role.

    `block_sizes` is the numel of each canonical block (in order), for checks against a backend.
    """

    groups: dict[Role, tuple[Segment, ...]]
    block_sizes: tuple[int, ...]

    @property
    def roles(self) -> tuple[Role, ...]:
        """Roles present in the model, in Role's declaration order."""
        return tuple(r for r in Role if self.groups.get(r))

    def size(self, role: Role) -> int:
        """Number of parameter elements n_G of `role` (0 when absent)."""
        return sum(s.numel for s in self.groups.get(role, ()))

    def probe_fields(self, role: Role) -> tuple[tuple[int, ...], tuple[tuple[int, int, int, int], ...]]:
        """`role`'s elements as a probe round names them (trainer.zo.probes: ``group`` and ``group_line`` rounds):
        (sorted canonical block indices, (block, dim, start, stop) of each block the role holds only in part).

        Raises KeyError for a role the model lacks, ValueError when the role holds two segments of one block (a
        round carries one slice per block; no layout of this module's table does).
        """
        segs = self.groups[role]
        blocks = [s.block for s in segs]
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"role {role.value} holds two segments of one block; a probe round names one slice per "
                             "block")
        slices = tuple(sorted((s.block, s.dim, s.start, s.stop) for s in segs if s.dim is not None))
        return tuple(sorted(blocks)), slices


# (regex on the parameter name, role); first match wins. Fused GPT-2 c_attn is handled before these.
_RULES: tuple[tuple[str, Role], ...] = (
    (r"(^|\.)(wte|wpe|embed_tokens|embed_positions)\.weight$", Role.EMBED),
    (r"(^|\.)lm_head\.weight$", Role.HEAD),
    (r"(^|\.)(q_proj|k_proj)\.(weight|bias)$", Role.QK),
    (r"(^|\.)(v_proj|o_proj|out_proj)\.(weight|bias)$", Role.VO),
    (r"(^|\.)attn\.c_proj\.(weight|bias)$", Role.VO),
    (r"(^|\.)mlp\.(c_fc|c_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$", Role.FFN),
    (r"(^|\.)layers\.\d+\.(fc1|fc2)\.(weight|bias)$", Role.FFN),  # OPT: the MLP sits on the layer itself
    # q_norm / k_norm (Qwen3, OLMo2) normalise per head before the dot product: Norm, as every norm gain
    (r"(^|\.)(ln_\d+|ln_f|input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|"
     r"post_feedforward_layernorm|self_attn_layer_norm|final_layer_norm|q_norm|k_norm|norm)\.(weight|bias)$",
     Role.NORM),
)
_C_ATTN = re.compile(r"(^|\.)attn\.c_attn\.(weight|bias)$")


def role_of(name: str) -> Role | None:
    """Role of a non-fused parameter from its name, None if no rule matches (pure)."""
    for pat, role in _RULES:
        if re.search(pat, name):
            return role
    return None


def _split_c_attn(block: int, name: str, shape: tuple[int, ...]) -> list[tuple[Role, Segment]]:
    """QK = output features [0, 2D), V = [2D, 3D) of GPT-2's fused c_attn (module docstring)."""
    if name.endswith("weight"):
        if len(shape) != 2 or shape[1] != 3 * shape[0]:
            raise ValueError(f"{name}: expected a Conv1D weight of shape (D, 3D), got {shape}")
        dim, d = 1, shape[0]
    else:
        if len(shape) != 1 or shape[0] % 3:
            raise ValueError(f"{name}: expected a bias of shape (3D,), got {shape}")
        dim, d = 0, shape[0] // 3
    return [(Role.QK, Segment(block, name, shape, dim, 0, 2 * d)),
            (Role.VO, Segment(block, name, shape, dim, 2 * d, 3 * d))]


def assign_roles(named_params: Sequence[tuple[str, torch.Tensor]]) -> GroupMap:
    """GroupMap of canonical `named_params` (list(model.named_parameters())).

    Raises ValueError naming the first parameter no rule covers, in canonical order (an architecture this table does not know:
    add its names to _RULES rather than guessing) or a fused c_attn of an unexpected shape.
    """
    groups: dict[Role, list[Segment]] = {r: [] for r in Role}
    unknown = []
    for i, (name, p) in enumerate(named_params):
        shape = tuple(p.shape)
        if _C_ATTN.search(name):
            for role, seg in _split_c_attn(i, name, shape):
                groups[role].append(seg)
            continue
        role = role_of(name)
        if role is None:
            unknown.append(name)
            continue
        groups[role].append(Segment(i, name, shape))
    if unknown:
        more = f" (and {len(unknown) - 1} more: {', '.join(unknown[1:4])}{' ...' if len(unknown) > 4 else ''})"
        raise ValueError(f"ZO-Curv cannot place parameter {unknown[0]!r} in a block role (embed, qk, vo, ffn, norm, "
                         f"head){more if len(unknown) > 1 else ''}; trainer.zo.groups knows GPT-2, Llama-family "
                         "(Llama, SmolLM2, Mistral, Qwen2/3), Gemma 3 and OPT names")
    return GroupMap({r: tuple(s) for r, s in groups.items() if s},
                    tuple(p.numel() for _, p in named_params))


def model_roles(model: torch.nn.Module) -> GroupMap:
    """`assign_roles(list(model.named_parameters()))`."""
    return assign_roles(list(model.named_parameters()))


def block_multipliers(gmap: GroupMap, s: Mapping[Role, float],
                      devices: Sequence[torch.device | str] | None = None) -> list[float | torch.Tensor]:
    """Per canonical block, the lr multiplier to broadcast over it: a float when the whole block has one
    role, else a float32 tensor broadcastable to the block (e.g. (1, 3D) for c_attn's weight, (3D,) for its
    bias). Roles missing from `s` get 1. `devices[i]`: where block i's tensor multiplier lives (default cpu).
    """
    out: list[float | torch.Tensor] = [1.0] * len(gmap.block_sizes)
    parts: dict[int, list[tuple[Segment, float]]] = {}
    for role, segs in gmap.groups.items():
        for seg in segs:
            if seg.dim is None:
                out[seg.block] = float(s.get(role, 1.0))
            else:
                parts.setdefault(seg.block, []).append((seg, float(s.get(role, 1.0))))
    for b, segs in parts.items():
        seg0 = segs[0][0]
        bshape = [1] * len(seg0.shape)
        bshape[seg0.dim] = seg0.shape[seg0.dim]
        t = torch.ones(bshape, dtype=torch.float32, device=devices[b] if devices else "cpu")
        for seg, val in segs:
            idx = [slice(None)] * len(bshape)
            idx[seg.dim] = slice(seg.start, seg.stop)
            t[tuple(idx)] = val
        out[b] = float(t.flatten()[0]) if bool((t == t.flatten()[0]).all()) else t
    return out
