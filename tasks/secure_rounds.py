"""Many secure sums of one job at one key agreement (:mod:`core.secagg.multiround`): the job's
terms, each holder's sealed record (stored before a step sends) and the message kinds.
More: docs/secure-aggregation.md (the messages), docs/protocols/horizontal-lr.md (the checks)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from core.secagg import multiround as mr
from core.secagg.fixed_point import DEFAULT_SCALE_BITS
from core.secagg.graph import choose_parameters
from storage.artifacts import Artifact
from storage.party_store import PartyStore
from storage.secrets import SealedArtifacts

JOB_KEYS, MASKED, REQUEST, RESPONSE, REJOIN = (
    "secagg_job_keys",
    "secagg_masked",
    "secagg_unmask_request",
    "secagg_unmask_response",
    "rejoin",
)
VIEW = "secagg_view"
MASKED_RELAY, RESPONSE_RELAY = f"{MASKED}_relay", f"{RESPONSE}_relay"
VIEW_RELAY = f"{VIEW}_relay"
RELAY_OF = {MASKED: MASKED_RELAY, RESPONSE: RESPONSE_RELAY, VIEW: VIEW_RELAY}


@functools.lru_cache(maxsize=16)
def _config(
    job_id: str, parties: tuple[str, ...], threshold: int, dimension: int, scale_bits: int
) -> mr.JobConfig:
    params = choose_parameters(len(parties))
    if params.degree >= len(parties) - 1:  # complete graph: the job's own threshold holds
        params = replace(params, threshold=threshold)
    return mr.new_job(
        job_id, parties, dimension, min_senders=threshold, parameters=params, scale_bits=scale_bits
    )


@dataclass(frozen=True)
class RoundsJob:
    """What every holder of a job agrees on before its first round (small, non-secret)."""

    protocol: str  # namespaces the holders' records, e.g. "horizontal"
    job_id: str
    parties: tuple[str, ...]
    threshold: int  # fewest senders a sum may have
    dimension: int
    scale_bits: int = DEFAULT_SCALE_BITS
    stage_timeout: float = 60.0  # seconds a stage waits (the coordinator's view stage too)

    def terms(self) -> dict[str, Any]:
        """What a hospital agrees to from its own options and compares every call with."""
        return {
            "parties": list(self.parties),
            "threshold": self.threshold,
            "stage_timeout": float(self.stage_timeout),
        }

    def config(self) -> mr.JobConfig:
        """The job's SecAgg+ configuration: the same at every holder (graph from the job id);
        with a complete graph each self-mask needs ``threshold`` of its holders."""
        return _config(self.job_id, self.parties, self.threshold, self.dimension, self.scale_bits)

    @property
    def scope(self) -> str:
        """The job key file the records are sealed under (shredded at the job's end)."""
        return f"{self.protocol}/{self.job_id}/rounds"

    def record_key(self, who: str) -> str:
        return f"{self.scope}/{who}"


def _records(store: PartyStore, job: RoundsJob) -> SealedArtifacts:
    return SealedArtifacts(store, job.scope)


def load_record(store: PartyStore, job: RoundsJob, who: str, con: Any = None) -> dict[str, Any]:
    """This holder's record of the job ({} before its first step)."""
    return _records(store, job).get(job.record_key(who), {}, con=con) or {}


def save_record(
    store: PartyStore,
    job: RoundsJob,
    who: str,
    record: dict[str, Any],
    con: Any,
    also: Sequence[Artifact] = (),
) -> None:
    """Store the holder's record (sealed), with ``also`` (e.g. the round's checkpoint) in the
    same statement."""
    records = _records(store, job)
    records.artifacts.put_many([records.item(job.record_key(who), record), *also], con=con)


def forget_job(store: PartyStore, job: RoundsJob) -> None:
    """At the job's end: shred the key the records are sealed under (and drop them)."""
    records = _records(store, job)
    with store.transaction() as con:
        records.artifacts.delete_prefix(job.scope + "/", con=con)
    records.destroy()
