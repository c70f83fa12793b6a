"""An endpoint's credentials in ``kvlens replay`` and ``kvlens experiment``: a URL's
``user:password@`` is never printed (errors, logs, records, reports) and goes, as Basic auth, to
every call and every stream; the API key comes from ``--api-key-file`` or ``$OPENAI_API_KEY``
(not only a flag anyone can read in the process list) and goes to every call and stream too."""

from __future__ import annotations

import base64
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlens.cli import main
from tests.hostile.test_experiment_checks_hostile import GOOD, MODELS

pytestmark = pytest.mark.integration
SECRET = "s3cr3t-Pa55"
USER = "alice-the-user"
BASIC = "Basic " + base64.b64encode(f"{USER}:{SECRET}".encode()).decode()


class Recording:
    """A well-behaved endpoint that keeps each request's path and authorization header."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.seen: list[tuple[str, str | None]] = []

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.answer, args=(sock,), daemon=True).start()

    def answer(self, sock: socket.socket) -> None:
        with sock:
            data = b""
            while b"\r\n\r\n" not in data:
                more = sock.recv(65536)
                if not more:
                    return
                data += more
            head = data.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
            fields = dict(line.split(":", 1) for line in head[1:])
            fields = {name.strip().lower(): value.strip() for name, value in fields.items()}
            path = head[0].split(" ")[1]
            self.seen.append((path, fields.get("authorization")))
            length = int(fields.get("content-length", "0"))
            body = data.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += sock.recv(65536)
            answer = {"/v1/models": MODELS, "/v1/completions": GOOD}.get(path, b"{}")
            kind = b"text/event-stream" if path == "/v1/completions" else b"application/json"
            sock.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                % (kind, len(answer), answer)
            )


@pytest.fixture
def recording() -> Iterator[Recording]:
    server = Recording()
    threading.Thread(target=server.serve, daemon=True).start()
    yield server
    server.listener.close()


def replay(url: str, out: Path, *flags: str) -> int:
    args = ["replay", "shared-prefix", "--endpoint", url, "--model", "m", "--arm", "a", "--out", str(out)]
    return main([*args, "--requests", "1", "--reset", *flags])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _nothing_secret(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text and USER not in text, text


def test_a_url_with_userinfo_is_never_printed_when_the_endpoint_is_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Before: "kvlens: http://alice-the-user:s3cr3t-Pa55@127.0.0.1:PORT does not answer (...)"."""
    port = _free_port()
    url = f"http://{USER}:{SECRET}@127.0.0.1:{port}"
    assert replay(url, tmp_path / "a.jsonl") == 2
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == (
        f"kvlens: http://127.0.0.1:{port} does not answer (http://127.0.0.1:{port}/v1/models: ConnectError)"
    )
    _nothing_secret(out, err, caplog.text)
    quantization = ["experiment", "quantization", "shared-prefix", "--model", "m", "--out-dir", str(tmp_path)]
    assert main([*quantization, "--endpoint", f"a={url}", "--endpoint", f"b={url}"]) == 2
    assert main([*quantization, "--endpoint", url, "--endpoint", f"b={url}"]) == 2  # no NAME=
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == "kvlens: --endpoint takes NAME=URL (e.g. bf16=http://host:8000)"
    _nothing_secret(out, err, caplog.text)


def test_a_urls_basic_auth_goes_to_every_call_and_stream_and_nowhere_else(
    recording: Recording, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the checks (httpx reads a URL's userinfo) had it, the streams did not."""
    out = tmp_path / "a.jsonl"
    assert replay(f"http://{USER}:{SECRET}@127.0.0.1:{recording.port}", out) == 0
    assert sorted(set(recording.seen)) == [
        ("/metrics", BASIC),
        ("/reset_prefix_cache", BASIC),
        ("/v1/completions", BASIC),
        ("/v1/models", BASIC),
    ]
    assert json.loads(out.read_text())["cached_tokens"] == 16
    printed, err = capsys.readouterr()
    _nothing_secret(printed, err, caplog.text, out.read_text())


def test_the_api_key_comes_from_a_file_or_the_environment_and_goes_to_every_call(
    recording: Recording, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: --api-key only (seen by anyone in the process list): --api-key-file was unknown."""
    url = f"http://127.0.0.1:{recording.port}"
    key_file = tmp_path / "key"
    key_file.write_text(f"{SECRET}-file\n")
    monkeypatch.setenv("OPENAI_API_KEY", f"{SECRET}-env")
    assert replay(url, tmp_path / "a.jsonl", "--api-key-file", str(key_file)) == 0
    assert {auth for _, auth in recording.seen} == {f"Bearer {SECRET}-file"}
    recording.seen.clear()
    assert replay(url, tmp_path / "b.jsonl") == 0
    assert {auth for _, auth in recording.seen} == {f"Bearer {SECRET}-env"}
    recording.seen.clear()
    # the environment's key gives way to a URL's own credentials
    assert replay(f"http://{USER}:{SECRET}@127.0.0.1:{recording.port}", tmp_path / "c.jsonl") == 0
    assert {auth for _, auth in recording.seen} == {BASIC}
    printed, err = capsys.readouterr()
    assert SECRET not in printed + err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--api-key-file", "{tmp}/missing"], "--api-key-file {tmp}/missing: No such file or directory"),
        (["--api-key-file", "{tmp}/blank"], "--api-key-file {tmp}/blank: it is blank"),
        (["--api-key", "k", "--api-key-file", "{tmp}/blank"], None),  # argparse: one of them
        (
            ["--api-key", "k"],
            "http://127.0.0.1:{port}: credentials in the URL and an API key: give one of them",
        ),
    ],
)
def test_a_key_that_cannot_be_used_is_refused_before_any_request(
    recording: Recording,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str | None,
) -> None:
    (tmp_path / "blank").write_text("\n")
    given = [flag.format(tmp=tmp_path) for flag in flags]
    url = f"http://{USER}:{SECRET}@127.0.0.1:{recording.port}"
    if message is None:
        with pytest.raises(SystemExit) as exit_:
            replay(url, tmp_path / "a.jsonl", *given)
        assert exit_.value.code == 2
    else:
        assert replay(url, tmp_path / "a.jsonl", *given) == 2
        assert capsys.readouterr().err.splitlines()[-1] == "kvlens: " + message.format(
            tmp=tmp_path, port=recording.port
        )
    assert recording.seen == []
