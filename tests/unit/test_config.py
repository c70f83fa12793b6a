"""Settings: sources and precedence, every error reported at once (the settings page's table and
example: tests/unit/test_docs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlens.cli import main
from kvlens.config import load_offline, load_settings
from kvlens.errors import SettingsError


def test_defaults() -> None:
    settings = load_settings()
    assert settings.host == "127.0.0.1"
    assert settings.latency_buckets_seconds[0] == 0.001 and settings.latency_buckets_seconds[-1] == 120.0
    assert settings.cost_model_for("anything").b == pytest.approx(1 / 1024)


def test_flags_over_environment_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "kvlens.yaml"
    config.write_text(
        "port: 9000\nmax_models: 7\nprompt_length_edges: [100, 1000]\n"
        "cost_models:\n  llama:\n    a: 2\n    b: 0.5\n"
    )
    monkeypatch.setenv("KVLENS_PORT", "9100")
    monkeypatch.setenv("KVLENS_MAX_MODELS", "9")
    settings = load_settings(config, max_models=11)
    assert settings.port == 9100  # environment beats the file
    assert settings.max_models == 11  # a flag beats the environment
    assert settings.prompt_length_edges == [100, 1000]  # from the file
    assert settings.cost_model_for("llama").a == 2.0


def test_all_errors_are_reported_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLENS_PORT", "70000")
    monkeypatch.setenv("KVLENS_PROMPT_LENGTH_EDGES", "[512, 256]")
    monkeypatch.setenv("KVLENS_LATENCY_BUCKETS_SECONDS", "[0.1, -1]")
    monkeypatch.setenv("KVLENS_MODELS", '["ok", "bad\\nname"]')
    with pytest.raises(SettingsError) as caught:
        load_settings()
    message = str(caught.value)
    assert message.startswith("4 invalid setting(s)")
    for name in ("port", "prompt_length_edges", "latency_buckets_seconds", "models"):
        assert name in message


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    config = tmp_path / "kvlens.yaml"
    config.write_text("prot: 9000\n")
    with pytest.raises(SettingsError, match="prot"):
        load_settings(config)


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("port: [\n")
    with pytest.raises(SettingsError):
        load_settings(broken)


def test_secret_token_is_not_shown() -> None:
    settings = load_settings(ingest_token="hunter2-token")
    assert "hunter2" not in repr(settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"scrape_targets": ["http://u:s3cret@a:1/metrics", "http://a:1/metrics"]}, "distinct"),
        ({"scrape_targets": ["http://a:99999/metrics?s3cret"]}, "valid URLs"),
        ({"scrape_password_file": "FILE"}, "go together"),
        (
            {
                "scrape_targets": ["http://u:s3cret@a:1/metrics"],
                "scrape_username": "u",
                "scrape_password_file": "FILE",
            },
            "not both",
        ),
    ],
)
def test_scrape_credentials_are_checked_without_echoing_them(
    tmp_path: Path, settings: dict[str, object], message: str
) -> None:
    password = tmp_path / "password"
    password.write_text("s3cret")
    settings = {key: password if value == "FILE" else value for key, value in settings.items()}
    with pytest.raises(SettingsError, match=message) as refused:
        load_settings(**settings)
    assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize(("content", "message"), [(None, "cannot read it"), ("  \n", "blank")])
def test_an_unusable_scrape_password_file_is_refused_at_start(
    tmp_path: Path, content: str | None, message: str
) -> None:
    password = tmp_path / "password"
    if content is not None:
        password.write_text(content)
    with pytest.raises(SettingsError, match=message):
        load_settings(scrape_username="u", scrape_password_file=password)


def test_cli_exits_2_with_the_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVLENS_MAX_MODELS", "0")
    assert main(["serve"]) == 2
    assert "max_models" in capsys.readouterr().err


def test_cost_models_by_priority_and_only_configured_names_remembered() -> None:
    settings = load_settings(
        None,
        cost_models={"cal": {"a": 1e-5, "b": 1e-9, "unit": "seconds"}, "both": {"a": 3, "b": 1}},
        model_shapes={
            "both": {"layers": 32, "kv_heads": 8, "head_dim": 128},
            "shaped": {"layers": 32, "kv_heads": 8, "head_dim": 128, "hidden_size": 4096, "heads": 32,
                       "intermediate_size": 14336},
            "decode-only": {"layers": 32, "kv_heads": 8, "head_dim": 128},
        },
    )  # fmt: skip
    assert settings.cost_model_for("cal").unit == "seconds"
    assert settings.cost_model_for("both").a == 3  # cost_models beat a shape
    assert settings.cost_model_for("shaped").unit == "flops"
    assert settings.cost_model_for("shaped").a / settings.cost_model_for("shaped").b == pytest.approx(26_624)
    assert settings.cost_model_for("decode-only").unit == "work_units"  # too little shape for FLOPs
    for i in range(10_000):  # names from records: never remembered
        assert settings.cost_model_for(f"sent-{i}").unit == "work_units"
    assert len(settings._cost_models) == 5
    notes = settings.cost_model_notes()
    assert "model shaped: compute saved in flops (from its shape, b/a = 1/26,624)" in notes
    assert "model cal: compute saved in seconds (calibrated, b/a = 1/10,000)" in notes
    assert "the article's illustrative unit, not FLOPs or seconds" in notes[-1]


@pytest.mark.parametrize("name", ["ingest_token", "metrics_token", "metrics_password"])
@pytest.mark.parametrize("value", ["", " ", "\n"])
def test_a_blank_secret_is_an_error(name: str, value: str) -> None:
    extra = {"metrics_username": "prom"} if name == "metrics_password" else {}
    with pytest.raises(SettingsError) as caught:
        load_settings(**{name: value}, **extra)
    assert str(caught.value) == (
        f"invalid setting {name}: is blank: unset it to turn this check off, or give a value"
    )


def test_one_rule_decides_whether_ingest_is_open() -> None:
    assert load_settings(host="0.0.0.0").ingest_secret is None
    assert load_settings(host="0.0.0.0").ingest_open
    closed = load_settings(host="0.0.0.0", ingest_token="s3cret")
    assert closed.ingest_secret == b"s3cret"
    assert not closed.ingest_open
    assert not load_settings(host="127.0.0.1").ingest_open


def test_offline_commands_build_the_accounting_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A file written for `kvlens serve` is read by the offline commands: its other rooms' keys
    # are skipped, its accounting read; a key of no room is still a typo.
    config = tmp_path / "kvlens.yaml"
    config.write_text(
        "port: 9000\ningest_token: abc\nscrape_targets: ['http://x:8000/metrics']\n"
        "prompt_length_edges: [100, 1000]\nanalyze_memory_limit: 1GiB\n"
    )
    offline = load_offline(config)
    assert offline.prompt_length_edges == [100, 1000] and offline.analyze_memory_limit == "1GiB"
    assert not hasattr(offline, "port") and not hasattr(offline, "scrape_targets")
    (tmp_path / "typo.yaml").write_text("prompt_length_edge: [100]\n")
    with pytest.raises(SettingsError, match="prompt_length_edge: Extra inputs are not permitted"):
        load_offline(tmp_path / "typo.yaml")
    # The sidecar's environment is not read by an offline command, the accounting's is.
    monkeypatch.setenv("KVLENS_PORT", "not a port")
    monkeypatch.setenv("KVLENS_MAX_MODELS", "0")
    with pytest.raises(SettingsError, match=r"^invalid setting max_models: Input should be greater"):
        load_offline()
    monkeypatch.delenv("KVLENS_MAX_MODELS")
    records = tmp_path / "records.jsonl"
    records.write_text('{"prompt_tokens": 100, "cached_tokens": 50}\n')
    assert main(["analyze", str(records), "--json"]) == 0
    assert '"requests": 1' in capsys.readouterr().out
    assert main(["serve"]) == 2
    assert "port" in capsys.readouterr().err


def test_the_offline_defaults_are_the_validated_ones() -> None:
    # load_offline() with nothing to read returns the defaults unvalidated (no validator built)
    from kvlens.accounting import CostModelSetting
    from kvlens.analysis.settings import AnalysisSettings

    assert load_offline() == AnalysisSettings.model_validate({})
    sidecar = load_settings().model_dump()
    assert load_offline().model_dump() == {name: sidecar[name] for name in AnalysisSettings.model_fields}
    assert CostModelSetting.model_construct() == CostModelSetting()
    assert load_offline().cost_model_for("m") == load_settings().cost_model_for("m")
