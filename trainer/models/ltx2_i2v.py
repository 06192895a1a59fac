"""LTX-2 image-to-video (`ltx2-i2v`): the LTX-2 folder (trainer/models/ltx2.py) sampled with
`LTX2ImageToVideoPipeline`, the first latent frame given by an image.

How diffusers' LTX2ImageToVideoPipeline (0.42) conditions, and what training does the same way:

- the image (re-compressed as an H.264 frame at CRF 33 for the Gemma 3 generations, then resized) is encoded
  alone, one latent frame, normalised as every LTX-2 latent; it is the first latent frame of the transformer's
  input at every step, and the scheduler steps only the frames after it (the first frame's prediction is dropped);
- the timestep is per token: the step's t * 1000 on every token but the first frame's, which get 0 (`timestep` of
  shape (B, tokens)); `sigma` and the audio stream's timestep stay the step's.

Training takes the clip's own first frame (already a video frame: no re-compression), encodes it alone when the
clip's latent is cached (`encode_conditions`), puts it in place of the first noisy latent frame with timestep 0 and
leaves that frame out of the loss (`frame_loss_weights`: the loss is the mean with that frame at zero). The sound
trains as in `ltx2` (the module essay there): the pipeline gives the audio stream the step's timestep, not the
per-token one. `dittrain sample --image first.png` (`sample.image` in a
fit) hands the picture, cut to the sample's size, to the pipeline.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import LTX2ImageToVideoPipeline

from .base import Components
from .ltx2 import LTX2Adapter, pack, tiny_pipeline


class LTX2I2VAdapter(LTX2Adapter):
    family = "ltx2-i2v"
    full_name, example_path = "LTX-2 (19B, image-to-video)", "/path/to/LTX-2-Diffusers"
    first_frame_conditions = True
    first_frame_given = True  # the pipeline drops the first frame's prediction

    @classmethod
    def tiny_builders(cls):
        return {"ltx2-i2v": tiny_pipeline}

    def pipeline(self, components: Components) -> LTX2ImageToVideoPipeline:
        """LTX2ImageToVideoPipeline from the same components as `ltx2`'s pipeline."""
        return LTX2ImageToVideoPipeline(**super().pipeline(components).components)

    def encode_conditions(self, vae, pixels) -> dict[str, torch.Tensor]:
        """The first frame alone through the VAE, as the pipeline encodes `image`: one latent frame (B, C, 1, h, w)."""
        return {"image_latents": self.encode_videos(vae, pixels[:, :, :1])}

    def predict(self, transformer, noisy_latents, t, text, guidance: float = 1.0) -> torch.Tensor:
        x = torch.cat([text["image_latents"].to(noisy_latents.dtype), noisy_latents[:, :, 1:]], dim=2)
        f, h, w = x.shape[2:]
        step = t * 1000.0
        first = torch.zeros(f, h, w, device=x.device, dtype=step.dtype)
        first[0] = 1.0  # the pipeline's conditioning mask, packed as the tokens are
        timestep = step[:, None] * (1 - first.flatten())[None]
        return self._call(transformer, pack(x), timestep, text, (f, h, w), sigma=step)

    @classmethod
    def dummy_inputs(cls, transformer, batch, height, width, text_tokens, dtype, device="meta",
                     frames: int | None = None, sound: bool = False) -> dict:
        """Text-to-video's, with `predict`'s per-token timestep (B, tokens): the transformer then makes its
        timestep embedding and modulations per token too."""
        kw = super().dummy_inputs(transformer, batch, height, width, text_tokens, dtype, device, frames, sound)
        x = kw["hidden_states"]
        kw["timestep"] = x.new_ones(batch, x.shape[1])
        return kw

    @classmethod
    def pipeline_image(cls, pipe, image) -> dict[str, Any]:
        return {} if image is None else {"image": image}
