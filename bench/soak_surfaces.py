"""The soak's attacks on the newer surfaces (bench/soak.py's docstring lists them): ``diagnosis``,
records with ``prefix_hashes`` then their diagnoses asked for by odd ids; ``tenants``, a flood
of new tenant names with chains through the tenants' block storers. Both light (a step every
0.5 s): they check that the surfaces stay bounded and answered, not how fast they are.

Their records are of the model ``soak-abuse``, so that the soak's sent-vs-counted check (model
``soak``) does not see them. Every answer 5xx fails the soak (the :class:`Tally`'s rule), and
so does any ``kvlens_ingest_consumer_errors_total`` (a reader after the sums that failed)."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from urllib.parse import quote

import httpx
import orjson
from prometheus_client.metrics_core import Metric

from bench.soak_load import Tally

MAX_TENANTS = 20
STEP_SECONDS = 0.5
TENANTS_A_BATCH = 200
# ids a sender may pick: a path, dots, a NUL, emoji, one past the 256 characters kept (refused)
ODD_IDS = ("../../metrics", "a/b/../c", "..", ".", "%00", "\x00x", "\U0001f600" * 60, "x" * 4096, " ")


def odd_record(request_id: str, i: int) -> dict[str, object]:
    """A record the diagnoses keep: int and string prefix ids, one of them repeated."""
    return {
        "request_id": request_id,
        "model": "soak-abuse",
        "replica": f"r{i % 3}",
        "prompt_tokens": 16 * 8,
        "cached_tokens": 16 * (i % 4),
        "block_size": 16,
        "prefix_hashes": [1, 2, f"s-{i % 50}", i % 7, "0123456789abcdef", 2, i, f"{i}"],
    }


def no_key_record(i: int) -> dict[str, object]:
    """A record whose string id has no UTF-8 (a lone surrogate): refused, never a reader's 500."""
    return {**odd_record(f"no-key-{i}", i), "prefix_hashes": [1, "\ud800"]}


def post(client: httpx.Client, url: str, body: bytes, stop: threading.Event) -> httpx.Response:
    """POST as a sender does: a 503 (ingest's slots all taken, with Retry-After) tried again;
    the soak's other senders may hold every slot for a moment."""
    for _ in range(50):
        answer = client.post(f"{url}/v1/records", content=body)
        if answer.status_code != 503 or stop.wait(0.1):
            break
    return answer


class SurfacesAttack:
    def __init__(self, attacks: frozenset[str], tally: Tally) -> None:
        self.attacks = attacks & {"diagnosis", "tenants"}
        self.tally = tally
        self.found = 0  # diagnoses answered 200 for an id the attack pushed
        self.missing: list[str] = []  # pushed ids answered 404 while they must be kept
        self.tenant_series = 0
        self.overflow = 0.0
        self.consumer_errors = 0.0

    def settings(self) -> dict[str, str]:
        if "tenants" not in self.attacks:
            return {}
        return {"KVLENS_MAX_TENANTS": str(MAX_TENANTS), "KVLENS_TENANT_REMEMBER_BLOCKS": "100000"}

    def jobs(self, url: str, stop: threading.Event) -> list[tuple[Callable[..., None], tuple[object, ...]]]:
        jobs: list[tuple[Callable[..., None], tuple[object, ...]]] = []
        if "diagnosis" in self.attacks:
            jobs.append((self.diagnoses, (url, stop)))
        if "tenants" in self.attacks:
            jobs.append((self.tenant_flood, (url, stop)))
        return jobs

    def diagnoses(self, url: str, stop: threading.Event) -> None:
        """Push records under odd ids (and one whose prefix id has no key), then ask each back by
        its id (quoted whole, ``/`` as ``%2F``), and an id never sent (404)."""
        with httpx.Client(timeout=30) as client:
            for step in itertools.count():
                if stop.wait(STEP_SECONDS):
                    return
                self.tally.attacked("diagnosis")
                ids = [f"{odd}-{step}" for odd in ODD_IDS[step % len(ODD_IDS) :][:3]]
                records = [*(odd_record(i, step) for i in ids), no_key_record(step)]
                # json writes a lone surrogate as its escape (orjson refuses to)
                body = b"[" + b",".join(json.dumps(r).encode() for r in records) + b"]"
                answer = post(client, url, body, stop)
                self.tally.answered("diagnosis-push", answer.status_code)
                taken = answer.status_code == 200
                refused = {r["index"] for r in answer.json()["rejected"]} if taken else set()
                kept = {i for n, i in enumerate(ids) if n not in refused and taken}
                for request_id in [*ids, f"never-sent-{step}%"]:
                    got = client.get(f"{url}/v1/requests/{quote(request_id, safe='')}/diagnosis")
                    self.tally.answered("diagnosis", got.status_code)
                    if got.status_code == 200:
                        self.found += 1
                    elif request_id in kept:
                        self.missing.append(request_id[:40])

    def tenant_flood(self, url: str, stop: threading.Event) -> None:
        """TENANTS_A_BATCH new tenant names a batch, each record with a chain that other tenants'
        records share (cross-tenant hits for the storers to find)."""
        names = itertools.count()
        with httpx.Client(timeout=30) as client:
            while not stop.wait(STEP_SECONDS):
                self.tally.attacked("tenants")
                records = [
                    {
                        "model": "soak-abuse",
                        "tenant": f"flood-{n}",
                        "prompt_tokens": 64,
                        "cached_tokens": 32,
                        "block_size": 16,
                        "prefix_hashes": [7, 8, n % 11, n],
                    }
                    for n in itertools.islice(names, TENANTS_A_BATCH)
                ]
                answer = post(client, url, orjson.dumps(records), stop)
                self.tally.answered("tenants", answer.status_code)

    def observe(self, at: float, families: list[Metric]) -> None:
        tenants: set[str] = set()
        for family in families:
            for sample in family.samples:
                if family.name == "kvlens_ingest_consumer_errors":
                    self.consumer_errors = max(self.consumer_errors, sample.value)
                elif family.name == "kvlens_tenant_overflow" and sample.name.endswith("_total"):
                    self.overflow = sample.value
                elif "tenant" in sample.labels:
                    tenants.add(sample.labels["tenant"])
        self.tenant_series = max(self.tenant_series, len(tenants))

    def report(self) -> list[str]:
        lines = []
        if "diagnosis" in self.attacks:
            lines.append(
                f"  diagnosis         {self.found} diagnoses found by odd ids, {len(self.missing)} lost"
            )
        if "tenants" in self.attacks:
            lines.append(
                f"  tenants           at most {self.tenant_series} tenant labels "
                f"(cap {MAX_TENANTS} + other), "
                f"{self.overflow:,.0f} records folded into other"
            )
        lines.append(f"  consumer errors   {self.consumer_errors:g}")
        return lines

    def failures(self) -> list[str]:
        failed = [f"{self.consumer_errors:g} ingest consumer errors"] if self.consumer_errors else []
        if "diagnosis" in self.attacks and (self.missing or not self.found):
            failed.append(f"diagnosis: {self.found} found, lost {', '.join(self.missing[:5]) or 'none'}")
        if "tenants" in self.attacks:
            if self.tenant_series > MAX_TENANTS + 1:
                failed.append(f"tenants: {self.tenant_series} tenant labels past the cap {MAX_TENANTS}")
            if not self.overflow:
                failed.append("tenants: no record folded into other")
        return failed
