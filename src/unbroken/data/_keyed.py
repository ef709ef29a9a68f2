"""Seed mixing and the keyed bijection that orders samples without materializing anything.

Everything here is a pure function of its arguments: no global RNG is read or written, so the
order and the per-sample seeds are the same in every process, worker and run.
"""

from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

# Domain tags keep the seeds derived for different purposes independent even when the user
# passes the same integer seed to the sampler, the `seeded` wrapper and the packer.
TAG_ORDER = 0x6F72646572  # "order"
TAG_SAMPLE = 0x73616D706C65  # "sample"
TAG_COLLATE = 0x636F6C6C617465  # "collate"
TAG_WORKERS = 0x776F726B657273  # "workers"
TAG_PACK = 0x7061636B  # "pack"

# The largest dataset the bijection handles: indices and positions must fit in int64.
MAX_SAMPLES = 1 << 62


def _fmix64(z: int) -> int:
    """splitmix64 / murmur3 finalizer: a bijection on 64-bit words with full avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def mix(*words: int) -> int:
    """Hash any number of integers (any size or sign) to one well-mixed 64-bit integer.

    Order matters and the word count is mixed in, so ``mix(a, b) != mix(a, b, 0)``.
    """
    h = _fmix64(_GOLDEN ^ len(words))
    for w in words:
        w = int(w)
        # Fold integers wider than 64 bits (and negative ones) chunk by chunk so that no
        # two distinct Python integers are silently truncated to the same word.
        sign = 1 if w < 0 else 0
        w = abs(w)
        chunks = 0
        while True:
            h = _fmix64((h + _GOLDEN + (w & _M64)) & _M64)
            w >>= 64
            chunks += 1
            if not w:
                break
        h = _fmix64((h + _GOLDEN + (chunks << 1 | sign)) & _M64)
    return h


_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _fmix64_array(z: np.ndarray) -> np.ndarray:
    # uint64 array arithmetic wraps modulo 2**64 (arrays, unlike NumPy scalars, never warn).
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


class KeyedPermutation:
    """A keyed pseudorandom bijection of ``[0, n)``: a balanced Feistel network on the
    smallest even-bit domain ``2**(2h) >= n``, with cycle-walking to stay inside ``[0, n)``.

    O(1) memory, O(1) expected time per element (the domain is less than 4n, so a walk takes
    under 4 steps on average). Vectorized over NumPy arrays of positions.
    """

    ROUNDS = 8  # more than the 4 Luby-Rackoff needs: small domains then still mix well

    def __init__(self, n: int, key: int) -> None:
        if not 0 <= n <= MAX_SAMPLES:
            raise ValueError(f"permutation size must be in [0, 2**62], got {n}")
        self.n = n
        half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
        self._half = np.uint64(half)
        self._mask = np.uint64((1 << half) - 1)
        # The round function keeps the top `half` bits of the mixed word (the best mixed).
        self._take = np.uint64(64 - half)
        self._keys = [np.uint64(mix(key, r)) for r in range(self.ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left = x >> self._half
        right = x & self._mask
        for k in self._keys:
            f = _fmix64_array(right ^ k) >> self._take
            left, right = right, left ^ f
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Map positions (any integer array, each in ``[0, n)``) to their permuted values
        (int64)."""
        x = np.asarray(positions, dtype=np.uint64).reshape(-1)
        if self.n <= 1:
            return x.astype(np.int64)
        y = self._feistel(x)
        n = np.uint64(self.n)
        outside = np.flatnonzero(y >= n)
        # Cycle-walking: re-apply the bijection until the value lands inside [0, n). The
        # cycle through x contains x itself, so this always terminates, and it keeps the
        # restricted map a bijection of [0, n).
        while outside.size:
            y[outside] = self._feistel(y[outside])
            outside = outside[y[outside] >= n]
        return y.astype(np.int64)
