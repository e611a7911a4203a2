"""EngineConfig: every field documented, bad options refused at construction, config.json read once per
model."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from sluice.engine import LLM, EngineConfig
from sluice.engine.config import SpeculativeConfig

MODELS = Path(__file__).resolve().parent.parent / "models"


def test_every_setting_has_a_one_line_help():
    for f in fields(EngineConfig):
        if f.init:
            help_text = f.metadata.get("help", "")
            assert help_text and "\n" not in help_text, f.name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp8"}, "unknown dtype 'fp8'"),
        ({"kv_cache_dtype": "int4"}, "unknown kv_cache_dtype 'int4'"),
        ({"quantization": "int3"}, "unknown quantization 'int3'"),
        ({"quantization": "int4", "quant_type": "nf2"}, "unknown quant_type 'nf2'"),
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"speculative": {"method": "ngram", "k": 2}}, "unknown speculative option"),
        ({"speculative": {"method": "draft", "model": "d", "quantization": "int3"}},
         "unknown quantization 'int3'"),
    ],
)
def test_bad_options_fail_when_the_config_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/nonexistent", **kwargs)  # refused before any file is looked at


def test_speculative_dict_is_parsed_once_into_a_typed_config():
    cfg = EngineConfig(model="m", speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3)
    assert EngineConfig(model="m").speculative_config is None


def test_config_json_is_read_once_per_model(monkeypatch):
    reads: list[str] = []
    real = Path.read_text

    def counting(self, *args, **kwargs):
        if self.name == "config.json":
            reads.append(self.parent.name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting)
    LLM(str(MODELS / "sluice-tiny"), dtype="float32", device="cpu", kv_cache_memory_gb=0.01,
        speculative={"method": "draft", "model": str(MODELS / "sluice-tiny-draft"),
                     "quantization": "int8_weight_only"})
    assert sorted(reads) == ["sluice-tiny", "sluice-tiny-draft"]
