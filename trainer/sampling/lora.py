"""Apply LoRA files to a pipeline exactly as diffusers does, and fail clearly when a file does not fit.

Loading goes through the pipeline's own `load_lora_weights` (one adapter per file) and `set_adapters` (the
per-file weights), so a LoRA changes an image here exactly as it does in any diffusers script: there is no second
implementation to drift. What diffusers does not do is refuse a file made for another model; depending on how the
keys differ it raises an error deep in peft, logs a warning and loads part of the file, or logs that "no LoRA keys"
were found and loads nothing. All three become one `UserError` naming the file:

- an exception from diffusers / peft (shape mismatch, keys without "lora", target modules not in the model);
- a warning from the `diffusers` logger about unexpected or missing LoRA keys (captured while loading);
- an adapter that ended up in no component of the pipeline.

LoKr and LoHa files (lora.type) are in peft's format, which `load_lora_weights` does not read: they are loaded with
peft itself (`load_peft_file`: the adapter built from the peft config in the header, weights set by key).
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError
from .request import LoraSpec

# "No LoRA keys associated to <component>" is not among them: diffusers logs it for every component a file has no
# weights for (a transformer-only LoRA and the text encoders); a file that fits no component at all is caught by
# the adapter check after loading.
_BAD_SIGNS = ("unexpected keys", "missing keys", "not found in the base model")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _diffusers_warnings():
    """Collect what diffusers (and peft, which uses `warnings`) report while a LoRA loads."""
    import warnings

    cap = _Capture()
    logger = logging.getLogger("diffusers")
    # diffusers' own handler is swapped out meanwhile: what matters becomes our one-line error, and the benign
    # "No LoRA keys associated to <text encoder>" notices would only be noise.
    saved = logger.handlers[:]
    logger.handlers = [cap]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield cap
        cap.messages += [str(w.message) for w in caught]
    finally:
        logger.handlers = saved


def _short(msg: str, limit: int = 160) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _explain(msg: str, family: str) -> str:
    """diffusers' / peft's message in a few words: which weight did not fit and how."""
    msg = " ".join(msg.split())
    m = re.search(r"unexpected keys found in the model: (.*?)\.?\s*$", msg)
    if m:
        keys = [k.strip() for k in m.group(1).split(",") if k.strip()]
        return f"{len(keys)} LoRA weights match no layer of this {family} model (first: {keys[0]})"
    m = re.search(
        r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from checkpoint, "
        r"the shape in current model is torch\.Size\((\[[^\]]*\])\)",
        msg,
    )
    if m:
        name, got, want = m.groups()
        name = re.sub(r"\.lora\d+\.", ".", name)  # drop our adapter name: the key as the file has it
        return f"{name} has shape {got} in the file, this {family} model needs {want}"
    return _short(msg)


def adapter_name(index: int) -> str:
    return f"lora{index}"


def load_peft_file(transformer, path, adapter: str = "default", weight: float = 1.0) -> None:
    """Load a LoKr / LoHa file written by dittrain into `transformer` with peft: the adapter is built from the peft
    config in the file's header and its weights set by key; `weight` scales the update (like set_adapters)."""
    from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lycoris_utils import LycorisLayer
    from safetensors.torch import load_file

    from ..lora_format import DIFFUSERS_PREFIX, LORA_METADATA_KEY, lora_metadata, peft_config

    meta = lora_metadata(path)
    if LORA_METADATA_KEY not in meta:
        raise UserError(f"{path}: no peft config in the file's header (a LoKr / LoHa file saved by dittrain is expected)")
    raw = peft_config(meta)
    raw["peft_type"] = str(raw["peft_type"]).rsplit(".", 1)[-1]
    config = PeftConfig.from_peft_type(**{k: v for k, v in raw.items() if v is not None or k == "target_modules"})
    config.inference_mode = True
    inject_adapter_in_model(config, transformer, adapter_name=adapter)
    sd = {k.removeprefix(DIFFUSERS_PREFIX): v for k, v in load_file(str(path)).items()}
    result = set_peft_model_state_dict(transformer, sd, adapter_name=adapter)
    missing = [k for k in getattr(result, "missing_keys", []) if f".{adapter}" in k]
    if getattr(result, "unexpected_keys", None) or missing:
        raise UserError(f"{path}: adapter keys do not match this model (unexpected "
                        f"{list(result.unexpected_keys)[:3]}, missing {missing[:3]})")
    if weight != 1.0:
        for m in transformer.modules():
            if isinstance(m, LycorisLayer) and adapter in m.scaling:
                m.scaling[adapter] *= weight


def load_loras(pipe, specs: list[LoraSpec], family: str) -> list[str]:
    """Load each file as adapter `lora<i>` and activate them all with their weights. Returns the adapter names.

    A LoKr / LoHa file (peft's format, which `load_lora_weights` does not read) is loaded with `load_peft_file`,
    alone: peft cannot stack it with other adapters on the same layers. A comfy / kohya file (output.lora_format)
    is converted to the diffusers layout in a temporary folder first (trainer/lora_format/)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dittrain-lora-") as tmp:
        return _load_loras(pipe, specs, family, _diffusers_copies(specs, family, tmp))


def _diffusers_copies(specs: list[LoraSpec], family: str, tmp: str) -> list:
    """The path to load for each spec: the file itself, or its diffusers-layout copy under `tmp`."""
    from ..lora_format import convert_lora, file_format

    paths = []
    for i, spec in enumerate(specs):
        if file_format(spec.path) == "diffusers":
            paths.append(spec.path)
        else:
            paths.append(Path(tmp) / f"{i}.safetensors")
            convert_lora(spec.path, paths[-1], "diffusers", family)
    return paths


def _load_loras(pipe, specs: list[LoraSpec], family: str, paths: list) -> list[str]:
    from ..lora_format import LORA_KINDS, lora_kind, lora_metadata

    def kind(path) -> str:
        try:
            return lora_kind(lora_metadata(path))
        except Exception:  # not a readable safetensors header: diffusers' loader below says what is wrong
            return "lora"

    from ..models import adapter_class

    fam = adapter_class(family)
    kinds = [kind(p) for p in paths]
    # a kind diffusers' loader does not take (LoKr, LoHa: trainer/lora_format/kinds.py) goes through peft
    lycoris = [(s, k) for s, k in zip(specs, kinds, strict=True) if not (k in LORA_KINDS
                                                                         and LORA_KINDS[k].loads_with_diffusers)]
    if lycoris and len(specs) > 1:
        s, k = lycoris[0]
        raise UserError(f"{s.path}: a {k} adapter is loaded through peft and cannot be combined with other --lora "
                        "files; sample with it alone (or merge the others first)")
    if lycoris:
        s, k = lycoris[0]
        try:
            load_peft_file(pipe.transformer, paths[0], adapter_name(0), s.weight)
        except (ValueError, RuntimeError, KeyError, TypeError) as e:
            raise UserError(f"{s.path}: {k} adapter does not fit this model: {_explain(str(e), family)}; "
                            "was it trained for another model?") from None
        return [adapter_name(0)]
    names = []
    for i, spec in enumerate(specs):
        name = adapter_name(i)
        hint = "was it trained for another model? (model.path in the config is the model it is applied to)"
        with _diffusers_warnings() as cap:
            try:
                # a family of experts: the expert the file's name picks (Wan 2.2: load_into_transformer_2)
                pipe.load_lora_weights(str(paths[i]), adapter_name=name, **fam.lora_load_kwargs(spec.path))
            except (ValueError, RuntimeError, KeyError, TypeError) as e:
                raise UserError(
                    f"{spec.path}: LoRA does not fit this model: {_explain(str(e), family)}; {hint}"
                ) from None
        bad = [m for m in cap.messages if any(s in m for s in _BAD_SIGNS)]
        if bad:
            raise UserError(
                f"{spec.path}: LoRA keys do not match this model: {_explain(bad[0], family)}; {hint}"
            )
        loaded_into = [part for part, adapters in pipe.get_list_adapters().items() if name in adapters]
        if not loaded_into:
            raise UserError(f"{spec.path}: no LoRA weights in this file match the model; {hint}")
        names.append(name)
    if names:
        pipe.set_adapters(names, adapter_weights=[s.weight for s in specs])
    return names
