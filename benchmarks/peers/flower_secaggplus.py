"""Flower's SecAgg+ on its deployment engine, timed per round on this machine, for
bench_horizontal to print beside privreg's party processes.

Run it with the python of the virtualenv that ``make peer-flower`` makes (flwr 1.42.0), never
privreg's own: Flower is a peer measured here, not a dependency.

Usage: python benchmarks/peers/flower_secaggplus.py --clients N [--rounds R] [--plain]

Starts a SuperLink and one SuperNode per client, each its own process on loopback, in
insecure mode (no TLS: Flower's TLS needs certificates with the right names for three APIs,
and on loopback it would add little next to Flower's own round cost), with Flower's defaults
otherwise (the SuperLink runs the ServerApp and every SuperNode each message's ClientApp in a
subprocess). ``flwr run`` submits ``flower_app.py``: the 31-number logistic regression on the
demo's hospitals, SecAgg+ through ``SecAggPlusWorkflow`` and ``secaggplus_mod`` (every client
a neighbour of every other, reconstruction threshold N // 2 + 1 as privreg's), or plain FedAvg
with ``--plain``. Prints one JSON document on stdout: the median seconds per round (from one
round's end to the next's), each round's seconds, the wall seconds from ``flwr run`` to the
last round's end and from the first process's start, and how far the final model is from the
same rounds computed in the clear.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEMO = HERE.parents[1] / "demo" / "horizontal"
BIN = Path(sys.executable).parent

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "privregbench"
version = "1.0.0"
description = "privreg's horizontal LR benchmark model under Flower SecAgg+"
license = "Apache-2.0"
dependencies = ["flwr==1.42.0", "numpy", "pandas"]

[tool.flwr.app]
publisher = "privreg"

[tool.flwr.app.components]
serverapp = "flower_app:server"
clientapp = "flower_app:client"

[tool.flwr.app.config]
rounds = 3
clients = 3
secure = true
num-shares = 1.0
threshold = 2
out = ""
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(clients: int, rounds: int, secure: bool, folder: Path) -> dict[str, object]:
    app = folder / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(PYPROJECT)
    shutil.copy(HERE / "flower_app.py", app / "flower_app.py")
    port = free_port()
    # Flower starts its own helpers (flower-superexec, flwr-serverapp, flwr-clientapp) by name
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "FLWR_HOME": str(folder / "home"), "PATH": path}
    (folder / "home").mkdir()
    (folder / "home" / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    logs = (folder / "logs").resolve()
    logs.mkdir()
    out = folder / "result.json"
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        with (logs / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(  # a group of its own: its helpers end with it
                command,
                env=env,
                cwd=folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        processes.append(process)
        return process

    started = time.time()
    try:
        start(
            "superlink",
            [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
             "--port", str(port), "--disable-runtime-dependency-installation"],
        )  # fmt: skip
        for index in range(clients):
            node = f'partition-id={index} num-partitions={clients} data-dir="{DEMO}"'
            start(
                f"supernode-{index}",
                [str(BIN / "flower-supernode"), "--insecure", "--superlink",
                 f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", str(free_port()),
                 "--node-config", node],
            )  # fmt: skip
        wait_for_port(port, processes[0], logs / "superlink.log")
        run_config = (
            f"rounds={rounds} clients={clients} secure={'true' if secure else 'false'} "
            f'num-shares=1.0 threshold={clients // 2 + 1} out="{out.resolve()}"'
        )
        submitted = time.time()
        subprocess.run(
            [str(BIN / "flwr"), "run", str(app), "bench", "--run-config", run_config],
            env=env, cwd=folder, check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        deadline = time.time() + 600 + 300 * rounds
        while not out.exists():
            for process in processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a Flower process ended (exit {process.returncode})")
            if time.time() > deadline:
                raise TimeoutError(f"no result after {deadline - submitted:.0f} s")
            time.sleep(0.2)
        result = json.loads(out.read_text())
    except BaseException:
        for log in sorted(logs.glob("*.log")):
            sys.stderr.write(f"--- {log.name}\n" + log.read_text(errors="replace")[-3000:])
        raise
    finally:
        stop(processes)
    ends = result["ends"]
    per_round = [b - a for a, b in itertools.pairwise(ends)]
    expected = plaintext_model(clients, len(per_round))
    error = max(abs(a - b) for a, b in zip(result["model"], expected, strict=True))
    return {
        "flwr": "1.42.0",
        "clients": clients,
        "secure": secure,
        "rounds": len(per_round),
        "round": statistics.median(per_round),
        "per_round": per_round,
        "wall_from_submit": ends[-1] - submitted,
        "wall_from_start": ends[-1] - started,
        "max_error": error,
    }


def plaintext_model(clients: int, rounds: int) -> list[float]:
    """The model the rounds should reach: FedAvg of the clients' gradient steps, in the clear
    (SecAgg+ quantises each client's model to 2^22 levels over [-8, 8]: about 1e-5 off)."""
    sys.path.insert(0, str(HERE))
    from flower_app import FEATURES, Hospital, hospital_rows

    hospitals = [Hospital(*hospital_rows(DEMO, i, clients)) for i in range(clients)]
    weights = np.zeros(FEATURES + 1)
    for _ in range(rounds):
        fits = [h.fit([weights], {}) for h in hospitals]
        weights = sum(n * w for (w,), n, _ in fits) / sum(n for _, n, _ in fits)
    return [float(v) for v in weights]


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """End each Flower process and what it started: a SuperNode's ClientApp processes can
    outlive it otherwise (each process leads a group of its own)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        deadline = time.time() + 20
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.time()))


def wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the SuperLink ended: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError("the SuperLink did not open its port in 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plain", action="store_true", help="FedAvg without SecAgg+")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.clients, args.rounds, not args.plain, Path(tmp))
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
