"""Orthogonal matrices for rotations: normalized Hadamard matrices where the width allows one, a
seeded random orthogonal matrix otherwise.

A Hadamard matrix of order n has entries +-1 and orthogonal rows (H H^T = n I); H / sqrt(n) is
orthogonal. Orders built here: Sylvester's 2^k; Paley's first construction, q + 1 for a prime
q = 3 (mod 4); Paley's second, 2(q + 1) for a prime q = 1 (mod 4); and Kronecker products of those
with 2^k, so 576 = 36 x 16 (Paley II with q = 17, times Sylvester's 16) is one. SpinQuant and
QuaRot use such matrices because they spread every channel over all others with equal weight,
which flattens outlier channels.
"""

from __future__ import annotations

import numpy as np

MAX_PALEY = 1 << 14  # largest Paley order tried (a prime search up to here is instant)


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    f = 2
    while f * f <= q:
        if q % f == 0:
            return False
        f += 1
    return True


def _jacobsthal(q: int) -> np.ndarray:
    """Q[i, j] = chi(j - i) over GF(q), q prime: 1 for a nonzero square, -1 for a non-square, 0 on the diagonal."""
    squares = np.zeros(q, dtype=np.int8)
    squares[[(x * x) % q for x in range(1, q)]] = 1
    chi = np.where(squares == 1, 1, -1).astype(np.int8)
    chi[0] = 0
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


def _paley(order: int) -> np.ndarray | None:
    """A Hadamard matrix of ``order`` by one of Paley's constructions, or None."""
    q = order - 1
    if q % 4 == 3 and _is_prime(q):  # Paley I: I + S, S the skew conference matrix
        s = np.zeros((order, order), dtype=np.int64)
        s[0, 1:], s[1:, 0] = 1, -1
        s[1:, 1:] = _jacobsthal(q)
        return s + np.eye(order, dtype=np.int64)
    if order % 2 == 0:
        q = order // 2 - 1
        if q % 4 == 1 and _is_prime(q):  # Paley II from the symmetric conference matrix C
            c = np.zeros((q + 1, q + 1), dtype=np.int64)
            c[0, 1:], c[1:, 0] = 1, 1
            c[1:, 1:] = _jacobsthal(q)
            return np.kron(c, np.array([[1, -1], [-1, -1]])) + np.kron(np.eye(q + 1, dtype=np.int64),
                                                                     np.array([[1, 1], [1, -1]]))
    return None


def hadamard(n: int) -> np.ndarray | None:
    """A Hadamard matrix (+-1 entries, H H^T = n I) of order ``n``, or None where none is built here."""
    base, power = n, 1
    while base % 2 == 0 and base > 1:
        base //= 2
        power *= 2
    # try the odd part times 2^k, moving factors of two into the Paley part while that is an order
    while True:
        core = np.ones((1, 1), dtype=np.int64) if base == 1 else (_paley(base) if base <= MAX_PALEY else None)
        if core is not None:
            h = core
            sylvester = np.array([[1, 1], [1, -1]], dtype=np.int64)
            k = power
            while k > 1:
                h = np.kron(h, sylvester)
                k //= 2
            return h
        if power == 1:
            return None
        base, power = base * 2, power // 2


KINDS = ("hadamard", "random-hadamard", "random-matrix")  # SpinQuantModifier's transform types


def orthogonal(n: int, seed: int = 0, kind: str = "hadamard") -> tuple[np.ndarray, str]:
    """An orthogonal ``n`` x ``n`` matrix in float64 and how it was made, by SpinQuantModifier's
    transform types: ``hadamard``, the normalized Hadamard matrix where one of order ``n`` is built
    here; ``random-hadamard``, that matrix with its columns' signs drawn from ``seed``;
    ``random-matrix`` (and either of the others where no Hadamard matrix is built), a random
    orthogonal matrix (QR of a Gaussian matrix seeded by ``seed``, signs fixed so the draw is uniform)."""
    if kind not in KINDS:
        raise ValueError(f"unknown rotation type {kind!r}")
    rng = np.random.default_rng(seed)
    h = None if kind == "random-matrix" else hadamard(n)
    if h is not None:
        q = h.astype(np.float64) / np.sqrt(n)
        if kind == "random-hadamard":
            return q * rng.choice([-1.0, 1.0], size=n)[None, :], f"Hadamard {n}, random signs (seed {seed})"
        return q, f"Hadamard {n}"
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))[None, :], f"random orthogonal {n} (seed {seed})"
