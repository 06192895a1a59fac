"""The flow-matching objective shared by Flux, SD3 and Qwen-Image.

How. A clean latent x0 and Gaussian noise eps are mixed along a straight line, x_t = (1 - t) x0 + t eps, with
t in (0, 1) (1 = pure noise). The transformer predicts the velocity of that line, eps - x0, and the loss is the
mean squared error to it, optionally weighted per timestep. Which t are trained matters more than anything
else here: the SD3 paper's logit-normal density puts most samples in the middle of the path, "mode" is its
heavier-tailed alternative, and every family shifts t towards noise for larger images (s t / (1 + (s - 1) t),
with s from the adapter when `train.shift: auto`), because more pixels keep more signal at the same t.

Why a separate generator. Noise and timesteps come from one seeded CPU `torch.Generator` owned by this object,
never from the global RNG: its state is saved in every checkpoint, so a resumed run draws exactly the noise the
uninterrupted run would have drawn, and the numbers do not depend on the device (CUDA's generator would give
other noise than the CPU's for the same seed). Drawing on the CPU costs one small host-to-device copy per
step (a latent's size; 1 MiB at 1024x1024), which is nothing next to a transformer step.

Two experts in one run (`model.expert: both`, trainer/train/experts.py). With `split` (the pipeline's boundary as
a flow time) a step must train one expert, so its timesteps must all fall on one side of it. The step's first
draw, made exactly as a one-model run makes it, picks the side: so each expert is trained on a share of the steps
equal to its share of the shifted-timestep distribution, whatever the sampling, shift and bucket. Every further
draw of the step (the rest of the batch, the other micro-batches) is drawn again until it falls on that side
(rejection sampling: exactly the distribution conditioned on the expert). Each t then has the one-model run's
distribution, and all of it comes from this generator, so it is fixed by the seed and resumes bitwise.
`start_step` opens a step; `side` says the expert it drew (True: t at or above the split, the high-noise one).

A second modality (LTX-2's sound: `ModelAdapter.noised_streams`). Its clean latents ride in the batch's text dict;
`noise(..., streams=)` mixes each with its own Gaussian noise at the picture's t (one t for both, as Lightricks'
trainer draws it and as the pipeline steps both with one schedule), and `loss` adds its mean squared error per
sample, times `train.audio_loss_weight`, to the picture's before the timestep weighting (Lightricks' trainer: the
sum, weight 1). Its noise comes from a generator seeded by (seed, batch position, key), not from this object's:
the picture's draws stay what they are without it, several processes need no shapes of each other's sound, and a
resumed run draws the same noise.

Left out. Per-family input packing and positions are the adapter's (`predict`); so is Flux's guidance
embedding (the guidance value is passed through). Min-SNR or debiased weightings of epsilon-prediction models
do not apply to a velocity target and are not offered.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from ..config import TrainConfig

#: pixels per latent side when the caller names none (the family's `latent_scale` otherwise)
VAE_SCALE = 8


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Resolution shift t' = s t / (1 + (s - 1) t); s = 1 leaves t unchanged."""
    if shift == 1.0:
        return t
    return shift * t / (1.0 + (shift - 1.0) * t)


def loss_weights(t: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sample loss weights for sigma = t (the formulas of the SD3 paper as diffusers implements them)."""
    if weighting == "none":
        return torch.ones_like(t)
    if weighting == "sigma_sqrt":
        return t.clamp_min(1e-4) ** -2.0
    if weighting == "cosmap":
        bot = 1.0 - 2.0 * t + 2.0 * t**2
        return 2.0 / (math.pi * bot)
    raise ValueError(f"unknown loss weighting {weighting!r}")


@dataclass
class Noised:
    """One batch prepared for the transformer."""

    noisy: torch.Tensor  #: x_t, the transformer input, in the model's dtype, on the latents' device
    t: torch.Tensor  #: (B,) fp32 flow time (after the shift), on the latents' device
    target: torch.Tensor  #: eps - x0 in fp32
    weight: torch.Tensor  #: (B,) fp32 loss weights
    #: a second modality's latents (module essay), by its key in the text dict, noised at the same t
    streams: dict[str, Noised] = field(default_factory=dict)


class FlowMatching:
    """Samples timesteps and noise from its own generator and computes the weighted velocity loss."""

    def __init__(self, cfg: TrainConfig, shift_fn=None, seed: int | None = None, vae_scale: int = VAE_SCALE,
                 t_range: tuple[float, float] = (0.0, 1.0), split: float | None = None):
        """`shift_fn(height_px, width_px) -> s` is the adapter's `timestep_shift`, used when `cfg.shift` is
        auto; `vae_scale` (the family's `latent_scale`) turns latent sides back into pixels for it. `seed`
        defaults to the training seed. `t_range` (the adapter's `train_timesteps`: one expert's share of the
        flow times) maps each shifted t linearly into [low, high]; (0, 1) leaves it as it is. `split`: two experts
        in one run, split at this flow time (see the module essay)."""
        self.cfg = cfg
        self.t_range = (float(t_range[0]), float(t_range[1]))
        self.split = split
        self.side: bool | None = None  # with `split`: the step's expert (True: t at or above it), once drawn
        self._shift_fn = shift_fn
        self._vae_scale = vae_scale
        self.seed = cfg.seed if seed is None else seed
        self.generator = torch.Generator("cpu")
        self.generator.manual_seed(self.seed)

    # -- state (saved in checkpoints as a uint8 tensor) ------------------------------------------------------

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    # -- sampling --------------------------------------------------------------------------------------------

    def shift_for(self, latents: torch.Tensor) -> float:
        if self.cfg.shift != "auto":
            return float(self.cfg.shift)
        if self._shift_fn is None:
            return 1.0
        h, w = latents.shape[-2] * self._vae_scale, latents.shape[-1] * self._vae_scale
        return float(self._shift_fn(h, w))

    def sample_t(self, n: int) -> torch.Tensor:
        """(n,) fp32 timesteps on the CPU, before the shift."""
        g, c = self.generator, self.cfg
        if c.timestep_sampling == "uniform":
            u = torch.rand(n, generator=g)
        elif c.timestep_sampling == "logit_normal":
            u = torch.sigmoid(torch.randn(n, generator=g) * c.logit_std + c.logit_mean)
        elif c.timestep_sampling == "mode":
            u = torch.rand(n, generator=g)
            u = 1.0 - u - c.mode_scale * (torch.cos(math.pi * u / 2.0) ** 2 - 1.0 + u)
        else:  # pragma: no cover - the config's Literal rules this out
            raise ValueError(c.timestep_sampling)
        return u.clamp(0.0, 1.0)

    def noise(self, x0: torch.Tensor, dtype: torch.dtype | None = None,
              streams: dict[str, torch.Tensor] | None = None, position: int = 0) -> Noised:
        """Draw t and eps for a batch of clean latents (B, C, h, w) and build x_t (cast to `dtype`, default the
        latents' dtype) and the fp32 target; `streams`: a second modality's clean latents by key, noised at the same
        t with noise of the batch `position` (module essay)."""
        b = x0.shape[0]
        t = shift_timesteps(self.sample_t(b), self.shift_for(x0))
        if self.split is not None:
            t = self._one_side(t, self.shift_for(x0))
        lo, hi = self.t_range
        if (lo, hi) != (0.0, 1.0):  # an expert's timesteps (Wan 2.2 A14B: t >= boundary, or t < boundary)
            t = lo + (hi - lo) * t
        eps = torch.randn(x0.shape, generator=self.generator, dtype=torch.float32)
        # Host-to-device copies of t and eps (small; see the module essay). The mix is done in fp32 and only the
        # transformer input is cast to the model's dtype.
        dev = x0.device
        t, eps = t.to(dev), eps.to(dev)
        x0f = x0.float()
        tb = t.view(-1, *([1] * (x0.ndim - 1)))
        noisy = (1.0 - tb) * x0f + tb * eps
        out = Noised(
            noisy=noisy.to(dtype or x0.dtype),
            t=t,
            target=eps - x0f,
            weight=loss_weights(t, self.cfg.loss_weighting),
        )
        for key, clean in sorted((streams or {}).items()):
            out.streams[key] = self._stream(key, clean, out, dtype, position)
        return out

    def _stream(self, key: str, clean: torch.Tensor, main: Noised, dtype, position: int) -> Noised:
        """`clean` noised at `main`'s t with its own noise (module essay), weighted by train.audio_loss_weight."""
        digest = hashlib.sha256(f"{self.seed}|{position}|{key}".encode()).digest()
        g = torch.Generator("cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        eps = torch.randn(clean.shape, generator=g, dtype=torch.float32).to(clean.device)  # host-to-device, small
        x0 = clean.float()
        tb = main.t.view(-1, *([1] * (x0.ndim - 1)))
        return Noised(noisy=((1.0 - tb) * x0 + tb * eps).to(dtype or clean.dtype), t=main.t, target=eps - x0,
                      weight=main.weight * float(self.cfg.audio_loss_weight))

    def start_step(self) -> None:
        """A new optimizer step: its first draw picks the side of `split` (the expert) again."""
        self.side = None

    def _high(self, t: torch.Tensor) -> torch.Tensor:
        """Per t: at or above the split, compared as the pipeline compares its timesteps (t * 1000 in fp32, which
        is what `predict` hands the transformer: the expert the router picks is the one drawn here)."""
        return t.float() * 1000.0 >= self.split * 1000.0

    def _one_side(self, t: torch.Tensor, shift: float, tries: int = 10_000) -> torch.Tensor:
        """`t` with every draw on the step's side of `split` (the first draw of the step picks it): the others
        drawn again, one at a time, until they fall there (see the module essay)."""
        high = self._high(t)
        if self.side is None:
            self.side = bool(high[0])
        for i in range(t.shape[0]):
            for _ in range(tries):
                if bool(high[i]) == self.side:
                    break
                t[i] = shift_timesteps(self.sample_t(1), shift)[0]
                high[i] = self._high(t[i : i + 1])[0]
            else:  # a side drawn this rarely is left at the split itself (its edge): bounded work per step
                t[i] = self.split if self.side else self.split * (1.0 - 1e-6)
        return t

    @staticmethod
    def loss(pred: torch.Tensor, noised: Noised, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted mean squared error, fp32, a scalar.

        `mask`: optional (B, 1, h, w) per-latent-cell weights (data.masked_loss), broadcast over the channels. The
        error is multiplied by it before the mean, not renormalised by its sum: a cell keeps the weight it has
        without a mask, and an image with a small mask contributes less (a weight of 1 everywhere is exactly the
        unmasked loss). Predictions are in the (B, C, h, w) latent layout for every family (the adapters unpack
        Flux's and Qwen-Image's 2x2 tokens in `predict`), so the mask needs no packing.

        `pred` may be (prediction, {key: a second modality's prediction}) (`Noised.streams`): each adds its own
        per-sample mean squared error at its weight (module essay)."""
        pred, more = pred if isinstance(pred, tuple) else (pred, {})
        err = (pred.float() - noised.target).pow(2)
        if mask is not None:
            err = err * mask.to(err.device, torch.float32, non_blocking=True)  # host-to-device copy, latent-sized / C
        total = err.flatten(1).mean(1) * noised.weight
        for key, p in more.items():
            s = noised.streams[key]
            total = total + (p.float() - s.target).pow(2).flatten(1).mean(1) * s.weight
        return total.mean()
