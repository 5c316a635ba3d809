"""Randomizer modes decrypt under one key; obfuscators never repeat; pools stay private;
a script without a main guard can use the process pool."""

from __future__ import annotations

import math
import multiprocessing
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import gmpy2
import pytest
from gmpy2 import mpz
from phe.paillier import PaillierPublicKey

from core.paillier import cipher, native
from core.paillier.errors import KeyMismatchError, PaillierError
from core.paillier.keys import generate_keypair
from core.paillier.randomness import (
    DEFAULT_RANDOMIZER,
    FixedBaseRandomizer,
    ObfuscatorFile,
    make_randomizer,
    pool_path,
    randomizer_mode,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def keys():
    return generate_keypair(512, allow_insecure_key_size=True)


def test_default_is_the_full_exponent_and_djn_means_short() -> None:
    assert DEFAULT_RANDOMIZER == "full" == cipher.DEFAULT_RANDOMIZER
    assert randomizer_mode("djn") == "short"
    with pytest.raises(PaillierError, match="randomizer must be one of"):
        randomizer_mode("fast")


@pytest.mark.parametrize("mode", ["full", "short", "standard", "djn"])
def test_every_mode_decrypts_under_the_same_key_with_and_without_crt(keys, mode) -> None:
    public, private = keys
    values = [0, 1, -1, 2**100, -(2**100), 12345]
    for own_key in (None, private):
        encrypted = cipher.encrypt(public, values, mode, private=own_key)
        assert cipher.decrypt(private, encrypted) == values
        fresh = cipher.rerandomize(public, encrypted, mode)
        assert not set(fresh) & set(encrypted)
        assert cipher.decrypt(private, fresh) == values


def test_exponent_lengths_and_table_crt_and_powmod_agree(keys) -> None:
    public, private = keys
    n, bits = public.n, public.n.bit_length()
    full = FixedBaseRandomizer(public, mode="full", private_key=private)
    short = FixedBaseRandomizer(public, mode="short")
    assert full.exponent_bits == bits and short.exponent_bits == math.ceil(bits / 2)
    exponents = full.exponents(400)
    assert all(0 <= e < n for e in exponents)
    assert max(exponents).bit_length() == bits  # really full length, not k/2 bits
    assert all(0 <= e < 2**short.exponent_bits for e in short.exponents(400))
    # Table (400 values), CRT (the private key) and plain powmod give the same residues.
    reference = [gmpy2.powmod(full._h_s, e, mpz(n) ** 2) for e in exponents]
    plain = FixedBaseRandomizer(public, mode="full")
    plain._h_s = full._h_s
    assert full.power(exponents) == reference == plain.power(exponents)
    # Each is an n-th residue: it decrypts to 0.
    assert cipher.decrypt(private, [int(v) for v in reference[:20]]) == [0] * 20


def test_standard_mode_needs_no_special_modulus_but_fixed_base_does() -> None:
    p, q = gmpy2.next_prime(2**255 + 2**200), gmpy2.next_prime(2**256 + 2**190)
    while p % 4 != 3:
        p = gmpy2.next_prime(p)
    while q % 4 != 1:
        q = gmpy2.next_prime(q)
    from phe.paillier import PaillierPublicKey

    public = PaillierPublicKey(int(p * q))
    assert make_randomizer(public, "standard").obfuscators(2)
    with pytest.raises(PaillierError, match="p = q = 3"):
        make_randomizer(public, "full")


def test_obfuscators_never_repeat_within_a_run(keys) -> None:
    public, private = keys
    for mode in ("full", "short"):
        source = make_randomizer(public, mode, private_key=private)
        values = source.obfuscators(1500)
        assert len(set(values)) == len(values)


def _take(path: str, n: int, count: int, queue) -> None:
    from phe.paillier import PaillierPublicKey

    source = FixedBaseRandomizer(PaillierPublicKey(n), mode="full")
    queue.put([int(v) for v in ObfuscatorFile(path, source).take(count)])


def test_pool_file_is_private_and_hands_each_value_out_once_across_processes_and_restarts(
    keys, tmp_path: Path
) -> None:
    public, private = keys
    path = tmp_path / "party" / "obfuscators.pool"
    path.parent.mkdir()
    pool = ObfuscatorFile(path, make_randomizer(public, "full"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pool.fill(300)
    assert pool.available() == 300
    first = pool.take(50)
    # Two other processes take concurrently from the same file.
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_take, args=(str(path), public.n, 100, queue)) for _ in "ab"]
    for worker in workers:
        worker.start()
    others = [queue.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join()
    # A restart: a new object on the same file continues after what was claimed.
    restarted = ObfuscatorFile(path, make_randomizer(public, "full"))
    rest = restarted.obfuscators(80)  # 50 left in the file, 30 computed on demand
    assert restarted.computed_on_demand == 30 and restarted.available() == 0
    every = [int(v) for v in first + rest] + others[0] + others[1]
    assert len(every) == 330 and len(set(every)) == 330
    encrypted = cipher.encrypt(public, [7] * 10, pool=ObfuscatorFile(path, pool._source))
    assert cipher.decrypt(private, encrypted) == [7] * 10
    # Handed-out records are wiped from the disk.
    data = path.read_bytes()
    assert all(int(v).to_bytes(128, "big") not in data for v in every[:50])


def test_pool_file_refuses_lax_permissions_and_other_keys(keys, tmp_path: Path) -> None:
    public, _ = keys
    path = tmp_path / "obfuscators.pool"
    ObfuscatorFile(path, make_randomizer(public, "short")).fill(3)
    with pytest.raises(PaillierError, match="another key or randomizer mode"):
        ObfuscatorFile(path, make_randomizer(public, "full"))
    os.chmod(path, 0o644)
    with pytest.raises(PaillierError, match="accessible to others"):
        ObfuscatorFile(path, make_randomizer(public, "short"))
    # A party's pool is per key: another key's pool file is refused, and so is its use.
    other, _ = generate_keypair(512, allow_insecure_key_size=True)
    own = cipher.party_pool(tmp_path / "party.duckdb", public, "full", create=True)
    assert own is not None and cipher.fill_pool(own, 4) == 4
    assert (
        stat.S_IMODE(pool_path(tmp_path / "party.duckdb", public.n, "full").stat().st_mode) == 0o600
    )
    with pytest.raises(PaillierError, match="another key"):
        ObfuscatorFile(own.path, make_randomizer(other, "full"))
    with pytest.raises(KeyMismatchError):
        cipher.encrypt(other, [1], pool=own)
    assert cipher.party_pool(tmp_path / "party.duckdb", other, "full") is None
    os.chmod(own.path.parent, 0o755)  # the folder, too, is the party's alone
    with pytest.raises(PaillierError, match="accessible to others"):
        cipher.party_pool(tmp_path / "party.duckdb", public, "full")


def test_prepared_key_and_pool_from_the_command_line(tmp_path: Path) -> None:
    from privreg.cli import main
    from storage.artifacts import ArtifactStore
    from storage.party_store import PartyStore

    common = ["--job-id", "j1", "--guest", "g", "--hosts", "h", "--workspace", str(tmp_path)]
    arbiter, host = str(tmp_path / "arbiter.duckdb"), str(tmp_path / "h.duckdb")
    assert main(["paillier", "prepare-key", *common, "--database", arbiter]) == 0
    assert main(["paillier", "fill-pool", *common, "--database", host, "--count", "5"]) == 0
    n = ArtifactStore(PartyStore(arbiter)).get("vertical/j1/keypair")["n"]
    assert (
        ObfuscatorFile(
            pool_path(host, n, "full"), make_randomizer(PaillierPublicKey(n), "full")
        ).available()
        == 5
    )
    # the run's key size must be the prepared key's
    assert (
        main(["paillier", "prepare-key", *common, "--database", arbiter, "--key-size", "3072"]) == 1
    )


SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import pandas as pd

    from core.paillier import cipher
    from flows.vertical_lr import vertical_lr
    from storage.descriptor import TableRef
    from storage.party_store import PartyStore

    data = Path(sys.argv[1]) / "benchmarks" / "data" / "fate"
    workspace = Path(sys.argv[2])
    guest = pd.read_csv(data / "breast_hetero_guest.csv.gz").head(160)
    host = pd.read_csv(data / "breast_hetero_host.csv.gz").set_index("id").loc[guest["id"]]
    guest_ref = TableRef(str(workspace / "g.duckdb"), "t", label_column="y", label_domain=(0, 1))
    host_ref = TableRef(str(workspace / "h.duckdb"), "t")
    PartyStore.of(guest_ref).import_frame(guest, guest_ref)
    PartyStore.of(host_ref).import_frame(host.reset_index(), host_ref)
    result = vertical_lr(
        guest_ref.to_dict(), [host_ref.to_dict()], epochs=1, batch_size=144, key_size=512,
        workspace=str(workspace),
    )
    backend = cipher._parallel_backend
    started = backend is not None and backend._executor is not None
    print("BACKEND", type(backend).__name__, "WORKERS", started, "LOSSES", len(result["losses"]))
    """
)


@pytest.mark.usefixtures("prefect_server")
def test_a_script_without_main_guard_runs_a_vertical_job(tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    env = {  # on gmpy2, the job's X^T [[d]] runs in worker processes (the kernel's in threads)
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PRIVREG_PURE_PYTHON": "1",
    }
    done = subprocess.run(
        [sys.executable, str(script), str(ROOT), str(workspace)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BACKEND ProcessBackend WORKERS True LOSSES" in done.stdout


@pytest.mark.skipif(not native.AVAILABLE, reason="native kernel disabled")
def test_the_kernel_draws_on_threads_sharing_one_table(monkeypatch, keys) -> None:
    """Asked to run on worker processes, a fixed-base randomizer whose products the kernel
    does runs on this process's threads instead: one table built once (not one per worker),
    no worker started, and every value an n-th residue (it encrypts 0), none repeated."""
    from core.paillier import randomness
    from core.paillier.parallel import ProcessBackend

    public, private = keys
    built = []
    build = randomness._built_table
    monkeypatch.setattr(
        randomness, "_built_table", lambda *args: built.append(args[3]) or build(*args)
    )
    randomness._TABLES.clear()
    randomizer = FixedBaseRandomizer(public)
    randomizer.plan(2048)
    backend = ProcessBackend(2)
    values = randomizer.obfuscators(1024, backend=backend) + randomizer.obfuscators(
        1024, backend=backend
    )
    assert len(built) == 1  # eight chunks on two threads, one table
    assert backend._executor is None
    assert len(set(values)) == len(values) == 2048
    assert cipher.decrypt(private, [int(v) for v in values[:64]]) == [0] * 64
    randomness._TABLES.clear()


def test_the_fixed_base_table_grows_with_the_values_drawn_and_powers_stay_exact(keys) -> None:
    """A process that draws a few hundred values builds a small table (a 2048-bit key's
    largest one costs seconds and hundreds of MB), a larger one once many values repay it,
    and every value is h^e whatever the window."""
    from core.paillier import randomness

    public, _ = keys
    modulus, base, bits = mpz(public.nsquare), mpz(12345), 512
    randomness._TABLES.clear()
    windows = []
    for count in (300, 60, 2000, 6000):
        exponents = [int.from_bytes(os.urandom(bits // 8), "big") for _ in range(count)]
        powers = randomness._powers(modulus, base, bits, None, exponents)
        assert powers[:50] == [gmpy2.powmod(base, e, modulus) for e in exponents[:50]]
        (table,) = randomness._TABLES.values()
        windows.append(randomness._table_window(table))
    assert windows[0] < randomness.DEFAULT_WINDOW_BITS  # not the largest table for 400 values
    assert windows == sorted(windows) and windows[-1] > windows[0]  # grown, never shrunk
    assert randomness._window_for(10**7, 2048) == randomness.DEFAULT_WINDOW_BITS
    randomness._TABLES.clear()


def test_a_planned_total_sizes_each_worker_s_table_once_and_values_stay_exact(keys) -> None:
    """Told a job's draws, a pool's workers build the window that suits their share at once
    instead of growing small tables chunk by chunk; the values are the same powers."""
    from core.paillier import randomness
    from core.paillier.parallel import SerialBackend

    class TwoWorkers(SerialBackend):  # chunks as for two workers, run here to see the tables
        @property
        def parallelism(self) -> int:
            return 2

    public, private = keys
    phi = (private.p - 1) * (private.q - 1)
    windows = {}
    for planned in (0, 20_000):
        randomness._TABLES.clear()
        pool = cipher.ahead_pool(f"planned-{planned}", public)
        pool.plan(planned)
        values = pool.obfuscators(512, backend=TwoWorkers())  # eight chunks of 64
        assert all(gmpy2.powmod(v, phi, public.nsquare) == 1 for v in values)  # n-th residues
        assert len(set(values)) == 512
        (table,) = randomness._TABLES.values()
        windows[planned] = randomness._table_window(table)
        cipher.forget_ahead(f"planned-{planned}", public.n)
    assert windows[20_000] == randomness._window_for(10_000, 512) > windows[0]
    randomness._TABLES.clear()


def test_obfuscators_computed_ahead_are_the_owners_each_used_once_and_forgotten(keys) -> None:
    public, private = keys
    pool = cipher.ahead_pool("lab", public)
    assert cipher.ahead_pool("lab", public) is pool  # one per owner, key and mode
    assert cipher.ahead_pool("clinic", public) is not pool  # never another party's values
    assert cipher.fill_ahead(pool, 5) == 5 and cipher.fill_ahead(pool, 3) == 5  # a top-up
    kept = list(pool._values)
    encrypted = cipher.encrypt(public, [7, -7, 0], pool=pool)
    assert cipher.decrypt(private, encrypted) == [7, -7, 0] and len(pool) == 2
    again = cipher.rerandomize(public, encrypted, pool=pool)  # 2 left, 1 computed on demand
    assert len(pool) == 0 and pool.computed_on_demand == 1
    assert cipher.decrypt(private, again) == [7, -7, 0]
    used = [(c * pow(1 + m * public.n, -1, public.nsquare)) % public.nsquare
            for c, m in zip(encrypted, [7, public.n - 7, 0], strict=True)]  # fmt: skip
    assert used == [int(v) for v in kept[:3]]  # the values taken, in order, once each
    cipher.forget_ahead("lab", public.n)
    assert cipher.ahead_pool("lab", public) is not pool
