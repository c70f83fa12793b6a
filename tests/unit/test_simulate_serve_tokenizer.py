"""`kvlens simulate serve --tokenizer DIR`: text is counted as the `tokenizers` library counts it
with the same directory (what `vllm bench serve` and AIPerf read), generated text re-tokenizes to
the tokens the server reports, and the flag's mistakes are one line each."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlens.cli import main
from kvlens.simulate.serve import main as serve
from kvlens.simulate.serve import requests, tokenizer
from tests.unit.test_simulate_serve import flags

tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer extra")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "tokenizer"
TEXT = "Prefix caching pays off when the prompt's first blocks repeat: cached tokens skip prefill."


@pytest.fixture(scope="module")
def library() -> object:
    return tokenizers.Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))


def no_config(path: object) -> Any:
    """The settings loader ``kvlens simulate`` hands ``simulate serve``: unused without --config."""
    raise AssertionError(f"no --config in these tests, asked for {path}")


def served_with_tokenizer() -> requests.Served:
    _, served = serve._checked(flags("--tokenizer", str(FIXTURE)), no_config)
    return served


def test_text_prompts_are_counted_as_the_tokenizers_library_counts_them(library: object) -> None:
    served = served_with_tokenizer()
    expected = library.encode(TEXT).ids  # type: ignore[attr-defined]
    assert len(expected) < len(TEXT.encode())  # not one a byte: the mismatch the tools warned of
    answer = orjson.loads(requests.tokenize(served, orjson.dumps({"prompt": TEXT})))
    assert answer["tokens"] == expected and answer["count"] == len(expected)
    asked = requests.completion(served, {"prompt": TEXT, "max_tokens": 3}, None)
    assert asked.prompts == [expected]
    assert orjson.loads(requests.detokenize(served, orjson.dumps({"tokens": expected}))) == {"prompt": TEXT}
    assert served.vocab_size == library.get_vocab_size(with_added_tokens=True) == 2000  # type: ignore[attr-defined]


def test_chat_is_chatml_with_the_tokenizers_special_tokens_as_one_token_each(library: object) -> None:
    served = served_with_tokenizer()
    asked = requests.chat(served, {"messages": [{"role": "user", "content": TEXT}]}, None)
    rendered = tokenizer.chat_prompt([("user", TEXT)])
    (ids,) = asked.prompts
    assert ids == library.encode(rendered, add_special_tokens=False).ids  # type: ignore[attr-defined]
    im_start = library.token_to_id("<|im_start|>")  # type: ignore[attr-defined]
    assert ids.count(im_start) == 2  # the user's turn and the assistant's


@pytest.mark.parametrize(("count", "start"), [(1, 0), (7, 0), (100, 3), (1000, 0)])
def test_generated_text_re_tokenizes_to_the_generated_count(library: object, count: int, start: int) -> None:
    served = served_with_tokenizer()
    text = served.codec.generated_text(count, start)
    assert len(library.encode(text).ids) == count  # type: ignore[attr-defined]
    pieces = served.codec.generated_pieces()
    assert "".join(pieces[i % len(pieces)] for i in range(start, start + count)) == text


def test_a_context_is_measured_in_the_tokenizers_tokens(library: object) -> None:
    _, served = serve._checked(flags("--tokenizer", str(FIXTURE), "--max-model-len", "10"), no_config)
    with pytest.raises(requests.ApiError, match=f"your request has {len(library.encode(TEXT).ids)} input"):  # type: ignore[attr-defined]
        requests.completion(served, {"prompt": TEXT}, None)


def test_the_flags_mistakes_are_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "serve", "--tokenizer", str(FIXTURE), "--vocab-size", "3000"]) == 2
    assert capsys.readouterr().err == (
        "kvlens simulate serve: --vocab-size is the --tokenizer's: give one of them\n"
    )
    assert main(["simulate", "serve", "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlens simulate serve: --tokenizer: cannot read {tmp_path / 'tokenizer.json'}: ")
    assert err.count("\n") == 1
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert main(["simulate", "serve", "--tokenizer", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # the extra not installed
    assert main(["simulate", "serve", "--tokenizer", str(FIXTURE)]) == 2
    assert capsys.readouterr().err == (
        "kvlens simulate serve: --tokenizer needs the tokenizer extra: pip install "
        "'kvlens[tokenizer]' (from a checkout: pip install '.[tokenizer]')\n"
    )


def test_without_the_flag_text_is_one_token_a_byte() -> None:
    _, served = serve._checked(flags(), no_config)
    answer = orjson.loads(requests.tokenize(served, orjson.dumps({"prompt": "héllo"})))
    assert answer["count"] == 6 and served.vocab_size == tokenizer.DEFAULT_VOCAB_SIZE
