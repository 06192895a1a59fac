"""The package boundaries the architecture promises (README "Architecture"), read from the source with `ast`, and
the family facts every model adapter must provide.

- trainer/offload/ (the conductor) imports nothing from the planner, the config or the model adapters;
- trainer/planner/ imports only the conductor's arithmetic (offload.plan, offload.allocators, and fused.py's list
  of optimizers whose state is packed), models/, quant (the loader's quantized layout), config, errors, dtypes and
  itself, with no import cycle;
- nothing outside trainer/models/ compares a family name (`family == "flux"`): facts live on the adapters.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from trainer.models import ADAPTERS, adapter_class

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


ALLOWED = ("trainer.offload.plan", "trainer.offload.allocators", "trainer.offload.fused", "trainer.models",
           "trainer.config", "trainer.errors", "trainer.dtypes", "trainer.planner", "trainer.quant")


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
    assert "hidden_states" in kw and "timestep" in kw
    # the pipeline's guidance arguments are ones its __call__ takes
    pipe_params = inspect.signature(cls.pipeline_cls.__call__).parameters
    fake_pipe = type("P", (), {"transformer": model})()
    assert set(cls.pipeline_guidance(fake_pipe, 3.5)) <= set(pipe_params)
