"""The worker's flags come from EngineConfig's fields: every settable field has one, typed, and reaches
LLM."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import typer
from typer.testing import CliRunner

from sluice.engine.config import EngineConfig
from sluice.worker import engine_flags
from sluice.worker.cli import worker


@pytest.fixture(scope="module")
def command():
    app = typer.Typer()
    app.command()(worker)
    return typer.main.get_command(app)


def parse(command, *args: str) -> dict:
    return dict(command.make_context("worker", list(args)).params)


def test_every_settable_field_is_a_flag_of_its_type(command):
    flags = {p.name: p.opts for p in command.params}
    helps = {p.name: p.help for p in command.params}
    hints = typing.get_type_hints(EngineConfig)
    settable = [f for f in dataclasses.fields(EngineConfig) if f.init and f.name not in engine_flags.SKIPPED]
    assert len(settable) >= 10
    samples = {int: ("7", 7), float: ("0.5", 0.5), str: ("abc", "abc")}
    for f in settable:
        flag = "--" + f.name.replace("_", "-")
        assert flags[f.name] == [flag], f.name
        assert helps[f.name] == f.metadata["help"], f"{f.name}: the help is the config field's own"
        assert parse(command)[f.name] is None, f"{f.name}: the config, not the CLI, holds the default"
        kind = engine_flags._unwrap_optional(hints[f.name])
        if kind is bool:
            assert parse(command, flag)[f.name] is True and parse(command,
                                                                  "--no-" + flag[2:])[f.name] is False
        elif engine_flags.is_json(hints[f.name]):
            assert engine_flags.engine_kwargs(parse(command, flag, '{"a": [1]}'))[f.name] == {"a": [1]}
        elif kind in samples:
            text, value = samples[kind]
            parsed = parse(command, flag, text)[f.name]
            assert parsed == value and type(parsed) is kind, f.name


def test_given_flags_reach_the_engine_config_and_the_rest_keep_its_defaults(command):
    options = parse(
        command, "--model", "m", "--dtype", "float32", "--max-num-seqs", "4", "--no-enable-prefix-caching",
        "--speculative", '{"method": "ngram", "num_speculative_tokens": 3}', "--grace", "2",
    )  # fmt: skip
    kwargs = engine_flags.engine_kwargs(options)
    assert kwargs == {
        "dtype": "float32",
        "max_num_seqs": 4,
        "enable_prefix_caching": False,
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
    }
    assert options["grace"] == 2.0 and options["model"] == "m" and "dtype" not in options
    config = EngineConfig.from_kwargs("m", **kwargs)
    assert config.max_num_seqs == 4 and config.block_size == EngineConfig("m").block_size


def test_bad_json_and_missing_model_fail_clearly(command, monkeypatch):
    with pytest.raises(typer.BadParameter) as bad:
        engine_flags.engine_kwargs(parse(command, "--speculative", "{nope"))
    assert "--speculative" in bad.value.format_message() and "not valid JSON" in bad.value.format_message()
    monkeypatch.delenv("SLUICE_MODEL", raising=False)
    out = CliRunner().invoke(_app(), ["--max-num-seqs", "2"])
    assert out.exit_code == 2 and "SLUICE_MODEL" in out.output


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(worker)
    return app


def test_help_comes_from_field_metadata_or_attribute_docstrings():
    @dataclasses.dataclass
    class Example:
        width: int = 3
        """How wide, in cells."""
        depth: int = dataclasses.field(default=1, metadata={"help": "How deep."})

    assert engine_flags.field_docs(Example) == {"width": "How wide, in cells."}
    help_of = {f.name: engine_flags._option(f, int, engine_flags.field_docs(Example).get(f.name, ""))[1].help
               for f in dataclasses.fields(Example)}  # fmt: skip
    assert help_of == {"width": "How wide, in cells.", "depth": "How deep."}
