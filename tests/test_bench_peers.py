"""The peers' rows in privreg's benchmarks: without the peer's own virtualenv, or when its
driver fails, a row says "not measured" and why, never a figure."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import beside, runner


def test_an_absent_peer_is_not_measured_and_names_its_make_target(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "PEERS", tmp_path)
    text = beside.flower_beside({3: 0.123}, 50, rounds=3)
    row = next(line for line in text.splitlines() if line.startswith("| 3 |"))
    assert row.startswith("| 3 | 0.123 | not measured: run `make bench-horizontal`")
    assert "x |" not in row  # no ratio without Flower's figure
    (spu,) = beside.spu_rows(100_000, repeats=1)
    assert spu[1] == "not measured: run `make bench-psi` (it installs spu first)"
    assert spu[2:] == ["", "", "", ""]
    (openmined,) = beside.openmined_rows(1_000, 100_000, repeats=1)
    assert openmined[1] == "not measured: run `make bench-psi` (it installs openmined first)"
    assert openmined[2:] == ["", "", "", ""]


def test_peers_install_into_their_own_virtualenvs_never_privregs():
    """Only the install rule puts packages into privreg's .venv; each peer's make target
    installs into var/peers/<name>, and bench_psi and bench_paillier import no peer
    themselves."""
    root = Path(__file__).resolve().parents[1]
    rule, into_venv, into_peers = "", [], {}
    for line in (root / "Makefile").read_text().splitlines():
        if line and not line[0].isspace() and ":" in line:
            rule = line.split(":")[0]
        elif "pip install" in line and "$(BIN)/python" in line:
            into_venv.append(rule)
        elif "pip install" in line and "$(PEERS)/" in line:
            into_peers[line.split("$(PEERS)/")[1].split("/")[0]] = rule
    assert set(into_venv) == {"$(STAMP)"}
    assert into_peers == {name: f"$(PEERS)/{name}/.installed" for name in into_peers}
    assert {"flower", "spu", "openmined", "heu"} <= set(into_peers)
    bench = (root / "benchmarks" / "bench_psi.py").read_text()
    assert "private_set_intersection" not in bench and "import spu" not in bench
    assert "from heu" not in (root / "benchmarks" / "bench_paillier.py").read_text()


def test_a_failing_driver_is_not_measured(tmp_path, monkeypatch, capfd):
    """privreg's own python as the 'peer': spu is not importable there, the driver exits."""
    if importlib.util.find_spec("spu") is not None:
        pytest.skip("spu is importable here")
    (tmp_path / "spu" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tmp_path / "spu" / "bin" / "python")
    monkeypatch.setattr(runner, "PEERS", tmp_path)
    run = runner.run_peer("spu", "spu_psi.py", ["--size", "10"], "bench-psi", timeout=60)
    assert run.data is None
    assert run.note == "not measured: spu_psi.py failed (exit 1)"
    assert "No module named 'spu'" in capfd.readouterr().err
