"""An experiment's out-dir as the state of a run that may be done one endpoint (or arm) at a time
and resumed: the plan it was made under, the steps finished in it, and who is writing into it.

- **The plan** (``plan.json``): what makes the steps in the folder comparable (the trace's
  content, the window, targets, rates, seed, vocabulary, block size, the arms' protocol) and its
  hash. Never the endpoints' URLs or credentials: the point is to run each endpoint on its own,
  on the same GPU, under the same plan. A run under another plan is refused, naming each field
  that differs, before anything is sent. The file also lists the endpoints (or arms) run into the
  folder, in the order they came: the first is the baseline.
- **A step** (one endpoint at one rate, its fixed work, one arm) is finished when its records
  file has its final name. It is written under ``.unfinished/`` and renamed at the step's end
  (its metadata, ``NAME.step.json``, first), so a killed run leaves no half step that looks
  finished; a rename within one folder is atomic. A rerun skips finished steps; ``--restart``
  redoes the ones it runs.
- **The lock** (``.kvlens.lock``): ``flock`` on a file holding the writer's pid and command. A
  second run into the folder is refused naming them; the kernel drops the lock of a process that
  died, so a stale file never blocks (``flock`` is per host: two machines sharing the folder over
  NFS are not kept apart).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import shlex
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from kvlens.experiment.client import Progress
from kvlens.experiment.lock import locked
from kvlens.experiment.protocol import ExperimentError, Window
from kvlens.simulate.trace import TraceRequest

SCHEMA = "kvlens.outdir/v1"
PLAN = "plan.json"
LOCK = ".kvlens.lock"
UNFINISHED = ".unfinished"
STEP_SUFFIX = ".step.json"
# The most a plan.json or NAME.step.json may hold: a step's engine sample keeps up to 50,000
# samples (engine_metrics.MAX_SAMPLES), ~15 MB as written with indentation; past the cap (or not
# a regular file: a FIFO, /dev/zero) the file is refused unread rather than read whole.
MAX_STATE_BYTES = 64 * 1024 * 1024
PROGRESS_SECONDS = 10.0  # a progress line this often when stderr is a log, not a terminal


def trace_identity(requests: Iterable[TraceRequest]) -> str:
    """A hash of what the requests ask (order, arrivals, lengths, block keys): two traces with
    the same identity send the same prompts at the same times, whatever file they came from."""
    digest = hashlib.sha256()
    for request in requests:
        digest.update(
            orjson.dumps(
                [request.index, request.arrival, request.prompt_tokens, request.output_tokens, request.blocks]
            )
        )
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Plan:
    """``fields``: JSON values, each a part of what makes two runs comparable."""

    experiment: str  # "quantization" or "prefix-cache"
    fields: dict[str, Any]

    @property
    def digest(self) -> str:
        material = orjson.dumps({"experiment": self.experiment, **self.fields}, option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(material).hexdigest()[:16]


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``field: old -> new`` for each field that differs (or is in one plan only)."""

    def shown(value: Any) -> str:
        return "(none)" if value is ... else orjson.dumps(value).decode()

    return [
        f"{key}: {shown(old.get(key, ...))} -> {shown(new.get(key, ...))}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key, ...) != new.get(key, ...)
    ]


@dataclass(frozen=True)
class Step:
    """One unit of work that is finished or not: ``NAME.jsonl`` in the out-dir."""

    name: str  # the records file's stem: "fixed-bf16", "rate-4-bf16", "warm"
    endpoint: str  # the endpoint's or the arm's name
    kind: str  # "fixed", "rate" or "arm"
    rate: float | None = None


@dataclass
class Found:
    """A finished step in the out-dir: its records and what was written with them."""

    step: Step
    records: Path
    meta: dict[str, Any]


@dataclass
class OutDir:
    """The out-dir of one run. :meth:`open` takes the lock and checks the plan; :meth:`run` runs
    a step or skips it when it is finished. ``progress`` is shown while a step runs."""

    path: Path
    plan: Plan
    restart: bool = False
    command: str = "kvlens"
    progress: Callable[[str, Progress, int], None] | None = None
    ran: list[Step] = field(default_factory=list)  # this run's finished steps
    kept: list[Step] = field(default_factory=list)  # finished before, skipped
    current: Step | None = None  # the step under way
    _lock: IO[str] | None = None

    @contextlib.contextmanager
    def open(self, endpoints: Iterable[str]) -> Iterator[OutDir]:
        """Create the folder, lock it, refuse another plan's folder, add ``endpoints``."""
        self.path.mkdir(parents=True, exist_ok=True)
        endpoints = list(endpoints)
        with locked(self.path / LOCK, self.command):
            state = self.state()
            if state is not None:
                _same_plan(self.path, state, self.plan)
            self.check_steps(endpoints)
            known = list(state["endpoints"]) if state else []
            known += [name for name in endpoints if name not in known]
            _write_json(
                self.path / PLAN,
                {
                    "schema": SCHEMA,
                    "experiment": self.plan.experiment,
                    "plan_hash": self.plan.digest,
                    "plan": self.plan.fields,
                    "endpoints": known,
                },
            )
            yield self
            with contextlib.suppress(OSError):  # only when nothing is left in it
                (self.path / UNFINISHED).rmdir()

    def check_steps(self, endpoints: list[str]) -> None:
        """Every finished step in the folder readable, before anything is sent. A broken one of
        this run's ``endpoints`` is redone under ``--restart`` (else refused: redo it so). One of
        another endpoint is refused either way, naming the file, that endpoint and how to mend
        it: this run cannot redo it (its URL is that run's), and the report over the folder would
        stop at it once this run's steps had all been sent. One whose endpoint cannot be read may
        be this run's: left to ``--restart``."""
        for meta_path in sorted(self.path.glob(f"*{STEP_SUFFIX}")):
            name = meta_path.name[: -len(STEP_SUFFIX)]
            endpoint = _step_endpoint(self.path, name)
            if self.restart and (endpoint is None or endpoint in endpoints):
                continue
            remove = f"remove {name}{STEP_SUFFIX} and {name}.jsonl to go on without it"
            if endpoint is None:
                redo = f"{REDO} (a run of its endpoint into this out-dir), or {remove}"
            elif endpoint in endpoints:
                redo = REDO
            else:
                redo = (
                    f"; a step of endpoint {endpoint!r}, which this run does not redo (--restart "
                    f"redoes this run's own steps): run {endpoint!r} into this out-dir again with "
                    f"--restart, or {remove}"
                )
            _finished_meta(self.path, name, redo)

    def check_plan(self) -> None:
        """Refuse a folder of another plan now, before any endpoint is called (:meth:`open`
        checks again under the lock, before it writes)."""
        state = self.state()
        if state is not None:
            _same_plan(self.path, state, self.plan)

    def state(self) -> dict[str, Any] | None:
        """``plan.json`` as written, or None in a folder without one."""
        try:
            state = read_state_json(self.path / PLAN, ": not an out-dir")
        except FileNotFoundError:
            return None
        if not isinstance(state, dict) or state.get("schema") != SCHEMA:
            raise ExperimentError(f"{self.path / PLAN} is not a kvlens out-dir plan ({SCHEMA})")
        wrong = _wrong_plan_field(state)
        if wrong:
            raise ExperimentError(f"{self.path / PLAN}: not a kvlens out-dir plan: {wrong}")
        return state

    def kept_json(self, name: str) -> Any:
        """``NAME``, a JSON file an earlier run kept in the folder beside its steps (a setting of
        the report, not a measurement: no part of the plan), or None when there is none."""
        try:
            return read_state_json(self.path / name, "")
        except FileNotFoundError:
            return None

    def keep_json(self, name: str, value: Any) -> None:
        """Write ``NAME`` into the folder whole (under the lock: from within :meth:`open`)."""
        _write_json(self.path / name, value)

    def records(self, step: Step) -> Path:
        return self.path / f"{step.name}.jsonl"

    def finished(self, step: Step) -> dict[str, Any] | None:
        """The step's metadata when it is finished in the folder (and not to be redone)."""
        if self.restart and step not in self.ran:
            return None
        return _finished_meta(self.path, step.name)

    def run(self, step: Step, body: Callable[[Path], dict[str, Any]]) -> Found:
        """Skip ``step`` when finished; else ``body(staged)`` writes its records at ``staged``
        (files it names in its answer's ``files`` are moved in too) and returns its metadata."""
        meta = self.finished(step)
        if meta is not None:
            self.kept.append(step)
            return Found(step, self.records(step), meta)
        staging = self.path / UNFINISHED
        staging.mkdir(exist_ok=True)
        staged = staging / f"{step.name}.jsonl"
        self.current = step
        meta = {"step": step.name, "endpoint": step.endpoint, "kind": step.kind, "rate": step.rate}
        meta |= body(staged)
        for name in meta.get("files", []):  # beside the records (a warm-up), before them
            os.replace(staging / name, self.path / name)
        meta["finished_at"] = time.time()
        _write_json(self.path / f"{step.name}{STEP_SUFFIX}", meta)
        os.replace(staged, self.records(step))  # last: from here the step is finished
        self.current = None
        self.ran.append(step)
        return Found(step, self.records(step), meta)

    def found(self) -> list[Found]:
        """Every finished step in the folder, whichever run made it."""
        return finished_steps(self.path)

    def interrupted(self) -> str:
        """What Ctrl-C leaves: the steps kept, the one that was not finished, how to resume."""
        done = [found.step.name for found in self.found()]
        lines = [f"stopped: {len(done)} finished step(s) kept in {self.path}: {', '.join(done) or 'none'}"]
        if self.current is not None:
            staged = self.path / UNFINISHED / f"{self.current.name}.jsonl"
            lines.append(
                f"the step under way, {self.current.name}, was not finished: it runs again on resume "
                f"(its records so far: {staged})"
            )
        lines.append(f"to resume (finished steps are skipped): {self.command}")
        return "\n".join(lines)


def finished_steps(path: Path) -> list[Found]:
    found = []
    for meta_path in sorted(path.glob(f"*{STEP_SUFFIX}")):
        name = meta_path.name[: -len(STEP_SUFFIX)]
        meta = _finished_meta(path, name)
        if meta is not None:
            rate = meta.get("rate")
            step = Step(name, meta["endpoint"], meta["kind"], None if rate is None else float(rate))
            found.append(Found(step, path / f"{name}.jsonl", meta))
    return found


REDO = "; redo the step with --restart"


def _finished_meta(path: Path, name: str, redo: str = REDO) -> dict[str, Any] | None:
    """The step's metadata when it is finished; refused naming the file (and ``redo``) when it
    cannot be read."""
    if not (path / f"{name}.jsonl").is_file():
        return None
    try:
        meta = read_state_json(path / f"{name}{STEP_SUFFIX}", redo)
    except FileNotFoundError:
        return None  # records without their metadata: from an older kvlens, or not ours
    wrong = _wrong_step_field(meta, name)
    if wrong:
        raise ExperimentError(f"{path / name}{STEP_SUFFIX}: {wrong}{redo}")
    assert isinstance(meta, dict)  # checked by _wrong_step_field (for mypy)
    return meta


def _step_endpoint(path: Path, name: str) -> str | None:
    """The endpoint a step's metadata names, read leniently (it may be a file that is otherwise
    wrong); None when it cannot be told."""
    try:
        meta = read_state_json(path / f"{name}{STEP_SUFFIX}", "")
    except (ExperimentError, OSError):
        return None
    endpoint = meta.get("endpoint") if isinstance(meta, dict) else None
    return endpoint if isinstance(endpoint, str) else None


STEP_KINDS = ("arm", "fixed", "rate")


def _wrong_step_field(meta: Any, name: str) -> str | None:
    """What is wrong with a step's metadata, checked once where it is read, so a dry run and the
    run agree and the readers of a step (the reports) take its fields as written."""
    if not isinstance(meta, dict):
        return "not an object"
    if meta.get("step") != name:
        return f"step must be {name}"
    if not isinstance(meta.get("endpoint"), str):
        return "endpoint must be a string"
    kind = meta.get("kind")
    if kind not in STEP_KINDS:
        return f"kind must be one of {', '.join(STEP_KINDS)}"
    rate = meta.get("rate")
    if (kind == "rate" or rate is not None) and not _is_number(rate):
        return "rate must be a number"
    concurrency = meta.get("concurrency")
    if concurrency is not None and (
        not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1
    ):
        return "concurrency must be a whole number of 1 or more"
    files = meta.get("files", [])
    if not isinstance(files, list) or not all(isinstance(file, str) for file in files):
        return "files must be a list of names"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_state_json(path: Path, advice: str) -> Any:
    """``path``, a JSON file of the out-dir's state, parsed; FileNotFoundError when there is none.
    Anything but a regular file of at most MAX_STATE_BYTES is refused unread, as is a file that
    is not JSON: an ExperimentError naming the file, ending with ``advice``."""
    try:
        # O_NONBLOCK: a FIFO in its place must not block the open; O_NOFOLLOW is not wanted (a
        # symlink to a regular file is a fair way to share a folder's state)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ExperimentError(f"{path}: cannot be read ({error.strerror or error}){advice}") from None
    with os.fdopen(fd, "rb") as file:
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ExperimentError(f"{path}: not a regular file{advice}")
            if info.st_size > MAX_STATE_BYTES:
                raise ExperimentError(f"{path}: over {MAX_STATE_BYTES} bytes{advice}")
            data = file.read(MAX_STATE_BYTES + 1)  # the size may have grown since fstat
        except OSError as error:
            raise ExperimentError(f"{path}: cannot be read ({error.strerror or error}){advice}") from None
    if len(data) > MAX_STATE_BYTES:
        raise ExperimentError(f"{path}: over {MAX_STATE_BYTES} bytes{advice}")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise ExperimentError(f"{path}: not JSON ({error}){advice}") from None


def _wrong_plan_field(state: dict[str, Any]) -> str | None:
    """What is wrong with the shape of a ``plan.json`` (checked once, where it is read, so the
    rest takes its fields as written: a string of endpoints is not split into characters)."""
    endpoints = state.get("endpoints")
    if not isinstance(endpoints, list) or not all(isinstance(name, str) for name in endpoints):
        return "endpoints must be a list of names"
    if not isinstance(state.get("plan"), dict):
        return "plan must be an object"
    for name in ("experiment", "plan_hash"):
        if not isinstance(state.get(name), str):
            return f"{name} must be a string"
    return None


def _same_plan(path: Path, state: dict[str, Any], plan: Plan) -> None:
    if state.get("experiment") != plan.experiment:
        raise ExperimentError(
            f"{path} holds a {state.get('experiment')} experiment, not {plan.experiment}: "
            "use another --out-dir"
        )
    if state.get("plan_hash") == plan.digest:
        return
    differ = differences(state.get("plan") or {}, plan.fields)
    raise ExperimentError(
        f"{path} was run under another plan (hash {state.get('plan_hash')}, this run's {plan.digest}); "
        f"its steps would not be comparable with this run's. What differs (old -> new): "
        + "; ".join(differ or ["the plan's format"])
        + ". Run with the old plan's settings, or into another --out-dir"
    )


def _write_json(path: Path, value: Any) -> None:
    staged = path.with_name(path.name + ".tmp")
    staged.write_bytes(orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(staged, path)


def command_line(program: str, argv: Iterable[str]) -> str:
    """The command to run again, as the shell takes it, with secrets left out: ``--api-key``'s
    value and a URL's user and password are replaced by placeholders to fill in."""
    words, secret = [program], False
    for word in argv:
        if secret:
            words.append("KEY")
            secret = False
            continue
        if word == "--api-key":
            secret = True
        elif word.startswith("--api-key="):
            word = "--api-key=KEY"
        words.append(_without_userinfo(word))
    return shlex.join(words)


def _without_userinfo(word: str) -> str:
    scheme, separator, rest = word.partition("://")
    at = rest.find("@")
    slash = rest.find("/")
    if not separator or at < 0 or (0 <= slash < at):
        return word
    return f"{scheme}://USER:PASSWORD{rest[at:]}"


def duration(seconds: float) -> str:
    """``1:05`` or ``2:03:04``."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Heartbeat:
    """A progress line at most every ``every`` seconds, and one as each step ends: for a log
    file, where a line rewritten in place (a terminal's) shows nothing. ``clock`` is injected
    (tests move it; nothing waits)."""

    def __init__(
        self,
        write: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        every: float = PROGRESS_SECONDS,
    ) -> None:
        self._write, self._clock, self._every = write, clock, every
        self._last: float | None = None
        self._started: dict[str, float] = {}
        self._ended: set[str] = set()

    def __call__(self, label: str, progress: Progress, total: int) -> None:
        now = self._clock()
        started = self._started.setdefault(label, now)
        ended = progress.done >= total
        if label in self._ended or not (ended or self._last is None or now - self._last >= self._every):
            return
        if self._last is None and not ended:  # the first call starts the clock; nothing to say yet
            self._last = now
            return
        self._last = now
        elapsed = now - started
        if ended:
            self._ended.add(label)
            eta = "done"
        elif progress.done:
            eta = f"ETA {duration(elapsed * (total - progress.done) / progress.done)}"
        else:
            eta = "ETA unknown"
        self._write(
            f"kvlens experiment: step {label}: {progress.sent}/{total} sent, {progress.done} answered, "
            f"{progress.errors} errors, {duration(elapsed)} elapsed, {eta}"
        )


def quantization_plan(
    requests: list[TraceRequest],
    *,
    targets: Any,
    block_size: int,
    vocab_size: int,
    seed: int,
    concurrency: int,
    max_output_tokens: int | None,
    rates: list[float] | None,
    sweep: tuple[float, int] | None,
) -> Plan:
    """What makes two endpoints' quantization steps comparable (``targets``: the dataclass)."""
    return Plan(
        "quantization",
        {
            "trace": trace_identity(requests),
            "requests": len(requests),
            "block_size": block_size,
            "vocab_size": vocab_size,
            "seed": seed,
            "concurrency": concurrency,
            "max_output_tokens": max_output_tokens,
            "targets": dataclasses.asdict(targets),
            "rates": rates,
            "rate_sweep": None if sweep is None else {"start": sweep[0], "max_doublings": sweep[1]},
        },
    )


def prefix_cache_plan(
    window: Window, schedule: Any, *, block_size: int, vocab_size: int, max_concurrency: int, api: str
) -> Plan:
    """What makes two arms comparable (``schedule``: the run's ``Schedule`` dataclass): the
    same measured window, warmed by the same requests, sent the same way."""
    return Plan(
        "prefix-cache",
        {
            "trace": trace_identity(window.measure),
            "requests": len(window.measure),
            "warmup": trace_identity(window.warmup),
            "warmup_requests": len(window.warmup),
            "measure_from": window.measure_from,
            "schedule": dataclasses.asdict(schedule),
            "block_size": block_size,
            "vocab_size": vocab_size,
            "max_concurrency": max_concurrency,
            "api": api,
            "protocol": "off: no prefix caching; cold: emptied; warm: emptied, then warmed apart",
        },
    )


@dataclass(frozen=True)
class PlannedStep:
    step: Step
    requests: int
    arrivals_seconds: float | None  # None: closed loop, its time the server's
    note: str = ""


def dry_run(out: OutDir, planned: list[PlannedStep]) -> str:
    """The plan as ``--dry-run`` prints it: the out-dir's state, each step (to run, or finished
    and skipped), and the time its arrivals take. Reads the folder; contacts no endpoint."""
    state = out.state() if out.path.is_dir() else None
    matches = state is not None and state.get("plan_hash") == out.plan.digest
    lines = [f"kvlens experiment {out.plan.experiment} --dry-run: nothing is sent, nothing written", ""]
    if state is None:
        lines.append(f"out-dir {out.path}: new (plan {out.plan.digest})")
    elif matches:
        lines.append(
            f"out-dir {out.path}: same plan ({out.plan.digest}); run into it so far: "
            + (", ".join(state.get("endpoints", [])) or "none")
        )
    else:
        try:
            _same_plan(out.path, state, out.plan)
        except ExperimentError as error:
            lines.append(f"out-dir {out.path}: this run would be refused: {error}")
    lines += ["", "plan:"] + [
        f"  {key}: {orjson.dumps(value).decode()}" for key, value in out.plan.fields.items()
    ]
    if matches:  # the run's own check, before it sends anything: the same refusal
        out.check_steps(list(dict.fromkeys(each.step.endpoint for each in planned)))
    lines += ["", f"{'step':<24}{'endpoint':<12}{'requests':>9}{'arrivals':>11}  state"]
    to_run, closed = 0.0, 0
    for each in planned:
        finished = matches and out.finished(each.step) is not None
        arrivals = "-" if each.arrivals_seconds is None else duration(each.arrivals_seconds)
        state_text = "finished: skipped" if finished else "to run"
        if not finished:
            if each.arrivals_seconds is None:
                closed += 1
            else:
                to_run += each.arrivals_seconds
        lines.append(
            f"{each.step.name:<24}{each.step.endpoint[:11]:<12}{each.requests:>9}{arrivals:>11}  {state_text}"
            + (f" ({each.note})" if each.note else "")
        )
    estimate = f"estimated duration: at least {duration(to_run)} (the arrivals of the steps to run)"
    if closed:
        estimate += f", plus {closed} fixed-work step(s) whose time is the server's"
    return "\n".join([*lines, "", estimate]) + "\n"
