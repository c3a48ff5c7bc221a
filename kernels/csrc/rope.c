/* Rotary position embedding for CPU tensors (fp32), as models/rope.py applies it:
 *
 *   x [T, H, D] with row strides (stride_t, stride_h) and unit stride within a head; cos, sin
 *   [T, D/2] contiguous; out [T, H, D] contiguous.
 *   x1, x2 = the even and odd dimensions of a head (interleave) or its two halves;
 *   out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin].
 *
 * Each product is rounded before the sum, as torch's separate operators round them, so the result
 * is torch's bit for bit: the function is compiled without contracting products into fused
 * multiply-adds. One thread: a decode step's rows are a microsecond of work or two. */
#include <stdint.h>

__attribute__((optimize("fp-contract=off"))) int afd_rope_f32(const float *x, const float *cos_t, const float *sin_t,
                                                             float *out, int64_t T, int64_t H, int64_t D,
                                                             int64_t stride_t, int64_t stride_h, int64_t interleave) {
    if (T < 0 || H < 1 || D < 2 || D % 2 || stride_h < D || stride_t < 0) return -1;
    int64_t half = D / 2, step = interleave ? 2 : 1, second = interleave ? 1 : half;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t h = 0; h < H; h++) {
            const float *xh = x + t * stride_t + h * stride_h;
            float *o = out + (t * H + h) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = xh[i * step], x2 = xh[i * step + second];
                float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
                o[i] = a - b;
                o[half + i] = e + f;
            }
        }
    }
    return 0;
}
