"""SecretFlow HEU's Paillier (``sf-heu`` 0.5.2b0, ``ZPaillier``) timed on this machine, for
bench_paillier.

Run it with the python of the virtualenv that ``make peer-heu`` makes, never privreg's own:
HEU is a peer measured beside privreg, not one of its dependencies.

Usage: python benchmarks/peers/heu_paillier.py [--key-bits 2048] [--count 1000] [--batch 4000]

Prints one JSON document on stdout:
* ``encrypt_cpu_ms``: CPU ms per value, one value at a time (``encryptor().encrypt_raw``),
  warm, median of three runs of ``count`` values (one core);
* ``encrypt_wall_ms``: wall ms per value of ``batch`` values through the array encryptor
  (``heu.numpy``, its thread pool: every core), warm, median of three;
* ``add_ns``: CPU ns per ciphertext addition (one product modulo n^2 plus the binding's
  per-call cost; HEU's Python API has no bare product), keyed by the bits of n^2, for keys of
  1024 and 2048 bits.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json

from timing import timed  # this folder: the driver runs as a script from it


def encryption(key_bits: int, count: int, batch: int) -> tuple[float, float]:
    """(CPU ms per value one at a time, wall ms per value of an array on every core)."""
    import numpy as np
    from heu import numpy as hnp
    from heu import phe

    encryptor = phe.setup(phe.SchemaType.ZPaillier, key_bits).encryptor()
    encryptor.encrypt_raw(1)
    cpu, _ = timed(lambda: [encryptor.encrypt_raw(i) for i in range(count)], repeats=3)
    kit = hnp.setup(phe.SchemaType.ZPaillier, key_bits)
    plain = kit.array(np.arange(batch, dtype=np.int64), phe.IntegerEncoderParams())
    array_encryptor = kit.encryptor()
    array_encryptor.encrypt(plain)
    _, wall = timed(lambda: array_encryptor.encrypt(plain), repeats=3)
    return 1e3 * cpu / count, 1e3 * wall / batch


def addition_ns(modulus_bits: int, count: int = 20_000) -> float:
    """CPU ns per ciphertext addition under a key of half ``modulus_bits``."""
    from heu import phe

    kit = phe.setup(phe.SchemaType.ZPaillier, modulus_bits // 2)
    a, b = kit.encryptor().encrypt_raw(5), kit.encryptor().encrypt_raw(7)
    evaluator = kit.evaluator()

    def chain() -> None:
        for _ in range(count):
            evaluator.add_inplace(a, b)

    return 1e9 * timed(chain, repeats=5)[0] / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--count", type=int, default=1000, help="values timed one at a time")
    parser.add_argument("--batch", type=int, default=4000, help="values of the array run")
    args = parser.parse_args()
    cpu_ms, wall_ms = encryption(args.key_bits, args.count, args.batch)
    result = {
        "version": importlib.metadata.version("sf-heu"),
        "encrypt_cpu_ms": cpu_ms,
        "encrypt_wall_ms": wall_ms,
        "add_ns": {str(bits): addition_ns(bits) for bits in (2048, 4096)},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
