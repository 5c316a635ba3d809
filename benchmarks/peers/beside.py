"""The peers' rows that privreg's benchmarks print beside their own, measured in the same run.

``flower_beside``: Flower 1.42's SecAgg+ on its deployment engine at the party counts
bench_horizontal ran privreg with; ``spu_rows``: SecretFlow's RR22 and KKRT (spu 0.9.5) at
bench_psi's size; ``openmined_rows``: openmined-psi 2.0.6 at bench_psi's sizes. Each runs the
peer's driver (``runner.run_peer``) after privreg's own runs, one at a time, so the two never
compete for the machine's cores.
"""

from __future__ import annotations

import os

from .runner import run_peer

#: seconds a peer's run may take before its row says so (Flower polls every few seconds and
#: starts a process per message: tens of seconds a round under load)
FLOWER_TIMEOUT_PER_ROUND, SPU_TIMEOUT, OPENMINED_TIMEOUT = 600.0, 3600.0, 3600.0


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def flower_beside(privreg: dict[int, float], privreg_rounds: int, rounds: int) -> str:
    """A markdown section: privreg's median seconds per round (``privreg``: hospitals ->
    seconds) beside Flower SecAgg+'s at the same numbers of clients."""
    rows, notes = [], []
    for n, seconds in privreg.items():
        run = run_peer(
            "flower",
            "flower_secaggplus.py",
            ["--clients", str(n), "--rounds", str(rounds)],
            "bench-horizontal",
            FLOWER_TIMEOUT_PER_ROUND * (rounds + 1),
        )
        if run.data is None:
            rows.append([str(n), f"{seconds:.3f}", run.note, "", ""])
            continue
        flower = run.data
        rows.append(
            [
                str(n),
                f"{seconds:.3f}",
                f"{flower['round']:.1f} ("
                + ", ".join(f"{s:.1f}" for s in flower["per_round"])
                + ")",
                f"{flower['round'] / seconds:,.0f}x",
                f"{flower['wall_from_start']:.0f}",
            ]
        )
        notes.append(f"{n} clients {flower['max_error']:.1e}")
    load = os.getloadavg()[0]
    headers = [
        "hospitals",
        f"privreg s/round (median of {privreg_rounds})",
        f"Flower SecAgg+ s/round (median of {rounds}: each round)",
        "Flower / privreg",
        "Flower wall s, start-up incl.",
    ]
    text = (
        f"\n## Flower 1.42.0 SecAgg+ beside privreg, seconds per round, same run (load average "
        f"{load:.1f} after Flower)\n\n{_table(headers, rows)}\n\n"
        "Flower: its deployment engine on loopback, a SuperLink and one SuperNode per client, "
        "each its own process, insecure mode (no TLS; privreg's rounds run over mTLS), its "
        "default subprocess isolation (a new ClientApp process for every message); the same "
        "31-number logistic regression on the same rows (one gradient step per round), "
        "SecAgg+ through SecAggPlusWorkflow and secaggplus_mod with every client a neighbour "
        "and privreg's threshold N // 2 + 1; a round is from one round's end to the next's."
    )
    if notes:
        text += f" Final model vs the same rounds in the clear, max abs error: {', '.join(notes)}."
    return text


def spu_rows(size: int, repeats: int) -> list[list[str]]:
    """Rows for bench_psi's table (implementation, median s, ids/s, cpu s, peak MiB, wire
    bytes/id): spu's RR22 and KKRT at ``size`` x ``size``, rerun here."""
    run = run_peer(
        "spu",
        "spu_psi.py",
        ["--size", str(size), "--repeats", str(repeats)],
        "bench-psi",
        SPU_TIMEOUT,
    )
    if run.data is None:
        return [["spu 0.9.5 RR22 and KKRT (SecretFlow libpsi)", run.note, "", "", "", ""]]
    names = {"RR22": "RR22 (VOLE-based OPRF)", "KKRT": "KKRT16 (OT-based OPRF)"}
    rows = []
    for protocol, figures in run.data["protocols"].items():
        seconds = figures["seconds"]
        rows.append(
            [
                f"spu {run.data['spu']} {names.get(protocol, protocol)}, 2 processes over "
                "loopback (both learn)",
                f"{seconds:.2f}",
                f"{2 * size / seconds:,.0f}",
                f"{figures['cpu']:.1f}",
                f"{figures['peak_mib']:,.0f}",
                "",
            ]
        )
    return rows


def openmined_rows(small: int, size: int, repeats: int) -> list[list[str]]:
    """A row for bench_psi's table (as :func:`spu_rows`): openmined-psi at ``small`` x
    ``size``, client and server in one process, rerun here."""
    name = "openmined-psi 2.x P-256, one process (client learns)"
    args = ["--size", str(size), "--small", str(small), "--repeats", str(repeats)]
    run = run_peer("openmined", "openmined_psi.py", args, "bench-psi", OPENMINED_TIMEOUT)
    if run.data is None:
        return [[name, run.note, "", "", "", ""]]
    figures = run.data
    seconds = figures["seconds"]
    return [
        [
            name.replace("2.x", figures["openmined_psi"]),
            f"{seconds:.2f}",
            f"{(small + size) / seconds:,.0f}",
            f"{figures['cpu']:.1f}",
            f"{figures['peak_mib']:,.0f}",
            f"{figures['wire_bytes'] / size:.1f}",
        ]
    ]
