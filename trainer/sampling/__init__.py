"""Image generation through the family's diffusers pipeline, shared by `dittrain sample` and the training loop.

Public surface: `TrainingSampler` (what the training loop calls), `generate` and `encode_prompts` underneath, `SampleSettings`,
`release_text_encoders`; `trainer/sample.py` holds the `dittrain sample` command built on them.
"""

from .engine import encode_prompts, generate, release_text_encoders
from .request import LoraSpec, SampleRequest, SampleSettings
from .training import TrainingSampler

__all__ = [
    "LoraSpec",
    "SampleRequest",
    "SampleSettings",
    "TrainingSampler",
    "encode_prompts",
    "generate",
    "release_text_encoders",
]
