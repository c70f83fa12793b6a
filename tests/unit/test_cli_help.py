"""The command line's help and logging: a wrong flag shows the subcommand's usage, every flag says
what it does and its default, every command's help has examples, and log lines share one format
(text or JSON, one object per line) with uvicorn's."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import re

import pytest

from kvlens import logs
from kvlens.cli import main, parser_of


def leaves(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every command's own parser (``experiment``'s two kinds apart), by its ``prog``."""
    found: dict[str, argparse.ArgumentParser] = {}
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        return {parser.prog: parser}
    for sub in subparsers[0].choices.values():
        found.update(leaves(sub))
    return found


def every_command() -> dict[str, argparse.ArgumentParser]:
    return {
        **leaves(parser_of([])),
        **leaves(parser_of(["simulate", "run"])),
        **leaves(parser_of(["simulate", "serve"])),
    }


def test_every_command_is_walked() -> None:
    assert sorted(every_command()) == [
        "kvlens analyze", "kvlens audit isolation", "kvlens bandwidth", "kvlens compare", "kvlens convert",
        "kvlens demo",
        "kvlens experiment prefix-cache", "kvlens experiment quantization", "kvlens import", "kvlens replay",
        "kvlens serve", "kvlens simulate", "kvlens simulate run", "kvlens simulate serve",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("analyze", ["analyze", "--no-such-flag"]),
        ("bandwidth", ["bandwidth", "--params", "8B", "--bogus", "1"]),
        (
            "experiment prefix-cache",
            [
                "experiment",
                "prefix-cache",
                "shared-prefix",
                *("--endpoint", "u", "--model", "m", "--out-dir", "d"),
                "--nope",
            ],
        ),
        ("simulate run", ["simulate", "run", "--nope"]),
        ("simulate serve", ["simulate", "serve", "--nope"]),
    ],
)
def test_a_wrong_flag_shows_the_subcommands_usage(
    command: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvlens {command} "), err
    assert err.splitlines()[-1].startswith(f"kvlens {command}: error: unrecognized arguments: --"), err


def option_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


@pytest.mark.parametrize("prog", sorted(every_command()))
def test_every_flag_has_help_and_shows_its_default(prog: str) -> None:
    parser = every_command()[prog]
    text = " ".join(parser.format_help().split())  # argparse wraps at the terminal's width
    assert "default: None" not in text and "default: False" not in text
    for action in option_actions(parser):
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        assert action.help, f"{prog} {action.option_strings[0]} has no help"
        # a default written by hand beside the one the formatter adds says it twice
        assert not re.search(r"\(default [^:]|\(\d[\d.,]*\)$", action.help), action.help
        if action.default is not None and action.default is not False and action.default != []:
            shown = " ".join(f"(default: {action.default})".split())
            assert shown in text, f"{prog} {action.option_strings[0]}: no {shown!r}"


@pytest.mark.parametrize("prog", sorted(every_command()))
def test_every_command_has_examples_and_its_help_fits_80_columns(
    prog: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to it
    text = every_command()[prog].format_help()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    examples = text.split("examples:\n", 1)[1]
    lines = [line.strip() for line in examples.splitlines() if line.strip().startswith("kvlens ")]
    assert lines, text
    assert all(line.startswith(prog + " ") or line == prog for line in lines), lines


def records_of(level: str, fmt: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Log through the configuration the CLI installs (and hands to uvicorn as its log_config)
    one line from kvlens and one from uvicorn's own logger, as they reach stderr."""
    logging.config.dictConfig(logs.config(level, fmt))
    try:
        logging.getLogger("kvlens.test").info("hello %s", "there")
        logging.getLogger("uvicorn.error").info("Uvicorn running on %s", "http://127.0.0.1:1")
        logging.getLogger("kvlens.test").debug("not at info")
    finally:
        logging.config.dictConfig(logs.config("WARNING", "text"))
    return capsys.readouterr().err.splitlines()


def test_text_log_lines_have_one_format_with_uvicorns(capsys: pytest.CaptureFixture[str]) -> None:
    lines = records_of("info", "text", capsys)
    assert len(lines) == 2
    pattern = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO "
    assert all(re.match(pattern, line) for line in lines), lines
    assert lines[0].endswith(" INFO kvlens.test: hello there")
    assert lines[1].endswith(" INFO uvicorn.error: Uvicorn running on http://127.0.0.1:1")


def test_json_log_lines_are_one_object_each(capsys: pytest.CaptureFixture[str]) -> None:
    lines = records_of("INFO", "json", capsys)
    objects = [json.loads(line) for line in lines]
    assert [set(o) for o in objects] == [{"ts", "level", "logger", "message"}] * 2
    assert [(o["level"], o["logger"], o["message"]) for o in objects] == [
        ("INFO", "kvlens.test", "hello there"),
        ("INFO", "uvicorn.error", "Uvicorn running on http://127.0.0.1:1"),
    ]
    assert objects[0]["ts"].endswith("Z") and objects[0]["ts"][10] == "T"


def test_the_environment_sets_the_defaults_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLENS_LOG_FORMAT", "json")
    monkeypatch.setenv("KVLENS_LOG_LEVEL", "WARNING")
    args = parser_of(["analyze"]).parse_args(["analyze", "x.jsonl"])
    assert (args.log_level, args.log_format) == ("warning", "json")
    args = parser_of(["analyze"]).parse_args(["analyze", "x.jsonl", "--log-format", "text"])
    assert args.log_format == "text"
    monkeypatch.setenv("KVLENS_LOG_LEVEL", "")  # set but empty, as a compose file may leave it: unset
    assert parser_of(["analyze"]).parse_args(["analyze", "x.jsonl"]).log_level == "info"


def test_a_bad_log_setting_from_the_environment_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVLENS_LOG_FORMAT", "yaml")
    assert main(["analyze", "--print-sql"]) == 2
    err = capsys.readouterr().err
    assert err == "kvlens: KVLENS_LOG_FORMAT='yaml' is not one of text, json\n"


def test_version_is_the_installed_distributions_and_looked_up_only_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from importlib.metadata import version

    import kvlens

    kvlens.__dict__.pop("__version__", None)  # not read yet in this process, or forgotten
    parser_of(["analyze", "x.jsonl"])
    assert "__version__" not in kvlens.__dict__  # building the parser did not look it up
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"kvlens {version('kvlens')}\n"
    assert kvlens.__dict__["__version__"] == version("kvlens")
