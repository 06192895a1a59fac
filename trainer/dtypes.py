"""The one map from the config's dtype names (`model.dtype`: bf16, fp16, fp32) to torch dtypes."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
