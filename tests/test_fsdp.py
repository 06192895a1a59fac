"""train.distributed: fsdp (trainer/train/sharded.py) with 2 and 4 CPU processes over gloo, on the tiny Flux.

N processes at batch 1 and grad_accum 4/N train the same global batches, with the same noise, as 1 process at
grad_accum 4; FSDP2 reduce-scatters and averages the gradients in another order than one process sums them, so
losses and weights agree to fp32 rounding, not bitwise. Checkpoints (weights gathered to rank 0, optimizer state
sharded through torch.distributed.checkpoint's safetensors writer) resume on another number of processes, and a
two-"node" torchrun on localhost trains through the CLI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from test_distributed import _run_two, _weights
from test_train_support import losses, make_config

from trainer.errors import ConfigError
from trainer.train import checkpoint as ck
from trainer.train.trainer import Trainer


def _cfg(models, images, out, cache, method="lora", world=1, distributed="fsdp", **train):
    """Global batch 4: `world` processes x batch 1 x grad_accum 4/world; clipping on for LoRA (the global norm
    of the sharded gradients)."""
    return make_config(
        models, images, out, cache, "flux", method,
        train={"steps": 4, "batch_size": 1, "grad_accum": 4 // world, "checkpoint_every": 2, "keep_checkpoints": 3,
               "distributed": distributed, **train},
        optimizer={"scheduler": "cosine", "warmup_steps": 1, "weight_decay": 0.01, "fused_back_pass": False,
                   "max_grad_norm": 0.05 if method == "lora" else None},
    )


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from test_train_support import write_images

    return write_images(tmp_path_factory.mktemp("fsdp-images"))


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fused(cfg):
    """`cfg` with the fused back pass (each shard steps in FSDP2's hook after its reduce-scatter)."""
    return cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"fused_back_pass": True})})


_EMA = {"decay": 0.5}  # far from 1, so that the EMA moves visibly in 2 steps
_OPTIMIZERS = {"adamw_schedulefree": {"scheduler": "constant", "warmup_steps": 0}, "prodigy": {"lr": 1.0}}


def _ema_act_cfg(models, images, out, cache, world):
    c = _cfg(models, images, out, cache, world=world, ema=_EMA)
    return c.model_copy(update={"offload": c.offload.model_copy(update={"activations": True, "nano_batches": 2})})


def _optim_cfg(models, images, out, cache, world, name):
    c = _cfg(models, images, out, cache, world=world)
    return c.model_copy(update={"optimizer": c.optimizer.model_copy(update={"name": name, **_OPTIMIZERS[name]})})


def _sample_cfg(models, images, out, cache, world):
    c = make_config(
        models, images, out, cache, "flux", "lora",
        train={"steps": 2, "batch_size": 1, "grad_accum": 2 // world, "distributed": "fsdp", "validate_every": 0},
        optimizer={"fused_back_pass": False},
        sample={"every": 2, "prompts": ["a red square", "a blue disc"], "steps": 2, "width": 64, "height": 64})
    d = c.model_dump(mode="json")  # `data` is make_config's own argument: set the held-out share here
    d["data"]["validation"] = {"fraction": 0.25}
    d["train"]["validate_every"] = 2
    return type(c).model_validate(d)


@pytest.fixture(scope="module")
def launched(tiny_models, images, once_per_session):
    """The 2-process runs of the tests below in one launch, once in the session (`once_per_session`: xdist may
    spread the tests over workers): their 1-process references first (each filling its test's data cache, as the
    2-process jobs then find it), then every 2-process job of theirs in the same two processes, one after another
    (a launch imports torch and diffusers in both processes and loads the model: ~10-20 s of 2 cores). The
    activation-offloading jobs run last: they patch the trainer for the rest of the process. -> {test: (its
    folder, rank 0's results, rank 1's)}, and "models" / "images": the tiny models and images it used (another
    worker's), for the tests' own runs beside it."""
    out = once_per_session("fsdp-launch", lambda root: _launch(tiny_models, images, root))
    return {k: Path(v) if isinstance(v, str) else (Path(v[0]), v[1], v[2]) for k, v in out.items()}


def _launch(tiny_models, images, root: Path) -> dict:
    lora, full, act, opt, smp = (root / n for n in ("lora", "full", "act", "optim", "sample"))
    m, im = tiny_models, images
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(_cfg(m, im, lora / "ref", lora / "cache")).fit()  # 1 process, grad_accum 4 (fsdp ignored)
        Trainer(_cfg(m, im, full / "ref", full / "cache", "full", steps=2, checkpoint_every=0, ema=_EMA)).fit()
        c2 = _cfg(m, im, full / "ref-accum-2", full / "cache", "full", steps=2, checkpoint_every=0, grad_accum=2)
        Trainer(c2.model_copy(update={"optimizer": c2.optimizer.model_copy(update={"max_grad_norm": 1e9})})).fit()
        Trainer(_ema_act_cfg(m, im, act / "ref", act / "cache", 1)).fit()
        for n in _OPTIMIZERS:
            Trainer(_optim_cfg(m, im, opt / f"ref-{n}", opt / "cache", 1, n)).fit()
        Trainer(_sample_cfg(m, im, smp / "ref", smp / "cache", 1)).fit()
    finally:
        torch.set_num_threads(before)
    jobs = {
        "lora": [{"cfg": _cfg(m, im, lora / "two", lora / "cache", world=2).model_dump(mode="json")}],
        "full": [{"cfg": _cfg(m, im, full / "two", full / "cache", "full", world=2, steps=2, checkpoint_every=0,
                              ema=_EMA).model_dump(mode="json")},
                 {"cfg": _fused(_cfg(m, im, full / "fused", full / "cache", "full", world=4, steps=2,
                                     checkpoint_every=0)).model_dump(mode="json")}],
        "optim": [{"cfg": _optim_cfg(m, im, opt / f"two-{n}", opt / "cache", 2, n).model_dump(mode="json")}
                  for n in _OPTIMIZERS],
        "sample": [{"cfg": _sample_cfg(m, im, smp / "two", smp / "cache", 2).model_dump(mode="json")}],
        "act": [{"cfg": _ema_act_cfg(m, im, act / "two", act / "cache", 2).model_dump(mode="json"),
                 "stream": True,  # stream: a "GPU", so activations run
                 "patch": {"trainer.train.sharded.ACTIVATION_MIN_BYTES": 0}},  # the tiny model's inputs count too
                {"cfg": _ema_act_cfg(m, im, act / "resumed-in-two", act / "cache", 2).model_dump(mode="json"),
                 "resume": str(act / "two" / "checkpoints" / "step-000002")}],
    }
    r0, r1 = _run_two([j for js in jobs.values() for j in js], root, timeout=900)
    dirs = {"lora": lora, "full": full, "act": act, "optim": opt, "sample": smp}
    out, i = {"models": str(tiny_models), "images": str(images)}, 0
    for name, js in jobs.items():
        out[name] = (str(dirs[name]), r0[i:i + len(js)], r1[i:i + len(js)])
        i += len(js)
    return out


def test_fsdp_lora_on_2_and_4_processes_trains_like_one_and_resumes_across_world_sizes(launched, tmp_path,
                                                                                          one_thread):
    root, r0, r1 = launched["lora"]
    tiny_models, images = launched["models"], launched["images"]  # those of the launch's references
    cache, ref = root / "cache", root / "ref"  # 1 process, grad_accum 4 (fsdp ignored); filled the cache
    ref_w = _weights(ref, "lora")

    two, four = root / "two", tmp_path / "four"
    assert r0[0]["error"] is None and r1[0]["error"] is None, (r0, r1)
    assert (r0[0]["monitor"], r1[0]["monitor"], r0[0]["buckets"]) == (True, False, 0)  # FSDP2 averages, no buckets
    assert losses(two) == pytest.approx(losses(ref), rel=1e-5)
    _close(_weights(two, "lora"), ref_w)
    # The checkpoint: the LoRA file a one-process run writes, and the optimizer state as safetensors shards.
    step2 = two / "checkpoints" / "step-000002"
    shards = sorted((step2 / "optimizer").rglob("*.safetensors"))
    assert len(shards) == 2 and not (step2 / "optimizer.safetensors").exists()
    with safe_open(str(shards[0]), "pt") as f:
        assert any(k.endswith("/exp_avg") for k in f.keys())  # noqa: SIM118 - safe_open has no __iter__
    assert not [p for p in (two / "checkpoints").iterdir() if p.name.startswith(".")]

    # 4 processes; and the 2-process checkpoint at step 2 resumed on 4 ends where the 1-process run did.
    resumed4 = tmp_path / "resumed-in-four"
    jobs = [{"cfg": _cfg(tiny_models, images, four, cache, world=4).model_dump(mode="json")},
            {"cfg": _cfg(tiny_models, images, resumed4, cache, world=4).model_dump(mode="json"),
             "resume": str(step2)}]
    results = _run_two(jobs, tmp_path, world=4, timeout=600)
    assert all(i["error"] is None for r in results for i in r), results
    assert losses(four) == pytest.approx(losses(ref), rel=1e-5)
    _close(_weights(four, "lora"), ref_w)
    _close(_weights(resumed4, "lora"), ref_w)
    assert losses(resumed4) == pytest.approx(losses(ref)[2:], rel=1e-5)

    # ... and on one process (no process group: the shards are read back whole).
    resumed1 = tmp_path / "resumed-in-one"
    Trainer(_cfg(tiny_models, images, resumed1, cache), resume=str(step2)).fit()
    _close(_weights(resumed1, "lora"), ref_w)


def test_fsdp_full_finetune_on_two_processes_trains_like_one(launched):
    """... and its EMA (train.ema, each process the EMA of its shards): the transformer-ema/ folder of one process;
    and with the fused back pass (grad_accum 1 on 2 processes against 1 process accumulating 2, unfused): the same
    weights, and the global gradient norm summed from the shards."""
    tmp, r0, r1 = launched["full"]  # ref: 1 process with the EMA; ref-accum-2: accumulating 2, unfused
    ref, ref2, two, fused = tmp / "ref", tmp / "ref-accum-2", tmp / "two", tmp / "fused"
    assert all(i["error"] is None for i in r0 + r1), (r0, r1)
    assert losses(two) == pytest.approx(losses(ref), rel=1e-5)
    assert losses(fused) == pytest.approx(losses(ref2), rel=1e-5)
    _close(_weights(fused, "full"), _weights(ref2, "full"))
    norms = [[json.loads(line)["grad_norm"] for line in (o / "metrics.jsonl").read_text().splitlines()]
             for o in (fused, ref2)]
    assert None not in norms[0] and norms[0] == pytest.approx(norms[1], rel=1e-5)
    _close(_weights(two, "full"), _weights(ref, "full"))  # every weight, gathered from the shards
    ema_two, ema_ref = (_weights(o, "full", "transformer-ema") for o in (two, ref))
    _close(ema_two, ema_ref)
    trained = _weights(two, "full")
    assert any(not torch.equal(ema_two[k], trained[k]) for k in trained)  # the EMA, not the trained weights


def test_fsdp_keeps_ema_activation_offloading_and_nano_batches_like_one_process(launched):
    """train.ema, offload.activations and offload.nano_batches under fsdp on 2 processes: the losses, LoRA and EMA
    of one process (which nano-batches too; it offloads activations only on a GPU), the checkpoints' ema.safetensors
    the file one process writes (each process reads its rows of it on resume). Activation offloading
    runs its CPU path (copies into an unpinned host arena and back) on every block input, as its byte count shows."""
    tmp, r0, r1 = launched["act"]  # ema decay 0.5, offload.activations, nano_batches 2: `_ema_act_cfg`
    ref, two, resumed = tmp / "ref", tmp / "two", tmp / "resumed-in-two"
    results = [r0, r1]
    assert all(i["error"] is None for r in results for i in r), results
    assert all(r[0]["offloaded_activation_bytes"] > 0 and r[0]["nano_mlps"] > 0 for r in results), results
    assert losses(two) == pytest.approx(losses(ref), rel=1e-5)
    _close(_weights(two, "lora"), _weights(ref, "lora"))
    ema_ref = load_file(str(ref / "lora-ema.safetensors"))
    _close(load_file(str(two / "lora-ema.safetensors")), ema_ref)
    assert any(not torch.equal(ema_ref[k], v) for k, v in load_file(str(ref / "lora.safetensors")).items())
    for step in ("step-000002", "step-000004"):  # what one process writes: same names, values and header
        files = [two / "checkpoints" / step / "ema.safetensors", ref / "checkpoints" / step / "ema.safetensors"]
        _close(*(load_file(str(f)) for f in files))
        metas = []
        for f in files:
            with safe_open(str(f), "pt") as sf:
                metas.append(sf.metadata())
        assert metas[0] == metas[1]
    assert losses(resumed) == pytest.approx(losses(ref)[2:], rel=1e-5)
    _close(load_file(str(resumed / "lora-ema.safetensors")), ema_ref)


def test_fsdp_schedule_free_and_prodigy_train_like_one_process_and_resume(launched, one_thread):
    """optimizer.name adamw_schedulefree and prodigy on DTensor shards: the losses and LoRA of one process; their
    checkpoints (schedule-free's saved with the averaged weights swapped in; both keep step sizes and counts in
    the param groups, written beside the shards; Prodigy's p0 of a LoRA B is a scalar) resumed on one process
    end where the uninterrupted run did."""
    tmp, r0, r1 = launched["optim"]
    tiny_models, images = launched["models"], launched["images"]  # those of the launch's references
    assert all(i["error"] is None for i in r0 + r1), (r0, r1)
    for n in _OPTIMIZERS:
        ref, two, resumed = (tmp / f"{o}-{n}" for o in ("ref", "two", "resumed"))
        assert losses(two) == pytest.approx(losses(ref), rel=1e-5)
        _close(_weights(two, "lora"), _weights(ref, "lora"))
        Trainer(_optim_cfg(tiny_models, images, resumed, tmp / "cache", 1, n),
                resume=str(two / "checkpoints" / "step-000002")).fit()
        assert losses(resumed) == pytest.approx(losses(ref)[2:], rel=1e-5)
        _close(_weights(resumed, "lora"), _weights(ref, "lora"))


def test_fsdp_refuses_what_it_does_not_do_in_one_line(tiny_models, images, tmp_path):
    with pytest.raises((ConfigError, ValueError)) as e:
        make_config(tiny_models, images, tmp_path / "o", tmp_path / "c", "flux", "full",
                    train={"distributed": "fsdp"}, offload={"transformer": "auto", "vram_budget_gb": 20},
                    optimizer={"name": "adafactor", "max_grad_norm": None})
    msg = str(e.value)
    assert "train.distributed: fsdp needs" in msg and "optimizer.name: adamw, " in msg and "offload.transformer" in msg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_torchrun_on_localhost_trains_through_the_cli(tiny_models, images, tmp_path):
    """`torchrun --nnodes 2` twice on one host (one process per "node", c10d rendezvous), as docs/multi-gpu.md's
    two-host example runs it: the run ends on both nodes with one LoRA written by node 0's rank 0."""
    out, cache = tmp_path / "out", tmp_path / "cache"
    cfg = _cfg(tiny_models, images, out, cache, world=2, steps=2, checkpoint_every=0)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
         "--node_rank", str(n), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
         "--rdzv_id", "dittrain-test", "-m", "trainer", "fit", str(path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two-node run hung")
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    assert "sharded (fsdp)" in logs[0] and (out / "lora.safetensors").is_file()
    assert len(losses(out)) == 2
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [2]


def test_config_error_names_the_fsdp_key(tiny_models, images, tmp_path):
    with pytest.raises((ConfigError, ValueError)) as e:
        make_config(tiny_models, images, tmp_path / "o", tmp_path / "c", "flux", "lora",
                    train={"distributed": "zero3"})
    assert "distributed" in str(e.value)


def test_sharded_transformer_folder_is_written_file_by_file_and_loads_in_diffusers(tiny_models, tmp_path, monkeypatch):
    """sharded.save_transformer (a full fine-tune's weights under fsdp) on a one-process gloo group: several
    safetensors files with their index, which diffusers' from_pretrained reads back to the same weights, in the
    model dtype even from fp32 master shards."""
    import torch.distributed as tdist
    from diffusers import FluxTransformer2DModel

    from trainer.train import sharded

    ref = FluxTransformer2DModel.from_pretrained(tiny_models / "flux" / "transformer", torch_dtype=torch.bfloat16)
    model = FluxTransformer2DModel.from_pretrained(tiny_models / "flux" / "transformer", torch_dtype=torch.bfloat16)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model.requires_grad_(True)
        sharded.shard(model, list(model.transformer_blocks) + list(model.single_transformer_blocks),
                      torch.device("cpu"), offload=False, checkpointed=False, compile=False, master=torch.float32)
        monkeypatch.setattr(sharded, "FILE_BYTES", 20_000)
        sharded.save_transformer(model, tmp_path / "transformer", True, torch.bfloat16)
    finally:
        tdist.destroy_process_group()
    files = sorted((tmp_path / "transformer").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    dtypes = set()
    for f in files:
        with safe_open(str(f), "pt") as sf:
            dtypes |= {sf.get_slice(k).get_dtype() for k in sf.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}  # the fp32 master shards saved in the model dtype
    back = FluxTransformer2DModel.from_pretrained(tmp_path / "transformer", torch_dtype=torch.bfloat16)
    got, want = back.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    bad = [(k, got[k].dtype, want[k].dtype) for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, bad[:5]


def test_fsdp_samples_and_validates_during_training_like_one_process(launched):
    """Rank 0 samples and scores the held-out image while the other rank joins each transformer call
    (sharded.Lockstep): the images and validation losses of one process, to fp32 rounding."""
    import numpy as np
    from PIL import Image

    tmp, r0, r1 = launched["sample"]  # `_sample_cfg`: 2 prompts sampled and a held-out quarter scored at step 2
    ref, two = tmp / "ref", tmp / "two"
    assert r0[0]["error"] is None and r1[0]["error"] is None, (r0, r1)
    assert (r0[0]["sampler"], r1[0]["sampler"]) == (True, False)

    def val(out):
        return [json.loads(line)["val_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                if "val_loss" in line]

    assert val(two) and val(two) == pytest.approx(val(ref), rel=1e-4)
    for i in range(2):
        a, b = (np.asarray(Image.open(o / "samples" / f"step-000002-{i}.png"), dtype=np.int16) for o in (ref, two))
        assert np.abs(a - b).max() <= 2  # 8-bit pixels of the same latents, to rounding
