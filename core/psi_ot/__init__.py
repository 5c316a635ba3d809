"""OT-extension PSI (KKRT16), semi-honest: Naor-Pinkas base OTs, the KKRT batched related-key
OPRF, three-function cuckoo hashing and the PSI built on them. Plain functions, no Prefect.

Kolesnikov, Kumaresan, Rosulek, Trieu, "Efficient Batched Oblivious PRF with Applications to
Private Set Intersection", ACM CCS 2016 (IACR ePrint 2016/799).
"""
