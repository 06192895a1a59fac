"""Where the weights sit while sampling: resident on the device, or streamed by the offload conductor.

A fraction f of a component's block bytes stays in pinned CPU RAM and is streamed through the conductor's GPU ring
on its cyclic sampling schedule (`trainer/offload/`); everything that is not a block (embedders, final norms)
goes to the device. f = 0 moves the whole module. On a CPU there is no second memory to save: the conductor
accepts the fraction and replays the same plan through a ring in CPU RAM (no saving, same speed), so the CPU path
gives the same images at every fraction and exercises the same code.

The conductor packs only parameters that do not require grad (trainable ones stay resident), so `run_sample`
freezes the transformer first: every block weight, LoRA layers included, then streams.

With `compile` (train.compile resolved, trainer/train/streaming.py `compile_options`), the transformer's blocks
run their class's compiled forward (trainer/offload/compiled.py); at fraction 0 they are then attached to a
resident conductor (nothing streams) only so that the StreamedBlock runs the compiled code.

Text encoders are placed as the caches' text stage places them (`place_encoder`, trainer/data/cache.py): they have
no adapter-declared block list, so their blocks are taken to be their largest `nn.ModuleList` by parameter count
(T5's `encoder.block`, CLIP's `encoder.layers`, Qwen2.5-VL's language-model `layers`:
`trainer.models.base.text_encoder_blocks`, which the planner's text-caching phase sizes too).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from ..data.cache import place_encoder, resolve_device
from ..offload import move_outside_blocks
from ..planner.prediction import ALLOCATOR_OVERHEAD
from ..planner.presets import process_fraction
from ..planner.sampling import SAMPLE_TILE_PIXELS, VAE_ACT_DECODE


def _attach(blocks: list[nn.Module], device: torch.device, fraction: float, compile=False, fill=None):
    from ..offload import attach_offload

    return attach_offload(blocks, device, fraction, mode="sample", compile=compile, fill=fill)


@contextmanager
def place_transformer(adapter, transformer: nn.Module, device: torch.device, fraction: float, compile=False,
                      fill=None, keep_weights: bool = True):
    """Resident (f = 0) or streamed (f > 0) for the duration of the block, blocks compiled with `compile`
    (False, True or CompileOptions); the handle is closed after (`keep_weights=False`: the transformer is being
    dropped, its streamed blocks are not copied back out). `fill`: the blocks hold placeholders, which the
    conductor fills from the model's files (trainer/models/stream_load.py)."""
    if fraction <= 0 and not compile and fill is None:
        transformer.to(device)
        yield None
        return
    fraction = max(fraction, 0.0)
    blocks = adapter.blocks(transformer)
    move_outside_blocks(transformer, blocks, device)
    extra = {k: v for k, v in (("compile", compile), ("fill", fill)) if v}
    handle = _attach(blocks, device, fraction, **extra)
    try:
        yield handle
    finally:
        handle.close(keep_weights)


@contextmanager
def place_text_encoders(pipe, device: torch.device, fraction: float):
    """Put every loaded text encoder on `device` (streamed at `fraction` > 0) while prompts are encoded. The
    callers release the encoders right after, so their streamed blocks are not copied back out of the arena on
    the way out (that copy would put a second T5-XXL in RAM): the blocks are left empty."""
    from .engine import text_encoder_names

    with ExitStack() as stack:
        for name in text_encoder_names(pipe):
            handle = place_encoder(getattr(pipe, name), device, fraction)
            if handle is not None:
                stack.callback(handle.close, keep_weights=False)
        yield


#: bytes per image pixel an untiled bf16 VAE decode reserves at its peak, as the planner counts it (~4.3 GB at
#: 1024 x 1024)
UNTILED_DECODE_PER_PIXEL = VAE_ACT_DECODE * ALLOCATOR_OVERHEAD
#: what an untiled decode must leave free besides its estimate (the estimate is coarse; cuDNN workspaces)
DECODE_MARGIN = 2**30


def tile_decode(vae: nn.Module, height: int, width: int, tile: int = 512) -> bool:
    """Decode with `tile`-pixel tiles (a quarter overlap, diffusers' blending) when the image has more than
    SAMPLE_TILE_PIXELS pixels; batches are always sliced. Returns whether tiling is on. diffusers' AutoencoderKL
    tiles at its config's sample_size (1024 for Flux / SD3) by default, too large to help at 1024 px; the
    Qwen-Image VAE's own tiles are 256 px and are left as they are."""
    if hasattr(vae, "enable_slicing"):
        vae.enable_slicing()
    if height * width <= SAMPLE_TILE_PIXELS or not hasattr(vae, "enable_tiling"):
        return False
    vae.enable_tiling()
    if hasattr(vae, "tile_sample_min_size"):  # AutoencoderKL
        down = 2 ** (len(vae.config.block_out_channels) - 1)
        vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // down
    no_sliver_tiles(vae, height, width)
    return True


#: the fewest latent rows (or columns) a tile of a video VAE's tiled decode may have: its convs reflect-pad by one
MIN_TILE_LATENTS = 2


def no_sliver_tiles(vae: nn.Module, height: int, width: int) -> None:
    """diffusers' video VAEs (LTX-2's, Wan's, HunyuanVideo's) start a tile every `tile_sample_stride_*` pixels while
    rows are left, so the last tile can be a sliver: LTX-2 at 832x480 has 15 latent rows, tiles of 16 every 14, and
    a second tile of one row, which its reflect-padded convs refuse ("Padding size should be less than the
    corresponding input dimension": `fit`'s sampling at the 16 GB preset, bench/history/2026-11-28.md). A dimension
    that fits one tile gets one tile (stride = tile); a longer one keeps diffusers' tiles and shrinks the stride a
    latent at a time (more overlap, blended as diffusers blends) until the last tile has MIN_TILE_LATENTS."""
    down = getattr(vae, "spatial_compression_ratio", None)
    if not down:
        return
    if not hasattr(vae, "_diffusers_tile_strides"):  # each call starts from diffusers' strides, not the last call's
        vae._diffusers_tile_strides = {d: getattr(vae, f"tile_sample_stride_{d}", None) for d in ("height", "width")}
    for dim, size in (("height", height), ("width", width)):
        low, step = f"tile_sample_min_{dim}", f"tile_sample_stride_{dim}"
        if not (hasattr(vae, low) and hasattr(vae, step)):
            continue
        n, tile, stride = -(-size // down), getattr(vae, low) // down, vae._diffusers_tile_strides[dim] // down
        if n <= tile:
            setattr(vae, step, getattr(vae, low))
            continue
        while stride > 1 and n - (n - 1) // stride * stride < MIN_TILE_LATENTS:
            stride -= 1
        setattr(vae, step, stride * down)


def cuda_headroom(device: torch.device) -> int:
    """Bytes this process can still allocate on `device`: what the card has free plus what the caching allocator
    holds unused, within the per-process cap (`set_per_process_memory_fraction`, as `DITTRAIN_VRAM_CAP_GB` sets)."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cached = torch.cuda.memory_reserved(device) - allocated
    return int(min(free + cached, process_fraction(device) * total - allocated))


def decode_for_sample(vae: nn.Module, device: torch.device, height: int, width: int, frames: int = 1,
                      family: str | None = None) -> str | None:
    """`dittrain sample`, once the transformer is placed: decode untiled (the pipeline's own decode, so the image
    equals `pipe(...)`'s) when that fits in what the device has free with `DECODE_MARGIN` to spare, else tiled
    (`tile_decode`). Returns a note when it tiles, None otherwise. An untiled 1024 px decode next to a streaming
    ring ran Qwen-Image 2.1's 16 GB preset out of memory (bench/history/2026-11-25.md, 2026-11-25 21:40); a video
    family's decode (`family` declares a `full_vae_config`) is what the planner counts for a clip of `frames`
    frames (planner/vae.py), not a figure per pixel of one image: Wan 2.2 TI2V-5B's 8 GB preset ran out of memory
    decoding 832x480 untiled (bench/history/2026-11-27.md, 19:35)."""
    if device.type != "cuda" or height * width <= SAMPLE_TILE_PIXELS:
        return None
    need, have = untiled_decode_bytes(vae, height, width, frames, family), cuda_headroom(device)
    if need + DECODE_MARGIN <= have or not tile_decode(vae, height, width):
        return None
    tiles = "512 px tiles" if hasattr(vae, "tile_sample_min_size") else "tiles"
    return (f"note: the VAE decodes in {tiles} (an untiled {width}x{height} decode needs about "
            f"{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB is free): tile seams differ from the pipeline's "
            "untiled decode by a few levels")


def encode_tiles(family: str, device: torch.device | str):
    """The latent cache's `tile_vae` for `family` on `device` (trainer/data/cache.py `EncoderStages.tile_vae`): on a
    GPU, a video family whose VAE the planner counts on the meta device (`full_vae_config`) encodes a batch of clips
    in the VAE's spatial tiles (diffusers' `enable_tiling`; HunyuanVideo 1.5's tiles run in its time chunks) where the
    untiled encode, as the planner counts it (planner/phases.py `encode_tiles`), is over what the device has left
    beside the VAE (`cuda_headroom`); None elsewhere (tiled above 1024x1024 pixels, `vae_memory_mode`). The
    latent-caching phase predicts the same choice against the card's budget."""
    from ..models import adapter_class

    device = torch.device(resolve_device(device))  # train.device's auto, as the cache's StagedLoader takes it
    if device.type != "cuda" or adapter_class(family).full_vae_config is None:
        return None

    def tile(vae: nn.Module, width: int, height: int, frames: int, batch: int) -> bool:
        from ..planner.phases import encode_tiles as needs_tiles

        config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
        dtype = next(vae.parameters()).dtype
        tiled = needs_tiles(family, config, dtype, width, height, frames, batch, cuda_headroom(device))
        if tiled:  # the strides diffusers' tiled encode steps by, without a sliver of a last tile (as the decode's)
            no_sliver_tiles(vae, height, width)
        return tiled

    return tile


def untiled_decode_bytes(vae: nn.Module, height: int, width: int, frames: int = 1, family: str | None = None) -> float:
    """Reserved bytes an untiled decode of one image (or a clip of `frames` frames of a video family) needs at its
    peak, as the planner counts it."""
    from ..models import adapter_class

    if family is None or adapter_class(family).full_vae_config is None:
        return height * width * UNTILED_DECODE_PER_PIXEL
    from ..planner.vae import RESERVED_PER_COUNTED, clip_peak

    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
    dtype = next(vae.parameters()).dtype
    return RESERVED_PER_COUNTED * clip_peak(family, config, dtype, "decode", width, height, frames)
