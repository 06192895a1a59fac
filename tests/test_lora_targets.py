"""lora.targets that peft cannot adapt are one line naming the setting and the fix, never peft's traceback."""

from types import SimpleNamespace

import pytest
from _offload_util import tiny_flux

from trainer.config import LoraConfig
from trainer.errors import UserError
from trainer.train.model import add_lora


def _add(targets):
    return add_lora(tiny_flux(0, layers=1, singles=1), SimpleNamespace(lora=LoraConfig(targets=targets)), ("to_q",))


def test_a_target_that_names_a_container_says_which_linear_to_name():
    """`attn.to_out` is a ModuleList (the Linear and a Dropout) in diffusers' attention: peft raises TypeError."""
    with pytest.raises(UserError, match=r"lora.targets \[.attn.to_out.\]: a name matches a ModuleList, not a layer"
                                        r".*attn.to_out.0"):
        _add(["attn.to_out"])


def test_a_target_that_matches_nothing_is_named():
    with pytest.raises(UserError, match=r"lora.targets \['no_such_layer'\]"):
        _add(["no_such_layer"])


def test_the_linear_inside_the_container_trains():
    assert _add(["attn.to_out.0"])
