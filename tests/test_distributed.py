"""Data-parallel training (trainer/train/distributed.py) with two CPU processes over gloo, on the tiny Flux.

2 processes at batch 1 train the same global batch sequence, with the same noise, as 1 process at batch 1 with
grad_accum 2, so the weights must be bitwise equal in fp32: LoRA (bucketed all-reduce before clipping, blocks
streamed through the conductor's CPU path) and full fine-tuning (all-reduce inside the fused back pass, against
the unfused reference). Checkpoints cross world sizes both ways. Rank 0 alone writes; Ctrl-C and a non-finite
loss on one rank stop both at the same step.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train_support import losses, make_config, write_images

from trainer.train import checkpoint as ck
from trainer.train.trainer import Trainer

WORLD = 2


def _cfg(models, images, out, cache, method="lora", world=1, **train):
    """Global batch 2: `world` processes x batch 1 x grad_accum 2/world. Full fine-tuning steps inside backward
    with several processes and unfused in the 1-process reference (it accumulates)."""
    fused = method == "full" and world > 1
    return make_config(
        models, images, out, cache, "flux", method,
        train={"steps": 4, "batch_size": 1, "grad_accum": 2 // world, "checkpoint_every": 2, "keep_checkpoints": 3,
               **train},
        optimizer={"scheduler": "cosine", "warmup_steps": 1, "weight_decay": 0.01, "fused_back_pass": fused,
                   "max_grad_norm": None if method == "full" else 0.05},
    )


def _weights(out: Path, method: str, folder: str = "transformer") -> dict[str, torch.Tensor]:
    if method == "lora":
        return load_file(str(out / "lora.safetensors"))
    sd = {}
    for f in sorted((out / folder).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"


# ---------------------------------------------------------------------------------------------- the workers


def _job(rank: int, job: dict) -> dict:
    from trainer.config import Config

    cfg = Config.model_validate(job["cfg"])
    for target, value in job.get("patch", {}).items():  # "module.NAME": value, set in this process
        module, _, name = target.rpartition(".")
        setattr(importlib.import_module(module), name, value)
    if job.get("stream"):  # the conductor's CPU path, as tests/test_train_resume.py runs it
        Trainer._can_stream = lambda self: True
    t = Trainer(cfg, resume=job.get("resume"))
    t.setup()
    reducer = getattr(t.optim, "_reducer", None)
    info = {"monitor": t.monitor is not None, "sampler": t.sampler is not None, "world": t.dist.world,
            "rank": t.dist.rank, "buckets": len(reducer.buckets) if reducer else 0, "error": None,
            "owned": t.optim.owners is not None,
            "nano_mlps": sum(type(m).__name__.startswith("NanoBatched") for m in t.transformer.modules())}
    if job.get("stream") and t.offload is not None:  # the shared arena (issue 20), seen from inside while both
        # processes map it (fsdp has no conductor: "stream" only lets it offload activations on the CPU)
        inner_step = t.train_step

        def step_and_look():
            m = inner_step()
            if t.step == 2:
                st = t.offload.stats()
                info["arena"] = {"shared": st["arena_shared"], "gathered_by": st["gathered_by"], **_arena_smaps()}
            return m

        t.train_step = step_and_look
    if job.get("stop_after") and rank == 1:  # a stop request seen by rank 1 only
        inner = t.train_step

        def train_step():
            m = inner()
            if t.step == job["stop_after"]:
                t.stop.requested = True
            return m

        t.train_step = train_step
    if job.get("nan_at") and rank == 1:  # a non-finite loss on rank 1 only
        inner_loss = t.objective.loss

        def loss(pred, noised, mask=None):
            out = inner_loss(pred, noised, mask=mask)
            return out * float("nan") if t.step + 1 == job["nan_at"] else out

        t.objective.loss = loss
    offloader = getattr(t, "_activations", None)  # fsdp's activation offloader (closed by fit, its count kept)
    try:
        info["path"] = str(t.fit())
        info["offloaded_activation_bytes"] = offloader.offloaded_bytes if offloader is not None else 0
    except Exception as e:  # noqa: BLE001 - reported to the test
        info["error"] = f"{type(e).__name__}: {e}"
        info["step"] = t.step
    return info


def _arena_smaps() -> dict:
    """Rss and Pss (bytes) of this process's mapping of the shared arena file (/proc/self/smaps): with two
    processes touching every page, Pss is half the Rss."""
    out, inside = {"rss": 0, "pss": 0}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = "dittrain-arena" in line
        elif inside and head and head[0] in ("Rss:", "Pss:"):
            out[head[0][:-1].lower()] += int(head[1]) * 1024
    return out


def _worker(rank: int, store: str, jobs: list[dict], result: str, backend: str, world: int = WORLD) -> None:
    import torch.distributed as tdist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)  # the same kernels (and summation order) as the 1-thread reference
    from trainer.train import distributed

    distributed.BUCKET_BYTES = 8192  # several buckets even for the tiny LoRA (~12k parameters)
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    # A file store, not a TCP port: no race with other programs for a free port.
    tdist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=300))
    out = []
    try:
        for job in jobs:
            out.append(_job(rank, job))
    except Exception:  # noqa: BLE001
        out.append({"error": traceback.format_exc()})
    finally:
        Path(result, f"rank{rank}.json").write_text(json.dumps(out))
        tdist.destroy_process_group()


def _run_two(jobs: list[dict], tmp: Path, timeout: float = 300, backend: str = "gloo",
             world: int = WORLD) -> list[list[dict]]:
    from _ranks import start

    result = tmp / f"results-{time.monotonic_ns()}"
    result.mkdir()
    ctx = start(_worker, (str(result / "store"), jobs, str(result), backend, world), world)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2-process run hung")
    return [json.loads((result / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("dist-images"))


# ---------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def launched(tiny_models, images, once_per_session):
    """The four 2-process tests below in one launch, once in the session (`once_per_session`: xdist may spread
    them over workers): their 1-process references first (each filling its test's data cache, as the 2-process
    jobs then find it), then every job of theirs in the same two processes, one after another (a launch imports
    torch and diffusers in both processes and loads the model: ~10-20 s of 2 cores). The stop and non-finite
    jobs run last. -> {test: (its folder, rank 0's results, rank 1's)}, and "models" / "images": the tiny models
    and images it used (another worker's), for the tests' own runs beside it."""
    out = once_per_session("distributed-launch", lambda root: _launch(tiny_models, images, root))
    return {k: Path(v) if isinstance(v, str) else (Path(v[0]), v[1], v[2]) for k, v in out.items()}


def _launch(tiny_models, images, root: Path) -> dict:
    lora, shard, full, stop = (root / n for n in ("lora", "sharded", "full", "stop"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(_cfg(tiny_models, images, lora / "ref", lora / "cache")).fit()  # grad_accum 2; fills the cache
        Trainer(_cfg(tiny_models, images, shard / "ref", shard / "cache", steps=3, checkpoint_every=0)).fit()
        Trainer(_cfg(tiny_models, images, full / "ref", full / "cache", "full", steps=2,
                     checkpoint_every=0)).fit()  # unfused, accumulates
    finally:
        torch.set_num_threads(before)

    cfg2 = _cfg(tiny_models, images, lora / "two", lora / "cache", world=2)
    cfg2 = cfg2.model_copy(update={
        "offload": cfg2.offload.model_copy(update={"transformer": 0.5}),
        "output": cfg2.output.model_copy(update={"tensorboard": True}),
        "sample": cfg2.sample.model_copy(update={"every": 4, "prompts": ["a red square"], "steps": 2, "width": 64,
                                                 "height": 64}),
    })
    cfg_sh = _cfg(tiny_models, images, shard / "two", shard / "cache", world=2, steps=3, checkpoint_every=0)
    cfg_sh = cfg_sh.model_copy(update={
        "offload": cfg_sh.offload.model_copy(update={"transformer": 1.0, "sharded_stream": True}),
        "sample": cfg_sh.sample.model_copy(update={"every": 2, "prompts": ["a red square"], "steps": 2, "width": 64,
                                                   "height": 64}),
    })
    cfg_f = _cfg(tiny_models, images, full / "two", full / "cache", "full", world=2, steps=2, checkpoint_every=0)
    assert cfg_f.optimizer.fused_back_pass
    cfg_fs = _cfg(tiny_models, images, full / "streamed", full / "cache", "full", world=2, steps=2,
                  checkpoint_every=0)
    cfg_fs = cfg_fs.model_copy(update={"offload": cfg_fs.offload.model_copy(update={"transformer": 0.5})})
    cfg_fo = _cfg(tiny_models, images, full / "owned", full / "cache", "full", world=2, steps=2, checkpoint_every=1)
    cfg_fo = cfg_fo.model_copy(update={"offload": cfg_fo.offload.model_copy(update={"transformer": 0.5,
                                                                                     "sharded_stream": True})})
    cfg_fr = cfg_fo.model_copy(update={"output": cfg_fo.output.model_copy(update={"dir": full / "owned-resumed"})})
    jobs = {  # the unstreamed full fine-tune first: "stream" patches Trainer for the rest of the process
        "full-fused": [{"cfg": cfg_f.model_dump(mode="json")}],
        "lora": [
            {"cfg": cfg2.model_dump(mode="json"), "stream": True},
            {"cfg": _cfg(tiny_models, images, lora / "resumed-in-two", lora / "cache", world=2).model_dump(mode="json"),
             "resume": str(lora / "ref" / "checkpoints" / "step-000002")},
            {"cfg": _cfg(tiny_models, images, lora / "accum2", lora / "cache", world=2, steps=2, grad_accum=2,
                         checkpoint_every=0).model_dump(mode="json")},
        ],
        "sharded": [{"cfg": cfg_sh.model_dump(mode="json"), "stream": True}],
        "full-streamed": [{"cfg": cfg_fs.model_dump(mode="json"), "stream": True},
                          {"cfg": cfg_fo.model_dump(mode="json"), "stream": True},  # owned steps (owners.py)
                          {"cfg": cfg_fr.model_dump(mode="json"), "stream": True,
                           "resume": str(full / "owned" / "checkpoints" / "step-000001")}],
        "stop": [
            {"cfg": _cfg(tiny_models, images, stop / "stop", stop / "cache", world=2,
                         checkpoint_every=0).model_dump(mode="json"), "stop_after": 1},
            {"cfg": _cfg(tiny_models, images, stop / "nan", stop / "cache", world=2).model_dump(mode="json"),
             "nan_at": 2},
        ],
    }
    r0, r1 = _run_two([j for js in jobs.values() for j in js], root, timeout=900)
    out, i = {}, 0
    for name, js in jobs.items():
        out[name] = (r0[i:i + len(js)], r1[i:i + len(js)])
        i += len(js)
    full_r = tuple(a + b for a, b in zip(out.pop("full-fused"), out.pop("full-streamed"), strict=True))
    dirs = {"lora": lora, "sharded": shard, "full": full, "stop": stop}
    return {"models": str(tiny_models), "images": str(images),
            **{name: (str(dirs[name]), *rs) for name, rs in {**out, "full": full_r}.items()}}


def test_two_processes_train_lora_like_one_and_checkpoints_cross_world_sizes(launched, one_thread):
    tmp, r0, r1 = launched["lora"]
    tiny_models, images = launched["models"], launched["images"]  # those of the launch's references
    cache, ref, two = tmp / "cache", tmp / "ref", tmp / "two"
    ref_w = _weights(ref, "lora")
    assert all(i["error"] is None for i in r0 + r1), (r0, r1)
    assert r0[0]["buckets"] > 1

    # Same weights and losses as the 1-process run at the same global batch, the streamed frozen blocks living
    # once in one /dev/shm arena that both processes map (each page shared by two: Pss = Rss / 2), gone after.
    for info in (r0[0], r1[0]):
        a = info["arena"]
        assert a["shared"] and a["rss"] > 0 and a["pss"] == pytest.approx(a["rss"] / 2, rel=0.1), a
    assert not list(Path("/dev/shm").glob("dittrain-arena-*"))
    _assert_equal(_weights(two, "lora"), ref_w)
    assert losses(two) == pytest.approx(losses(ref), rel=1e-6, abs=0)
    # A 1-process checkpoint resumed in 2 processes ends where the 1-process run did.
    _assert_equal(_weights(tmp / "resumed-in-two", "lora"), ref_w)

    # Rank 0 alone writes: one metrics line per step, one TensorBoard event file, complete checkpoints only.
    assert (r0[0]["monitor"], r1[0]["monitor"]) == (True, False)
    assert (r0[0]["sampler"], r1[0]["sampler"]) == (True, False)
    assert [p.name for p in (two / "samples").iterdir()] == ["step-000004-0.png"]
    assert len(losses(two)) == 4
    assert len(list((two / "tensorboard").glob("events.*"))) == 1
    assert [s for s, _ in ck.list_checkpoints(two / "checkpoints")] == [2, 4]
    assert not [p for p in (two / "checkpoints").iterdir() if p.name.startswith(".")]
    assert r0[0]["path"] == r1[0]["path"] == str(two / "lora.safetensors")
    state = json.loads((two / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["data"]["position"] == 4  # global: 2 steps x 2 processes x 1 micro-batch

    # A 2-process checkpoint resumed in 1 process ends where the 1-process run did.
    resumed1 = tmp / "resumed-in-one"
    Trainer(_cfg(tiny_models, images, resumed1, cache), resume=str(two / "checkpoints" / "step-000002")).fit()
    _assert_equal(_weights(resumed1, "lora"), ref_w)

    # Accumulation in several processes (buckets launched only after the last micro-batch): 2 x grad_accum 2 is
    # 1 x grad_accum 4, to rounding (the micro-batch gradients are summed in another order).
    accum4 = tmp / "accum4"
    Trainer(_cfg(tiny_models, images, accum4, cache, steps=2, grad_accum=4, checkpoint_every=0)).fit()
    a, b = _weights(tmp / "accum2", "lora"), _weights(accum4, "lora")
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)


def test_the_sharded_stream_trains_like_one_process_and_joins_rank_0s_sampling(launched):
    """offload.sharded_stream (trainer/offload/gather.py): each process copies half of every load and gathers the
    other half; the LoRA is bitwise the 1-process one at the same global batch, and rank 0's sampling during
    training (every load a collective) is joined by rank 1 (sharded.Lockstep), so neither waits forever."""
    tmp, r0, r1 = launched["sharded"]
    assert all(i["error"] is None for i in r0 + r1), (r0, r1)
    assert r0[0]["arena"]["gathered_by"] == r1[0]["arena"]["gathered_by"] == 2
    _assert_equal(_weights(tmp / "two", "lora"), _weights(tmp / "ref", "lora"))
    assert [p.name for p in (tmp / "two" / "samples").iterdir()] == ["step-000002-0.png"]


def test_two_processes_full_finetune_with_the_fused_back_pass_like_one(launched):
    tmp, r0, r1 = launched["full"]
    assert all(i["error"] is None for i in r0 + r1), (r0, r1)
    ref_w = _weights(tmp / "ref", "full")
    _assert_equal(_weights(tmp / "two", "full"), ref_w)
    # Streamed trainable blocks (conductor's CPU path, optimizer state kept in RAM): equal to the last bits only,
    # as in one process (tests/test_train_resume.py: shared inputs' gradients are summed in another order).
    got = _weights(tmp / "streamed", "full")
    for k in ref_w:
        torch.testing.assert_close(got[k], ref_w[k], rtol=1e-5, atol=1e-7)


def test_a_full_finetune_over_the_sharded_stream_steps_owned_weights_like_whole_copies(launched, one_thread):
    """offload.sharded_stream with train.method: full (trainer/train/owners.py): each process steps half of the
    weights and keeps their optimizer state; the run is bitwise the whole-copies one (2 processes: a + b), its
    checkpoint holds one state file per process, and it resumes in 2 processes bitwise and in 1 process (which
    reads both files) to the last bits."""
    tmp, r0, r1 = launched["full"]
    owned, resumed = (r0[2], r1[2]), (r0[3], r1[3])
    assert all(i["error"] is None for i in owned + resumed), (owned, resumed)
    assert all(i["owned"] for i in owned) and not r0[1]["owned"]
    assert r0[2]["arena"]["gathered_by"] == 2 and r0[2]["arena"]["shared"]
    got = _weights(tmp / "owned", "full")
    _assert_equal(got, _weights(tmp / "streamed", "full"))
    ck1 = tmp / "owned" / "checkpoints" / "step-000001"
    assert sorted(p.name for p in ck1.glob("optimizer*")) == [
        "optimizer.rank-000-of-002.safetensors", "optimizer.rank-001-of-002.safetensors"]
    _assert_equal(_weights(tmp / "owned-resumed", "full"), got)
    one = tmp / "owned-resumed-in-one"
    Trainer(_cfg(Path(launched["models"]), Path(launched["images"]), one, tmp / "cache", "full", steps=2,
                 checkpoint_every=0), resume=str(ck1)).fit()
    for k, v in _weights(one, "full").items():
        torch.testing.assert_close(v, got[k], rtol=1e-5, atol=1e-7)


def test_stop_and_nonfinite_loss_are_agreed_across_ranks(launched):
    tmp, r0, r1 = launched["stop"]
    # Ctrl-C seen by rank 1 only: both finish step 1, rank 0 saves, both stop.
    for r in (r0, r1):
        assert r[0]["error"].startswith("TrainingInterrupted") and r[0]["step"] == 1, r[0]
    assert [s for s, _ in ck.list_checkpoints(tmp / "stop" / "checkpoints")] == [1]
    # NaN on rank 1 at step 2: both raise before backward (no collective left waiting); rank 1 names its batch.
    assert r0[1]["error"].startswith("NonFiniteLossError") and "rank 1" in r0[1]["error"], r0[1]
    assert r1[1]["error"].startswith("NonFiniteLossError") and "broken image in the batch" in r1[1]["error"], r1[1]
    assert r0[1]["step"] == r1[1]["step"] == 1


def test_accelerate_launch_trains_like_one_process(launched, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m trainer.cli fit` (on a machine without GPUs: two CPU
    processes over gloo) sets the environment torchrun sets and trains the same LoRA as one process at the same
    global batch (the launch's 1-process LoRA reference: the same config, its data cache copied here)."""
    import shutil
    import socket
    import subprocess
    import sys

    import yaml

    accelerate = Path(sys.executable).with_name("accelerate")
    if not accelerate.exists() and shutil.which("accelerate") is None:
        pytest.skip("accelerate is not installed")
    tmp = launched["lora"][0]
    tiny_models, images = launched["models"], launched["images"]  # those of the launch's references
    cache, ref = tmp_path / "cache", tmp / "ref"  # 1 process, grad_accum 2
    shutil.copytree(tmp / "cache", cache)
    two = tmp_path / "two"
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(_cfg(tiny_models, images, two, cache, world=2).model_dump(mode="json")))
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(accelerate if accelerate.exists() else shutil.which("accelerate")), "launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port), "-m", "trainer.cli", "fit", str(path)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "data parallel: 2 processes over gloo" in run.stdout + run.stderr
    _assert_equal(_weights(two, "lora"), _weights(ref, "lora"))


def test_four_processes_share_one_arena_and_train_like_one(tiny_models, images, tmp_path, one_thread):
    """Issue 20 with four processes: every page of the streamed frozen blocks is mapped by all four (Pss = Rss / 4),
    and the LoRA is bitwise the 1-process one at the same global batch (4 = 1 x 4 micro-batches)."""
    cache = tmp_path / "cache"
    ref = tmp_path / "ref"
    cfg1 = _cfg(tiny_models, images, ref, cache, steps=2, checkpoint_every=0)
    cfg1 = cfg1.model_copy(update={"train": cfg1.train.model_copy(update={"grad_accum": 4})})
    Trainer(cfg1).fit()
    four = tmp_path / "four"
    cfg4 = _cfg(tiny_models, images, four, cache, steps=2, checkpoint_every=0)
    cfg4 = cfg4.model_copy(update={"train": cfg4.train.model_copy(update={"grad_accum": 1}),
                                   "offload": cfg4.offload.model_copy(update={"transformer": 1.0})})
    rs = _run_two([{"cfg": cfg4.model_dump(mode="json"), "stream": True}], tmp_path, world=4)
    assert all(r[0]["error"] is None for r in rs), rs
    for r in rs:
        a = r[0]["arena"]
        assert a["shared"] and a["rss"] > 0 and a["pss"] == pytest.approx(a["rss"] / 4, rel=0.1), a
    # Not bitwise: four gradients are summed in the all-reduce's order, not the accumulation's (a + b is the same
    # both ways, so two processes are bitwise; (a + b) + (c + d) is not ((a + b) + c) + d).
    got, want = _weights(four, "lora"), _weights(ref, "lora")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


def test_torchrun_threads_split_the_cores_when_torchrun_chose_one_thread(monkeypatch, capsys):
    """torchrun sets OMP_NUM_THREADS=1 in every worker when the user set none: each process then read, copied and
    cast the whole load on one core (issue 40). Only that default is replaced, by cores / local processes."""
    from trainer.train import distributed

    run = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "4", "RANK": "0"}
    assert distributed.torchrun_threads(run, cores=64, launcher_env={"PATH": "/bin"}) == 16
    assert distributed.torchrun_threads(run, cores=2, launcher_env={}) == 1
    assert distributed.torchrun_threads(run, cores=64, launcher_env={"OMP_NUM_THREADS": "1"}) is None  # the user's
    assert distributed.torchrun_threads({**run, "OMP_NUM_THREADS": "8"}, cores=64, launcher_env={}) is None
    assert distributed.torchrun_threads({k: v for k, v in run.items() if k != "TORCHELASTIC_RUN_ID"}, cores=64,
                                        launcher_env={}) is None  # not torchrun: someone else's 1
    assert distributed.torchrun_threads({**run, "LOCAL_WORLD_SIZE": "1"}, cores=64, launcher_env={}) is None

    # what setup does with it: torch's threads, and the line that says what was chosen
    for k, v in run.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(distributed, "_initial_environ", lambda pid: {"PATH": "/bin"})
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    before = torch.get_num_threads()
    try:
        distributed._use_torchrun_threads(4)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert "each of this host's 4 processes uses 3 CPU threads" in capsys.readouterr().err


def test_initial_environ_reads_the_environment_a_process_started_with():
    """torchrun's own environment as it started (it sets OMP_NUM_THREADS only in its os.environ afterwards)."""
    import subprocess
    import sys

    from trainer.train import distributed

    p = subprocess.Popen([sys.executable, "-c", "import os, time; os.environ['LATE'] = '1'; time.sleep(30)"],
                         env={**os.environ, "EARLY": "x"})
    try:
        time.sleep(0.5)
        env = distributed._initial_environ(p.pid)
    finally:
        p.kill()
        p.wait()
    if env is not None:  # None where /proc is not there to read
        assert env.get("EARLY") == "x" and "LATE" not in env


def test_compile_workers_split_the_cores_among_the_hosts_processes(monkeypatch, capsys):
    """torch inductor starts min(32, cores) compile workers beside each process: 128 for 4 processes on 64 cores.
    Each training process gets its share instead (at most 32, at least 1); a value the user set is kept, and one
    process keeps torch's own choice."""
    from torch._inductor import config as inductor

    from trainer.train import distributed

    four = {"LOCAL_WORLD_SIZE": "4"}
    assert distributed.compile_workers(four, cores=64) == 16
    assert distributed.compile_workers({"LOCAL_WORLD_SIZE": "2"}, cores=128) == 32
    assert distributed.compile_workers(four, cores=2) == 1
    assert distributed.compile_workers({**four, "TORCHINDUCTOR_COMPILE_THREADS": "8"}, cores=64) is None
    assert distributed.compile_workers({"LOCAL_WORLD_SIZE": "1"}, cores=64) is None

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(distributed.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    # torch's config module, not monkeypatch (whose undo there deletes the setting for the tests after)
    with inductor.patch(compile_threads=32):
        distributed._use_compile_workers(4)
        assert inductor.compile_threads == 16
    assert "each of this host's 4 processes compiles with 16 workers" in capsys.readouterr().err
    with inductor.patch(compile_threads=8):  # already fewer (a small host): left alone, nothing said
        distributed._use_compile_workers(4)
        assert inductor.compile_threads == 8 and not capsys.readouterr().err
