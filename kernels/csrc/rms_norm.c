/* RMSNorm for CPU tensors (fp32): out[r] = w * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)) for every row r
 * of x [rows, dim], whose rows start `stride` floats apart; out is [rows, dim], contiguous. The sum of squares is accumulated in double, then rounded to float as the
 * mean; the rest is float arithmetic in the order torch's reference uses (normalise, then scale).
 * One thread: a decode step's rows are a few microseconds of work, less than waking a team. */
#include <math.h>
#include <stdint.h>

int afd_rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, int64_t stride,
                     double eps) {
    if (rows < 0 || dim < 1 || stride < dim) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        float *o = out + r * dim;
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; d++) ss += (double)xr[d] * xr[d];
        float inv = 1.f / sqrtf((float)(ss / (double)dim) + (float)eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) o[d] = w[d] * (xr[d] * inv);
    }
    return 0;
}
