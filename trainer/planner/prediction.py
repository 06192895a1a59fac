"""The memory planner: predicted VRAM, RAM and step time per offload fraction, and the automatic fraction.

How. Everything is derived from the model's own code and the conductor's own arithmetic, not from tables:

- weights: the transformer is built on the meta device from its config (trainer/planner/trace.py) and
  every block is packed with `allocators.BlockPacking` exactly as the conductor packs it (LoRA weights stay out
  of the pack and resident; a full fine-tune packs the weights, and the optimizer state of streamed blocks
  lives in pinned RAM and visits the GPU while its parameter steps, as trainer/train/method.py wires it). The
  ring size is
  `plan.capacity_for`, the streamed blocks and the host-to-device bytes per step come from `plan.make_plan`,
  and the pinned arena is the sum of the streamed blocks' packed bytes (`HostArena` is exact);
- activations per bucket: one forward on meta tensors of the bucket's shape (a video family's: a clip of
  data.clip_frames frames in a bucket of the resolution, `Facts.size`, every latent frame's tokens) counts each
  block's checkpoint inputs and what one block's recompute saves for backward (with the attention and RMS-norm kernels modelled
  as the GPU runs them). Backward's transients are an estimate: the working set of the block being
  differentiated is taken as its saved tensors + twice its largest saved tensor (the gradient of that tensor
  and of its producer's input coexist) + twice its input bytes (gradient in, gradient out); where its attention's
  backward holds more than twice the largest tensor, that instead: the gradients of q, k and v of the calls that
  share them, and flash attention's float32 dq accumulator (trace.py `attention_backward`; a block whose
  feed-forward is split in token chunks has no larger transient);
- with activation offloading the checkpoint inputs live in pinned host RAM; the GPU keeps the first block's
  inputs (they need no grad, so the offloader leaves them) and two blocks' worth in flight; those two are, for the
  last two recomputed blocks, their own inputs, which never leave the GPU (offload/plan.py `inputs_on_device`), so
  the host holds every recomputed block's inputs but the first's and those two's;
- the peak: backward runs blocks last to first; while block i is differentiated the checkpoint inputs of
  blocks 0..i are held, block i's working set exists and the gradients of blocks i..n-1 have accumulated
  (none under the fused back pass, which frees each at once). The optimizer step afterwards holds every
  gradient and no activations. The predicted peak is the largest of these moments;
- per-block checkpointing (`predict(..., kept=...)`, train.gradient_checkpointing: auto): a kept block holds its
  saved tensors from its forward to its backward instead of only its inputs, and its backward skips the recompute
  (trainer/planner/checkpointing.py chooses which blocks). Where blocks may keep their activations and
  train.compile is on, the saved tensors are counted as the compiled blocks keep them (trainer/planner/compiled_saves.py:
  AOTAutograd's partitioner recomputes casts and pointwise work that eager blocks keep);
- LoRA: fp32 weights, fp32 gradients and the optimizer state, all resident. Full fine-tune: every block's
  weights train and stream (written back after their step); the embedders train resident;
- several processes of one host, a full fine-tune over the sharded stream (owned steps, trainer/train/owners.py;
  `with_owned_steps`, used by the phase lines, the trainer's check line and `dittrain plan --gpus N`): the
  conductor packs no optimizer state beside the weights (trainer/train/method.py `_packs_state`), so the ring and
  the arena hold the weights alone (`Facts.weight_packed`); each process's 1/N of the state (masters included)
  waits in its own pinned buffers and visits the GPU while each of its parameters steps (trainer/optim
  StateOffload: one parameter's at a time, counted as the largest's, as 8-bit AdamW's in one process), 1/N of the
  non-block state stays on the GPU, and the gradients on their way to their owners are counted as the largest
  block's (`owner_grads`, sized from a measurement). Flux.1-dev, Adafactor with fp32 masters, every block streamed,
  1024 px, 4 x H200 (bench/history/2026-11-28.md 17:10): 6.69 GB reserved a GPU, 6.97 predicted (8.97 before, the
  one-process ring with the masters packed in it; 6.29 without `owner_grads`). Step time: each process's 1/N of
  the optimizer steps and of the state copies (the latter at the blocks' rate, though they cross this process's
  own link whole); the gradient reduces and weight broadcasts are not modelled: 1.40 s predicted there against
  3.43 s measured (2.67 s before, from the masters crossing PCIe in the ring, which owned steps do not do);
- peak reserved VRAM = static allocations (ring or resident blocks, non-block weights, trainable state), each
  rounded to the allocator's 2 MiB, + the saved tensors of the blocks that keep their activations, as they are
  (allocated once per step in forward order and held until their block's backward, the same sequence every step:
  the caching allocator reuses their segments whole), + `ALLOCATOR_OVERHEAD` x the rest of the activation peak
  (the caching allocator's rounding and fragmentation for the tensors that come and go: checkpoint inputs,
  recomputed blocks, backward's transients, gradients) + `WORKSPACE` (cuBLAS and attention workspaces). The
  CUDA context (0.5-1 GB, never in `max_memory_reserved`) is on top of that. Measured on an H100 (compiled,
  1024 px LoRA, offload 0; bench/history/2026-11-25.md 15:30 and the planner's over-count after it): without checkpointing Flux peaked at 44.7 GiB reserved (48.0 GB; predicted
  49.9 GB) and Qwen-Image at 66.9 GiB (71.8 GB; predicted 72.8 GB); with the overhead on the kept tensors too the
  predictions were 57.8 / 82.6 GB;
- two experts in one run (model.expert: both, trainer/train/experts.py): the experts are the same size and run in
  turn, the one not running parked (its ring freed, its non-block weights, LoRA and LoRA state in CPU RAM): the
  GPU holds one expert as a one-expert run does; RAM every block of both (arena + parking buffer) and the parked
  resident part; and per step half a switch more copies (the incoming ring and resident part: the expert changes
  on 2 p (1 - p) <= 1/2 of the steps). With offload.park: disk the parked expert holds no
  block bytes and no frozen non-block bytes (its LoRA and LoRA state stay): RAM holds one expert's arena, and a
  switch also reads the incoming expert's blocks (and embedders) from its files
  (their bytes there: a bf16 folder's under quantize fp8, an fp8 file's as packed) into a fresh arena at
  `DISK_READ` (an assumption, not yet measured; quantizing on the way is not counted), which the step time carries
  half of;
  `switch_s` is one switch's seconds either way. offload.park: auto takes disk exactly where the whole run's
  predicted host-RAM peak (its largest phase, activations included: phases.py `run_ram_peaks`) with the idle expert
  in RAM exceeds offload.host_ram_gb (else this machine's RAM) and the peak with it on disk does not
  (`auto_parks_on_disk`, `Facts.parks_on_disk_at`; the trainer decides by the same two numbers);
- step time: the host's launches, the GPU's kernels and the conductor's copies replayed block by block over
  the training plan (trainer/planner/replay.py; costs in trainer/planner/timing.py).

`choose_fraction` walks fractions on a 0.05 grid (the ring rounds to whole blocks, plan.capacity_for) and returns
the smallest one whose predicted reserved peak fits the budget at every bucket (the largest bucket decides).
For the trainer: `resolve_fraction(cfg)` (the config's number, or auto's choice, logged), `expected(cfg, f)`
and `check_line(pred, measured_reserved, measured_step)` to log the prediction against the first real steps.
`dittrain plan`'s text is trainer/planner/report.py.

Nano-batching (offload.nano_batches: the family's token-wise MLPs in token chunks, trainer/offload/nano.py): a
recomputed block no longer saves its MLPs' hidden activations, and backward's working set holds one chunk's
(planner/trace.py `chunk_mlps`). HunyuanVideo 1.5 declares all of its block but the attention kernel as two such
regions (trainer/models/hunyuan_video15_block.py): at 720p x 121, 16 chunks take its working set from 14.6 GB to 7.2
(eager count; 7.2 compiled), of which 3.7 GB is its attention's backward (both of its calls' gradients of the joint
q, k, v and the float32 dq). Eager blocks keep the MLPs' inputs and what they make that is not per token; under
train.compile (the recompute runs the compiled forward) what the split block saves is counted by compiling it
(planner/compiled_saves.py `chunk_saving`): each chunk is an activation-checkpoint region that keeps nothing, and the
split block saves no float32 copy of a norm's input either, so backward's transients are sized by its own largest
tensor or its attention's backward. Measured (H200, compiled, every block streamed, activations offloaded, 16
chunks): Wan 2.1 14B LoRA at 480p x 81, fp8 base (bench/history/2026-11-27.md 12:05), 12.92 GB reserved, 10.88
allocated, predicted 13.48 / 10.35 (13.91 / 10.67 before 2026-11-28's count, below; the eager count said 15.72 /
12.01); without chunks 19.10 / 14.96, predicted 19.93 / 15.13. HunyuanVideo 1.5 LoRA at 720p x 121
(bench/logs/2026-11-28e/hv720-16gb*): 14.87 GB reserved (15.00, the cap, at step 1), 11.56 allocated, predicted
14.90 / 11.29; before 2026-11-28's count 13.66 / 10.37, which left out the attention's backward (3.7 GB, where twice
the largest tensor said 0.93) and counted the split compiled block's saves from the eager ones (1.86 GB too many).
A compiled block that keeps its activations is counted unsplit.
The step time adds the MLPs' matmuls once more to each block's backward (their attention, a cross-attention's,
is left out).

Left out: the text encoders
and VAE during training when captions and latents are cached (they run in `dittrain cache`, reported apart),
and the optimizer's transient fp32 copies of one parameter (at most a few hundred MB for the largest matrix).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace

import torch

from .. import quant
from ..dtypes import DTYPES
from ..errors import UserError
from ..lora_format.kinds import LORA_KINDS
from ..models import adapter_class, stream_load
from ..models.base import BOTH_EXPERTS
from ..offload.allocators import BlockPacking
from ..offload.plan import INPUTS_ON_DEVICE, Plan, PlanError, capacity_for, inputs_on_device, make_plan
from . import compiled_saves as pcompiled
from . import timing as ptime
from . import trace as ptrace
from .meta import (
    optimizer_state_bytes,
    packed_state_layout,
    text_encoder_bytes,
    text_encoder_sizes,
    transformer_config,
)
from .replay import simulate
from .vae import vae_config

GB = 1e9
MIB2 = 2 << 20
# reserved / allocated for the activation peak: the caching allocator's rounding and fragmentation. Measured on an
# H200 with full-size Flux LoRA (bench/history/2026-11-22.md, 2026-11-22 01:13 UTC): 1.53-1.60 at 512 px, 1.24-1.36 at
# 1024 px; 1.35 puts all six measured peaks within 5 % (1.10, the first assumption, was 1.4-9.4 % under).
ALLOCATOR_OVERHEAD = 1.35
#: anonymous host memory of a training process besides the arena: torch and CUDA libraries, Python, the data
#: caches' index. Measured: Flux LoRA at 0.9 on an H200, 25.3-25.9 GB anonymous RSS per phase beside a 23.7 GB
#: arena (bench/history/2026-11-23.md 18:45)
HOST_BASE = 2.5 * GB
WORKSPACE = 0.25 * GB  # cuBLAS workspaces, attention scratch, small tensors
#: bytes/s a switch of experts parked on disk reads (and page-locks) the incoming expert's blocks at: an assumption
#: (a PCIe 4 NVMe's sequential read; from the page cache it is faster), not measured yet
DISK_READ = 2.0 * GB
GRID = [round(0.05 * i, 2) for i in range(21)]
TABLE_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class Facts:
    """What the planner derives once per config: sizes and the meta model to trace activations with."""

    family: str
    #: the family's adapter class (trainer/models/): every family fact the planner reads after `analyze`
    adapter: type
    source: str
    method: str
    dtype: torch.dtype
    batch: int
    checkpointing: bool
    fused: bool
    optimizer: str
    model: torch.nn.Module
    blocks: list
    packed: list[int]  #: per block: packed bytes the conductor streams
    block_param_bytes: list[int]  #: per block: frozen/trained weight bytes in the model dtype (no alignment)
    nonblock_bytes: int  #: embedders, final norm and projection (always resident)
    nonblock_params: int
    trainable_params: int  #: LoRA parameters, or every parameter (full)
    #: per block: gradient bytes that accumulate in backward (0 with the fused back pass)
    block_grads: list[int]
    nonblock_grads: int  #: gradient bytes of trained non-block parameters (full FT without fused back pass)
    state_gpu: int  #: optimizer state always on the GPU (LoRA's; full FT: the non-block parameters')
    #: full FT: per block, its parameters' optimizer state (fp32; in pinned RAM at the same size when it is kept
    #: there: trainer/offload `pinned_exact`)
    block_states: list[int]
    largest_state: int  #: full FT: the largest parameter's optimizer state (on the GPU while it steps)
    largest_param: int  #: numel of the largest trainable parameter (fused back pass keeps one gradient)
    text_tokens: int
    text_encoders: list[tuple[str, int]]
    resolutions: list[int]
    #: full FT: streamed blocks carry their optimizer state in their pack (`packed` includes it); else (8-bit
    #: AdamW) the state of streamed blocks waits in RAM and visits the GPU while its parameter steps
    state_packed: bool = False
    #: the transformer is read whole into pageable RAM before its blocks are packed (else block by block)
    loads_whole: bool = False
    #: reference images joined to each sample's sequence beyond what `dummy_inputs` gives: for a family whose
    #: reference is optional (Flux.2, Flux.3), the data's references per image (`DataConfig.references`), else 0;
    #: `blocks` and the LoRA targets are the adapter's for that count (Flux.3's reference-mode blocks)
    references: int = 0
    #: count the blocks' saved tensors as compiled blocks keep them (planner/compiled_saves.py): train.compile on (auto
    #: is on for CUDA) and some block may keep its activations (gradient_checkpointing false or auto)
    compiled: bool = False
    #: the text encoders as built from the folder (planner/meta.py `text_encoder_sizes`); None: no folder, the
    #: family's shares of `text_encoders` apply
    text_sizes: list | None = None
    #: pixel frames of a training clip (video families: data.clip_frames, or the family's `plan_frames` without
    #: data; 1: images). The presets generator sets it per setting, as it sets `resolutions`
    frames: int = 1
    #: data.bucket_step as the run resolves it (the family's own where the config sets none): a video bucket's sides
    bucket_step: int = 64
    #: the VAE config a video family's clip encode and decode are counted with (planner/vae.py); None: an image
    #: family's per-pixel estimates
    vae_config: dict | None = None
    #: offload.nano_batches: the blocks' token-wise MLPs run in this many token chunks (planner/trace.py
    #: `chunk_mlps`; recomputed blocks only: a block counted as keeping its compiled activations is counted unsplit)
    nano_batches: int = 1
    #: train.compile: the blocks run compiled, their recompute in backward too (what the split block saves is the
    #: compiled block's, planner/compiled_saves.py `chunk_saving`); `compiled` above is about kept activations
    compile_blocks: bool = False
    #: transformers the run trains in turn (model.expert: both: each expert of the family, trainer/train/experts.py):
    #: one ring on the GPU at a time, every expert's blocks pinned, its non-block weights and LoRA resident
    experts: int = 1
    #: offload.park: where the expert not running waits ("ram", "disk" or "auto": `parks_on_disk_at`)
    park: str = "auto"
    #: offload.host_ram_gb in bytes: the RAM park: auto plans for (None: this machine's physical RAM)
    host_ram: float | None = None
    #: the blocks' bytes in the model's files, read at a switch of experts parked on disk (None: the packed bytes)
    block_file_bytes: int | None = None
    traces: dict = field(default_factory=dict)

    #: the Config this was analyzed from (`analyze`): offload.park: auto reads the whole run's phases from it
    run_cfg: object = None
    #: full FT: per block, the packed bytes of its weights alone (what owned steps stream: `with_owned_steps`);
    #: `packed` where the state is not packed
    weight_packed: list[int] | None = None
    #: full FT with owned steps (trainer/train/owners.py): the processes stepping 1/owners of the weights each,
    #: each keeping only their optimizer state (`with_owned_steps`); 1 otherwise
    owners: int = 1

    def parks_on_disk_at(self, fraction: float) -> bool:
        """Whether the run's idle expert waits on disk at transformer fraction `fraction`: offload.park ram / disk as
        said; auto: `auto_parks_on_disk` of the whole run's predicted host-RAM peak with either park (the largest
        phase of `dittrain fit`, planner/phases.py `run_ram_peaks`), unless the transformer loads whole (nothing to
        read its blocks back from)."""
        if self.experts <= 1:
            return False
        if self.park != "auto":
            return self.park == "disk"
        if self.loads_whole:
            return False
        from .phases import run_ram_peaks  # prediction <-> phases: the cycle choose_fraction already makes

        return auto_parks_on_disk(run_ram_peaks(self.run_cfg, fraction, self), self.host_ram)

    def size(self, res: int) -> tuple[int, int, int]:
        """(width, height, frames) the planner traces for bucket `res`. An image family: the res x res square (the
        presets' 512 and 1024 px buckets are exactly that). A video family: a clip of `frames` frames in the bucket
        of `res` whose width is the multiple of the bucket step nearest res, as trainer/data/buckets.py
        `bucket_sizes` makes it (step d = data.bucket_step capped at res/4, rounded to the divisor; height the
        multiple of d nearest res^2 / width): 640x624 at 632 (480p), as many tokens as 832x480; 960x960 at 960
        (720p), as many as 1280x720."""
        cls = self.adapter
        if not cls.video:
            return res, res, 1
        div = cls.latent_scale * cls.token_patch
        d = max(div, (min(self.bucket_step, res // 4) // div) * div)
        w = max(d, round(res / d) * d)
        return w, max(d, round(res * res / w / d) * d), self.frames

    def tokens(self, res: int) -> int:
        """Image (or clip) tokens of one item at bucket `res` for the full-size model (references not included)."""
        w, h, frames = self.size(res)
        return self.adapter.full_tokens(h, w, frames)

    def trace(self, res: int) -> ptrace.Trace:
        """The training forward at bucket `res` (`size`)."""
        return self.trace_at(*self.size(res))

    def trace_at(self, width: int, height: int, frames: int = 1) -> ptrace.Trace:
        """The forward on one item of width x height pixels (and `frames` frames: video families), traced once."""
        # the presets generator flips `compiled` (and may set `nano_batches`) on one Facts
        key = (width, height, frames, self.compiled, self.nano_batches, self.compile_blocks)
        if key not in self.traces:
            inputs = ptrace.forward_inputs(
                self.family, self.model, self.batch, height, width, self.text_tokens, self.dtype,
                references=self.references, frames=frames,
            )
            mlps = [self.adapter.token_wise_of(b) for b in self.blocks]
            tr = ptrace.trace_forward(self.model, self.blocks, inputs, kernels="cuda", mlps=mlps)
            if self.compiled:
                tr = pcompiled.apply_compiled(self.model, self.blocks, tr)
            elif self.nano_batches > 1:
                tr = ptrace.chunk_mlps(tr, self.nano_batches, self._chunk_saving(tr))
            self.traces[key] = tr
        return self.traces[key]

    def _chunk_saving(self, tr: ptrace.Trace) -> list[tuple[int, int]] | None:
        """What compiled blocks save with their token-wise sub-layers in chunks, and the largest tensor they save
        then (compiled_saves.py `chunk_saving`); None (the eager count) for
        eager blocks, or where dynamo cannot trace the block on meta (`saved_by` says so)."""
        if not self.compile_blocks:
            return None
        try:
            return pcompiled.chunk_saving(self.model, self.blocks, tr, self.adapter.token_wise_of)
        except Exception as e:  # noqa: BLE001 - dynamo's errors have no common base; the eager count is the fallback
            tr.saved_by = f"{tr.saved_by} (compiling the chunked block on meta failed: {type(e).__name__})"
            return None


def analyze(cfg) -> Facts:
    """Build the meta model for `cfg` and pack its blocks as the conductor would (no weights allocated)."""
    family, method = cfg.model.family, cfg.train.method
    cls = adapter_class(family)  # the one look-up: Facts carries the class
    dtype = DTYPES[cfg.model.dtype]
    config, source = transformer_config(cfg)
    model = ptrace.meta_transformer(family, config, dtype)
    refs = cfg.data.references() if cls.reference_optional and cfg.data is not None else 0
    blocks = ptrace.blocks_of(family, model, refs)
    read = _block_file_bytes(cfg, blocks)  # before the quantization below
    if cfg.model.quantize != "none":  # the loader's own quantization (meta tensors): 8-bit weights, fp32 scales
        quant.quantize_blocks(blocks, cfg.model.quantize, cfg.model.quantize_modulation,
                              cls.modulation_linears)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    nonblock = [p for p in model.parameters() if id(p) not in in_blocks]
    nonblock_bytes = sum(p.numel() * p.element_size() for p in nonblock)
    block_param_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
    if method == "lora":
        trained = _lora_facts(cfg, model, blocks, refs)
    else:
        trained = _full_facts(cfg, model, blocks, nonblock)
    block_grads, nonblock_grads = _gradient_bytes(cfg, dtype, blocks, nonblock)
    res = sorted(set(cfg.data.resolutions)) if cfg.data is not None else [cfg.sample.width]
    frames = (cfg.data.clip_frames if cfg.data is not None else cls.plan_frames) if cls.video else 1
    return Facts(
        family=family,
        adapter=cls,
        source=source,
        method=method,
        dtype=dtype,
        batch=cfg.train.batch_size,
        checkpointing=cfg.train.gradient_checkpointing is not False,  # auto: all, then planner/checkpointing.py
        fused=cfg.optimizer.fused_back_pass,
        optimizer=cfg.optimizer.name,
        model=model,
        blocks=blocks,
        block_param_bytes=block_param_bytes,
        nonblock_bytes=nonblock_bytes,
        nonblock_params=sum(p.numel() for p in nonblock),
        block_grads=block_grads,
        nonblock_grads=nonblock_grads,
        **trained,
        text_tokens=cls.text_tokens,
        text_encoders=text_encoder_bytes(cfg),
        text_sizes=text_encoder_sizes(cfg),
        resolutions=res,
        loads_whole=stream_load.loads_whole(cfg),  # a resumed full fine-tune loads whole too; plan cannot know
        references=refs,
        compiled=cfg.train.compile is not False and cfg.train.gradient_checkpointing is not True,
        frames=frames,
        bucket_step=cfg.data.bucket_step if cfg.data is not None else cls.bucket_step,
        vae_config=vae_config(cfg),
        nano_batches=cfg.offload.nano_batches,
        compile_blocks=cfg.train.compile is not False,
        experts=len(cls.experts) if getattr(cfg.model, "expert", None) == BOTH_EXPERTS else 1,
        park=cfg.offload.park,
        block_file_bytes=read,
        host_ram=cfg.offload.host_ram_gb * GB if cfg.offload.host_ram_gb is not None else None,
        run_cfg=cfg,
    )


def _block_file_bytes(cfg, blocks: list) -> int | None:
    """The bytes of the blocks' weights in the model's files (what a switch of experts parked on disk reads): an fp8
    `model.transformer_file` under quantize fp8 (its bytes adopted as they are) holds them in fp8 (None: the packed
    bytes); otherwise the blocks at model.dtype (a diffusers folder's bf16, quantized as it is read)."""
    f = cfg.model.transformer_file
    if f is not None and cfg.model.quantize == "fp8":
        try:
            if quant.is_fp8_file(f):
                return None
        except (OSError, ValueError):
            pass
    return sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())


def physical_ram() -> float:
    """This machine's RAM in bytes."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def auto_parks_on_disk(peaks: dict[str, float], host_ram: float | None) -> bool:
    """offload.park: auto's rule (the trainer's, trainer/train/experts.py, and the planner's): disk exactly where
    the run's predicted host-RAM peak with the idle expert in RAM (`peaks["ram"]`, bytes) exceeds `host_ram`
    (offload.host_ram_gb; None: this machine's physical RAM) and the peak with it on disk (`peaks["disk"]`) does
    not."""
    budget = host_ram if host_ram is not None else physical_ram()
    return peaks["ram"] > budget and peaks["disk"] <= budget


def _lora_facts(cfg, model: torch.nn.Module, blocks: list, refs: int) -> dict:
    """LoRA's trained part of `Facts`: the meta model gets its LoRA layers (peft, as the trainer injects them), the
    blocks pack their frozen weights alone, and the LoRA weights and their optimizer state stay on the GPU."""
    model.requires_grad_(False)
    family = cfg.model.family
    targets = tuple(cfg.lora.targets) if cfg.lora.targets else ptrace.default_lora_targets(family, refs)
    # lora.compute_dtype auto runs plain LoRA's branch in the model dtype (DoRA, LoKr, LoHa: peft's forward)
    lc = cfg.lora
    in_dtype = lc.compute_dtype == "auto" and LORA_KINDS[lc.type].compute_dtype_forward and not lc.dora
    trainable = ptrace.add_meta_lora(model, targets, lc.rank, lc.alpha, in_dtype, kind=lc.type, dora=lc.dora)
    packed = [BlockPacking.of(b, include_trainable=False).nbytes for b in blocks]
    lora = [p for p in model.parameters() if p.requires_grad]
    return dict(
        trainable_params=trainable,
        packed=packed,
        largest_param=max((p.numel() for p in lora), default=0),
        state_gpu=optimizer_state_bytes(cfg.optimizer.name, lora),
        block_states=[0] * len(blocks),
        largest_state=0,
        state_packed=False,
    )


def _full_facts(cfg, model: torch.nn.Module, blocks: list, nonblock: list) -> dict:
    """A full fine-tune's trained part of `Facts`, as the trainer wires a streamed one (trainer/train/method.py):
    the conductor packs each weight's optimizer state beside it (trainer/offload/fused_state.py), so the state
    crosses PCIe with its block and sits in the pinned arena between steps; 8-bit AdamW's state (layout unknown
    before a step) lives in pinned RAM instead (trainer/optim StateOffload) and visits the GPU while its parameter
    steps, as every optimizer's does under owned steps (`weight_packed`, `with_owned_steps`). The state of
    non-block modules stays on the GPU. optimizer.master_weights adds each bf16/fp16 weight's fp32 master to its
    state, wherever that is (4 bytes per parameter; with owned steps 1/N on each process, as the rest of the state:
    `node_ram_of_processes`)."""
    model.requires_grad_(True)
    trainable = sum(p.numel() for p in model.parameters())
    name, masters = cfg.optimizer.name, cfg.optimizer.master_weights
    layout = packed_state_layout(name, masters)
    packed = [BlockPacking.of(b, include_trainable=True, state_layout=layout or ()).nbytes for b in blocks]
    weights = packed if layout is None else [BlockPacking.of(b, include_trainable=True).nbytes for b in blocks]
    biggest = max(model.parameters(), key=lambda p: p.numel())
    return dict(
        trainable_params=trainable,
        packed=packed,
        weight_packed=weights,
        largest_param=biggest.numel(),
        state_gpu=optimizer_state_bytes(name, nonblock, masters),
        block_states=[optimizer_state_bytes(name, list(b.parameters()), masters) for b in blocks],
        largest_state=optimizer_state_bytes(name, [biggest], masters),
        state_packed=layout is not None,
    )


def _gradient_bytes(cfg, dtype: torch.dtype, blocks: list, nonblock: list) -> tuple[list[int], int]:
    """(per block, the non-block parameters): the bytes of the gradients that accumulate in backward: LoRA's in
    fp32, a full fine-tune's in the model dtype, none under the fused back pass (each is stepped and freed)."""
    fused = cfg.optimizer.fused_back_pass
    gsize = 4 if cfg.train.method == "lora" else torch.tensor([], dtype=dtype).element_size()  # LoRA grads are fp32
    block_grads = [
        0 if fused else sum(p.numel() * gsize for p in b.parameters() if p.requires_grad) for b in blocks
    ]
    nonblock_grads = 0 if fused else sum(p.numel() * gsize for p in nonblock if p.requires_grad)
    return block_grads, nonblock_grads


# ------------------------------------------------------------------------------------- pure arithmetic


def streaming(packed: list[int], fraction: float) -> tuple[int, int, int]:
    """(ring bytes, pinned host bytes, host-to-device bytes per training step) for an offload fraction,
    exactly as the conductor sizes them (plan.capacity_for / make_plan / HostArena)."""
    ring, streamed, h2d = _streaming(tuple(packed), fraction)
    return ring, sum(packed[b] for b in streamed), h2d


@functools.lru_cache(maxsize=256)
def _train_plan(packed: tuple[int, ...], fraction: float) -> Plan | None:
    """The training plan the conductor runs at `fraction` (None when nothing streams)."""
    if fraction <= 0.0:
        return None
    return make_plan(packed, capacity_for(packed, fraction), "train")


def _streaming(packed: tuple[int, ...], fraction: float) -> tuple[int, tuple[int, ...], int]:
    plan = _train_plan(packed, fraction)
    if plan is None:
        return sum(packed), (), 0
    return plan.capacity, plan.streamed, plan.bytes_per_step()


def _round2m(n: float) -> float:
    return math.ceil(n / MIB2) * MIB2


@dataclass
class Prediction:
    fraction: float
    resolution: int
    activation_offload: bool
    ring: int  #: GPU bytes of blocks (the ring, or every block when nothing streams)
    nonblock: int
    trainable: (
        int  #: on the GPU at the peak: LoRA weights, optimizer state and gradients (full FT: state, grads)
    )
    act_checkpoint_gpu: int
    act_checkpoint_host: int
    act_block: int  #: working set of the block being differentiated at the peak
    act_other: int
    pinned: int
    h2d: int
    d2h: int
    peak_allocated: float
    peak_reserved: float
    static: float  #: the reserved peak's fixed part (2 MiB-rounded allocations that live the whole step)
    dynamic: float  #: its varying part (activations and gradients at the peak), before ALLOCATOR_OVERHEAD
    ram_peak: float
    compute_s: float  #: the GPU's kernel time alone
    transfer_s: float  #: the copies alone (host-to-device and back, at the PCIe rates)
    host_s: float  #: the host's launch time alone
    step_s: float  #: the three together, block by block (trainer/planner/replay.py)
    #: model.expert: both: where the idle expert waits ("ram" / "disk"; "" for one model) and one switch's seconds
    park: str = ""
    switch_s: float = 0.0


@dataclass
class _Placement:
    """Where one step's weights and trainable state sit at an offload fraction, and what the conductor copies."""

    ring: int  #: GPU bytes of blocks (the ring, or every block when nothing streams)
    pinned: int  #: pinned host bytes: the arena (and a StateOffload's streamed state, parked experts' blocks)
    h2d: int  #: host-to-device bytes per step
    d2h: int  #: device-to-host bytes per step
    trainable: int  #: on the GPU before any gradient: LoRA weights and optimizer state (full FT: state)
    one_grad: int  #: the fused back pass's one gradient and the fp32 copies it steps (0 without it)
    state_moved: int  #: StateOffload: streamed blocks' state bytes sent to the GPU and back every step
    parked: int  #: host bytes of the parked experts' resident parts (model.expert: both)
    switch_in: int = 0  #: one switch of experts: bytes to the GPU (the incoming ring and resident part)
    switch_out: int = 0  #: and to the host (the outgoing resident part)
    switch_read: int = 0  #: and read from the files (parked on disk: the incoming expert's blocks)
    on_disk: bool = False  #: the idle experts wait on disk (offload.park resolved; `Facts.parks_on_disk_at`)
    #: owned steps: gradients on their way to their owners (`owner_grads`)
    to_owners: int = 0


@dataclass
class _Peak:
    """The step's activation-and-gradient peak: backward's worst moment or the optimizer step, as reserved."""

    recomputed: list[bool]  #: per block: its activations are recomputed in backward (not kept)
    dynamic: float  #: activations + gradients at the peak, before ALLOCATOR_OVERHEAD
    grads: float  #: the gradients among them
    checkpoint_gpu: int  #: checkpoint inputs (and kept blocks' saved tensors) on the GPU at the peak
    checkpoint_host: int  #: checkpoint inputs in pinned host RAM (activation offloading)
    other: int  #: saved outside the blocks (embedders, final layers)
    long_lived: float  #: kept blocks' saved tensors at the peak (reserved as they are, no overhead)


def predict(
    facts: Facts,
    fraction: float,
    res: int,
    activation_offload: bool = False,
    rates: ptime.Rates | None = None,
    kept: frozenset[int] = frozenset(),
) -> Prediction:
    """The step's GPU and host memory and its time at an offload fraction and bucket (see the module essay).
    `kept`: blocks that keep their activations for backward instead of being recomputed, in a checkpointed run
    (train.gradient_checkpointing: auto, trainer/planner/checkpointing.py)."""
    rates = rates or ptime.reference_rates()
    tr = facts.trace(res)
    place = _with_parked_experts(facts, _placement(facts, fraction), fraction)
    peak = _activation_peak(facts, tr, kept, activation_offload, place.one_grad)
    h2d, d2h = place.h2d, place.d2h
    if activation_offload:  # the checkpoint inputs go to the host in forward and come back in backward
        h2d += peak.checkpoint_host
        d2h += peak.checkpoint_host
    trainable = place.trainable + peak.grads
    static = _round2m(place.ring) + _round2m(facts.nonblock_bytes) + _round2m(trainable - peak.grads)
    act = peak.dynamic - peak.grads
    compute_s, host_s, step_s = _step_seconds(facts, tr, rates, fraction, res, peak.recomputed, place.state_moved)
    transfer_s = ptime.transfer_seconds(h2d, d2h, rates)
    read_s = place.switch_read / DISK_READ  # synchronous, on half the steps at most (parked on disk)
    switch_s = ptime.transfer_seconds(place.switch_in, place.switch_out, rates) + read_s
    return Prediction(
        fraction=fraction,
        resolution=res,
        activation_offload=activation_offload,
        ring=place.ring,
        nonblock=facts.nonblock_bytes,
        trainable=trainable,
        act_checkpoint_gpu=peak.checkpoint_gpu,
        act_checkpoint_host=peak.checkpoint_host,
        act_block=act - peak.checkpoint_gpu - peak.other,
        act_other=peak.other,
        pinned=place.pinned,
        h2d=h2d,
        d2h=d2h,
        peak_allocated=place.ring + facts.nonblock_bytes + trainable + act + place.to_owners,
        peak_reserved=static + _reserved_part(peak.dynamic, peak.long_lived) + WORKSPACE + _round2m(place.to_owners),
        static=static,
        dynamic=peak.dynamic,
        ram_peak=_ram_peak(facts, place, peak.checkpoint_host),
        compute_s=compute_s,
        transfer_s=transfer_s,
        host_s=host_s,
        # activation offloading's copies and full fine-tuning's write-backs are not replayed: a floor
        step_s=max(step_s, transfer_s) + read_s / 2,
        park=("disk" if place.on_disk else "ram") if facts.experts > 1 else "",
        switch_s=switch_s if facts.experts > 1 else 0.0,
    )


def _placement(facts: Facts, fraction: float) -> _Placement:
    """Ring, pinned arena, copies per step and the trainable state on the GPU, for LoRA or a full fine-tune: LoRA
    keeps its fp32 weights and their state resident; a full fine-tune's block state sits where its optimizer puts
    it (every block's on the GPU when nothing streams, in each block's pack, or StateOffload's pinned copy)."""
    ring, pinned, h2d = streaming(facts.packed, fraction)
    state_moved = 0
    if facts.method != "full":  # LoRA: fp32 weights and the optimizer state, resident
        trainable = facts.trainable_params * 4 + facts.state_gpu
        one_grad = facts.largest_param * 4 if facts.fused else 0
        return _Placement(ring, pinned, h2d, 0, trainable, one_grad, state_moved, 0)
    _, streamed, _ = _streaming(tuple(facts.packed), fraction)
    if fraction <= 0.0:  # nothing streams: plain modules, the optimizer keeps every state on the GPU
        ring = sum(facts.block_param_bytes)
        trainable = facts.state_gpu + sum(facts.block_states)
    elif facts.state_packed:  # each block's state is in its pack: in the ring, or in the pinned arena
        trainable = facts.state_gpu
    else:  # StateOffload: resident blocks' state on the GPU, one streamed parameter's while it steps
        # (owned steps: the process's 1/owners of the state; the largest parameter's where it is the owner)
        on_gpu = [s for b, s in enumerate(facts.block_states) if b not in streamed]
        trainable = (facts.state_gpu + sum(on_gpu)) // facts.owners + (facts.largest_state if streamed else 0)
        state_moved = sum(facts.block_states[b] for b in streamed) // facts.owners  # to the GPU and back, every step
        pinned += state_moved
    # fused back pass: one gradient in the model dtype + the fp32 copies of weight and gradient it steps
    esize = torch.tensor([], dtype=facts.dtype).element_size()
    one_grad = facts.largest_param * (esize + 8) if facts.fused else 0
    # d2h = h2d: every streamed block is written back before its region is reused
    return _Placement(ring, pinned, h2d, h2d, trainable, one_grad, state_moved, 0, to_owners=owner_grads(facts))


def owner_grads(facts: Facts) -> int:
    """Owned steps (trainer/train/owners.py): the GPU bytes of the gradients on their way to their owners, beside
    the one the fused back pass steps. Each gradient is summed onto its owner by an NCCL reduce and then freed; our
    reading (not profiled) is that its memory is reused only once the reduce has run on the GPU, so the gradients of
    the block being differentiated can be alive at once: counted as the largest block's, in the model dtype,
    reserved as they are (the same tensors every step). Sized from a measurement: Flux.1-dev, Adafactor without
    masters (its state a few MB), every block streamed, activations offloaded: 6.04 GB reserved a GPU with owned
    steps on 4 x H200 against 5.25 GB on one GPU (bench/history/2026-11-27.md 16:00), 0.79 GB more, where the
    largest block's gradients are 0.68 GB. 0 for one process."""
    return max(facts.block_param_bytes) if facts.owners > 1 else 0


def _with_parked_experts(facts: Facts, place: _Placement, fraction: float) -> _Placement:
    """`place` with two experts trained in turn, the other parked (offload/conductor.py, train/experts.py): every
    expert's blocks in RAM (arena + parking buffer), the parked ones' non-block weights, LoRA and state beside
    them, and half a change of expert's copies per step (the incoming ring and resident part in, the other's
    resident part out; the expert changes on 2 p (1 - p) <= 1/2 of the steps). Parked on disk: no block bytes
    (one arena, refilled at a switch) and no frozen non-block bytes (read back from the files with the blocks):
    the parked ones hold their LoRA and its state alone."""
    if facts.experts <= 1:
        return place
    disk = facts.parks_on_disk_at(fraction)
    resident = facts.nonblock_bytes + place.trainable
    held = place.trainable if disk else resident  # what a parked expert keeps in CPU RAM
    incoming = place.ring + facts.nonblock_bytes + place.trainable
    return replace(
        place,
        pinned=place.pinned if disk else facts.experts * sum(facts.packed),
        parked=(facts.experts - 1) * held,
        h2d=place.h2d + incoming // 2,
        d2h=place.d2h + held // 2,
        switch_in=incoming,
        switch_out=held,
        switch_read=(facts.block_file_bytes or sum(facts.packed)) + facts.nonblock_bytes if disk else 0,
        on_disk=disk,
    )


def _reserved_part(dyn: float, long_lived: float) -> float:
    """The dynamic part as the caching allocator reserves it: kept blocks' saved tensors as they are (allocated in
    the same order every step, their segments reused whole), the rest times ALLOCATOR_OVERHEAD."""
    return long_lived + ALLOCATOR_OVERHEAD * (dyn - long_lived)


def _activation_peak(facts: Facts, tr: ptrace.Trace, kept: frozenset[int], activation_offload: bool,
                     one_grad: int) -> _Peak:
    """The larger (as reserved) of backward's worst moment and the optimizer step. Backward runs blocks last to
    first: while block i is differentiated the checkpoint inputs of blocks 0..i (and the saved tensors of the kept
    ones) are held, block i's working set exists, and the gradients of blocks i..n-1 (none under the fused back
    pass, which frees each at once) have accumulated. The optimizer step holds every gradient, no activations."""
    n = len(tr.block_inputs)
    ck = [facts.checkpointing and i not in kept for i in range(n)]  # per block: recomputed in backward
    offloaded = activation_offload and facts.checkpointing
    if offloaded:  # the GPU keeps the first block's inputs and two blocks' in flight
        ck_gpu = tr.block_inputs[0] + 2 * max(tr.block_inputs[1:] or [0])
        # the last recomputed blocks' inputs stay on the GPU: backward's two in flight when it reaches them
        stay = inputs_on_device(ck, INPUTS_ON_DEVICE)
        ck_host = tr.checkpoint_inputs - tr.block_inputs[0] - sum(
            tr.block_inputs[i] for i in range(1, n) if i in kept or i in stay)
    else:
        ck_gpu, ck_host = tr.checkpoint_inputs, 0
    held, kept_gpu, long_lived = _held_before_backward(facts, tr, ck)
    grads_after = [sum(facts.block_grads[i:]) for i in range(n)]
    peaks = [
        (ck_gpu + kept_gpu[i] if offloaded else held[i]) + _working_set(tr, i, ck[i]) + grads_after[i]
        for i in range(n)
    ]
    i_peak = max(range(n), key=lambda i: _reserved_part(peaks[i], long_lived[i]))
    bwd = peaks[i_peak] + tr.outside_saved + one_grad
    step = sum(facts.block_grads) + facts.nonblock_grads + one_grad
    if _reserved_part(bwd, long_lived[i_peak]) >= _reserved_part(step, 0):  # the peak is inside backward
        shown = ck_gpu + kept_gpu[i_peak] if offloaded else held[i_peak]
        return _Peak(ck, bwd, grads_after[i_peak] + one_grad, shown, ck_host, tr.outside_saved, long_lived[i_peak])
    return _Peak(ck, step, step, 0, ck_host, 0, 0)  # the optimizer step: gradients only


def _held_before_backward(facts: Facts, tr: ptrace.Trace, ck: list[bool]) -> tuple[list, list, list]:
    """Per block i, what blocks 0..i hold for backward: their checkpoint inputs and the kept blocks' saved
    tensors; of that, what kept blocks hold on the GPU (both, under checkpointing); and the kept saved tensors
    alone (long-lived, reserved without overhead)."""
    held = kept_gpu = long = 0
    prefix, kept_prefix, long_prefix = [], [], []
    for i in range(len(ck)):
        held += tr.block_inputs[i] + (0 if ck[i] else tr.block_saved[i])
        kept_gpu += 0 if ck[i] or not facts.checkpointing else tr.block_inputs[i] + tr.block_saved[i]
        long += 0 if ck[i] else tr.block_saved[i]
        prefix.append(held)
        kept_prefix.append(kept_gpu)
        long_prefix.append(long)
    return prefix, kept_prefix, long_prefix


def _working_set(tr: ptrace.Trace, i: int, recomputed: bool) -> int:
    """Block i's working set while it is differentiated: its saved tensors (when recomputed; a kept block's are
    counted as held) + twice its input bytes (gradient in, gradient out) but those no gradient reaches
    (`Trace.block_const_inputs`: held, never differentiated; until 2026-11-28 they were counted twice more, 1.4 GB
    of Wan 2.2 TI2V's per-token modulations at 720p) + backward's transients: twice its largest saved tensor
    (the gradient of that tensor and of its producer's input coexist), or, where more, what its attention's
    backward holds at once (trace.py `attention_backward`: the gradients of q, k and v of the calls that share
    them, and flash attention's float32 dq accumulator)."""
    attn = tr.block_attn_bwd[i] if tr.block_attn_bwd else 0
    const = tr.block_const_inputs[i] if tr.block_const_inputs else 0
    ws = tr.block_saved[i] + max(2 * tr.block_largest[i], attn) + 2 * (tr.block_inputs[i] - const)
    return ws if recomputed else ws - tr.block_saved[i]


def _ram_peak(facts: Facts, place: _Placement, ck_host: int) -> float:
    """RAM: the pinned arena and activation buffers, the process's own (HOST_BASE), the parked experts, and, where
    the transformer is read whole before packing (facts.loads_whole), a pageable copy of it beside the arena."""
    model_bytes = sum(facts.block_param_bytes) + facts.nonblock_bytes
    return (model_bytes if facts.loads_whole else 0) + place.pinned + ck_host + HOST_BASE + place.parked


def _step_seconds(facts: Facts, tr: ptrace.Trace, rates: ptime.Rates, fraction: float, res: int, ck: list[bool],
                  state_moved: int) -> tuple[float, float, float]:
    """(GPU kernel time, host launch time, step time before the copies' floor): the blocks replayed over the
    training plan (trainer/planner/replay.py), plus the embedders' and final layers' GPU time and, in a full
    fine-tune, their optimizer steps."""
    n = len(ck)
    full = facts.method == "full"
    ck_flops = ptime.block_train_flops(tr, n, facts.checkpointing, full)
    kept_flops = ptime.block_train_flops(tr, n, False, full)  # no recompute
    flops = ptime.train_flops(
        tr.linear_flops, tr.attn_flops, checkpointing=facts.checkpointing, weights_train=full
    ) - sum(ck_flops[i] - kept_flops[i] for i in range(n) if not ck[i])
    plan = _train_plan(tuple(facts.packed), fraction)
    costs = _block_costs(facts, tr, rates, res, ck, plan, state_moved)
    sim = simulate(costs, plan, rates.h2d)
    block_flops = sum(ck_flops[i] if ck[i] else kept_flops[i] for i in range(n))
    opt_step = ptime.REF_FULL_STEP_S_PER_PARAM if full else 0.0  # a full fine-tune's optimizer steps
    outside_s = max(0.0, flops - block_flops) / rates.rate(res) + facts.nonblock_params * opt_step
    return sim.gpu_s + outside_s, sim.host_s, sim.step_s + outside_s


def _block_costs(facts: Facts, tr: ptrace.Trace, rates: ptime.Rates, res: int, ck: list[bool], plan: Plan | None,
                 state_moved: int) -> list:
    """Each block's host, GPU and copy costs (trainer/planner/timing.py), without the recompute where the block
    keeps its activations, and with what its backward adds: a full fine-tune's optimizer step of its weights,
    StateOffload's state copies (on the compute stream) and nano-batching's second MLP forward."""
    full = facts.method == "full"
    esize = torch.tensor([], dtype=facts.dtype).element_size()
    costs = ptime.block_costs(facts.blocks, tr, rates, res, full, facts.checkpointing,
                              facts.adapter.blocks_sync_host)
    costs = [c if ck[b] or not facts.checkpointing else c.without_recompute() for b, c in enumerate(costs)]
    streamed_blocks = set(plan.streamed) if plan is not None else set()
    opt_step = ptime.REF_FULL_STEP_S_PER_PARAM if full else 0.0
    return [
        c.scaled(
            # owned steps: each process steps, and copies the state of, 1/owners of the weights
            extra_gpu_bwd=facts.block_param_bytes[b] / esize * opt_step / facts.owners
            # StateOffload's state copies run on the compute stream, in the block's backward
            + (2 * facts.block_states[b] / facts.owners / rates.h2d if state_moved and b in streamed_blocks else 0.0)
            # offload.nano_batches: each chunk of the token-wise MLPs runs its forward once more in backward
            + (tr.block_mlp_linear_flops[b] / rates.rate(res) if facts.nano_batches > 1 and tr.block_mlp_linear_flops
               else 0.0)
        )
        for b, c in enumerate(costs)
    ]


def _fraction_of(cfg) -> float | None:
    f = cfg.offload.transformer
    return None if f == "auto" else float(f)


def _peak(facts: Facts, fraction: float, res: int, act: bool) -> float:
    """Predicted reserved peak; inf where the ring schedule cannot be built (plan.PlanError: a block larger
    than the ring the fraction leaves, possible with very unequal block sizes)."""
    try:
        return predict(facts, fraction, res, act).peak_reserved
    except PlanError:
        return math.inf


def _sampling_peak(cfg, facts: Facts, fraction: float, res: int) -> float:
    """Sampling during training's predicted peak (phases.py; 0 when it is off): it keeps the training ring, so
    it too must fit the budget the fraction is chosen for."""
    s = getattr(cfg, "sample", None)
    if s is None or not (s.every and s.prompts):
        return 0.0
    from .phases import predict_phases

    saved = facts.resolutions
    facts.resolutions = [res]
    try:
        return next(p.vram for p in predict_phases(cfg, fraction, facts) if p.name == "sampling")
    except PlanError:
        return math.inf
    finally:
        facts.resolutions = saved


#: share of the VRAM budget a chosen fraction's predicted peak leaves unused: the checkpointed training-step
#: predictions read up to 2.4 % under the peaks the whole-`fit` preset runs measured (bench/history/2026-11-25.md, the
#: planner's over-count section), so a fraction planned right at the budget could run out of memory there
PREDICTION_MARGIN = 0.03


def first_fit(fits, grid: list[float] = GRID) -> float | None:
    """The smallest fraction of `grid` (ascending) for which `fits(fraction)` holds, or None: the search
    `choose_fraction` and sampling's auto (planner/sampling.py `choose_sampling_fraction`) share."""
    return next((f for f in grid if fits(f)), None)


def choose_fraction(
    cfg,
    vram_gb: float | None = None,
    *,
    facts: Facts | None = None,
    activation_offload: bool | None = None,
    log=print,
) -> float:
    """The smallest fraction (0.05 grid) whose predicted reserved peak, and that of sampling during training when
    it is on (phases.py), fits `vram_gb` (default offload.vram_budget_gb) less PREDICTION_MARGIN at every bucket;
    raises UserError when even 1.0 does not fit."""
    budget = vram_gb if vram_gb is not None else cfg.offload.vram_budget_gb
    if budget is None:
        raise UserError("offload.transformer: auto needs offload.vram_budget_gb (or pass --vram)")
    facts = facts or analyze(cfg)
    act = cfg.offload.activations if activation_offload is None else activation_offload
    if cfg.train.method == "full" and not cfg.optimizer.fused_back_pass:
        grid = [0.0]  # streaming trained weights needs the fused back pass (config.py says so)
    elif not cfg.train.gradient_checkpointing:
        grid = [0.0]
    else:
        grid = GRID
    chosen = 0.0
    limit = budget * GB * (1 - PREDICTION_MARGIN)
    for res in facts.resolutions:
        fit = first_fit(lambda f, res=res: _peak(facts, f, res, act) <= limit
                        and _sampling_peak(cfg, facts, f, res) <= limit, grid)
        if fit is None and _peak(facts, grid[-1], res, act) <= limit:
            need = _sampling_peak(cfg, facts, grid[-1], res) / GB
            raise UserError(
                f"offload: sampling during training needs {need:.1f} GB at {cfg.sample.width}x{cfg.sample.height} "
                f"(budget {budget:g} GB); set sample.every: 0 or lower sample.width / sample.height"
            )
        if fit is None:
            need = predict(facts, grid[-1], res, act).peak_reserved / GB
            hint = "lower the resolution" + (
                "" if act else " / use activation offloading (offload.activations: true)"
            )
            raise UserError(
                f"offload: {facts.family} {facts.method} at {res} px needs at least {need:.1f} GB even with every "
                f"block streamed (budget {budget:g} GB, {limit / GB:.1f} GB after the planner's "
                f"{PREDICTION_MARGIN:.0%} margin for prediction error); {hint}"
            )
        p = predict(facts, fit, res, act)
        log(
            f"offload: bucket {res} px fits {budget:g} GB at transformer fraction {fit:.2f} "
            f"(predicted peak reserved {p.peak_reserved / GB:.1f} GB)"
        )
        chosen = max(chosen, fit)
    log(f"offload: auto chose transformer fraction {chosen:.2f} (largest bucket decides)")
    return chosen


def resolve_fraction(cfg, *, facts: Facts | None = None, log=print) -> float:
    """The transformer offload fraction to train with: the config's number, or `choose_fraction` for auto."""
    f = _fraction_of(cfg)
    return f if f is not None else choose_fraction(cfg, facts=facts, log=log)


def expected(
    cfg, fraction: float, *, facts: Facts | None = None, rates: ptime.Rates | None = None,
    kept: frozenset[int] = frozenset(), processes: int = 1, sharded: bool = False,
) -> Prediction:
    """The prediction for the config's largest bucket at `fraction` (what the first real steps are checked
    against); `kept`: blocks that keep their activations (train.gradient_checkpointing: auto); `processes` of one
    host streaming at once, with whole copies or the `sharded` stream (timing.for_processes; a full fine-tune's:
    owned steps, `with_owned_steps`)."""
    facts = facts or analyze(cfg)
    if sharded:  # a full fine-tune's sharded stream runs owned steps (trainer/train/streaming.py `owned_steps`)
        facts = with_owned_steps(facts, processes)
    rates = ptime.for_processes(rates or ptime.reference_rates(), processes, sharded)
    return predict(facts, fraction, max(facts.resolutions), cfg.offload.activations, rates, kept=kept)


def with_owned_steps(facts: Facts, processes: int) -> Facts:
    """`facts` as one of `processes` processes of a full fine-tune with owned steps (trainer/train/owners.py) holds
    them: the conductor packs no optimizer state beside the weights (trainer/train/method.py `_packs_state`), so
    the ring and arena hold `weight_packed` alone; the process's own 1/N of the state waits in pinned buffers
    (StateOffload over the parameters it owns) and visits the GPU while each of its parameters steps, as 8-bit
    AdamW's does in one process (`_placement`). `facts` itself for LoRA or one process."""
    if processes <= 1 or facts.method != "full" or facts.weight_packed is None:
        return facts
    return replace(facts, packed=facts.weight_packed, state_packed=False, owners=processes)


def node_ram_of_processes(facts: Facts, pred: Prediction, fraction: float, processes: int) -> tuple[int, int]:
    """A streamed full fine-tune on `processes` processes of one host: the node's RAM (bytes) with whole copies
    (every process `pred`'s own arena, the optimizer state packed in it or pinned beside it) and with owned steps
    (trainer/train/owners.py: one shared arena of the streamed weights, each process 1/N of their optimizer
    state): `shared_arena_bytes` once and `process_ram` per process. `pred`: the one-process prediction at
    `fraction`; the owned steps' blocks stream as `with_owned_steps` packs them (the weights alone)."""
    _, streamed, _ = _streaming(tuple(with_owned_steps(facts, processes).packed), fraction)
    weights = sum(facts.block_param_bytes[b] for b in streamed)
    state = sum(facts.block_states[b] for b in streamed)
    own = pred.ram_peak - pred.pinned  # what a process holds besides its arena and pinned state
    return processes * pred.ram_peak, weights + processes * own + state


def node_arena_words(nbytes: float, processes: int) -> str:
    """How a one-process RAM figure's shared arena is said once for the host (the trainer's load line and `dittrain
    plan --gpus N`)."""
    return f"node: {nbytes / GB:.1f} GB shared arena in /dev/shm, once for the host's {processes} processes"


def shared_arena_bytes(facts: Facts, fraction: float, processes: int = 1, shared: bool = False) -> int:
    """The host's one arena of streamed blocks at `fraction` when `processes` processes share it (`shared`: a
    /dev/shm file each maps, trainer/train/streaming.py `shared_arena`; file pages, in no process's anonymous
    RSS): LoRA's packed frozen blocks, or a full fine-tune's streamed weights alone (owned steps: the state is each
    owner's, `owned_state_bytes`). 0 where each process has its own (one process, whole copies, no /dev/shm)."""
    if processes <= 1 or not shared:
        return 0
    if facts.method != "full":
        return streaming(facts.packed, fraction)[1]
    _, streamed, _ = _streaming(tuple(facts.packed), fraction)
    return sum(facts.block_param_bytes[b] for b in streamed)


def owned_state_bytes(facts: Facts, fraction: float, processes: int = 1, shared: bool = False) -> float:
    """A full fine-tune over the sharded stream (`shared` arena, `processes` > 1: owned steps, owners.py): one
    process's share of the streamed blocks' optimizer state (masters included), 1/N of it, in pinned buffers of
    its own (trainer/optim StateOffload over the parameters it owns, made at their first step). 0 otherwise."""
    if processes <= 1 or not shared or facts.method != "full":
        return 0.0
    _, streamed, _ = _streaming(tuple(facts.packed), fraction)
    return sum(facts.block_states[b] for b in streamed) / processes


def process_ram(facts: Facts, pred: Prediction, fraction: float, processes: int = 1, shared: bool = False) -> float:
    """One of `processes` processes' host RAM at the training step's peak, as its anonymous RSS counts it: `pred`'s
    (the one-process prediction at `fraction`) where each process has its own arena (one process, whole copies);
    with a `shared` arena, without it (`shared_arena_bytes`, the node's once) and with the process's 1/N of a
    full fine-tune's state (`owned_state_bytes`). `node_ram_of_processes`: `shared_arena_bytes` + N x this."""
    if processes <= 1 or not shared:
        return pred.ram_peak
    return pred.ram_peak - pred.pinned + owned_state_bytes(facts, fraction, processes, shared)


def held_on_gpu(facts: Facts, fraction: float) -> tuple[float, int]:
    """A full fine-tune between steps at `fraction`, after `handle.sync()` (conductor `expose_current_weights`):
    (weight bytes, optimizer-state bytes) the GPU holds. Weights: the non-block ones, the blocks that never stream
    and, of the streamed ones, those the ring holds at that moment (at most its streamed slots, counted at the
    streamed packs' share of weights); every block's at fraction 0. State: the non-block parameters' and the
    never-streamed blocks' (in their packs in the ring, or the optimizer's own); a streamed block's current state
    is its host copy (trainer/offload/fused_state.py, or StateOffload's pinned buffers)."""
    _, streamed, _ = _streaming(tuple(facts.packed), fraction)
    capacity = streaming(facts.packed, fraction)[0]
    resident = [b for b in range(len(facts.packed)) if b not in set(streamed)]
    weights = facts.nonblock_bytes + sum(facts.block_param_bytes[b] for b in resident)
    if streamed:
        slots = capacity - sum(facts.packed[b] for b in resident)
        share = sum(facts.block_param_bytes[b] for b in streamed) / sum(facts.packed[b] for b in streamed)
        weights += max(0, slots) * share
    return weights, facts.state_gpu + sum(facts.block_states[b] for b in resident)


def check_line(pred: Prediction, reserved_bytes: float, step_s: float | None = None, micro_batches: int = 1) -> str:
    """One log line comparing a prediction with the measured peak reserved VRAM (and step time). The prediction
    is for one micro-batch (a forward and backward); a step of `micro_batches` (train.grad_accum) is compared with
    that many of them."""

    def pct(p, m):
        return f"{100.0 * (p - m) / m:+.0f} %" if m else "n/a"

    line = (
        f"offload: peak reserved VRAM predicted {pred.peak_reserved / GB:.2f} GB, measured "
        f"{reserved_bytes / GB:.2f} GB (prediction {pct(pred.peak_reserved, reserved_bytes)})"
    )
    if step_s is not None:
        want = pred.step_s * micro_batches
        what = "step" if micro_batches == 1 else f"step of {micro_batches} micro-batches"
        line += f"; {what} predicted {want:.2f} s, measured {step_s:.2f} s ({pct(want, step_s)})"
    return line
