"""What the three diffusers-based families share: checking and loading a local model folder, reading its small
JSON configs, the resolution divisor, the resolution-dependent timestep shift and building the pipeline.

Loading is two-phase on purpose. `_check` looks at the file system only (config files present, the classes the
family expects: trainer/models/folder.py) and raises a `UserError` naming the path and what belongs there; only then does
`load` call `from_pretrained(..., local_files_only=True)`. A typo in `model.path` therefore costs milliseconds,
not a half-loaded 24 GB model, and nothing is ever fetched from a network.

A single-file transformer (`model.transformer_file`) goes through diffusers' `from_single_file` with the local
folder as its config, which accepts both diffusers-named keys and the original (BFL / Stability) checkpoints.
(`fit` and streamed `sample` read diffusers-named files block by block instead: trainer/models/stream_load.py.)

The adapter instance reads `model_index`-level configs lazily (a few hundred bytes each) so that the divisor,
latent channels and shift come from the actual model, tiny or real, instead of being hard-coded per family.
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from .. import quant
from ..errors import UserError
from .base import Components, ModelAdapter
from .folder import check_folder_family

PARTS = frozenset({"transformer", "vae", "text", "scheduler", "experts"})  # experts: ModelAdapter.experts
#: modulation Linears of AdaLayerNorm blocks (Flux, SD3): `norm*.linear`, the per-sample scale / shift / gate
NORM_MODULATION = r"(^|\.)norm[^.]*\."
#: T5 encoders' `wo` stays in the model dtype when text encoders are quantized (transformers casts its input to
#: `wo.weight.dtype`, which would be fp8)
T5_KEEP = r"(^|\.)wo\."


def own_aligned_memory(module: nn.Module, align: int = 64) -> nn.Module:
    """Give every CPU parameter and buffer whose data is not `align`-byte aligned its own fresh memory.

    safetensors hands out tensors on the file's memory map, at 8-byte-aligned offsets, and `from_pretrained` keeps
    them. CPU kernels pick their vector paths by pointer alignment: fp32 `linear` of one row reads a weight at an
    address that is 8 mod 16 in a different summation order than the same weight at a 64-byte aligned address
    (the CPU allocator's, and every ring view of trainer/offload/allocators.py), so resident blocks computed
    other last bits than streamed ones. A fresh copy makes resident and streamed weights the same alignment class.
    """
    for m in module.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in slots.items():
                if t is None or t.device.type != "cpu" or t.data_ptr() % align == 0:
                    continue
                if isinstance(t, nn.Parameter):
                    t.data = t.data.clone()
                else:
                    slots[name] = t.clone()
    return module


def _quiet() -> None:
    """Loading bars of tiny sub-models are noise in a CLI that has its own progress output."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


class DiffusersAdapter(ModelAdapter):
    """Shared implementation; subclasses set the class data and the family-specific tensor work."""

    #: transformers classes that load the tokenizer folders, in `tokenizer_dirs` order (empty: AutoTokenizer)
    tokenizer_classes: ClassVar[tuple[str, ...]] = ()
    #: latents are packed 2x2 into tokens by the pipeline (Flux, Qwen-Image) rather than patchified inside the
    #: transformer (SD3, whose `patch_size` says so)
    packs_2x2: ClassVar[bool] = True
    #: the Qwen-VL families: the text encoder's image-and-text processor in the folder's `processor/` (named so in
    #: errors, e.g. "Qwen2-VL"), checked with the other folders before any weight loads and loaded after the
    #: tokenizers by `load_processor`; None: no processor
    processor_label: ClassVar[str | None] = None
    #: the sub-folder holding that processor (Flux.3 names its Qwen3-VL processor `tokenizer/`)
    processor_dir: ClassVar[str] = "processor"

    # ------------------------------------------------------------------------------------------ small configs

    def _json(self, rel: str, required: bool = True) -> dict:
        if self.cfg is None:
            raise UserError(f"{self.family}: this needs the model folder (get_adapter(model_cfg) with model.path)")
        p = Path(self.cfg.path) / rel
        if not p.is_file():
            if not required:
                return {}
            if not Path(self.cfg.path).is_dir():  # the folder itself, not one file in it, is what is missing
                raise UserError(self.missing_folder())
            raise UserError(f"{p} not found: expected a diffusers-format {self.family} folder at model.path "
                            f"({self._expected()})")
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{p}: not a readable JSON config ({e})") from None

    def missing_folder(self, root: Path | None = None) -> str:
        """The one line for a model.path that does not exist (or is not a folder)."""
        root = Path(root if root is not None else self.cfg.path)
        what = "is a file, not a folder" if root.exists() else "does not exist"
        return (f"model.path {root} {what}: point it at a diffusers-format {self.family} folder "
                f"({self._expected()})")

    def _expected(self) -> str:
        dirs = ["transformer/", "vae/", *(d + "/" for d in self.text_encoder_dirs), *(d + "/" for d in self.tokenizer_dirs)]
        return "model_index.json, " + ", ".join(dirs) + ", scheduler/" + (f", {self.processor_dir}/" if self.processor_label else "")

    @staticmethod
    def load_processor(folder: Path) -> Any:
        """The processor in `folder` (families with a `processor_label` define it)."""
        raise NotImplementedError

    @cached_property
    def transformer_config(self) -> dict:
        return self._json("transformer/config.json")

    @cached_property
    def vae_config(self) -> dict:
        return self._json("vae/config.json")

    @cached_property
    def scheduler_config(self) -> dict:
        return self._json("scheduler/scheduler_config.json", required=False) or dict(self.default_scheduler)

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent side (8 for every shipped family)."""
        c = self.vae_config
        if "temperal_downsample" in c:  # Qwen-Image's video VAE (as its pipeline computes it)
            return 2 ** len(c["temperal_downsample"])
        return 2 ** (len(c.get("block_out_channels", [0] * 4)) - 1)

    @property
    def patch_size(self) -> int:
        """Latent pixels per token side."""
        return 2 if self.packs_2x2 else int(self.transformer_config.get("patch_size", 2))

    @property
    def resolution_divisor(self) -> int:
        return self.vae_scale_factor * self.patch_size

    @property
    def latent_channels(self) -> int:
        c = self.vae_config
        return int(c.get("z_dim", c.get("latent_channels", 16)))

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes a guidance value (Flux dev); read from its config."""
        return bool(self.transformer_config.get("guidance_embeds", False))

    def image_seq_len(self, height: int, width: int) -> int:
        """Image tokens the transformer sees for an image of this size."""
        d = self.resolution_divisor
        return (height // d) * (width // d)

    def timestep_shift(self, height: int, width: int) -> float:
        s = self.scheduler_config
        if not s.get("use_dynamic_shifting", False):
            return float(s.get("shift", 1.0))
        # mu exactly as the pipelines' calculate_shift; the scheduler then applies exp(mu) (or mu for "linear").
        base_len, max_len = s.get("base_image_seq_len", 256), s.get("max_image_seq_len", 4096)
        base, top = s.get("base_shift", 0.5), s.get("max_shift", 1.15)
        m = (top - base) / (max_len - base_len)
        mu = self.shift_seq_len(height, width) * m + (base - m * base_len)
        return math.exp(mu) if s.get("time_shift_type", "exponential") == "exponential" else mu

    def shift_seq_len(self, height: int, width: int) -> int:
        """The "image_seq_len" the family's pipeline hands calculate_shift: the image tokens, unless a family's
        pipeline passes something else."""
        return self.image_seq_len(height, width)

    # ------------------------------------------------------------------------------------------ loading

    def _check(self, cfg, parts: set[str]) -> None:
        """File-system checks only: every problem is a UserError before any weight is allocated."""
        unknown = set(parts) - PARTS
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}; choose from {sorted(PARTS)}")
        root = Path(cfg.path)
        if not root.is_dir():
            raise UserError(self.missing_folder(root))

        def need(rel: str, what: str) -> None:
            if not (root / rel).exists():
                raise UserError(f"{root / rel} not found: expected {what} of a diffusers-format {self.family} folder "
                                f"({self._expected()})")

        # another family's folder (or single file): one line before any weight loads (trainer/models/folder.py)
        check_folder_family(root, self.family, getattr(cfg, "transformer_file", None))
        if "transformer" in parts:
            tdir = self.transformer_dir  # `transformer`, or the folder of the expert model.expert picks
            need(f"{tdir}/config.json", "the transformer config")
            if cfg.transformer_file is not None:
                f = Path(cfg.transformer_file)
                if not f.is_file():
                    raise UserError(f"{f}: transformer file not found (model.transformer_file): expected a .safetensors "
                                    f"file with the transformer weights")
                if f.suffix != ".safetensors":
                    raise UserError(f"{f}: model.transformer_file must be a .safetensors file (pickled checkpoints are "
                                    f"not loaded)")
            elif not any((root / tdir).glob("*.safetensors")):
                raise UserError(f"{root / tdir}: no .safetensors weights found (expected "
                                f"diffusion_pytorch_model*.safetensors, or set model.transformer_file)")
        if "vae" in parts:
            need("vae/config.json", "the VAE config")
        if "text" in parts:
            for d in self.text_encoder_dirs:
                need(f"{d}/config.json", "a text encoder config")
            for d in self.tokenizer_dirs:
                need(d, "a tokenizer folder")
            if self.processor_label and not (root / self.processor_dir).is_dir():
                raise UserError(f"{root / self.processor_dir} not found: expected the {self.processor_label} processor folder "
                                f"of a diffusers-format {self.family} folder ({self._expected()})")

    def load(self, cfg, *, parts, dtype, device="cpu") -> Components:
        if self.cfg is None or Path(self.cfg.path) != Path(cfg.path):
            self.cfg = cfg
            for name in ("transformer_config", "vae_config", "scheduler_config"):
                self.__dict__.pop(name, None)  # cached_property values of another folder
        parts = set(parts)
        self._check(cfg, parts)
        _quiet()
        import transformers
        from diffusers import FlowMatchEulerDiscreteScheduler

        root = str(cfg.path)
        out = Components()
        try:
            if "transformer" in parts:
                if cfg.transformer_file is not None:
                    tr = self.transformer_cls.from_single_file(
                        quant.single_file_source(cfg.transformer_file), config=root, subfolder="transformer",
                        torch_dtype=dtype,
                        local_files_only=True,
                    )
                else:
                    tr = self.transformer_cls.from_pretrained(
                        root, subfolder=self.transformer_dir, torch_dtype=dtype, local_files_only=True
                    )
                # 8-bit frozen base (trainer/quant.py): block by block, before the move to the device
                quant.prepare_transformer(tr, self.blocks(tr), cfg.quantize, dtype, cfg.transformer_file,
                                         cfg.quantize_modulation, self.modulation_linears)
                if getattr(cfg, "fp8_matmul", False):  # model.fp8_matmul: W8A8 matmuls (a layer attribute)
                    quant.use_scaled_mm(tr, True)
                out.transformer = own_aligned_memory(tr.to(device))
            if "vae" in parts:
                import diffusers

                vae_cls = getattr(diffusers, self.vae_cls_name)
                out.vae = vae_cls.from_pretrained(root, subfolder="vae", torch_dtype=dtype, local_files_only=True)
                out.vae = out.vae.to(device).eval().requires_grad_(False)
            if "text" in parts:
                for d, cls_name in zip(self.text_encoder_dirs, self.text_encoder_classes, strict=True):
                    enc_cls = getattr(transformers, cls_name)
                    config = self.text_encoder_config(enc_cls.config_class.from_pretrained(
                        root, subfolder=d, local_files_only=True))
                    # a trimmed config leaves weights of the file unread: transformers would list each one
                    verbosity = transformers.utils.logging.get_verbosity()
                    transformers.utils.logging.set_verbosity_error()
                    try:
                        enc = enc_cls.from_pretrained(
                            root, subfolder=d, config=config, dtype=dtype, local_files_only=True
                        )
                    finally:
                        transformers.utils.logging.set_verbosity(verbosity)
                    enc = self.slim_text_encoder(enc)
                    quant.quantize_module(enc.requires_grad_(False), cfg.quantize_text_encoders, text_encoder=True,
                                          keep=self.text_encoder_keep_linears)
                    out.text_encoders.append(enc.to(device).eval().requires_grad_(False))
                for i, d in enumerate(self.tokenizer_dirs):
                    tok_cls = self.tokenizer_classes[i] if i < len(self.tokenizer_classes) else "AutoTokenizer"
                    out.tokenizers.append(
                        getattr(transformers, tok_cls).from_pretrained(root, subfolder=d, local_files_only=True)
                    )
            if "scheduler" in parts:
                if (Path(root) / "scheduler" / "scheduler_config.json").is_file():
                    out.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
                        root, subfolder="scheduler", local_files_only=True
                    )
                else:
                    out.scheduler = FlowMatchEulerDiscreteScheduler(**self.default_scheduler)
        except (OSError, ValueError, ImportError) as e:  # ImportError: e.g. a processor needing torchvision
            # Files present but unreadable or mismatched (truncated safetensors, wrong shapes, ...).
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{root}: could not load the {self.family} model: {first}") from e
        if "experts" in parts:  # a family of experts: the others than `transformer`, each loaded as it would train
            for name, d in self.experts.items():
                if d != self.transformer_dir:
                    mc = cfg.model_copy(update={"expert": name})
                    out.experts[d] = type(self)(mc, self.references).load(mc, parts={"transformer"}, dtype=dtype,
                                                                          device=device).transformer
        if "text" in parts and self.processor_label:
            try:
                out.tokenizers.append(self.load_processor(Path(root) / self.processor_dir))
            except (OSError, ValueError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise UserError(f"{root}: could not load the {self.family} processor: {first}") from e
        return out

    def text_encoder_config(self, config: Any) -> Any:
        """The text encoder's config as it is built for loading (default: as in the folder). A family whose
        captions never reach part of the encoder can leave that part out here, so its weights are never read
        (Flux.2: the decoder layers after the deepest hidden state used)."""
        return config

    # ------------------------------------------------------------------------------------------ shared helpers

    def pipeline(self, components: Components) -> Any:
        kw = {self.transformer_dir: components.transformer, **components.experts, "vae": components.vae,
              "scheduler": components.scheduler}
        for i, d in enumerate(self.text_encoder_dirs):
            kw[d] = components.text_encoders[i] if i < len(components.text_encoders) else None
        for i, d in enumerate(self.tokenizer_dirs):
            kw[d] = components.tokenizers[i] if i < len(components.tokenizers) else None
        return self.pipeline_cls(**kw)

    def collate_text(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not items:
            raise ValueError("collate_text needs at least one entry")
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}

    @staticmethod
    def _kl_encode(vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """Mean of the latent distribution (deterministic, so cached latents never depend on a seed), shifted and
        scaled as the pipelines undo it before decoding."""
        c = vae.config
        lat = vae.encode(pixels.to(vae.dtype)).latent_dist.mode()
        return (lat - (c.shift_factor or 0.0)) * c.scaling_factor


def packed_inputs(transformer, batch: int, height: int, width: int, text_tokens: int, dtype: torch.dtype,
                  device="meta", id_axes: int = 3) -> dict:
    """Random transformer-call arguments the Flux-style models share for `dummy_inputs`: 2x2-packed image tokens
    of an 8x VAE, text tokens, the timestep and zero position ids (`id_axes`: 3 for Flux.1 / Chroma, 4 for
    Flux.2 / Flux.3). Each family adds its own conditioning (guidance, pooled text, masks)."""
    c, dev = transformer.config, torch.device(device)
    rnd = {"device": dev, "dtype": dtype}
    ni = (height // 16) * (width // 16)  # 8x VAE, then 2x2 patches
    return dict(
        hidden_states=torch.randn(batch, ni, c.in_channels, **rnd),
        encoder_hidden_states=torch.randn(batch, text_tokens, c.joint_attention_dim, **rnd),
        timestep=torch.ones(batch, **rnd),
        img_ids=torch.zeros(ni, id_axes, device=dev),
        txt_ids=torch.zeros(text_tokens, id_axes, device=dev),
    )


def pack_2x2(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C), the token order of the Flux / Qwen-Image pipelines' `_pack_latents`."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_2x2(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack_2x2`: (B, h/2 * w/2, 4C) -> (B, C, h, w)."""
    b, _, d = x.shape
    return x.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)


def collate_masked_text(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-caption entries whose `prompt_embeds` are valid up to their `prompt_embeds_mask` (Qwen-VL and Qwen3
    captions): each cut to its valid tokens and right-padded to the batch's longest, with a 0/1 mask only where
    lengths differ (as the pipelines pass none when nothing is padded)."""
    if not items:
        raise ValueError("collate_text needs at least one entry")
    # Entries are CPU tensors from the cache here, so these lengths are no device sync.
    lengths = [int(it["prompt_embeds_mask"].sum()) if "prompt_embeds_mask" in it else it["prompt_embeds"].shape[0]
               for it in items]
    longest = max(lengths)
    out = {"prompt_embeds": torch.stack([nn.functional.pad(it["prompt_embeds"][:n], (0, 0, 0, longest - n))
                                         for it, n in zip(items, lengths, strict=True)])}
    if any(n < longest for n in lengths):
        mask = torch.zeros(len(items), longest, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        out["prompt_embeds_mask"] = mask
    return out


# ---------------------------------------------------------------------------------------------- full-size parts


def tiny_token_ids(folder: Path, sub: str = "text_encoder", keys=("bos_token_id", "eos_token_id", "pad_token_id")):
    """The special token ids of `folder`'s tiny encoder `sub` (its config.json, or its `text_config`), for the
    full-size config that goes with the tiny tokenizer in bench/program/bench_program.py's folders (every tiny id
    exists in the full vocabularies)."""
    tiny = json.loads((Path(folder) / sub / "config.json").read_text())
    tiny = {**tiny, **tiny.get("text_config", {})}
    return {k: tiny[k] for k in keys if tiny.get(k) is not None}


def flux_vae(scaling_factor: float = 0.3611, shift_factor: float = 0.1159):
    """Flux.1's VAE at full size (FLUX.1-dev's vae/config.json: 16 channels, 8x, scaling 0.3611, shift 0.1159;
    83.8 M), as HiDream-I1, Lumina-Image 2.0, Chroma and Z-Image ship it; SD3's is the same network with its own
    scaling and shift: bench_program's full-size folders."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=scaling_factor,
                         shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True)


def t5_xxl_config(**ids):
    """T5-XXL's encoder config (T5 v1.1 XXL: 24 layers 4096 wide, gated GELU) with the special token `ids` given
    (a tiny tokenizer's: bench_program's full-size folders)."""
    from transformers import T5Config

    return T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                    relative_attention_num_buckets=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                    use_cache=False, tie_word_embeddings=False, decoder_start_token_id=0, **ids)
