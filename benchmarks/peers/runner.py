"""Run a peer's benchmark driver with the peer's own virtualenv and read its JSON result.

Why: privreg's benchmarks print a peer's figures measured in the same run on the same
machine, but a peer (Flower, SecretFlow's spu) is never one of privreg's dependencies. Its
make target (``make peer-flower``, ``make peer-spu``) installs it into ``var/peers/<name>``;
the driver in this folder runs there as a subprocess and prints one JSON document. When the
virtualenv is absent (the benchmark script run directly) or the driver fails, the row says
"not measured" and why, never a figure from elsewhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "var" / "peers"


@dataclass(frozen=True)
class PeerResult:
    """A driver's JSON result, or the reason there is none (``data`` is then None)."""

    data: dict[str, Any] | None
    note: str = ""


def peer_python(name: str) -> Path:
    return PEERS / name / "bin" / "python"


def absent(name: str, target: str) -> str | None:
    """A row's note when ``var/peers/<name>`` is missing (``target`` installs it), else None."""
    if peer_python(name).exists():
        return None
    return f"not measured: run `make {target}` (it installs {name} first)"


def peer_command(name: str, driver: str, args: list[str]) -> list[str]:
    """The command running ``benchmarks/peers/<driver>`` with ``var/peers/<name>``'s python
    (a caller may run it elsewhere, e.g. inside a network namespace)."""
    return [str(peer_python(name)), str(Path(__file__).with_name(driver)), *args]


def run_peer(name: str, driver: str, args: list[str], target: str, timeout: float) -> PeerResult:
    """Run ``benchmarks/peers/<driver>`` with ``var/peers/<name>``'s python; its stderr goes
    to ours only when it fails (the peers log plenty)."""
    if note := absent(name, target):
        return PeerResult(None, note)
    command = peer_command(name, driver, args)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return PeerResult(None, f"not measured: {driver} {' '.join(args)} took over {timeout} s")
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return PeerResult(None, f"not measured: {driver} failed (exit {done.returncode})")
    return PeerResult(json.loads(done.stdout.strip().splitlines()[-1]))
