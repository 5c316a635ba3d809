"""A storage session keeps a party's database open for a burst of calls: each call inside is
still its own transaction (committed durably, or rolled back whole), the database is released
to other processes when the session ends, and a process killed inside one loses nothing it
committed. A round's checkpoint and its pruning commit in one transaction."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import numpy as np
import pytest

from storage.artifacts import ArtifactStore
from storage.checkpoints import RoundCheckpoints
from storage.party_store import PartyStore

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from storage.artifacts import ArtifactStore
    from storage.party_store import PartyStore

    store = PartyStore(sys.argv[1])
    artifacts = ArtifactStore(store)
    with store.session():
        artifacts.put("committed", [1, 2**1000], "test")
        try:
            with store.transaction() as con:
                artifacts.put("rolled-back", 1, "test", con=con)
                raise RuntimeError("fails half-way")
        except RuntimeError:
            pass
    print("released", flush=True)
    sys.stdin.readline()
    with store.session():
        artifacts.put("before-kill", {"round": 7}, "test")
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no checkpoint, no close: only the log has it
    """
)


def test_session_commits_survive_a_kill_and_the_file_is_released_at_its_end(
    tmp_path: Path,
) -> None:
    database = tmp_path / "party" / "bank.duckdb"
    store = PartyStore(database)
    ArtifactStore(store).put("setup", 0, "test")  # the database exists before the child
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(database)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "released"
        # the child is alive but its session ended: this process opens the file at once
        with store.connect(lock_timeout=2.0) as con:
            keys = {row[0] for row in con.execute("SELECT key FROM privreg_artifacts").fetchall()}
        assert keys == {"setup", "committed"}  # the failed transaction left nothing
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "holding"
        assert child.wait(timeout=30) != 0  # killed inside its session
    finally:
        child.kill()
        child.wait()
    artifacts = ArtifactStore(store)
    assert artifacts.get("committed") == [1, 2**1000]
    assert artifacts.get("before-kill") == {"round": 7}
    assert artifacts.get("rolled-back") is None


def test_sessions_nest_share_threads_and_never_create_a_database(tmp_path: Path) -> None:
    missing = PartyStore(tmp_path / "nobody.duckdb")
    with missing.session():
        assert ArtifactStore(missing).get("x", default="none") == "none"
    assert not missing.path.exists()

    store = PartyStore(tmp_path / "bank.duckdb")
    artifacts = ArtifactStore(store)
    artifacts.put("a", 1, "test")
    with store.session():
        with store.session():
            artifacts.put("b", 2, "test")
        # the inner session's end keeps the database open: a connection still joins it, and
        # a transaction that fails inside the outer session rolls back alone
        with pytest.raises(duckdb.ConstraintException), store.transaction() as con:
            artifacts.put("c", 3, "test", con=con)
            con.execute("INSERT INTO privreg_artifacts SELECT * FROM privreg_artifacts")
        assert [key for key, *_ in artifacts.list()] == ["a", "b"]
        # threads of the process share the open database, each with its own connections
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda i: artifacts.put(f"t/{i:02d}", i, "test"), range(20)))
    assert artifacts.get("b") == 2 and artifacts.get("c") is None
    assert [artifacts.get(f"t/{i:02d}") for i in range(20)] == list(range(20))


def test_a_round_checkpoint_and_its_pruning_commit_together(tmp_path: Path) -> None:
    store = PartyStore(tmp_path / "bank.duckdb")
    checkpoints = RoundCheckpoints(store, "vertical", "job-1")
    for round_ in range(3):
        checkpoints.save(round_, {"weights": np.full(2, float(round_))})
    with pytest.raises(RuntimeError), store.session(), store.transaction() as con:
        checkpoints.save(3, {"weights": np.full(2, 3.0)}, con)
        checkpoints.prune(keep_last=1, con=con)
        raise RuntimeError("killed before the round's commit")
    assert checkpoints.rounds() == [0, 1, 2]  # nothing of round 3, nothing pruned
    with store.transaction() as con:
        checkpoints.save(3, {"weights": np.full(2, 3.0)}, con)
        checkpoints.prune(keep_last=2, con=con)
    assert checkpoints.rounds() == [2, 3]
    assert np.array_equal(checkpoints.load(3)["weights"], [3.0, 3.0])
