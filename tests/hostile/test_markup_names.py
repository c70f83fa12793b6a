"""Names from the records (model, tenant, request ids) in ``kvlens analyze``'s terminal report are
text, never rich markup: "[/x]" raised MarkupError, "[bold]z" lost its brackets."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvlens.cli import main


@pytest.mark.parametrize("text", ["[/x]", "[bold]z", "[link=e]m"])
def test_the_terminal_report_prints_names_as_text_never_as_markup(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "records.jsonl"
    records = [
        {"model": text, "tenant": "A", "prompt_tokens": 32, "cached_tokens": 0, "prefix_hashes": [1, 2]},
        {"model": text, "tenant": text, "request_id": text, "prompt_tokens": 32, "cached_tokens": 32,
         "prefix_hashes": [1, 2], "prefill_seconds": 0.01},
    ]  # fmt: skip
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    assert main(["analyze", str(path), "--engine", "numpy"]) == 0
    out = capsys.readouterr().out
    assert out.count(text) >= 3  # the model's row, the pair's getter and request id, as written
