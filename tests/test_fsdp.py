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


def test_fsdp_lora_on_2_and_4_processes_trains_like_one_and_resumes_across_world_sizes(
        tiny_models, images, tmp_path, one_thread):
    cache = tmp_path / "cache"
    ref = tmp_path / "ref"
    Trainer(_cfg(tiny_models, images, ref, cache)).fit()  # 1 process, grad_accum 4 (fsdp ignored); fills the cache
    ref_w = _weights(ref, "lora")

    two, four = tmp_path / "two", tmp_path / "four"
    (r0, r1) = _run_two([{"cfg": _cfg(tiny_models, images, two, cache, world=2).model_dump(mode="json")}], tmp_path)
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


def _fused(cfg):
    """`cfg` with the fused back pass (each shard steps in FSDP2's hook after its reduce-scatter)."""
    return cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"fused_back_pass": True})})


def test_fsdp_full_finetune_on_two_processes_trains_like_one(tiny_models, images, tmp_path, one_thread):
    """... and its EMA (train.ema, each process the EMA of its shards): the transformer-ema/ folder of one process;
    and with the fused back pass (grad_accum 1 on 2 processes against 1 process accumulating 2, unfused): the same
    weights, and the global gradient norm summed from the shards."""
    cache = tmp_path / "cache"
    ref, ref2 = tmp_path / "ref", tmp_path / "ref-accum-2"
    ema = {"decay": 0.5}  # far from 1, so that the EMA moves visibly in 2 steps
    Trainer(_cfg(tiny_models, images, ref, cache, "full", steps=2, checkpoint_every=0, ema=ema)).fit()
    c2 = _cfg(tiny_models, images, ref2, cache, "full", steps=2, checkpoint_every=0, grad_accum=2)
    Trainer(c2.model_copy(update={"optimizer": c2.optimizer.model_copy(update={"max_grad_norm": 1e9})})).fit()  # norm
    two, fused = tmp_path / "two", tmp_path / "fused"
    jobs = [{"cfg": _cfg(tiny_models, images, two, cache, "full", world=2, steps=2, checkpoint_every=0,
                         ema=ema).model_dump(mode="json")},
            {"cfg": _fused(_cfg(tiny_models, images, fused, cache, "full", world=4, steps=2,
                                checkpoint_every=0)).model_dump(mode="json")}]
    r0, r1 = _run_two(jobs, tmp_path)
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


def test_fsdp_keeps_ema_activation_offloading_and_nano_batches_like_one_process(tiny_models, images, tmp_path,
                                                                                 one_thread):
    """train.ema, offload.activations and offload.nano_batches under fsdp on 2 processes: the losses, LoRA and EMA
    of one process (which nano-batches too; it offloads activations only on a GPU), the checkpoints' ema.safetensors
    the file one process writes (each process reads its rows of it on resume). Activation offloading
    runs its CPU path (copies into an unpinned host arena and back) on every block input, as its byte count shows."""
    cache = tmp_path / "cache"

    def cfg(out, world):
        c = _cfg(tiny_models, images, out, cache, world=world, ema={"decay": 0.5})
        return c.model_copy(update={"offload": c.offload.model_copy(update={"activations": True, "nano_batches": 2})})

    ref, two, resumed = tmp_path / "ref", tmp_path / "two", tmp_path / "resumed-in-two"
    Trainer(cfg(ref, 1)).fit()
    jobs = [{"cfg": cfg(two, 2).model_dump(mode="json"), "stream": True,  # stream: a "GPU", so activations run
             "patch": {"trainer.train.sharded.ACTIVATION_MIN_BYTES": 0}},  # the tiny model's inputs count too
            {"cfg": cfg(resumed, 2).model_dump(mode="json"), "resume": str(two / "checkpoints" / "step-000002")}]
    results = _run_two(jobs, tmp_path)
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


def test_fsdp_schedule_free_and_prodigy_train_like_one_process_and_resume(tiny_models, images, tmp_path,
                                                                            one_thread):
    """optimizer.name adamw_schedulefree and prodigy on DTensor shards: the losses and LoRA of one process; their
    checkpoints (schedule-free's saved with the averaged weights swapped in; both keep step sizes and counts in
    the param groups, written beside the shards; Prodigy's p0 of a LoRA B is a scalar) resumed on one process
    end where the uninterrupted run did."""
    cache = tmp_path / "cache"
    names = {"adamw_schedulefree": {"scheduler": "constant", "warmup_steps": 0}, "prodigy": {"lr": 1.0}}

    def cfg(out, world, name):
        c = _cfg(tiny_models, images, out, cache, world=world)
        return c.model_copy(update={"optimizer": c.optimizer.model_copy(update={"name": name, **names[name]})})

    for n in names:
        Trainer(cfg(tmp_path / f"ref-{n}", 1, n)).fit()
    r0, r1 = _run_two([{"cfg": cfg(tmp_path / f"two-{n}", 2, n).model_dump(mode="json")} for n in names], tmp_path)
    assert all(i["error"] is None for i in r0 + r1), (r0, r1)
    for n in names:
        ref, two, resumed = (tmp_path / f"{o}-{n}" for o in ("ref", "two", "resumed"))
        assert losses(two) == pytest.approx(losses(ref), rel=1e-5)
        _close(_weights(two, "lora"), _weights(ref, "lora"))
        Trainer(cfg(resumed, 1, n), resume=str(two / "checkpoints" / "step-000002")).fit()
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


def test_fsdp_samples_and_validates_during_training_like_one_process(tiny_models, images, tmp_path, one_thread):
    """Rank 0 samples and scores the held-out image while the other rank joins each transformer call
    (sharded.Lockstep): the images and validation losses of one process, to fp32 rounding."""
    import numpy as np
    from PIL import Image

    def cfg(out, world):
        c = make_config(
            tiny_models, images, out, tmp_path / "cache", "flux", "lora",
            train={"steps": 2, "batch_size": 1, "grad_accum": 2 // world, "distributed": "fsdp", "validate_every": 0},
            optimizer={"fused_back_pass": False},
            sample={"every": 2, "prompts": ["a red square", "a blue disc"], "steps": 2, "width": 64, "height": 64})
        d = c.model_dump(mode="json")  # `data` is make_config's own argument: set the held-out share here
        d["data"]["validation"] = {"fraction": 0.25}
        d["train"]["validate_every"] = 2
        return type(c).model_validate(d)

    ref, two = tmp_path / "ref", tmp_path / "two"
    Trainer(cfg(ref, 1)).fit()
    r0, r1 = _run_two([{"cfg": cfg(two, 2).model_dump(mode="json")}], tmp_path)
    assert r0[0]["error"] is None and r1[0]["error"] is None, (r0, r1)
    assert (r0[0]["sampler"], r1[0]["sampler"]) == (True, False)

    def val(out):
        return [json.loads(line)["val_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                if "val_loss" in line]

    assert val(two) and val(two) == pytest.approx(val(ref), rel=1e-4)
    for i in range(2):
        a, b = (np.asarray(Image.open(o / "samples" / f"step-000002-{i}.png"), dtype=np.int16) for o in (ref, two))
        assert np.abs(a - b).max() <= 2  # 8-bit pixels of the same latents, to rounding
