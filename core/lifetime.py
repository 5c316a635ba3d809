"""No helper process outlives the process that started it, whatever signal killed that one.

A party's flow process starts helpers: the Paillier pool's workers and the temporary Prefect
API server. When the flow process is killed with SIGKILL it runs no clean-up, and helpers
that live on hold its pipes (so its runner never sees it exit and never marks the run
Crashed) and its memory. Each helper therefore watches the process it serves and exits the
moment that process is gone, through a pidfd (Linux 5.3+: readable when the process exits,
no polling, no pid reuse) or, elsewhere, a once-a-second liveness check.

``python -m core.lifetime PID -m MODULE ARGS...`` runs ``MODULE`` as ``__main__`` under such a
watch (how the temporary Prefect server is started, see ``flows/runtime.py``).
"""

from __future__ import annotations

import os
import runpy
import select
import sys
import threading
import time
from pathlib import Path


def exit_with(pid: int) -> None:
    """End this process at once (exit status 70) when process ``pid`` has ended."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(70)
    except (AttributeError, OSError):  # no pidfd here: look once a second
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while alive(pid):
                time.sleep(1.0)
        os._exit(70)

    threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True).start()


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux: read from /proc), to check none outlives it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def watched_command(module_argv: list[str], pid: int | None = None) -> list[str]:
    """``python -m MODULE ARGS...`` (``module_argv``: MODULE, ARGS...) as a helper that exits
    when process ``pid`` (default: this one) ends: ``python -m core.lifetime PID -m ...``."""
    owner = os.getpid() if pid is None else pid
    return [sys.executable, "-m", "core.lifetime", str(owner), "-m", *module_argv]


def installation_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this installation first on ``PYTHONPATH``, so a child started with
    :func:`watched_command` imports ``core.lifetime`` (and privreg) from here."""
    root = str(Path(__file__).resolve().parents[1])
    paths = [p for p in (root, env.get("PYTHONPATH", "")) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as alive until reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "-m":
        raise SystemExit("usage: python -m core.lifetime PID -m MODULE [ARGS...]")
    exit_with(int(argv[0]))
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
