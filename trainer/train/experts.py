"""`model.expert: both`: every expert of a family of experts (Wan 2.2 A14B: high_noise in `transformer/`, low_noise
in `transformer_2/`) trained in one run, each step training the expert that owns its timestep.

    method = method_for(cfg)             # ExpertsMethod for `both` (one LoRA method per expert), else method.py's
    check(cfg, adapter, dist)            # what `both` does not do yet, refused in one line before anything loads
    setup(trainer, resume_dir, streamed) # loads, adapts and streams each expert; the router, optimizer, objective

Which expert a step trains. The objective (objective.py, `split`) draws the step's first timestep as a one-model
run would, over the whole [0, 1]; the expert that owns it (WanPipeline's own test: t * 1000 >= boundary_ratio *
1000) is the step's, so each expert gets its share of the shifted-timestep distribution of the steps; the step's
other timesteps are redrawn until they fall to the same expert. A step's batch never mixes experts: one expert's
blocks run, and backward reaches only its LoRA.

What the loop calls. `ExpertRouter` is the one module the loop, validation and the planner's check see as "the
transformer": its forward hands the call to the expert that owns the `timestep` it is given (`adapter.expert_for`),
its parameters are both experts' (the optimizer, the checkpoint's NaN check and the EMA read them), and
`by_component` gives the sampler each expert for its pipeline slot.

The optimizer is one object over both LoRAs. On a step of the other expert a LoRA has no gradient, and torch's
AdamW, 8-bit AdamW and Adafactor skip a parameter without one (no step count, no moment decay, no weight decay),
unfused or in the fused back pass (which steps a parameter only when its gradient arrives): its weights and state
stay bitwise as they were. Prodigy and schedule-free AdamW keep numbers shared by every parameter of a group (the
step size estimate, the averaging weights), so one expert's steps would change the other's: refused. The schedule
is the run's (step k of the run has step k's rate, whichever expert it trains). The EMA, refused for now: unfused,
it moves every shadow every step, the other expert's too.

Streaming. Each expert has its own offload handle over its own blocks, at the run's fraction. Where there is a
second memory (a GPU; tests run the conductor's CPU ring), the handles are `parkable`: a forward pre-hook on each
expert parks the other one (its ring given back, its blocks on their pinned host bytes; trainer/offload/
conductor.py) and unparks this one; the parked expert's resident part (non-block weights, LoRA, the LoRA's
optimizer state) waits in CPU RAM too. So the GPU holds one expert's bytes and the planner counts one ring, one
LoRA, and both experts' host bytes. A switch moves the incoming expert's ring (its initial blocks) and resident
part, once per change of expert; consecutive steps of one expert move nothing extra. The activation offloader's pinned
buffers are shared by the two handles.

Where the idle expert waits (offload.park, `park_on_disk`): `ram` keeps its blocks in the pinned arena (and a
parking buffer for the blocks never streamed), so RAM holds both experts' blocks (Wan 2.2 A14B fp8 at 720p x 81:
64.0 GB RSS measured, bench/history/2026-11-27.md 18:50); `disk` frees them (the conductor's `park(disk=True)`:
the arena unregistered and freed, the block tensors hollow) and the switch reads the incoming expert's blocks again
from its safetensors files with the loader that built them, bitwise the same bytes, so RAM holds one expert's
blocks and the page cache the files; `auto` takes disk exactly where the planner's whole-run host-RAM peak
(the largest phase of `fit`, offloaded activations included) with the idle expert in RAM exceeds
offload.host_ram_gb (else this machine's physical RAM) and the peak with it on disk does not (`park_on_disk`:
the planner's own rule and numbers). The parked expert's LoRA and its AdamW moments stay in CPU RAM either way
(Wan 14B rank 16: 0.93 GB); its frozen non-block weights (embedders, 0.52 GB) too with ram, and with disk none:
they become placeholders and the switch reads them back from the files with the blocks. A switch ends with a heap
trim (stream_load.py `trim_heap`): the incoming expert's freed CPU copies, small tensors, would otherwise keep their
pages, so that RAM held both experts' LoRA and moments where the planner counts one. Each switch is timed (one
host-device sync) and logged, the first few and then every 100th: which expert came in, where the other went, the
seconds.

Files. A checkpoint holds both: `<step>/high_noise/adapter-state.safetensors` and `<step>/low_noise/...` beside
the one optimizer, data and generator state, so a resumed run is bitwise the uninterrupted one. The final LoRAs
are each expert's own, named as a run of that expert alone names them: `lora-high_noise.safetensors` and
`lora-low_noise.safetensors` (the per-step files `<name>-<expert>-step-N`), which diffusers loads as

    pipe.load_lora_weights("lora-high_noise.safetensors")
    pipe.load_lora_weights("lora-low_noise.safetensors", load_into_transformer_2=True)

Left out: full fine-tuning of both (LoRA only), several processes, the EMA.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from ..config import Config
from ..errors import UserError
from ..models.base import BOTH_EXPERTS
from ..models.stream_load import trim_heap
from ..offload import move_outside_blocks
from ..optim.specs import names_where, optimizer_spec
from . import streaming
from .method import method_for as one_method_for
from .monitor import say
from .objective import FlowMatching
from .optimizer import optimizer_for


def trains_both(cfg: Config) -> bool:
    return getattr(cfg.model, "expert", None) == BOTH_EXPERTS


def expert_config(cfg: Config, name: str) -> Config:
    """`cfg` as a run of expert `name` alone holds it (its folder, its LoRA file names)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"expert": name})})


def method_for(cfg: Config):
    """The training method: `ExpertsMethod` for model.expert: both, else method.py's LoRA or full."""
    if trains_both(cfg):
        from ..models import adapter_class

        return ExpertsMethod(cfg, tuple(adapter_class(cfg.model.family).experts))
    return one_method_for(cfg)


def check(cfg: Config, dist) -> None:
    """One line for what `both` does not do (yet), before anything loads."""
    why = None
    if cfg.train.method != "lora":
        why = "trains LoRAs only (train.method: lora); a full fine-tune trains one expert per run"
    elif not optimizer_spec(cfg.optimizer.name).owned_steps:  # each weight stepped from its own state alone
        why = (f"needs an optimizer that steps each weight from its own state ({', '.join(names_where('owned_steps'))}): "
               f"{cfg.optimizer.name} keeps numbers shared by both experts' weights")
    elif cfg.train.ema is not None:
        why = "has no EMA yet (train.ema: null), or train each expert in its own run"
    elif dist.active:
        why = "runs in one process (several processes: one expert per run)"
    if why is not None:
        raise UserError(f"model.expert: {BOTH_EXPERTS} {why}")


class ExpertsMethod:
    """LoRA for every expert: one LoraMethod per expert (bound to that expert's config, so its files carry its
    name), the protocol of method.py fanned out over them. Checkpoint files go into one subfolder per expert."""

    def __init__(self, cfg: Config, names: tuple[str, ...]):
        self.cfg = cfg
        self.by_expert = {n: one_method_for(expert_config(cfg, n)) for n in names}
        first = next(iter(self.by_expert.values()))
        self.name, self.streams_trainable, self.oom_hint = first.name, first.streams_trainable, first.oom_hint
        self.transformer: nn.Module | None = None  # the ExpertRouter, set by `setup`

    def storage(self) -> str:
        return next(iter(self.by_expert.values())).storage() + f" per expert ({', '.join(self.by_expert)})"

    def describe(self, params: list[torch.nn.Parameter]) -> str:
        return next(iter(self.by_expert.values())).describe(params) + f" over {len(self.by_expert)} experts"

    def same_start(self, dist, params) -> None:
        for m in self.by_expert.values():
            m.same_start(dist, params)

    def save_weights(self, folder: Path, step: int) -> None:
        for n, m in self.by_expert.items():
            (folder / n).mkdir(exist_ok=True)
            m.save_weights(folder / n, step)

    def load_weights(self, folder: Path) -> None:
        for n, m in self.by_expert.items():
            m.load_weights(folder / n)

    def final_output(self, out_dir: Path) -> Path:
        """The last expert's final LoRA, as `write_final` returns it (each expert writes its own: `finals`)."""
        return self.finals(out_dir)[-1]

    def finals(self, out_dir: Path) -> list[Path]:
        return [m.final_output(out_dir) for m in self.by_expert.values()]

    def write_final(self, out_dir: Path, checkpoint: Path) -> Path:
        """Each expert's LoRA from its checkpoint subfolder, as a run of that expert alone writes it; returns the
        last (the others are said here, the loop says it)."""
        paths = [m.write_final(out_dir, checkpoint / n) for n, m in self.by_expert.items()]
        for p in paths[:-1]:
            say(f"saved {p}")
        return paths[-1]

    def write_ema(self, out_dir: Path, step: int) -> Path:  # pragma: no cover - check() refuses train.ema
        return [m.write_ema(out_dir, step) for m in self.by_expert.values()][0]


class ExpertRouter(nn.Module):
    """Both experts as the one module the loop calls (see the module essay): each call goes to the expert that
    owns its `timestep`, which is also `last` (for the step's metrics)."""

    def __init__(self, adapter, experts: dict[str, nn.Module]):
        super().__init__()
        self.experts = nn.ModuleDict(experts)
        self._adapter = adapter
        self.last: str | None = None

    @property
    def by_component(self) -> dict[str, nn.Module]:
        """Pipeline component (transformer, transformer_2) -> the trained expert for it."""
        return {self._adapter.experts[n]: m for n, m in self.experts.items()}

    @property
    def config(self):
        return next(iter(self.experts.values())).config

    def forward(self, *args, **kwargs):
        self.last = name = self._adapter.expert_for(kwargs["timestep"])
        return self.experts[name](*args, **kwargs)


class ExpertHandles:
    """The experts' offload handles as the loop's one handle (sync, close, stats, checkpointed), and the switch: a
    forward pre-hook on each expert parks the others and unparks it (`parks`: handles built parkable). A parked
    expert's resident part goes to CPU RAM too: its non-block weights, its LoRA and that LoRA's optimizer state
    (`optimizer()`: the run's, or None before it exists), so the GPU holds one expert's bytes. Parked on disk
    (`disk`, with each expert's `loaders`), its frozen non-block weights hold no bytes either (`park_resident`):
    the switch reads them back from its files with the loader that built them, as it reads its blocks."""

    def __init__(self, handles: dict[str, object], models: dict[str, nn.Module], blocks: dict[str, list],
                 params: dict[str, list], parks: bool, device: torch.device, optimizer=lambda: None,
                 disk: bool = False, loaders: dict[str, object] | None = None):
        self.handles, self.models, self.blocks, self.params, self.parks = handles, models, blocks, params, parks
        self.device, self._optimizer, self.disk = device, optimizer, disk
        self.loaders = loaders or {}
        self.active: str | None = None
        self.switches = 0  # changes of expert (each moves the incoming expert's ring and resident part)
        self.switch_seconds = 0.0  # their wall time, in total (each ends with a host-device sync)
        first = next(iter(handles.values()))
        for h in list(handles.values())[1:]:
            h.share_activations(first)  # one pinned activation buffer: the experts run in turn
        self._hooks = [m.register_forward_pre_hook(lambda _m, _a, n=n: self.activate(n)) for n, m in models.items()]

    def activate(self, name: str) -> None:
        if not self.parks or self.active == name:
            return
        t0 = time.perf_counter()
        for n, h in self.handles.items():
            if n != name and not h.parked:
                h.park(self.disk)  # host-device sync; the ring freed for the next one (and the arena, on disk)
                self.place_resident(n, torch.device("cpu"), parked=True)
        self.place_resident(name, self.device)
        self.handles[name].unpark()  # parked on disk: its blocks read from its files first
        if self.active is None:
            self.active = name
            return
        trim_heap()  # the incoming expert's CPU copies (LoRA, moments) freed: their heap pages back to the OS
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # host-device sync, once per switch: the seconds logged are real
        dt = time.perf_counter() - t0
        self.switches += 1
        self.switch_seconds += dt
        if self.switches <= 3 or self.switches % 100 == 0:
            where = "parked on disk (its arena freed), this one's blocks read from its files" if self.disk else \
                "parked in RAM"
            say(f"experts: switch {self.switches}: {name} in, {self.active} {where}: {dt:.2f} s")
        self.active = name

    def place_resident(self, name: str, device: torch.device, parked: bool = False) -> None:
        opt = self._optimizer()
        loader = self.loaders.get(name) if self.disk else None
        place_resident(self.models[name], self.blocks[name], self.params[name], device,
                       getattr(opt, "state", {}) if opt is not None else {}, loader, parked)

    @property
    def plan(self):
        return next(iter(self.handles.values())).plan

    @property
    def checkpointed(self) -> list[bool]:
        return next(iter(self.handles.values())).checkpointed

    def stats(self) -> dict:
        """The running expert's handle's stats (the GPU holds only its ring), with every handle's pinned bytes."""
        every = [h.stats() for h in self.handles.values()]
        out = dict(every[0] if self.active is None else self.handles[self.active].stats())
        for k in ("pinned_bytes", "parking_pinned_bytes", "offloaded_bytes", "host_bytes"):
            out[k] = sum(s.get(k, 0) for s in every)
        out["park"] = "disk" if self.disk else "ram"
        out["switches"], out["switch_s"] = self.switches, self.switch_seconds / max(1, self.switches)
        return out

    def sync(self) -> None:
        for h in self.handles.values():
            h.sync()

    def release_activations(self) -> None:
        for h in self.handles.values():  # one shared offloader: the second call finds nothing to give back
            h.release_activations()

    def activations_retaken(self) -> tuple[int, float, bool] | None:
        """The shared activation offloader's last buffer taken again (OffloadHandle.activations_retaken)."""
        for h in self.handles.values():  # one offloader shared by every expert: the first answer is the one
            got = h.activations_retaken()
            if got is not None:
                return got
        return None

    def close(self, keep_weights: bool = True) -> None:
        for hook in self._hooks:
            hook.remove()
        if keep_weights:  # a parked-on-disk expert's frozen non-block weights: read back (the model is kept)
            for n, loader in self.loaders.items():
                if self.disk and loader is not None and self.handles[n].parked:
                    loader.place(self.models[n], torch.device("cpu"), skip=self.blocks[n])
        for h in reversed(list(self.handles.values())):  # the first last: the others share its activation buffers
            h.close(keep_weights)


def place_resident(model: nn.Module, blocks: list, params: list, device: torch.device, state: dict,
                   loader=None, parked: bool = False) -> None:
    """An expert's non-block weights, its LoRA (`params`) and that LoRA's optimizer `state` to `device`, the
    Parameter objects kept (the optimizer's keys hold). Copies of a few hundred MB per switch (Wan 14B: the time
    and text embedders, a rank-16 LoRA and its AdamW moments). With `loader` (stream_load.TransformerLoader, the
    expert parked on disk): `parked`, its frozen non-block weights become placeholders instead (no bytes: Wan
    14B's 0.52 GB); else they are read from its files first (the same values it loaded)."""
    if loader is not None and parked:
        loader.release(model, skip=blocks)  # frees them where they are (the GPU): nothing copied to the CPU
    elif loader is not None:
        loader.place(model, device, skip=blocks)  # placeholders read from the files; the rest moved as below
    move_outside_blocks(model, blocks, device)
    for p in params:
        if p.device != device:
            p.data = p.data.to(device)
        for k, v in state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != device:
                state[p][k] = v.to(device)  # AdamW's 0-dim step count stays where torch keeps it


def park_on_disk(cfg: Config, fill, fraction: float, block_bytes: int, experts: int,
                 peaks: dict[str, float] | None = None) -> tuple[bool, str]:
    """Whether the idle expert waits on disk (offload.park; see the module essay), and the line that says why.
    `fill`: the loader's (None where the transformer was loaded whole: nothing to read the blocks back from);
    auto decides by the planner's whole-run host-RAM peak with either park at transformer fraction `fraction`
    (`peaks`, bytes, {"ram": .., "disk": ..}; None: planner/phases.py `run_ram_peaks` of `cfg`), the rule the
    planner's own prediction uses (`auto_parks_on_disk`). Where no prediction can be made, the fallback is disk
    where both experts' blocks (`block_bytes` each, measured) and the process (HOST_BASE) exceed the RAM."""
    from ..planner.prediction import GB, HOST_BASE, auto_parks_on_disk, physical_ram

    mode = cfg.offload.park
    if mode == "ram":
        return False, "experts: offload.park: ram (both experts' blocks in CPU RAM)"
    if fill is None:
        if mode == "disk":
            raise UserError("offload.park: disk reads the idle expert's blocks back from its safetensors files, but "
                            "this transformer loads whole into RAM (stream_load.loads_whole: a single file whose "
                            "keys do not map, or DoRA): use offload.park: ram")
        return False, "experts: offload.park: auto -> ram (the transformer loads whole: no files to read back from)"
    if mode == "disk":
        return True, "experts: offload.park: disk (the idle expert's blocks read back from its files at a switch)"
    given = cfg.offload.host_ram_gb
    budget = given * GB if given is not None else physical_ram()
    where = f"{budget / GB:.1f} GB host RAM{'' if given is None else ' (offload.host_ram_gb)'}"
    if peaks is None:
        try:
            from ..planner import analyze
            from ..planner.phases import run_ram_peaks

            peaks = run_ram_peaks(cfg, fraction, analyze(cfg))
        except Exception as e:  # noqa: BLE001 - a prediction that cannot be made must never stop training
            need = experts * block_bytes + HOST_BASE
            disk = need > budget
            return disk, (f"experts: offload.park: auto -> {'disk' if disk else 'ram'} (no planner prediction: "
                          f"{type(e).__name__}; both experts' blocks + the process {need / GB:.1f} GB "
                          f"{'>' if disk else '<='} {where})")
    disk = auto_parks_on_disk(peaks, budget)
    return disk, (f"experts: offload.park: auto -> {'disk' if disk else 'ram'} (the run's predicted RAM peak "
                  f"{peaks['ram'] / GB:.1f} GB with the idle expert in RAM, {peaks['disk'] / GB:.1f} GB on disk; "
                  f"{where})")


def setup(tr, resume_dir: Path | None, streamed: bool) -> None:
    """The part of `Trainer.setup` from the transformer on, for model.expert: both: each expert loaded, adapted
    (its LoRA drawn from the training seed, as a run of it alone draws it) and streamed in turn, then the router,
    the one optimizer and the objective that draws each step's expert (see the module essay)."""
    cfg, c = tr.cfg, tr.cfg.train
    method: ExpertsMethod = tr.method
    if resume_dir is not None:
        tr._check_resumed_method(resume_dir)
    conduct = streaming.conducts(cfg, tr.fraction, tr._can_stream(), tr.device)
    parks = conduct and tr._can_stream()  # a second memory to park in (a GPU; tests: the conductor's CPU ring)
    shapes = len({e.bucket for e in getattr(tr.data, "entries", ())}) or 8
    models, params, handles, by_expert, block_lists, loaders = {}, [], {}, {}, {}, {}
    disk = None  # decided once the first expert's blocks are packed (park_on_disk)
    for name, m in method.by_expert.items():
        adapter = tr.adapter.for_expert(name)
        # parked or streamed: blocks read from the files into the ring and arena, never whole on the device
        model, loader = tr._load_transformer(expert_config(cfg, name), adapter, streamed or parks,
                                             resume_dir is not None)
        model.train()
        if (form := adapter.use_attention(model, c.attention, tr.device)) is not None and not models:
            say(form)
        torch.manual_seed(c.seed)  # each expert's LoRA as a run of it alone draws it
        p = m.trainable_params(model, adapter)
        if resume_dir is not None:
            m.load_weights(resume_dir / name)
        m.same_start(tr.dist, p)
        blocks = adapter.blocks(model)
        say(f"{name} ({adapter.transformer_dir}/): {m.describe(p)}, {len(blocks)} blocks"
            f"{f', {tr.fraction:g} of block bytes streamed from CPU RAM' if streamed else ''}")
        h = streaming.place_blocks(model, blocks, cfg, tr.device, tr.fraction, conduct, m, None, shapes,
                                   fill=loader and loader.fill, parkable=parks)
        if loader is not None:
            loader.close()
        models[name], handles[name], by_expert[name], block_lists[name] = model, h, p, blocks
        loaders[name] = loader  # its files read again at a switch when parked on disk (closed until then)
        params += p
        if h is not None and parks:  # the next expert's ring takes these bytes; the first step unparks the one it trains
            if disk is None:
                disk, why = park_on_disk(cfg, loader and loader.fill, tr.fraction, h.stats()["block_bytes"],
                                         len(method.by_expert))
                say(why)
            if disk and loader is None:  # this expert loaded whole: it cannot be read back (the first one could)
                raise UserError(f"offload.park: disk: the {name} expert loads whole into RAM; use offload.park: ram")
            h.park(disk)  # on disk: its arena freed before the next expert's is filled
            place_resident(model, blocks, p, torch.device("cpu"), {}, loader if disk else None, parked=True)
    tr.transformer = ExpertRouter(tr.adapter, models)
    method.transformer = tr.transformer
    tr.params = params
    tr.optim = optimizer_for(cfg, params, tr.dist, model=tr.transformer)
    tr.ema = None
    tr.offload = ExpertHandles(handles, models, block_lists, by_expert, parks, tr.device,
                               lambda: tr.optim.optimizer, disk=bool(disk), loaders=loaders) if conduct else None
    tr.objective = FlowMatching(c, tr.adapter.timestep_shift, vae_scale=tr.adapter.latent_scale,
                                split=tr.adapter.boundary_ratio)
    tr._finish_setup(resume_dir)
