"""Vector quantizers for a block of columns of unit-variance (rotated, row-normalised) weights.

Every quantizer here maps x [rows, g] (entries ~ N(0, 1) after the rotation) to code values
c [rows, g] in the same units, at exactly ``bits`` bits per weight of codes; the caller keeps one
float32 scale per row (as the scalar arm does), so bits per weight are counted alike.

- ``Scalar``: vqpipe's Lloyd-Max codebook (vqpipe/codec/codebook.py), nearest level per entry.
- ``E8P``: QuIP#-style lattice codebook, 8 weights per 16-bit code: 256 absolute-value patterns of
  D8^ = D8 + 1/2 (the 227 of squared norm <= 10 and 29 of norm 12 with five 3/2 and three 1/2),
  7 free sign bits (the 8th is fixed by D8's even-sum parity) and a shift of +-1/4, so the points
  are a subset of E8 + 1/4. Nearest point: for each shift, each of the 256 patterns with the signs
  of the input, plus the cheapest single sign flip where the parity is wrong.
- ``Trellis``: QTIP-style bitshift trellis. A row's code is one bitstream, k = bits bits per
  weight; weight i's value is code(state_i), state_i the last L bits of the stream after weight i
  (the stream starts from L - k zero bits, so exactly k bits per weight are stored; decode is
  random access). code() is a computed Gaussian-ish map of the L-bit state (1MAD or 3INST).
  Viterbi finds the best stream for a block of columns, starting from the state the previous
  block ended in (the block is what LDLQ feeds its error forward between).

None of this is imported by vqpipe.
"""

import itertools
import math
from functools import lru_cache

import numpy as np

from vqpipe.codec.codebook import codebook


class Scalar:
    """vqpipe's Lloyd-Max grid (levels for rows of ``dim``): the baseline arm."""

    name = "scalar"

    def __init__(self, bits, dim=576):
        self.bits, self.group = bits, 1
        self.levels = np.asarray(codebook(bits, dim), dtype=np.float32)
        self.bounds = (self.levels[1:] + self.levels[:-1]) / 2

    def start(self, rows):
        return None

    def quantize(self, x, state=None):
        return self.levels[np.searchsorted(self.bounds, x)], state


# --- E8P ------------------------------------------------------------------------------------------


def _d8hat_abs(max_norm2):
    """Distinct absolute-value vectors of D8^ = D8 + 1/2 with squared norm <= max_norm2, sorted."""
    vals = (0.5, 1.5, 2.5)
    out = set()
    for a in itertools.product(vals, repeat=8):
        if sum(v * v for v in a) <= max_norm2 + 1e-9:
            out.add(tuple(sorted(a)))  # every permutation, and every pattern has valid signs
    pats = set()
    for s in out:
        for p in set(itertools.permutations(s)):
            pats.add(p)
    return np.array(sorted(pats), dtype=np.float32)


@lru_cache(maxsize=None)
def e8p_patterns(seed=0):
    """The 256 absolute-value patterns: the 227 of D8^ with |a|^2 <= 10, and the 29 of the 56
    norm-12 patterns (five 3/2, three 1/2) that a Gaussian source picks most often as its nearest
    pattern at the E8P scale (chosen on synthetic N(0,1) data, seeded)."""
    base = _d8hat_abs(10.0)
    assert len(base) == 227, len(base)
    cand = np.array([[1.5 if i not in three else 0.5 for i in range(8)]
                     for three in itertools.combinations(range(8), 3)], dtype=np.float32)
    allp = np.concatenate([base, cand])
    rng = np.random.default_rng(seed)
    z = np.abs(rng.standard_normal((200_000, 8)).astype(np.float32)) * E8P_SCALE
    d = (z * z).sum(1, keepdims=True) - 2 * z @ allp.T + (allp * allp).sum(1)[None]
    hits = np.bincount(d.argmin(1), minlength=len(allp))[227:]
    pick = np.sort(np.argsort(-hits, kind="stable")[:29])
    return np.concatenate([base, cand[pick]])


TOP = 16  # patterns searched for the parity fix (see E8P._nearest)
E8P_SCALE = 1.03  # input multiplier before the lattice search; refit by Gaussian MSE below (gauss.py)


class E8P:
    """QuIP#-style E8P: 16 bits per 8 weights (2 bits per weight)."""

    name = "e8p"

    def __init__(self, scale=None, top=TOP):
        self.bits, self.group, self.top = 2, 8, top
        self.scale = float(scale or E8P_SCALE)
        a = e8p_patterns()
        self.a = a
        self.a2 = (a * a).sum(1)
        self.par = (np.round(a - 0.5).sum(1).astype(np.int64) % 2).astype(bool)  # negatives needed, mod 2

    def start(self, rows):
        return None

    def _nearest(self, u):
        """(squared distance, point) of the nearest sign-flipped pattern to u [n, 8] (no shift)."""
        au = np.abs(u)
        neg = (np.count_nonzero(u < 0, axis=1) % 2).astype(bool)
        d0 = (au * au).sum(1, keepdims=True) - 2 * au @ self.a.T + self.a2[None]
        rows = np.arange(len(u))
        # The parity fix only adds to a pattern's distance: the winner is among the patterns
        # nearest before the fix. Only the ``top`` nearest are searched (256: all of them; gauss.py
        # counts how often the pruned search differs from the full one).
        if self.top < len(self.a):
            cand = np.argpartition(d0, self.top - 1, axis=1)[:, :self.top]
        else:
            cand = np.broadcast_to(np.arange(len(self.a)), d0.shape)
        prod = au[:, None, :] * self.a[cand]  # [n, top, 8]
        flip = prod.argmin(2)
        corr = 4 * np.take_along_axis(prod, flip[..., None], 2)[..., 0]
        mism = neg[:, None] != self.par[cand]
        tot = np.take_along_axis(d0, cand, 1) + np.where(mism, corr, 0)
        kk = tot.argmin(1)
        k = cand[rows, kk]
        sign = np.where(u < 0, -1.0, 1.0).astype(np.float32)
        pt = sign * self.a[k]
        m = mism[rows, kk]
        fi = flip[rows, kk]
        pt[rows[m], fi[m]] *= -1
        return tot[rows, kk], pt

    def quantize(self, x, state=None, chunk=4096):
        rows, g = x.shape
        z = (x * self.scale).reshape(-1, 8).astype(np.float32)
        out = np.empty_like(z)
        for s0 in range(0, len(z), chunk):
            zz = z[s0:s0 + chunk]
            dp, pp = self._nearest(zz - 0.25)
            dm, pm = self._nearest(zz + 0.25)
            out[s0:s0 + chunk] = np.where((dp <= dm)[:, None], pp + 0.25, pm - 0.25)
        return (out / self.scale).reshape(rows, g), state


# --- bitshift trellis ---------------------------------------------------------------------------


def code_1mad(states):
    """QTIP's 1MAD idea: an LCG of the state, the sum of its four bytes (a CLT Gaussian), centred."""
    x = (states.astype(np.uint64) * np.uint64(34038481) + np.uint64(76625530)) & np.uint64(0xFFFFFFFF)
    y = sum((x >> np.uint64(8 * i)) & np.uint64(255) for i in range(4)).astype(np.float64)
    return (y - 510.0) / 147.800537109375


def code_3inst(states):
    """QTIP's 3INST idea: an LCG of the state, masked and xor-ed so that each 16-bit half is an
    fp16 of a fixed exponent range with random mantissa and sign; the two halves summed."""
    x = (states.astype(np.uint64) * np.uint64(89226354) + np.uint64(64248484)) & np.uint64(0xFFFFFFFF)
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo + hi


CODES = {"1mad": code_1mad, "3inst": code_3inst}


@lru_cache(maxsize=None)
def trellis_table(L, code):
    """code(state) for every L-bit state, normalised to zero mean and unit variance over the states
    (at small L the raw code's moments are off by a few per cent)."""
    v = CODES[code](np.arange(1 << L))
    v = (v - v.mean()) / v.std()
    return v.astype(np.float32)


_LIB = None


def _lib():
    """The C Viterbi (viterbi.c), compiled once into the build folder (cc -O3 -march=native)."""
    global _LIB
    if _LIB is None:
        import ctypes
        import subprocess
        from pathlib import Path

        src = Path(__file__).with_name("viterbi.c")
        out = Path(__file__).resolve().parents[2] / "build" / "vq" / "viterbi.so"
        if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
            out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
        lib = ctypes.CDLL(str(out))
        P = ctypes.c_void_p
        lib.viterbi.argtypes = [P, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, P, P, ctypes.c_int32, ctypes.c_int32]
        _LIB = lib
    return _LIB


THREADS = 2


def viterbi(x, L, k, tab, threads=None):
    """States [n, T] (int32) of the least-squares path of each row of x [n, T] (float32), from state 0."""
    from concurrent.futures import ThreadPoolExecutor

    x = np.ascontiguousarray(x, dtype=np.float32)
    tab = np.ascontiguousarray(tab, dtype=np.float32)
    n, T = x.shape
    out = np.empty((n, T), dtype=np.int32)
    lib = _lib()
    th = max(1, min(threads or THREADS, n))
    args = lambda f: (x.ctypes.data, n, T, L, k, tab.ctypes.data, out.ctypes.data, f, th)
    if th == 1:
        lib.viterbi(*args(0))
    else:
        with ThreadPoolExecutor(th) as ex:  # ctypes releases the GIL
            list(ex.map(lambda f: lib.viterbi(*args(f)), range(th)))
    return out


class Trellis:
    """Bitshift trellis, L-bit state, k = ``bits`` bits per weight; ``code`` 1mad or 3inst.

    quantize(x) takes a block of ``group`` columns of every row (the LDLQ block) and cuts it into
    tiles of ``tile_rows`` rows x ``group`` columns; each tile is one trellis sequence of
    T = tile_rows * group values, in column-major order (down the rows of a column, then the next
    column), from state 0: exactly k bits per weight, every tile decodable on its own, every
    weight from the L bits before it. Viterbi in C (viterbi.c). ``scale`` multiplies the code
    values (fitted on Gaussian MSE, gauss.py)."""

    name = "trellis"

    def __init__(self, L=8, bits=2, code="1mad", scale=1.0, group=8, tile_rows=32):
        self.L, self.bits, self.code, self.group, self.tile_rows = L, bits, code, group, tile_rows
        self.table = trellis_table(L, code) * np.float32(scale)
        self.scale = scale

    def start(self, rows):
        return None

    def quantize(self, x, state=None):
        rows, g = x.shape
        tr = self.tile_rows
        if rows % tr:
            raise ValueError(f"{rows} rows are not a multiple of the tile's {tr}")
        # [tiles, tr, g] -> sequences [tiles, g * tr], column-major inside the tile
        seq = x.reshape(rows // tr, tr, g).transpose(0, 2, 1).reshape(rows // tr, g * tr)
        st = viterbi(seq, self.L, self.bits, self.table)
        c = self.table[st].reshape(rows // tr, g, tr).transpose(0, 2, 1).reshape(rows, g)
        return c, state
