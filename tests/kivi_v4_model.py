"""A numpy model of decode kernel v4's tensor-core path (vqpipe/kivi/decode_kernel.py, _BODY_V4), lane by lane.

It follows the CUDA body's index arithmetic literally: the stages as the cp.async copies fill them
(swizzles included), each lane's A and B fragments of mma.m16n8k16 built from those stages with the
body's formulas, the mma done on the matrices the PTX fragment layout says those registers hold,
the codes unpacked by the same bit operations (bf16x2(128 + c) minus 128), the float32 -> bf16 hi +
lo split rounded to nearest even, float32 everywhere else. A wrong lane formula gives a wrong
answer here, on the CPU, before any GPU time. The residual chunks (eighth window) go through the
same mma path and running state, their full-precision keys and values split hi + lo as the body
loads them (rows past the residual's end clamped to row 0, their scores -inf, their values 0).
What it does not model: the mma's internal accumulation order (float64 here, then one float32
rounding), cp.async timing, and the block/split merges (float64 here).
"""

import numpy as np

F32 = np.float32


def bf16_rn(x):
    """float32 -> the float32 value of its bfloat16 round-to-nearest-even."""
    b = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(F32)


def split(x):
    """kv4_split: hi = bf16(x), lo = bf16(x - hi) (x - hi exact in float32)."""
    x = np.asarray(x, F32)
    hi = bf16_rn(x)
    return hi, bf16_rn((x - hi).astype(F32))


def pair(x, bits):
    """kv4_pair: the codes at bit 0 and bit 16 of x as two floats, via bf16(128 + c) - 128."""
    m = (1 << bits) - 1
    r = (int(x) & (m | m << 16)) | 0x43004300
    lo, hi = np.array([(r & 0xFFFF) << 16, r & 0xFFFF0000], np.uint32).view(F32)
    return F32(lo - 128), F32(hi - 128)  # exact: 128 + c with c < 128


def byte_perm(a, b, sel):
    src = int(a) | (int(b) << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def mma(c, a, b):
    """c [32][4] += A @ B with the m16n8k16 fragments: a [32][4][2] (a0..a3, each (low, high) half),
    b [32][2][2]; lane = 4 g + t."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for e in range(2):
            A[g, 2 * t + e], A[g + 8, 2 * t + e] = a[lane][0][e], a[lane][1][e]
            A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a[lane][2][e], a[lane][3][e]
            B[2 * t + e, g], B[2 * t + 8 + e, g] = b[lane][0][e], b[lane][1][e]
            C[g, 2 * t + e], C[g + 8, 2 * t + e] = c[lane][e], c[lane][2 + e]
    D = (A @ B + C).astype(F32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for e in range(2):
            c[lane][e], c[lane][2 + e] = D[g, 2 * t + e], D[g + 8, 2 * t + e]


def stage(kc, kp, vc, vp, cl, bits, g_size):
    """One chunk's stage as the kernel's copies lay it out: (keys [W*32], key params [D], values
    [32*W], value params [32*NGV]); kp/vp as uint32 (half2 bits)."""
    w_, d = kc.shape[1], kp.shape[1]
    wq, ngv = w_ // 4, vp.shape[1]
    grp, off = cl * 32 // g_size, (cl * 32) % g_size
    ks = np.zeros(w_ * 32, np.uint32)
    for e in range(w_ * 8):
        w, tc = divmod(e, 8)
        dst = w * 32 + ((tc ^ (2 * (w % 4))) * 4)
        ks[dst : dst + 4] = kc[grp, w, off + tc * 4 : off + tc * 4 + 4]
    vs = np.zeros(32 * w_, np.uint32)
    flat = vc[cl * 32 : cl * 32 + 32].reshape(-1)
    for e in range(8 * w_):
        tk, pc = divmod(e, wq)
        dst = tk * w_ + ((pc ^ ((tk // 2) % wq)) * 4)
        vs[dst : dst + 4] = flat[e * 4 : e * 4 + 4]
    return ks, kp[grp].copy(), vs, vp[cl * 32 : cl * 32 + 32].reshape(-1).copy()


def unpair(u):
    lo, hi = np.array([u & 0xFFFF, u >> 16], np.uint16).view(np.float16).astype(F32)
    return lo, hi


def _softmax(s, m, l_, zacc, acc):
    """The body's online softmax step over one chunk's score fragments s [32][4][2]; zacc and acc
    rescaled in place; returns (p, m, l)."""
    cm = s.reshape(8, 4, 8).max(axis=(1, 2)).repeat(4)
    if np.any(cm > m):
        mn = np.maximum(m, cm)
        alpha = np.exp(m - mn).astype(F32)
        l_ = (l_ * alpha).astype(F32)
        zacc *= alpha[:, None]
        for v in range(len(acc)):
            for lane in range(32):
                acc[v][lane] = [F32(a * alpha[lane]) for a in acc[v][lane]]
        m = mn
    with np.errstate(invalid="ignore"):
        p = np.exp(s - m[:, None, None]).astype(F32)
    return p, m, (l_ + p.sum(axis=(1, 2), dtype=F32)).astype(F32)


def _residual_chunk(qv, m, l_, zacc, acc, rk, rv, r0, nr, bits):
    """One residual chunk (residual tokens r0 .. r0 + 31) as _V4_RES_MMA does it: A = qv as hi + lo,
    B = the keys (then the values) as hi + lo, two mmas per tile; updates zacc/acc, returns (m, l)."""
    d = rk.shape[1]
    cpw, hc = 32 // bits, 16 // bits
    ki, kh, nb = d * bits // 128, cpw // 4, d // 32
    ar = np.zeros((32, d // 16, 4, 2), F32)
    for lane in range(32):
        for k in range(d // 16):
            ar[lane, k, 0], ar[lane, k, 1] = split(qv[lane, k, :2])
            ar[lane, k, 2], ar[lane, k, 3] = split(qv[lane, k, 2:])
    row = lambda buf, rt: buf[rt if rt < nr else 0]  # noqa: E731
    s = np.zeros((32, 4, 2), F32)
    for u in range(4):
        cc = [[F32(0)] * 4 for _ in range(32)]
        for i in range(ki):
            for h in range(kh):
                bh, bl = [], []
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    x = row(rk, r0 + 8 * u + g)[cpw * (t + 4 * i) : cpw * (t + 4 * i) + cpw].astype(F32)
                    h0, l0 = split([x[2 * h], x[2 * h + hc]])
                    h1, l1 = split([x[2 * h + 1], x[2 * h + 1 + hc]])
                    bh.append((h0, h1))
                    bl.append((l0, l1))
                mma(cc, [ar[ln, i * kh + h] for ln in range(32)], bh)
                mma(cc, [ar[ln, i * kh + h] for ln in range(32)], bl)
        for lane in range(32):
            g, t = divmod(lane, 4)
            for e in range(2):
                ok = r0 + 8 * u + 2 * t + e < nr
                s[lane, u, e] = F32(cc[lane][e] + cc[lane][2 + e]) if ok else F32(-np.inf)
    s, m, l_ = _softmax(s, m, l_, zacc, acc)
    for kk in range(2):
        a_fr = []
        for lane in range(32):
            g, t = divmod(lane, 4)
            h01, l01 = split([s[lane, 2 * kk, 0], s[lane, 2 * kk, 1]])
            h23, l23 = split([s[lane, 2 * kk + 1, 0], s[lane, 2 * kk + 1, 1]])
            a_fr.append((h01, l01, h23, l23))
        for kb in range(nb):
            bh, bl = [[] for _ in range(4)], [[] for _ in range(4)]
            for lane in range(32):
                g, t = divmod(lane, 4)
                vo = (g % (2 * bits)) * (16 // bits) + (g // (2 * bits)) * 4
                tk = (16 * kk + 2 * t, 16 * kk + 2 * t + 1, 16 * kk + 8 + 2 * t, 16 * kk + 9 + 2 * t)
                y = [row(rv, r0 + te)[32 * kb + vo : 32 * kb + vo + 4].astype(F32) if r0 + te < nr else np.zeros(4, F32) for te in tk]
                for u in range(4):
                    h0, l0 = split([y[0][u], y[1][u]])
                    h1, l1 = split([y[2][u], y[3][u]])
                    bh[u].append((h0, h1))
                    bl[u].append((l0, l1))
            for u in range(4):
                mma(acc[4 * kb + u], a_fr, bh[u])
                mma(acc[4 * kb + u], a_fr, bl[u])
    return m, l_


def tc_partial(q, sm, kc, kp, vc, vp, chunks, bits, g_size, rk=None, rv=None, nr=0, nq=None):
    """The partial of one warp over ``chunks``: (m [R], l [R], acc [R][D]) unnormalized, as the body
    writes it. q [R, D] float32; kc [NG, W, G], kp [NG, D] (uint32 half2 bits), vc [S, W], vp [S, NGV]
    (uint32); chunks from nq // 32 on (nq: default len(vc)) are the residual's: rk, rv [RC, D] float32 (the buffers'
    values), nr of them valid."""
    r_, d = q.shape
    w_, cpw, hc = d * bits // 32, 32 // bits, 16 // bits
    ki, kh, nb, nt = w_ // 4, cpw // 4, d // 32, d // 8
    ngv, wq = vp.shape[1], w_ // 4
    qv = np.zeros((32, d // 16, 4), F32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(ki):
            for h in range(kh):
                c = cpw * (t + 4 * i) + 2 * h
                for k, ch in enumerate((c, c + hc, c + 1, c + 1 + hc)):
                    qv[lane, i * kh + h, k] = F32(q[g, ch] * F32(sm)) if g < r_ else F32(0)
    m = np.full(32, -np.inf, F32)
    l_ = np.zeros(32, F32)
    zacc = np.zeros((32, ngv), F32)
    acc = [[[F32(0)] * 4 for _ in range(32)] for _ in range(nt)]
    nqc = (vc.shape[0] if nq is None else nq) // 32
    for cl in chunks:
        if cl >= nqc:
            m, l_ = _residual_chunk(qv, m, l_, zacc, acc, rk, rv, (cl - nqc) * 32, nr, bits)
            continue
        ks, kps, vs, vps = stage(kc, kp, vc, vp, cl, bits, g_size)
        af = np.zeros((32, d // 16, 4, 2), F32)
        bias = np.zeros(32, F32)
        for lane in range(32):
            g, t = divmod(lane, 4)
            for i in range(ki):
                for h in range(kh):
                    c = cpw * (t + 4 * i) + 2 * h
                    x = []
                    for k, ch in enumerate((c, c + hc, c + 1, c + 1 + hc)):
                        s, z = unpair(kps[ch])
                        x.append(F32(qv[lane, i * kh + h, k] * s))
                        bias[lane] = F32(bias[lane] + F32(qv[lane, i * kh + h, k] * z))
                    hi, lo = split(x[:2])
                    af[lane, i * kh + h, 0], af[lane, i * kh + h, 1] = hi, lo
                    hi, lo = split(x[2:])
                    af[lane, i * kh + h, 2], af[lane, i * kh + h, 3] = hi, lo
        bias = (bias.reshape(8, 4).sum(1, dtype=F32)).repeat(4)  # the two xor shuffles (order aside)
        s = np.zeros((32, 4, 2), F32)
        for u in range(4):
            cc = [[bias[ln], bias[ln], F32(0), F32(0)] for ln in range(32)]
            for i in range(ki):
                for h in range(kh):
                    b = []
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        tok, w = 8 * u + g, t + 4 * i
                        x = int(ks[w * 32 + (((tok // 4) ^ (2 * t)) * 4) + tok % 4])
                        b.append((pair(x >> (bits * 2 * h), bits), pair(x >> (bits * (2 * h + 1)), bits)))
                    mma(cc, [af[ln, i * kh + h] for ln in range(32)], b)
            for lane in range(32):
                s[lane, u] = (F32(cc[lane][0] + cc[lane][2]), F32(cc[lane][1] + cc[lane][3]))
        s, m, l_ = _softmax(s, m, l_, zacc, acc)
        for kk in range(2):
            for kb in range(nb):
                j = 32 * kb // g_size
                a_fr, b_fr = [], [[] for _ in range(4)]
                for lane in range(32):
                    g, t = divmod(lane, 4)
                    tk = (16 * kk + 2 * t, 16 * kk + 2 * t + 1, 16 * kk + 8 + 2 * t, 16 * kk + 9 + 2 * t)
                    pk = (s[lane, 2 * kk, 0], s[lane, 2 * kk, 1], s[lane, 2 * kk + 1, 0], s[lane, 2 * kk + 1, 1])
                    xs = []
                    for e in range(4):
                        sv, zv = unpair(vps[tk[e] * ngv + j])
                        xs.append(F32(pk[e] * sv))
                        if 32 * kb % g_size == 0:
                            zacc[lane, j] = F32(zacc[lane, j] + F32(pk[e] * zv))
                    h01, l01 = split(xs[:2])
                    h23, l23 = split(xs[2:])
                    a_fr.append((h01, l01, h23, l23))
                    hw, fo = g % (2 * bits), (g // (2 * bits)) * 4
                    sel = 0x7632 if hw % 2 else 0x5410
                    wd = bits * kb + hw // 2
                    xw = [int(vs[tk[e] * w_ + (((wd // 4) ^ ((tk[e] // 2) % wq)) * 4) + wd % 4]) for e in range(4)]
                    y01, y23 = byte_perm(xw[0], xw[1], sel), byte_perm(xw[2], xw[3], sel)
                    for u in range(4):
                        b_fr[u].append((pair(y01 >> (bits * (fo + u)), bits), pair(y23 >> (bits * (fo + u)), bits)))
                for u in range(4):
                    mma(acc[4 * kb + u], a_fr, b_fr[u])
    l_ = l_.reshape(8, 4).sum(1, dtype=F32)
    zacc = zacc.reshape(8, 4, ngv).sum(1, dtype=F32)
    out = np.zeros((r_, d), F32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        if g >= r_:
            continue
        for v in range(nt):
            kb, u = divmod(v, 4)
            for e in range(2):
                n = 2 * t + e
                ch = 32 * kb + (n % (2 * bits)) * (16 // bits) + (n // (2 * bits)) * 4 + u
                out[g, ch] = F32(acc[v][lane][e] + acc[v][lane][2 + e]) + zacc[g, ch // g_size]
    return m.reshape(8, 4)[:r_, 0], l_[:r_], out
