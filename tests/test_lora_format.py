"""LoRA files in the diffusers, comfy and kohya layouts (trainer/lora_format/): every layout gives the trained
update at alpha != rank, in diffusers' loader, in a ComfyUI-style reading of the original layout (written here from
ComfyUI's documented rules: `<module>.alpha` / rank, scale 1 without it), and through diffusers' own converters of the
original layout where diffusers has one (Flux's kohya files, Qwen-Image's comfy and kohya files)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trainer import lora_format as lfm
from trainer.config import Config
from trainer.errors import UserError
from trainer.models import adapter_class
from trainer.train import checkpoint as ck
from trainer.train.model import add_lora

RANK, ALPHA = 4, 12.0  # scale 3: a loader that drops or double-counts alpha is off by 3x


def adapted(tiny_models, family: str, kind: str, seed: int = 0):
    """(transformer with a random non-zero adapter of `kind`, adapter, config): what a trained LoRA looks like."""
    lora = {"rank": RANK, "alpha": ALPHA, "type": "lora" if kind == "dora" else kind, "dora": kind == "dora"}
    cfg = Config.model_validate({"model": {"family": family, "path": str(tiny_models / family), "dtype": "fp32"},
                                 "output": {"dir": "unused"}, "lora": lora})
    adapter = adapter_class(family)(cfg.model)
    t = adapter.load(cfg.model, parts={"transformer"}, dtype=torch.float32).transformer
    add_lora(t, cfg, adapter.default_lora_targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in t.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    return t, adapter, cfg


def base_model(adapter, cfg):
    return adapter.load(cfg.model, parts={"transformer"}, dtype=torch.float32).transformer


def bare_pipeline(adapter, transformer):
    """The family's pipeline with only a transformer: all load_lora_weights needs."""
    params = inspect.signature(adapter.pipeline_cls.__init__).parameters
    kw = {n: None for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty}
    return adapter.pipeline_cls(**{**kw, "transformer": transformer})


def peft_deltas(t) -> dict[str, torch.Tensor]:
    """peft's own weight update of every adapted module (LoRA, LoKr, LoHa)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n: m.get_delta_weight("default").detach().float() for n, m in t.named_modules()
            if isinstance(m, BaseTunerLayer) and "default" in getattr(m, "scaling", {})}


def outputs(t, modules, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return {m: t.get_submodule(m)(torch.randn(2, t.get_submodule(m).in_features, generator=g)) for m in modules}


def save_checkpoint_file(t, cfg, path):
    ck.save_lora(path, t, {"rank": RANK, "alpha": ALPHA, "family": cfg.model.family, "type": cfg.lora.type,
                           "dora": cfg.lora.dora})
    return path


def comfy_style_deltas(path) -> dict[str, torch.Tensor]:
    """Each module's weight update as ComfyUI computes it (comfy/weight_adapter: alpha from `<module>.alpha`,
    divided by lora_down's rows / hada_w1_b's rows / the decomposed LoKr factor's rank, else scale 1), keyed by the
    module name as the file has it."""
    sd = {k: v.float() for k, v in load_file(str(path)).items()}
    mods = {k.rsplit(".", 2 if k.endswith(".weight") else 1)[0] for k in sd}
    out = {}
    for m in mods:
        alpha = sd.get(f"{m}.alpha")
        if f"{m}.lora_up.weight" in sd or f"{m}.lora_B.weight" in sd:
            up = sd.get(f"{m}.lora_up.weight", sd.get(f"{m}.lora_B.weight"))
            down = sd.get(f"{m}.lora_down.weight", sd.get(f"{m}.lora_A.weight"))
            d, rank = up @ down, down.shape[0]
        elif f"{m}.hada_w1_a" in sd:
            d = (sd[f"{m}.hada_w1_a"] @ sd[f"{m}.hada_w1_b"]) * (sd[f"{m}.hada_w2_a"] @ sd[f"{m}.hada_w2_b"])
            rank = sd[f"{m}.hada_w1_b"].shape[0]
        elif f"{m}.lokr_w1" in sd or f"{m}.lokr_w1_a" in sd:
            rank = None
            w1 = sd.get(f"{m}.lokr_w1")
            if w1 is None:
                w1, rank = sd[f"{m}.lokr_w1_a"] @ sd[f"{m}.lokr_w1_b"], sd[f"{m}.lokr_w1_b"].shape[0]
            w2 = sd.get(f"{m}.lokr_w2")
            if w2 is None:
                w2, rank = sd[f"{m}.lokr_w2_a"] @ sd[f"{m}.lokr_w2_b"], sd[f"{m}.lokr_w2_b"].shape[0]
            d = torch.kron(w1, w2)
        else:
            continue
        out[m] = d * (alpha.item() / rank if alpha is not None and rank else 1.0)
    return out


def stacked(kmap, deltas: dict[str, torch.Tensor], original: str, like: torch.nn.Module) -> torch.Tensor:
    """The diffusers modules' updates stacked in the original layer's output order; zeros where a part is not
    adapted (`like` is the base transformer, for the part's shape)."""
    _, names = kmap.parts(original)
    return torch.cat([deltas[n] if n in deltas else torch.zeros_like(like.get_submodule(n).weight) for n in names])


# ---------------------------------------------------------------------------------------------- diffusers layout


CASES = [("flux", "lora"), ("flux", "dora"), ("flux", "lokr"), ("flux", "loha"), ("sd3", "lora"), ("sd3", "loha"),
         ("qwen-image", "lora"), ("qwen-image", "lokr")]


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_diffusers_layout_loads_the_trained_update_everywhere(tiny_models, tmp_path, family, kind):
    """The diffusers file (scale in the weights, header alpha = r, no `.alpha` tensors, which diffusers refuses
    beside a header) gives the trained layer outputs in diffusers' load_lora_weights (LoKr / LoHa: peft, as `dittrain
    sample` loads them) and the trained update when read as ComfyUI reads it."""
    from trainer.sampling.lora import load_peft_file

    t, adapter, cfg = adapted(tiny_models, family, kind)
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    out = tmp_path / "lora.safetensors"
    lfm.convert_lora(src, out, "diffusers")
    keys = list(load_file(str(out)))
    assert not any(k.endswith(".alpha") for k in keys)
    meta = lfm.lora_metadata(out)
    assert meta[lfm.META_FORMAT] == "diffusers" and meta["dittrain.alpha"] == str(ALPHA)

    base = base_model(adapter, cfg)
    if kind in ("lora", "dora"):
        bare_pipeline(adapter, base).load_lora_weights(str(out), adapter_name="x")
    else:
        load_peft_file(base, out, "lora0")
    mods = list(peft_deltas(t))
    want, got = outputs(t, mods), outputs(base, mods)
    for m in mods:
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)

    if kind != "dora":  # ComfyUI drops peft's DoRA magnitudes (docs/lora-files.md); the rest loads as below
        comfy = comfy_style_deltas(out)
        for m, d in peft_deltas(t).items():
            torch.testing.assert_close(comfy[f"transformer.{m}"], d, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- comfy and kohya


@pytest.mark.parametrize(("family", "kind"), [("flux", "lora"), ("flux", "loha"), ("sd3", "lora"), ("sd3", "loha"),
                                              ("qwen-image", "lora"), ("qwen-image", "lokr"), ("flux2", "lora"),
                                              ("z-image", "lora"), ("chroma", "lora"), ("chroma", "loha"),
                                              ("qwen-image-2.1", "lora"), ("qwen-image-2.1", "loha"),
                                              ("krea2", "lora"), ("hunyuan-video-1.5", "lora"),
                                              ("hunyuan-video-1.5-i2v", "loha")])
@pytest.mark.parametrize("fmt", ["comfy", "kohya"])
def test_original_layout_gives_the_diffusers_update(tiny_models, tmp_path, family, kind, fmt):
    """Each original-layout module, read as ComfyUI reads it (alpha tensor / rank), holds the trained updates of the
    diffusers modules the family's map puts there, stacked in order (fused q/k/v), at alpha != rank; the file names
    its layout in the header."""
    t, adapter, cfg = adapted(tiny_models, family, kind)
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    out = tmp_path / f"{fmt}.safetensors"
    lfm.convert_lora(src, out, fmt)
    assert lfm.lora_metadata(out)[lfm.META_FORMAT] == fmt
    kmap, base = adapter.lora_key_map, base_model(adapter, cfg)
    prefix = "diffusion_model." if fmt == "comfy" else "lora_unet_"
    comfy = comfy_style_deltas(out)
    assert comfy and all(k.startswith(prefix) for k in comfy)
    deltas = peft_deltas(t)
    covered = set()
    for key, d in comfy.items():
        original = key.removeprefix("diffusion_model.") if fmt == "comfy" else kmap.from_kohya(key[len(prefix):])
        assert original is not None, key
        covered |= set(kmap.parts(original)[1])
        torch.testing.assert_close(d, stacked(kmap, deltas, original, base), rtol=1e-5, atol=1e-6)
    assert set(deltas) <= covered


@pytest.mark.parametrize(("family", "fmt"), [("flux", "kohya"), ("qwen-image", "comfy"), ("qwen-image", "kohya")])
def test_diffusers_own_converter_reads_our_original_layout(tiny_models, tmp_path, family, fmt):
    """An outside check of the key maps: diffusers' own readers of BFL's kohya layout (Flux) and of Qwen-Image's comfy
    and kohya layouts load our files to the trained layer outputs (alpha applied, fused q/k/v split back). diffusers'
    Flux reader splits `linear1` at full-size Flux's widths (3072, ..., 12288), so single blocks' `linear1` is left out
    of its part of the check on the tiny model."""
    t, adapter, cfg = adapted(tiny_models, family, "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    out = tmp_path / f"{fmt}.safetensors"
    lfm.convert_lora(src, out, fmt)
    mods = list(peft_deltas(t))
    if family == "flux":
        sd = {k: v for k, v in load_file(str(out)).items() if "_linear1." not in k}
        save_file(sd, str(out))
        mods = [m for m in mods if adapter.lora_key_map.place(m).original.rsplit(".", 1)[-1] != "linear1"]
        assert any("to_q" in m for m in mods)
    base = base_model(adapter, cfg)
    bare_pipeline(adapter, base).load_lora_weights(str(out), adapter_name="x")
    want, got = outputs(t, mods), outputs(base, mods)
    for m in mods:
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("family", "kind"), [("flux", "lora"), ("flux", "loha"), ("sd3", "lora"),
                                              ("qwen-image", "lokr"), ("z-image", "lora"), ("chroma", "lora"),
                                              ("qwen-image-2.1", "lora"), ("krea2", "loha"),
                                              ("hunyuan-video-1.5", "lora")])
def test_round_trips_through_every_layout(tiny_models, tmp_path, family, kind):
    """diffusers -> comfy -> kohya -> diffusers keeps every module's update and the trained alpha; comfy <-> kohya is
    a rename."""
    t, _, cfg = adapted(tiny_models, family, kind)
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    first = lfm.read_lora_file(src)
    path = src
    for fmt in ("diffusers", "comfy", "kohya", "diffusers"):
        nxt = tmp_path / f"{fmt}-{path.stem}.safetensors"
        lfm.convert_lora(path, nxt, fmt)
        path = nxt
    back = lfm.read_lora_file(path)
    assert set(back.modules) == set(first.modules)
    for name, m in first.modules.items():
        assert back.modules[name].scale == pytest.approx(m.scale)
        torch.testing.assert_close(back.modules[name].delta(), m.delta(), rtol=1e-6, atol=1e-7)
    assert back.meta["dittrain.alpha"] == str(ALPHA)
    lfm.convert_lora(src, tmp_path / "c.safetensors", "comfy")
    lfm.convert_lora(tmp_path / "c.safetensors", tmp_path / "k.safetensors", "kohya")
    lfm.convert_lora(tmp_path / "k.safetensors", tmp_path / "c2.safetensors", "comfy")
    a, b = load_file(str(tmp_path / "c.safetensors")), load_file(str(tmp_path / "c2.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # bitwise but for full-factor LoKr weights, which carry the scale (multiplied out and back in)
        if "lokr_w1" in k:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=0)
        else:
            assert torch.equal(a[k], b[k]), k


def test_another_tools_fused_lora_splits_to_the_same_update(tiny_models, tmp_path):
    """A fused-qkv LoRA not written by us (no fused_ranks header, full-rank down shared by q/k/v) splits into
    diffusers modules whose stacked update is the fused one."""
    _, adapter, cfg = adapted(tiny_models, "flux", "lora")
    base = base_model(adapter, cfg)
    width = base.get_submodule("transformer_blocks.0.attn.to_q").in_features
    g = torch.Generator().manual_seed(3)
    down, up = torch.randn(6, width, generator=g), torch.randn(3 * width, 6, generator=g)
    path = tmp_path / "other.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": down,
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(3.0)}, str(path))
    lf = lfm.read_lora_file(path, family="flux")
    parts = [lf.modules[f"transformer_blocks.0.attn.to_{p}"].delta() for p in "qkv"]
    torch.testing.assert_close(torch.cat(parts), up @ down * 0.5)


def test_refusals_name_the_file_and_the_misfit(tiny_models, tmp_path):
    t, _, cfg = adapted(tiny_models, "flux", "dora")
    src = save_checkpoint_file(t, cfg, tmp_path / "dora.safetensors")
    with pytest.raises(UserError, match="DoRA in the comfy / kohya layout needs the base model's weights"):
        lfm.convert_lora(src, tmp_path / "x.safetensors", "comfy")
    t, _, cfg = adapted(tiny_models, "flux", "lokr")
    src = save_checkpoint_file(t, cfg, tmp_path / "lokr.safetensors")
    with pytest.raises(UserError, match="cannot be written as one fused LoKr"):
        lfm.convert_lora(src, tmp_path / "x.safetensors", "kohya")
    bad = tmp_path / "bad.safetensors"
    save_file({"lora_unet_no_such_layer.lora_down.weight": torch.zeros(2, 4),
               "lora_unet_no_such_layer.lora_up.weight": torch.zeros(4, 2)}, str(bad))
    with pytest.raises(UserError, match=r"bad\.safetensors: lora_unet_no_such_layer is not a layer"):
        lfm.read_lora_file(bad, family="flux")
    with pytest.raises(UserError, match="does not say which model family"):
        lfm.read_lora_file(bad)
    te = tmp_path / "te.safetensors"
    save_file({"lora_unet_img_in.lora_down.weight": torch.zeros(2, 4), "lora_unet_img_in.lora_up.weight":
               torch.zeros(4, 2), "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(2, 4)},
              str(te))
    with pytest.raises(UserError, match=r"te.safetensors: lora_te1_text_model_.* is not a lora_unet_\* key"):
        lfm.read_lora_file(te, family="flux")
    with pytest.raises(UserError, match="not found"):
        lfm.read_lora_file(tmp_path / "missing.safetensors")


def test_convert_lora_cli(tiny_models, tmp_path):
    from typer.testing import CliRunner

    from trainer.cli import app

    t, _, cfg = adapted(tiny_models, "sd3", "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    res = CliRunner().invoke(app, ["convert-lora", str(src), str(tmp_path / "k.safetensors"), "--to", "kohya"])
    assert res.exit_code == 0, res.output
    with safe_open(str(tmp_path / "k.safetensors"), framework="pt") as f:
        assert f.metadata()[lfm.META_FORMAT] == "kohya"
        assert json.loads(f.metadata()[lfm.META_FUSED])
    res = CliRunner().invoke(app, ["convert-lora", str(src), str(tmp_path / "x.safetensors"), "--to", "onnx"])
    assert res.exit_code != 0 and "choose one of diffusers, comfy, kohya" in res.output


def test_convert_lora_cli_keeps_its_input_asks_before_replacing_and_writes_the_umasks_mode(tiny_models, tmp_path):
    """OUT == IN is refused (however it is spelt), an existing OUT needs --overwrite, and the file gets the mode a
    plain open() would give it under the umask (0644 under 022), as fit's files do (safetensors alone: 0600)."""
    import os

    from typer.testing import CliRunner

    from trainer.cli import app

    t, _, cfg = adapted(tiny_models, "sd3", "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    before = src.read_bytes()
    dst = tmp_path / "k.safetensors"

    def run(*args):
        return CliRunner().invoke(app, ["convert-lora", *map(str, args), "--to", "kohya"])

    old = os.umask(0o022)
    try:
        assert run(src, dst).exit_code == 0
        assert dst.stat().st_mode & 0o777 == 0o644
        first = {k: v.clone() for k, v in load_file(str(dst)).items()}  # not the file's pages: it is replaced below
        r = run(src, dst)
        assert r.exit_code == 1 and r.output.strip() == (
            f"error: {dst} already exists: add --overwrite to replace it, or choose another output file"), r.output
        os.umask(0o027)
        dst.write_bytes(b"old")
        r = run(src, dst, "--overwrite")
        assert r.exit_code == 0, r.output
        again = load_file(str(dst))
        assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
        assert dst.stat().st_mode & 0o777 == 0o640
        for same in (src, tmp_path / "." / src.name):
            r = run(src, same, "--overwrite")
            assert r.exit_code == 1 and r.output.startswith(f"error: {same} is the input file: write the converted "
                                                            "LoRA to another file (e.g. "), r.output
        assert src.read_bytes() == before
        assert not list(tmp_path.glob(".tmp-*"))
    finally:
        os.umask(old)


@pytest.mark.parametrize(("family", "kind", "fmt"), [("sd3", "lora", "comfy"), ("flux", "loha", "kohya"),
                                                     ("z-image", "lora", "comfy"), ("chroma", "lora", "kohya"),
                                                     ("krea2", "lora", "kohya")])
def test_sample_loads_comfy_and_kohya_files(tiny_models, tmp_path, family, kind, fmt):
    """`dittrain sample --lora` (load_loras) takes the comfy and kohya layouts too (converted on the way in) and
    gives the trained layer outputs."""
    from trainer.sampling.lora import load_loras
    from trainer.sampling.request import LoraSpec

    t, adapter, cfg = adapted(tiny_models, family, kind)
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    lfm.convert_lora(src, tmp_path / f"{fmt}.safetensors", fmt)
    base = base_model(adapter, cfg)
    load_loras(bare_pipeline(adapter, base), [LoraSpec(tmp_path / f"{fmt}.safetensors")], family)
    mods = list(peft_deltas(t))
    want, got = outputs(t, mods), outputs(base, mods)
    for m in mods:
        torch.testing.assert_close(got[m], want[m], rtol=1e-5, atol=1e-5)


def test_merge_reads_every_layout_to_the_same_deltas(tiny_models, tmp_path):
    """`dittrain merge` (read_lora) takes a comfy / kohya file as it takes the diffusers one: the same
    (down, up, scale) per base weight up to where the scale sits."""
    from trainer.merge import read_lora

    t, _, cfg = adapted(tiny_models, "flux", "lora")
    src = save_checkpoint_file(t, cfg, tmp_path / "ck.safetensors")
    want = {k: s * b @ a for k, (a, b, s) in read_lora(src).items()}
    for fmt in ("diffusers", "comfy", "kohya"):
        lfm.convert_lora(src, tmp_path / f"{fmt}.safetensors", fmt)
        got = {k: s * b @ a for k, (a, b, s) in read_lora(tmp_path / f"{fmt}.safetensors").items()}
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", sorted(__import__("trainer.models", fromlist=["ADAPTERS"]).ADAPTERS))
def test_every_family_maps_its_default_targets(family):
    """On the full-size model (meta device): every module the default targets adapt has an original name, each fused
    part's width is the map's multiple of the layer's input, and kohya names map back."""
    cls = adapter_class(family)
    kmap = cls.lora_key_map
    if kmap is None:
        pytest.skip(f"{family} declares no lora_key_map (comfy / kohya layouts refused for it)")
    with torch.device("meta"):
        model = cls.transformer_cls.from_config(cls.full_config)
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = [n for n in linear if any(n == t or n.endswith("." + t) for t in cls.default_lora_targets)]
    assert targets
    for name in targets:
        place = kmap.place(name)
        assert place is not None, name
        assert kmap.from_kohya(kmap.kohya(place.original)[len("lora_unet_"):]) == place.original
        rule, parts = kmap.parts(place.original)
        assert parts[place.index] == name
        if rule.fused:
            widths = [linear[p].out_features / linear[p].in_features for p in parts]
            assert widths == list(rule.widths), (place.original, widths)


def _original_header(family: str, cls, shapes: dict[str, torch.Size]) -> dict[str, dict]:
    """The full-size model's original-layout header (key -> shape), made without our key map: BFL's Flux layout from
    bench_program, Stability's SD3.5 layout by test_original_layout's inverse conversion, Qwen-Image's own names."""
    from test_original_layout import _bfl_flux_header, _sd3_original

    if family == "flux":
        return _bfl_flux_header(dict(cls.full_config))
    if family == "sd3":
        sd = _sd3_original({k: torch.empty(v, device="meta") for k, v in shapes.items()},
                           cls.full_config["num_layers"])
        return {k: {"dtype": "BF16", "shape": list(v.shape)} for k, v in sd.items()}
    if family == "qwen-image":
        return {k: {"dtype": "BF16", "shape": list(v)} for k, v in shapes.items()}
    # The others: no outside source of the original names here, so the header is the map's own names for the adapted
    # weights (fused rows summed); diffusers' converter then says whether it reads them back into those weights, in
    # order. Chroma's converter takes every tensor by name, so its header is the whole model (biases placed as their
    # weights, the q/k norms under BFL's names).
    kmap, header = cls.lora_key_map, {}
    if family == "chroma":
        from accelerate import init_empty_weights

        with init_empty_weights():
            shapes = {k: v.shape for k, v in cls.transformer_cls.from_config(dict(cls.full_config)).state_dict().items()}
        header.update(_chroma_norms(shapes))
    for k, shape in shapes.items():
        module, _, leaf = k.rpartition(".")
        place = kmap.place(module) if leaf in ("weight", "bias") else None
        if place is not None:
            inner = shapes[f"{module}.weight"][1]
            rows = sum(w * inner for w in place.rule.widths) if place.rule.fused else shape[0]
            header[f"{place.original}.{leaf}"] = {"dtype": "BF16", "shape": [rows, *shape[1:]]}
    return header


def _chroma_norms(shapes) -> dict[str, dict]:
    """Chroma's RMSNorm scales under BFL's names, as its single-file converter takes them."""
    ren = {"attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
           "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
    out = {}
    for k, shape in shapes.items():
        parts = k.split(".")
        if k.startswith("transformer_blocks.") and ".".join(parts[2:4]) in ren:
            out[f"double_blocks.{parts[1]}.{ren['.'.join(parts[2:4])]}.scale"] = list(shape)
        elif k.startswith("single_transformer_blocks.") and parts[3] in ("norm_q", "norm_k"):
            out[f"single_blocks.{parts[1]}.norm.{'query' if parts[3] == 'norm_q' else 'key'}_norm.scale"] = list(shape)
        elif k.startswith("distilled_guidance_layer.norms."):
            out[k.replace(".weight", ".scale")] = list(shape)
    return {k: {"dtype": "BF16", "shape": v} for k, v in out.items()}


@pytest.mark.parametrize("family", ["flux", "sd3", "qwen-image", "flux2", "z-image", "chroma", "qwen-image-2.1",
                                    "krea2", "flux3"])
def test_key_map_places_rows_where_diffusers_single_file_converter_takes_them(family):
    """diffusers' own single-file converter (run on row ids by trainer/models/original_layout.py, full-size model,
    shapes only) takes each adapted diffusers weight from exactly the original tensor and rows our map stacks it at."""
    from accelerate import init_empty_weights

    from trainer.models import original_layout

    cls = adapter_class(family)
    with init_empty_weights():
        model = cls.transformer_cls.from_config(dict(cls.full_config))
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if family not in ("flux", "sd3", "qwen-image"):  # only the adapted weights (see _original_header)
        shapes = {k: v for k, v in shapes.items() if k.endswith(".weight") and cls.lora_key_map.place(k[:-7])}
    layout = original_layout.row_map(cls.transformer_cls, dict(cls.full_config), _original_header(family, cls, shapes),
                                     shapes, lambda k: False)
    assert layout is not None
    kmap, checked = cls.lora_key_map, 0
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or not any(name == t or name.endswith("." + t)
                                                         for t in cls.default_lora_targets):
            continue
        place = kmap.place(name)
        start = sum(w * m.in_features for w in place.rule.widths[: place.index])
        assert layout.runs[f"{name}.weight"] == [(f"{place.original}.weight", start, start + m.out_features)], name
        checked += 1
    assert checked


def test_krea2_every_linear_has_an_original_name_diffusers_converter_maps_back():
    """Krea 2 renames without fusing: every Linear of the full-size model (the text fusion's `projector` too, which a
    LoRA on all Linears adapts) has an original name, and diffusers' own converter of original-layout Krea 2 LoRAs
    (the ComfyUI / ai-toolkit layout) maps each back to the same module."""
    from accelerate import init_empty_weights
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_krea2_lora_to_diffusers

    cls = adapter_class("krea2")
    with init_empty_weights():
        model = cls.transformer_cls.from_config(dict(cls.full_config))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert "text_fusion.projector" in names
    original = {}
    for name in names:
        place = cls.lora_key_map.place(name)
        assert place is not None, name
        original[f"diffusion_model.{place.original}.lora_A.weight"] = name
    back = _convert_non_diffusers_krea2_lora_to_diffusers({k: torch.zeros(1) for k in original})
    assert sorted(back) == sorted(f"transformer.{n}.lora_A.weight" for n in names)
