"""Validation loss: the held-out set (trainer/data/validation.py) scored with fixed noise at fixed timesteps.

    validator = Validator.build(cfg, data, adapter, device, dtype)   # None without data.validation
    metrics = validator(transformer, optimizer)                      # {"val_loss": ..., "val_loss_t0.5": ...}

What is scored. Every held-out entry at every `data.validation.timesteps` value t: x_t = (1 - t) x0 + t eps with
no resolution shift and no loss weighting, so the number depends only on the weights, never on the training
schedule or on which batch came before; eps is drawn from a CPU generator seeded by (train.seed, entry index), the
same for every step and every run with the same seed and data. `val_loss` is the mean over entries and timesteps
(mask-weighted like training with data.masked_loss); `val_loss_t<t>` the mean at each t. Comparable across steps
and across runs that share the validation set, seed and timesteps.

How. Under `torch.no_grad`, the transformer in eval mode (LoRA dropout off), a schedule-free optimizer's averaged
weights swapped in (as for sampling), through the very modules that train: each block is a `StreamedBlock`, whose
no-grad forward skips checkpointing and enters the conductor as a forward pass, which the conductor absorbs into
its training plan (trainer/offload/conductor.py: out-of-plan calls), so validation streams at every offload
fraction. It draws nothing from the training generators (its own generators, inside `fork_rng` as a guard), so
the training losses are bitwise those of a run without validation.

Only the main process scores (every process holds the same weights; the others go on and wait for it at the next
gradient average). Host-device sync: one `.item()` per batch and timestep, only on validation steps.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..optim.build import eval_weights
from .objective import FlowMatching, Noised, loss_weights


def _noise(shape: tuple[int, ...], seed: int, index: int, n: int) -> list[torch.Tensor]:
    """`n` fixed noise tensors for one sample: from a CPU generator seeded by (seed, entry index)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + index) & (2**63 - 1))
    return [torch.randn(shape, generator=g, dtype=torch.float32) for _ in range(n)]


class Validator:
    def __init__(self, data, adapter, device: torch.device, dtype: torch.dtype, timesteps: list[float], seed: int,
                 guidance: float):
        self.data, self.adapter = data, adapter
        self.device, self.dtype = device, dtype
        self.timesteps, self.seed, self.guidance = list(timesteps), seed, guidance

    @classmethod
    def build(cls, cfg, data, adapter, device, dtype) -> Validator | None:
        val = getattr(data, "validation", None)
        if val is None or not cfg.train.validate_every:
            return None
        return cls(val, adapter, device, dtype, cfg.data.validation.timesteps, cfg.train.seed, cfg.model.guidance)

    def due(self, step: int, every: int) -> bool:
        return every > 0 and step % every == 0

    def __call__(self, transformer: torch.nn.Module, optimizer=None) -> dict[str, float]:
        was_training = transformer.training
        devices = [self.device] if self.device.type == "cuda" else []
        transformer.eval()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), eval_weights(optimizer):
                return self._score(transformer)
        finally:
            transformer.train(was_training)

    def _score(self, transformer) -> dict[str, float]:
        sums: dict[float, float] = defaultdict(float)
        counts: dict[float, int] = defaultdict(int)
        for b in self.data.batches():
            x0 = b.latents.to(self.device, torch.float32)
            # the picture's loss only: a second modality's latents (LTX-2's sound) are left out of the call
            text = {k: (v.to(self.device, dtype=self.dtype if v.is_floating_point() else v.dtype)
                        if isinstance(v, torch.Tensor) else v) for k, v in b.text.items()
                    if k not in getattr(self.adapter, "noised_streams", ())}
            noises = [_noise(tuple(x0.shape[1:]), self.seed, i, len(self.timesteps)) for i in b.index]
            for j, t_val in enumerate(self.timesteps):
                eps = torch.stack([n[j] for n in noises]).to(self.device)  # host-to-device, latent-sized
                t = torch.full((x0.shape[0],), t_val, dtype=torch.float32, device=self.device)
                tb = t.view(-1, *([1] * (x0.ndim - 1)))
                noised = Noised(noisy=((1.0 - tb) * x0 + tb * eps).to(self.dtype), t=t, target=eps - x0,
                                weight=loss_weights(t, "none"))
                pred = self.adapter.predict(transformer, noised.noisy, noised.t, text, guidance=self.guidance)
                loss = FlowMatching.loss(pred, noised, mask=b.mask)
                sums[t_val] += loss.item() * x0.shape[0]  # host-device sync (validation steps only)
                counts[t_val] += x0.shape[0]
                del pred, loss, noised
        per_t = {t: sums[t] / counts[t] for t in self.timesteps}
        out = {"val_loss": sum(per_t.values()) / len(per_t)}
        out.update({f"val_loss_t{t:g}": v for t, v in per_t.items()})
        return out
