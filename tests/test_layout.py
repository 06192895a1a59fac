"""The package boundaries the architecture promises (docs/architecture.md), read from the source with `ast`, and
the family facts every model adapter must provide.

- trainer/offload/ (the conductor) imports nothing from the planner, the config or the model adapters;
- trainer/planner/ imports only the conductor's arithmetic (offload.plan, offload.allocators), the optimizer and
  LoRA-kind specs (optim/specs.py, lora_format/kinds.py), models/, quant (the loader's quantized layout), config,
  errors, dtypes and itself, with no import cycle;
- nothing outside trainer/models/ compares a family name (`family == "flux"`): facts live on the adapters;
- nor names a family at all, keeps a table keyed by one, or holds a regular expression of a family's module names
  (those are the adapters' `modulation_linears` / `text_encoder_keep_linears`);
- no import cycle anywhere in trainer/, imports inside functions counted (but not `if TYPE_CHECKING:` ones),
  apart from the listed cycles inside a package that predate this test; none at all between the packages and
  top-level modules of trainer/ (trainer.data, trainer.quant, ...);
- those packages form the layers of docs/architecture.md "What each package owns and may import", each importing
  only from the layers below, and each package imports only what that section says it may (nothing but train/, sample.py, the
  CLI, sampling/placement.py and captioning/ imports the planner);
- every registered family declares the facts of trainer/models/base.py, its own tiny builders, and its
  spellings resolve (`canonical_family`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from pathlib import Path

import pytest
import torch

from trainer.errors import UserError
from trainer.models import ADAPTERS, adapter_class, adapter_classes, canonical_family

ROOT = Path(__file__).resolve().parents[1] / "trainer"


def _imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Absolute names of the trainer modules `path` imports (relative imports resolved)."""
    pkg = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        pkg = pkg.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not node.module:  # `from . import x`: x is a module of the package
                out |= {f"{mod}.{a.name}" for a in node.names}
            else:
                out.add(mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m == "trainer" or m.startswith("trainer.")}


def _files(sub: str) -> list[Path]:
    return sorted((ROOT / sub).glob("*.py"))


def test_the_import_helper_resolves_relative_imports(tmp_path):
    got = _imports(ROOT / "planner" / "prediction.py")
    assert "trainer.offload.plan" in got and "trainer.planner.timing" in got


def test_offload_imports_neither_planner_config_nor_models():
    bad = {
        f"{p.name}: {m}"
        for p in _files("offload")
        for m in _imports(p)
        if m.split(".")[1] in ("planner", "config", "models")
    }
    assert not bad


ALLOWED = ("trainer.offload.plan", "trainer.offload.allocators", "trainer.offload.nano", "trainer.optim.specs", "trainer.lora_format.kinds",
           "trainer.models", "trainer.config", "trainer.errors", "trainer.dtypes", "trainer.planner", "trainer.quant")


def test_planner_imports_only_what_it_may():
    bad = {
        f"{p.name}: {m}"
        for p in _files("planner")
        for m in _imports(p)
        if not any(m == a or m.startswith(a + ".") for a in ALLOWED)
    }
    assert not bad


def test_planner_has_no_import_cycle():
    mods = {p.stem: p for p in _files("planner") if p.name != "__init__.py"}
    graph = {
        name: {m.rpartition(".")[2] for m in _imports(p, top_level_only=True) if m.startswith("trainer.planner.")}
        for name, p in mods.items()
    }
    for start in graph:  # depth-first from every module: reaching the start again is a cycle
        stack, seen = list(graph[start]), set()
        while stack:
            m = stack.pop()
            assert m != start, f"import cycle through trainer/planner/{start}.py"
            if m not in seen:
                seen.add(m)
                stack.extend(graph.get(m, ()))


def test_no_family_name_comparisons_outside_models():
    hits = []
    for p in ROOT.rglob("*.py"):
        if "models" in p.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                if any(c in ADAPTERS for c in consts):
                    hits.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not hits


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_every_adapter_provides_the_family_facts(family):
    cls = adapter_class(family)
    assert cls.family == family
    assert isinstance(cls.full_name, str) and cls.full_name
    assert isinstance(cls.example_path, str) and cls.example_path
    assert isinstance(cls.text_tokens, int) and cls.text_tokens > 0
    assert len(cls.text_encoder_params) == len(cls.text_encoder_dirs)
    assert all(isinstance(n, str) and isinstance(k, int) and k > 0 for n, k in cls.text_encoder_params)
    assert isinstance(cls.sampling_uses_negative, bool)
    assert inspect.isclass(cls.pipeline_cls) and hasattr(cls.pipeline_cls, "encode_prompt")
    # the full-size config builds the family's transformer (meta device: no memory), and the dummy inputs for a
    # bucket are arguments its forward takes, shaped so that one forward runs
    with torch.device("meta"):
        model = cls.transformer_cls.from_config(cls.full_config)
    kw = cls.dummy_inputs(model, 1, 256, 256, cls.text_tokens, torch.bfloat16)
    params = inspect.signature(model.forward).parameters
    assert set(kw) <= set(params)
    # every argument forward requires is given (hidden_states for most; Z-Image's x, t, cap_feats lists)
    required = {n for n, p in params.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                     p.KEYWORD_ONLY)}
    assert required and required <= set(kw)
    # the pipeline's guidance arguments are ones its __call__ takes
    pipe_params = inspect.signature(cls.pipeline_cls.__call__).parameters
    fake_pipe = type("P", (), {"transformer": model})()
    assert set(cls.pipeline_guidance(fake_pipe, 3.5)) <= set(pipe_params)


# ---------------------------------------------------------------------------------------------- family facts only in models/

#: every spelling of every family key
NAMES = {n for f in ADAPTERS for n in (f, f.replace("-", "_"))}
_REGEX_CHARS = set("\\^$[]()*+?{}|")


def _outside_models() -> list[Path]:
    return [p for p in sorted(ROOT.rglob("*.py")) if "models" not in p.relative_to(ROOT).parts]


@functools.cache
def meta_model(cls):
    """The family's full-size transformer on the meta device (built once per adapter class)."""
    with torch.device("meta"):
        return cls.transformer_cls.from_config(cls.full_config)


@functools.cache
def _block_linear_names() -> frozenset[str]:
    """Names (relative to their block, "." appended, as trainer/quant.py matches them) of every Linear in the
    blocks of every family's full-size transformer, built on the meta device."""
    names, seen = set(), set()
    for cls in adapter_classes():
        if cls.transformer_cls in seen:
            continue
        seen.add(cls.transformer_cls)
        for b in cls().blocks(meta_model(cls)):
            names |= {n + "." for n, m in b.named_modules() if isinstance(m, torch.nn.Linear)}
    return frozenset(names)


def _family_regexes(text: str, names: frozenset[str]) -> bool:
    """`text` is a regular expression that picks out module names of some family: it compiles and matches a
    span of at least three letters of some block Linears' names but not of all (plain words, separators and
    generic name syntax such as `^[A-Za-z0-9._-]+$` do not count)."""
    if not _REGEX_CHARS & set(text):
        return False
    try:
        rx = re.compile(text)
    except re.error:
        return False
    hit = [any(sum(c.isalpha() for c in m.group(0)) >= 3 for m in rx.finditer(n)) for n in names]
    return any(hit) and not all(hit)


def _hits(tree: ast.AST, names: frozenset[str]) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in NAMES:
                out.append((node.lineno, f"family name {node.value!r}"))
            elif _family_regexes(node.value, names):
                out.append((node.lineno, f"module-name regex {node.value!r}"))
    return out


def test_no_family_names_tables_or_regexes_outside_models():
    """A family's name, a table keyed by it (`{"flux": ...}`, `("flux", "lora", 8)`) or a pattern of its module
    names (`norm[^.]*` / `_mod`) anywhere in trainer/ outside trainer/models/ fails: they belong on the adapter."""
    names = _block_linear_names()
    hits = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in _outside_models()
            for line, what in _hits(ast.parse(p.read_text()), names)]
    assert not hits, "family facts outside trainer/models/ (declare them on the adapter):\n" + "\n".join(hits)


@pytest.mark.parametrize("snippet", [
    'MEASURED = {("flux", "lora", 8): "fits"}',
    'VAE_PARAMS = {"qwen_image": 126_892_531}',
    'if family == "sd3": pass',
    'KEEP = re.compile(r"(^|\\.)(norm[^.]*|[^.]*_mod)\\.")',
])
def test_the_family_fact_check_catches_each_kind(snippet):
    assert _hits(ast.parse(snippet), _block_linear_names())


@pytest.mark.parametrize("snippet", [
    'm = re.match(r"\\s*([\\d.]+)\\s*(B|KiB|MiB|GiB|TiB)", text)',
    'x = f"{a}|{b}|{c}"',
    'NAME = re.compile(r"^(?P<method>lora|full)-(?P<gb>\\d+)gb$")',
])
def test_the_family_fact_check_passes_generic_code(snippet):
    assert not _hits(ast.parse(snippet), _block_linear_names())


# ---------------------------------------------------------------------------------------------- import cycles


def _module_names(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = p.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if p.name == "__init__.py" else parts)] = p
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks (never executed)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for b in node.body for n in ast.walk(b)}
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """trainer module -> the trainer modules it imports anywhere in its file (at the top or inside functions;
    `from pkg import name` resolves to the module pkg.name when there is one, else to pkg). `root`: the trainer
    folder."""
    mods = _module_names(root)
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        found = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                found |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        edges = set()
        for m in found:
            while m not in mods and "." in m:
                m = m.rpartition(".")[0]
            if m in mods and m != name and m.startswith("trainer"):
                edges.add(m)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


#: cycles through function-level imports that predate this test. Each is a known debt: when one is broken,
#: take it off this list (the test below then keeps it broken). Do not add to it.
KNOWN_CYCLES = {
    # choose_fraction (prediction) checks sampling's peak (phases), which predicts training (prediction)
    frozenset({"trainer.planner.phases", "trainer.planner.prediction", "trainer.planner.sampling"}),
    # block.py wraps blocks for nano-batching (nano), which swaps classes with block.py's helper
    frozenset({"trainer.offload.block", "trainer.offload.nano"}),
    # `dittrain cache` (cache.run_cache) plans with the pipeline, which uses the cache's jobs
    frozenset({"trainer.data.cache", "trainer.data.pipeline", "trainer.data.validation"}),
}


def test_no_import_cycles_counting_function_level_imports():
    found = set(cycles(import_graph()))
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    assert not new, f"import cycles (imports inside functions count too): {new}"
    fixed = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not fixed, f"these cycles are gone: take them off KNOWN_CYCLES: {fixed}"


def _unit(module: str) -> str:
    """The package or top-level module of trainer that `module` belongs to: trainer.data.cache -> trainer.data."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` (module -> modules) between trainer's packages and top-level modules; trainer/__init__.py, which
    only holds the version, left out."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        if _unit(m) != "trainer":
            out.setdefault(_unit(m), set()).update(_unit(t) for t in targets if _unit(t) not in (_unit(m), "trainer"))
    return out


def test_no_import_cycle_between_packages_counting_function_level_imports():
    graph = package_graph(import_graph())
    found = {" <-> ".join(sorted(c)): {a: sorted(graph[a] & c) for a in sorted(c)} for c in cycles(graph)}
    assert not found, f"import cycles between trainer's packages (imports inside functions count too): {found}"


def test_the_package_cycle_check_sees_a_cycle_no_module_cycle_shows(tmp_path):
    """a/x.py imports b/y.py, which imports a/w.py inside a function: no module imports itself back, but the
    packages a and b import each other. c.py imports a only under TYPE_CHECKING: no cycle."""
    files = {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from ..b.y import f\n",
        "a/w.py": "from .. import c\n",
        "b/__init__.py": "",
        "b/y.py": "def f():\n    from ..a import w\n\n    return w\n",
        "c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .a import x\n",
    }
    root = tmp_path / "trainer"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    graph = import_graph(root)
    assert graph["trainer.b.y"] == {"trainer.a.w"} and graph["trainer.c"] == set()
    assert not cycles(graph)
    assert cycles(package_graph(graph)) == [frozenset({"trainer.a", "trainer.b"})]
    (root / "b" / "y.py").write_text("def f():\n    return 1\n")
    assert not cycles(package_graph(import_graph(root)))


#: docs/architecture.md "What each package owns and may import": the layers, bottom first. A package or top-level module of
#: trainer/ imports only from layers below its own; a new one takes its place here (and in docs/architecture.md).
LAYERS = (
    {"offload", "errors", "atomic", "dtypes", "words", "progress"},
    {"phase_log"},
    {"quant"},
    {"models"},
    {"lora_format", "optim"},
    {"config"},
    {"planner", "data"},
    {"sampling", "captioning"},
    {"train"},
    {"sample", "merge", "demo", "preset_files"},
    {"cli"},
    {"__main__"},
)
#: the small modules every package but offload/ and quant.py may use
SHARED = {"errors", "atomic", "dtypes", "words", "progress", "phase_log"}
#: the same section's rules, package by package (the planner's own: test_planner_imports_only_what_it_may)
MAY_IMPORT = {
    "offload": set(),
    "quant": set(),
    "models": {"errors", "quant"},
    "lora_format": {"models", "errors", "atomic"},
    "data": {"models", "offload", "config", *SHARED},
    "optim": {"errors"},
    "sampling": {"models", "data", "offload", "lora_format", "planner", *SHARED},
    "captioning": {"data", "models", "offload", "planner", "quant", *SHARED},
}
#: the only modules outside the planner that import it (a name stands for the modules under it too)
PLANNER_IMPORTERS = ("trainer.train", "trainer.sample", "trainer.cli", "trainer.sampling.placement",
                     "trainer.captioning")


def test_packages_import_only_from_the_layers_below():
    layer = {f"trainer.{u}": i for i, units in enumerate(LAYERS) for u in units}
    graph = package_graph(import_graph())
    assert set(graph) <= set(layer), f"not placed in LAYERS: {sorted(set(graph) - set(layer))}"
    up = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer[b] >= layer[a])
    assert not up, f"imports that do not go down the layers: {up}"


def test_packages_import_only_what_the_readme_says():
    graph = package_graph(import_graph())
    bad = {p: sorted(u.removeprefix("trainer.") for u in graph[f"trainer.{p}"] - {f"trainer.{m}" for m in ok})
           for p, ok in MAY_IMPORT.items()}
    assert not {p: b for p, b in bad.items() if b}
    planner_users = sorted(m for m, targets in import_graph().items() if _unit(m) != "trainer.planner"
                           and any(_unit(t) == "trainer.planner" for t in targets))
    assert [m for m in planner_users if not any(m == p or m.startswith(p + ".") for p in PLANNER_IMPORTERS)] == []


def test_the_cycle_check_sees_imports_inside_functions():
    graph = {"a": {"b"}, "b": set()}
    assert not cycles(graph)
    graph["b"] = {"a"}
    assert cycles(graph) == [frozenset({"a", "b"})]
    g = import_graph()
    assert "trainer.planner.phases" in g["trainer.planner.prediction"]  # prediction imports phases in a function
    assert "trainer.config" not in g["trainer.models.base"]  # only under TYPE_CHECKING


# ---------------------------------------------------------------------------------------------- the registry


def test_family_spellings_resolve_and_unknown_ones_name_the_closest():
    for f in ADAPTERS:
        assert canonical_family(f) == f == canonical_family(f.replace("-", "_")) == canonical_family(f.upper())
    with pytest.raises(UserError, match="did you mean 'flux'"):
        canonical_family("fluxx")
    with pytest.raises(UserError, match="choose from " + ", ".join(ADAPTERS)):
        canonical_family("sdxl")


def test_every_family_writes_its_own_tiny_folders():
    folders = []
    for cls in adapter_classes():
        assert "tiny_builders" in cls.__dict__, f"{cls.__name__} must declare its own tiny_builders"
        own = cls.own_tiny_builders()
        assert own and all(callable(b) for b in own.values()), cls.__name__
        folders += own
    assert len(folders) == len(set(folders)), folders


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_every_adapter_declares_the_spec_facts(family):
    """The facts trainer/models/base.py declares, with the types it says, on every family."""
    cls = adapter_class(family)
    assert isinstance(cls.vae_params, int) and cls.vae_params > 0
    assert cls.latent_scale > 0 and cls.token_patch > 0
    assert cls.full_image_tokens(1024, 1024) == (1024 // (cls.latent_scale * cls.token_patch)) ** 2
    assert len(cls.text_encoder_classes) == len(cls.text_encoder_dirs)
    assert all(isinstance(d, str) for d in (*cls.tokenizer_dirs, *cls.extra_text_dirs))
    assert cls.max_sequence_length is None or isinstance(cls.max_sequence_length, int)
    assert isinstance(cls.takes_reference, bool) and isinstance(cls.text_uses_reference, bool)
    assert cls.takes_reference or not cls.text_uses_reference
    assert isinstance(cls.reference_optional, bool) and (cls.takes_reference or not cls.reference_optional)
    if cls.reference_optional:  # the planner counts an optional reference's tokens through `reference_inputs`:
        # arguments the forward takes, one reference adding at least the target's tokens (Flux.2 joins them to
        # hidden_states, Flux.3 passes them as a sequence of their own)
        kw = cls.dummy_inputs(meta_model(cls), 1, 256, 256, 8, torch.bfloat16)
        ref = cls.reference_inputs(kw, 1)

        def size(d):
            return sum(v.numel() for v in d.values() if torch.is_tensor(v))

        assert set(ref) <= set(inspect.signature(meta_model(cls).forward).parameters)
        assert size(ref) >= size(kw) + kw["hidden_states"].numel()
    assert cls.preset_cards and all(isinstance(c, int) for c in cls.preset_cards)
    assert isinstance(cls.cache_family(), str) and cls.cache_family()
    for pat in (cls.modulation_linears, cls.text_encoder_keep_linears):
        re.compile(pat)
    # the modulation pattern picks out some of the family's block Linears, and not all of them
    names = [n for b in cls().blocks(meta_model(cls)) for n, m in b.named_modules() if isinstance(m, torch.nn.Linear)]
    mod = [n for n in names if re.search(cls.modulation_linears, n + ".")] if cls.modulation_linears else []
    assert len(mod) < len(names)
    for (method, card), m in cls.__dict__.get("measured_presets", {}).items():
        assert method in ("lora", "full") and card in cls.preset_cards and m.note.startswith("measured")


def test_bench_is_a_package_without_path_edits():
    """bench/ is one package run from the repository root (`python -m bench.<group>.<name>`): no module edits
    sys.path, `bench.GROUPS` names exactly the modules of each group, and each imports as named."""
    import importlib

    import bench

    root = Path(__file__).resolve().parents[1] / "bench"
    on_disk = {g: sorted(p.stem for p in (root / g).glob("*.py") if p.stem != "__init__") for g in bench.GROUPS}
    assert on_disk == {g: sorted(ns) for g, ns in bench.GROUPS.items()}
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py"]  # every module sits in a group
    for path in [*root.rglob("*.py"), *Path(__file__).parent.glob("*.py")]:
        text = path.read_text()
        assert path.parent.name == "tests" or "sys.path" not in text, f"{path} edits sys.path"
        for group in re.findall(r"(?:from|import) bench\.(\w+)", text):  # imports inside functions too
            assert group in bench.GROUPS, f"{path} imports bench.{group}: not a group of bench.GROUPS"
    for g, names in bench.GROUPS.items():
        for n in names:
            assert importlib.import_module(f"bench.{g}.{n}") is bench.module(n)
