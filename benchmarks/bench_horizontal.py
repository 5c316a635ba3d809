"""Horizontal logistic regression with secure aggregation: model quality and masking cost.

Usage: python benchmarks/bench_horizontal.py [--quick]

1. Held-out AUC on FATE's homo example data (breast: 2 parties, default_credit: 3 parties),
   trained with one secure aggregation per round, beside scikit-learn LogisticRegression
   (C=1) on the pooled rows. The L2 weight 1/N mirrors C=1 for the mean log-loss.
2. Seconds for one party to mask one round (fixed-point encoding + self mask + 9 pairwise
   masks) with 10 parties, and for the coordinator to unmask with 3 of 10 parties dropped
   (their pairwise masks rebuilt from Shamir shares of their mask keys).
3. Seconds per round of the horizontal flow (keys once per job, masks per round): the demo's
   three hospitals in one process, and the coordinator with 3 and with 10 hospitals each its
   own process over mutual TLS on loopback (``benchmarks/horizontal_rounds.py``), medians of
   ``--rounds`` rounds (default 50), beside the issue's targets and the fixed costs (a Prefect
   task run, a DuckDB opening) measured here; then Flower 1.42's SecAgg+ at 3 and 10 clients on
   its deployment engine, ``--flower-rounds`` rounds each (``benchmarks/peers``; Flower lives in
   its own virtualenv, which ``make bench-horizontal`` makes).
4. The multi-round protocol (``core.secagg.multiround``: keys once per job, masks per round,
   SecAgg+ neighbour graph) at 10, 100 and 1,000 simulated parties in this one process, 10%
   of them dropped each round: the chosen degree k and threshold t with their failure bounds,
   the job's set-up (once), a whole round (every party masks and answers, the coordinator
   unmasks) and one party's share of it.
5. The consistency round (Bonawitz et al. 2017's ConsistencyCheck: each sender signs its view
   of the survivor set, the coordinator relays all views, each sender checks them before it
   answers) at 3, 10 and 100 parties at the horizontal flow's vector size: its CPU per round
   (views signed, encoded, collected, relayed and decoded, checked by every sender) beside
   the core round without it; the channel's signatures and message latency come on top
   (one more message each way a round; see the party-process figures).

Timings are medians over repeats; the machine may be shared, so expect noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.horizontal_lr import (
    party_arrays,
    predict_proba,
    train_federated,
    validate_party_tables,
)
from core.secagg import (
    advertise_keys,
    collect_key_advertisements,
    collect_masked_inputs,
    mask_input,
    new_session,
    reconstruct_sum,
    reveal_shares,
    route_encrypted_shares,
    share_keys,
    start_coordinator,
)
from core.secagg import multiround as mr
from core.secagg.fixed_point import decode
from core.secagg.simulation import out_of_session, rejoin, run_round, start_job

DATA = Path(__file__).resolve().parent / "data" / "fate"
DATASETS = {
    "breast": (["breast_homo_guest", "breast_homo_host"], "breast_homo_test", 0.9873),
    "default_credit": (
        ["default_credit_homo_guest", "default_credit_homo_host_1", "default_credit_homo_host_2"],
        "default_credit_homo_test",
        0.7304,
    ),
}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def auc_rows(quick: bool) -> list[list[object]]:
    rounds = {
        "gradient averaging": (40 if quick else 100, 0),
        "FedAvg, 5 local epochs": (10 if quick else 30, 5),
    }
    rows: list[list[object]] = []
    for name, (party_files, test_file, reference) in DATASETS.items():
        tables = {f: pd.read_csv(DATA / f"{f}.csv.gz") for f in party_files}
        features = validate_party_tables(tables, label="y", id_column="id")
        parties = [party_arrays(t, features) for t in tables.values()]
        X_test, y_test = party_arrays(pd.read_csv(DATA / f"{test_file}.csv.gz"), features)
        X_pool = np.vstack([X for X, _ in parties])
        y_pool = np.concatenate([y for _, y in parties])
        baseline = LogisticRegression(C=1.0, max_iter=2000).fit(X_pool, y_pool)
        sklearn_auc = roc_auc_score(y_test, baseline.predict_proba(X_test)[:, 1])
        for mode, (iterations, epochs) in rounds.items():
            start = time.perf_counter()
            fit = train_federated(
                parties,
                iterations,
                learning_rate=1.0,
                l2=1.0 / len(y_pool),
                epochs_per_round=epochs,
            )
            seconds = time.perf_counter() - start
            auc = roc_auc_score(y_test, predict_proba(fit.weights, X_test))
            rows.append(
                [
                    name,
                    len(parties),
                    len(y_pool),
                    f"{mode}, {iterations} rounds",
                    f"{auc:.4f}",
                    f"{sklearn_auc:.4f}",
                    f"{reference:.4f}",
                    f"{100 * (auc - sklearn_auc) / sklearn_auc:+.2f}%",
                    f"{100 * (auc - reference) / reference:+.2f}%",
                    f"{seconds:.2f}",
                ]
            )
    return rows


def masking_rows(dimension: int, repeats: int, n: int = 10, dropped: int = 3) -> list[list[object]]:
    names = [f"org-{i}" for i in range(n)]
    config = new_session("bench", names, threshold=n // 2 + 1, dimension=dimension)
    rng = np.random.default_rng(1)
    updates = {name: rng.normal(size=dimension) for name in names}

    coordinator = start_coordinator(config)
    states, advertisements = {}, []
    for name in names:
        states[name], message = advertise_keys(config, name)
        advertisements.append(message)
    coordinator, directory = collect_key_advertisements(coordinator, advertisements)
    share_times, share_messages = [], []
    for name in names:
        start = time.perf_counter()
        states[name], message = share_keys(states[name], directory)
        share_times.append(time.perf_counter() - start)
        share_messages.append(message)
    coordinator, deliveries = route_encrypted_shares(coordinator, share_messages)

    mask_times = [
        median_seconds(
            lambda name=name: mask_input(states[name], deliveries[name], updates[name]), repeats
        )
        for name in names
    ]
    senders = names[dropped:]
    masked = []
    for name in senders:
        states[name], message = mask_input(states[name], deliveries[name], updates[name])
        masked.append(message)
    coordinator, request = collect_masked_inputs(coordinator, masked)
    responses = []
    for name in senders:
        states[name], response = reveal_shares(states[name], request)
        responses.append(response)
    unmask_seconds = median_seconds(lambda: reconstruct_sum(coordinator, responses), repeats)
    _, aggregate = reconstruct_sum(coordinator, responses)
    error = np.max(np.abs(decode(aggregate["ring_sum"]) - sum(updates[s] for s in senders)))
    assert error < n * 2.0**-24, f"unmasked sum is wrong (max error {error})"

    return [
        [
            f"party: share keys (Shamir + encrypt for {n - 1} peers)",
            n,
            f"{statistics.median(share_times):.4f}",
        ],
        [
            f"party: mask one round ({n - 1} pairwise + self mask, encode)",
            n,
            f"{statistics.median(mask_times):.4f}",
        ],
        [
            f"coordinator: unmask, {dropped} of {n} dropped (max abs error {error:.1e})",
            n,
            f"{unmask_seconds:.4f}",
        ],
    ]


#: (parties, dimension) of the multi-round runs; targets: 100 x 100,000 under 5 s a round,
#: 1,000 x 10,000 under 30 s, on two cores
MULTIROUND_SIZES = ((10, 100_000), (100, 100_000), (1000, 10_000))


#: parties of the consistency round's figures; dimension: a 10-feature model's packed update
CONSISTENCY_SIZES, CONSISTENCY_DIMENSION = (3, 10, 100), 14


#: seconds per round measured with hospital processes over mTLS before the consistency round
PROCESS_ROUND_SECONDS = {3: 0.132, 10: 0.370}


def consistency_rows(sizes: Sequence[int], rounds: int) -> list[list[object]]:
    """Median CPU per round of the view exchange on a round's critical path: one sender's
    signing and check (every sender does its own in parallel, in its own process) plus the
    coordinator's collecting and relaying, beside the whole core round and the party-process
    round times measured before it.

    The view steps are timed on their own inside a round (:func:`_view_steps_cpu`), so the
    added cost is measured, not inferred from two noisy totals. Not included: the channel's
    signature per view and its check per relayed entry over mTLS, and one more message each
    way (the party-process figures hold those)."""
    from storage import codec

    rows: list[list[object]] = []
    rng = np.random.default_rng(5)
    for n in sizes:
        names = [f"org-{i:04d}" for i in range(n)]
        job = start_job(mr.new_job(f"views-{n}", names, CONSISTENCY_DIMENSION))
        whole, coordinator, sender = [], [], []
        for round_ in range(rounds):
            vectors = {
                p: rng.integers(0, 2**64, CONSISTENCY_DIMENSION, dtype=np.uint64) for p in names
            }
            start = time.process_time()
            run_round(job, 2 * round_, vectors)
            whole.append(time.process_time() - start)
            spent = _view_steps_cpu(job, 2 * round_ + 1, vectors, codec)
            coordinator.append(spent[0])
            sender.append(spent[1])
        path = statistics.median(coordinator) + statistics.median(sender)
        before = PROCESS_ROUND_SECONDS.get(n)
        rows.append(
            [
                n,
                f"{statistics.median(whole) * 1e3:.2f}",
                f"{statistics.median(sender) * 1e3:.3f}",
                f"{statistics.median(coordinator) * 1e3:.3f}",
                f"{path * 1e3:.2f}",
                "n/a" if before is None else f"+{100 * path / before:.1f}% of {before} s",
            ]
        )
    return rows


def _view_steps_cpu(job: object, round_: int, vectors: dict, codec: object) -> tuple[float, float]:
    """One round's view exchange alone (after masking, before answering): the coordinator's
    CPU seconds and one sender's (the mean over senders)."""
    from core.secagg import wire

    job.coordinator, starts = mr.open_round(job.coordinator, round_)
    inputs = []
    for party, start in starts.items():
        job.parties[party] = mr.start_round(job.parties[party], start)
        job.parties[party], message = mr.mask_ring_round(job.parties[party], vectors[party])
        inputs.append(message)
    job.coordinator, requests = mr.collect_inputs(job.coordinator, inputs)
    sender = 0.0
    sent = {}
    for party, request in requests.items():
        began = time.process_time()
        job.parties[party], view = mr.sign_view(job.parties[party], request)
        sent[party] = codec.dumps(wire.view_to_plain(view))
        sender += time.process_time() - began
    began = time.process_time()
    got = [wire.view_from_plain(codec.loads(data), p) for p, data in sent.items()]
    mr.collect_views(job.coordinator, got)
    relay = codec.dumps({p: {"data": data, "proof": b""} for p, data in sent.items()})
    coordinator = time.process_time() - began
    for party, request in requests.items():
        began = time.process_time()
        entries = codec.loads(relay)
        views = {p: wire.view_from_plain(codec.loads(e["data"]), p) for p, e in entries.items()}
        mr._check_views(job.config, request, views, party)
        sender += time.process_time() - began
    responses = []
    for party, request in requests.items():
        job.parties[party], response = mr.answer_unmask(job.parties[party], request, views)
        responses.append(response)
    job.coordinator, _ = mr.unmask(job.coordinator, responses)
    return coordinator, sender / len(requests)


def multiround_rows(sizes: Sequence[tuple[int, int]], rounds: int) -> list[list[object]]:
    """Median seconds of a round over ``rounds`` rounds (10% dropped in each, rejoining after).

    The first round also agrees every pair's keys (once per job); wall and CPU seconds are
    both printed, since one process uses one core and the machine's other load shows in the
    wall time only.
    """
    rows: list[list[object]] = []
    rng = np.random.default_rng(3)
    for n, dimension in sizes:
        names = [f"org-{i:04d}" for i in range(n)]
        start = time.perf_counter()
        config = mr.new_job(f"bench-{n}", names, dimension)
        job = start_job(config)
        setup = time.perf_counter() - start
        k, t = len(config.neighbours[names[0]]), config.threshold
        params = mr.choose_parameters(n)
        times, cpu = [], []
        for round_ in range(rounds):
            vectors = {p: rng.integers(0, 2**64, dimension, dtype=np.uint64) for p in names}
            active = list(job.coordinator.active)
            gone = set(rng.choice(active, size=n // 10, replace=False).tolist())
            start, start_cpu = time.perf_counter(), time.process_time()
            result = run_round(job, round_, vectors, silent_at_mask=gone)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            expected = np.zeros(dimension, dtype=np.uint64)
            for party in result.senders:
                expected += vectors[party]
            assert np.array_equal(expected, result.ring_sum), f"{n} parties: wrong sum"
            for party in out_of_session(job):
                rejoin(job, party)
        per_round, per_round_cpu = statistics.median(times), statistics.median(cpu)
        bounds = params.describe().split("; ", 1)[1].split(" (")[0]
        rows.append(
            [
                n,
                f"{dimension:,}",
                f"{k}{' (complete)' if k == n - 1 else ''}",
                t,
                bounds,
                f"{setup:.2f}",
                f"{per_round:.3f}",
                f"{per_round_cpu:.3f}",
                f"{per_round_cpu / n * 1000:.2f}",
            ]
        )
    return rows


#: The issue's targets for a round of party-mode horizontal LR (coordinator + hospitals as
#: processes over mTLS on loopback), seconds: hospitals -> target
ROUND_TARGETS = {3: 0.25, 10: 0.5}


def flow_rows(rounds: int, one_process_too: bool = True, flower_rounds: int = 0) -> None:
    """The flows' seconds per round: one process, and 3 and 10 hospital processes with the
    coordinator over mTLS, all against one Prefect API; and the fixed costs a round pays.
    Then Flower's SecAgg+ at the same numbers of clients, ``flower_rounds`` rounds each."""
    import tempfile

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from benchmarks.horizontal_rounds import (
        delivery_latency,
        fixed_costs,
        one_process,
        party_processes,
    )

    if os.environ.get("PREFECT_HOME"):
        Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=300):
        api = str(PREFECT_API_URL.value())
        costs = fixed_costs(Path(tmp))
        delivery = delivery_latency(Path(tmp) / "delivery")
        single = one_process(Path(tmp) / "one", rounds) if one_process_too else None
        parties = {
            n: party_processes(Path(tmp) / f"parties-{n}", rounds, api, n) for n in ROUND_TARGETS
        }
    load = os.getloadavg()[0]
    print(f"\n## horizontal_lr, seconds per round, {rounds} rounds (load average {load:.1f})\n")
    rows = []
    if single is not None:
        rows.append(
            [
                "one process, 3 hospitals (file channel)",
                f"{single['round']:.3f}",
                "-",
                f"{single['wall']:.2f}",
            ]
        )
    for n, figures in parties.items():
        met = "yes" if figures["round"] <= ROUND_TARGETS[n] else "no"
        rows.append(
            [
                f"coordinator + {n} hospital processes, mTLS on loopback",
                f"{figures['round']:.3f}",
                f"{ROUND_TARGETS[n]} ({met})",
                f"{figures['wall']:.2f}",
            ]
        )
    headers = ["mode", "round s (median)", "target s (met)", "wall s per round, start-up incl."]
    print(markdown_table(headers, rows))
    cpu = ", ".join(f"{n} hospitals {figures['cpu']:.2f} s" for n, figures in parties.items())
    print(
        f"\nCPU seconds per round of all party processes and their endpoints, start-up "
        f"included ({os.cpu_count()} cores here): {cpu}."
    )
    task_ms, store_ms = costs["task run"] * 1000, costs["store opening"] * 1000
    print(
        f"\nfixed costs here (medians): a Prefect task run {task_ms:.1f} ms, opening a party's "
        f"DuckDB store {store_ms:.1f} ms. Budget of a party-mode round: the coordinator's task "
        "run (a hospital's task run covers about five seconds of rounds: a task run also costs "
        "the Prefect API 28 ms of CPU here under load) and no store opening (each process holds "
        "its store open through the rounds), 2 commits on the coordinator's path (the added "
        "inputs, the round) and 2 at each hospital (its masked input, the checkpoint with its "
        f"answer): about {task_ms:.0f} ms plus 4 commits of fixed cost, the rest is messages (4 "
        "one-way hops: call, masked input, unmask request, answer, then the model) and the "
        "cryptography. A one-process round runs 3n + 3 task runs (mask, answer and save per "
        "hospital, the call, the addition, the update)."
    )
    print("\n## A message from send to the waiting receiver, loopback (target 50 ms)\n")
    rows = [[name, f"{seconds * 1000:.1f}"] for name, seconds in delivery.items()]
    print(markdown_table(["transport", "ms (median of 20)"], rows))
    if flower_rounds:
        from benchmarks.peers.beside import flower_beside

        privreg = {n: figures["round"] for n, figures in parties.items()}
        print(flower_beside(privreg, rounds, flower_rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 100k-dim masking")
    parser.add_argument(
        "--core-only", action="store_true", help="only the multi-round secure sum in the core"
    )
    parser.add_argument("--rounds", type=int, default=50, help="rounds of the flow runs")
    parser.add_argument(
        "--flows-only", action="store_true", help="only the flows' seconds per round"
    )
    parser.add_argument(
        "--parties-only", action="store_true", help="only the party-process flows' rounds"
    )
    parser.add_argument(
        "--flower-rounds",
        type=int,
        default=3,
        help="rounds of Flower SecAgg+ beside the party processes (0: none)",
    )
    args = parser.parse_args()
    if args.flows_only or args.parties_only:
        flow_rows(args.rounds, not args.parties_only, args.flower_rounds)
        return

    print("## Multi-round secure sum in the core (one process, 10% dropped per round)\n")
    headers = [
        "parties",
        "dims",
        "k",
        "t",
        "failure bounds",
        "set-up s (once)",
        "round s (median)",
        "round CPU s",
        "CPU ms per party",
    ]
    print(markdown_table(headers, multiround_rows(MULTIROUND_SIZES, 2 if args.quick else 3)))
    print("\n## The consistency round per round (core, CPU, no processes)\n")
    headers = [
        "parties",
        "core round CPU ms",
        "one sender's views CPU ms",
        "coordinator's views CPU ms",
        "added per round ms",
        "vs party processes",
    ]
    print(markdown_table(headers, consistency_rows(CONSISTENCY_SIZES, 5 if args.quick else 20)))
    if args.core_only:
        return
    flow_rows(args.rounds, flower_rounds=args.flower_rounds)

    print("## Held-out AUC, secure aggregation vs scikit-learn on pooled rows\n")
    headers = [
        "data",
        "parties",
        "train rows",
        "mode",
        "secagg AUC",
        "sklearn AUC",
        "FATE ref.",
        "vs sklearn",
        "vs ref.",
        "seconds",
    ]
    print(markdown_table(headers, auc_rows(args.quick)))

    dimension = 100_000 if args.quick else 1_000_000
    rows = masking_rows(dimension, repeats=3 if args.quick else 5)
    print(f"\n## Secure aggregation, 10 parties, {dimension:,}-dim update (median seconds)\n")
    print(markdown_table(["step", "parties", "seconds"], rows))


if __name__ == "__main__":
    main()
