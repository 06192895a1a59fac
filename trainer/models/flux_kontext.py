"""Flux.1 Kontext: the Flux transformer trained to edit, conditioned on a reference image's latents joined to the
image tokens. Text, VAE, shift and blocks are Flux's (`FluxAdapter`); only the token sequence differs.

How it mirrors diffusers' FluxKontextPipeline (0.42):

- the reference image is VAE-encoded like the target (mean, shift, scale) and packed 2x2 into tokens;
- the transformer sees [target tokens, reference tokens] concatenated along the sequence; the target's image ids
  are (0, row, col) as in Flux, the reference's (1, row, col): the first id of 1 is all that tells the rotary
  positions the two images apart;
- the prediction is the first (target) part of the output; the reference tokens' outputs are discarded;
- timestep shift: from the target's token count, as the pipeline's `calculate_shift(latents.shape[1])`.

Training data: pairs (data/sources.py: `control/` beside the targets or a `control` metadata column). The
reference is resized and cropped to the target's bucket, so the sequence is exactly twice the target's image
tokens, which is what `dummy_inputs` gives the planner. The reference latents reach `predict` in the
conditioning dict under `control_latents` (trainer/data/pipeline.py puts them there; text entries sit beside
them), so the training loop carries them like text embeddings.

Sampling (`dittrain sample --image ref.png`): the reference is resized and centre-cropped to the sample's width x
height, the same rule as training, and handed to the pipeline with `_auto_resize=False` (the pipeline would
otherwise resize it to the nearest of its preferred ~1 MP sizes), and `max_area` = width x height (it would
otherwise rescale the output to about 1 MP: a 64 x 64 request made 1024 x 1024). Without `--image` the pipeline generates
without a reference, as FluxKontextPipeline does.

Left out: several reference images, references of a size other than the target's bucket.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxKontextPipeline, FluxTransformer2DModel

from ._diffusers import pack_2x2, unpack_2x2
from .flux import FluxAdapter, tiny_pipeline

CONTROL = "control_latents"


def _ids(h2: int, w2: int, first: float, dev) -> torch.Tensor:
    ids = torch.zeros(h2, w2, 3, device=dev)
    ids[..., 0] = first
    ids[..., 1] += torch.arange(h2, device=dev)[:, None]
    ids[..., 2] += torch.arange(w2, device=dev)[None, :]
    return ids.reshape(-1, 3)


class FluxKontextAdapter(FluxAdapter):
    family = "flux-kontext"
    transformer_cls = FluxTransformer2DModel
    pipeline_cls = FluxKontextPipeline
    takes_reference = True
    full_name, example_path = "Flux.1-Kontext-dev", "/path/to/FLUX.1-Kontext-dev"
    # FLUX.1-Kontext-dev has FLUX.1-dev's architecture (11.9 B, guidance embedding): FluxAdapter.full_config.

    @classmethod
    def tiny_builders(cls):
        return {"flux-kontext": lambda: tiny_pipeline(FluxKontextPipeline, schnell=False)}

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        ref = text.get(CONTROL)
        if ref is None:
            return super().predict(transformer, noisy_latents, t, text, guidance)
        b, _, h, w = noisy_latents.shape
        dev = noisy_latents.device
        x = pack_2x2(noisy_latents)
        n = x.shape[1]
        r = pack_2x2(ref.to(x.dtype))
        img_ids = torch.cat([_ids(h // 2, w // 2, 0.0, dev), _ids(ref.shape[-2] // 2, ref.shape[-1] // 2, 1.0, dev)])
        embeds = text["prompt_embeds"]
        g = None
        if transformer.config.guidance_embeds:
            g = torch.full((b,), float(guidance), device=dev, dtype=torch.float32)
        out = transformer(
            hidden_states=torch.cat([x, r], dim=1),
            timestep=t.to(x.dtype),
            guidance=g,
            pooled_projections=text["pooled_prompt_embeds"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=dev),
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return unpack_2x2(out[:, :n], h, w)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta") -> dict:
        kw = super().dummy_inputs(transformer, batch, height, width, text_tokens, dtype, device)
        # the reference image's tokens (same bucket) follow the target's: twice the image sequence
        kw["hidden_states"] = torch.cat([kw["hidden_states"], kw["hidden_states"]], dim=1)
        kw["img_ids"] = torch.cat([kw["img_ids"], kw["img_ids"]], dim=0)
        return kw

    @classmethod
    def pipeline_size(cls, pipe, width: int, height: int) -> dict[str, Any]:
        """FluxKontextPipeline rescales width x height to `max_area` (default 1024**2) at the same aspect ratio and
        warns "height and width have been adjusted": the area asked for keeps the size asked for."""
        return {"max_area": width * height}

    @classmethod
    def pipeline_image(cls, pipe, image: Any) -> dict[str, Any]:
        if image is None:
            return {}
        return {"image": image, "_auto_resize": False}
