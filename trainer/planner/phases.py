"""Every phase of `dittrain fit` on one table: predicted peak VRAM and peak host RAM of each.

The training step is not the only thing on the card. A run also loads the transformer, encodes captions (the
text encoders, streamed at offload.text_encoders) and latents (the VAE), samples during training (the training
ring and LoRA state stay, the VAE comes for the call) and saves checkpoints. `predict_phases` gives each phase's
peak reserved VRAM and peak host RAM (bytes); `fit_phases` picks offload.text_encoders so that text caching fits
the same budget the transformer fraction was chosen for, so that the largest phase decides whether a config fits.
The trainer logs each phase's measured peak beside these (trainer/phase_log.py).

How each is estimated (bf16 sizes; activations of the encoders are coarse, the bench measures them):
- load: the transformer is read into pageable RAM, its blocks packed into the pinned arena; on the GPU the
  ring, the non-block modules and the trained weights' state (the training step's static part), or, when
  sampling during training has prompts, the text encoders encoding them before that (as in text caching). RAM:
  the training step's, or where a sample's prompts are encoded there, the text caching phase's if larger (the
  encoders are loaded into CPU RAM within the load phase: LTX-2's 16 GB preset measured 27.9 and 28.5 GB there
  against 21.1 predicted, bench/history/2026-11-28.md 01:27 and 03:50; with the process counted, 29.7).
- text caching: every text encoder on the GPU at once, its non-block bytes and the ring of its block bytes at
  f = offload.text_encoders (`capacity_for`: whole blocks), plus the encode batch's activations (T5's attention
  scores in fp32 are most of them; a family that counts its own, `text_encode_peaks`, the larger of its peaks:
  LTX-2's stacked Gemma states, then its text connectors visiting with one prompt's norm) and workspace; RAM:
  the process's own (`HOST_BASE`, as in training) and the encoders in CPU RAM as loaded (LTX-2's 16 GB preset:
  28.5 GB measured, 27.2 predicted without the process, 29.7 with it). The encoders' blocks
  and the rest are those of the encoder as the loader builds and slims it from the folder's config, or, without a
  folder, the family's shares of its full-size encoder (trainer/planner/meta.py `text_encoder_sizes`).
- latent caching: the VAE's weights (the family's `vae_params`) plus its encode activations of one image (batches
  are sliced), about `VAE_ACT_ENCODE` bytes per pixel, or the family's `vae_encode_bytes_per_pixel` (Qwen-Image's
  VAE: more) (tiled above 1 MP, trainer/data/cache.py, so at most 1 MP counts). A video family's: the VAE's encode of one clip of the training bucket (`Facts.size`), counted on the
  meta device (vae.py: a causal chunk's working set and caches, not the clip's; reserved as measured on an H100,
  `RESERVED_PER_COUNTED`), plus the batch of clips
  (data.encode_batch_size) on the GPU (twice for image-to-video, which encodes [first frame, zeros] too) and an
  image encoder that sits beside the VAE (`cache_encoder_params`: Wan 2.1 I2V's CLIP); RAM: the process's own
  (`HOST_BASE`), the VAE as read, and the batch's frames as read and stacked (`CLIP_RAM_PER_PIXEL`; LTX-2's 16 GB
  preset measured 9.2 and 9.4 GB against 4.8 predicted without these two terms: 9.6 GB with them for a batch of 4
  clips, 8.4 for the 3 clips those runs encoded).
  Clips encode tiled above 1 MP, and where the untiled encode would not fit the card (`budget`; the cache asks the
  device the same question, `encode_tiles`): HunyuanVideo 1.5 at 720p x 121, whose encode reserves 18.4 GB untiled,
  1.1 GB in 256 px tiles (bf16).
- training step: `predict` (prediction.py).
- sampling: the training step's static part (ring, non-block, LoRA state) + the VAE + the pipeline's KV cache
  where it keeps one (sampling.py `kv_cache_bytes`: Qwen-Image 2.1) + what the call holds for its prompts where
  the family counts it (sampling.py: LTX-2's sound decoders) + the larger of the denoising forward's
  activations (sampling.py; doubled under classifier-free guidance) and the tiled decode's (512-pixel tiles above
  512x512). A video family's forward is its sample's clip (sample.width x height x frames) and its decode the
  video VAE's, tiled as diffusers tiles it above 512x512 (vae.py). A family's other sampling transformers
  (`sampling_components`: Ideogram 4's unconditional one) are placed at 1.0 beside the training ring (their ring
  and non-block weights) and, in RAM, their blocks' pinned arena for the call (`component_ram`).
- checkpoint save: on the GPU what the training step reserved (the caching allocator keeps it; the save adds
  little), or where every save of the run follows a sampling or validation phase, which empties the cache on its
  way out (`saves_after_emptied_cache`: the final save after the last step's sample, with no periodic checkpoint),
  the step's static part and `WORKSPACE` (Wan 2.2 A14B at 720p x 81, both experts, every block streamed, a sample
  each step: 2.39 GB measured, 2.40 predicted, where the step's 31.52 had been printed; bench/history/2026-11-28.md
  07:43); in RAM what a process holds between steps plus what the save copies: LoRA's weights and state (to the
  CPU for their files); a full fine-tune's tensors on the GPU alone (`save_copies`: safetensors writes a CPU
  tensor from its memory, and a streamed block's weights and state are its host copies after `handle.sync()`),
  the larger of the weights' file and the optimizer's, not the whole model and state (one of 4 processes,
  Flux.1-dev Adafactor with masters, every block streamed: 15.4 GB measured, 144.7 predicted before, 15.8 now;
  issue 40). That needs the optimizer file to take the arena's views of the state where they lie
  (trainer/optim/state.py): cloning every view of the one arena added the whole streamed state (Wan 2.1 1.3B's
  8 GB preset, one process: 27.4 GB measured against 16.9 predicted, bench/logs/2026-11-28i).
Several processes of one host (`processes`, `shared`; the trainer's phase lines under torchrun): each line is one
process's RAM as its anonymous RSS counts it. Where the streamed blocks' arena is the host's one /dev/shm file
(trainer/train/streaming.py `shared_arena`: a LoRA's, or a full fine-tune's over the sharded stream) it is file
pages, in no process's anonymous RSS: left out of every phase and said once for the node (prediction.py
`shared_arena_bytes`, the load line's "node: ... shared arena"); a full fine-tune's owned steps (owners.py) keep 1/N
of the streamed blocks' optimizer state (masters included) in each process, made at the first step (none at load).
VRAM is one GPU's: the one-process figures, except under a full fine-tune's owned steps, whose ring holds the weights
alone and whose state visits the GPU 1/N at a time (prediction.py `with_owned_steps`). Where each process has its
own arena (whole copies, no /dev/shm) the one-process figures stand. `dittrain plan --gpus N` prints one process's
figures too (report.py). Issue 40's runs on 4 x H200: the full fine-tune above measured 1.8 / 13.9 / 15.4 GB of RAM
(load / step / save; 2.5 / 14.3 / 15.8 predicted, 73.6 / 73.6 / 144.7 before) beside a 23.8 GB arena (23.67
predicted), and 6.69 GB of VRAM in the step and the save (6.97 predicted, 8.97 before; the load measured 2.46, the
caching phases' reserve kept, against 1.78); Flux.1-dev's LoRA 48 GB preset 2.1 / 2.3 / 2.7 (2.5 / 2.5 / 3.1;
14.2 / 14.2 / 14.8 before) beside its 11.67 GB arena. fsdp (train.distributed) has no
per-process model here: its lines give the one-process figures.
RAM outside the training step (load, sampling, checkpoint save) holds no offloaded activations: none exist before
the first step, and the trainer gives their pinned buffers back before sampling and a checkpoint save
(trainer/offload/activations.py `release`), so those phases count the step's RAM peak less them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..models import adapter_class
from ..optim.specs import optimizer_spec
from .meta import TextEncoderSize, shared_sizes
from .prediction import (
    ALLOCATOR_OVERHEAD,
    GB,
    HOST_BASE,
    WORKSPACE,
    Facts,
    held_on_gpu,
    owned_state_bytes,
    predict,
    process_ram,
    with_owned_steps,
)
from .sampling import SAMPLE_TILE_PIXELS, VAE_ACT_DECODE, cfg_batch, predict_sampling
from .text import table as text_table
from .vae import RESERVED_PER_COUNTED, clip_bytes, clip_peak

#: activation bytes per image pixel at the peak of a bf16 VAE encode (128 channels at full resolution, a few live
#: tensors; the decode: sampling.py VAE_ACT_DECODE): coarse, from diffusers' figures for 1024 px
VAE_ACT_ENCODE = 6 * 128 * 2
CACHE_TILE_PIXELS = 1024 * 1024  # trainer/data/cache.py VAE_TILE_PIXELS
#: host bytes per pixel of every frame of the latent cache's batch of clips: each clip as read (fp32 (3, F, H, W):
#: 12 bytes a pixel, trainer/data/video.py `load_clip`) and their `torch.stack` into the batch (12 more), both alive
#: until the batch moves to the GPU (trainer/data/cache.py `_encode_latents`)
CLIP_RAM_PER_PIXEL = 2 * 3 * 4


@dataclass
class PhasePrediction:
    name: str
    vram: float  #: peak reserved bytes
    ram: float  #: peak host RAM bytes
    note: str = ""


#: T5's eager attention holds batch x heads x tokens^2 scores several times over: the bf16 scores, an fp32 copy
#: for the softmax, its fp32 result and the bf16 cast (12 bytes an entry; T5-XXL has 64 heads). An upper bound
#: for the encoders that use fused attention. Without it the Flux 8 GB preset (predicted 6.9 GB) ran out of
#: memory at its 7.0 GB cap while caching captions (bench/history/2026-11-23.md, 2026-11-23).
TEXT_ATTN_HEADS = 64
TEXT_ATTN_BYTES = 2 + 4 + 4 + 2


def text_sizes(facts: Facts) -> list[TextEncoderSize]:
    """The text encoders as the run holds them: built from the folder where `analyze` could
    (`Facts.text_sizes`), else the family's shares of `Facts.text_encoders` (trainer/planner/meta.py)."""
    sizes = facts.text_sizes
    return list(sizes) if sizes is not None else shared_sizes(facts.family, facts.text_encoders)


def _text_vram(facts: Facts, te_fraction: float, encode_batch: int, stage: str = "cache") -> float:
    """The text encoders placed at `te_fraction` and what encoding `encode_batch` prompts holds beside them:
    captions' caching (`stage` "cache") or a sample's prompts ("sample"). A family that counts its own encoding
    (`text_encode_peaks`: LTX-2's stacked Gemma states and the text connectors visiting) gives each peak's
    (weights, activations); otherwise a generic estimate of the activations."""
    total = 0.0
    for s in text_sizes(facts):
        total += s.on_gpu(te_fraction)
    peaks = facts.adapter.text_encode_peaks(encode_batch, facts.dtype.itemsize, stage)
    if peaks is not None:
        return total + max(w + ALLOCATOR_OVERHEAD * a for w, a in peaks) + WORKSPACE
    # activations: encode_batch x tokens x 4096 wide x a few tensors and the FFN's widening; attention scores
    t = facts.text_tokens
    act = encode_batch * t * 4096 * 2 * 8 + encode_batch * TEXT_ATTN_HEADS * t * t * TEXT_ATTN_BYTES
    return total + ALLOCATOR_OVERHEAD * act + WORKSPACE


def _text_ram(facts: Facts) -> float:
    """The text encoders as loaded into CPU RAM: without the parameters their config leaves out."""
    return sum(s.loaded for s in text_sizes(facts))


def predict_phases(cfg, fraction: float, facts: Facts, te_fraction: float | None = None,
                   budget: float | None = None, kept: frozenset[int] = frozenset(), processes: int = 1,
                   shared: bool = False) -> list[PhasePrediction]:
    """Predicted peaks of every phase of `dittrain fit` for `cfg` at transformer fraction `fraction`; `budget`
    (bytes, the card's): a video family's clips that would not encode untiled within it are counted tiled, as the
    cache encodes them on that card; `kept`: the blocks that keep their activations in the training step
    (train.gradient_checkpointing: auto, planner/checkpointing.py; the checkpoint save keeps what it reserved).
    `processes` of one host training together, `shared`: the streamed blocks' arena is the host's one /dev/shm
    file (trainer/train/streaming.py `shared_arena`): RAM is then one process's (module essay, "Several
    processes"), the arena said once (prediction.py `shared_arena_bytes`)."""
    te = float(cfg.offload.text_encoders) if te_fraction is None else te_fraction
    res = max(facts.resolutions)
    if shared:  # a full fine-tune's shared arena: owned steps, the ring holds the weights alone (`with_owned_steps`)
        facts = with_owned_steps(facts, processes)
    train = predict(facts, fraction, res, cfg.offload.activations, kept=kept)
    step_ram = process_ram(facts, train, fraction, processes, shared)  # one process's (its arena, if its own)
    esize = 2 if facts.dtype.itemsize == 2 else facts.dtype.itemsize
    vae = facts.adapter.vae_params * esize  # the full-size VAE's parameters
    text_bytes = HOST_BASE + _text_ram(facts)  # the process's own and the encoders as loaded
    encode_batch = cfg.data.encode_batch_size if cfg.data else 4
    text_vram = _text_vram(facts, te, encode_batch)
    s = cfg.sample
    # encoded before the transformer, one prompt (and its negative) at a time, as the sampler's `pipeline_embeds`
    prompts_at_load = _text_vram(facts, te, 1, "sample") if s.every and s.prompts else 0.0
    # RAM outside a training step: no offloaded activations (none before the first step; the trainer gives their
    # buffers back before sampling and a checkpoint save, trainer/offload/activations.py `release`)
    between_steps = step_ram - train.act_checkpoint_host
    # owned steps: each process's share of the state is made at its parameters' first step (StateOffload)
    loaded = between_steps - owned_state_bytes(facts, fraction, processes, shared)
    out = [
        PhasePrediction("text caching", text_vram, text_bytes, f"offload.text_encoders {te:g}"),
        _latent_caching(facts, res, vae, encode_batch, budget),
        # RAM: the text encoders are loaded in the load phase too where a sample's prompts are encoded there
        PhasePrediction("load", max(train.static, prompts_at_load), max(loaded, text_bytes if prompts_at_load
                                                                         else 0.0),
                        f"offload.transformer {fraction:g}" + (", sample prompts encoded" if prompts_at_load else "")),
        PhasePrediction("training step", train.peak_reserved, step_ram, _bucket(facts, res)),
    ]
    if s.every and s.prompts:
        sp = s.width * s.height
        clip = facts.vae_config is not None  # a video family's sample: its clip, and the video VAE's decode
        # its activations (a batch of two under classifier-free guidance); the ring is the training one
        kw = {"batch": cfg_batch(facts.family, s.guidance), "size": (s.width, s.height, s.frames) if clip else None}
        samp = predict_sampling(facts, 0.0, int(sp**0.5), **kw)
        # the pipeline's KV cache (if any) lasts through the denoising loop and the decode
        # (the prompts' bytes the call holds too: `samp.prompt`, outside both)
        sample_act = (samp.peak_reserved - sum(facts.packed) - facts.nonblock_bytes - WORKSPACE - samp.kv_cache
                      - samp.others - samp.prompt)
        # the family's other sampling transformers: the training sampler streams them at 1.0 (sampling/training.py)
        others = predict_sampling(facts, 1.0, int(sp**0.5), **kw).others if samp.others else 0.0
        if clip:
            dec = RESERVED_PER_COUNTED * clip_peak(facts.family, facts.vae_config, facts.dtype, "decode", s.width,
                                                   s.height, s.frames, tiled=sp > SAMPLE_TILE_PIXELS)
        else:
            dec = min(sp, SAMPLE_TILE_PIXELS) * VAE_ACT_DECODE * ALLOCATOR_OVERHEAD
        size = f"{s.width}x{s.height}" + (f"x{s.frames}" if clip and s.frames > 1 else "")
        # an image encoder the sample's image visits the GPU for (its blocks stay reserved: `sample_encoder_on_device`)
        image_enc = facts.adapter.cache_encoder_params * esize if facts.adapter.sample_encoder_on_device else 0
        out.append(PhasePrediction("sampling", train.static + vae + image_enc + samp.kv_cache + others + samp.prompt
                                   + max(sample_act, dec) + WORKSPACE,
                                   between_steps + vae + component_ram(facts), f"every {s.every} steps, {size}"))
    owners = processes if owned_state_bytes(facts, fraction, processes, shared) else 1
    state = (facts.trainable_params * 4 + facts.state_gpu) if facts.method == "lora" else save_copies(
        facts, fraction, owners)
    if saves_after_emptied_cache(cfg):  # the static part alone is live, and the cache holds nothing else
        out.append(PhasePrediction("checkpoint save", train.static + WORKSPACE, between_steps + state,
                                   "trained weights + state; after a phase that empties the cache"))
    else:
        out.append(PhasePrediction("checkpoint save", train.peak_reserved, between_steps + state,
                                   "trained weights + state; the step's reserved VRAM kept"))
    return out


#: diffusers' `save_pretrained` writes a transformer in files of at most this many bytes (its max_shard_size,
#: "10GB"), each one `safetensors.torch.save_file`
SAVE_FILE_BYTES = 10 * 10**9


def save_copies(facts: Facts, fraction: float, owners: int = 1) -> float:
    """Host bytes a full fine-tune's checkpoint save adds to what the process holds between steps. safetensors
    (0.8, `save_file`) writes a CPU tensor from its own memory and copies a GPU tensor to the CPU first, keeping
    one file's copies until that file is written; after `handle.sync()` a streamed block's weights and state are
    its host copies (the arena, StateOffload's buffers), so only what the GPU holds is copied (`held_on_gpu`):
    the weights (`save_pretrained`, rank 0, one file of at most `SAVE_FILE_BYTES` at a time), then the optimizer
    state (one file: with owned steps each of the `owners` processes writes its own 1/N, owners.py). The larger
    of the two: not the whole model and state (a full-size Flux on 4 processes measured 1.5 GB over the step)."""
    weights, state = held_on_gpu(with_owned_steps(facts, owners), fraction)
    return max(min(weights, SAVE_FILE_BYTES), state / owners)


def saves_after_emptied_cache(cfg) -> bool:
    """Whether every checkpoint save of `dittrain fit` comes after a phase that gives the CUDA cache back (sampling
    and validation: phase_log.py `own_cache`) rather than straight after a training step. `fit`'s loop saves a
    periodic checkpoint (train.checkpoint_every, output.save_every; `run.save_due`: steps before the last) right
    after its step, before that step's sample or validation; the final save follows the loop, so after the last
    step's sample or validation where that step has one. Stopping on a signal saves after a step too (not counted:
    a run stopped early)."""
    t, s = cfg.train, cfg.sample
    if any(n and n < t.steps for n in (t.checkpoint_every, cfg.output.save_every)):
        return False
    sampled = bool(s.every and s.prompts) and t.steps % s.every == 0
    validated = bool(t.validate_every) and t.steps % t.validate_every == 0
    return sampled or validated


def run_ram_peaks(cfg, fraction: float, facts: Facts) -> dict[str, float]:
    """model.expert: both: the whole run's predicted host-RAM peak (bytes; the largest phase of `dittrain fit`,
    the offloaded activations included) with the idle expert parked in RAM ("ram") and on disk ("disk"), at
    transformer fraction `fraction`: what offload.park: auto decides by (prediction.py `auto_parks_on_disk`)."""
    return {mode: max(p.ram for p in predict_phases(cfg, fraction, replace(facts, park=mode)))
            for mode in ("ram", "disk")}


def component_ram(facts: Facts) -> float:
    """Host bytes the family's other sampling transformers (`sampling_components`: Ideogram 4's unconditional one,
    the trained one's size) hold while a sample during training runs: each is read for the call into a pinned
    arena of all its blocks (streamed at 1.0; trainer/sampling/training.py) and freed after."""
    blocks = facts.packed if facts.method == "lora" else facts.block_param_bytes  # weights only, no optimizer state
    return len(facts.adapter.sampling_components) * float(sum(blocks))


def _bucket(facts: Facts, res: int) -> str:
    """`res` px, and for a video family the clip the planner traces there (`Facts.size`)."""
    w, h, frames = facts.size(res)
    return f"{res} px" + (f": {w}x{h}x{frames} clips" if facts.adapter.video else "")


def _latent_caching(facts: Facts, res: int, vae: float, encode_batch: int,
                    budget: float | None = None) -> PhasePrediction:
    """`dittrain cache`'s latent stage at bucket `res`: the VAE (and an image encoder beside it) and one item's
    encode (module essay). A video family's clips encode tiled above `CACHE_TILE_PIXELS`, and where the untiled
    encode would not fit `budget` (bytes; the cache asks the device, `encode_tiles`)."""
    cls = facts.adapter
    if facts.vae_config is None:  # an image: bytes per pixel
        px = res * res
        enc_act = min(px, CACHE_TILE_PIXELS) * (cls.vae_encode_bytes_per_pixel or VAE_ACT_ENCODE)
        return PhasePrediction("latent caching", vae + ALLOCATOR_OVERHEAD * enc_act + WORKSPACE, HOST_BASE + vae + px * 12,
                               "tiled" if px > CACHE_TILE_PIXELS else "untiled")
    w, h, frames = facts.size(res)
    encoder = cls.cache_encoder_params * facts.dtype.itemsize
    ram = HOST_BASE + vae + encoder + encode_batch * frames * w * h * CLIP_RAM_PER_PIXEL

    def vram(tiled: bool) -> float:
        return vae + encoder + encode_need(facts.family, facts.vae_config, facts.dtype, w, h, frames, encode_batch,
                                           tiled)

    # the cache's own rule (`encode_tiles`), with the room the card's budget leaves beside the VAE
    tiled = w * h > CACHE_TILE_PIXELS if budget is None else \
        encode_tiles(facts.family, facts.vae_config, facts.dtype, w, h, frames, encode_batch, budget - vae - encoder)
    note = f"{w}x{h}x{frames} clips, " + ("tiled" if tiled else "untiled")
    if tiled and w * h <= CACHE_TILE_PIXELS:  # tiled for the budget alone
        note += f" (untiled {vram(False) / GB:.1f} GB)"
    return PhasePrediction("latent caching", vram(tiled), ram, note)


def encode_need(family: str, vae_config: dict, dtype, width: int, height: int, frames: int, batch: int,
                tiled: bool) -> float:
    """Reserved bytes the latent cache's encode of a batch of `batch` clips needs beside the VAE's weights: the
    clips on the GPU (twice for an image-to-video family that encodes [first frame, zeros] too), the encode of one
    clip (batches are sliced) counted on the meta device, untiled or `tiled` (vae.py), as reserved
    (`RESERVED_PER_COUNTED`), and `WORKSPACE`."""
    cls = adapter_class(family)
    copy = cls.first_frame_conditions and cls.conditions_copy_clip
    clips = batch * clip_bytes(width, height, frames, dtype) * (2 if copy else 1)
    act = clip_peak(family, vae_config, dtype, "encode", width, height, frames, tiled=tiled)
    return clips + RESERVED_PER_COUNTED * act + WORKSPACE


def encode_tiles(family: str, vae_config: dict, dtype, width: int, height: int, frames: int, batch: int,
                 room: float) -> bool:
    """Whether the latent cache encodes these clips of a video family tiled: above `CACHE_TILE_PIXELS` always, else
    where the untiled encode's `encode_need` is over `room`, the bytes the device has beside the VAE's weights
    (trainer/sampling/placement.py `encode_tiles` asks it; the latent-caching phase predicts the same against the
    budget)."""
    if width * height > CACHE_TILE_PIXELS:
        return True
    return encode_need(family, vae_config, dtype, width, height, frames, batch, False) > room


#: headroom kept under the budget when choosing offload.text_encoders: the encoders' activations are the
#: coarsest estimate here, and streaming more of a phase that runs once costs little time
TEXT_HEADROOM = 0.5 * GB


def fit_text_fraction(facts: Facts, budget_gb: float, encode_batch: int = 4) -> float:
    """The smallest offload.text_encoders (0.05 grid) whose text-caching peak fits `budget_gb` with
    `TEXT_HEADROOM` to spare; 1.0 if none."""
    for i in range(21):
        f = round(0.05 * i, 2)
        if _text_vram(facts, f, encode_batch) <= budget_gb * GB - TEXT_HEADROOM:
            return f
    return 1.0


def fallbacks(facts: Facts) -> list[str]:
    """One line per way the traces so far fell back to the eager count of saved tensors (a compiled run saves
    less, so the figures over-count it): printed beside the phase lines, so that a count that failed is seen (torch
    2.11's meta device once made every GPU host's figures the eager ones, unnoticed)."""
    return [f"planner: saved tensors counted as {why}; its figures over-count a compiled run"
            for why in sorted({tr.saved_by for tr in facts.traces.values() if "failed" in tr.saved_by})]


def arena_shared(cfg, fraction: float, processes: int) -> bool:
    """Whether `processes` processes of one host training `cfg` at `fraction` stream from the host's one /dev/shm
    arena, as `dittrain plan --gpus N` counts them (trainer/train/streaming.py `shared_arena` decides it in a run):
    blocks stream, offload.shared_arena is on, and the method is LoRA or a full fine-tune over the sharded stream
    (offload.sharded_stream not false, an optimizer with owned steps; `auto` counted on, as on GPUs with peer
    access)."""
    if processes <= 1 or fraction <= 0.0 or not cfg.offload.shared_arena:
        return False
    if cfg.train.method == "lora":
        return True
    return cfg.offload.sharded_stream is not False and optimizer_spec(cfg.optimizer.name).owned_steps


def predicted_map(cfg, fraction: float, facts: Facts, budget: float | None = None,
                  kept: frozenset[int] = frozenset(), processes: int = 1,
                  shared: bool = False) -> dict[str, tuple[float, float]]:
    """{phase: (VRAM, RAM)} for the trainer's log (`budget`: the device's cap in bytes, `kept`: the blocks that keep
    their activations, `processes` and `shared`: one of several processes' RAM, `predict_phases`)."""
    return {p.name: (p.vram, p.ram) for p in predict_phases(cfg, fraction, facts, budget=budget, kept=kept,
                                                            processes=processes, shared=shared)}


def table(preds: list[PhasePrediction], budget_gb: float | None = None, width: int | None = None) -> list[str]:
    """The phase table `dittrain plan` prints (fitted to `width` columns, trainer/planner/text.py)."""
    rows = [("phase", "peak VRAM GB", "peak RAM GB", "note")]
    for p in preds:
        rows.append((p.name, f"{p.vram / GB:.2f}", f"{p.ram / GB:.1f}", p.note))
    lines = ["", "Phases of `dittrain fit` (predicted peaks; the largest decides whether the run fits):"]
    lines += text_table(rows, note=True, width=width, indent="  ")
    big = max(preds, key=lambda p: p.vram)
    line = f"  largest: {big.name}, {big.vram / GB:.2f} GB"
    if budget_gb is not None:
        line += f" ({'fits' if big.vram <= budget_gb * GB else 'does NOT fit'} {budget_gb:g} GB)"
    lines.append(line)
    return lines
