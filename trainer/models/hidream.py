"""HiDream-I1 (HiDream.ai, 17.1 B): HiDreamImageTransformer2DModel, 16 double-stream and 32 single-stream blocks 2560
wide whose image feed-forwards are mixtures of experts (a shared SwiGLU expert plus 4 routed ones, 2 per token), four
text encoders (CLIP-L and CLIP-G pooled, T5-XXL, Llama-3.1-8B-Instruct's every hidden state) and Flux's 16-channel
VAE. The trained model is HiDream-I1-Full (the Dev and Fast releases are its distilled versions, the same architecture).

How each piece mirrors diffusers' HiDreamImagePipeline (0.42):

- text: the pipeline's own `_get_clip_prompt_embeds` (both CLIPs, padded to 128 tokens: HiDream's CLIPs take more
  than 77 positions), `_get_t5_prompt_embeds` and `_get_llama3_prompt_embeds` on the loaded parts, each at the
  pipeline's 128 tokens: `pooled` (CLIP-L's and CLIP-G's projections side by side, 2048), `t5` (128 x 4096) and
  `llama` (Llama's 32 hidden states after each layer, 32 x 128 x 4096: 32 MB a caption in bf16, the cache's bulk;
  every block reads one of them, `llama_layers`). Padding rows are kept: the transformer has no text mask, so they
  are part of what it sees.
- latents: VAE mean, then (z - shift_factor) * scaling_factor; the transformer patchifies 2x2 itself.
- predict: the pipeline's timestep convention (t x 1000, 1000 is noise); the transformer predicts x0 - noise (the
  pipeline negates it before its scheduler step), so `predict` returns the negation. In training mode diffusers'
  transformer hands its output back un-patchified another way, (B, C, tokens, 4) instead of (B, C, H, W), which
  `predict` lays out as an image. diffusers' transformer pads a non-square image to `max_resolution`'s token count
  (4096: a 1024 x 1024 image's) with the padding's keys zeroed, which still take part in attention (a zero logit,
  their values): that is how the pipeline runs every non-square size, so a non-square bucket costs a square 1 MP
  image's tokens, and `predict` runs it so. A non-square bucket of more tokens (the 1024 px buckets of aspect 1.5 and
  more: 832 x 1280 has 4160) has no padding to make, and diffusers' patchify fails on it; `predict` hands it the
  image's tokens unpadded, as a square image of any size runs (`unpadded_tokens`).
- mixture of experts: diffusers' router (`MoEGate`, a bare weight (4, 2560) per block) picks 2 of the 4 routed
  experts per token (the single blocks' text tokens too) by softmax score; in training mode the tokens go through their experts in a loop over
  boolean masks (a host sync per expert and block), in eval mode through `moe_infer` (no gradients). The experts and
  the router are block weights: they stream with their block, in an 8-bit base they are quantized with the other
  block Linears (the router's weight is no Linear and stays in the model dtype). Under LoRA the router is frozen:
  peft adapts Linears, and the router is a bare parameter, so it keeps routing with its released weights (on the
  hidden states the trained layers change) while the LoRA of every expert, shared and routed, trains; a full
  fine-tune trains it with the rest, through the top-2 weights (diffusers' auxiliary load-balancing loss is computed
  and dropped, as in its own training path).
- compiled (`train.compile`, trainer/offload/compiled.py): the masks' sizes are data, and dynamo by default breaks
  the graph there (`aten.nonzero`), skips the MoE's frame (a break inside its loop) and compiles each expert's
  forward as its own frame for the token count it got; with static shapes every new count is a new graph, so each
  step's routing compiled again until torch's recompile limit, then the experts ran eager (measured on a tiny
  model of two blocks with 8 buckets' limit: 16, 21, 24, 26 graphs after each of 4 steps). The blocks are
  `_HiDreamBlock`s (diffusers' class, same forward) whose `dynamo_config` has dynamo trace those sizes as unbacked
  symbols (`capture_dynamic_output_shape_ops`, `capture_scalar_outputs`): one graph per block variant and bucket
  whatever the routing, the experts' matmuls and their LoRA inside it, diffusers' own training code traced, so the
  same ops (aot_eager: eager's loss and gradients bitwise; inductor on the CPU: losses within 3e-8). The host
  syncs stay (each mask's size). Eval mode's `moe_infer` (numpy counts, a loop dynamo cannot unroll) is, compiled
  only, the same ops with the counts as `.tolist()` and every expert run, an empty one on no rows; eager it is
  diffusers'.
  Chosen over a static-shape rewrite (every routed expert on every token: twice the routed FLOPs; grouped matmuls:
  no per-expert LoRA Linears) and over leaving the experts eager outside the graph (the bulk of the block's FLOPs).
- the planner: its meta-device trace cannot run the experts' boolean masks (their sizes are data), so the family's
  transformer class (`HiDreamImageTransformer2DModel` here: diffusers' class, same name, config and weights) gives
  each routed expert an equal share of the token-expert pairs on the meta device (balanced routing) and runs
  diffusers' forward on real tensors, bitwise. The count is every Linear's: the shared expert (SwiGLU 3584 wide) on
  every token and 2 routed experts (6912 wide) per token, the single blocks' 384 text tokens included; the router
  (4 x 2560) is left out (tests/test_planner_flops.py counts a block by hand). The masks' host syncs
  (`blocks_sync_host`) make the step time its launches plus its kernels, not the larger of the two
  (trainer/planner/replay.py).
- shift: the scheduler's own, fixed (the class the folder's scheduler config names): HiDream-I1-Full's is, as
  recalled and not checked offline, UniPCMultistepScheduler with flow sigmas and `flow_shift` 3.0; training uses
  the same shift.
- sampling (`HiDreamImageAreaPipeline`): the pipeline rescales every request to its default area (1024 x 1024
  pixels) and keeps the aspect; the face tells it the area asked for, so an image is the size asked, and for sizes of
  about 1 MP (the ones the model was trained at) it is what the plain pipeline makes. Guidance above 1 runs the
  negative prompt (""), 50 steps at guidance 5 (the release's settings).

HiDream-E1 (instruction editing) is trainer/models/hidream_e1.py, on this adapter and `transformer_prediction`.
Left out: the auxiliary load-balancing loss; the pipeline's separate prompts per text encoder (`prompt_2` ...
`prompt_4`: every encoder reads the caption).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import diffusers
import torch
from diffusers import HiDreamImagePipeline
from diffusers.models.transformers.transformer_hidream_image import HiDreamBlock, MOEFeedForwardSwiGLU
from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift
from torch import nn

from ._diffusers import T5_KEEP, DiffusersAdapter, flux_vae, t5_xxl_config, tiny_token_ids
from .base import Components
from .lora_keys import KeyRule, LoraKeyMap, identity_rules

#: the pipeline's token count per text encoder (`max_sequence_length` of `encode_prompt` and `__call__`)
TEXT_TOKENS = 128
#: Llama-3.1-8B's token embedding and output head (128256 x 4096 each)
LLAMA_EMBED = 128_256 * 4096
#: HiDream-I1's routed experts per MoE feed-forward (the released config)
ROUTED_EXPERTS = 4
#: positions of the released CLIP-L / CLIP-G (Long-CLIP's 248, as recalled: not checked offline; the pipeline pads
#: to 128 tokens, so any count from 128 runs it): bench_program's full-size folders
CLIP_POSITIONS = 248

_BLOCK = ("block.attn1.to_q", "block.attn1.to_k", "block.attn1.to_v", "block.attn1.to_out",
          *(f"block.ff_i.shared_experts.w{n}" for n in (1, 2, 3)),
          *(f"block.ff_i.experts.{j}.w{n}" for j in range(ROUTED_EXPERTS) for n in (1, 2, 3)),
          "block.adaLN_modulation.1")
_TEXT = ("block.attn1.to_q_t", "block.attn1.to_k_t", "block.attn1.to_v_t", "block.attn1.to_out_t",
         *(f"block.ff_t.w{n}" for n in (1, 2, 3)))
#: HiDream's original layout is diffusers' own names (diffusers' single-file converter and its HiDream LoRA converter
#: only strip or swap the `diffusion_model.` prefix; ComfyUI's HiDream model uses them too)
HIDREAM_LORA_KEYS = LoraKeyMap((
    *identity_rules("double_stream_blocks", _BLOCK + _TEXT, ()),
    *identity_rules("single_stream_blocks", _BLOCK,
                    ("t_embedder.timestep_embedder.linear_1", "t_embedder.timestep_embedder.linear_2",
                     "p_embedder.pooled_embedder.linear_1", "p_embedder.pooled_embedder.linear_2", "x_embedder.proj",
                     "final_layer.linear", "final_layer.adaLN_modulation.1")),
    KeyRule("caption_projection.{i}.linear", ("caption_projection.{i}.linear",)),
))


class _MoEFeedForward(MOEFeedForwardSwiGLU):
    """diffusers' MoE feed-forward; on the meta device (the planner's trace) a stand-in of the same shapes. It takes
    a token chunk that is not contiguous (`offload.nano_batches` slices the tokens), which diffusers' `view`s refuse:
    made contiguous first (no copy for a contiguous input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            return super().forward(x.contiguous())
        return self._balanced(x)

    @torch.no_grad()
    def moe_infer(self, x, flat_expert_indices, flat_expert_weights):
        """diffusers' `moe_infer` (eval mode); compiled, the same ops with the experts' counts as unbacked sizes
        (`.tolist()` instead of its numpy loop, which dynamo cannot unroll): every expert runs, an empty one on no
        rows (diffusers skips it: its scatter adds nothing)."""
        if not torch.compiler.is_compiling():
            return super().moe_infer(x, flat_expert_indices, flat_expert_weights)
        expert_cache = torch.zeros_like(x)
        idxs = flat_expert_indices.argsort()
        experts = torch.arange(len(self.experts), device=x.device)
        ends = (flat_expert_indices[:, None] == experts).sum(0).cumsum(0).tolist()  # bincount: a static shape
        token_idxs = idxs // self.num_activated_experts
        start = 0
        for expert, end in zip(self.experts, ends, strict=True):
            exp_token_idx = token_idxs[start:end]
            expert_out = expert(x[exp_token_idx])
            expert_out.mul_(flat_expert_weights[idxs[start:end]])
            expert_cache = expert_cache.to(expert_out.dtype)
            expert_cache.scatter_reduce_(0, exp_token_idx.view(-1, 1).repeat(1, x.shape[-1]), expert_out, reduce="sum")
            start = end
        return expert_cache

    def _balanced(self, x: torch.Tensor) -> torch.Tensor:
        """The training path with every routed expert taking an equal share of the (token, expert) pairs: the same
        tensors (the repeated tokens, each expert's gathered input and hidden states, the weighted sum) and
        matmuls as routing that spreads the tokens evenly, without the masks whose sizes only data can tell."""
        shape, d = x.shape, x.shape[-1]
        flat = x.reshape(-1, d)
        scores = nn.functional.linear(flat, self.gate.weight).softmax(dim=-1)
        weight, _ = torch.topk(scores, k=self.gate.top_k, dim=-1, sorted=False)
        pairs = flat.repeat_interleave(self.num_activated_experts, dim=0)
        y = torch.empty_like(pairs)
        share = -(-pairs.shape[0] // len(self.experts))
        for i, expert in enumerate(self.experts):
            lo, hi = i * share, min((i + 1) * share, pairs.shape[0])
            y[lo:hi] = expert(pairs[lo:hi].clone())  # the mask's gather is a copy
        y = (y.view(*weight.shape, d) * weight.unsqueeze(-1)).sum(dim=1).view(shape)
        return y + self.shared_experts(x)


class _HiDreamBlock(HiDreamBlock):
    """diffusers' HiDreamBlock whose compiled forward (trainer/offload/compiled.py: `dynamo_config`) traces the
    experts' data-dependent sizes (the training path's boolean masks, eval's counts) instead of breaking the graph
    there and compiling again for every routing (module essay)."""

    dynamo_config: ClassVar[dict[str, bool]] = {"capture_dynamic_output_shape_ops": True,
                                                "capture_scalar_outputs": True}


class HiDreamImageTransformer2DModel(diffusers.HiDreamImageTransformer2DModel):
    """diffusers' HiDreamImageTransformer2DModel (same name, config and weights) whose MoE feed-forwards also run on
    the meta device (module essay); on real tensors every call is diffusers' own."""

    @functools.wraps(diffusers.HiDreamImageTransformer2DModel.__init__)  # diffusers reads the config's keys there
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for m in self.modules():
            if type(m) is MOEFeedForwardSwiGLU:
                m.__class__ = _MoEFeedForward
            elif type(m) is HiDreamBlock:
                m.__class__ = _HiDreamBlock


class HiDreamImageAreaPipeline(HiDreamImagePipeline):
    """diffusers' HiDreamImagePipeline that makes the image the size asked for (`area`: width x height; module essay).

    The pipeline scales width and height by sqrt(its default area / their product) and rounds each down to a multiple
    of 16. Given `area`, its default area is set a billionth above `area` for the call: the scale is then just above 1
    and the rounding gives back the size asked (any multiple of 16 below 16 x 10^9 px a side)."""

    @functools.wraps(HiDreamImagePipeline.__call__)
    def __call__(self, *args, area: int | None = None, **kwargs):
        if area is None:
            return super().__call__(*args, **kwargs)
        default = self.default_sample_size
        self.default_sample_size = math.sqrt(area) * (1 + 1e-9) / self.vae_scale_factor
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self.default_sample_size = default


class HiDreamAdapter(DiffusersAdapter):
    family = "hidream"
    transformer_cls = HiDreamImageTransformer2DModel
    pipeline_cls = HiDreamImageAreaPipeline
    #: both streams' attention and every feed-forward Linear: the text stream's, and the image stream's shared and
    #: routed experts (`w1`, `w2`, `w3`); the router is no Linear (module essay)
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t", "to_out_t",
                            "w1", "w2", "w3")
    lora_key_map = HIDREAM_LORA_KEYS
    comfy_reads_diffusers_lora = True  # comfy/lora.py model_lora_keys_unet: HiDream's `transformer.<module>` keys
    modulation_linears = r"(^|\.)adaLN_modulation\."
    token_wise = ("block.ff_i",)  # the image stream's MoE feed-forward, in both kinds of block
    blocks_sync_host = True  # the training path's boolean masks: each one's size is read on the host (module essay)
    text_encoder_dirs = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
    text_encoder_classes = ("CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel",
                            "LlamaForCausalLM")
    tokenizer_dirs = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")
    text_encoder_keep_linears = T5_KEEP
    packs_2x2 = False  # the transformer patchifies 2x2 itself (`patch_size` 2)
    #: HiDream-I1-Full's scheduler as recalled (not checked offline: no copy of the released folder here)
    default_scheduler: ClassVar[dict[str, Any]] = {
        "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "prediction_type": "flow_prediction",
        "use_flow_sigmas": True, "flow_shift": 3.0,
    }
    max_sequence_length = TEXT_TOKENS
    full_name, example_path = "HiDream-I1-Full", "/path/to/HiDream-I1-Full"
    #: the released transformer/config.json (diffusers' scripts/convert_hidream_to_diffusers.py writes it; diffusers'
    #: own defaults differ: 64 input channels, (32, 32) rope axes, no caption channels or Llama layers): 17.1 B
    full_config: ClassVar[dict[str, Any]] = {
        "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 16, "num_single_layers": 32,
        "attention_head_dim": 128, "num_attention_heads": 20, "caption_channels": [4096, 4096], "text_emb_dim": 2048,
        "num_routed_experts": ROUTED_EXPERTS, "num_activated_experts": 2, "axes_dims_rope": [64, 32, 32],
        "max_resolution": [128, 128], "llama_layers": [*range(32), *[31] * 16],
    }
    text_tokens = TEXT_TOKENS  # per encoder; the blocks see T5's and two Llama layers' (module essay)
    #: CLIP-L / CLIP-G as SD3's (77 positions; HiDream's take more, a few hundred thousand parameters), T5-XXL's
    #: encoder, Llama-3.1-8B-Instruct as LlamaForCausalLM (its output head unused: `slim_text_encoder`)
    text_encoder_params = (("CLIP-L", 123_650_304), ("CLIP-G", 694_659_840), ("T5-XXL encoder", 4_762_310_656),
                           ("Llama-3.1-8B-Instruct", 8_030_261_248))
    text_encoder_unused_params = (0, 0, 0, LLAMA_EMBED)
    text_encoder_nonblock_params = (38_595_840, 64_981_760, 131_600_384, LLAMA_EMBED + 4096)
    text_encoder_layers = (12, 32, 24, 32)
    vae_params = 83_819_683  # Flux's AutoencoderKL
    sampling_uses_negative = True
    #: what the presets sample with: HiDream-I1-Full's settings (50 steps, guidance 5)
    sample_defaults: ClassVar[dict[str, Any]] = {"steps": 50, "guidance": 5.0}
    latent_scale, token_patch = 8, 2

    @classmethod
    def tiny_builders(cls):
        return {"hidream": tiny_pipeline}

    @classmethod
    def full_size_parts(cls, folder: Path):
        """bench/program/bench_program.py's full-size random folders: (Flux's VAE; [(sub-folder, class, config[,
        dtype of its matrices on disk])]): CLIP-L and CLIP-G with their projections (`CLIP_POSITIONS` positions),
        T5-XXL's encoder and Llama-3.1-8B-Instruct (LlamaForCausalLM) whole, with the special ids of the folder's
        tiny tokenizers. Nothing is cut: the pipeline reads every one of Llama's 32 hidden states (`llama_layers`),
        and its head stays as the release holds it (the loader drops it: `slim_text_encoder`). T5's and Llama's 2-D
        weights are written in fp8 (4.8 + 8.0 GB on disk instead of 9.5 + 16.1; transformers casts them to the
        load dtype, so RAM and VRAM are bf16's): in bf16 the folder (61 GB) would not fit a 64 GB disk."""
        from transformers import (
            CLIPTextConfig,
            CLIPTextModelWithProjection,
            LlamaConfig,
            LlamaForCausalLM,
            T5EncoderModel,
        )

        def clip(sub, hidden, inter, layers, heads, act):
            return CLIPTextConfig(vocab_size=49408, hidden_size=hidden, intermediate_size=inter,
                                  num_hidden_layers=layers, num_attention_heads=heads, projection_dim=hidden,
                                  max_position_embeddings=CLIP_POSITIONS, hidden_act=act,
                                  **tiny_token_ids(folder, sub))

        t5 = t5_xxl_config(**tiny_token_ids(folder, "text_encoder_3", ("eos_token_id", "pad_token_id")))
        llama = LlamaConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                            tie_word_embeddings=False, bos_token_id=None,
                            **tiny_token_ids(folder, "text_encoder_4", ("eos_token_id", "pad_token_id")))
        fp8 = torch.float8_e4m3fn
        return flux_vae(), [
            ("text_encoder", CLIPTextModelWithProjection, clip("text_encoder", 768, 3072, 12, 12, "quick_gelu")),
            ("text_encoder_2", CLIPTextModelWithProjection, clip("text_encoder_2", 1280, 5120, 32, 20, "gelu")),
            ("text_encoder_3", T5EncoderModel, t5, fp8),
            ("text_encoder_4", LlamaForCausalLM, llama, fp8)]

    # ------------------------------------------------------------------------------------------ folder and loading

    def timestep_shift(self, height: int, width: int) -> float:  # noqa: ARG002 - fixed, whatever the size
        s = self.scheduler_config
        if s.get("use_dynamic_shifting", False):  # the pipeline's mu: from the transformer's max_seq, not the image
            r = self.transformer_config.get("max_resolution", [128, 128])
            p = int(self.transformer_config.get("patch_size") or 2)
            return math.exp(calculate_shift(r[0] * r[1] // (p * p)))
        return float(s.get("flow_shift", s.get("shift", 1.0)) or 1.0)

    def load(self, cfg, *, parts, dtype, device="cpu") -> Components:
        """As every family loads, but the scheduler is the class the folder's `scheduler_config.json` names (the
        release's UniPC), and Llama's tokenizer pads with its end token, as the pipeline sets it."""
        parts = set(parts)
        out = super().load(cfg, parts=parts - {"scheduler"}, dtype=dtype, device=device)
        if "scheduler" in parts:
            out.scheduler = self._scheduler(Path(cfg.path))
        if len(out.tokenizers) == 4:
            out.tokenizers[3].pad_token = out.tokenizers[3].eos_token
        return out

    def _scheduler(self, root: Path):
        from ..errors import UserError

        conf = dict(self.scheduler_config)
        name = str(conf.get("_class_name", "FlowMatchEulerDiscreteScheduler"))
        cls = getattr(diffusers, name, None)
        if cls is None or not name.endswith("Scheduler") or not hasattr(cls, "from_config"):
            raise UserError(f"{root / 'scheduler/scheduler_config.json'}: unknown scheduler class {name!r} (expected a "
                            f"diffusers scheduler such as UniPCMultistepScheduler)")
        if (root / "scheduler" / "scheduler_config.json").is_file():
            return cls.from_pretrained(str(root), subfolder="scheduler", local_files_only=True)
        return cls.from_config(conf)

    def slim_text_encoder(self, encoder: nn.Module) -> nn.Module:
        """Llama's output head computes logits nobody reads (the pipeline takes its hidden states): it becomes the
        identity before the encoder is placed (1 GB in bf16)."""
        if type(encoder).__name__ == "LlamaForCausalLM":
            encoder.lm_head = nn.Identity()
        return encoder

    def blocks(self, transformer: nn.Module) -> list[nn.Module]:
        return [*transformer.double_stream_blocks, *transformer.single_stream_blocks]

    # ------------------------------------------------------------------------------------------ tensors

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The pipeline's own per-encoder functions (module essay), each on its encoder's device."""
        (c1, c2, t5, llama), (k1, k2, k3, k4) = components.text_encoders, components.tokenizers
        me = SimpleNamespace(tokenizer_3=k3, text_encoder_3=t5, tokenizer_4=k4, text_encoder_4=llama)
        prompts, n = list(prompts), TEXT_TOKENS

        def dev(enc):
            return enc.get_input_embeddings().weight.device

        pooled = [HiDreamImagePipeline._get_clip_prompt_embeds(me, k, c, prompts, n, dev(c), None)
                  for k, c in ((k1, c1), (k2, c2))]
        return {
            "pooled": torch.cat([pooled[0], pooled[1].to(pooled[0].device)], dim=-1),
            "t5": HiDreamImagePipeline._get_t5_prompt_embeds(me, prompts, n, dev(t5), None),
            # (layers, B, L, D) as the pipeline stacks them; the cache wants the batch first
            "llama": HiDreamImagePipeline._get_llama3_prompt_embeds(me, prompts, n, dev(llama), None).transpose(0, 1),
        }

    def encode_images(self, vae: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        return self._kl_encode(vae, pixels)

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:  # noqa: ARG002
        return transformer_prediction(transformer, noisy_latents, t * 1000.0, text["t5"], text["llama"].transpose(0, 1),
                                      text["pooled"])

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        c, dev = transformer.config, torch.device(device)
        rnd = {"device": dev, "dtype": dtype}
        t5_dim, llama_dim = c.caption_channels
        return dict(
            hidden_states=torch.randn(batch, c.in_channels, height // 8, width // 8, **rnd),
            timesteps=torch.ones(batch, **rnd),
            encoder_hidden_states_t5=torch.randn(batch, text_tokens, t5_dim, **rnd),
            encoder_hidden_states_llama3=torch.randn(max(c.llama_layers) + 1, batch, text_tokens, llama_dim, **rnd),
            pooled_embeds=torch.randn(batch, c.text_emb_dim, **rnd),
        )

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device) -> dict[str, torch.Tensor]:
        t5, nt5, llama, nllama, pooled, npooled = pipe.encode_prompt(
            prompt=prompt, device=device, do_classifier_free_guidance=negative is not None, negative_prompt=negative,
            max_sequence_length=TEXT_TOKENS)
        out = {"prompt_embeds_t5": t5, "prompt_embeds_llama3": llama, "pooled_prompt_embeds": pooled}
        if negative is not None:
            out |= {"negative_prompt_embeds_t5": nt5, "negative_prompt_embeds_llama3": nllama,
                    "negative_pooled_prompt_embeds": npooled}
        return out

    @classmethod
    def pipeline_size(cls, pipe, width: int, height: int) -> dict[str, Any]:  # noqa: ARG003 - the protocol
        return {"area": int(width) * int(height)}


def transformer_prediction(transformer, latents: torch.Tensor, timesteps: torch.Tensor, t5: torch.Tensor,
                           llama: torch.Tensor, pooled: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
    """The velocity (noise - x0) of (B, C, h, w) latents, as (B, C, h, w): the transformer's output negated (it
    predicts x0 - noise), at the pipeline's `timesteps` (1000: noise), `llama` as the pipeline stacks it (layers
    first). A non-square image is padded to `pad_to` tokens (None: the transformer's `max_seq`, diffusers' own
    patchify), or runs unpadded when it has more (module essay); a square one is never padded, as diffusers runs it."""
    b, c, h, w = latents.shape
    p = transformer.config.patch_size
    gh, gw = h // p, w // p
    n = transformer.max_seq if pad_to is None else pad_to
    tokens = {}
    if h != w and (gh * gw > n or n != transformer.max_seq):  # diffusers' patchify cannot pad to n: ours does
        tokens = unpadded_tokens(latents, p, max(n, gh * gw))
    out = transformer(
        hidden_states=tokens.pop("hidden_states", latents),
        timesteps=timesteps,
        encoder_hidden_states_t5=t5,
        encoder_hidden_states_llama3=llama,
        pooled_embeds=pooled,
        return_dict=False,
        **tokens,
    )[0]
    if out.shape[-2:] != (h, w):  # training mode's (B, C, tokens, p * p): the image tokens laid out as (h, w)
        out = out[:, :, : gh * gw].unflatten(2, (gh, gw)).unflatten(-1, (p, p))
        out = out.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)
    return -out  # the model's x0 - noise, as (noise - x0)


def unpadded_tokens(latents: torch.Tensor, p: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """The transformer's pre-patchified arguments for (B, C, h, w) latents: its `patchify` (tokens with features
    (row, column, channel) of each p x p patch, positions (0, row, column)) as it lays out a square image, with a
    mask of ones, for a non-square image of more tokens than its padding holds; with `pad_to`, zero tokens, zero
    positions and a mask of zeros after the image's up to `pad_to` tokens, as its patchify pads to its `max_seq`."""
    b, c, h, w = latents.shape
    gh, gw = h // p, w // p
    n, pad = gh * gw, max((pad_to or 0) - gh * gw, 0)
    x = latents.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(b, n, p * p * c)
    ids = torch.zeros(gh, gw, 3, device=latents.device)
    ids[..., 1] += torch.arange(gh, device=latents.device)[:, None]
    ids[..., 2] += torch.arange(gw, device=latents.device)[None, :]
    ids = ids.reshape(n, 3)
    mask = latents.new_ones(b, n)
    if pad:
        x = torch.cat([x, x.new_zeros(b, pad, x.shape[-1])], dim=1)
        ids = torch.cat([ids, ids.new_zeros(pad, 3)])
        mask = torch.cat([mask, mask.new_zeros(b, pad)], dim=1)
    sizes = torch.tensor([gh, gw], dtype=torch.int64, device=latents.device).expand(b, 2)
    return {"hidden_states": x, "img_ids": ids.reshape(1, n + pad, 3).expand(b, -1, -1), "img_sizes": sizes,
            "hidden_states_masks": mask}


# ---------------------------------------------------------------------------------------------- tiny model


def tiny_pipeline():
    """A tiny random HiDream-I1: two double- and two single-stream blocks 32 wide, each image feed-forward a
    mixture of 4 routed experts (2 per token) and a shared one, Llama layers read as the release reads them (each
    block one, the last repeated); two CLIPs with 128 positions, a T5 and a 4-layer Llama over the tiny Qwen
    tokenizer; Flux-like VAE; the release's UniPC scheduler with flow sigmas."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM

    from .tiny import clip_tokenizer, kl_vae, qwen_tokenizer, t5_text, t5_tokenizer

    clip_tok, t5_tok, llama_tok = clip_tokenizer(), t5_tokenizer(), qwen_tokenizer()
    clip_tok.model_max_length = TEXT_TOKENS

    def clip(hidden: int, seed: int):
        cfg = CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=TEXT_TOKENS, hidden_act="quick_gelu", projection_dim=hidden,
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
        )
        torch.manual_seed(seed)
        return CLIPTextModelWithProjection(cfg).eval()

    torch.manual_seed(61)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(llama_tok), hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=256, eos_token_id=llama_tok.eos_token_id,
        pad_token_id=llama_tok.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )).eval()
    torch.manual_seed(62)
    transformer = diffusers.HiDreamImageTransformer2DModel(  # the library's class: saved as a real folder's
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[32, 16], text_emb_dim=16 + 24, num_routed_experts=ROUTED_EXPERTS,
        num_activated_experts=2, axes_dims_rope=[8, 4, 4], max_resolution=[16, 16], llama_layers=[0, 1, 3, 3],
    )
    conf = {k: v for k, v in HiDreamAdapter.default_scheduler.items() if not k.startswith("_")}
    return HiDreamImagePipeline(
        scheduler=diffusers.UniPCMultistepScheduler(**conf), vae=kl_vae(0.1159, 0.3611),
        text_encoder=clip(16, 63), tokenizer=clip_tok, text_encoder_2=clip(24, 64), tokenizer_2=clip_tok,
        text_encoder_3=t5_text(t5_tok, 32), tokenizer_3=t5_tok, text_encoder_4=llama, tokenizer_4=llama_tok,
        transformer=transformer,
    )
