/* Decode attention for CPU tensors (fp32): one query token per sequence against its cached tokens,
 * read from the paged cache in place. Serves both attention kinds of the engine:
 *
 *   absorbed MLA: one shared key/value "head" per token, the row [latent C | rope R]; keys are the
 *     whole row (Dk = C + R), values its first C entries (Dv = C); q is the absorbed query and the
 *     rope query back to back.
 *   GQA: KVH key/value heads per token, the row [keys KVH x D | values KVH x D]; query head h reads
 *     key/value head h / (H / KVH).
 *
 * For query head h of sequence b: softmax over j < kv_lens[b] of q[b, h] . key(slot(b, j)), applied
 * to value(slot(b, j)); slot(b, j) = pages[b, j / page_size] * page_size + j % page_size; q is
 * already multiplied by the softmax scale.
 *
 * One pass over each sequence's rows in blocks of BLK tokens with an online softmax: the scores of
 * a block for all of a task's heads, the running maximum and sum, then the block's values added into
 * the output. No gathered copy of the cache is made. Tasks are (sequence, key/value head, group of
 * its query heads), spread over OpenMP threads; the caller picks the group size so that small
 * batches still fill the threads.
 */
#include <math.h>
#include <stdint.h>

#define BLK 32
#define MAX_HEADS 128 /* heads per task */
#define VW 16          /* floats per vector of add_values (one AVX-512 register; narrower CPUs split it) */

typedef float vf __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float)))); /* unaligned loads */

/* out[h] += sum over the block's rows t of s[h * BLK + t] * value(t), for every head h < nh. Four
 * heads and VW outputs at a time stay in registers over all the block's rows, so each value row is
 * loaded once per four heads and each output once per block; the adds run in row order, as a plain
 * loop over rows would. */
static void add_values(const float *s, const float *const *rows, int n, int nh, int Dv, int64_t voff, float *out) {
    int h = 0;
    for (; h + 4 <= nh; h += 4) {
        float *o0 = out + h * Dv, *o1 = o0 + Dv, *o2 = o1 + Dv, *o3 = o2 + Dv;
        const float *p0 = s + h * BLK, *p1 = p0 + BLK, *p2 = p1 + BLK, *p3 = p2 + BLK;
        int c = 0;
        for (; c + VW <= Dv; c += VW) {
            vf a0 = *(vf *)(o0 + c), a1 = *(vf *)(o1 + c), a2 = *(vf *)(o2 + c), a3 = *(vf *)(o3 + c);
            for (int t = 0; t < n; t++) {
                vf r = *(const vf *)(rows[t] + voff + c);
                a0 += p0[t] * r;
                a1 += p1[t] * r;
                a2 += p2[t] * r;
                a3 += p3[t] * r;
            }
            *(vf *)(o0 + c) = a0, *(vf *)(o1 + c) = a1, *(vf *)(o2 + c) = a2, *(vf *)(o3 + c) = a3;
        }
        for (; c < Dv; c++)
            for (int t = 0; t < n; t++) {
                float r = rows[t][voff + c];
                o0[c] += p0[t] * r, o1[c] += p1[t] * r, o2[c] += p2[t] * r, o3[c] += p3[t] * r;
            }
    }
    for (; h < nh; h++) {
        float *o = out + h * Dv;
        const float *p = s + h * BLK;
        for (int t = 0; t < n; t++) {
            const float *row = rows[t] + voff;
#pragma omp simd
            for (int c = 0; c < Dv; c++) o[c] += p[t] * row[c];
        }
    }
}

static void attend(const float *q, const float *cache, const int64_t *pages, int64_t len, int64_t page_size,
                   int nh, int Dk, int Dv, int64_t stride, int64_t koff, int64_t voff, float *out) {
    float s[MAX_HEADS * BLK], m[MAX_HEADS], l[MAX_HEADS];
    const float *rows[BLK];
    for (int h = 0; h < nh; h++) {
        m[h] = -INFINITY;
        l[h] = 0.f;
        for (int c = 0; c < Dv; c++) out[h * Dv + c] = 0.f;
    }
    for (int64_t j0 = 0; j0 < len; j0 += BLK) {
        int n = (int)(len - j0 < BLK ? len - j0 : BLK);
        for (int t = 0; t < n; t++) {
            int64_t j = j0 + t;
            rows[t] = cache + (pages[j / page_size] * page_size + j % page_size) * stride;
        }
        /* scores, four heads at a time: each row is read once per four dot products */
        for (int t = 0; t < n; t++) {
            const float *row = rows[t] + koff;
            int h = 0;
            for (; h + 4 <= nh; h += 4) {
                const float *q0 = q + h * Dk, *q1 = q0 + Dk, *q2 = q1 + Dk, *q3 = q2 + Dk;
                float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int d = 0; d < Dk; d++) {
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
                const float *qh = q + h * Dk;
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int d = 0; d < Dk; d++) a += qh[d] * row[d];
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
                float *o = out + h * Dv;
#pragma omp simd
                for (int c = 0; c < Dv; c++) o[c] *= corr;
            }
        }
        add_values(s, rows, n, nh, Dv, voff, out);
    }
    for (int h = 0; h < nh; h++) {
        float inv = l[h] > 0.f ? 1.f / l[h] : 0.f, *o = out + h * Dv;
        for (int c = 0; c < Dv; c++) o[c] *= inv;
    }
}

/* q [B, H, Dk] (scaled), cache [num_slots, stride], pages [B, P], kv_lens [B] -> out [B, H, Dv].
 * Key/value head g of a row: keys at g * Dk, values at val_base + g * Dv (MLA: KVH = 1, val_base =
 * 0). Tasks take up to heads_per_task (1..MAX_HEADS) query heads of one key/value head; threads: the
 * OpenMP team size. Returns 0; -1 for sizes it cannot take; -2 when a sequence is longer than its
 * page table row or one of the pages it reads is outside the cache (nothing is read then). */
int afd_paged_decode_f32(const float *q, const float *cache, const int64_t *pages, const int64_t *kv_lens,
                         float *out, int64_t B, int64_t H, int64_t KVH, int64_t Dk, int64_t Dv, int64_t stride,
                         int64_t val_base, int64_t num_slots, int64_t P, int64_t page_size, int64_t heads_per_task,
                         int threads) {
    if (heads_per_task < 1 || heads_per_task > MAX_HEADS || page_size < 1 || KVH < 1 || H % KVH != 0 ||
        KVH * Dk > stride || val_base + KVH * Dv > stride)
        return -1;
    int64_t num_pages = num_slots / page_size;
    for (int64_t b = 0; b < B; b++) {
        if (kv_lens[b] < 0 || kv_lens[b] > P * page_size) return -2;
        for (int64_t p = 0; p < (kv_lens[b] + page_size - 1) / page_size; p++)
            if (pages[b * P + p] < 0 || pages[b * P + p] >= num_pages) return -2;
    }
    int64_t group = H / KVH, chunks = (group + heads_per_task - 1) / heads_per_task;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < B * KVH * chunks; task++) {
        int64_t b = task / (KVH * chunks), g = task / chunks % KVH, c = task % chunks;
        int64_t h0 = g * group + c * heads_per_task;
        int64_t nh = group - c * heads_per_task < heads_per_task ? group - c * heads_per_task : heads_per_task;
        attend(q + (b * H + h0) * Dk, cache, pages + b * P, kv_lens[b], page_size, (int)nh, (int)Dk, (int)Dv,
               stride, g * Dk, val_base + g * Dv, out + (b * H + h0) * Dv);
    }
    return 0;
}
