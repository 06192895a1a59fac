"""Qwen-Image-Edit-2509 (diffusers `QwenImageEditPlusPipeline`): Qwen-Image-Edit's transformer, VAE and text
encoder, with one reference image per training pair. Everything is `QwenImageEditAdapter`'s (reference latents
joined to the target's tokens with a second `img_shapes` entry, prediction = the target part, text cache keyed by
caption + reference) except what the text encoder is shown.

What differs from Qwen-Image-Edit, as in diffusers' QwenImageEditPlusPipeline (0.42):

- the template: the same system prompt and drop index (64), but the user turn numbers its pictures:
  `Picture 1: <|vision_start|><|image_pad|><|vision_end|>` then the instruction (`PLUS_TEMPLATE`);
- the size the text encoder sees: the reference resized (Lanczos, `VaeImageProcessor.resize`) to about
  384 x 384 pixels of area, its aspect kept, sides multiples of 32 (`calculate_dimensions(CONDITION_IMAGE_SIZE,
  ratio)`), so ~196 vision tokens instead of ~1369. The VAE still sees the reference large: the pipeline resizes
  it to about 1 megapixel; training uses it as cut for the target's bucket (as Qwen-Image-Edit does), and the
  condition image is made from those same pixels, so same-aspect pairs at resolution 1024 reproduce the pipeline;
- transformer: called as the Edit pipeline calls it ([target, reference] tokens, `img_shapes` with one entry per
  image). Checkpoints whose transformer config sets `zero_cond_t` (Qwen-Image-Edit-2511) give the reference
  tokens timestep 0 inside the transformer itself, from `img_shapes`: nothing to do here.

Left out: several reference images per pair (the pipeline's list of images, "Picture 1 ... Picture N"), and
validation sets (data.validation), as for Qwen-Image-Edit.
"""

from __future__ import annotations

from functools import cache

from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    calculate_dimensions,
)
from PIL import Image

from .qwen_image_edit import EDIT_TEMPLATE, QwenImageEditAdapter, tiny_edit_pipeline

#: QwenImageEditPlusPipeline's template with one picture: "Picture 1: " before the vision tokens
PLUS_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|>", "Picture 1: <|vision_start|>")


@cache
def _resizer():
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=16)  # the pipeline's image_processor (resize: PIL Lanczos)


def condition_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) the Plus pipeline shows a reference to the text encoder at: ~384x384 area, aspect kept."""
    w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
    return int(w), int(h)


def condition_image(image: Image.Image) -> Image.Image:
    w, h = condition_size(image)
    return _resizer().resize(image, h, w)


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    family = "qwen-image-edit-plus"
    pipeline_cls = QwenImageEditPlusPipeline
    full_name, example_path = "Qwen-Image-Edit-2509", "/path/to/Qwen-Image-Edit-2509"
    # the reference's vision tokens in the text sequence: a 384x384 condition image is 14 x 14 = 196 (28-px
    # merged patches), plus the few tokens of "Picture 1: "
    text_tokens = 256 + 196 + 8
    edit_template = PLUS_TEMPLATE

    @classmethod
    def tiny_builders(cls):
        return {"qwen-image-edit-plus": lambda: tiny_edit_pipeline(QwenImageEditPlusPipeline)}

    @classmethod
    def text_reference(cls, image: Image.Image) -> Image.Image:
        return condition_image(image)

    @classmethod
    def pipeline_text_image(cls, pipe, image: Image.Image):
        """The Plus pipeline's `encode_prompt` takes a list of references at their condition size."""
        return [condition_image(image)]
