"""Paillier encryption as the flows run it (``core.paillier.cipher``), beside SecretFlow HEU.

Usage: python benchmarks/bench_paillier.py [--count 2000] [--heu-count 4000] [--key-bits 2048]

One run, side by side, 2048-bit keys:
* per core: CPU milliseconds per encrypted value, serial, after the fixed-base table is built
  (the table's one-off cost is printed beside it); for HEU, ``ZPaillier`` encryption one
  value at a time (``phe.setup(...).encryptor().encrypt_raw``);
* both cores: wall milliseconds per value for a batch encrypted on the process pool (ours) or
  HEU's array encryptor (``heu.numpy``, its thread pool), warm.
Modes: ``full`` (the default, h_s^r with r < n: DCR only), ``short`` (r of k/2 bits, HEU's
and IPCL's choice), ``standard`` (r^n), and the CRT variants a party uses under its own key
(WALR's labels). HEU is the ``sf-heu`` package in its own virtualenv (``make peer-heu``, which
``make bench-paillier`` runs first), timed by ``benchmarks/peers/heu_paillier.py``; without it
the HEU rows say so and the ratios use the anchor measured on this machine kind
(0.67 ms CPU per value, 0.35 ms wall per value on two cores). Also CRT decryption and
X^T [[d]]: on 30,000 x 23 (default_credit's shape, both cores), and per core on one FATE-shape
host batch (4,096 x 300, 1024-bit), the fused dense path beside the per-column planner it
replaced for feature columns. The window rows time the obfuscators alone, per core, with the
previous 10-bit window beside the current one (same run, same key).

First, one Montgomery product per kernel path (IFMA, AVX2, portable C: whichever this CPU
runs) at 2048 and 4096 bits, in ns and in cycles per product of two limbs (cycles from the
clock /proc/cpuinfo reports), beside gmpy2 and HEU's ciphertext addition; last, the issue's
targets beside this run's figures. IPCL (``ipcl-python``) has no distribution on the index
used here, which the output says.

Native kernel (``core.paillier.native``, the C extension) beside the gmpy2 code it replaces,
in the same run, alternating: one multiplication modulo 2048- and 4096-bit moduli (gmpy2's
``a * b % m`` in a Python loop against a chain of Montgomery products in C); obfuscators per
mode per core and on both cores (two worker processes, each with its own table); X^T [[d]]
per column of a 4,096-row batch at 1024- and 2048-bit keys. Medians of CPU time per core,
wall time on both cores; the machine may be shared, so read the ratios.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import gmpy2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers.runner import PeerResult, run_peer
from benchmarks.peers.timing import timed
from core.paillier import cipher, native, randomness
from core.paillier.keys import generate_keypair
from core.paillier.multiexp import execute_column, multiexp_columns, plan_column
from core.paillier.randomness import (
    _TABLES,
    DEFAULT_WINDOW_BITS,
    FixedBaseRandomizer,
    fixed_base_obfuscators,
)

HEU_ANCHOR_CPU_MS, HEU_ANCHOR_WALL_MS = 0.67, 0.35


def heu_figures(key_bits: int, count: int, batch: int) -> PeerResult:
    """HEU ZPaillier timed by its driver in its own virtualenv (``make peer-heu``): encryption
    per core and on every core, and one ciphertext addition per modulus size."""
    args = ["--key-bits", str(key_bits), "--count", str(count), "--batch", str(batch)]
    return run_peer("heu", "heu_paillier.py", args, "bench-paillier", timeout=900)


def serial(action: Callable[[], object]) -> Callable[[], object]:
    """Run ``action`` with every cipher call in this process (one core)."""

    def run() -> object:
        saved = cipher._PARALLEL_MIN_WORK
        cipher._PARALLEL_MIN_WORK = 10**12
        try:
            return action()
        finally:
            cipher._PARALLEL_MIN_WORK = saved

    return run


def _with_native(flag: bool, action: Callable[[], object]) -> Callable[[], object]:
    """``action`` on the native kernel at every modulus size (``flag``) or on the gmpy2 path
    in this process, whatever the flows' size rule (``native.NATIVE_MAX_BITS``) picks."""

    def run() -> object:
        saved = native.AVAILABLE, native.NATIVE_MAX_BITS
        native.AVAILABLE = flag and saved[0]
        native.NATIVE_MAX_BITS = 1 << 20
        try:
            return action()
        finally:
            native.AVAILABLE, native.NATIVE_MAX_BITS = saved

    return run


def _median_pair(native_action, gmpy2_action, repeats: int) -> tuple[float, float]:
    """Median CPU seconds of each, run alternately so both see the same machine load."""
    fast, slow = [], []
    for _ in range(repeats):
        fast.append(timed(native_action, repeats=1)[0])
        slow.append(timed(gmpy2_action, repeats=1)[0])
    return statistics.median(fast), statistics.median(slow)


def _random_modulus(bits: int) -> gmpy2.mpz:
    return gmpy2.mpz(secrets.randbits(bits)) | 1 | (gmpy2.mpz(1) << (bits - 1))


def _gmpy2_chain(modulus: gmpy2.mpz, a: gmpy2.mpz, b: gmpy2.mpz, count: int) -> gmpy2.mpz:
    for _ in range(count):
        a = a * b % modulus
    return a


def _worker_setup(use_native: bool, fixed: tuple) -> None:
    """Pool initializer: pick the path, then build this worker's table (not timed)."""
    native.AVAILABLE = use_native and native.AVAILABLE
    native.NATIVE_MAX_BITS = 1 << 20  # the kernel at every size, as in _with_native
    fixed_base_obfuscators(*fixed, 64)


def _both_cores_ms(use_native: bool, fixed: tuple, count: int, workers: int) -> float:
    """Wall ms per obfuscator with ``workers`` processes, tables built beforehand."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_worker_setup, initargs=(use_native, fixed)
    ) as pool:
        list(pool.map(int, range(workers)))  # wait until every worker is up
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            futures = [pool.submit(fixed_base_obfuscators, *fixed, count) for _ in range(workers)]
            for future in futures:
                future.result()
            walls.append(time.perf_counter() - start)
    return 1e3 * statistics.median(walls) / (count * workers)


RADIX_BITS = {"ifma": 52, "avx2": 26, "portable": 64, "gmpy2": 64}
"""Limb size of each product's working form: what "cycles per limb product" divides by."""

IPCL_NOTE = (
    "IPCL: no row. `pip download --no-deps ipcl-python` finds no distribution on the package "
    "index this benchmark runs against, and Intel's IPCL is not installed otherwise"
)


def clock_ghz() -> float | None:
    """The clock /proc/cpuinfo reports (a VM's nominal rate; turbo may differ), or None."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("cpu MHz"):
                    return float(line.split(":")[1]) / 1e3
    except OSError:
        return None
    return None


def _path_product_ns(path: str, modulus, a, b, count: int, pair: bool) -> float:
    """Median CPU ns per Montgomery product on ``path`` (a chain of ``count`` in C)."""
    previous = native.set_path(path)
    try:
        chain = functools.partial(native.multiply_chain, modulus, a, b, count, pair=pair)
        return 1e9 * timed(chain, repeats=7)[0] / (count * (2 if pair else 1))
    finally:
        native.set_path(previous)


def _cycles_per_limb_product(ns: float, bits: int, path: str, ghz: float | None) -> str:
    limbs = -(-bits // RADIX_BITS[path])
    return "" if ghz is None else f"{ns * ghz / limbs**2:.3f}"


def product_section(figures: dict[str, Any], heu: PeerResult, count: int = 20_000) -> None:
    """One Montgomery product per path at 2048 and 4096 bits, beside gmpy2 and HEU."""
    paths = native.supported_paths()
    ghz = clock_ghz()
    clock = f"{ghz:.2f} GHz as /proc/cpuinfo reports it" if ghz else "clock unknown"
    print(
        "\n### One product modulo a 2048- and 4096-bit modulus, per path (median CPU ns; "
        f"cycles at {clock}, per product of two limbs of the path's radix)\n"
    )
    print("| modulus | path | limbs | ns / product | cycles / limb product "
          "| two interleaved, ns / product | AVX2 / this |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for bits in (2048, 4096):
        modulus = _random_modulus(bits)
        a, b = (gmpy2.mpz(secrets.randbelow(int(modulus))) for _ in range(2))
        single = {p: _path_product_ns(p, modulus, a, b, count, False) for p in paths}
        paired = {p: _path_product_ns(p, modulus, a, b, count, True) for p in paths}
        single["gmpy2"] = (
            1e9 * timed(functools.partial(_gmpy2_chain, modulus, a, b, count), repeats=7)[0] / count
        )
        for path, ns in single.items():
            ratio = f"{single['avx2'] / ns:.2f}x" if "avx2" in single else ""
            pair = f"{paired[path]:.0f}" if path in paired else "(Python loop: a * b % m)"
            print(
                f"| {bits} | {path} | {-(-bits // RADIX_BITS[path])} | {ns:.0f} "
                f"| {_cycles_per_limb_product(ns, bits, path, ghz)} | {pair} | {ratio} |"
            )
        heu_text = f"{heu.data['add_ns'][str(bits)]:.0f}" if heu.data else heu.note
        print(f"| {bits} | HEU ZPaillier, ciphertext addition per call | | {heu_text} | | | |")
        if bits == 4096 and "ifma" in single and "avx2" in single:
            figures["product_4096_avx2_over_ifma"] = single["avx2"] / single["ifma"]
            previous = native.set_path("ifma")
            try:  # as the kernel's loops run them at this size on this CPU
                pairs = native.interleaves(modulus)
            finally:
                native.set_path(previous)
            ifma = paired["ifma"] if pairs else single["ifma"]
            figures["product_4096_in_loops"] = single["avx2"] / ifma
            figures["product_4096_form"] = "two interleaved" if pairs else "one at a time"


def print_targets(figures: dict[str, Any]) -> None:
    """The issue's targets beside this run's figures."""
    print("\n### Targets\n\n| target | this run | met |\n|---|---|---|")
    rows = (
        ("Montgomery product at 4096 bits: at least 2.5x the AVX2 path (one product alone)",
         "product_4096_avx2_over_ifma", lambda v: v >= 2.5, "{:.2f}x"),
        ("The same, per product as the kernel's loops run them here "
         f"({figures.get('product_4096_form', 'not measured')})",
         "product_4096_in_loops", lambda v: v >= 2.5, "{:.2f}x"),
        ("Encryption with the default randomizer: at most 0.5x HEU's per core (today 1.17x)",
         "encrypt_full_over_heu", lambda v: v <= 0.5, "{:.2f}x HEU"),
    )  # fmt: skip
    for target, key, met, shape in rows:
        value = figures.get(key)
        if value is None:
            print(f"| {target} | not measured in this run | |")
        else:
            print(f"| {target} | {shape.format(value)} | {'yes' if met(value) else 'no'} |")


def native_section(public, private, fate_public, args) -> None:
    """The native kernel beside the gmpy2 path (see the module docstring)."""
    if not native.AVAILABLE:
        print("\n### Native kernel: not built or disabled (PRIVREG_PURE_PYTHON): skipped\n")
        return
    workers = os.cpu_count() or 1
    print(
        "\n### Native Montgomery kernel against gmpy2, same run (medians, CPU per core; "
        f"{native.current_path()} product unless a row says "
        "otherwise)\n"
    )
    print("| operation | gmpy2 | native | gmpy2 / native |\n|---|---|---|---|")
    count = 20_000
    products = list(native.supported_paths())
    for bits in (2048, 4096):
        modulus = _random_modulus(bits)
        a, b = (gmpy2.mpz(secrets.randbelow(int(modulus))) for _ in range(2))
        for label, square in (("multiplication", False), ("squaring", True)):
            for kind in products:
                previous = native.set_path(kind)
                fast, slow = _median_pair(
                    functools.partial(native.multiply_chain, modulus, a, b, count, square=square),
                    functools.partial(_gmpy2_chain, modulus, a, a if square else b, count),
                    repeats=5,
                )
                native.set_path(previous)
                print(
                    f"| one {label} mod a {bits}-bit modulus ({kind} product) "
                    f"| {1e6 * slow / count:.2f} us | {1e6 * fast / count:.2f} us "
                    f"| {slow / fast:.2f}x |"
                )
    for label, mode, own_key in (
        ("full", "full", None),
        ("full, CRT (own key)", "full", private),
        ("short", "short", None),
        ("short, CRT (own key)", "short", private),
    ):
        source = FixedBaseRandomizer(public, mode=mode, private_key=own_key)
        per_path = {}
        for flag in (True, False):
            _TABLES.clear()
            build, _ = timed(_with_native(flag, lambda s=source: s.obfuscators(64)), repeats=1)
            cpu, _ = timed(_with_native(flag, lambda s=source: s.obfuscators(args.count)))
            per_path[flag] = (1e3 * cpu / args.count, build)
        _TABLES.clear()
        (fast, fast_build), (slow, slow_build) = per_path[True], per_path[False]
        print(
            f"| obfuscator, {label}, {public.n.bit_length()}-bit, per core | {slow:.3f} ms "
            f"| {fast:.3f} ms | {slow / fast:.2f}x |"
        )
        print(
            f"| table build, {label} (once per key and process) | {slow_build:.2f} s "
            f"| {fast_build:.2f} s | {slow_build / fast_build:.2f}x |"
        )
    for mode in ("full", "short"):
        source = FixedBaseRandomizer(public, mode=mode)
        fixed = (source.n, source._h_s, mode, None, DEFAULT_WINDOW_BITS)
        fast = _both_cores_ms(True, fixed, args.count // 2, workers)
        slow = _both_cores_ms(False, fixed, args.count // 2, workers)
        print(
            f"| obfuscator, {mode}, {workers} cores, wall | {slow:.3f} ms | {fast:.3f} ms "
            f"| {slow / fast:.2f}x |"
        )
    rng = np.random.default_rng(1)
    X = np.rint(rng.standard_normal((4096, args.native_columns)) * 2**20).astype(np.int64)
    for key in (fate_public, public):
        modulus = gmpy2.mpz(key.nsquare)
        bases = [gmpy2.mpz(c) for c in cipher.encrypt(key, rng.integers(0, 2**40, 4096).tolist())]
        fast, slow = _median_pair(
            _with_native(True, lambda b=bases, m=modulus: multiexp_columns(b, X, m)),
            _with_native(False, lambda b=bases, m=modulus: multiexp_columns(b, X, m)),
            repeats=3,
        )
        columns = args.native_columns
        print(
            f"| X^T [[d]], 4,096-row batch, {key.n.bit_length()}-bit key, per column "
            f"| {1e3 * slow / columns:.1f} ms | {1e3 * fast / columns:.1f} ms "
            f"| {slow / fast:.2f}x |"
        )
    randomness._TABLES.clear()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="values per serial timing")
    parser.add_argument("--batch", type=int, default=4000, help="values per two-core batch")
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument(
        "--fate-columns", type=int, default=30, help="columns timed of the 300 (scaled to 300)"
    )
    parser.add_argument(
        "--native-columns", type=int, default=8, help="X^T [[d]] columns timed per path"
    )
    parser.add_argument(
        "--native-only", action="store_true", help="only the native-against-gmpy2 section"
    )
    args = parser.parse_args(argv)
    public, private = generate_keypair(args.key_bits)
    values = list(range(args.batch))
    workers = os.cpu_count() or 1
    fate_public, fate_private = generate_keypair(1024, allow_insecure_key_size=True)
    figures: dict[str, Any] = {}
    heu = heu_figures(args.key_bits, args.count, args.batch)
    if native.AVAILABLE:
        product_section(figures, heu)
    native_section(public, private, fate_public, args)
    if args.native_only:
        print_targets(figures)
        return

    if heu.data:
        heu_cpu, heu_wall = heu.data["encrypt_cpu_ms"], heu.data["encrypt_wall_ms"]
        source = f"sf-heu {heu.data['version']}, measured in this run"
    else:
        heu_cpu, heu_wall = HEU_ANCHOR_CPU_MS, HEU_ANCHOR_WALL_MS
        source = f"{heu.note}; the ratios use the anchor numbers"
    rows = []
    for label, mode, own_key in (
        ("full (default, DCR only)", "full", None),
        ("full, CRT (own key)", "full", private),
        ("short (opt-in)", "short", None),
        ("short, CRT (own key)", "short", private),
        ("standard r^n", "standard", None),
    ):
        count = args.count if mode != "standard" else max(args.count // 10, 20)
        _TABLES.clear()
        build_cpu, _ = timed(
            serial(lambda m=mode, k=own_key: cipher.encrypt(public, values[:64], m, private=k)),
            repeats=1,
        )
        cpu, _ = timed(
            serial(
                lambda m=mode, k=own_key, c=count: cipher.encrypt(public, values[:c], m, private=k)
            )
        )
        batch = values if mode != "standard" else values[: max(len(values) // 10, 256)]
        cipher.encrypt(public, batch, mode, private=own_key)  # warm the workers' tables
        _, wall = timed(lambda m=mode, k=own_key, b=batch: cipher.encrypt(public, b, m, private=k))
        per_core, both = 1e3 * cpu / count, 1e3 * wall / len(batch)
        rows.append((label, per_core, both, build_cpu))
    if heu.data:
        rows.append(("HEU ZPaillier (short exponent)", heu_cpu, heu_wall, float("nan")))
        figures["encrypt_full_over_heu"] = rows[0][1] / heu_cpu
    print(f"\n### Encryption, {args.key_bits}-bit key ({workers} cores; HEU: {source})\n")
    print(f"{IPCL_NOTE}.\n")
    print("| mode | per core: CPU ms / value | vs HEU | both cores: wall ms / value | vs HEU "
          "| table build, CPU s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for label, per_core, both, build in rows:
        table = "" if build != build else f"{build:.2f}"
        print(
            f"| {label} | {per_core:.3f} | {per_core / heu_cpu:.2f}x | {both:.3f} "
            f"| {both / heu_wall:.2f}x | {table} |"
        )

    print(f"\n### Fixed-base window, obfuscators only, per core ({args.key_bits}-bit)\n")
    print("| mode | 10-bit window (before): CPU ms / value | "
          f"{DEFAULT_WINDOW_BITS}-bit window (now) | ratio |")  # fmt: skip
    print("|---|---|---|---|")
    for mode in ("full", "short"):
        per_window = {}
        for window in (10, DEFAULT_WINDOW_BITS):
            _TABLES.clear()
            source = FixedBaseRandomizer(public, mode=mode, window_bits=window)
            source.obfuscators(64)  # builds the table
            cpu, _ = timed(lambda s=source: s.obfuscators(args.count))
            per_window[window] = 1e3 * cpu / args.count
        before, now = per_window[10], per_window[DEFAULT_WINDOW_BITS]
        print(f"| {mode} | {before:.3f} | {now:.3f} | {now / before:.2f} |")
    _TABLES.clear()

    encrypted = cipher.encrypt(public, values)
    cpu, _ = timed(serial(lambda: cipher.decrypt(private, encrypted[: args.count])))
    rng = np.random.default_rng(0)
    X = rng.integers(-(2**18), 2**18, (30_000, 23))
    d = cipher.encrypt(public, rng.integers(-(2**40), 2**40, 30_000).tolist())
    _, xt_wall = timed(lambda: cipher.transpose_dot(public, X, d), repeats=1)
    X_fate = np.rint(rng.standard_normal((4096, 300)) * 2**20).astype(np.int64)
    d_fate = cipher.encrypt(
        fate_public, rng.integers(-(2**40), 2**40, 4096).tolist(), private=fate_private
    )
    bases, modulus = [gmpy2.mpz(c) for c in d_fate], gmpy2.mpz(fate_public.nsquare)
    columns = args.fate_columns
    planned, _ = timed(
        lambda: [execute_column(bases, plan_column(X_fate[:, j]), modulus) for j in range(columns)],
        repeats=1,
    )
    fused, _ = timed(lambda: multiexp_columns(bases, X_fate[:, :columns], modulus), repeats=1)
    print(f"\n### Other operations, {args.key_bits}-bit key\n")
    print("| operation | time |\n|---|---|")
    print(f"| CRT decryption, per core | {1e3 * cpu / args.count:.3f} ms CPU / value |")
    print(f"| X^T [[d]], 30,000 x 23 (default_credit shape), both cores | {xt_wall:.1f} s wall |")
    print(
        f"| X^T [[d]], FATE host batch 4,096 x 300 at 1024 bits, per core, per-column planner "
        f"(before) | {300 * planned / columns:.1f} s CPU (timed on {columns} columns) |"
    )
    print(
        f"| X^T [[d]], same batch, fused dense path (now) | {300 * fused / columns:.1f} s CPU "
        f"({fused / planned:.2f}x) |"
    )
    print_targets(figures)


if __name__ == "__main__":
    main()
