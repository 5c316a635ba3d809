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


def test_bench_wan_spu_rows_without_spu_are_not_measured_and_name_the_make_target(
    tmp_path, monkeypatch
):
    from benchmarks import bench_wan, wan

    monkeypatch.setattr(runner, "PEERS", tmp_path)
    name = bench_wan.spu_name("RR22", 100_000)
    run = lambda s, p, j: bench_wan.spu_psi_run(s, "RR22", 100_000)  # noqa: E731
    measured = bench_wan.run_case(name, run, wan.WAN, None, 3, api_port=0)
    assert measured.figures is None and measured.runs == 0
    line = bench_wan.row(*measured)
    assert line.startswith(
        "| spu RR22 PSI 100,000 x 100,000 | WAN | 100 Mbit/s, 20 ms "
        "| not measured: run `make bench-wan` (it installs spu first) |"
    )


def test_bench_wan_spu_sides_listen_on_their_own_address_and_dial_through_the_relay():
    """Each party's brpc link: its own entry where it listens, its peer's relay port."""
    from types import SimpleNamespace

    from benchmarks import bench_wan

    relay = {("clinic", "lab"): "10.77.0.1:20000", ("lab", "clinic"): "10.77.0.1:20001"}
    net = SimpleNamespace(
        parties=["clinic", "lab"],
        address={"clinic": "10.77.0.10", "lab": "10.77.0.11"},
        peer_address=lambda dialler, peer: relay[dialler, peer],
    )
    assert bench_wan.spu_link(net, 0) == ["10.77.0.10:7700", "10.77.0.1:20000"]
    assert bench_wan.spu_link(net, 1) == ["10.77.0.1:20001", "10.77.0.11:7700"]


def test_bench_wan_prints_the_psi_target_beside_privregs_1m_rr22_row_at_wan():
    from benchmarks import bench_wan, wan

    size = 1_000_000
    figures = {"seconds": 10.0, "sent": 35_000_000, "ids": size}  # 280 bits per id
    rr22 = {"seconds": 12.0, "sent": 40_000_000, "ids": size}
    measured = {(bench_wan.spu_name("RR22", size), "WAN"): rr22}
    cell = bench_wan.psi_target(bench_wan.psi_name(size, "rr22"), wan.WAN, figures, measured)
    assert cell == "≤ spu RR22's 12.00 s: met; ≤ 300 bits per id: met"
    slow = {**figures, "seconds": 13.0, "sent": 40_000_000}
    cell = bench_wan.psi_target(bench_wan.psi_name(size, "rr22"), wan.WAN, slow, measured)
    assert cell == "≤ spu RR22's 12.00 s: missed; ≤ 300 bits per id: missed"
    alone = bench_wan.psi_target(bench_wan.psi_name(size, "rr22"), wan.WAN, figures, {})
    assert alone.startswith("spu RR22 not measured; ")
    assert bench_wan.psi_target(bench_wan.psi_name(size, "rr22"), wan.LAN, figures, measured) == ""
    assert (
        bench_wan.psi_target(bench_wan.psi_name(100_000, "rr22"), wan.WAN, figures, measured) == ""
    )
    kkrt = bench_wan.psi_name(size, "kkrt")  # the target is the low-communication protocol's
    assert kkrt == "PSI KKRT16 1,000,000 x 1,000,000"
    assert bench_wan.psi_target(kkrt, wan.WAN, figures, measured) == ""
    assert bench_wan.bits_per_id(figures) == "280"
    assert bench_wan.bits_per_id({"sent": 1}) == ""  # not a PSI row


def test_bench_wan_prints_the_round_trip_target_beside_the_ten_hospital_row_at_wan():
    from benchmarks import bench_wan, wan

    name = "horizontal LR, 10 hospitals"
    assert bench_wan.round_trip_target(name, wan.WAN, {"message round trips": 3}) == (
        "≤ 4 round trips per round: met"
    )
    assert bench_wan.round_trip_target(name, wan.WAN, {"message round trips": 5}).endswith("missed")
    assert bench_wan.round_trip_target(name, wan.WAN, None) == "not measured"
    assert bench_wan.round_trip_target(name, wan.LAN, {"message round trips": 3}) == ""
    assert bench_wan.round_trip_target("horizontal LR, 3 hospitals", wan.WAN, {}) == ""
