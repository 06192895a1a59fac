"""One definition per LoRA kind: `LORA_KINDS`, the registry every other part reads.

A `LoraKind` holds all that the trainer, the config, the planner, the sampler and the file layouts know of an adapter
kind: how peft builds it from the config's `lora` section (`build`: the trainer injects it, the planner injects the
same on the meta model), the names of its factors in files and in peft's state dict, how its update and rank are
computed, where a baked scale goes, how a fused layer stacks it, the peft config a file's header holds, and which
loaders take it. `lora.type` in the config is a key of `LORA_KINDS`; trainer/train/model.py, trainer/lora_format/
(reading, writing, converting), trainer/planner/prediction.py, trainer/sampling/lora.py, trainer/train/method.py and
trainer/merge.py read the spec. So a new kind is one spec here (peft has to build it), and tests/test_lora_kinds.py
builds, saves and loads every spec and checks the planner's count of its parameters.

DoRA is not a kind: it is plain LoRA's variant (`lora.dora`, `dora` below), a trained magnitude per output channel
that files hold as `magnitude` beside LoRA's factors.

Factor names. Inside dittrain a module's tensors have canonical names: LoRA's `down` / `up` / `magnitude` (peft's
`lora_A.weight` / `lora_B.weight` / `lora_magnitude_vector`, kohya's and ComfyUI's `lora_down.weight` /
`lora_up.weight`), LoKr's and LoHa's LyCORIS names (`lokr_w1`, `hada_w1_a`, ...), which peft and ComfyUI share.

Nothing here imports torch or peft at import time: config.py reads the names and docs, and importing the config
stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..config import LoraConfig
    from ._core import Module

Tensors = dict[str, "torch.Tensor"]


@dataclass(frozen=True, kw_only=True)
class LoraKind:
    name: str
    """`lora.type`, and the kind a file's modules are read as."""
    label: str
    """Its name in messages (LoRA, LoKr, LoHa)."""
    doc: str
    """What it is, for the config's description of `lora.type`."""
    peft_type: str
    """peft's PeftType name, as a file's header stores it (`peft_type` in `lora_adapter_metadata`)."""
    build: Callable[[LoraConfig, list[str]], Any]
    """The peft config for the `lora` section and target modules; every kind starts at a zero update."""
    file_names: dict[str, str]
    """Key suffix in a file (any layout) -> canonical factor name."""
    required: tuple[tuple[str, ...], ...]
    """Canonical factors a module must have: one of each tuple."""
    rank: Callable[[Tensors], int | None]
    """The rank ComfyUI divides alpha by (a `.alpha` tensor); None where it applies no alpha (a LoKr with two full
    factors)."""
    delta: Callable[[Tensors], torch.Tensor]
    """The weight update (out, in) of fp32 canonical factors, before the scale (and without DoRA's rescaling)."""
    bake_into: tuple[str, ...]
    """The factor a scale is multiplied into, the first present of these."""
    header: Callable[[dict[str, Module], int], dict]
    """The peft config fields a file's header holds for these modules with the scale baked in (alpha = r = `r0`,
    besides `r`, `target_modules` and the rank / alpha patterns)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Key suffixes of this kind that are not read, with the reason."""
    peft_names: dict[str, str] = field(default_factory=dict)
    """Canonical name -> peft's state-dict suffix, where they differ."""
    original_names: dict[str, str] = field(default_factory=dict)
    """Canonical name -> the comfy / kohya suffix, where they differ."""
    pairs: tuple[tuple[str, str], ...] | None = None
    """(input-side, output-side) factor pairs: a fused original layer (q/k/v in one Linear) stacks the parts' input
    factors and puts their output factors block-diagonally; None: it cannot be stacked (a sum of Kronecker products
    is not one)."""
    config_r: Callable[[Tensors, int | None], int] | None = None
    """peft's `r` for a module (its tensors and a known r): None for the `rank`."""
    scales_by_config_r: bool = False
    """peft scales its update by alpha / the config's r, not the tensors' rank (LoKr)."""
    dora: bool = False
    """It has the DoRA variant (`lora.dora`)."""
    loads_with_diffusers: bool = False
    """diffusers' `load_lora_weights` takes its files; else `dittrain sample` loads them with peft
    (trainer/sampling/lora.py `load_peft_file`) and the trainer says so after saving."""
    mergeable: bool = False
    """`dittrain merge` folds it into the weights (trainer/merge.py)."""
    compute_dtype_forward: bool = False
    """`lora.compute_dtype: auto` runs its branch in the model's dtype (trainer/train/model.py `ComputeDtypeLora`;
    the planner counts the same); else peft's forward in fp32."""

    def r_of(self, t: Tensors, known: int | None = None) -> int:
        """peft's `r` for a module with tensors `t` (`known`: the r a header gave, if any)."""
        return self.config_r(t, known) if self.config_r is not None else self.rank(t)


# ---------------------------------------------------------------------------------------------- LoRA


def _lora_build(lc, targets):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=targets,
                          init_lora_weights=True, use_dora=lc.dora)


def _lora_header(modules, r0):
    return {"peft_type": "LORA", "lora_alpha": r0, "use_dora": any("magnitude" in m.t for m in modules.values()),
            "lora_dropout": 0.0, "bias": "none", "init_lora_weights": True}


LORA = LoraKind(
    name="lora", label="LoRA", peft_type="LORA", build=_lora_build, header=_lora_header,
    doc="lora (B @ A; loads with diffusers' load_lora_weights)",
    file_names={"lora_A.weight": "down", "lora_down.weight": "down", "lora_B.weight": "up", "lora_up.weight": "up",
                "lora_magnitude_vector": "magnitude"},
    refused={"dora_scale": "ComfyUI's DoRA (dora_scale) is read by ComfyUI only: turning it back into peft's "
                           "magnitudes needs the base weights (read the diffusers-layout file of the same run instead)",
             "lora_B.bias": "LoRA biases are not supported", "lora_mid.weight": "conv LoRA (lora_mid) is not supported"},
    required=(("down",), ("up",)),
    peft_names={"down": "lora_A.weight", "up": "lora_B.weight", "magnitude": "lora_magnitude_vector"},
    original_names={"down": "lora_down.weight", "up": "lora_up.weight"},
    rank=lambda t: t["down"].shape[0],
    delta=lambda t: t["up"] @ t["down"],
    bake_into=("up",),
    pairs=(("down", "up"),),
    dora=True, loads_with_diffusers=True, mergeable=True, compute_dtype_forward=True,
)

# ---------------------------------------------------------------------------------------------- LoKr


def _lokr_build(lc, targets):
    from peft import LoKrConfig

    return LoKrConfig(r=lc.rank, alpha=lc.alpha, rank_dropout=lc.dropout, target_modules=targets, init_weights=True)


def _lycoris_header(peft_type: str):
    def header(modules, r0):
        out = {"peft_type": peft_type, "alpha": r0, "rank_dropout": 0.0, "module_dropout": 0.0, "init_weights": True}
        if peft_type == "LOKR":
            out["decompose_both"] = any("lokr_w1_a" in m.t for m in modules.values())
        return out

    return header


def _lokr_rank(t):
    for name in ("lokr_w2_b", "lokr_w1_b"):  # ComfyUI's order: w2's rank wins
        if name in t:
            return t[name].shape[0]
    return None


def _lokr_delta(t):
    import torch

    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    return torch.kron(w1, w2)


def _lokr_r(t, known):
    """w2's rank when it is factored; else the r a header gave, or (not said anywhere) w2's larger side."""
    return t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else known or max(t["lokr_w2"].shape)


_LOKR_NAMES = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")
LOKR = LoraKind(
    name="lokr", label="LoKr", peft_type="LOKR", build=_lokr_build, header=_lycoris_header("LOKR"),
    doc="lokr (Kronecker product, LyCORIS LoKr; loads with peft)",
    file_names={n: n for n in _LOKR_NAMES},
    refused={"lokr_t2": "Tucker (conv) LoKr factors are not supported"},
    required=(("lokr_w1", "lokr_w1_a"), ("lokr_w2", "lokr_w2_a")),
    rank=_lokr_rank, delta=_lokr_delta, bake_into=("lokr_w1", "lokr_w1_a"),
    config_r=_lokr_r, scales_by_config_r=True,
)

# ---------------------------------------------------------------------------------------------- LoHa


def _loha_build(lc, targets):
    from peft import LoHaConfig

    return LoHaConfig(r=lc.rank, alpha=lc.alpha, rank_dropout=lc.dropout, target_modules=targets, init_weights=True)


_LOHA_NAMES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOHA = LoraKind(
    name="loha", label="LoHa", peft_type="LOHA", build=_loha_build, header=_lycoris_header("LOHA"),
    doc="loha (Hadamard product of two low-rank pairs, LyCORIS LoHa; loads with peft)",
    file_names={n: n for n in _LOHA_NAMES},
    refused={"hada_t1": "Tucker (conv) LoHa factors are not supported",
             "hada_t2": "Tucker (conv) LoHa factors are not supported"},
    required=tuple((n,) for n in _LOHA_NAMES),
    rank=lambda t: t["hada_w1_b"].shape[0],
    delta=lambda t: (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"]),
    bake_into=("hada_w1_a",),
    pairs=(("hada_w1_b", "hada_w1_a"), ("hada_w2_b", "hada_w2_a")),
)

#: every LoRA kind, by `lora.type`; the config's order
LORA_KINDS: dict[str, LoraKind] = {k.name: k for k in (LORA, LOKR, LOHA)}
#: the names, in the registry's order (the config's `Literal`)
LORA_KIND_NAMES = tuple(LORA_KINDS)


def lora_kind_spec(name: str) -> LoraKind:
    """The spec of kind `name` (a LoraConfig's `type`, a LoraFile's `kind`)."""
    from ..errors import UserError

    try:
        return LORA_KINDS[name]
    except KeyError:
        raise UserError(f"lora.type: unknown LoRA kind {name!r} ({', '.join(LORA_KINDS)})") from None


def kind_of_factor(name: str) -> str | None:
    """The kind whose canonical factor `name` is (None for none)."""
    return _FACTOR_KIND.get(name)


def kind_of_peft_type(peft_type: str) -> str:
    """The kind of a header's peft_type (`LOKR`, or `PeftType.LOKR` as some tools write it)."""
    short = str(peft_type).rsplit(".", 1)[-1]
    return next((k.name for k in LORA_KINDS.values() if k.peft_type == short), short.lower())


_FACTOR_KIND = {canon: k.name for k in LORA_KINDS.values() for canon in k.file_names.values()}
