/* Absorbed MLA decode attention for CPU tensors (fp32), reading the paged latent cache in place.
 *
 * For each sequence b and head h: softmax over j < kv_lens[b] of q[b, h] . cache[slot(b, j)],
 * applied to the latent part (the first C values) of those rows; slot(b, j) = pages[b, j / page_size]
 * * page_size + j % page_size. q is the absorbed query and the rope query back to back ([C + R]),
 * already multiplied by the softmax scale.
 *
 * One pass over each sequence's rows in blocks of BLK tokens with an online softmax: the scores of
 * a block for all of a task's heads, the running maximum and sum, then the block's rows added into
 * the output. No gathered copy of the cache is made. Tasks are (sequence, group of heads), spread
 * over OpenMP threads; the caller picks the group size so that small batches still fill the threads.
 */
#include <math.h>
#include <stdint.h>

#define BLK 32
#define MAX_HEADS 128 /* heads per task */

static void attend(const float *q, const float *cache, const int64_t *pages, int64_t len, int64_t page_size,
                   int nh, int C, int D, float *out) {
    float s[MAX_HEADS * BLK], m[MAX_HEADS], l[MAX_HEADS];
    const float *rows[BLK];
    for (int h = 0; h < nh; h++) {
        m[h] = -INFINITY;
        l[h] = 0.f;
        for (int c = 0; c < C; c++) out[h * C + c] = 0.f;
    }
    for (int64_t j0 = 0; j0 < len; j0 += BLK) {
        int n = (int)(len - j0 < BLK ? len - j0 : BLK);
        for (int t = 0; t < n; t++) {
            int64_t j = j0 + t;
            rows[t] = cache + (pages[j / page_size] * page_size + j % page_size) * D;
        }
        /* scores, four heads at a time: each row is read once per four dot products */
        for (int t = 0; t < n; t++) {
            const float *row = rows[t];
            int h = 0;
            for (; h + 4 <= nh; h += 4) {
                const float *q0 = q + h * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int d = 0; d < D; d++) {
                    float r = row[d];
                    a0 += q0[d] * r;
                    a1 += q1[d] * r;
                    a2 += q2[d] * r;
                    a3 += q3[d] * r;
                }
                s[h * BLK + t] = a0;
                s[(h + 1) * BLK + t] = a1;
                s[(h + 2) * BLK + t] = a2;
                s[(h + 3) * BLK + t] = a3;
            }
            for (; h < nh; h++) {
                const float *qh = q + h * D;
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int d = 0; d < D; d++) a += qh[d] * row[d];
                s[h * BLK + t] = a;
            }
        }
        /* online softmax: rescale what the earlier blocks accumulated when the maximum grows */
        for (int h = 0; h < nh; h++) {
            float *sh = s + h * BLK, mb = m[h], sum = 0.f;
            for (int t = 0; t < n; t++) mb = sh[t] > mb ? sh[t] : mb;
            float corr = expf(m[h] - mb);
            for (int t = 0; t < n; t++) {
                sh[t] = expf(sh[t] - mb);
                sum += sh[t];
            }
            l[h] = l[h] * corr + sum;
            m[h] = mb;
            if (corr != 1.f) {
                float *o = out + h * C;
#pragma omp simd
                for (int c = 0; c < C; c++) o[c] *= corr;
            }
        }
        for (int t = 0; t < n; t++) {
            const float *row = rows[t];
            for (int h = 0; h < nh; h++) {
                float p = s[h * BLK + t], *o = out + h * C;
#pragma omp simd
                for (int c = 0; c < C; c++) o[c] += p * row[c];
            }
        }
    }
    for (int h = 0; h < nh; h++) {
        float inv = l[h] > 0.f ? 1.f / l[h] : 0.f, *o = out + h * C;
        for (int c = 0; c < C; c++) o[c] *= inv;
    }
}

/* q [B, H, D] (D = C + R, scaled), cache [slots, D], pages [B, P], kv_lens [B] -> out [B, H, C].
 * heads_per_task in 1..MAX_HEADS; threads: the OpenMP team size. Returns 0, or -1 for bad sizes. */
int afd_mla_decode_f32(const float *q, const float *cache, const int64_t *pages, const int64_t *kv_lens,
                       float *out, int64_t B, int64_t H, int64_t C, int64_t D, int64_t P, int64_t page_size,
                       int64_t heads_per_task, int threads) {
    if (heads_per_task < 1 || heads_per_task > MAX_HEADS || page_size < 1 || C > D) return -1;
    int64_t groups = (H + heads_per_task - 1) / heads_per_task;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < B * groups; task++) {
        int64_t b = task / groups, h0 = (task % groups) * heads_per_task;
        int64_t nh = H - h0 < heads_per_task ? H - h0 : heads_per_task;
        attend(q + (b * H + h0) * D, cache, pages + b * P, kv_lens[b], page_size, (int)nh, (int)C, (int)D,
               out + (b * H + h0) * C);
    }
    return 0;
}
