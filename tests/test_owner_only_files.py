"""A party's files and folders are its owner's only from their creation, not after a chmod.

A fresh process with the common umask 022 opens a new database and writes to it (DuckDB then
creates its write-ahead log itself) and sends a message (the channel creates its folders):
while the connection is still open, before any chmod privreg does at close, nothing it
created may be readable by the group or others.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path

    os.umask(0o022)
    root = Path(sys.argv[1])
    from storage.party_store import PartyStore
    from federation.workspace import channel_for

    with PartyStore(root / "clinic" / "db" / "clinic.duckdb").connect() as con:
        con.execute("CREATE TABLE t AS SELECT 1 AS x")  # creates the write-ahead log
        for path in sorted(root.rglob("*")):  # while open: no chmod has run yet
            print(oct(path.stat().st_mode), path.relative_to(root))
    channel_for("job", str(root / "ws")).endpoint("clinic").send("lab", "kind", 1)
    for path in sorted((root / "ws").rglob("*")):
        print(oct(path.stat().st_mode), path.relative_to(root))
    print("umask", oct(os.umask(0)))
    """
)


def test_databases_logs_and_message_folders_are_private_from_creation(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[-1] == "umask 0o77"  # the process keeps creating private files
    modes = {name: int(mode, 8) for mode, name in (line.split(" ", 1) for line in lines[:-1])}
    assert "clinic/db/clinic.duckdb.wal" in modes and "ws/runs/job/messages" in modes
    shared = {
        name: stat.filemode(mode)
        for name, mode in modes.items()
        if mode & (stat.S_IRWXG | stat.S_IRWXO)
    }
    assert shared == {}
