"""How every party step retries, in one place: transient faults (a message not there yet, a
locked file, an I/O hiccup) with backoff; a refused input, a protocol violation, a budget refusal
or another party's failure would fail again, so it fails at once. No step uses Prefect's result
cache: the parties' stores (checkpoints, releases, messages) are the truth when a run resumes.
"""

from __future__ import annotations

from typing import Any

from prefect.cache_policies import NO_CACHE

from federation.status import PeerFailedError
from storage.ledger import BudgetError


def is_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry condition: anything but bad input (ValueError), budget refusals and the end of
    the job at another party."""
    try:
        state.result()
    except (ValueError, BudgetError, PeerFailedError):
        return False
    except Exception:
        return True
    return True


PARTY_STEP: dict[str, Any] = {
    "retries": 2,
    "retry_delay_seconds": [1, 5],
    "retry_condition_fn": is_transient,
    "cache_policy": NO_CACHE,
}
