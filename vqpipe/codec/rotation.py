"""Seeded orthogonal rotations R (d x d), applied as x -> R x along the last axis.

Kinds:
- ``hadamard``: R = H D, D a diagonal of seeded random signs, H the normalised Hadamard matrix
  (``mx.hadamard_transform``; only for d = m * 2^k with m in {1, 12, 20, 28}). Stores d signs.
- ``kron``: R = Q (x) (H D) for d = m * p, where p is the largest Hadamard size dividing d and Q a
  seeded Haar-random m x m orthogonal matrix. 4864 = 19 * 256 stores a 19 x 19 matrix + 256 signs,
  applies in O(d log p + d m).
- ``qr``: a dense Haar-random d x d matrix (QR of a Gaussian matrix). O(d^2) storage and work; it
  is the case the reservoir's persist_rotation dial exists for.
- ``none``: the identity (the unrotated baseline).
- ``auto``: ``hadamard`` where MLX supports the size, otherwise ``kron``.

Everything random comes from numpy's PCG64 seeded by (seed, dim, kind), so a rotation regenerates
bit-identically in a fresh process (given the same numpy/LAPACK build for ``qr``; the reservoir
stores a checksum to catch a different one).
"""

from dataclasses import dataclass, field, replace
from functools import lru_cache

import mlx.core as mx
import numpy as np

KINDS = ("auto", "hadamard", "kron", "qr", "none")
HADAMARD_BASES = (1, 12, 20, 28)
_KIND_TAG = {"hadamard": 1, "kron": 2, "qr": 3, "none": 4}


def _is_pow2(n):
    return n >= 1 and n & (n - 1) == 0


def hadamard_supported(d):
    return any(d % m == 0 and _is_pow2(d // m) for m in HADAMARD_BASES)


def kron_split(d):
    """(m, p): d = m * p with p the largest size ``mx.hadamard_transform`` supports."""
    best = 1
    for base in HADAMARD_BASES:
        p = base
        while d % p == 0:
            best = max(best, p)
            p *= 2
    return d // best, best


def _rng(seed, dim, kind):
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, dim, _KIND_TAG[kind]])))


def _signs(rng, n):
    return np.where(rng.random(n) < 0.5, -1.0, 1.0).astype(np.float32)


def haar_orthogonal(rng, n):
    """Haar-distributed orthogonal matrix: QR of a Gaussian matrix with the signs of R's diagonal."""
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    q *= np.sign(np.diag(r))
    return q.astype(np.float32)


@dataclass
class Rotation:
    kind: str
    dim: int
    seed: int
    m: int = 1
    p: int = 1
    signs: mx.array = None
    q: mx.array = None
    matrix: mx.array = None
    # False: the sign diagonal D is left out of apply / apply_transpose (x is D x already: see
    # vqpipe/layers/fold.py); ``signs`` are then ones, so the qmv prologue multiplies by 1 (exact).
    signed: bool = True
    _cast: dict = field(default_factory=dict, repr=False, compare=False)

    def _as(self, name, dtype):
        """``signs``/``q`` in ``dtype``, cast once: decode calls every layer per token, and a cast
        per call is one more op to launch on a GPU. (The dense QR matrix is not cached: a second
        d x d copy would double its memory.)"""
        a = getattr(self, name)
        if a.dtype == dtype:
            return a
        key = (name, dtype)
        if key not in self._cast:
            self._cast[key] = a.astype(dtype)
            mx.eval(self._cast[key])  # else, cast first inside a compile trace, an AsType replayed per call
        return self._cast[key]

    def apply(self, x):
        """R x along the last axis of ``x`` (weight rows or activations)."""
        if self.kind == "none":
            return x
        if self.kind == "qr":
            return x @ self.matrix.T.astype(x.dtype)
        if self.kind == "hadamard":
            return mx.hadamard_transform(x * self._as("signs", x.dtype) if self.signed else x)
        shape = x.shape
        y = x.reshape(*shape[:-1], self.m, self.p)
        if self.signed:
            y = y * self._as("signs", x.dtype)
        if self.p > 1:
            y = mx.hadamard_transform(y)
        return (self._as("q", x.dtype) @ y).reshape(shape)

    def apply_transpose(self, y):
        """R^T y along the last axis (undoes ``apply``)."""
        if self.kind == "none":
            return y
        if self.kind == "qr":
            return y @ self.matrix.astype(y.dtype)
        if self.kind == "hadamard":
            y = hadamard_transpose(y)
            return y * self._as("signs", y.dtype) if self.signed else y
        shape = y.shape
        x = self.q.T.astype(y.dtype) @ y.reshape(*shape[:-1], self.m, self.p)
        if self.p > 1:
            x = hadamard_transpose(x)
        return (x * self._as("signs", y.dtype) if self.signed else x).reshape(shape)

    def has_signs(self):
        return self.kind in ("hadamard", "kron") and self.signed

    def sign_vector(self):
        """D's diagonal over all ``dim`` inputs (kron repeats its p signs m times), float32."""
        if not self.has_signs():
            raise ValueError(f"a {self.kind} rotation{'' if self.signed else ' without its signs'} has no sign vector")
        s = self.signs.astype(mx.float32)
        return s if self.kind == "hadamard" else mx.tile(s, (self.m,))

    def unsigned(self):
        """The same rotation without D: ``apply(D x)`` of this one equals ``apply(x)`` of self,
        exactly (negation is exact). For the forward pass only; it cannot be stored."""
        if not self.has_signs():
            raise ValueError(f"a {self.kind} rotation has no signs to leave out")
        return replace(self, signs=mx.ones(self.signs.shape, self.signs.dtype), signed=False, _cast={})

    def to_state(self):
        if not self.signed:
            raise ValueError("a rotation without its signs (folded into the layers before it) is not stored; "
                             "store the layer's own rotation")
        meta = {"kind": self.kind, "dim": self.dim, "seed": self.seed}
        arrays = {}
        if self.kind == "kron":
            meta.update(m=self.m, p=self.p)
            arrays["q"] = self.q
        if self.kind in ("hadamard", "kron"):
            arrays["signs"] = self.signs
        if self.kind == "qr":
            arrays["matrix"] = self.matrix
        return meta, arrays

    def matrix_bytes(self):
        return sum(a.nbytes for a in self.to_state()[1].values())


@lru_cache(maxsize=None)
def _hadamard_base(m):
    """The m x m matrix A that ``mx.hadamard_transform`` uses for sizes m * 2^k (normalised)."""
    # On the CPU stream: MLX 0.32.4's CUDA backend fails to compile a transform of size m * 2^0.
    a = mx.hadamard_transform(mx.eye(m, stream=mx.cpu), stream=mx.cpu).T
    mx.eval(a)
    return a


def hadamard_transpose(y):
    """H^T y for MLX's normalised Hadamard H = A_m (x) S_p (Sylvester S, symmetric).

    The 20- and 28-point base matrices A_m are not symmetric, so H^T != H for those sizes.
    """
    d = y.shape[-1]
    m = next((b for b in HADAMARD_BASES[1:] if d % b == 0 and _is_pow2(d // b)), 1)
    if m == 1:
        return mx.hadamard_transform(y)
    p = d // m
    z = y.reshape(*y.shape[:-1], m, p)
    if p > 1:
        z = mx.hadamard_transform(z)
    return (_hadamard_base(m).T.astype(y.dtype) @ z).reshape(y.shape)


def resolve_kind(kind, dim):
    if kind not in KINDS:
        raise ValueError(f"unknown rotation {kind!r}; choose one of {', '.join(KINDS)}")
    if kind == "auto":
        return "hadamard" if hadamard_supported(dim) else "kron"
    if kind == "hadamard" and not hadamard_supported(dim):
        raise ValueError(
            f"rotation 'hadamard' does not support dimension {dim}: mx.hadamard_transform needs "
            f"m * 2^k with m in {HADAMARD_BASES}; use 'kron' or 'auto'"
        )
    return kind


def make_rotation(kind, dim, seed=0):
    """Generate a rotation of size ``dim`` from ``seed`` (``kind`` may be ``auto``)."""
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"rotation dimension must be a positive integer, got {dim!r}")
    kind = resolve_kind(kind, dim)
    rng = _rng(seed, dim, kind)
    if kind == "none":
        return Rotation("none", dim, seed)
    if kind == "hadamard":
        return Rotation("hadamard", dim, seed, 1, dim, signs=mx.array(_signs(rng, dim)))
    if kind == "kron":
        m, p = kron_split(dim)
        signs = _signs(rng, p)
        q = haar_orthogonal(rng, m)
        return Rotation("kron", dim, seed, m, p, signs=mx.array(signs), q=mx.array(q))
    return Rotation("qr", dim, seed, matrix=mx.array(haar_orthogonal(rng, dim)))


def regenerate(meta):
    """Rebuild a rotation from its meta alone (seed); bit-identical to the original."""
    return make_rotation(meta["kind"], int(meta["dim"]), int(meta["seed"]))


def from_state(meta, arrays):
    """Build a rotation from stored arrays; no random generation, no QR."""
    kind, dim, seed = meta["kind"], int(meta["dim"]), int(meta["seed"])
    if kind == "none":
        return Rotation("none", dim, seed)
    if kind == "hadamard":
        return Rotation("hadamard", dim, seed, 1, dim, signs=arrays["signs"])
    if kind == "kron":
        return Rotation("kron", dim, seed, int(meta["m"]), int(meta["p"]), signs=arrays["signs"], q=arrays["q"])
    if kind == "qr":
        return Rotation("qr", dim, seed, matrix=arrays["matrix"])
    raise ValueError(f"unknown rotation kind {kind!r} in stored state")
