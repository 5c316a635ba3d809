"""Benchmark of the Paillier layer against a straightforward ``phe`` implementation.

Run ``python benchmarks/bench_paillier.py [--quick] [--workers 2]``. Prints markdown tables:
per-operation throughput (encrypt, decrypt, add, multiply) and X^T [[d]] for a 30,000 x 23
(FATE default_credit features) and a 100,000 x 300 (synthetic) matrix, each next to the phe
loop (encrypt each value, ``ct * float``, sum) measured in the same run, plus the "physical
floor": the number of modular multiplications the algorithm performs times the measured cost
of one 4096-bit multiply-and-reduce. Large cases time a subset of rows/columns and extrapolate
linearly (marked "extrapolated").

The machine may be shared, so times are CPU seconds (``time.process_time``), which a busy
neighbour inflates far less than wall-clock time; medians over repeats. For process-parallel
runs each chunk's CPU time is measured inside the worker, and the "critical path" (main
process CPU + slowest worker's CPU) is what the call takes when every worker has a core to
itself; the wall-clock time of the same run is printed next to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gmpy2
import numpy as np
import pandas as pd
from gmpy2 import mpz
from phe.paillier import PaillierPrivateKey, PaillierPublicKey

from core.paillier import (
    DJNRandomizer,
    EncryptedVector,
    ObfuscatorPool,
    ProcessBackend,
    StandardRandomizer,
    encode_matrix,
    encode_values,
    generate_keypair,
    pack,
    predicted_multiplications,
)

DATA_DIR = Path(__file__).resolve().parent / "data" / "fate"
KEY_BITS = 2048
VALUE_FRAC_BITS = 32
FEATURE_FRAC_BITS = 16


@dataclass(frozen=True)
class Settings:
    quick: bool
    workers: int
    repeats: int
    encrypt_count: int
    decrypt_count: int
    cheap_op_count: int
    phe_loop_rows: int
    credit_columns: int | None  # None: all 23 columns, no extrapolation
    wide_rows: int
    wide_columns: int


def settings_for(quick: bool, workers: int) -> Settings:
    if quick:
        return Settings(True, workers, 3, 12, 12, 200, 60, 4, 100_000, 2)
    return Settings(False, workers, 5, 40, 40, 1000, 200, None, 100_000, 4)


def _timed_call(function: Callable[..., object], *args: object) -> tuple[object, float, int]:
    start = time.process_time()
    result = function(*args)
    return result, time.process_time() - start, os.getpid()


class CpuTimingBackend:
    """Wraps a process backend and records the CPU seconds each worker chunk used."""

    def __init__(self, inner: ProcessBackend) -> None:
        self._inner = inner
        self.slowest_chunks: list[float] = []

    @property
    def parallelism(self) -> int:
        return self._inner.parallelism

    def run(
        self, function: Callable[..., Any], arguments: Any, *, sensitive: bool = False
    ) -> list[Any]:
        wrapped = [(function, *args) for args in arguments]
        outputs = self._inner.run(_timed_call, wrapped, sensitive=sensitive)
        # Chunks run inline (a single chunk) are already in this process's CPU time.
        remote = [cpu for _, cpu, pid in outputs if pid != os.getpid()]
        self.slowest_chunks.append(max(remote, default=0.0))
        return [result for result, _, _ in outputs]


@dataclass(frozen=True)
class Timing:
    cpu: float  # main-process CPU (+ slowest worker chunk per parallel step)
    wall: float


def measure(
    action: Callable[[], object], repeats: int, backend: CpuTimingBackend | None = None
) -> Timing:
    """Median CPU and wall seconds of ``action`` (critical path if it uses ``backend``)."""
    cpu_samples, wall_samples = [], []
    for _ in range(repeats):
        if backend is not None:
            backend.slowest_chunks = []
        wall, cpu = time.perf_counter(), time.process_time()
        action()
        cpu = time.process_time() - cpu
        wall = time.perf_counter() - wall
        if backend is not None:
            cpu += sum(backend.slowest_chunks)
        cpu_samples.append(cpu)
        wall_samples.append(wall)
    return Timing(statistics.median(cpu_samples), statistics.median(wall_samples))


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    """Median CPU seconds of a serial action."""
    return measure(action, repeats).cpu


def format_seconds(seconds: float) -> str:
    return f"{seconds:,.1f} s" if seconds >= 10 else f"{seconds:,.2f} s"


# ------------------------------------------------------------------------------ primitives


def measure_mulmod(public_key: PaillierPublicKey, repeats: int) -> float:
    """Seconds for one 4096-bit (mod n^2) multiply-and-reduce with gmpy2."""
    n_square = mpz(public_key.n) ** 2
    values = StandardRandomizer(public_key).obfuscators(64)

    def chain() -> None:
        accumulator = values[0]
        for _ in range(50):
            for value in values:
                accumulator = accumulator * value % n_square

    return median_seconds(chain, repeats) / (50 * len(values))


def synthetic_ciphertexts(public_key: PaillierPublicKey, values: np.ndarray) -> EncryptedVector:
    """Valid ciphertexts of ``values`` for timing X^T [[d]] at scale.

    Randomness is the product of two draws from 64 fresh obfuscators (not independent per
    element, which is irrelevant to the speed of X^T [[d]] and saves minutes of encryption).
    """
    n = mpz(public_key.n)
    n_square = n * n
    obfuscators = StandardRandomizer(public_key).obfuscators(64)
    pick = np.random.default_rng(7).integers(0, 64, (len(values), 2)).tolist()
    plaintexts = encode_values(values, VALUE_FRAC_BITS)
    ciphertexts = [
        (1 + n * (m % n)) * obfuscators[a] % n_square * obfuscators[b] % n_square
        for m, (a, b) in zip(plaintexts, pick, strict=True)
    ]
    return EncryptedVector(public_key, ciphertexts, VALUE_FRAC_BITS)


# ------------------------------------------------------------------------------ per-op table


class PerOpTable:
    """Rows of (operation, CPU time/op, throughput, vs phe, wall time/op, notes)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, ...]] = []

    def add(self, name: str, per_op: Timing, baseline: float, note: str = "") -> None:
        self.rows.append(
            (
                name,
                f"{per_op.cpu * 1e3:.3f} ms",
                f"{1.0 / per_op.cpu:,.0f}/s",
                f"{baseline / per_op.cpu:.1f}x",
                f"{per_op.wall * 1e3:.3f} ms",
                note,
            )
        )


def per_op(timing: Timing, count: int) -> Timing:
    return Timing(timing.cpu / count, timing.wall / count)


def per_op_rows(
    settings: Settings,
    public_key: PaillierPublicKey,
    private_key: PaillierPrivateKey,
    backend: CpuTimingBackend,
    t_mul: float,
) -> list[tuple[str, ...]]:
    rng = np.random.default_rng(1)
    repeats, workers = settings.repeats, settings.workers
    table = PerOpTable()
    count = settings.encrypt_count
    values = rng.uniform(-1, 1, count)
    wide_values = rng.uniform(-1, 1, count * workers)
    parallel_note = f"{workers} processes, critical path"

    phe_encrypt = per_op(
        measure(lambda: [public_key.encrypt(float(v)) for v in values], repeats), count
    )
    table.add("encrypt: phe `pk.encrypt(float)`", phe_encrypt, phe_encrypt.cpu, "baseline")
    timing = measure(lambda: EncryptedVector.encrypt(public_key, values), repeats)
    table.add("encrypt: standard r^n, serial", per_op(timing, count), phe_encrypt.cpu)
    StandardRandomizer(public_key).obfuscators(workers * 2, backend=backend)  # warm-up
    timing = measure(
        lambda: EncryptedVector.encrypt(public_key, wide_values, backend=backend), repeats, backend
    )
    table.add(
        "encrypt: standard r^n, parallel",
        per_op(timing, len(wide_values)),
        phe_encrypt.cpu,
        parallel_note,
    )

    djn = DJNRandomizer(public_key)
    table_seconds = median_seconds(lambda: djn.obfuscators(1), 1)
    djn_values = np.resize(values, count * 4)
    timing = measure(
        lambda: EncryptedVector.encrypt(public_key, djn_values, randomizer=djn), repeats
    )
    djn_multiplications = djn.exponent_bits // 8 + 2
    table.add(
        "encrypt: DJN short exponent + fixed-base table, serial",
        per_op(timing, len(djn_values)),
        phe_encrypt.cpu,
        f"table {table_seconds:.1f} s once; floor {djn_multiplications} mul = "
        f"{djn_multiplications * t_mul * 1e3:.2f} ms",
    )
    djn.obfuscators(workers * 8, backend=backend)  # every worker builds its table once
    djn_wide = np.resize(values, count * 4 * workers)
    timing = measure(
        lambda: EncryptedVector.encrypt(public_key, djn_wide, randomizer=djn, backend=backend),
        repeats,
        backend,
    )
    table.add(
        "encrypt: DJN, parallel", per_op(timing, len(djn_wide)), phe_encrypt.cpu, parallel_note
    )

    pool = ObfuscatorPool(StandardRandomizer(public_key))
    fill = measure(lambda: pool.fill(len(wide_values), backend=backend), 1, backend)
    timing = measure(lambda: EncryptedVector.encrypt(public_key, wide_values, randomizer=pool), 1)
    table.add(
        "encrypt: precomputed r^n pool, online part",
        per_op(timing, len(wide_values)),
        phe_encrypt.cpu,
        f"pool filled ahead at {len(wide_values) / fill.cpu:.0f}/s ({parallel_note})",
    )

    vector = EncryptedVector.encrypt(public_key, wide_values, randomizer=djn)
    phe_numbers = vector.to_phe()
    phe_decrypt = per_op(
        measure(lambda: [private_key.decrypt(x) for x in phe_numbers], repeats), len(vector)
    )
    table.add("decrypt: phe `sk.decrypt`", phe_decrypt, phe_decrypt.cpu, "baseline")
    timing = measure(lambda: vector.decrypt(private_key), repeats)
    table.add("decrypt: CRT, serial", per_op(timing, len(vector)), phe_decrypt.cpu)
    timing = measure(lambda: vector.decrypt(private_key, backend=backend), repeats, backend)
    table.add("decrypt: CRT, parallel", per_op(timing, len(vector)), phe_decrypt.cpu, parallel_note)
    packing = measure(lambda: pack(vector, max_abs_value=1.0), repeats)
    packed = pack(vector, max_abs_value=1.0)
    unpacking = measure(lambda: packed.decrypt(private_key), repeats)
    assert np.array_equal(packed.decrypt(private_key), vector.decrypt(private_key))
    combined = Timing(packing.cpu + unpacking.cpu, packing.wall + unpacking.wall)
    slots = packed.layout.slots_per_ciphertext
    table.add(
        f"decrypt: pack {slots} values per ciphertext + decrypt, serial",
        per_op(combined, len(vector)),
        phe_decrypt.cpu,
        f"{len(vector)} values -> {len(packed.ciphertexts)} ciphertexts; "
        f"packing {packing.cpu / len(vector) * 1e3:.2f} ms/value",
    )

    cheap = settings.cheap_op_count
    left = synthetic_ciphertexts(public_key, rng.uniform(-1, 1, cheap))
    right = synthetic_ciphertexts(public_key, rng.uniform(-1, 1, cheap))
    factors = rng.standard_normal(cheap)
    phe_left, phe_right = left.to_phe(), right.to_phe()
    phe_add = per_op(
        measure(lambda: [a + b for a, b in zip(phe_left, phe_right, strict=True)], repeats), cheap
    )
    table.add("add ct+ct: phe", phe_add, phe_add.cpu, "baseline")
    table.add(
        "add ct+ct: EncryptedVector",
        per_op(measure(lambda: left + right, repeats), cheap),
        phe_add.cpu,
        f"floor 1 mul = {t_mul * 1e6:.1f} us",
    )
    phe_mul = per_op(
        measure(lambda: [a * float(f) for a, f in zip(phe_left, factors, strict=True)], repeats),
        cheap,
    )
    table.add("mul ct*float: phe", phe_mul, phe_mul.cpu, "baseline (53-bit float encoding)")
    table.add(
        "mul ct*float: EncryptedVector (16 fractional bits)",
        per_op(measure(lambda: left * factors, repeats), cheap),
        phe_mul.cpu,
    )
    return table.rows


# ------------------------------------------------------------------------------ X^T [[d]]


@dataclass(frozen=True)
class XtdResult:
    label: str
    phe_seconds: float
    serial: Timing
    parallel: Timing
    floor_seconds: float
    multiplications: int
    t_mul: float
    extrapolated: bool


def load_credit_features() -> np.ndarray:
    guest = pd.read_csv(DATA_DIR / "default_credit_hetero_guest.csv.gz")
    host = pd.read_csv(DATA_DIR / "default_credit_hetero_host.csv.gz")
    features = [frame.filter(regex=r"^x\d+$").to_numpy(dtype=np.float64) for frame in (guest, host)]
    return np.hstack(features)


def phe_loop_seconds_per_entry(d: EncryptedVector, features: np.ndarray, rows: int) -> float:
    """The straightforward phe loop: sum_i ct_i * float(x_ij), timed on a row subset."""
    numbers = d[:rows].to_phe()
    columns = min(2, features.shape[1])

    def loop() -> None:
        for column in range(columns):
            total = numbers[0] * float(features[0, column])
            for i in range(1, rows):
                total = total + numbers[i] * float(features[i, column])

    return median_seconds(loop, 1) / (rows * columns)


def measure_xt_dot(
    label: str,
    public_key: PaillierPublicKey,
    private_key: PaillierPrivateKey,
    features: np.ndarray,
    timed_columns: int,
    settings: Settings,
    backend: CpuTimingBackend,
) -> XtdResult:
    rows, total_columns = features.shape
    rng = np.random.default_rng(3)
    d_values = rng.uniform(-1, 1, rows)
    d = synthetic_ciphertexts(public_key, d_values)
    encoded = encode_matrix(features[:, :timed_columns], FEATURE_FRAC_BITS)
    scale = total_columns / timed_columns

    results: dict[str, EncryptedVector] = {}
    t_mul = measure_mulmod(public_key, settings.repeats)  # re-measured: load drifts
    serial = measure(lambda: results.update(serial=d.transpose_dot(encoded)), 1)
    parallel = measure(
        lambda: results.update(parallel=d.transpose_dot(encoded, backend=backend)), 1, backend
    )
    assert results["serial"].ciphertexts == results["parallel"].ciphertexts
    d_plain = np.asarray(encode_values(d_values, VALUE_FRAC_BITS), dtype=object)
    exact = encoded.values.astype(object).T @ d_plain
    assert results["serial"].decrypt_integers(private_key) == list(exact), "X^T [[d]] mismatch"

    multiplications = round(predicted_multiplications(encoded.values) * scale)
    phe_per_entry = phe_loop_seconds_per_entry(d, features, settings.phe_loop_rows)
    return XtdResult(
        label,
        phe_per_entry * rows * total_columns,
        Timing(serial.cpu * scale, serial.wall * scale),
        Timing(parallel.cpu * scale, parallel.wall * scale),
        multiplications * t_mul,
        multiplications,
        t_mul,
        timed_columns < total_columns,
    )


def xt_dot_rows(results: list[XtdResult]) -> list[tuple[str, ...]]:
    table = []
    for result in results:
        how = " (extrapolated)" if result.extrapolated else ""
        table.append(
            (
                result.label,
                f"{format_seconds(result.phe_seconds)} (extrapolated)",
                f"{format_seconds(result.serial.cpu)}{how}",
                f"{result.phe_seconds / result.serial.cpu:.0f}x",
                f"{format_seconds(result.parallel.cpu)}{how}",
                f"{result.serial.cpu / result.parallel.cpu:.2f}x",
                f"{format_seconds(result.serial.wall)} / {format_seconds(result.parallel.wall)}",
                f"{result.multiplications:,} mul x {result.t_mul * 1e6:.2f} us = "
                f"{format_seconds(result.floor_seconds)}",
                f"{result.floor_seconds / result.serial.cpu:.0%}",
            )
        )
    return table


def print_table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller samples, < 2 minutes")
    parser.add_argument("--workers", type=int, default=2, help="processes for parallel rows")
    arguments = parser.parse_args()
    settings = settings_for(arguments.quick, arguments.workers)

    started = time.perf_counter()
    load = os.getloadavg()[0]
    start = time.perf_counter()
    public_key, private_key = generate_keypair(KEY_BITS)
    keygen_seconds = time.perf_counter() - start
    t_mul = measure_mulmod(public_key, settings.repeats)
    print(f"# Paillier layer benchmark ({'quick' if settings.quick else 'full'})\n")
    print(
        f"{KEY_BITS}-bit key (generated in {keygen_seconds:.2f} s), gmpy2 {gmpy2.version()}, "
        f"{os.cpu_count()} CPUs, load average at start {load:.1f}; one 4096-bit mul+mod = "
        f"{t_mul * 1e6:.2f} us CPU. Medians of {settings.repeats} repeats; parallel rows use "
        f"{settings.workers} processes.\n"
    )

    with ProcessBackend(settings.workers) as processes:
        backend = CpuTimingBackend(processes)
        print("## Per-operation cost\n")
        rows = per_op_rows(settings, public_key, private_key, backend, t_mul)
        headers = ("operation", "CPU time/op", "throughput", "vs phe", "wall time/op", "notes")
        print_table(headers, rows)

        credit = load_credit_features()
        credit_columns = settings.credit_columns or credit.shape[1]
        wide = np.random.default_rng(11).standard_normal((settings.wide_rows, 300))
        results = [
            measure_xt_dot(
                f"{credit.shape[0]:,} x {credit.shape[1]} (default_credit)",
                public_key,
                private_key,
                credit,
                credit_columns,
                settings,
                backend,
            ),
            measure_xt_dot(
                f"{wide.shape[0]:,} x {wide.shape[1]} (synthetic N(0,1))",
                public_key,
                private_key,
                wide,
                settings.wide_columns,
                settings,
                backend,
            ),
        ]
    print("## X^T [[d]] (d: 32 fractional bits, X: 16 fractional bits), CPU seconds\n")
    headers = (
        "matrix",
        "phe loop",
        "ours, serial",
        "vs phe",
        f"ours, {settings.workers} processes (critical path)",
        "parallel gain",
        "wall: serial / parallel",
        "physical floor (serial)",
        "floor / ours",
    )
    print_table(headers, xt_dot_rows(results))
    print(
        f"phe loop = `sum(ct_i * float(x_ij))` timed on {settings.phe_loop_rows} rows x 2 "
        "columns and scaled to the full matrix. Ours runs all rows for "
        f"{credit_columns}/23 and {settings.wide_columns}/300 columns and scales linearly in "
        "the column count (each column is an independent multi-exponentiation). Results are "
        "checked against exact integer arithmetic and serial == parallel bit for bit."
    )
    print(f"\nTotal benchmark time {time.perf_counter() - started:.0f} s (wall).")


if __name__ == "__main__":
    main()
