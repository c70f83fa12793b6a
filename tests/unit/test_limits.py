"""kvlens.limits owns the sizes (one parser, for flags, settings and DuckDB's own '1.8 GiB') and
the default port; the settings and the engine they feed take the same sizes."""

from __future__ import annotations

import pytest

from kvlens import limits
from kvlens.config import load_settings
from kvlens.errors import InputError, SettingsError

GIB = 2**30


def test_one_size_parser() -> None:
    assert limits.parse_size("14GiB") == 14 * GIB
    assert limits.parse_size("16 GB") == 16e9
    assert limits.parse_size("1.5e10") == 1.5e10
    assert limits.parse_size("1.8 GiB") == 1.8 * GIB  # DuckDB's current_setting('memory_limit')
    assert limits.parse_size("512 bytes") == 512  # DuckDB's form below a KiB
    for text in ("", "GiB", "14 GiBs", "-1GiB", "0", "nan", "1e400"):
        with pytest.raises(ValueError, match="size"):
            limits.parse_size(text)


@pytest.mark.parametrize("text", ["2GiB", "2 GiB", "2gib", "1.5e10", "2147483648", "20MB", "2 gigs"])
def test_the_settings_and_the_engine_take_the_same_memory_limits(text: str) -> None:
    pytest.importorskip("duckdb", reason="the scale extra")
    from kvlens.analysis.duckdb.engine import Engine

    try:
        load_settings(analyze_memory_limit=text)
        settings_take = True
    except SettingsError:
        settings_take = False
    try:
        engine = Engine(memory_limit=text)
    except InputError as error:
        assert str(error) == f"memory limit {text!r} is not a size DuckDB takes"
        engine_takes = False
    else:
        # DuckDB holds it rounded to its display ('1.9 GiB'): within 5 %
        assert engine.memory_limit_bytes() == pytest.approx(limits.parse_size(text), rel=0.05)
        engine.close()
        engine_takes = True
    assert (settings_take, engine_takes) == (text != "2 gigs",) * 2


def test_the_default_memory_limit_and_port_have_one_owner() -> None:
    settings = load_settings()
    defaults = (limits.DEFAULT_MEMORY_LIMIT, limits.DEFAULT_PORT)
    assert (settings.analyze_memory_limit, settings.port) == defaults
    assert (limits.DEFAULT_MEMORY_LIMIT, limits.DEFAULT_PORT) == ("2GiB", 9433)


def test_only_limits_spells_the_default_port() -> None:
    import ast
    from pathlib import Path

    package = Path(limits.__file__).parent
    spelled = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        spelled += [
            f"{path.relative_to(package)}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and id(node) not in docstrings
            and (node.value == limits.DEFAULT_PORT or "9433" in str(node.value))
            and path.name != "limits.py"
        ]
    assert spelled == []
