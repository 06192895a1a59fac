"""Regional compilation inside StreamedBlock (trainer/offload/compiled.py), on the CPU with a cheap backend
(aot_eager: dynamo + AOTAutograd, no inductor): same numbers as eager, streamed == resident bitwise, one set of
graphs per block class shared by every block and by the conductor's ring views, one more per bucket shape, and
the sampling path runs the same compiled code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _offload_util import add_lora, batch, blocks_of, tiny_flux, train_steps, trainable_state

from trainer.offload import CompileOptions, attach_offload, compiled
from trainer.offload.block import StreamedBlock

AOT = CompileOptions(backend="aot_eager", shapes=4)

if torch.cuda.is_available():  # on a GPU box: checkpointing refuses CUDA being initialized inside its forward
    torch.cuda.init()


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    compiled.reset()
    yield
    compiled.reset()


def _model():
    return add_lora(tiny_flux(0, layers=2, singles=3))  # 5 blocks of 2 classes


def _train(fraction: float, compile, steps: int = 2, side: int = 8, **kw):
    m = _model()
    h = attach_offload(blocks_of(m), "cpu", fraction, compile=compile, **kw)
    losses = train_steps(m, steps, side=side)
    h.close()
    return losses, trainable_state(m)


def test_compiled_matches_eager_and_streamed_matches_resident_bitwise_without_recompiles():
    eager_l, eager_w = _train(0.0, False)
    assert compiled.stats()["graphs"] == 0
    res_l, res_w = _train(0.0, AOT)
    graphs = compiled.stats()["graphs"]
    # Per class at most two variants (the first block's inputs carry no gradient), never one per block:
    assert 2 <= graphs <= 4 < len(blocks_of(_model()))
    torch.testing.assert_close(res_l, eager_l, rtol=1e-5, atol=1e-6)
    for k in eager_w:
        torch.testing.assert_close(res_w[k], eager_w[k], rtol=1e-4, atol=1e-6)
    # Streamed through the conductor's ring (parameters re-pointed at ring regions every step): the same
    # compiled graphs serve it, nothing recompiles, and it agrees bitwise with the resident compiled run.
    str_l, str_w = _train(0.5, AOT)
    assert compiled.stats()["graphs"] == graphs
    assert torch.equal(str_l, res_l)
    assert res_w.keys() == str_w.keys() and all(torch.equal(res_w[k], str_w[k]) for k in res_w)


@pytest.mark.parametrize("backend", ["aot_eager"])  # inductor: tests/test_offload_gpu.py
def test_streamed_blocks_that_keep_their_activations_compiled_train_bitwise_resident(backend):
    """Nothing recomputed, every block streamed, each block class compiled: the compiled graphs save the weights
    (ring views) for backward, and the conductor's saved-tensor hooks resolve them to where the block is loaded
    for its backward (the race detector makes a stale view NaN): bitwise the resident compiled run."""
    opts = CompileOptions(backend=backend, shapes=4)
    res_l, res_w = _train(0.0, opts, checkpointing=False)
    graphs = compiled.stats()["graphs"]
    str_l, str_w = _train(1.0, opts, checkpointing=False, race_detector=True)
    assert compiled.stats()["graphs"] == graphs
    assert torch.equal(str_l, res_l)
    assert res_w.keys() == str_w.keys() and all(torch.equal(res_w[k], str_w[k]) for k in res_w)


def test_one_compile_per_bucket_shape():
    m = _model()
    h = attach_offload(blocks_of(m), "cpu", 0.5, compile=AOT)
    train_steps(m, 1, side=8)
    first = compiled.stats()["graphs"]
    train_steps(m, 1, side=8)
    assert compiled.stats()["graphs"] == first  # same shape: nothing new
    train_steps(m, 1, side=4)
    assert compiled.stats()["graphs"] == 2 * first  # a new bucket shape: the same number once more
    train_steps(m, 2, side=4)
    train_steps(m, 1, side=8)
    assert compiled.stats()["graphs"] == 2 * first
    assert "block graphs for 2 block classes" in compiled.report()
    assert compiled.report() is None  # printed once
    h.close()
    assert not any(isinstance(b, StreamedBlock) for b in blocks_of(m))


def test_dynamic_shapes_compile_once_for_several_buckets():
    m = _model()
    h = attach_offload(blocks_of(m), "cpu", 0.0, compile=CompileOptions(backend="eager", dynamic=True))
    train_steps(m, 1, side=8)
    first = compiled.stats()["graphs"]
    train_steps(m, 1, side=4)
    train_steps(m, 1, side=6)
    assert compiled.stats()["graphs"] == first
    h.close()


def test_sampling_runs_the_compiled_blocks():
    from trainer.sampling.placement import place_transformer

    m = _model()
    kw, _ = batch(0)
    with torch.no_grad():
        want = m(**kw)[0]
    adapter = SimpleNamespace(blocks=blocks_of)
    with torch.no_grad(), place_transformer(adapter, m, torch.device("cpu"), 0.0, compile=AOT) as handle:
        assert handle is not None and all(isinstance(b, StreamedBlock) for b in blocks_of(m))
        got = m(**kw)[0]
    assert compiled.stats()["graphs"] >= 2
    assert not any(isinstance(b, StreamedBlock) for b in blocks_of(m))  # closed after
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # without compile, fraction 0 stays the plain resident module
    with place_transformer(adapter, m, torch.device("cpu"), 0.0) as handle:
        assert handle is None


def test_training_handle_forward_under_no_grad_is_compiled_too():
    """The training sampler calls the loop's transformer under no_grad: the same StreamedBlocks, compiled."""
    m = _model()
    h = attach_offload(blocks_of(m), "cpu", 0.5, compile=AOT)
    kw, _ = batch(0)
    with torch.no_grad():
        m(**kw)
    assert compiled.stats()["graphs"] >= 2
    h.close()


def test_compile_options_from_the_config():
    from trainer.config import TrainConfig
    from trainer.train import streaming

    def cfg(**train):
        return SimpleNamespace(train=TrainConfig(**train), offload=SimpleNamespace(activations=False, nano_batches=1))

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert streaming.compile_options(cfg(), cpu) is None  # auto: off on the CPU
    assert streaming.compiles(cfg(), cuda)  # auto: on for CUDA
    assert not streaming.compiles(cfg(compile=False), cuda)
    opts = streaming.compile_options(cfg(compile=True, compile_dynamic=True), cpu, shapes=5)
    assert opts.dynamic and opts.shapes == 5
    # the handle runs (to compile) even without checkpointing or streaming
    assert streaming.conducts(cfg(compile=True, gradient_checkpointing=False), 0.0, False, cpu)
    assert not streaming.conducts(cfg(gradient_checkpointing=False), 0.0, False, cpu)
    with pytest.raises(TypeError):
        compiled.options("inductor")


def test_trainer_with_train_compile_logs_compile_once_and_trains_like_eager(tiny_models, tmp_path, monkeypatch,
                                                                              capsys):
    from test_train_support import losses, make_config, write_images

    from trainer.train.trainer import Trainer

    monkeypatch.setenv("DITTRAIN_COMPILE_BACKEND", "aot_eager")
    images = write_images(tmp_path / "images", n=2)
    runs = {}
    for on in (False, True):
        out = tmp_path / f"out-{on}"
        cfg = make_config(tiny_models, images, out, tmp_path / "cache", "flux", train={"steps": 2, "compile": on})
        t = Trainer(cfg)
        t.fit()
        t.close()
        runs[on] = losses(out)
    captured = capsys.readouterr()
    err = captured.err + captured.out
    assert err.count("compile: ") == 1 and "block graphs for 2 block classes" in err
    assert compiled.stats()["graphs"] >= 2
    torch.testing.assert_close(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- issue 29: one compile per run, cache


def test_token_axes_marked_up_front_compile_once_for_every_bucket():
    """compile_dynamic: tokens marks the sequence axes before the first compile: later buckets reuse its graphs
    (with static shapes each bucket compiles its own), and the numbers match eager."""
    opts = CompileOptions(backend="eager", dynamic="tokens", shapes=1)  # dynamo decides the graphs; no AOT needed
    m = add_lora(tiny_flux(0, layers=1, singles=1))
    h = attach_offload(blocks_of(m), "cpu", 0.0, compile=opts)
    train_steps(m, 1, side=8)
    first = compiled.stats()["graphs"]
    got = train_steps(m, 1, side=4)
    train_steps(m, 1, side=6)
    assert compiled.stats()["graphs"] == first  # no new graph for two new bucket shapes
    h.close()
    m2 = add_lora(tiny_flux(0, layers=1, singles=1))
    train_steps(m2, 1, side=8)
    torch.testing.assert_close(got, train_steps(m2, 1, side=4), rtol=1e-5, atol=1e-6)


def test_mark_token_axes_leaves_widths_and_size_one_axes_static():
    x = torch.zeros(1, 16, 8)  # batch 1, 16 tokens, width 8
    rope = (torch.zeros(24, 4), torch.zeros(24, 4))
    ids = torch.zeros(16, 3, dtype=torch.long)
    compiled.mark_token_axes(((x,), {"rope": rope, "ids": ids}))

    def marked(t):
        return set(getattr(t, "_dynamo_weak_dynamic_indices", set()))

    assert marked(x) == {1} and marked(rope[0]) == {0} and marked(ids) == set()


def _tiny_block_cls():
    class TinyBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.gelu(self.lin(x)) * 2

    return TinyBlock


def test_compile_cache_folder_is_written_and_a_second_run_loads_it(tmp_path, monkeypatch):
    """Inductor on the CPU (needs a C++ compiler): the first run misses and writes the folder, a second run after
    every in-process cache is dropped loads the compiled forward + backward from it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))  # restored after the test
    folder = compiled.use_cache(tmp_path / "torch-compile")
    assert folder == str(tmp_path / "torch-compile" / compiled._cpu_key())
    cls = _tiny_block_cls()
    opts = CompileOptions(backend="inductor", shapes=1)

    def run():
        torch.manual_seed(0)
        b = cls()
        x = torch.randn(4, 8, requires_grad=True)
        compiled.forward_of(cls, opts)(b, x).sum().backward()
        return compiled.stats(), x.grad

    first, g1 = run()
    assert first["graphs"] == 1 and first["aot_misses"] >= 1 and first["aot_hits"] == 0
    assert any((tmp_path / "torch-compile").rglob("*")) and not (tmp_path / "elsewhere").exists()
    line = compiled.report()
    assert "cache 0 of 1 forward+backward graphs" in line and folder in line
    compiled.reset()  # a new run: dynamo's and our in-process state dropped
    second, g2 = run()
    assert second["graphs"] == 1 and second["aot_hits"] >= 1 and second["aot_misses"] == 0
    assert torch.equal(g1, g2)
    assert "cache 1 of 1 forward+backward graphs" in compiled.report()


def test_compile_cache_has_one_folder_per_cpu_vector_isa(tmp_path, monkeypatch):
    """Inductor's FX graph cache is keyed by the thread count but not by the ISA its C++ kernels were written for
    (measured: a kernel compiled under ATEN_CPU_CAPABILITY=default loads as a hit under AVX2), so a compile cache
    on a disk shared by machines of different CPUs keeps one subfolder per ISA; the same ISA finds its own."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))  # restored after the test
    amx = {"on": False}
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx["on"], raising=False)
    folders = {}
    for cap, has_amx in (("AVX2", False), ("AVX512", False), ("AVX512", True), ("DEFAULT", False), ("AVX2", True)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda cap=cap: cap)
        amx["on"] = has_amx
        folders[cap, has_amx] = compiled.use_cache(tmp_path / "torch-compile")
    root = tmp_path / "torch-compile"
    assert folders == {("AVX2", False): str(root / "cpu-avx2"), ("AVX512", False): str(root / "cpu-avx512"),
                       ("AVX512", True): str(root / "cpu-avx512-amx"), ("DEFAULT", False): str(root / "cpu-default"),
                       ("AVX2", True): str(root / "cpu-avx2")}  # AMX tiles come only with AVX-512 kernels
    assert sorted(p.name for p in root.iterdir()) == ["cpu-avx2", "cpu-avx512", "cpu-avx512-amx", "cpu-default"]


def test_trainer_points_the_compile_cache_beside_the_data_cache(tiny_models, tmp_path, monkeypatch, capsys):
    import os

    from test_train_support import make_config, write_images

    from trainer.train.trainer import Trainer

    monkeypatch.setenv("DITTRAIN_COMPILE_BACKEND", "eager")  # the wiring, not the kernels (the test above)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "default"))  # restored after the test
    images = write_images(tmp_path / "images", n=1)
    cfg = make_config(tiny_models, images, tmp_path / "out", tmp_path / "cache", "flux",
                      train={"steps": 1, "compile": True, "compile_cache": True})
    t = Trainer(cfg)
    t.fit()
    t.close()
    want = str((tmp_path / "cache" / "torch-compile" / compiled._cpu_key()).resolve())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == want and os.path.isdir(want)
    out = capsys.readouterr()
    assert f"compile cache: {want}" in out.err + out.out


def test_a_later_step_that_compiled_says_so_in_one_line(monkeypatch):
    """Step 1's compile has its own line (`report`); a later step that compiled (a new bucket shape, a grad mode)
    gets one too, naming the step and the seconds, so a slow step in the log is explained or is not a compile."""
    monkeypatch.setattr(compiled, "_STATS", {"graphs": 4, "seconds": 30.0, "reported": True})
    before = compiled.stats()
    assert compiled.later_compile_line(before, 5, 0.6) is None  # nothing new
    compiled._STATS.update(graphs=6, seconds=52.5)
    assert compiled.later_compile_line(before, 1, 60.0) is None  # the first step: `report`'s line
    line = compiled.later_compile_line(before, 5, 23.1)
    assert line == ("compile: step 5 compiled 2 more block graphs in 22.5 s of its 23.1 s (a new input shape or "
                    "grad mode; 6 in all)")
