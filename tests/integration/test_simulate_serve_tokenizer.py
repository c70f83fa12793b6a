"""`kvlens simulate serve --tokenizer DIR` as a process: a streamed answer's text re-tokenizes,
with the same directory, to the completion tokens the server reports, and the prompt is counted
as the `tokenizers` library counts it (what AIPerf and `vllm bench serve` check: without the flag
AIPerf measured 600.5 prompt tokens a request against its own 256 and warned of a discrepancy)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.live import start_kvlens

pytestmark = pytest.mark.integration
tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer extra")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "tokenizer"


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_and_prompt_count_as_the_client_counts_them(chat: bool) -> None:
    library = tokenizers.Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    running = start_kvlens(
        "simulate", "serve", "--tokenizer", str(FIXTURE), "--speed", "1000", ready="/health"
    )
    try:
        api = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        prompt = "How much of the prompt came from the prefix cache, and did the first token come sooner?"
        options = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 37}
        text, usage = "", None
        if chat:
            stream = api.chat.completions.create(
                model="simulated", messages=[{"role": "user", "content": prompt}], **options
            )
            for chunk in stream:
                usage = chunk.usage or usage
                text += "".join(choice.delta.content or "" for choice in chunk.choices)
            expected_prompt = len(
                library.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n").ids
            )
        else:
            for piece in api.completions.create(model="simulated", prompt=prompt, **options):
                usage = piece.usage or usage
                text += "".join(choice.text for choice in piece.choices)
            expected_prompt = len(library.encode(prompt).ids)
        assert usage is not None
        assert usage.completion_tokens == 37 == len(library.encode(text).ids)
        assert usage.prompt_tokens == expected_prompt
    finally:
        running.output()
