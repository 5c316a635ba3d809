"""Many secure sums of one job at one key agreement (:mod:`core.secagg.multiround`), per holder.

Why a module of its own: :mod:`tasks.secure_sum` runs one four-stage session (fresh keys, share
exchange) per sum, which is what one-off sums (pooled statistics, sparse LDA) need; a training
job sums once per round and must not pay key agreement every time. Here each holder keeps one
record per job in its own store, sealed under the job's key file (:mod:`storage.secrets`):
its multi-round state (private key, pair secrets, the round it masked and the request it
answered) and what it sent from it. A step computes, stores the new record, and only then
sends; a retry (or a process restarted after kill -9) finds the record and re-sends the same
bytes, so no mask covers two inputs and no second, different unmask request is answered.

Messages (``round`` is the training round; every kind is plain, the same on a re-run):

=========================  ====================================  ===========================
kind                        sender -> receiver                    when
=========================  ====================================  ===========================
``secagg_job_keys``         party -> coordinator                  once per job (round 0)
``round`` (the call)        coordinator -> every party            each round: active + keys
``secagg_masked``           party -> coordinator                  each round
``secagg_unmask_request``   coordinator -> each sender            each round
``secagg_masked_relay``     coordinator -> each sender            with the requests
``secagg_view``             sender -> coordinator                 on its request
``secagg_view_relay``       coordinator -> each sender            before any answer
``secagg_unmask_response``  sender -> coordinator                 each round
``secagg_unmask_response_   coordinator -> each sender            before the model
relay``
``rejoin``                  left-out party -> coordinator         with its new keys (re-key)
=========================  ====================================  ===========================

The view exchange (Bonawitz et al.'s ConsistencyCheck) and the relays that let every party
check the announced sum: docs/protocols/horizontal-lr.md. A party's steps are
:mod:`tasks.secure_rounds_party`, the coordinator's :mod:`tasks.secure_rounds_coordinator`.
"""

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
