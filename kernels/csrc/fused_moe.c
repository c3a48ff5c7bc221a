/* Routed-expert SwiGLU for CPU tensors (fp32): every token's weighted sum over the experts it was
 * routed to, computed from the stacked expert weights in place.
 *
 *   x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; ids [T, K] int64, the local
 *   expert of each of a token's K routes or -1 (an expert held elsewhere: contributes nothing);
 *   weights [T, K] fp32.
 *   out[t] = sum over routes k of token t with ids[t, k] >= 0, in ascending expert order, of
 *            weights[t, k] * w2[e] . (silu(gate[e] . x[t]) * (up[e] . x[t])),  e = ids[t, k].
 *
 * The routes are sorted by expert (a counting sort, stable in route order). Each task takes up to
 * TILE routes of one expert and runs both products on them, so that every weight row it reads
 * serves TILE tokens: the expert's weights are read once per tile, never copied into blocks, and no
 * row is padding. A task writes its routes' weighted outputs to their own rows of `routed`
 * [T * K, H]; a second parallel loop adds each token's rows in ascending expert order (the order
 * the torch reference and Hugging Face's loop over experts add them), so the result does not depend
 * on how the tasks were spread over the threads. K is at most MAX_K.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 4
#define MAX_K 64

/* y[i][r] = w[r] . x[i] for r < rows, i < n (n <= TILE): each weight row is read once for all n. */
static void rows_times_tile(const float *w, int64_t rows, int64_t len, const float *const *x, int n, float *const *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *wr = w + r * len;
        if (n == TILE) {
            const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t d = 0; d < len; d++) {
                float v = wr[d];
                a0 += v * x0[d];
                a1 += v * x1[d];
                a2 += v * x2[d];
                a3 += v * x3[d];
            }
            y[0][r] = a0;
            y[1][r] = a1;
            y[2][r] = a2;
            y[3][r] = a3;
        } else {
            for (int i = 0; i < n; i++) {
                const float *xi = x[i];
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int64_t d = 0; d < len; d++) a += wr[d] * xi[d];
                y[i][r] = a;
            }
        }
    }
}

/* One task: routes order[0..n) of expert e. act: the thread's scratch, TILE x 2I floats. */
static void expert_tile(const float *x, const float *w13, const float *w2, const float *weights, const int64_t *order,
                        int n, int64_t K, int64_t H, int64_t I, float *act, float *routed) {
    const float *xs[TILE];
    float *gu[TILE], *a[TILE], *ys[TILE];
    for (int i = 0; i < n; i++) {
        xs[i] = x + (order[i] / K) * H;
        gu[i] = act + i * 2 * I;
        a[i] = gu[i];
        ys[i] = routed + order[i] * H;
    }
    rows_times_tile(w13, 2 * I, H, xs, n, gu); /* gate in [0, I), up in [I, 2I) */
    for (int i = 0; i < n; i++) {
        float *g = gu[i];
        for (int64_t c = 0; c < I; c++) g[c] = g[c] / (1.f + expf(-g[c])) * g[I + c];
    }
    rows_times_tile(w2, H, I, (const float *const *)a, n, ys);
    for (int i = 0; i < n; i++) {
        float wt = weights[order[i]], *y = ys[i];
#pragma omp simd
        for (int64_t h = 0; h < H; h++) y[h] *= wt;
    }
}

/* See the top of the file. routed: scratch [T * K, H]. Returns 0; -1 for sizes it cannot take; -2
 * when an expert id is below -1 or not below E (nothing is computed then); -3 when it could not
 * allocate its scratch. */
int afd_fused_moe_f32(const float *x, const float *w13, const float *w2, const int64_t *ids, const float *weights,
                      float *out, float *routed, int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, int threads) {
    if (T < 0 || K < 1 || K > MAX_K || E < 1 || H < 1 || I < 1) return -1;
    int64_t R = T * K;
    for (int64_t r = 0; r < R; r++)
        if (ids[r] < -1 || ids[r] >= E) return -2;
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)), *order = malloc((size_t)(R > 0 ? R : 1) * sizeof(int64_t));
    int64_t *tiles = malloc((size_t)(R > 0 ? R : 1) * sizeof(int64_t)), *fill = calloc((size_t)E, sizeof(int64_t));
    if (!start || !order || !tiles || !fill) {
        free(start), free(order), free(tiles), free(fill);
        return -3;
    }
    for (int64_t r = 0; r < R; r++)
        if (ids[r] >= 0) start[ids[r] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t r = 0; r < R; r++)
        if (ids[r] >= 0) order[start[ids[r]] + fill[ids[r]]++] = r;
    int64_t ntiles = 0; /* tile i: routes order[tiles[i] ..), of one expert, at most TILE of them */
    for (int64_t e = 0; e < E; e++)
        for (int64_t p = start[e]; p < start[e + 1]; p += TILE) tiles[ntiles++] = p;
    const int64_t *route_end = start + 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *act = malloc((size_t)(TILE * 2 * I) * sizeof(float));
        if (!act) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < ntiles; i++) {
            if (!act) continue;
            int64_t p = tiles[i], e = ids[order[p]];
            int n = (int)(route_end[e] - p < TILE ? route_end[e] - p : TILE);
            expert_tile(x, w13 + e * 2 * I * H, w2 + e * H * I, weights, order + p, n, K, H, I, act, routed);
        }
        free(act);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            /* this token's routes, by ascending expert id (K is small: insertion sort) */
            int64_t mine[MAX_K], m = 0;
            float *o = out + t * H;
            for (int64_t h = 0; h < H; h++) o[h] = 0.f;
            for (int64_t k = 0; k < K; k++) {
                int64_t r = t * K + k;
                if (ids[r] < 0) continue;
                int64_t j = m++;
                while (j > 0 && ids[mine[j - 1]] > ids[r]) mine[j] = mine[j - 1], j--;
                mine[j] = r;
            }
            for (int64_t j = 0; j < m; j++) {
                const float *y = routed + mine[j] * H;
#pragma omp simd
                for (int64_t h = 0; h < H; h++) o[h] += y[h];
            }
        }
    }
    free(start), free(order), free(tiles), free(fill);
    return failed ? -3 : 0;
}
