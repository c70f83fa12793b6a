"""What an experiment leaves and says against a real `kvlens simulate serve`: its three reports in
its out-dir with the README's install (the `serve` extra, no `rich`), the same report rebuilt by
`kvlens compare` over the arms' files, and a `--model` the endpoint does not serve refused before
anything is sent."""

from __future__ import annotations

import errno
import json
import os
import pty
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlens.cli import main
from tests.json_outputs import validate
from tests.live import Running, start_kvlens

pytestmark = pytest.mark.integration

# The README's install is `.[serve]`: `rich` (the analyze extra) is absent. The test venv has it,
# so the command runs in a process where importing it fails as it would there.
WITHOUT_RICH = """
import sys

class NoRich:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "rich":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoRich())
from kvlens.cli import main
sys.exit(main(sys.argv[1:]))
"""


def simulated(*flags: str) -> Running:
    return start_kvlens("simulate", "serve", *flags, ready="/health")


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    running = simulated("--speed", "1000", "--block-size", "16")
    yield running
    running.output()


def at_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run ``kvlens ARGV`` without rich, its stdout a terminal (where the report is printed as a
    table); its exit code and what it printed there."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-c", WITHOUT_RICH, *argv],
        stdout=follower,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(follower)
    chunks: list[bytes] = []

    def drain() -> None:  # a terminal's buffer is small: read it while the command writes
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError as error:  # EIO: the command has closed its end
                assert error.errno == errno.EIO
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    _, err = process.communicate(timeout=120)
    reader.join(timeout=10)
    os.close(leader)
    assert process.returncode is not None
    return process.returncode, b"".join(chunks).decode().replace("\r\n", "\n") + err


SHARED = ["--requests", "16", "--groups", "2", "--prefix-tokens", "256", "--traffic-rate", "50"]


@pytest.mark.timeout(180)
def test_prefix_cache_with_the_serve_extra_alone_writes_its_reports_and_compare_rebuilds_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    on = simulated("--speed", "1000", "--block-size", "16")
    off = simulated("--speed", "1000", "--block-size", "16", "--no-prefix-caching")
    runs = tmp_path / "runs"
    try:
        code, printed = at_a_terminal(
            [
                "experiment",
                "prefix-cache",
                "shared-prefix",
                "--endpoint",
                on.url,
                "--off-endpoint",
                off.url,
                "--model",
                "simulated",
                "--out-dir",
                str(runs),
                *SHARED,
                "--html",
                str(runs / "pages" / "compare.html"),  # the out-dir and this folder do not exist yet
            ]
        )
    finally:
        on.output()
        off.output()
    assert code == 0, printed
    markdown = (runs / "report.md").read_text()
    report = json.loads((runs / "report.json").read_text())
    assert markdown.startswith("# kvlens compare (baseline: off)\n")
    assert markdown in printed  # the text at the terminal, without rich, is the report's
    assert report["arms"] == ["off", "cold", "warm"]
    warmup = runs / "warm.warmup.jsonl"
    assert report["warmup_recorded_apart"] == {"warm": {"file": str(warmup), "requests": 8}}
    page = (runs / "report.html").read_text()
    assert page == (runs / "pages" / "compare.html").read_text()
    apart = f"warm: 0 requests kept out of the timed window; 8 replayed before it, recorded apart in {warmup}"
    assert f"<li>{apart}</li>" in page

    # `kvlens compare` over the arms' files: the same report, the warm-up line included
    arms = [f"--arm={arm}={runs / arm}.jsonl" for arm in ("off", "cold", "warm")]
    capsys.readouterr()
    assert main(["compare", *arms, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == report
    assert main(["compare", *arms, "--markdown"]) == 0
    assert capsys.readouterr().out == markdown
    assert f"- warm-up, {apart}\n" in markdown


@pytest.mark.timeout(180)
def test_quantization_writes_its_reports_and_its_plot_into_new_folders(
    server: Running, tmp_path: Path
) -> None:
    out = tmp_path / "quant"
    plot = tmp_path / "plots" / "attainment.svg"
    code, printed = at_a_terminal(
        [
            "experiment",
            "quantization",
            "shared-prefix",
            "--model",
            "simulated",
            "--endpoint",
            f"a={server.url}",
            "--endpoint",
            f"b={server.url}",
            "--out-dir",
            str(out),
            "--requests",
            "4",
            "--prefix-tokens",
            "64",
            "--suffix-tokens",
            "16",
            "--output-tokens",
            "4",
            "--concurrency",
            "2",
            "--rates",
            "20",
            "--plot",
            str(plot),
        ]
    )
    assert code == 0, printed
    text = (out / "report.md").read_text()
    assert text.startswith("# kvlens quantization (baseline: a)\n")
    assert max(len(line) for line in text.splitlines()) <= 80  # the text a terminal shows, whole
    assert text in printed
    result = json.loads((out / "report.json").read_text())
    validate(result)
    assert result["schema"] == "kvlens.quantization/v1"
    assert result["errors"] == {
        name: {"requests": 4, "failed": 0, "reasons": {}}
        for name in ("fixed-a", "fixed-a-long", "fixed-b", "fixed-b-long", "rate-20-a", "rate-20-b")
    }
    assert "<title>kvlens quantization" in (out / "report.html").read_text()
    assert plot.read_text().startswith("<svg")


def _commands(url: str, out: Path) -> dict[str, list[str]]:
    endpoint = ["--model", "wrong"]
    return {
        "replay": [
            "replay",
            "shared-prefix",
            "--endpoint",
            url,
            *endpoint,
            "--arm",
            "a",
            "--out",
            str(out / "a.jsonl"),
        ],
        "prefix-cache": [
            "experiment",
            "prefix-cache",
            "shared-prefix",
            "--endpoint",
            url,
            *endpoint,
            "--out-dir",
            str(out),
        ],
        "quantization": [
            "experiment",
            "quantization",
            "shared-prefix",
            *endpoint,
            "--endpoint",
            f"a={url}",
            "--endpoint",
            f"b={url}",
            "--out-dir",
            str(out),
            "--rates",
            "2",
        ],
    }


@pytest.mark.parametrize("command", ["replay", "prefix-cache", "quantization"])
def test_a_model_the_endpoint_does_not_serve_is_refused_before_anything_is_sent(
    server: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    code = main([*_commands(server.url, out)[command], *SHARED])
    assert code == 2
    assert capsys.readouterr().err == (
        f"kvlens: {server.url} does not serve --model 'wrong' (it serves: 'simulated')\n"
    )
    assert list(out.iterdir()) == []
