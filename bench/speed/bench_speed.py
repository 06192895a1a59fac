#!/usr/bin/env python3
"""Issue #16: LoRA training step and sampling forward of a full-size random model (1024 px, batch 1, LoRA r16
on the family's default targets, AdamW, gradient checkpointing), every row a ratio to the reference row
'plain diffusers + peft, bf16 LoRA, eager, resident' measured in the same process.

    python -m bench.speed.bench_speed --out /tmp/speed                       # Flux, all rows (budget-limited)
    python -m bench.speed.bench_speed --family qwen_image --out /tmp/speed_q # offload-0 rows
    python -m bench.speed.bench_speed --family sd3 --out /tmp/speed_s
    python -m bench.speed.bench_speed --family z-image --out /tmp/speed_z    # (and --family chroma) offload-0 rows
    python -m bench.speed.bench_speed --family qwen-image-2.1 --out /tmp/speed_q21    # also krea2, flux3
    python -m bench.speed.bench_speed --family wan --size 832x480 --frames 81 --out /tmp/speed_w  # a 480p clip (--variant 1.3b)
    python -m bench.speed.bench_speed --rows issue29 --family ltx2 --size 1280x704 --frames 121 --out /tmp/s45  # with sound
    python -m bench.speed.bench_speed --rows issue29 --family hunyuan-video-1.5 --size 832x480 --frames 121 --out /tmp/s45
    python -m bench.speed.bench_speed --smoke --out /tmp/s                   # CPU, tiny widths: checks the script
    python -m bench.speed.bench_speed --rows issue29 --family hidream --only "=plain + compile_repeated_blocks;=dittrain offload 0, compiled" --out /tmp/s42  # issue 42 (also lumina2, anima, ernie-image, ideogram4)
    python -m bench.speed.bench_speed --rows issue29 --out /tmp/s29          # issue 29's table (Flux; or --family)
    python -m bench.speed.bench_speed --profile --family qwen_image --out /tmp/p  # profiler: dittrain vs plain, eager
    python -m bench.speed.bench_speed --profile --interleave --layers 30 --family qwen_image --out /tmp/p  # + steps in turn
    python -m bench.speed.bench_speed --profile --rows issue29 --family chroma --only "=plain + compile_repeated_blocks;=dittrain offload 0, compiled, checkpointing auto" --out /tmp/p
    python -m bench.speed.bench_speed --profile --rows issue29 --only "=dittrain offload 0, compiled;=dittrain offload 1.0 + act, compiled" --out /tmp/p  # + each row's device timeline (bench/common/timeline.py)

Issue 29 (`--rows issue29`): every ratio is also given to the row 'plain + compile_repeated_blocks' (the compiled
plain script a user writes in one line), and streamed rows get their PCIe floor (H2D bytes per step over the
pinned host-to-device rate measured in the same process) and the ratio to it. Rows: plain eager; plain compiled;
dittrain offload 0 compiled with every block checkpointed, with `train.gradient_checkpointing: auto` (the
planner's per-block choice for this card) and with none; Flux also: fp8 base every block streamed with
activation offloading, without and with fp8 matmuls (`model.fp8_matmul`), the same with the modulation Linears
in fp8, bf16 every block streamed, and bf16 (fp8 + fp8 matmuls) streamed with a ring of 3 and 4 (3) blocks
instead of 2 (`attach_offload(min_ring_blocks=)`: copies further ahead in the backward), bf16 streamed
without activation offloading; then offload 0 compiled with `train.compile_dynamic: tokens` (one compile for
every bucket: is the step slower?), the offload-0 compiled row once more (its 'first step' is a re-run's with
inductor's cache warm, the issue's <= 10 s), and plain compiled without checkpointing. Chroma also: plain
compiled with the attention mask in every block (diffusers' checkpointed forward gives the single blocks none; the
pipeline gives them the mask, as dittrain does), dittrain `auto` with the flash-attention form of the mask
and with flex attention adding it (trainer/models/chroma.py `use_mask_attention`; flex has no CPU backward, so
the CPU smoke run of that row fails unless torch's device check is lifted, as tests/test_bench_speed.py does),
flex with every block recomputed (the streaming presets' compute), flex at offload 0.9 (the 8 GB preset's
fraction, no activation offloading), and both without any mask (what the mask costs). A row that runs out
of memory is reported as such and the run goes on.

Rows (in this order; `--budget-s` stops adding rows when the time is spent, the reference always runs):
- plain: diffusers model + peft `add_adapter` with bf16 LoRA weights, `enable_gradient_checkpointing()`,
  torch AdamW, eager, resident; and the same with diffusers' `compile_repeated_blocks()`;
- dittrain: the project's own LoRA (fp32 masters, `lora.compute_dtype` new = auto / old = fp32), every block a
  StreamedBlock through `attach_offload` (checkpointed, streamed at the fraction, activation offloading where
  named), the project's AdamW (`trainer.optim.build_optimizer`), `compile` off / on (trainer/offload/compiled.py);
  an fp8-base row (trainer.quant `quantize_blocks`) at 1.0 + activations, and the same with the modulation
  Linears quantized too (`model.quantize_modulation`);
- sampling forward (no grad): plain eager, dittrain resident compiled, dittrain streamed 1.0 compiled, and that
  with an fp8 base and with an fp8 base + modulation (bf16 vs fp8 streamed sampling in one process).

Video families (Wan, HunyuanVideo 1.5, LTX-2): `--size WxH` and `--frames` make the inputs one clip (Wan at
832x480x81: latents (1, 16, 21, 60, 104), 512 text tokens; LTX-2's with the clip's sound, the joint call, and its loss
on both predictions); their rows add the streamed ones (offload 1.0 + act, bf16 and fp8 base) after offload 0. The
plain rows build diffusers' own class where the family's subclasses it (HunyuanVideo 1.5's block in token-wise
regions).
Every model keeps its class's `_keep_in_fp32_modules` (Wan's norms) in fp32, as `from_pretrained(torch_dtype=bf16)`
and the trainer load them.

Issue 42's image families (lumina2, anima, ernie-image, ideogram4, hidream) go through the same path: the
family's full config, its `dummy_inputs` at 1024 px (`text_tokens` caption tokens: HiDream's T5 and Llama's 32 hidden
states, 128 tokens each, CLIP's pooled features), its default LoRA targets; their offload-0 compiled rows
are held to 0.85 x plain compiled (TARGETS42). HiDream's MoE feed-forwards run diffusers' training-mode forward
in both rows (the routed experts as a loop over boolean masks): compile_repeated_blocks breaks the graph at each
mask, dittrain's blocks trace the masks' sizes whole (`dynamo_config`, trainer/models/hidream.py); Ideogram 4 builds
the trained (conditional) transformer alone, and its plain rows hand it the text features over the whole
sequence, as diffusers' forward takes them (`plain_inputs`; dittrain's rows give the text rows alone).

Timing: CUDA events around each step after --warmup steps (compile happens in them), median of --steps.
"first step" is the wall time of the first step (compile included); "compile" is compiled.stats()'s forward
compile seconds. Every row builds a fresh model; dynamo caches are reset between rows.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.common.timing import build_bf16, step_seconds
from trainer import quant
from trainer.config import LoraConfig, OptimizerConfig
from trainer.models import adapter_class
from trainer.offload import CompileOptions, attach_offload, compiled, move_outside_blocks
from trainer.optim import build_optimizer
from trainer.train.model import add_lora

SMOKE = {  # tiny widths per family for --smoke (CPU)
    "flux": dict(num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)),
    "qwen_image": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                       axes_dims_rope=(4, 4, 8)),
    "sd3": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                caption_projection_dim=32, pooled_projection_dim=32, sample_size=32, pos_embed_max_size=32),
    "z-image": dict(dim=64, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                    axes_dims=[8, 12, 12]),
    "chroma": dict(num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=32, axes_dims_rope=(4, 4, 8), approximator_hidden_dim=32),
    "qwen-image-2.1": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, context_in_dim=32,
                           axes_dims_rope=(4, 6, 6)),
    "krea2": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, text_hidden_dim=32, num_text_layers=2, text_num_attention_heads=2,
                  text_num_key_value_heads=2, text_intermediate_size=64, num_layerwise_text_blocks=1,
                  num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6)),
    "flux3": dict(num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4)),
    "flux2": dict(num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=48, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4)),
    "wan": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, ffn_dim=64, text_dim=32, freq_dim=32,
                rope_max_seq_len=64),
    "lumina2": dict(hidden_size=48, num_layers=2, num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1,
                    multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(300, 64, 64), cap_feat_dim=32),
    "anima": dict(num_attention_heads=2, attention_head_dim=16, num_layers=2, mlp_ratio=2.0, text_embed_dim=16,
                  adaln_lora_dim=8),
    "ernie-image": dict(hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=64, in_channels=16,
                        out_channels=16, text_in_dim=16, rope_axes_dim=(4, 6, 6)),
    "ideogram4": dict(in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
                      intermediate_size=64, adaln_dim=16, llm_features_dim=13 * 16, mrope_section=(4, 2, 2)),
    "hidream": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                    caption_channels=[32, 16], text_emb_dim=40, axes_dims_rope=[8, 4, 4], max_resolution=[16, 16],
                    llama_layers=[0, 1], num_routed_experts=2),  # 2 per token as the release; plain compile
                    # breaks the graph at each routed expert's token mask (dittrain's blocks trace it)
    "hunyuan-video-1.5": dict(num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
                              mlp_ratio=2.0, text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=16,
                              rope_axes_dim=(4, 6, 6), target_size=64),
    "ltx2": dict(num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, audio_num_attention_heads=2,
                 audio_attention_head_dim=8, audio_cross_attention_dim=16, num_layers=2, caption_channels=32),
}
TARGETS29 = {  # issue 29: ratio to plain compiled ("compiled") or to the row's PCIe floor ("floor"), by row name
    "dittrain offload 0, compiled": ("compiled", 0.80),
    "dittrain offload 0, compiled, checkpointing auto": ("compiled", 0.80),
    "dittrain offload 0, compiled, checkpointing none": ("compiled", 0.80),
    "dittrain offload 1.0 + act, fp8 base, compiled": ("compiled", 0.85),
    "dittrain offload 1.0 + act, fp8 base, fp8 matmul, compiled": ("compiled", 0.85),
    "dittrain offload 1.0 + act, fp8 base + modulation, fp8 matmul, compiled": ("compiled", 0.85),
    "dittrain offload 1.0 + act, compiled": ("floor", 1.10),
    "dittrain offload 1.0 + act, ring 3 blocks, compiled": ("floor", 1.10),
    "dittrain offload 1.0, compiled": ("floor", 1.10),
    "dittrain offload 1.0 + act, ring 4 blocks, compiled": ("floor", 1.10),
    "dittrain offload 1.0 + act, fp8 base, fp8 matmul, ring 3 blocks, compiled": ("compiled", 0.85),
}
#: issue 42's five image families: their offload-0 compiled step <= 0.85 x plain compiled (issue 29's rows and table)
ISSUE42 = ("lumina2", "anima", "ernie-image", "ideogram4", "hidream")
TARGETS42 = {"dittrain offload 0, compiled": ("compiled", 0.85),
             "dittrain offload 0, compiled, checkpointing auto": ("compiled", 0.85),
             "dittrain offload 0, compiled, checkpointing none": ("compiled", 0.85)}
#: issue 45 (video families): a streamed step within 1.15 x of max(its PCIe floor, the resident compute: the
#: 'dittrain offload 0, compiled' row, every block recomputed as the streamed rows do)
TARGETS45 = {"dittrain offload 1.0 + act, compiled": ("max", 1.15),
             "dittrain offload 1.0 + act, fp8 base, compiled": ("max", 1.15)}
TARGETS = {  # ratio to the reference the issue asks for, by row name
    "flux": {"dittrain offload 0, compiled": 0.85, "dittrain offload 0.5, compiled": 0.85,
             "dittrain offload 1.0 + act, compiled": 1.15, "dittrain offload 1.0 + act, fp8 base, compiled": 0.85,
             "sample: dittrain resident, compiled": 0.80},
    "qwen_image": {"dittrain offload 0, compiled": 0.90},
    "sd3": {"dittrain offload 0, compiled": 0.90},
    "z-image": {"dittrain offload 0, compiled": 0.90},
    "chroma": {"dittrain offload 0, compiled": 0.90},
    "qwen-image-2.1": {"dittrain offload 0, compiled": 0.90},
    "krea2": {"dittrain offload 0, compiled": 0.90},
    "flux3": {"dittrain offload 0, compiled": 0.90},
}


def issue29_specs(family: str) -> list[dict]:
    """Issue 29's rows (see the module docstring), most important first."""
    ours = dict(kind="ours", fraction=0.0, act=False, compile=True, math="auto", quant="none", modulation=False,
                dynamic=False, ckpt="all", fp8mm=False)
    streamed = {**ours, "fraction": 1.0, "act": True}
    rows = [dict(name="plain diffusers + peft, bf16 LoRA, eager, resident", kind="plain", compile=False),
            dict(name="plain + compile_repeated_blocks", kind="plain", compile=True),
            {**ours, "name": "dittrain offload 0, compiled"},
            {**ours, "name": "dittrain offload 0, compiled, checkpointing auto", "ckpt": "auto"},
            {**ours, "name": "dittrain offload 0, compiled, checkpointing none", "ckpt": "none"}]
    if family == "flux":
        rows += [
            {**streamed, "name": "dittrain offload 1.0 + act, fp8 base, compiled", "quant": "fp8"},
            {**streamed, "name": "dittrain offload 1.0 + act, fp8 base, fp8 matmul, compiled", "quant": "fp8",
             "fp8mm": True},
            {**streamed, "name": "dittrain offload 1.0 + act, fp8 base + modulation, fp8 matmul, compiled",
             "quant": "fp8", "modulation": True, "fp8mm": True},
            {**streamed, "name": "dittrain offload 1.0 + act, compiled"},
            # the backward's copies wait on compute at prefetch distance one (history/2026-11-26.md, 2026-11-26 timeline):
            # a ring of more blocks loads further ahead
            {**streamed, "name": "dittrain offload 1.0 + act, ring 3 blocks, compiled", "ring": 3},
            {**streamed, "name": "dittrain offload 1.0, compiled", "act": False},  # block inputs stay on the GPU
            {**streamed, "name": "dittrain offload 1.0 + act, ring 4 blocks, compiled", "ring": 4},
            {**streamed, "name": "dittrain offload 1.0 + act, fp8 base, fp8 matmul, ring 3 blocks, compiled",
             "quant": "fp8", "fp8mm": True, "ring": 3},
        ]
    if adapter_class(family).video:  # issue 45: the streamed step against max(its PCIe floor, resident compute)
        rows += [{**streamed, "name": "dittrain offload 1.0 + act, compiled"},
                 {**streamed, "name": "dittrain offload 1.0 + act, fp8 base, compiled", "quant": "fp8"}]
    if family == "chroma":  # its attention mask (trainer/models/chroma.py: "Attention with the mask")
        plain_c = dict(kind="plain", compile=True)
        rows += [
            {**plain_c, "name": "plain + compile_repeated_blocks, mask in every block (as the pipeline)",
             "mask_all": True},
            {**ours, "name": "dittrain offload 0, compiled, checkpointing auto, flash mask", "ckpt": "auto",
             "attn": "flash"},
            {**ours, "name": "dittrain offload 0, compiled, checkpointing auto, flex mask", "ckpt": "auto",
             "attn": "flex"},
            # what the streaming presets run (every block recomputed), with flex: their compute floor
            {**ours, "name": "dittrain offload 0, compiled, every block recomputed, flex", "attn": "flex"},
            # the 8 GB preset's fraction, flex, no activation offloading (configs/chroma/lora-8gb.yaml)
            {**ours, "name": "dittrain offload 0.9, compiled, flex", "attn": "flex", "fraction": 0.9},
            {**plain_c, "name": "plain + compile_repeated_blocks, no attention mask", "nomask": True},
            {**ours, "name": "dittrain offload 0, compiled, checkpointing auto, no attention mask", "ckpt": "auto",
             "nomask": True},
        ]
    if family == "flux2":  # 32 B: is the streamed fp8 step bound by PCIe or by compute? (issue 26)
        rows += [
            {**ours, "name": "dittrain offload 0, fp8 base, compiled", "quant": "fp8"},
            {**streamed, "name": "dittrain offload 1.0 + act, fp8 base, compiled", "quant": "fp8"},
        ]
    rows += [  # one compile per run: symbolic token axes (step speed); a second compile of row 3 (the cache's)
        {**ours, "name": "dittrain offload 0, compiled, dynamic token axes", "dynamic": "tokens"},
        {**ours, "name": "dittrain offload 0, compiled, again (inductor's cache warm: a re-run's first step)"},
        dict(name="plain + compile_repeated_blocks, no checkpointing", kind="plain", compile=True, ckpt=False),
    ]
    return rows


def row_specs(family: str) -> list[dict]:
    """Every row, most important first. kind: plain | ours | sample-plain | sample-ours."""
    ours = dict(kind="ours", fraction=0.0, act=False, compile=True, math="auto", quant="none", modulation=False,
                dynamic=False, ckpt="all", fp8mm=False)
    rows = [dict(name="plain diffusers + peft, bf16 LoRA, eager, resident", kind="plain", compile=False)]
    rows.append({**ours, "name": "dittrain offload 0, compiled"})
    if family == "flux":
        rows += [
            {**ours, "name": "dittrain offload 0.5, compiled", "fraction": 0.5},
            {**ours, "name": "dittrain offload 1.0 + act, compiled", "fraction": 1.0, "act": True},
            {**ours, "name": "dittrain offload 1.0 + act, fp8 base, compiled", "fraction": 1.0, "act": True,
             "quant": "fp8"},
            {**ours, "name": "dittrain offload 1.0 + act, fp8 base + modulation, compiled", "fraction": 1.0,
             "act": True, "quant": "fp8", "modulation": True},
            dict(name="sample: plain eager forward", kind="sample-plain", compile=False),
            {**ours, "name": "sample: dittrain resident, compiled", "kind": "sample-ours"},
            {**ours, "name": "sample: dittrain offload 1.0, compiled", "kind": "sample-ours", "fraction": 1.0},
            {**ours, "name": "sample: dittrain offload 1.0, fp8, compiled", "kind": "sample-ours", "fraction": 1.0,
             "quant": "fp8"},
            {**ours, "name": "sample: dittrain offload 1.0, fp8 + modulation, compiled", "kind": "sample-ours",
             "fraction": 1.0, "quant": "fp8", "modulation": True},
        ]
    rows += [
        dict(name="plain + compile_repeated_blocks", kind="plain", compile=True),
        {**ours, "name": "dittrain offload 0, eager", "compile": False},
        {**ours, "name": "dittrain offload 0, eager, old LoRA math (fp32)", "compile": False, "math": "fp32"},
        {**ours, "name": "dittrain offload 0, compiled, old LoRA math (fp32)", "math": "fp32"},
        {**ours, "name": "dittrain offload 0, compiled, dynamic shapes", "dynamic": True},
    ]
    if adapter_class(family).video:  # a 14 B video model: streamed from pinned RAM, bf16 and fp8 (the GPU presets')
        rows[2:2] = [
            {**ours, "name": "dittrain offload 1.0 + act, compiled", "fraction": 1.0, "act": True},
            {**ours, "name": "dittrain offload 1.0 + act, fp8 base, compiled", "fraction": 1.0, "act": True,
             "quant": "fp8"},
        ]
    if family == "flux":
        rows += [
            {**ours, "name": "dittrain offload 0.5, eager", "fraction": 0.5, "compile": False},
            {**ours, "name": "dittrain offload 1.0 + act, eager", "fraction": 1.0, "act": True, "compile": False},
            {**ours, "name": "sample: dittrain resident, eager", "kind": "sample-ours", "compile": False},
        ]
    return rows


def diffusers_class(cls: type) -> type:
    """The diffusers class a family's transformer class is, or subclasses (HunyuanVideo 1.5's computes its block in
    token-wise regions for `offload.nano_batches`): what a plain row builds, diffusers' own forward."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("diffusers."))


def build(family: str, dev, smoke: bool, layers: int | None = None, variant: str | None = None,
          plain: bool = False):
    """A random model of the family (full size, or SMOKE's widths), bf16, in training mode; `layers`: that many
    blocks (`num_layers`) instead of the config's (two models side by side in `--profile --interleave`);
    `variant`: another full size of the family's transformer (`full_variants`: wan's 1.3b); `plain`: diffusers'
    class itself where the family subclasses it."""
    cls = adapter_class(family)
    conf = {**(cls.full_variants[variant] if variant else cls.full_config), **(SMOKE[family] if smoke else {})}
    if layers:
        conf["num_layers"] = layers
    model_cls = diffusers_class(cls.transformer_cls) if plain else cls.transformer_cls
    m = build_bf16(lambda: model_cls.from_config(conf), dev)
    torch.nn.Module.to(m, torch.bfloat16)  # torch's: ModelMixin's warns that it casts the fp32 modules
    for n, p in m.named_parameters():  # those stay fp32, as `from_pretrained(torch_dtype=bf16)` and the trainer
        if any(k in n.split(".") for k in m._keep_in_fp32_modules or []):  # load them (Wan's norms, Krea 2's)
            p.data = p.data.float()
    return cls(), m.train()


def model_inputs(adapter, m, dev, res: int, size: tuple[int, int] | None = None, frames: int | None = None):
    """The transformer's inputs for one sample of `res` x `res` (or `size`, (width, height)); a video family's of
    a clip of `frames` frames (Wan at 832x480x81: latents (1, 16, 21, 60, 104)); LTX-2's with the clip's sound
    (126 audio tokens for 121 frames)."""
    w, h = size or (res, res)
    video = {"frames": frames} if getattr(type(adapter), "video", False) else {}
    if "audio_latents" in getattr(type(adapter), "noised_streams", ()):  # LTX-2: a clip with its sound, as `fit`
        video["sound"] = True  # trains clips that have an audio track
    kw = type(adapter).dummy_inputs(m, 1, h, w, type(adapter).text_tokens if res > 64 else 8, torch.bfloat16, dev,
                                    **video)
    for k, v in kw.items():  # the image tokens never require grad (latents)
        if isinstance(v, torch.Tensor) and torch.device(dev).type != "meta":  # on the device, as the trainer's
            kw[k] = v = v.to(dev)  # batches (Lumina 2's text mask comes on the CPU for the planner's meta trace)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in ("img_ids", "txt_ids", "attention_mask"):
            kw[k] = v * 0.5
    kw["return_dict"] = False
    return kw


def plain_inputs(family: str, kw: dict) -> dict:
    """The inputs of a plain row, where a family's own forward takes a shorter form than diffusers' call: Ideogram
    4's text features over the whole [text, image] sequence, zero on the image rows (what its pipeline and diffusers'
    forward take; the family's class projects the text rows alone when given those: trainer/models/ideogram4.py), so
    the plain rows run diffusers' forward unchanged."""
    if family == "ideogram4":
        f, s = kw["encoder_hidden_states"], kw["hidden_states"].shape[1]
        kw = {**kw, "encoder_hidden_states": torch.cat([f, f.new_zeros(f.shape[0], s - f.shape[1], f.shape[2])], 1)}
    return kw


def drop_mask(kw: dict) -> None:
    """No text mask: Chroma's `attention_mask` (a different function: a diagnostic), Qwen's all-ones
    `encoder_hidden_states_mask` (the same function: QwenImagePipeline.encode_prompt and the trainer's collate
    drop a mask with nothing padded, so at batch 1 they attend without one, which lets SDPA pick flash)."""
    kw.pop("attention_mask", None)
    kw.pop("encoder_hidden_states_mask", None)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, warmup: int, steps: int) -> dict:
    """first: wall seconds of the first call (compile included); median over `steps` after `warmup`."""
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        fn()
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ts = step_seconds(fn, steps, dev.type == "cuda")
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return {"step_s": statistics.median(ts), "first_s": first, "peak_gb": peak}


def plain_setup(adapter, m, args, spec):
    """The reference: peft bf16 LoRA, diffusers' checkpointing, torch AdamW, eager (or compile_repeated_blocks)."""
    from peft import LoraConfig as PeftLoraConfig

    m.requires_grad_(False)
    m.add_adapter(PeftLoraConfig(r=args.rank, lora_alpha=args.rank, target_modules=list(adapter.default_lora_targets),
                                 init_lora_weights="gaussian"))  # weights in the model's dtype: bf16
    params = [p for p in m.parameters() if p.requires_grad]
    if spec.get("mask_all"):
        mask_every_block(m)
    if spec["kind"] == "plain" and spec.get("ckpt", True):
        m.enable_gradient_checkpointing()
    if spec["compile"]:
        if not getattr(m, "_repeated_blocks", None):  # SD3's class names none in diffusers 0.42: name its blocks
            m._repeated_blocks = sorted({type(b).__name__ for b in adapter.blocks(m)})
        m.compile_repeated_blocks(fullgraph=False, backend=args.backend)
    return params, None


def mask_every_block(m) -> None:
    """Chroma: diffusers' checkpointed forward calls the single blocks without `attention_mask` (the pipeline's
    uncheckpointed one passes it); hand it to them as the pipeline does, so plain attends as dittrain does."""
    held = {}

    def keep(_mod, _args, kwargs):
        held["mask"] = kwargs.get("attention_mask")

    def give(_mod, args, kwargs):
        if kwargs.get("attention_mask") is None and held.get("mask") is not None:
            return args, {**kwargs, "attention_mask": held["mask"]}
        return None

    m.register_forward_pre_hook(keep, with_kwargs=True)
    for b in m.single_transformer_blocks:
        b.register_forward_pre_hook(give, with_kwargs=True)


def ours_setup(adapter, m, args, spec, dev):
    """As the trainer wires it: LoRA with fp32 masters (trainer/train/model.py), StreamedBlocks, compile."""
    m.requires_grad_(False)
    blocks = adapter.blocks(m)
    if spec["quant"] != "none":
        quant.quantize_blocks(blocks, spec["quant"], spec["modulation"], adapter.modulation_linears)
        quant.use_scaled_mm(m, spec.get("fp8mm", False))  # model.fp8_matmul
    if spec.get("attn"):  # Chroma's own forms of its masked attention (train.attention: flash / flex)
        from trainer.models.chroma import use_mask_attention

        use_mask_attention(m, spec["attn"])
    cfg = SimpleNamespace(lora=LoraConfig(rank=args.rank, alpha=args.rank, compute_dtype=spec["math"]))
    params = add_lora(m, cfg, adapter.default_lora_targets)
    for p in params:
        if p.abs().sum() == 0:  # peft's B starts at zero: give the branch real numbers, as after some training
            torch.nn.init.normal_(p, std=1e-3)
    opts = CompileOptions(dynamic=spec["dynamic"], backend=args.backend) if spec["compile"] else False
    training = spec["kind"] == "ours"
    if spec["fraction"] > 0 and dev.type == "cuda":
        m.to("cpu")  # the conductor packs block weights from CPU RAM (as the trainer loads a streamed model)
    handle = attach_offload(blocks, dev, spec["fraction"], mode="train" if training else "sample",
                            activations=spec["act"] and dev.type == "cuda", compile=opts,
                            checkpointing=checkpointing(spec, args, dev) if training else None,
                            min_ring_blocks=spec.get("ring", 2))
    move_outside_blocks(m, blocks, dev)
    return params, handle


def checkpointing(spec, args, dev):
    """The handle's `checkpointing` for the row: all, none, or the planner's choice (`gradient_checkpointing:
    auto`) for this card at the row's fraction, as the trainer makes it (trainer/train/streaming.py)."""
    c = spec.get("ckpt", "all")
    if c != "auto":
        return c == "all"
    from trainer.config import Config
    from trainer.planner.checkpointing import CARD_SHARE, choose_checkpointing
    from trainer.planner.presets import _config

    d = _config(args.family, "lora", args.res, spec["act"], spec["fraction"], ckpt="auto", quantize=spec["quant"])
    d["lora"]["rank"] = d["lora"]["alpha"] = args.rank
    budget = CARD_SHARE * torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 1e15
    if not args.smoke:
        return choose_checkpointing(Config.model_validate(d), spec["fraction"], budget).checkpointed
    import tempfile

    # the planner reads the model's width from <path>/transformer/config.json: the smoke widths, in a folder
    # removed after (one was left in the temp folder per row before)
    with tempfile.TemporaryDirectory(prefix="bench-speed-") as tmp:
        folder = Path(tmp)
        (folder / "transformer").mkdir()
        conf = {**adapter_class(args.family).full_config, **SMOKE[args.family]}
        (folder / "transformer" / "config.json").write_text(json.dumps(conf))
        d["model"]["path"] = str(folder)
        return choose_checkpointing(Config.model_validate(d), spec["fraction"], budget).checkpointed


def pcie_rate(dev) -> float | None:
    """Pinned host-to-device bytes/s: the best of three 1 GiB copies (None on the CPU)."""
    if dev.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=dev)
    best = 0.0
    for _ in range(3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        best = max(best, src.numel() / (e0.elapsed_time(e1) / 1000))
    del src, dst
    torch.cuda.empty_cache()
    return best


def run_row(spec, args, dev) -> dict:
    compiled.reset()
    plain = spec["kind"] in ("plain", "sample-plain")
    adapter, m = build(args.family, dev, args.smoke, variant=args.variant, plain=plain)
    kw = model_inputs(adapter, m, dev, args.res, args.size, args.frames)
    if spec.get("nomask"):  # a diagnostic: what the attention mask costs (a different function)
        drop_mask(kw)
    if plain:
        kw = plain_inputs(args.family, kw)
    params, handle = plain_setup(adapter, m, args, spec) if plain else ours_setup(adapter, m, args, spec, dev)
    sample = spec["kind"].startswith("sample")
    if sample:
        m.eval()
        def step():
            with torch.no_grad():
                m(**kw)
    else:
        opt = (torch.optim.AdamW(params, lr=1e-5) if plain
               else build_optimizer(params, OptimizerConfig(name="adamw", lr=1e-5)))

        def step():
            loss(m(**kw)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    try:
        r = timed(step, dev, args.warmup, args.steps)
        if handle is not None:
            r["h2d_bytes"] = handle.stats()["h2d_bytes_per_step"]
    finally:
        if handle is not None:
            handle.close()
    r.update(name=spec["name"], spec={k: v for k, v in spec.items() if k != "name"})
    s = compiled.stats()
    r["compile_s"] = s["seconds"] if s["graphs"] else None
    r["graphs"] = s["graphs"]
    return r  # the model and its optimizer go with this frame; `free` then returns their memory


def loss(outs) -> torch.Tensor:
    """Every output's mean square: LTX-2's audio prediction beside its video one (its audio stream trains as in
    `fit`); Z-Image returns one tensor per sample."""
    outs = [torch.stack(o) if isinstance(o, list) else o for o in outs]
    return sum(o.float().square().mean() for o in outs if isinstance(o, torch.Tensor))


def free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    compiled.reset()


def table(rows: list[dict], family: str) -> str:
    ref = rows[0]["step_s"]
    fwd = next((r["step_s"] for r in rows if r["name"] == "sample: plain eager forward"), None)
    lines = ["| row | step s | ratio | target | first step s | compile s | peak GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["step_s"] is None:
            lines.append(f"| {r['name']} | {r['error']} | | | | | |")
            continue
        base = fwd if r["name"].startswith("sample:") else ref
        ratio = r["step_s"] / base if base else float("nan")
        t = TARGETS.get(family, {}).get(r["name"])
        mark = "" if t is None else (f"<= {t} {'met' if ratio <= t else 'MISSED'}")
        c = "" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        p = "" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        lines.append(f"| {r['name']} | {r['step_s']:.3f} | {ratio:.2f} | {mark} | {r['first_s']:.1f} | {c} | {p} |")
    return "\n".join(lines)


def table29(rows: list[dict], rate: float | None, family: str = "flux") -> str:
    """Issue 29's table: ratios to plain eager and to plain compiled; streamed rows' PCIe floor (issue 42's
    families: their own offload-0 target, TARGETS42; video families: max(floor, resident compute), TARGETS45)."""
    targets = {**TARGETS29, **(TARGETS42 if family in ISSUE42 else {}),
               **(TARGETS45 if adapter_class(family).video else {})}
    eager = rows[0]["step_s"]
    comp = next((r["step_s"] for r in rows if r["name"] == "plain + compile_repeated_blocks"), None)
    resident = next((r["step_s"] for r in rows if r["name"] == "dittrain offload 0, compiled"), None)
    lines = ["| row | step s | vs plain eager | vs plain compiled | PCIe floor s | vs floor | target | first step s "
             "| compile s | peak GiB |", "|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(a, b):
        return "" if not a or not b else f"{a / b:.2f}"

    for r in rows:
        if r["step_s"] is None:
            lines.append(f"| {r['name']} | {r['error']} | | | | | | | | |")
            continue
        floor = r["h2d_bytes"] / rate if rate and r.get("h2d_bytes") else None
        mark = ""
        if r["name"] in targets:
            col, t = targets[r["name"]]
            ref = {"compiled": comp, "floor": floor,
                   "max": max(floor, resident) if floor and resident else None}[col]
            got = r["step_s"] / ref if ref else None
            what = {"compiled": "plain compiled", "floor": "floor", "max": "max(floor, offload 0 compiled)"}[col]
            mark = f"<= {t} x {what}" + (
                "" if got is None else f" {'met' if got <= t else 'MISSED'} ({got:.2f} x {ref:.3f} s)")
        c = "" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        p = "" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        fl = "" if floor is None else f"{floor:.3f}"
        lines.append(f"| {r['name']} | {r['step_s']:.3f} | {ratio(r['step_s'], eager)} | {ratio(r['step_s'], comp)} "
                     f"| {fl} | {ratio(r['step_s'], floor)} | {mark} | {r['first_s']:.1f} | {c} | {p} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="flux", choices=sorted(SMOKE))
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--size", default=None, help="WxH instead of --res x --res (video: the clip's pixels, e.g. "
                    "832x480)")
    ap.add_argument("--frames", type=int, default=None, help="video families: frames of the clip (default: the "
                    "family's plan_frames, Wan's 81)")
    ap.add_argument("--variant", default=None, help="another full size of the family's transformer "
                    "(full_variants, e.g. --family wan --variant 1.3b)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop adding rows after this many seconds")
    ap.add_argument("--only", default="", help="substrings separated by ';' (or '=whole row name'): run only rows whose name has one "
                    "(and the reference)")
    ap.add_argument("--rows", default="all", choices=("all", "issue29"), help="which row set (module docstring)")
    ap.add_argument("--profile", action="store_true",
                    help="profile plain vs dittrain, eager, resident (bench/speed/speed_profile.py) instead of the rows")
    ap.add_argument("--interleave", action="store_true", help="with --profile: also time the rows' steps "
                    "alternately in one process, every model built at once (bench/speed/speed_profile.py)")
    ap.add_argument("--layers", type=int, default=None, help="with --profile: blocks per model (num_layers)")
    ap.add_argument("--no-mask", action="store_true", help="with --profile: drop the text mask (Qwen: as the "
                    "pipeline and the trainer at batch 1)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (default inductor; smoke: aot_eager)")
    ap.add_argument("--out", type=Path, default=None, help="folder for speed.json and speed.md")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny widths: checks the script, measures nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        args.res, args.warmup, args.steps, args.rank = 64, 1, 1, 4
        args.size, args.frames = ("96x64", 5) if adapter_class(args.family).video else (None, None)
        args.backend = args.backend or "aot_eager"
    args.size = tuple(int(x) for x in args.size.lower().split("x")) if args.size else None
    args.backend = args.backend or "inductor"
    dev = torch.device("cpu" if args.smoke else "cuda")
    if dev.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention fails in backward there (GPU.md); trainer does the same
    specs = issue29_specs(args.family) if args.rows == "issue29" else row_specs(args.family)
    if args.only:
        keep = [s.strip() for s in args.only.split(";")]  # "=name": that row exactly; else a substring

        def first_key(s) -> int | None:
            hits = [i for i, k in enumerate(keep) if (s["name"] == k[1:] if k.startswith("=") else k in s["name"])]
            return hits[0] if hits else None

        specs = [specs[0]] + [s for s in specs[1:] if first_key(s) is not None]
    if args.profile:
        from bench.speed.speed_profile import profile

        # --only picks the rows to profile (compiled ones too), in the order it names them (the first is the one
        # the others are compared to; each row is written as soon as it is done, so put the one that matters
        # most early)
        return profile(args, dev, sorted(specs[1:], key=first_key) if args.only else None)
    rate = pcie_rate(dev) if args.rows == "issue29" else None
    if rate:
        print(f"pinned host-to-device: {rate / 1e9:.1f} GB/s (best of three 1 GiB copies)", flush=True)
    t0, rows = time.perf_counter(), []
    for spec in specs:
        if rows and time.perf_counter() - t0 > args.budget_s:
            print(f"budget spent: skipped '{spec['name']}' and later rows", flush=True)
            break
        try:
            r = run_row(spec, args, dev)
        except torch.OutOfMemoryError as e:  # e.g. no checkpointing on a model too big for the card: say so
            r = {"name": spec["name"], "spec": {k: v for k, v in spec.items() if k != "name"}, "step_s": None,
                 "error": f"out of memory ({str(e).splitlines()[0][:80]})"}
        free(dev)
        rows.append(r)
        if r["step_s"] is None:
            print(f"{r['name']}: {r['error']}", flush=True)
            continue
        comp = "" if r["compile_s"] is None else f", compile {r['compile_s']:.1f} s"
        print(f"{r['name']}: {r['step_s']:.3f} s/step, first step {r['first_s']:.1f} s{comp}", flush=True)
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    body = table29(rows, rate, args.family) if args.rows == "issue29" else table(rows, args.family)
    shape = f"{args.size[0]}x{args.size[1]}" if args.size else f"{args.res} px"
    if adapter_class(args.family).video:
        shape += f" x {args.frames or adapter_class(args.family).plan_frames} frames"
    md = (f"{args.family}{f' {args.variant}' if args.variant else ''}, {shape}, LoRA r{args.rank}, {device}, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, backend {args.backend}"
          + (f", pinned H2D {rate / 1e9:.1f} GB/s" if rate else "") + "\n\n" + body)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "" if args.rows == "all" else f"_{args.rows}"
        (args.out / f"speed_{args.family}{tag}.json").write_text(json.dumps(rows, indent=1))
        (args.out / f"speed_{args.family}{tag}.md").write_text(md + "\n")
    return rows


if __name__ == "__main__":
    main()
