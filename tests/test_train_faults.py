"""Faults: a checkpoint write cut short, a second Ctrl-C, a NaN batch, CUDA out of memory."""

from __future__ import annotations

import signal

import pytest
import torch
from test_train_support import losses, make_config, write_images

from trainer.errors import NonFiniteLossError, NonFiniteWeightsError, UserError
from trainer.train import checkpoint as ck
from trainer.train.faults import TrainingInterrupted
from trainer.train.optimizer import Optim
from trainer.train.trainer import Trainer


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("fault-images"))


def _cfg(tiny_models, images, tmp_path, method="lora", **train):
    return make_config(tiny_models, images, tmp_path / "run", tmp_path / "cache", "flux", method,
                       train={"steps": 5, "checkpoint_every": 2, **train})


def test_checkpoint_write_failing_midway_leaves_the_previous_one_loadable(tiny_models, images, tmp_path, monkeypatch):
    cfg = _cfg(tiny_models, images, tmp_path)
    Trainer(cfg).fit()
    expected = losses(tmp_path / "run")
    for p in (tmp_path / "run").iterdir():  # start over, keeping the cache
        if p.name != "cache":
            import shutil

            shutil.rmtree(p) if p.is_dir() else p.unlink()

    calls = []
    real = Optim.save

    def failing_save(self, folder):
        calls.append(folder)
        if len(calls) == 2:  # the second checkpoint (step 4): weights written, optimizer half-written
            (folder / "optimizer.safetensors").write_bytes(b"\0" * 10)
            raise OSError(28, "No space left on device")
        real(self, folder)

    monkeypatch.setattr(Optim, "save", failing_save)
    with pytest.raises(OSError, match="No space"):
        Trainer(cfg).fit()
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in ck.list_checkpoints(root)] == [2]
    assert not any(p.name.startswith(".tmp") for p in root.iterdir())
    monkeypatch.undo()
    Trainer(cfg, resume="latest").fit()
    assert losses(tmp_path / "run") == expected


def test_second_ctrl_c_during_the_save_quits_at_once_and_keeps_the_last_checkpoint(tiny_models, images, tmp_path,
                                                                                    monkeypatch):
    cfg = _cfg(tiny_models, images, tmp_path)
    real_step, real_save = Trainer.train_step, ck.save_lora

    def train_step(self):
        m = real_step(self)
        if self.step == 3:
            self.stop.handler(signal.SIGINT, None)  # first Ctrl-C: finish the step, then save
        return m

    def save_lora(path, transformer, meta):
        if meta["step"] == 3:
            (path.parent / "partial").write_text("x")
            signal.raise_signal(signal.SIGINT)  # second Ctrl-C while the checkpoint is being written
        real_save(path, transformer, meta)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(ck, "save_lora", save_lora)
    with pytest.raises(TrainingInterrupted, match=r"^stopped by SIGINT at once at step 3 without saving; the last "
                       r"complete checkpoint is .*step-000002; continue with `dittrain fit CONFIG --resume latest`$"):
        Trainer(cfg).fit()  # the hint to continue is kept
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in ck.list_checkpoints(root)] == [2]
    monkeypatch.undo()
    t = Trainer(cfg, resume="latest")
    t.fit()
    assert t.step == 5 and len(losses(tmp_path / "run")) == 5
    assert not any(p.name.startswith(".tmp") for p in root.iterdir())


@pytest.mark.parametrize("method", ["lora", "full"])
def test_non_finite_loss_stops_before_any_weight_changes(method, tiny_models, images, tmp_path, monkeypatch):
    cfg = _cfg(tiny_models, images, tmp_path, method)
    t = Trainer(cfg)
    t.setup()
    real = t.data.next_batch
    seen = {}

    def next_batch():
        b = real()
        if t.step == 3:  # the batch of step 4
            seen["weights"] = [p.detach().clone() for p in t.params]
            seen["files"] = b.files
            b.latents[0, 0, 0, 0] = float("nan")
        return b

    t.data.next_batch = next_batch
    with pytest.raises(NonFiniteLossError, match="loss is nan at step 4") as e:
        t.fit()
    assert all(f in str(e.value) for f in seen["files"])
    lr = cfg.optimizer.lr
    assert f"Likely fixes: lower optimizer.lr (now {lr:g}, try {lr / 4:g})" in str(e.value)  # not only the files
    assert all(torch.equal(a, p) for a, p in zip(seen["weights"], t.params, strict=True))
    if method == "full":
        assert all(p.grad is None for p in t.params)  # backward never ran: the fused pass did not step
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]
    assert not (tmp_path / "run" / "lora.safetensors").exists()


@pytest.mark.parametrize("method", ["lora", "full"])
def test_non_finite_weights_under_a_finite_loss_are_never_saved(method, tiny_models, images, tmp_path):
    """A NaN gradient under a finite loss steps a weight to NaN without tripping the loss check; the checkpoint
    after that step refuses to save it and names the weight, so the previous checkpoint stays the newest."""
    t = Trainer(_cfg(tiny_models, images, tmp_path, method))
    t.setup()
    real = t.train_step

    def train_step():
        m = real()
        if t.step == 4:  # after the optimizer step of step 4, before its checkpoint
            with torch.no_grad():
                t.params[0].view(-1)[0] = float("nan")
        return m

    t.train_step = train_step
    with pytest.raises(NonFiniteWeightsError, match="is NaN or inf after step 4") as e:
        t.fit()
    assert "step-000002" in str(e.value) and e.value.exit_code == 3
    assert [s for s, _ in ck.list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]


def test_cuda_out_of_memory_becomes_advice(tiny_models, images, tmp_path, monkeypatch):
    cfg = _cfg(tiny_models, images, tmp_path)
    t = Trainer(cfg)
    t.setup()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(t.adapter, "predict", oom)
    with pytest.raises(UserError, match=r"out of memory at step 1: raise offload.transformer from 0 to 0.25.*presets"):
        t.fit()


def test_ctrl_c_to_dittrain_fit_saves_and_resume_latest_continues(tiny_models, images, tmp_path):
    """The real thing, end to end: `dittrain fit` in its own process, SIGINT from outside, exit code 130, a
    complete checkpoint, then `--resume latest` finishing the run."""
    import json
    import subprocess
    import sys
    import time

    import yaml

    cfg = _cfg(tiny_models, images, tmp_path, steps=100000, checkpoint_every=0)
    path = tmp_path / "cfg.yaml"
    dumped = cfg.model_dump(mode="json")
    dumped["output"]["dir"] = str(tmp_path / "not-this-one")  # the run goes where --set says
    path.write_text(yaml.safe_dump(dumped))
    cmd = [sys.executable, "-m", "trainer", "fit", str(path), "--set", f"output.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGINT at step") and "error" not in last, last  # asked for: not an error
    found = ck.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert len(found) == 1
    step = found[0][0]
    assert json.loads((found[0][1] / "state.json").read_text())["step"] == step >= 2

    # The hint is the command that continues this run: this config with this run's --set overrides
    import shlex

    hint = shlex.split(last.split("continue with `")[1].rstrip("`"))
    assert hint[:2] == ["dittrain", "fit"] and hint[-2:] == ["--resume", "latest"] and hint[2:-2] == cmd[4:]
    # ... run here, through the same CLI (the stop above needed a process of its own; the resume does not)
    from typer.testing import CliRunner

    from trainer.cli import app

    done = CliRunner().invoke(app, [*hint[1:], "--set", f"train.steps={step + 2}"])
    assert done.exit_code == 0, done.output[-2000:]
    assert f"resumed from {found[0][1]} at step {step}" in done.output
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()][-3:] == [step, step + 1, step + 2]
    assert (tmp_path / "run" / "lora.safetensors").is_file()


def test_sigterm_saves_and_exits_143_and_sigint_130(tiny_models, images, tmp_path, monkeypatch):
    """SIGTERM is the polite stop of schedulers and `kill`: the same save as Ctrl-C, exit code 143 (128 + 15, the
    convention) where Ctrl-C keeps 130."""
    import os

    real_step = Trainer.train_step

    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        def train_step(self, sig=sig):
            m = real_step(self)
            if self.step == 1:
                os.kill(os.getpid(), sig)  # through the installed handler, as from outside
            return m

        monkeypatch.setattr(Trainer, "train_step", train_step)
        out = tmp_path / sig.name
        cfg = make_config(tiny_models, images, out, tmp_path / "cache", "flux", train={"steps": 5})
        before = signal.getsignal(sig)
        with pytest.raises(TrainingInterrupted, match=rf"^stopped by {sig.name} at step 1: saved ") as e:
            Trainer(cfg).fit()
        assert e.value.exit_code == code
        assert signal.getsignal(sig) is before  # the handlers installed twice (loading, training) are undone


def test_a_stop_while_caching_says_what_is_kept_closes_the_bar_and_how_to_continue(tiny_models, images, tmp_path,
                                                                                     monkeypatch):
    """A signal before step 1 (here while caching latents) stops at once: the line says caching stopped, that the
    entries written so far are kept (and counts them), and gives the command that continues, without
    `--resume latest` (a fresh run has no checkpoint); the progress bar is closed before the line is printed."""
    import os

    from safetensors import safe_open

    from trainer.data import cache as dc

    real_put, puts, latents = dc.DiskStore.put, [], set()

    def put(self, key, tensors, meta):
        real_put(self, key, tensors, meta)
        puts.append(key)
        if "bucket" in meta:  # a latent
            latents.add(key)
            if len(latents) == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the third latent written: mid-way through the latents

    bars = []

    class Bar:  # records whether the bar was closed, as tqdm's would be drawn one last time
        def __init__(self, *a, **k):
            self.closed = False
            bars.append(self)

        def update(self, n):
            pass

        def close(self):
            self.closed = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(dc.DiskStore, "put", put)
    monkeypatch.setattr(dc, "progress_bar", Bar)
    cache = tmp_path / "cache"
    cfg = make_config(tiny_models, write_images(tmp_path / "many", n=12), tmp_path / "run", cache, "flux")
    with pytest.raises(TrainingInterrupted) as e:
        Trainer(cfg, relaunch="dittrain fit my.yaml --resume latest").fit()
    entries = sorted(cache.rglob("*.safetensors"))
    captions = sum("caption" in safe_open(str(p), "pt").metadata() for p in entries)
    assert str(e.value) == (f"caching stopped by SIGTERM before training: the {captions} captions and "
                            f"{len(entries) - captions} latents encoded so far are kept in {cache} and reused; "
                            f"continue with `dittrain fit my.yaml`")
    assert e.value.exit_code == 143 and len(entries) == len(puts) and len(entries) - captions == 3
    assert len(bars) == 2 and all(b.closed for b in bars)  # captions, then latents
    assert not (tmp_path / "run").exists()  # the folder a fresh run made is given back


def test_dittrain_cache_stopped_says_what_is_kept_and_exits_130(tiny_models, images, tmp_path, monkeypatch):
    import os

    import yaml
    from typer.testing import CliRunner

    from trainer.cli import app
    from trainer.data import cache as dc

    real_put = dc.DiskStore.put

    def put(self, key, tensors, meta):
        real_put(self, key, tensors, meta)
        if "bucket" in meta:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the first latent

    monkeypatch.setattr(dc.DiskStore, "put", put)
    cfg = _cfg(tiny_models, images, tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite was started in the background by a shell
    r = CliRunner().invoke(app, ["cache", str(tmp_path / "c.yaml")])
    assert r.exit_code == 130, r.output
    assert r.output.strip().splitlines()[-1].startswith("caching stopped by SIGINT: the ")
    assert r.output.strip().endswith(f"captions and 1 latent encoded so far are kept in {tmp_path / 'cache'} and "
                                     "reused; `dittrain cache` (or `dittrain fit`) with this config encodes the rest")
    assert signal.getsignal(signal.SIGINT) is before  # the command's handler is gone again


def test_a_failing_sampling_pass_turns_sampling_off_and_training_goes_on(tiny_models, images, tmp_path, monkeypatch,
                                                                         capsys):
    """A sample that fails mid-run (here the pipeline raising, as HunyuanVideo 1.5 I2V's image encoder did on a GPU:
    bench/history/2026-11-28.md 15:22) costs no trained steps: one line names the step and the reason, sampling stays
    off, and the run ends with the same losses and LoRA as a run without sampling."""
    from trainer.sampling.training import TrainingSampler

    plain = _cfg(tiny_models, images, tmp_path / "plain", steps=4)
    Trainer(plain).fit()
    calls = []

    def failing(self, transformer, progress=False, before_decode=None):
        calls.append(1)
        raise RuntimeError("Input type (CUDABFloat16Type) and weight type (CPUBFloat16Type) should be the same\nmore")

    monkeypatch.setattr(TrainingSampler, "__call__", failing)
    cfg = _cfg(tiny_models, images, tmp_path / "sampled", steps=4)
    cfg = cfg.model_copy(update={"sample": cfg.sample.model_copy(update={
        "prompts": ["a red square"], "every": 1, "steps": 1, "width": 64, "height": 64})})
    path = Trainer(cfg).fit()
    assert path.is_file() and calls == [1]  # the first pass failed; none after it
    assert losses(tmp_path / "sampled" / "run") == losses(tmp_path / "plain" / "run")
    out = capsys.readouterr()
    line = next(x for x in (out.out + out.err).splitlines() if "sampling at step 1 failed" in x)
    assert "training goes on (RuntimeError: Input type (CUDABFloat16Type)" in line and "more" not in line
