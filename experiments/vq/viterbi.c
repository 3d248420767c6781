/* Viterbi search of a bitshift trellis (experiments/vq/codes.py, Trellis): n independent
   sequences of T values each; state_i = ((state_{i-1} << k) | b_i) & (2^L - 1), starting from
   state 0; value of state t = tab[t]. Writes each position's state (int32) of the path with the
   least squared error. Experiment code: built by experiments/vq/codes.py with cc -O3. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

void viterbi(const float *x, int64_t n, int T, int L, int k, const float *tab, int32_t *out,
             int32_t first, int32_t step)
{
    const int S = 1 << L, K = 1 << k, P = S >> k;
    float *cost = malloc(sizeof(float) * S), *next = malloc(sizeof(float) * S);
    float *m = malloc(sizeof(float) * P);
    uint8_t *back = malloc((size_t)T * P);
    for (int64_t s = first; s < n; s += step) {
        const float *xs = x + s * T;
        for (int t = 0; t < S; t++) cost[t] = INFINITY;
        cost[0] = 0.0f;
        for (int i = 0; i < T; i++) {
            uint8_t *bk = back + (size_t)i * P;
            if (K == 4) {
                const float *c0 = cost, *c1 = cost + P, *c2 = cost + 2 * P, *c3 = cost + 3 * P;
                for (int j = 0; j < P; j++) {
                    float a = c0[j], b = c1[j], c = c2[j], d = c3[j];
                    int ab = b < a, cd = d < c;
                    float mab = ab ? b : a, mcd = cd ? d : c;
                    int w = mcd < mab;
                    m[j] = w ? mcd : mab;
                    bk[j] = (uint8_t)(w ? 2 + cd : ab);
                }
            } else {
                for (int j = 0; j < P; j++) { m[j] = cost[j]; bk[j] = 0; }
                for (int top = 1; top < K; top++) {
                    const float *c = cost + top * P;
                    for (int j = 0; j < P; j++) {
                        int better = c[j] < m[j];
                        m[j] = better ? c[j] : m[j];
                        bk[j] = better ? (uint8_t)top : bk[j];
                    }
                }
            }
            const float xi = xs[i];
            for (int t = 0; t < S; t++) {
                float d = xi - tab[t];
                next[t] = d * d;
            }
            for (int j = 0; j < P; j++)
                for (int b = 0; b < K; b++)
                    next[j * K + b] += m[j];
            float *tmp = cost; cost = next; next = tmp;
        }
        int t = 0;
        for (int u = 1; u < S; u++) if (cost[u] < cost[t]) t = u;
        int32_t *o = out + s * T;
        for (int i = T - 1; i >= 0; i--) {
            o[i] = t;
            int top = back[(size_t)i * P + (t >> k)];
            t = (top << (L - k)) | (t >> k);
        }
    }
    free(cost); free(next); free(m); free(back);
}
