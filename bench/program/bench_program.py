"""The whole program as a new user runs it, on full-size random-weight models, under a VRAM cap.

    python -m bench.program.bench_program --families flux sd3 qwen_image --work /tmp/bench   # a GPU box
    python -m bench.program.bench_program --smoke --work /tmp/smoke                            # CPU, tiny models
    python -m bench.program.bench_program --families flux2 --transformer-file fp8 --card 16 --keep   # Flux.2-dev, 64 GB disk
    python -m bench.program.bench_program --families wan --transformer-file fp8 --card 16 --frames 81 --resolution 480p
    python -m bench.program.bench_program --estimate --families wan wan-1.3b wan-i2v wan2.2-a14b --transformer-file fp8
    python -m bench.program.bench_program --families hidream lumina2 ernie-image anima --transformer-file fp8 --card 8 16
    python -m bench.program.bench_program --families ltx2 ltx2-i2v --transformer-file fp8 --card 8 16 --frames 121
    python -m bench.program.bench_program --families hunyuan-video-1.5 --transformer-file fp8 --card 16 24 --frames 121
    python -m bench.program.bench_program --families hunyuan-video-1.5-i2v-720p --transformer-file fp8 --card 48 80 \
        --frames 121 --resolution 720p

For each family: write a diffusers folder with every component at full size (transformer from the adapter's
`full_config`; VAE, CLIP-L / CLIP-G / T5-XXL / Qwen2.5-VL-7B / Qwen3-4B from their real configs, built here in
code, or by the family's `full_size_parts`) and random bf16 weights, written tensor by tensor into safetensors
shards from a meta-device model (the whole model is never built in RAM); tokenizers, scheduler and
model_index.json come from the tiny models (trainer/models/tiny.py: same classes and wiring, small vocabularies
whose ids all exist in the full-size embeddings). A few JPEGs. Then
`dittrain cache`, `dittrain fit` (a few steps, sampling during training on) and `dittrain sample` run as
subprocesses of the family's `lora-<card>gb` preset (`--method full`: `full-<card>gb`) with DITTRAIN_VRAM_CAP_GB =
card - 1, and the table prints per
phase: peak reserved VRAM (from DITTRAIN_PHASE_LOG, trainer/phase_log.py), peak anonymous RSS (this process
polls the child's RssAnon every 0.1 s and takes the maximum inside each phase's time window), and the median
training-step time. `--gpus N` runs `fit` through torchrun on N GPUs (anonymous PSS summed over its processes, the
node's /dev/shm beside it). The folder is deleted after each family (Qwen-Image is ~58 GB on disk: one family at a time)
unless --keep, which also reuses a folder left by an earlier run. Several `--card` sizes run one after another on
the same folder; `--set section.key=value` overrides a preset setting and `--tag` names the variant, so variants
can be compared on one written folder (each run has its own cache, output and logs under
<family>/<card>gb[-full][-tag]).

--transformer-file fp8 (or fp8-original, Flux.1 only: BFL key names under ComfyUI's `model.diffusion_model.`, the
layout trainer/models/original_layout.py streams): the transformer is written as ONE safetensors file the way users' fp8 checkpoints are
(diffusers keys; the Linear weights inside the blocks float8_e4m3fn with a per-tensor `scale_weight`, the rest
bf16), still tensor by tensor, next to transformer/config.json, and the preset gets `model.transformer_file` and
`model.quantize: fp8`; the file streams block by block (trainer/models/stream_load.py). Qwen-Image's folder is then
~37 GB instead of ~58 GB (it fits a 64 GB disk).

Flux.2 (--families flux2 / flux2-klein): the transformer from the adapter's `full_config` (dev: 32.2 B; klein: 4 B),
AutoencoderKLFlux2 at its defaults, and for dev Mistral-Small-3.1 (Mistral3Config's defaults) cut to 31 of its 40
decoder layers: the pipeline reads hidden states 10 / 20 / 30, so layers 31-39 never change a caption (the adapter
does not even load them from a real folder), vision tower and head kept. Its 2-D weights are written in fp8 and
cast to bf16 by transformers on load (19 GB on disk instead of 38, the same bytes in RAM and VRAM as bf16 weights);
with --transformer-file fp8 (33 GB) the dev folder is ~52 GB. klein gets Qwen3-4B whole (36 layers, bf16). A bf16
preset of dev (24 GB and up) is measured on the fp8 file with `--set model.quantize=none`: the loader up-casts it
to bf16 block by block, which is what the preset streams.

Video (the Wan families; `wan-1.3b` is Wan2.1-T2V-1.3B, a size the adapter declares in `full_variants`): the
transformer from `full_config` (14 B; I2V 16.4 B with its image cross-attention; TI2V-5B 5.0 B) and the rest from
the adapter's `full_size_parts`: AutoencoderKLWan at Wan 2.1's config (its defaults) or Wan 2.2's 48-channel one
(TI2V-5B, 0.70 B); UMT5-XXL's encoder whole (google/umt5-xxl: 24 layers of 4096, 256384 tokens, 5.68 B), its
2-D weights written in fp8 and cast to bf16 by transformers on load (5.7 GB on disk instead of 11.4, the same
bytes in RAM and VRAM); for Wan 2.1 I2V the CLIP image encoder (open-clip ViT-H/14 as a CLIPVisionModel, 0.63 B,
bf16) and a 224 px CLIPImageProcessor. Nothing of the models is cut. Tied tensors (UMT5's and T5's
`encoder.embed_tokens` = `shared`) are written once, as save_pretrained writes them, so they are tied again on
load. Wan 2.2 A14B trains one expert a run (`model.expert`, set to the first, high_noise, where the preset has
none): with --transformer-file the one fp8 file is what the loader reads for every expert (`model.transformer_file`
names one file), so `transformer_2/` gets its config only (the second expert's weights are the first's numbers:
sizes, memory and times are those of two files); without it `transformer_2/` is written with fp8 matrices (two
bf16 experts, 57 GB, would not fit a 64 GB disk beside the rest). Folders, with --transformer-file fp8 / without:
wan 20.5 / 34.5 GB, wan-1.3b 7.4 / 8.8, wan-i2v 23.8 / 40.0, wan2.2-a14b(-i2v) 20.5 / 48.8, wan2.2-ti2v-5b
12.2 / 17.1; every folder's size and its write time (at the rates the GPU box wrote earlier folders, WRITE_RATE)
are printed before it is written, and `--estimate` prints only them. Data: `--images` mp4 clips instead of
JPEGs (bench/program/program_video.py: moving content, `--frames` + 4 frames at the family's rate, Wan's 16 fps,
at `--resolution` 480p = 832x480, 720p = 1280x720 or WxH, with captions), trained in one bucket of their own size
(data.resolutions, data.bucket_step, data.fps, data.clip_frames) and sampled at that size with `--sample-frames` (9) frames, 2
steps (image-to-video: from the first frame, `sample.image`). Config: the family's `lora-<card>gb` preset (a size
with presets of its own, its folder: `wan-1.3b` from configs/wan-1.3b/, not the 14 B's), else the preset of the
nearest card, else one built here that streams everything (offload.transformer 1.0,
offload.activations, offload.text_encoders 1.0; `--set` for what to measure); the line `config from ...` says which.

Families that declare their parts in their own file (`full_size_parts`; built on the meta device like the rest):
HiDream-I1 (hidream.py: Flux's VAE; CLIP-L and CLIP-G with projections at 248 positions, T5-XXL's encoder and
Llama-3.1-8B-Instruct whole, T5's and Llama's matrices in fp8 on disk: the pipeline reads all 32 of Llama's hidden
states, so no layer is cut, and its unused head stays as the release has it), Lumina-Image 2.0 (Flux's VAE,
Gemma-2-2B whole), ERNIE-Image (Flux.2's VAE, Ministral-3-3B whole with its Pixtral tower), Anima (Qwen-Image's
VAE, Qwen3-0.6B whole, the LLM adapter in text_conditioner/), LTX-2 and its image-to-video face (the video VAE,
Gemma 3 12B whole with its vision tower, matrices in fp8: every hidden state is read; the text connectors, the
audio VAE and the vocoder). A diffusers model listed beside the text encoders (the connectors, audio VAE, vocoder,
LLM adapter) is built for real and saved as the VAE is (`_write_built`): its own initialisation, not random
buffers. Folders, without / with --transformer-file fp8: hidream 48.8 / 32.3 GB, lumina2 10.6 / 8.0, ernie-image
23.9 / 16.1, anima 5.6 / 3.7, ltx2 (and ltx2-i2v) 55.5 / 36.9. LTX-2's clips are written at its 24 fps (its
positions are in seconds: another data.fps is refused) with 8k + 1 frames and a stereo tone as their audio track
(program_video.py), so its audio stream trains as on real clips with sound. HunyuanVideo 1.5 and its
image-to-video face (hunyuan_video15.py / _i2v.py: the released VAE, 1.26 B; Qwen2.5-VL-7B's language model
whole, matrices in fp8; the Glyph ByT5 encoder at byt5-small's config; for I2V SigLIP so400m-patch14-384 and a
384 px processor): 26.7 / 18.5 GB, I2V 27.5 / 19.4. `-720p` (hunyuan-video-1.5-720p, -i2v-720p) writes the 720p
transformer (the same shapes, target_size 960). The I2V pipeline samples at the size it picks for the image
(`pipeline_image`): 480p runs take `--resolution 816x480` (832x480 is refused), 720p ones the -720p folder, the
smoke `--resolution 64x48` (the tiny model's target size is 64).

--smoke: the tiny models on the CPU, no cap, 2 steps (tests/test_phases.py-style check that the whole path runs;
tests/test_phases.py runs it, also with --transformer-file fp8, which rewrites the tiny transformer the same way,
and for wan and wan-i2v on 96x64 clips of 5 frames; LTX-2's are 9 frames, with sound).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHARD_BYTES = 4 * 2**30


# ---------------------------------------------------------------------------------------------- full-size folders


_POOL: dict = {}
POOL_SIZE = 1 << 24


def _value(name: str, shape, dtype, gen):
    """Matrices: a window of a 16 M-value N(0, 0.02) pool at a random offset, repeated as needed (memcpy speed:
    drawing every one of Flux's 12 B values took 190 s of a 200 s write on the GPU box); vectors: ones / zeros."""
    import torch

    if len(shape) >= 2:
        if dtype not in _POOL:
            _POOL[dtype] = torch.empty(POOL_SIZE).normal_(0.0, 0.02, generator=gen).to(dtype)
        pool, n = _POOL[dtype], torch.Size(shape).numel()
        start = int(torch.randint(0, POOL_SIZE, (1,), generator=gen))
        return pool.repeat((start + n) // POOL_SIZE + 1)[start : start + n].clone().reshape(shape)
    if name.endswith("weight") and any(k in name for k in ("norm", "ln", "layer_norm", "scale")):
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def write_random(module, folder: Path, prefix: str, dtype, seed: int = 0, matrix_dtype=None) -> int:
    """Random weights for every tensor of a meta-device `module`, written shard by shard into `folder` with an
    index (`prefix`: diffusion_pytorch_model or model). `matrix_dtype`: the dtype of the 2-D weights if not `dtype`
    (float8_e4m3fn halves a text encoder on disk; transformers casts it to the load dtype). Returns the bytes
    written."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shapes = disk_plan(module, dtype, matrix_dtype)
    groups, cur, size = [], [], 0
    for k, (shape, dt) in shapes.items():
        n = torch.Size(shape).numel() * torch.tensor([], dtype=dt).element_size()
        if cur and size + n > SHARD_BYTES:
            groups.append(cur)
            cur, size = [], 0
        cur.append(k)
        size += n
    groups.append(cur)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, keys in enumerate(groups):
        name = f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: _value(k, shapes[k][0], shapes[k][1], gen) if shapes[k][1].is_floating_point
                   else torch.zeros(shapes[k][0], dtype=shapes[k][1]) for k in keys}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(keys, name))
        del tensors
    (folder / f"{prefix}.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def disk_plan(module, dtype, matrix_dtype=None) -> dict:
    """key -> (shape, dtype on disk) of what `write_random` writes for `module`: floating 2-D tensors in
    `matrix_dtype` (or `dtype`), other floating tensors in `dtype`, the rest in their own. A tensor tied to one
    listed before it (UMT5's and T5's `encoder.embed_tokens` is their `shared`, a tied head is its embedding) is
    written once, under its first name, as save_pretrained writes it: transformers then ties it again on load
    (written twice with different values, it keeps two copies: 2.1 GB more RAM for UMT5-XXL)."""
    seen, out = set(), {}
    for k, v in module.state_dict(keep_vars=True).items():
        if id(v) in seen:
            continue
        seen.add(id(v))
        out[k] = (tuple(v.shape), v.dtype if not v.is_floating_point()
                  else (matrix_dtype or dtype) if v.ndim == 2 else dtype)
    return out


def plan_bytes(plan: dict) -> int:
    """Bytes of the tensors of a plan (key -> (shape, dtype)), headers aside."""
    import torch

    return sum(torch.Size(shape).numel() * torch.tensor([], dtype=dt).element_size() for shape, dt in plan.values())


_ST_DTYPES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float32": "F32", "int64": "I64"}


def write_fp8_file(module, blocks, path: Path, seed: int = 0) -> int:
    """One safetensors file for a meta-device transformer, the way users' fp8 checkpoints are: diffusers keys, the
    Linear weights inside `blocks` (modules of `module`) in float8_e4m3fn with a per-tensor `scale_weight`
    (weight = fp8 * scale), every other tensor bf16. Written tensor by tensor after a header computed from the
    shapes (safetensors' own layout: 8-byte header length, JSON header, then the bytes in header order), so at most
    one tensor is in RAM. Returns the bytes written."""
    return _write_fp8_plan(*_fp8_tensors(module, blocks), path, seed)


def _fp8_tensors(module, blocks) -> tuple[dict, set[str]]:
    """(key -> (shape, dtype), the keys written in fp8) of `write_fp8_file`."""
    from torch import nn

    names = {id(m): n for n, m in module.named_modules()}
    fp8 = {f"{names[id(b)]}.{n}.weight" for b in blocks for n, m in b.named_modules() if type(m) is nn.Linear}
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}, fp8


def fp8_file_bytes(tensors: dict, fp8: set[str]) -> int:
    """Bytes of `_write_fp8_plan`'s tensors (header aside): fp8 keys 1 byte a value and a 4-byte scale, the rest
    bf16 (floating) or 8 bytes (integer)."""
    import torch

    return sum(torch.Size(shape).numel() * (1 if k in fp8 else 2 if dt.is_floating_point else 8) + 4 * (k in fp8)
               for k, (shape, dt) in tensors.items())


def bfl_flux_header(c: dict) -> dict[str, list[int]]:
    """Key -> shape of BFL's flux1-dev.safetensors (the original layout), written out from its architecture for
    the config `c` (FluxTransformer2DModel keys; the single blocks' width is 3072 as diffusers' converter fixes)."""
    d, mlp, head = 3072, 12288, c["attention_head_dim"]
    shapes: dict[str, list[int]] = {}

    def lin(name, rows, cols):
        shapes[name + ".weight"], shapes[name + ".bias"] = [rows, cols], [rows]

    lin("img_in", d, c["in_channels"])
    lin("txt_in", d, c["joint_attention_dim"])
    for emb, width in (("time_in", 256), ("guidance_in", 256), ("vector_in", c["pooled_projection_dim"])):
        lin(f"{emb}.in_layer", d, width)
        lin(f"{emb}.out_layer", d, d)
    for i in range(c["num_layers"]):
        for s in ("img", "txt"):
            p = f"double_blocks.{i}.{s}"
            lin(f"{p}_mod.lin", 6 * d, d)
            lin(f"{p}_attn.qkv", 3 * d, d)
            lin(f"{p}_attn.proj", d, d)
            lin(f"{p}_mlp.0", mlp, d)
            lin(f"{p}_mlp.2", d, mlp)
            shapes[f"{p}_attn.norm.query_norm.scale"] = shapes[f"{p}_attn.norm.key_norm.scale"] = [head]
    for i in range(c["num_single_layers"]):
        p = f"single_blocks.{i}"
        lin(f"{p}.modulation.lin", 3 * d, d)
        lin(f"{p}.linear1", 3 * d + mlp, d)
        lin(f"{p}.linear2", d, d + mlp)
        shapes[f"{p}.norm.query_norm.scale"] = shapes[f"{p}.norm.key_norm.scale"] = [head]
    lin("final_layer.linear", c["in_channels"], d)
    lin("final_layer.adaLN_modulation.1", 2 * d, d)
    return shapes


def write_original_fp8_file(config: dict, path: Path, seed: int = 0) -> int:
    """Flux.1 in the original layout as ComfyUI's scaled fp8 files are: BFL key names under
    `model.diffusion_model.`, block Linear weights float8_e4m3fn with a per-tensor `scale_weight`, the rest bf16."""
    return _write_fp8_plan(*_original_fp8_tensors(config), path, seed)


def _original_fp8_tensors(config: dict) -> tuple[dict, set[str]]:
    import torch

    pre = "model.diffusion_model."
    shapes = {pre + k: (tuple(v), torch.bfloat16) for k, v in bfl_flux_header(config).items()}
    return shapes, {k for k, (shape, _) in shapes.items() if len(shape) == 2 and "blocks." in k}


def _write_fp8_plan(tensors: dict, fp8: set[str], path: Path, seed: int) -> int:
    """Write `tensors` (key -> (shape, dtype)) with random values, the keys in `fp8` as float8_e4m3fn plus a
    per-tensor `scale_weight` each, the rest bf16 (or their integer dtype), tensor by tensor."""
    import torch

    plan = []  # (key, dtype, shape, how)
    for k, (shape, dtype) in tensors.items():
        if k in fp8:
            plan += [(k, torch.float8_e4m3fn, shape, "fp8"),
                     (k[: -len("weight")] + "scale_weight", torch.float32, (1,), "scale")]
        else:
            plan.append((k, torch.bfloat16 if dtype.is_floating_point else dtype, shape, "plain"))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for k, dt, shape, _ in plan:
        n = torch.Size(shape).numel() * torch.tensor([], dtype=dt).element_size()
        header[k] = {"dtype": _ST_DTYPES[str(dt).removeprefix("torch.")], "shape": list(shape),
                     "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    gen = torch.Generator().manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        scale = None
        for k, dt, shape, how in plan:
            if how == "fp8":
                w = _value(k, shape, torch.bfloat16, gen).float()  # allocation: one tensor (fp32)
                amax = float(w.abs().max())
                scale = torch.tensor([amax / 448.0 if amax > 0 else 1.0])
                t = (w / scale).to(torch.float8_e4m3fn)
                del w
            elif how == "scale":
                t = scale
            else:
                t = _value(k, shape, dt, gen) if dt.is_floating_point else torch.zeros(shape, dtype=dt)
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # reshape: 0-dim tensors too
            del t
    return 8 + len(raw) + offset


def _meta(build):
    import torch

    with torch.device("meta"):
        return build()


def _clip_cfg(tok_dir: Path, hidden, inter, layers, heads, proj, act):
    from transformers import AutoTokenizer, CLIPTextConfig

    tok = AutoTokenizer.from_pretrained(tok_dir)
    return CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=heads, max_position_embeddings=77, hidden_act=act, projection_dim=proj,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _t5_cfg(tok_dir: Path):
    from transformers import AutoTokenizer

    from trainer.models._diffusers import t5_xxl_config

    tok = AutoTokenizer.from_pretrained(tok_dir)
    return t5_xxl_config(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)


def _qwen3_4b_cfg(tiny_dir: Path):
    """Qwen3-4B's text config; the special-token ids of the tiny tokenizer (all exist in the 151936 rows)."""
    from transformers import Qwen3Config

    tiny = json.loads((tiny_dir / "config.json").read_text())
    return Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                       tie_word_embeddings=True,
                       **{k: tiny[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in tiny})


def _save(folder: Path, model, config_owner, prefix: str, dtype, seed: int, matrix_dtype=None) -> int:
    import shutil as sh

    if folder.exists():
        sh.rmtree(folder)
    folder.mkdir(parents=True)
    if hasattr(config_owner, "save_config"):
        config_owner.save_config(folder)  # diffusers
    else:
        model.config.save_pretrained(folder)  # transformers
    return write_random(model, folder, prefix, dtype, seed, matrix_dtype)


#: bytes a second the GPU box wrote (H200, bench/logs/2026-11-2*-program-*.log): sharded bf16 folders 28-58 GB in
#: 26-56 s; Flux.2-dev's 33 GB fp8 file and 19 GB fp8 Mistral in 117 s, so the file at ~0.34 GB/s (each matrix
#: is scaled and cast); estimates, printed before a folder is written
WRITE_RATE = {"shards": 1.0e9, "fp8 file": 0.34e9}


def write_full_folder(family: str, folder: Path, transformer_file: str | None = None, variant: str | None = None,
                      write: bool = True) -> int:
    """A full-size random-weight diffusers folder for `family` (see the module essay). Returns bytes written.
    `transformer_file` "fp8" / "fp8-original": the transformer as one fp8 file in the folder, named by FILES
    (`write_transformer_file`). `variant`: a key of the adapter's `full_variants` (another size of its
    transformer). Prints the bytes and the write time estimated at WRITE_RATE first; `write` False: only that
    (the tiny folder is left in `folder`)."""
    import torch
    from diffusers import ModelMixin

    from trainer.models import adapter_class
    from trainer.models.tiny import make_tiny_models

    bf16 = torch.bfloat16
    tmp = folder.parent / f"{folder.name}-tiny"
    tiny = make_tiny_models(tmp, [family])[0]  # the family's tiny folder (qwen_image's is qwen-image)
    if folder.exists():
        shutil.rmtree(folder)
    shutil.move(str(tiny), str(folder))
    shutil.rmtree(tmp, ignore_errors=True)
    ad = adapter_class(family)
    tcls = ad.transformer_cls if hasattr(ad, "transformer_cls") else None
    conf = ad.full_variants[variant] if variant else ad.full_config
    tr = _meta(lambda: tcls.from_config(conf))
    with torch.device("meta"):
        vae, encs = _full_parts(family, folder, ad)
    fp8 = torch.float8_e4m3fn
    parts = []  # (what, bytes on disk, how: a WRITE_RATE key, write() -> bytes)
    if transformer_file:
        tensors = (_original_fp8_tensors(dict(tr.config)) if transformer_file == "fp8-original"
                   else _fp8_tensors(tr, ad().blocks(tr)))
        parts.append(("transformer", fp8_file_bytes(*tensors), "fp8 file",
                      lambda: write_transformer_file(folder, tr, ad, transformer_file)))
    else:
        parts.append(("transformer", plan_bytes(disk_plan(tr, bf16)), "shards",
                      lambda: _save(folder / "transformer", tr, tr, "diffusion_pytorch_model", bf16, 1)))
    # a family of experts (Wan 2.2 A14B): the others than `transformer`. With a transformer file, that one file is
    # what the loader reads for every expert (model.transformer_file), so each gets its config only; otherwise its
    # matrices in fp8 on disk (diffusers casts them to bf16 on load), or two 14 B experts in bf16 (57 GB) would not
    # fit the GPU box's 64 GB disk beside the rest. A family's other sampling transformers (`sampling_components`:
    # Ideogram 4's unconditional one, the same size) are always read from their folder: fp8 matrices there
    experts = set(getattr(ad, "experts", {}).values()) - {"transformer"}
    for i, d in enumerate(sorted(experts | set(getattr(ad, "sampling_components", ())))):
        if transformer_file and d in experts:
            parts.append((d, 0, "shards", lambda d=d: _config_only(folder / d, tr)))
        else:
            parts.append((d, plan_bytes(disk_plan(tr, bf16, fp8)), "shards",
                          lambda d=d, i=i: _save(folder / d, tr, tr, "diffusion_pytorch_model", bf16, 2 + i, fp8)))
    parts.append(("vae", sum(p.numel() * 2 for p in vae.parameters()), "shards",
                  lambda: _write_built(folder / "vae", vae)))
    # Flux.2-dev's Mistral-3 (19 B after the cut below) in bf16 would not fit the GPU box's 64 GB disk beside the
    # 32 GB fp8 transformer: its matrices are written in fp8 (loaded as bf16, so RAM and VRAM are bf16's); a
    # family's `full_size_parts` says so for its own encoders (a fourth entry: the matrices' dtype on disk)
    for i, (name, cls, cfg, *disk) in enumerate(encs):
        if issubclass(cls, ModelMixin):  # a diffusers model (LTX-2's connectors, Anima's LLM adapter): as the VAE
            model = _meta(lambda cls=cls, cfg=cfg: cls.from_config(cfg))
            parts.append((name, sum(p.numel() * 2 for p in model.parameters()), "shards",
                          lambda name=name, model=model: _write_built(folder / name, model)))
            continue
        matrices = disk[0] if disk else fp8 if family == "flux2" else None
        enc = _meta(lambda cls=cls, cfg=cfg: cls(cfg))
        parts.append((name, plan_bytes(disk_plan(enc, bf16, matrices)), "shards",
                      lambda name=name, enc=enc, i=i, m=matrices: _save(folder / name, enc, enc.config, "model", bf16,
                                                                        10 + i, m)))
    est = sum(n / WRITE_RATE[how] for _, n, how, _ in parts)
    label = family + (f"-{variant}" if variant else "")
    print(f"{label}: folder ~{sum(n for _, n, _, _ in parts) / 1e9:.1f} GB on disk ("
          + ", ".join(f"{what} {n / 1e9:.2f} GB{' fp8 file' if how == 'fp8 file' else ''}"
                      for what, n, how, _ in parts if n)
          + f"), ~{est:.0f} s to write at the GPU box's rates", flush=True)
    if not write:
        return sum(n for _, n, _, _ in parts)
    return sum(w() for _, _, _, w in parts)


def _config_only(folder: Path, transformer) -> int:
    if folder.exists():
        shutil.rmtree(folder)
    transformer.save_config(folder)
    return 0


def _write_built(folder: Path, meta_model) -> int:
    """A diffusers model of the folder built for real from the meta one's config, with its own initialisation, and
    saved in bf16: the VAE (84 M - 1.2 B) and the diffusers parts a family lists beside its text encoders (LTX-2's
    text connectors, 1.4 B, audio VAE and vocoder; Anima's LLM adapter), whose buffers (an audio VAE's latent
    statistics) random values would make meaningless."""
    import torch

    model = type(meta_model).from_config(meta_model.config).to(torch.bfloat16)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() * 2 for p in model.parameters())


def _full_parts(family: str, folder: Path, ad):
    """(the VAE, [(sub-folder, encoder class, config[, matrices' dtype on disk])]) of the family at full size,
    built under the caller's device (the meta device: `write_full_folder`)."""
    from diffusers import AutoencoderKLQwenImage
    from transformers import (
        CLIPTextModel,
        CLIPTextModelWithProjection,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3Model,
        T5EncoderModel,
    )

    from trainer.models._diffusers import flux_vae

    if hasattr(ad, "full_size_parts"):  # families that declare their full-size VAE and text encoders themselves
        return ad.full_size_parts(folder)
    if family == "flux":
        return flux_vae(), [
            ("text_encoder", CLIPTextModel, _clip_cfg(folder / "tokenizer", 768, 3072, 12, 12, 768, "quick_gelu")),
            ("text_encoder_2", T5EncoderModel, _t5_cfg(folder / "tokenizer_2"))]
    if family == "chroma":  # Flux's VAE, T5-XXL alone
        return flux_vae(), [("text_encoder", T5EncoderModel, _t5_cfg(folder / "tokenizer"))]
    if family == "z-image":  # Flux's VAE, Qwen3-4B (the base model without its tied head, as the pipeline loads it)
        return flux_vae(), [("text_encoder", Qwen3Model, _qwen3_4b_cfg(folder / "text_encoder"))]
    if family == "sd3":
        return flux_vae(1.5305, 0.0609), [
            ("text_encoder", CLIPTextModelWithProjection,
             _clip_cfg(folder / "tokenizer", 768, 3072, 12, 12, 768, "quick_gelu")),
            ("text_encoder_2", CLIPTextModelWithProjection,
             _clip_cfg(folder / "tokenizer_2", 1280, 5120, 32, 20, 1280, "gelu")),
            ("text_encoder_3", T5EncoderModel, _t5_cfg(folder / "tokenizer_3"))]
    if family in FLUX2:
        return _flux2_parts(family, folder)
    tiny = json.loads((folder / "text_encoder" / "config.json").read_text())
    text = {k: tiny["text_config"][k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if k in tiny.get("text_config", {})}
    cfg = Qwen2_5_VLConfig(
        text_config={"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                     "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                     "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24],
                                         "rope_theta": 1000000.0}, **text},
        vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                       "out_hidden_size": 3584},
        vocab_size=152064, hidden_size=3584,
        **{k: tiny[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                "vision_end_token_id") if k in tiny},
    )
    return AutoencoderKLQwenImage(), [("text_encoder", Qwen2_5_VLForConditionalGeneration, cfg)]  # Qwen-Image's VAE


FLUX2 = ("flux2", "flux2-klein")
#: decoder layers of the bench's Mistral-3: the pipeline reads hidden states 10 / 20 / 30, so layers 31-39 of the
#: real 40 are never needed (the adapter drops them at load too: `Flux2Adapter.slim_text_encoder`)
MISTRAL_BENCH_LAYERS = 31


def _flux2_parts(family: str, folder: Path):
    """Flux.2's VAE (AutoencoderKLFlux2's defaults are the real one) and text encoder at full size: Mistral-Small-3.1
    (Mistral3Config's defaults, cut to MISTRAL_BENCH_LAYERS decoder layers; vision tower and head kept) for dev,
    Qwen3-4B (36 layers) for klein. Token ids come from the tiny folder's tokenizer."""
    from diffusers import AutoencoderKLFlux2
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    tiny = json.loads((folder / "text_encoder" / "config.json").read_text())
    if family == "flux2-klein":
        ids = {k: tiny[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if tiny.get(k) is not None}
        cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                          rope_theta=1000000.0, tie_word_embeddings=True, **ids)
        return AutoencoderKLFlux2(), [("text_encoder", Qwen3ForCausalLM, cfg)]
    text = tiny.get("text_config", {})
    ids = {k: text[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if text.get(k) is not None}
    cfg = Mistral3Config(image_token_index=tiny["image_token_index"])  # defaults: Mistral-Small-3.1-24B
    cfg.text_config.num_hidden_layers = MISTRAL_BENCH_LAYERS
    cfg.text_config.sliding_window = None
    for k, v in ids.items():
        setattr(cfg.text_config, k, v)
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = False  # Mistral-Small has its own head
    return AutoencoderKLFlux2(), [("text_encoder", Mistral3ForConditionalGeneration, cfg)]


#: --transformer-file kind -> the single file's name in the model folder
FILES = {"fp8": "transformer-fp8.safetensors", "fp8-original": "transformer-fp8-original.safetensors"}


def write_transformer_file(folder: Path, meta_transformer, adapter_cls, kind: str = "fp8") -> int:
    """Replace the folder's transformer weights by one fp8 file, FILES[kind] (transformer/config.json stays: the
    config of a single file comes from it): diffusers keys ("fp8"), or Flux.1's original layout the way ComfyUI's
    fp8 files are ("fp8-original", `write_original_fp8_file`). Returns the bytes written."""
    for f in (folder / "transformer").glob("diffusion_pytorch_model*"):
        f.unlink()
    meta_transformer.save_config(folder / "transformer")
    if kind == "fp8-original":
        if adapter_cls.family != "flux":
            raise SystemExit("--transformer-file fp8-original: only Flux.1's original layout is written here")
        return write_original_fp8_file(dict(meta_transformer.config), folder / FILES[kind], seed=1)
    return write_fp8_file(meta_transformer, adapter_cls().blocks(meta_transformer), folder / FILES[kind], seed=1)


def write_jpegs(folder: Path, n: int, size: int) -> Path:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        yy, xx = np.mgrid[0:size, 0:size]
        img = np.stack([(xx * (i + 1)) % 256, (yy * 3) % 256, rng.integers(0, 256, (size, size))], -1)
        Image.fromarray(img.astype(np.uint8)).save(folder / f"img{i}.jpg", quality=90)
        (folder / f"img{i}.txt").write_text(f"a test picture number {i} with stripes")
    return folder


# ---------------------------------------------------------------------------------------------- runs


def _tree(pid: int) -> list[int]:
    """pid and every process below it (a torchrun launcher's workers), from /proc's parent ids."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def _anon(pid: int, proportional: bool = False) -> int:
    """pid's RssAnon, or with `proportional` its Pss_Anon: pages it shares copy-on-write with other processes (a
    process pool's forked workers) counted as a share each, so a sum over processes counts each page once."""
    path, key = (f"/proc/{pid}/smaps_rollup", "Pss_Anon:") if proportional else (f"/proc/{pid}/status", "RssAnon:")
    for line in Path(path).read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def _compile_worker(pid: int) -> bool:
    """Whether pid is one of torch inductor's compile workers (its pool's sidecar and the processes it forks run
    torch/_inductor/compile_worker's `__main__.py`)."""
    try:
        return b"compile_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _node_shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


class AnonPoller:
    """Samples a child's RssAnon every `every` seconds: [(time, bytes)]. `tree`: the sum of Pss_Anon over the child
    and every process below it (a torchrun launch's workers and their compile workers), sampled every second, with
    the node's shared memory beside (`shmem`: [(time, bytes)], the host's /dev/shm arena) and the part of the sum
    held by torch's compile workers (`workers`: [(time, bytes)], `_compile_worker`). (A sum of RssAnon counted a
    pool's copy-on-write pages once per worker: 57 GB for a 4-GPU fit whose workers held 2.3 GB each.)"""

    def __init__(self, pid: int, every: float = 0.1, tree: bool = False) -> None:
        self.pid, self.tree, self.samples, self.shmem, self.workers = pid, tree, [], [], []
        self.every = 1.0 if tree else every  # walking /proc for the tree costs more
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            total = workers = 0
            for pid in _tree(self.pid) if self.tree else [self.pid]:
                try:
                    anon = _anon(pid, proportional=self.tree)
                except OSError:
                    continue
                total += anon
                workers += anon if self.tree and _compile_worker(pid) else 0
            if total:
                self.samples.append((now, total))
            if self.tree:
                self.shmem.append((now, _node_shmem()))
                self.workers.append((now, workers))
            time.sleep(self.every)

    def stop(self) -> list:
        self._stop.set()
        self._t.join()
        return self.samples

    def peak(self, t0: float = 0.0, t1: float = float("inf")) -> int:
        return max((b for t, b in self.samples if t0 - self.every <= t <= t1 + self.every), default=0)


def run(cmd: list[str], env: dict, log: Path, tree: bool = False) -> tuple[int, AnonPoller, float]:
    t0 = time.time()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        poll = AnonPoller(p.pid, tree=tree)
        rc = p.wait()
    poll.stop()
    return rc, poll, time.time() - t0


def _set(d: dict, assignment: str) -> None:
    """`section.key=value` (value parsed as YAML) into the config dict `d`."""
    import yaml

    key, _, value = assignment.partition("=")
    *path, last = key.split(".")
    for k in path:
        d = d.setdefault(k, {})
    d[last] = yaml.safe_load(value)


def base_config(name: str, card: int, smoke: bool, method: str = "lora") -> tuple[dict, str]:
    """The config dict a run starts from and where it came from: the family's tiny config (--smoke) or its
    `<method>-<card>gb` preset (`lora-24gb`, `full-24gb`); where that file is missing, the family's preset of the
    nearest card size, else (LoRA) `fallback_config` (Wan's video presets came after this bench learned video)."""
    import yaml

    if smoke:
        path = ROOT / "configs" / "tiny" / f"{name}-{method}.yaml"
        if path.exists():
            return yaml.safe_load(path.read_text()), str(path)
        if method != "lora":
            raise SystemExit(f"--method {method} --smoke: no {path}")
        return fallback_config(name, True), "built here (no tiny config)"
    path = ROOT / "configs" / name / f"{method}-{card}gb.yaml"
    if path.exists():
        return yaml.safe_load(path.read_text()), str(path)
    cut = len(method) + 1
    sizes = sorted((abs(int(f.stem[cut:-2]) - card), f) for f in (ROOT / "configs" / name).glob(f"{method}-*gb.yaml")
                   if f.stem[cut:-2].isdigit())
    if sizes:
        return yaml.safe_load(sizes[0][1].read_text()), \
            f"{sizes[0][1]} (no {method}-{card}gb preset: the nearest card's)"
    if method != "lora":
        raise SystemExit(f"--method {method}: {name} has no {method}-*gb preset")
    return fallback_config(name, False), "built here (no preset: override with --set)"


def fallback_config(name: str, smoke: bool) -> dict:
    """A LoRA config for a family without presets: rank 16 (tiny: 4), gradient checkpointing, AdamW; on a GPU every
    block streamed with activation offloading and the text encoders streamed (offload.transformer 1.0,
    offload.activations, offload.text_encoders 1.0: fits any card the planner would stream on, the slowest way);
    `--set offload.transformer=...` etc. for the variant to measure."""
    rank = 4 if smoke else 16
    return {
        "model": {"family": name, "path": "", "dtype": "fp32" if smoke else "bf16"},
        "train": {"method": "lora", "steps": 1, "batch_size": 1, "seed": 0, "gradient_checkpointing": True},
        "lora": {"rank": rank, "alpha": rank},
        "optimizer": {"name": "adamw", "lr": 1e-4},
        "data": {"sources": [], "resolutions": [64 if smoke else 1024]},
        "offload": {} if smoke else {"transformer": 1.0, "text_encoders": 1.0, "activations": True},
        "sample": {},
        "output": {"dir": ""},
    }


def write_config(family: str, model: Path, images: Path, work: Path, res: int | None, steps: int, smoke: bool,
                 card: int, transformer_file: str | None = None, sets: list[str] | None = None, *,
                 clips=None, image: Path | None = None, method: str = "lora", preset: str | None = None) -> Path:
    """The run's config: `base_config` pointed at the model, the data (`images`, or for a video family the clips
    in that folder: `clips`, a program_video.Clips, and `image`, an image-to-video family's sample image) and
    `work`, a few steps, sampling during training on, then `sets`. `preset`: the `--families` entry, whose presets
    folder is taken where it has one (`wan-1.3b`: configs/wan-1.3b/, the 1.3 B's own), else the family's."""
    import yaml

    from trainer.models import adapter_class

    name = {"qwen_image": "qwen-image"}.get(family, family)  # the registry key: configs/<key>/, tiny/<key>-lora
    own = preset and not smoke and (ROOT / "configs" / preset).is_dir()  # a size without presets: the family's
    d, source = base_config(preset if own else name, card, smoke, method)
    print(f"{family} {card}gb: config from {source}", flush=True)
    d["model"]["path"] = str(model)
    ad = adapter_class(name)
    if ad.experts and not d["model"].get("expert"):  # a family of experts trains one per run: the first
        d["model"]["expert"] = next(iter(ad.experts))
    if transformer_file:
        d["model"].update({"transformer_file": str(model / FILES[transformer_file]), "quantize": "fp8"})
    if res is None:  # the preset's own resolution (an 8 GB preset may train at 512 px where 1024 does not fit)
        res = max(d["data"].get("resolutions") or [1024])
    d["data"].update({"sources": [{"path": str(images)}], "resolutions": [res], "cache_dir": str(work / "cache")})
    d["train"].update({"steps": steps, "checkpoint_every": 0, "log_every": 1})
    d["output"] = {**d.get("output", {}), "dir": str(work / "out")}
    d["sample"] = {**d.get("sample", {}), "prompts": ["a photo of a cat"], "every": max(1, steps - 1), "steps": 2,
                   "width": res, "height": res}
    if clips is not None:
        from bench.program.program_video import video_config

        video_config(d, ad, images, clips, image)
    if smoke:
        d["train"]["device"] = "cpu"
    for a in sets or ():
        _set(d, a)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{family}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def split_variant(name: str) -> tuple[str, str | None]:
    """`--families` entry -> (registry family, variant of its transformer or None): `wan-1.3b` is wan's 1.3b
    (`full_variants`)."""
    from trainer.models import ADAPTERS, adapter_class

    if name in ADAPTERS or name == "qwen_image":
        return name, None
    for fam in ADAPTERS:
        if name.startswith(fam + "-") and name[len(fam) + 1:] in getattr(adapter_class(fam), "full_variants", {}):
            return fam, name[len(fam) + 1:]
    raise SystemExit(f"--families {name}: not a family whose folder this bench writes")


def bench_family(name: str, work: Path, args) -> list[dict]:
    """Write (or, with --keep, reuse) the family's folder, then run the commands for each of `args.card`."""
    from trainer.models import adapter_class

    family, variant = split_variant(name)
    ad = adapter_class({"qwen_image": "qwen-image"}.get(family, family))
    fam_dir = work / name
    model = model_folder(name, fam_dir, args)
    clips, image, res = None, None, None
    if getattr(ad, "video", False):
        from bench.program.program_video import first_frame

        clips = video_clips(ad, args)
        data = write_clip_folder(name, fam_dir / "clips", args.images, clips)
        if getattr(ad, "first_frame_conditions", False):
            image = first_frame(fam_dir / "first-frame.png", clips)
    else:
        res = 64 if args.smoke else None if args.resolution is None else int(args.resolution)
        data = write_jpegs(fam_dir / "images", args.images, res or 1024)
    rows = []
    for card in args.card:
        run_dir = fam_dir / (f"{card}gb" + ("-full" if args.method == "full" else "") + (f"-{args.tag}" if args.tag else ""))
        cfg = write_config(family, model, data, run_dir, res, args.steps, args.smoke, card, args.transformer_file,
                           args.set, clips=clips, image=image, method=args.method, preset=name)
        rows += run_commands(name, card, cfg, run_dir, args)
    if not args.keep:
        shutil.rmtree(model, ignore_errors=True)
    return rows


def model_folder(name: str, fam_dir: Path, args) -> Path:
    """The model folder of `--families` entry `name` under `fam_dir`: the tiny one (`args.smoke`; with
    `args.transformer_file` fp8 its transformer rewritten as the full-size one would be), the one an earlier run
    left (`args.keep`: only a missing transformer file is added), else a full-size folder written here."""
    from trainer.models import adapter_class

    family, variant = split_variant(name)
    ad = adapter_class({"qwen_image": "qwen-image"}.get(family, family))
    fam_dir.mkdir(parents=True, exist_ok=True)
    model = fam_dir / "model"
    if args.smoke:
        from trainer.models.tiny import make_tiny_models

        model = make_tiny_models(fam_dir / "tiny", [family])[0]
        if args.transformer_file == "fp8":  # the tiny transformer through the same writer
            tcls = ad.transformer_cls
            meta = _meta(lambda: tcls.from_config(tcls.load_config(model / "transformer")))
            write_transformer_file(model, meta, ad)
            for d in set(getattr(ad, "experts", {}).values()) - {"transformer"}:  # as `write_full_folder` leaves them
                _config_only(model / d, meta)
    elif args.keep and (model / "model_index.json").exists() and (
            args.transformer_file or any((model / "transformer").glob("diffusion_pytorch_model*"))):
        print(f"{name}: reusing {model}", flush=True)
        if args.transformer_file and not (model / FILES[args.transformer_file]).exists():  # only the file is new
            t = time.time()
            conf = ad.full_variants[variant] if variant else ad.full_config
            nbytes = write_transformer_file(model, _meta(lambda: ad.transformer_cls.from_config(conf)), ad,
                                            args.transformer_file)
            print(f"{name}: wrote {nbytes / 1e9:.1f} GB ({args.transformer_file}) in {time.time() - t:.0f} s",
                  flush=True)
    else:
        t = time.time()
        nbytes = write_full_folder(family, model, args.transformer_file, variant)
        print(f"{name}: wrote {nbytes / 1e9:.1f} GB of random weights in {time.time() - t:.0f} s", flush=True)
    return model


def video_clips(ad, args):
    """The program_video.Clips a video family's runs train on: `args.resolution` (smoke 96x64, else 480p),
    `args.frames` / `args.sample_frames` (smoke: the shortest the family takes, else 81 / 9), its frame rate and
    sound."""
    from bench.program.program_video import Clips, divisor, video_size

    size = video_size(args.resolution or ("96x64" if args.smoke else "480p"), divisor(ad))
    shortest = ad.frame_step + 1  # the smoke's clips and samples: Wan 5 frames, LTX-2 9
    frames, sample_frames = (args.frames or shortest, args.sample_frames or shortest) if args.smoke else (
        args.frames or 81, args.sample_frames or 9)
    if not (ad.valid_frames(frames) and ad.valid_frames(sample_frames)):
        raise SystemExit(f"--frames {frames} / --sample-frames {sample_frames}: {ad.family} takes "
                         f"{ad.frame_step}k + 1 frames")
    return Clips(*size, frames, sample_frames, fps=ad.default_fps, sound=ad.sound)


def write_clip_folder(name: str, folder: Path, n: int, clips) -> Path:
    """`n` clips (program_video.py `write_clips`) in `folder`, with a line saying what was written and how long it
    took."""
    from bench.program.program_video import write_clips

    t = time.time()
    data = write_clips(folder, n, clips)
    print(f"{name}: wrote {n} clips of {clips.frames + 4} frames at {clips.width}x{clips.height}, {clips.fps:g} fps"
          f"{' with sound' if clips.sound else ''} in {time.time() - t:.0f} s", flush=True)
    return data


def run_commands(family: str, card: int, cfg: Path, run_dir: Path, args) -> list[dict]:
    phase_log = run_dir / "phases.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               DITTRAIN_PHASE_LOG=str(phase_log))
    if not args.smoke:
        env["DITTRAIN_VRAM_CAP_GB"] = str(card - 1)
    py = [sys.executable, "-m", "trainer"]
    commands = {
        "cache": py + ["cache", str(cfg)],
        "fit": (py if args.gpus == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                           str(args.gpus), "-m", "trainer"]) + ["fit", str(cfg)],
        "sample": py + ["sample", str(cfg), "--prompt", "a photo of a dog", "--steps", "2"],
    }
    label = f"{family} {card}gb" + (" full" if args.method == "full" else "") + (f" {args.tag}" if args.tag else "")
    rows = []
    for cmd_name in args.commands.split(","):
        if cmd_name == "none":  # the folder, clips and config only
            continue
        log_file = run_dir / f"{cmd_name}.log"
        before = _records(phase_log)
        rc, poll, wall = run(commands[cmd_name], env, log_file, tree=cmd_name == "fit" and args.gpus > 1)
        recs = _records(phase_log)[len(before):]
        lines = log_file.read_text().strip().splitlines() if log_file.exists() else []
        key = key_lines(lines)
        print("\n".join(f"[{label} {cmd_name}] {line}" for line in key), flush=True)
        rows.append({"family": family, "label": label, "command": cmd_name, "rc": rc, "wall_s": wall,
                     "anon_peak": poll.peak(), "shmem_peak": max((b for _, b in poll.shmem), default=0),
                     "workers_peak": max((b for _, b in poll.workers), default=0),
                     "gpus": args.gpus if cmd_name == "fit" else 1, "last_line": lines[-1] if lines else "", "key_lines": key,
                     "phases": _per_phase(recs, poll)})
    return rows


#: the lines of a command's log that carry its measurements and decisions, echoed to the bench's own output and
#: kept in results.json: a GPU machine that returns only some files still returns these
KEY_PREFIXES = ("phase ", "step ", "offload:", "compile:", "note:", "error:", "warning:", "lora:", "device ", "wrote ",
                "threads:")


def key_lines(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip().startswith(KEY_PREFIXES)]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _per_phase(recs: list[dict], poll: AnonPoller) -> dict:
    """Per phase: peaks over every process, and `times` per rank ({rank: [seconds of each record]}). A torchrun
    launch writes each phase once per process, all at the same time: their sum (what this table showed before,
    "load 88.6 s" for four processes that each loaded in ~22 s) is no time anyone waited."""
    out: dict[str, dict] = {}
    for r in recs:
        p = out.setdefault(r["phase"], {"vram": 0, "alloc": 0, "anon": 0, "times": {}})
        p["vram"] = max(p["vram"], r["vram_reserved"])
        p["alloc"] = max(p["alloc"], r.get("vram_allocated", 0))
        p["anon"] = max(p["anon"], poll.peak(r["start"], r["end"]), r["anon_rss"])
        p["times"].setdefault(int(r.get("rank", 0)), []).append(r["end"] - r["start"])
    return out


def phase_time(name: str, times: dict[int, list[float]]) -> str:
    """The `time s` cell of phase `name`: for training steps, the median over every process's steps after its
    first; otherwise the slowest process's total (the processes run their phases side by side)."""
    if name == "training step":
        steps = [t for ts in times.values() for t in ts[1:]]
        if steps:
            return f"median {statistics.median(steps):.2f} of {sum(len(ts) for ts in times.values())}"
    return f"{max(sum(ts) for ts in times.values()):.1f}"


def report(rows: list[dict]) -> list[str]:
    lines = ["| family | command | rc | phase | peak reserved VRAM GB | peak allocated GB | peak anon RSS GB | time s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        gpus = r.get("gpus", 1)
        what = "(process)" if gpus == 1 else (f"({gpus} processes: anon PSS summed, torch's compile workers "
                                              f"{r.get('workers_peak', 0) / 1e9:.1f} GB of it at their peak; node "
                                              f"shmem peak {r['shmem_peak'] / 1e9:.1f} GB; phase times: the slowest "
                                              "process's)")
        lines.append(f"| {r['label']} | {r['command']} | {r['rc']} | {what} | | | {r['anon_peak'] / 1e9:.1f} | "
                     f"{r['wall_s']:.0f} |")
        for name, p in r["phases"].items():
            shown = phase_time(name, p["times"])
            lines.append(f"| | | | {name} | {p['vram'] / 1e9:.2f} | {p['alloc'] / 1e9:.2f} | {p['anon'] / 1e9:.1f} | "
                         f"{shown} |")
        if r["rc"]:
            lines.append(f"| | | | last line: {r['last_line'][:200]} | | | | |")
    return lines


#: the families `_full_parts` knows the text encoders and VAE of (others declare them: `full_size_parts`)
WRITABLE = ("flux", "sd3", "qwen_image", "qwen-image", "flux2", "flux2-klein", "z-image", "chroma", "qwen-image-2.1", "krea2", "flux3")


def writable() -> list[str]:
    """WRITABLE, every family whose adapter declares `full_size_parts`, and their transformers' other sizes
    (`full_variants`: wan-1.3b)."""
    from trainer.models import ADAPTERS, adapter_class

    out = list(WRITABLE)
    for f in ADAPTERS:
        cls = adapter_class(f)
        if hasattr(cls, "full_size_parts"):
            out += [f] * (f not in out) + [f"{f}-{v}" for v in getattr(cls, "full_variants", {})]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=["flux", "sd3", "qwen_image"], choices=writable(),
                    help="families whose full-size folder this script writes (<family>-<size>: another size of its "
                    "transformer, e.g. wan-1.3b)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dittrain-bench-program"))
    ap.add_argument("--card", type=int, nargs="+", default=[8], help="preset card sizes in GB, run one after "
                    "another on the same folder; the VRAM cap is card - 1")
    ap.add_argument("--method", default="lora", choices=("lora", "full"), help="which presets: lora-<card>gb (the "
                    "default) or full-<card>gb (a full fine-tune; its run folder <card>gb-full)")
    ap.add_argument("--resolution", default=None,
                    help="train and sample at this size instead of each preset's own (data.resolutions); video "
                    "families: 480p (832x480, the default), 720p (1280x720) or WxH, the clips' size")
    ap.add_argument("--frames", type=int, default=None, help="video families: frames per training clip at the "
                    "family's rate (Wan: 4k + 1 at 16 fps, LTX-2: 8k + 1 at 24; default 81, smoke 5 / 9)")
    ap.add_argument("--sample-frames", type=int, default=None, help="video families: frames per sample (during "
                    "the fit and `dittrain sample`; default 9, smoke 5 / 9)")
    ap.add_argument("--estimate", action="store_true", help="print each family's folder size on disk and its "
                    "estimated write time; write and run nothing")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (tests)")
    ap.add_argument("--keep", action="store_true", help="keep the written model folders, and reuse one already in --work")
    ap.add_argument("--transformer-file", choices=sorted(FILES), default=None,
                    help="fp8: write the transformer as one fp8 single file (block Linears float8_e4m3fn with "
                    "per-tensor scale_weight, the rest bf16) and train with model.transformer_file and quantize fp8; "
                    "fp8-original: the same in Flux.1's original (BFL) layout under ComfyUI's model.diffusion_model. "
                    "prefix. With --keep, a folder written for the other kind is reused and only the file is added")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a preset setting (dotted key, YAML value), e.g. --set sample.guidance=1")
    ap.add_argument("--tag", default="", help="a name for this variant (its run folder and table rows)")
    ap.add_argument("--gpus", type=int, default=1, help="`fit` on this many GPUs of the host (torchrun "
                    "--nproc_per_node; cache and sample run as one process): the fit row's anonymous PSS is summed "
                    "over the processes, the node's shared memory (the /dev/shm arena) beside it, VRAM is the largest GPU's")
    ap.add_argument("--commands", default="cache,fit,sample", help="which commands to run, in order (fit alone "
                    "caches too); `none` writes the model folder (kept, as with --keep), the data and the config and "
                    "runs nothing: on one host write the folders one after another, then run the jobs side by side (four folders written "
                    "at once took about four times as long each, bench/history/2026-11-28.md 19:55)")
    args = ap.parse_args(argv)
    unknown = set(args.commands.split(",")) - {"cache", "fit", "sample", "none"}
    if unknown:
        ap.error(f"--commands {args.commands}: {', '.join(sorted(unknown))} is not cache, fit, sample or none")
    if args.commands == "none":  # a folder written to be run by the next invocation (--keep) stays
        args.keep = True
    if args.smoke:
        args.steps = min(args.steps, 2)
    if args.estimate:
        for name in args.families:
            family, variant = split_variant(name)
            folder = args.work / name / "estimate"
            write_full_folder(family, folder, args.transformer_file, variant, write=False)
            shutil.rmtree(folder, ignore_errors=True)
        return 0
    rows = []
    for fam in args.families:
        rows += bench_family(fam, args.work, args)
        print("\n".join(report([r for r in rows if r["family"] == fam])), flush=True)
    (args.work / "results.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(["", *report(rows)]))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
