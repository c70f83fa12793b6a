"""An experiment's out-dir as the state of a resumable run: the plan and its refusal, steps
finished only by their rename, the lock, the progress line for a log, the resume command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlens.experiment import lock as lock_file
from kvlens.experiment import outdir
from kvlens.experiment.client import Progress
from kvlens.experiment.protocol import ExperimentError
from kvlens.simulate.trace import TraceRequest

PLAN = outdir.Plan("quantization", {"trace": "abc", "rates": [4.0, 8.0], "seed": 0})


def test_the_plan_hash_covers_the_plan_and_not_the_endpoints(tmp_path: Path) -> None:
    requests = [TraceRequest(0, 0.0, 100, 8, (1, 2)), TraceRequest(1, 0.5, 100, 8, (1, 3))]
    same = [TraceRequest(0, 0.0, 100, 8, (1, 2)), TraceRequest(1, 0.5, 100, 8, (1, 3))]
    other = [TraceRequest(0, 0.0, 100, 8, (1, 2)), TraceRequest(1, 0.5, 100, 8, (1, 4))]
    assert outdir.trace_identity(requests) == outdir.trace_identity(same)
    assert outdir.trace_identity(requests) != outdir.trace_identity(other)
    # the same plan in another order of fields is the same plan
    assert outdir.Plan("quantization", {"seed": 0, "rates": [4.0, 8.0], "trace": "abc"}).digest == PLAN.digest
    with outdir.OutDir(tmp_path, PLAN).open(["bf16"]):
        pass
    state = orjson.loads((tmp_path / "plan.json").read_bytes())
    assert state == {
        "schema": "kvlens.outdir/v1",
        "experiment": "quantization",
        "plan_hash": PLAN.digest,
        "plan": {"trace": "abc", "rates": [4.0, 8.0], "seed": 0},
        "endpoints": ["bf16"],
    }
    with outdir.OutDir(tmp_path, PLAN).open(["w4a16", "bf16"]):
        pass
    assert orjson.loads((tmp_path / "plan.json").read_bytes())["endpoints"] == ["bf16", "w4a16"]


def test_another_plan_is_refused_naming_each_field_that_differs(tmp_path: Path) -> None:
    with outdir.OutDir(tmp_path, PLAN).open(["bf16"]):
        pass
    other = outdir.Plan("quantization", {"trace": "def", "rates": [4.0], "seed": 0, "vocab_size": 1000})
    with pytest.raises(ExperimentError) as refused, outdir.OutDir(tmp_path, other).open(["w4a16"]):
        pytest.fail("opened")
    assert str(refused.value) == (
        f"{tmp_path} was run under another plan (hash {PLAN.digest}, this run's {other.digest}); its "
        "steps would not be comparable with this run's. What differs (old -> new): rates: [4.0,8.0] -> "
        '[4.0]; trace: "abc" -> "def"; vocab_size: (none) -> 1000. Run with the old plan\'s settings, '
        "or into another --out-dir"
    )
    prefix = outdir.Plan("prefix-cache", PLAN.fields)
    refusal = "holds a quantization experiment, not prefix-cache"
    with pytest.raises(ExperimentError, match=refusal), outdir.OutDir(tmp_path, prefix).open(["off"]):
        pytest.fail("opened")
    assert orjson.loads((tmp_path / "plan.json").read_bytes())["endpoints"] == ["bf16"]  # untouched


def write_records(path: Path, count: int) -> dict[str, Any]:
    path.write_bytes(b"".join(orjson.dumps({"trace_index": i}) + b"\n" for i in range(count)))
    return {"sample": {"scrapes": 1}}


def test_a_step_is_finished_only_when_its_records_are_renamed_in(tmp_path: Path) -> None:
    step = outdir.Step("rate-4-bf16", "bf16", "rate", 4.0)
    with outdir.OutDir(tmp_path, PLAN).open(["bf16"]) as out:

        def killed(staged: Path) -> dict[str, Any]:
            write_records(staged, 3)  # three records written, then the run dies
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            out.run(step, killed)
        assert out.current == step
        assert not (tmp_path / "rate-4-bf16.jsonl").exists()
        assert len((tmp_path / ".unfinished" / "rate-4-bf16.jsonl").read_bytes().splitlines()) == 3
        assert out.found() == []
    with outdir.OutDir(tmp_path, PLAN).open(["bf16"]) as out:
        found = out.run(step, lambda staged: write_records(staged, 5))
        assert out.ran == [step] and out.kept == []
    assert found.records == tmp_path / "rate-4-bf16.jsonl"
    assert len(found.records.read_bytes().splitlines()) == 5
    assert found.meta["sample"] == {"scrapes": 1} and found.meta["rate"] == 4.0
    assert not (tmp_path / ".unfinished").exists()  # emptied and removed at the run's end
    # a rerun skips it; --restart redoes it, once
    with outdir.OutDir(tmp_path, PLAN).open(["bf16"]) as out:
        again = out.run(step, lambda staged: pytest.fail("ran a finished step"))
        assert out.kept == [step] and again.meta == found.meta
    with outdir.OutDir(tmp_path, PLAN, restart=True).open(["bf16"]) as out:
        redone = out.run(step, lambda staged: write_records(staged, 7))
        assert out.ran == [step] and redone.meta["finished_at"] > found.meta["finished_at"]
        assert out.finished(step) == redone.meta  # redone in this run: not redone twice
    assert len((tmp_path / "rate-4-bf16.jsonl").read_bytes().splitlines()) == 7
    # records without their metadata (an older kvlens's folder) are not a finished step
    (tmp_path / "rate-8-bf16.jsonl").write_bytes(b"{}\n")
    assert [f.step for f in outdir.finished_steps(tmp_path)] == [step]


def test_a_second_run_into_the_folder_is_refused_naming_the_first(tmp_path: Path) -> None:
    command = "kvlens experiment quantization shared-prefix --endpoint bf16=http://127.0.0.1:8000"
    with outdir.OutDir(tmp_path, PLAN, command=command).open(["bf16"]):
        # flock is per open file: a second open in this process is refused as another's would be
        with pytest.raises(ExperimentError) as refused, outdir.OutDir(tmp_path, PLAN).open(["w4a16"]):
            pytest.fail("opened")
        assert str(refused.value) == (
            f"{tmp_path} is in use by another run (pid {os.getpid()}: {command}); wait for it to end, "
            "or stop it"
        )
    # ended: the lock went with its file descriptor, the file stays and does not block
    with outdir.OutDir(tmp_path, PLAN).open(["w4a16"]):
        pass


def test_the_resume_command_leaves_secrets_out() -> None:
    argv = [
        "experiment",
        "quantization",
        "shared-prefix",
        "--endpoint",
        "w4a16=http://alice:s3cret@gpu:8000/",
        "--api-key",
        "sk-123",
        "--api-key=sk-456",
        "--out-dir",
        "runs/quant 1",
    ]
    assert outdir.command_line(".venv/bin/kvlens", argv) == (
        ".venv/bin/kvlens experiment quantization shared-prefix --endpoint "
        "w4a16=http://USER:PASSWORD@gpu:8000/ --api-key KEY --api-key=KEY --out-dir 'runs/quant 1'"
    )


def test_ctrl_c_names_the_steps_kept_the_one_lost_and_the_command(tmp_path: Path) -> None:
    command = "kvlens experiment quantization shared-prefix --out-dir D"
    step = outdir.Step("rate-4-bf16", "bf16", "rate", 4.0)
    with outdir.OutDir(tmp_path, PLAN, command=command).open(["bf16"]) as out:
        out.run(outdir.Step("fixed-bf16", "bf16", "fixed"), lambda staged: write_records(staged, 2))

        def interrupted(staged: Path) -> dict[str, Any]:
            write_records(staged, 1)
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            out.run(step, interrupted)
        assert out.interrupted() == (
            f"stopped: 1 finished step(s) kept in {tmp_path}: fixed-bf16\n"
            f"the step under way, rate-4-bf16, was not finished: it runs again on resume (its records "
            f"so far: {tmp_path / '.unfinished' / 'rate-4-bf16.jsonl'})\n"
            f"to resume (finished steps are skipped): {command}"
        )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_progress_line_every_ten_seconds_and_one_at_each_steps_end() -> None:
    clock, lines = Clock(), list[str]()
    beat = outdir.Heartbeat(lines.append, clock)
    progress = Progress()
    beat("rate-4-bf16", progress, 200)  # the step starts: nothing to say yet
    for second in range(1, 26):  # shown every 0.5 s by the replay; said every 10 s
        clock.now = 100.0 + second
        progress.sent, progress.done = 4 * second, 4 * second - 2
        progress.errors = second // 10
        beat("rate-4-bf16", progress, 200)
    progress.sent = progress.done = 200
    clock.now = 130.0
    beat("rate-4-bf16", progress, 200)
    beat("rate-4-bf16", progress, 200)  # shown once more after the end: said once
    assert lines == [
        "kvlens experiment: step rate-4-bf16: 40/200 sent, 38 answered, 1 errors, 0:10 elapsed, ETA 0:43",
        "kvlens experiment: step rate-4-bf16: 80/200 sent, 78 answered, 2 errors, 0:20 elapsed, ETA 0:31",
        "kvlens experiment: step rate-4-bf16: 200/200 sent, 200 answered, 2 errors, 0:30 elapsed, done",
    ]


def test_durations_read_as_a_clock() -> None:
    assert [outdir.duration(s) for s in (0, 4.6, 65, 3600 + 62, 100 * 3600)] == [
        "0:00",
        "0:05",
        "1:05",
        "1:01:02",
        "100:00:00",
    ]


def test_endpoints_whose_fixed_work_would_share_a_file_are_refused() -> None:
    """``a``'s long fixed work is ``fixed-a-long``, as is the short one of an endpoint ``a-long``."""
    from kvlens.experiment import quantization

    assert [quantization.fixed_step("a", group).name for group in ("short", "long")] == [
        "fixed-a",
        "fixed-a-long",
    ]
    quantization.check_names(["a", "b-long", "long"])
    with pytest.raises(
        ExperimentError, match="'a-long' and 'a' would share the step fixed-a-long: rename one"
    ):
        quantization.check_names(["a", "b", "a-long"])


def finished_step(path: Path, name: str = "rate-4-bf16", **meta: Any) -> Path:
    """A finished step written by hand: its records and its ``.step.json`` holding ``meta``."""
    (path / f"{name}.jsonl").write_bytes(b"{}\n")
    step_json = path / f"{name}.step.json"
    step_json.write_bytes(orjson.dumps(meta))
    return step_json


def test_a_plan_or_step_file_that_is_not_a_small_regular_file_is_refused_unread(tmp_path: Path) -> None:
    (tmp_path / "plan.json").symlink_to("/dev/zero")
    with pytest.raises(ExperimentError) as refused:
        outdir.OutDir(tmp_path, PLAN).check_plan()
    assert str(refused.value) == f"{tmp_path / 'plan.json'}: not a regular file: not an out-dir"
    (tmp_path / "plan.json").unlink()
    step_json = finished_step(tmp_path)
    step_json.unlink()
    step_json.symlink_to("/dev/zero")
    redo = "; redo the step with --restart"
    with pytest.raises(ExperimentError) as refused:
        outdir.finished_steps(tmp_path)
    assert str(refused.value) == f"{step_json}: not a regular file{redo}"
    step_json.unlink()
    with step_json.open("wb") as sparse:  # past the cap without writing 64 MiB
        sparse.truncate(outdir.MAX_STATE_BYTES + 1)
    with pytest.raises(ExperimentError) as refused:
        outdir.finished_steps(tmp_path)
    assert str(refused.value) == f"{step_json}: over {outdir.MAX_STATE_BYTES} bytes{redo}"
    step_json.write_bytes(b"{")
    with pytest.raises(ExperimentError, match=r"rate-4-bf16\.step\.json: not JSON \(.*\); redo the step"):
        outdir.finished_steps(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("endpoints", [1, None], "endpoints must be a list of names"),
        ("endpoints", "zz", "endpoints must be a list of names"),
        ("plan", [1], "plan must be an object"),
        ("plan_hash", 7, "plan_hash must be a string"),
        ("experiment", None, "experiment must be a string"),
    ],
)
def test_a_plan_json_of_the_wrong_shape_is_refused_naming_the_field(
    tmp_path: Path, field: str, value: Any, why: str
) -> None:
    with outdir.OutDir(tmp_path, PLAN).open(["bf16"]):
        pass
    state = orjson.loads((tmp_path / "plan.json").read_bytes())
    (tmp_path / "plan.json").write_bytes(orjson.dumps(state | {field: value}))
    message = f"{tmp_path / 'plan.json'}: not a kvlens out-dir plan: {why}"
    with pytest.raises(ExperimentError) as refused, outdir.OutDir(tmp_path, PLAN).open(["w4a16"]):
        pytest.fail("opened")
    assert str(refused.value) == message
    with pytest.raises(ExperimentError) as refused:
        outdir.OutDir(tmp_path, PLAN).check_plan()
    assert str(refused.value) == message


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        ({"step": "rate-4-bf16", "endpoint": "bf16", "rate": 4.0}, "kind must be one of arm, fixed, rate"),
        ({"step": "rate-4-bf16", "endpoint": "bf16", "kind": "rate", "rate": "abc"}, "rate must be a number"),
        ({"step": "rate-4-bf16", "endpoint": "bf16", "kind": "rate", "rate": [1]}, "rate must be a number"),
        ({"step": "rate-4-bf16", "endpoint": "bf16", "kind": "rate", "rate": None}, "rate must be a number"),
        (
            {"step": "rate-4-bf16", "endpoint": "bf16", "kind": "fixed", "concurrency": "x"},
            "concurrency must be a whole number of 1 or more",
        ),
        (
            {"step": "rate-4-bf16", "endpoint": "bf16", "kind": "arm", "files": "w"},
            "files must be a list of names",
        ),
        ({"step": "rate-4-bf16", "endpoint": 3, "kind": "arm"}, "endpoint must be a string"),
        ({"step": "other", "endpoint": "bf16", "kind": "arm"}, "step must be rate-4-bf16"),
        ([1], "not an object"),
    ],
)
def test_a_step_json_of_the_wrong_shape_is_refused_where_it_is_read(
    tmp_path: Path, meta: Any, why: str
) -> None:
    step_json = tmp_path / "rate-4-bf16.step.json"
    (tmp_path / "rate-4-bf16.jsonl").write_bytes(b"{}\n")
    step_json.write_bytes(orjson.dumps(meta))
    message = f"{step_json}: {why}; redo the step with --restart"
    with pytest.raises(ExperimentError) as refused:
        outdir.finished_steps(tmp_path)
    assert str(refused.value) == message
    # the run refuses it at open, before anything is sent; --dry-run asks the same check
    if not isinstance(meta, dict) or not isinstance(meta.get("endpoint"), str):  # whose: not told
        message += " (a run of its endpoint into this out-dir), or remove rate-4-bf16.step.json and "
        message += "rate-4-bf16.jsonl to go on without it"
    with pytest.raises(ExperimentError) as refused, outdir.OutDir(tmp_path, PLAN).open(["bf16"]):
        pytest.fail("opened")
    assert str(refused.value) == message
    with pytest.raises(ExperimentError) as refused:
        outdir.OutDir(tmp_path, PLAN).check_steps(["bf16"])
    assert str(refused.value) == message


def test_a_step_json_of_each_kind_as_written_is_read_back(tmp_path: Path) -> None:
    finished_step(tmp_path, "a", step="a", endpoint="on", kind="arm", rate=None, files=["a.warmup.jsonl"])
    finished_step(tmp_path, "f", step="f", endpoint="bf16", kind="fixed", rate=None, concurrency=4)
    finished_step(tmp_path, "r", step="r", endpoint="bf16", kind="rate", rate=2)
    assert [f.step for f in outdir.finished_steps(tmp_path)] == [
        outdir.Step("a", "on", "arm"),
        outdir.Step("f", "bf16", "fixed"),
        outdir.Step("r", "bf16", "rate", 2.0),
    ]


def test_a_lock_file_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    lock = tmp_path / ".kvlens.lock"
    os.mkfifo(lock)
    with pytest.raises(ExperimentError) as refused, lock_file.locked(lock, "kvlens"):
        pytest.fail("locked")
    assert str(refused.value) == f"cannot lock {lock}: not a regular file"


@pytest.mark.parametrize("target", ["victim.txt", "/dev/zero", "missing"])
def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(
    tmp_path: Path, target: str
) -> None:
    """Taking the lock truncates the file and writes a pid in it: through a symlink that was
    whatever file it named (another run's records, a file of the user's)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's data\n")
    lock = tmp_path / ".kvlens.lock"
    lock.symlink_to(target if target.startswith("/") else tmp_path / target)
    with pytest.raises(ExperimentError) as refused, lock_file.locked(lock, "kvlens"):
        pytest.fail("locked")
    assert str(refused.value) == f"cannot lock {lock}: a symbolic link, not a regular file (remove it)"
    assert victim.read_text() == "the user's data\n"
    assert not (tmp_path / "missing").exists()  # not created through the link either


def test_the_lock_holders_text_is_shown_printable_and_bounded(tmp_path: Path) -> None:
    lock = tmp_path / ".kvlens.lock"
    with lock_file.locked(lock, "kvlens"):
        lock.write_bytes(b"12\x1b[2J3\xff\n" + b"kvlens \x07run\r" + b"x" * 2000 + b"\n")
        with pytest.raises(ExperimentError) as refused, lock_file.locked(lock, "kvlens"):
            pytest.fail("locked")
    shown = "kvlens run" + "x" * 990
    assert str(refused.value) == (
        f"{tmp_path} is in use by another run (pid 12[2J3\ufffd: {shown}); wait for it to end, or stop it"
    )


def test_a_broken_step_of_another_endpoint_is_refused_before_this_run_naming_it(tmp_path: Path) -> None:
    """--restart redoes this run's own steps: another endpoint's broken step file is no step this
    run can redo (its URL is that run's). Refused at open, before anything is sent, naming the
    file and the endpoint and how to mend it. Before: the run sent all its steps, then the report
    over the folder stopped at that file saying to redo it with --restart, which had just been
    done; a broken step of this run's own endpoint is redone by --restart, as before."""
    ours = outdir.Step("rate-4-w4", "w4", "rate", 4.0)
    broken = finished_step(tmp_path, step="rate-4-bf16", endpoint="bf16", kind="rate", rate="4")
    with outdir.OutDir(tmp_path, PLAN, restart=True).open(["bf16"]):
        pass  # its own: redone by this run (not run here), not refused
    for restart in (True, False):
        with (
            pytest.raises(ExperimentError) as refused,
            outdir.OutDir(tmp_path, PLAN, restart=restart).open(["w4"]),
        ):
            pytest.fail("opened")
        assert str(refused.value) == (
            f"{broken}: rate must be a number; a step of endpoint 'bf16', which this run does not "
            "redo (--restart redoes this run's own steps): run 'bf16' into this out-dir again with "
            "--restart, or remove rate-4-bf16.step.json and rate-4-bf16.jsonl to go on without it"
        )
    assert not (tmp_path / "rate-4-w4.jsonl").exists()
    (tmp_path / "rate-4-bf16.jsonl").unlink()  # removed as the message says: the run goes on
    with outdir.OutDir(tmp_path, PLAN, restart=True).open(["w4"]) as out:
        out.run(ours, lambda staged: write_records(staged, 2))
        assert [f.step for f in out.found()] == [ours]
    broken.write_bytes(b"{")  # not JSON: whose it is cannot be told; this run may be its endpoint's
    (tmp_path / "rate-4-bf16.jsonl").write_bytes(b"{}\n")
    with pytest.raises(ExperimentError) as refused, outdir.OutDir(tmp_path, PLAN).open(["w4"]):
        pytest.fail("opened")
    assert str(refused.value).endswith(
        "; redo the step with --restart (a run of its endpoint into this out-dir), or remove "
        "rate-4-bf16.step.json and rate-4-bf16.jsonl to go on without it"
    )
