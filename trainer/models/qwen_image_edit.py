"""Qwen-Image-Edit: Qwen-Image's transformer trained to edit, conditioned twice on the reference image: its VAE
latents joined to the image tokens (as Kontext does) and its pixels seen by the Qwen2.5-VL text encoder together
with the instruction. VAE, blocks, shift and LoRA targets are Qwen-Image's (`QwenImageAdapter`).

How it mirrors diffusers' QwenImageEditPipeline (0.42):

- text: the instruction goes into the pipeline's edit chat template, whose user turn starts with
  `<|vision_start|><|image_pad|><|vision_end|>`; the `processor` (Qwen2VLProcessor) expands the image pad into one
  token per 2x2 merged 14-pixel patch and turns the reference into `pixel_values` / `image_grid_thw`; Qwen2.5-VL
  runs on both; the last hidden state is taken at the valid tokens and the template's first 64 tokens dropped.
  So the embedding depends on the reference image, and the text cache key of this family includes the reference
  (`text_uses_reference`: trainer/data/cache.py `TextJob`, keyed by caption + the reference's latent key, which
  hashes its content, bucket and crop);
- latents: the reference is VAE-encoded like the target (mode, per-channel mean / std) and packed 2x2; the
  transformer sees [target tokens, reference tokens] and `img_shapes` = [(1, h/2, w/2), (1, rh/2, rw/2)] per
  sample (the 3-D rotary positions give the second image frame index 1); the prediction is the first (target)
  part of the output, so the loss is on the target tokens only;
- shift: from the target's token count, as the pipeline's `calculate_shift(latents.shape[1])`.

Training data: pairs, as for flux-kontext (data/sources.py: `control/` beside the targets or a `control` metadata
column). The reference is resized and cropped to the target's bucket, and the text encoder sees exactly those
pixels; so the sequence is twice the target's image tokens (`dummy_inputs`). The pipeline instead resizes the
reference to about 1 megapixel (its aspect kept) for both the VAE and the text encoder, which is what training at
resolution 1024 on same-aspect pairs reproduces.

Sampling (`dittrain sample --image ref.png`): the reference is resized and centre-cropped to the sample's size
(as for every edit family) and handed to the pipeline, which then treats it as above (about 1 megapixel for the
VAE and the text encoder). The pipeline cannot run without a reference, so sampling needs `--image` (or
`sample.image` in the config for samples during training).

The processor. transformers' `Qwen2VLProcessor` needs a video processor, and its only implementation needs
torchvision. Where torchvision is installed the folder's `processor/` loads as it is; where it is not, the
processor is rebuilt from the folder's own image processor (its PIL variant, identical settings) and tokenizer,
with an empty `BaseVideoProcessor` (no video is ever processed here).

Qwen-Image-Edit-2509 (`QwenImageEditPlusPipeline`, one reference): qwen_image_edit_plus.py, a subclass that
changes the template (`edit_template`) and the size the text encoder sees the reference at (`text_reference`).

Left out: several reference images, references of another size than the target's bucket, validation sets
(data.validation) for this family.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImageEditPipeline, QwenImageTransformer2DModel
from PIL import Image
from torch import nn

from ..errors import UserError
from ._diffusers import pack_2x2, unpack_2x2
from .base import Components, to_pil
from .qwen_image import QWEN_VL_EMBED, QWEN_VL_LM_HEAD, QWEN_VL_VISUAL, QwenImageAdapter, tiny_parts

CONTROL = "control_latents"
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EDIT_TEMPLATE_DROP = 64  # QwenImageEditPipeline.prompt_template_encode_start_idx
PIPELINE_AREA = 1024 * 1024  # the pipeline's reference area (calculate_dimensions(1024 * 1024, ratio))


@cache
def image_only_processor_class():
    """Qwen2VLProcessor that accepts a plain `BaseVideoProcessor` (see `load_processor`)."""
    from transformers import Qwen2VLProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        # Without torchvision, `transformers.BaseVideoProcessor` is a dummy class, so the base check refuses the
        # real (torchvision-free) BaseVideoProcessor instance; accept it: no video goes through this processor.
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and isinstance(argument, BaseVideoProcessor):
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageOnlyQwen2VLProcessor


def load_processor(folder: str | Path):
    """The model folder's `processor/` (Qwen2VLProcessor).

    With torchvision installed this is `Qwen2VLProcessor.from_pretrained`, as diffusers loads it. Without it
    transformers cannot build the processor's video part (its video processor needs torchvision, and
    Qwen2VLProcessor refuses video_processor=None), so the processor is assembled from the folder's image
    processor in its PIL variant (`Qwen2VLImageProcessorPil`: the same resize / normalisation settings), the
    folder's tokenizer and an empty `BaseVideoProcessor`: we never process video."""
    import transformers
    from transformers.utils import is_torchvision_available

    folder = Path(folder)
    if is_torchvision_available():
        return transformers.Qwen2VLProcessor.from_pretrained(folder, local_files_only=True)
    from transformers.video_processing_utils import BaseVideoProcessor

    image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return image_only_processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=BaseVideoProcessor()
    )


def pipeline_reference_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) the pipeline resizes a reference to: about 1 MP, its aspect kept, sides multiples of 32."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    w, h, _ = calculate_dimensions(PIPELINE_AREA, image.width / image.height)
    return int(w), int(h)


def tiny_edit_pipeline(pipeline_cls: type):
    """The tiny Qwen-Image (qwen_image.py `tiny_parts`) as an edit pipeline, with a Qwen2-VL processor of the real
    one's settings (14-pixel patches merged 2x2, CLIP mean / std) whose images are capped at 128x128 pixels, so
    the vision tower stays cheap."""
    from transformers import Qwen2VLImageProcessorPil
    from transformers.video_processing_utils import BaseVideoProcessor

    parts = tiny_parts()
    proc = image_only_processor_class()(
        image_processor=Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=128 * 128),
        tokenizer=parts["tokenizer"], video_processor=BaseVideoProcessor(),
    )
    return pipeline_cls(**parts, processor=proc)


class QwenImageEditAdapter(QwenImageAdapter):
    family = "qwen-image-edit"
    transformer_cls = QwenImageTransformer2DModel
    pipeline_cls = QwenImageEditPipeline
    takes_reference = True
    #: the text encoder sees the reference image: text-cache entries are per (caption, reference)
    text_uses_reference = True
    #: folders besides the text encoders / tokenizers whose files change the text embeddings (cache identity)
    extra_text_dirs = ("processor",)
    full_name, example_path = "Qwen-Image-Edit", "/path/to/Qwen-Image-Edit"
    # Qwen-Image-Edit has Qwen-Image's transformer (20.4 B) and text encoder (Qwen2.5-VL-7B, here with its vision
    # tower used): QwenImageAdapter.full_config / text_encoder_params.
    # The reference's image tokens come before the instruction in the text sequence (one per 28x28 pixels of the
    # reference): a 1024x1024 reference adds 37 x 37 = 1369, which the planner's text-token count includes.
    text_tokens = 256 + 1369
    # its text encoder runs the vision tower on the reference: only the language-model head is dropped
    text_encoder_unused_params = (QWEN_VL_LM_HEAD,)
    text_encoder_nonblock_params = (QWEN_VL_EMBED + QWEN_VL_VISUAL,)
    #: the chat template the instruction goes into (the Plus family numbers its pictures)
    edit_template = EDIT_TEMPLATE

    @classmethod
    def tiny_builders(cls):
        return {"qwen-image-edit": lambda: tiny_edit_pipeline(QwenImageEditPipeline)}

    # ------------------------------------------------------------------------------------------ loading

    processor_label = "Qwen2-VL"
    load_processor = staticmethod(load_processor)

    def pipeline(self, components: Components) -> Any:
        toks = components.tokenizers
        return self.pipeline_cls(
            transformer=components.transformer, vae=components.vae, scheduler=components.scheduler,
            text_encoder=components.text_encoders[0] if components.text_encoders else None,
            tokenizer=toks[0] if toks else None, processor=toks[1] if len(toks) > 1 else None,
        )

    # ------------------------------------------------------------------------------------------ text

    @torch.no_grad()
    def encode_prompts(self, components: Components, prompts: list[str], images: list | None = None) -> dict:
        """`images`: one reference (PIL image, or pixels (3, H, W) in [-1, 1]) per prompt; required."""
        if images is None or len(images) != len(prompts):
            raise ValueError(f"{self.family}: encode_prompts needs one reference image per prompt")
        (enc,), proc = components.text_encoders, components.tokenizers[1]
        dev = enc.get_input_embeddings().weight.device
        pil = [self.text_reference(im if isinstance(im, Image.Image) else to_pil(im)) for im in images]
        inputs = proc(text=[self.edit_template.format(p) for p in prompts], images=pil, padding=True,
                      return_tensors="pt").to(dev)
        hidden = enc(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                     output_hidden_states=True).hidden_states[-1]
        valid = inputs["attention_mask"].bool()
        parts = [h[m][EDIT_TEMPLATE_DROP:] for h, m in zip(hidden, valid, strict=True)]
        longest = max(p.shape[0] for p in parts)
        embeds = torch.stack([nn.functional.pad(p, (0, 0, 0, longest - p.shape[0])) for p in parts]).to(enc.dtype)
        mask = torch.zeros(len(parts), longest, dtype=torch.long, device=dev)
        for i, p in enumerate(parts):
            mask[i, : p.shape[0]] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    @classmethod
    def text_reference(cls, image: Image.Image) -> Image.Image:
        """The reference as the text encoder is handed it (here: as cut for the target's bucket)."""
        return image

    # ------------------------------------------------------------------------------------------ transformer

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        ref = text.get(CONTROL)
        if ref is None:
            return super().predict(transformer, noisy_latents, t, text, guidance)
        b, _, h, w = noisy_latents.shape
        x = pack_2x2(noisy_latents)
        n = x.shape[1]
        g = None
        if transformer.config.guidance_embeds:
            g = torch.full((b,), float(guidance), device=x.device, dtype=torch.float32)
        out = transformer(
            hidden_states=torch.cat([x, pack_2x2(ref.to(x.dtype))], dim=1),
            timestep=t.to(x.dtype),
            guidance=g,
            encoder_hidden_states=text["prompt_embeds"],
            encoder_hidden_states_mask=text.get("prompt_embeds_mask"),
            img_shapes=[[(1, h // 2, w // 2), (1, ref.shape[-2] // 2, ref.shape[-1] // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack_2x2(out[:, :n], h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        kw = super().dummy_inputs(transformer, batch, height, width, text_tokens, dtype, device)
        # the reference image's tokens (same bucket) follow the target's: twice the image sequence
        kw["hidden_states"] = torch.cat([kw["hidden_states"], kw["hidden_states"]], dim=1)
        kw["img_shapes"] = [[s[0], s[0]] for s in kw["img_shapes"]]
        return kw

    # ------------------------------------------------------------------------------------------ sampling

    @classmethod
    def pipeline_text_image(cls, pipe, image: Image.Image):
        """The reference as the pipeline hands it to `encode_prompt`: resized to its ~1 MP size."""
        w, h = pipeline_reference_size(image)
        return pipe.image_processor.resize(image, h, w)

    @classmethod
    def pipeline_embeds(cls, pipe, prompt, negative, device, image=None) -> dict[str, torch.Tensor]:
        """As the pipeline encodes: the reference (`pipeline_text_image`) seen with each prompt."""
        if image is None:
            raise UserError(f"{cls.family} samples need a reference image: pass --image (or set sample.image)")
        ref = cls.pipeline_text_image(pipe, image)
        pe, mask = pipe.encode_prompt(prompt=prompt, image=ref, device=device, num_images_per_prompt=1)
        out = {"prompt_embeds": pe, "prompt_embeds_mask": mask}
        if negative is not None:
            npe, nmask = pipe.encode_prompt(prompt=negative, image=ref, device=device, num_images_per_prompt=1)
            out |= {"negative_prompt_embeds": npe, "negative_prompt_embeds_mask": nmask}
        return out

    @classmethod
    def pipeline_image(cls, pipe, image: Any) -> dict[str, Any]:
        if image is None:
            raise UserError(f"{cls.family} samples need a reference image: pass --image (or set sample.image)")
        return {"image": image}

