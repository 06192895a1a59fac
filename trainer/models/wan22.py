"""Wan 2.2 A14B text-to-video: two experts of Wan 2.1 14B's architecture in one `WanPipeline`.

How the pipeline splits the work (diffusers' WanPipeline, 0.42): `transformer` (the high-noise expert) denoises
every step whose scheduler timestep t (0..1000) is at or above `boundary_ratio * num_train_timesteps` (the folder's
model_index.json: 0.875 for T2V-A14B), `transformer_2` (the low-noise expert) the steps below it, each with
classifier-free guidance (`guidance_scale`, and `guidance_scale_2` for the low-noise steps, which defaults to the
same value). Text encoder (UMT5-XXL), VAE (Wan 2.1's) and scheduler are shared, so everything but the transformer
is Wan 2.1's adapter (trainer/models/wan.py).

Training: one expert per run, or both. `model.expert: high_noise` loads `transformer/` and trains it on flow
times t in [boundary, 1]; `low_noise` loads `transformer_2/` and trains t in [0, boundary) (ModelAdapter.
train_timesteps: the objective maps each shifted t linearly into that range, trainer/train/objective.py). Only that
expert is loaded, LoRA-wrapped and streamed. `model.expert: both` (LoRA; trainer/train/experts.py) trains both in
one run: each step draws its timesteps over [0, 1] as a one-model run does, the first draw picks the expert that
owns it (`expert_for`: the pipeline's own t >= boundary test) and the rest of the step is drawn on its side; the
other expert's LoRA and optimizer state stay untouched, and on a GPU it waits parked in pinned RAM (its ring given
back) while the one that owns the step streams. Either way each expert's LoRA is written as
`lora-high_noise.safetensors` / `lora-low_noise.safetensors`, which diffusers loads as

    pipe.load_lora_weights("lora-high_noise.safetensors")
    pipe.load_lora_weights("lora-low_noise.safetensors", load_into_transformer_2=True)

and `dittrain sample --lora` does the same by the file's name (`low_noise` / `low-noise` in it: transformer_2).

Sampling (`dittrain sample`, and the samples during a fit) loads both experts: the one `model.expert` picks as
usual (streamed from its files at an offload fraction), the other whole into CPU RAM (`Components.experts`); each
is placed at the same fraction (streamed: its blocks come to the GPU only while it runs). During a one-expert fit the
other expert is the base model (its LoRA is not trained there), streamed at fraction 1.0 on a GPU; during a `both`
fit each slot gets its trained expert.
"""

from __future__ import annotations

import re

import torch

from .base import BOTH_EXPERTS
from .wan import WAN_SCHEDULER, WanAdapter, tiny_pipeline

#: the boundary when a folder's model_index.json names none (Wan 2.2's wan_t2v_A14B config: 0.875)
T2V_BOUNDARY = 0.875
#: a LoRA file for the low-noise expert, told by its name (`<name>-low_noise.safetensors`, `low_noise_model...`)
_LOW_NOISE = re.compile(r"low[_-]?noise", re.IGNORECASE)


def tiny_pipeline_a14b():
    """Tiny Wan 2.2 A14B-like: Wan 2.1's tiny parts, a second random transformer as the low-noise expert, the
    boundary at 0.875."""
    from diffusers import WanPipeline, WanTransformer3DModel

    base = tiny_pipeline()
    torch.manual_seed(24)
    low = WanTransformer3DModel.from_config(base.transformer.config)
    return WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                       transformer=base.transformer, transformer_2=low, scheduler=base.scheduler,
                       boundary_ratio=T2V_BOUNDARY)


class Wan22A14BAdapter(WanAdapter):
    family = "wan2.2-a14b"
    full_name, example_path = "Wan2.2-T2V-A14B", "/path/to/Wan2.2-T2V-A14B-Diffusers"
    #: model.expert -> its folder and pipeline component
    experts = {"high_noise": "transformer", "low_noise": "transformer_2"}
    default_boundary = T2V_BOUNDARY
    #: the published T2V-A14B folders' scheduler when a folder has none (Wan 2.2's sample_shift 12 for T2V-A14B)
    default_scheduler = {**WAN_SCHEDULER, "flow_shift": 12.0}
    sample_defaults = {"guidance": 4.0, "steps": 40}
    full_variants = {}  # two 14 B experts only

    @classmethod
    def tiny_builders(cls):
        return {"wan22-a14b": tiny_pipeline_a14b}

    @property
    def boundary_ratio(self) -> float:
        """Where the experts split, as a share of the 1000 training timesteps (model_index.json)."""
        index = self._json("model_index.json", required=False)
        return float(index.get("boundary_ratio") or self.default_boundary)

    def train_timesteps(self) -> tuple[float, float]:
        from ..errors import UserError

        if self.expert is None:
            raise UserError(f"model.expert: {self.family} trains one expert per run, or both: set model.expert to "
                            f"high_noise (transformer/, t >= {self.boundary_ratio:g}), low_noise (transformer_2/, below "
                            f"it) or {BOTH_EXPERTS} (each step trains the expert that owns its timestep)")
        if self.expert == BOTH_EXPERTS:
            return (0.0, 1.0)  # the objective draws each step's expert first (FlowMatching's `split`)
        b = self.boundary_ratio
        return (b, 1.0) if self.experts[self.expert] == "transformer" else (0.0, b)

    def expert_for(self, timestep: torch.Tensor) -> str:
        """`transformer` (high_noise) for pipeline timesteps at or above boundary_ratio * 1000, `transformer_2`
        below: WanPipeline's own test (`t >= boundary_timestep`), on the same fp32 values `predict` passes."""
        high = torch.as_tensor(timestep) >= self.boundary_ratio * 1000.0
        if bool(high.all()):  # host-device sync (a (B,) bool): the expert decides which weights run
            want = "transformer"
        elif not bool(high.any()):
            want = "transformer_2"
        else:
            raise ValueError(f"one batch spans both experts' timesteps ({timestep.tolist()}); a step trains one")
        return next(name for name, d in self.experts.items() if d == want)

    @classmethod
    def lora_load_kwargs(cls, path) -> dict:
        return {"load_into_transformer_2": True} if _LOW_NOISE.search(str(path).rsplit("/", 1)[-1]) else {}

    @classmethod
    def pipeline_transformers(cls, pipe) -> list:
        return [pipe.transformer, pipe.transformer_2]

    def pipeline(self, components):
        pipe = super().pipeline(components)
        pipe.register_to_config(boundary_ratio=self.boundary_ratio)  # what WanPipeline.from_pretrained sets
        return pipe
