/* The decode step's work between its matrix products, fused: built by labkit.fast.kernels
 * with the machine's C compiler and called through ctypes.
 *
 * Every array is fp32 and contiguous (strides in elements where given). Each row is computed
 * alone, in a fixed order, so a row's result does not depend on how many rows are beside it.
 * Sums run over eight partial sums, whatever vector width the compiler picks; the build
 * turns off the contraction of a * b + c into one rounding (-ffp-contract=off).
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

#define LANES 8

/* exp(x) as 2^k * e^r, r = x - k ln 2 in [-ln2/2, ln2/2], e^r by Cephes' polynomial for
 * expf (about 1 ulp); written without branches or calls so that loops over it vectorize.
 * 0 below -87.3 (where exp is subnormal), +inf above 88.37, NaN for NaN. */
static inline float lk_exp(float x) {
    float c = x < -87.3f ? -87.3f : x;
    c = c > 88.37626f ? 88.37626f : c;
    float k = __builtin_floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    y = x < -87.3f ? 0.0f : y;
    y = x > 88.37626f ? __builtin_inff() : y;
    return x != x ? x : y;
}

static inline float sum_of(const float *restrict a, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < n; i++) s += a[i];
    return s;
}

static inline float sum_of_products(const float *restrict a, const float *restrict b,
                                    int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out = x / sqrt(mean(x^2) + eps), row by row: x, out (rows, n). */
void lk_rms_rows(const float *restrict x, float *restrict out, int64_t rows, int64_t n,
                 float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *a = x + r * n;
        float *o = out + r * n;
        float mean = sum_of_products(a, a, n) / (float)n;
        float inv = 1.0f / __builtin_sqrtf(mean + eps);
        for (int64_t i = 0; i < n; i++) o[i] = a[i] * inv;
    }
}

/* out = silu(gate) * up: gu (rows, 2 I) holds gate then up, out (rows, I). */
void lk_swiglu(const float *restrict gu, float *restrict out, int64_t rows, int64_t inner) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inner, *u = g + inner;
        float *o = out + r * inner;
        for (int64_t i = 0; i < inner; i++) o[i] = g[i] / (1.0f + lk_exp(-g[i])) * u[i];
    }
}

/* RoPE with a sign-folded sin: x * cos + roll(x, D/2) * sin (labkit.fast.layer.rope). */
static inline void rope_row(const float *restrict x, float *restrict out,
                            const float *restrict cos, const float *restrict sin, int64_t D) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int64_t i = half; i < D; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

/* Scores of q against n keys (n, D) plus an additive bias (or none) into w; their top. */
static inline float scores(const float *restrict q, const float *restrict k,
                           const float *restrict bias, float *restrict w, int64_t n, int64_t D,
                           float top) {
    for (int64_t j = 0; j < n; j++) {
        w[j] = sum_of_products(q, k + j * D, D) + (bias ? bias[j] : 0.0f);
        top = w[j] > top ? w[j] : top;
    }
    return top;
}

static inline void weighted_sum(const float *restrict w, const float *restrict v,
                                float *restrict o, int64_t n, int64_t D, float total) {
    for (int64_t j = 0; j < n; j++) {
        float p = w[j] / total;
        for (int64_t i = 0; i < D; i++) o[i] += p * v[j * D + i];
    }
}

/* One decode step's attention for N rows: qkv (N, (H + 2 Hkv) D) from the q, k, v product
 * (the attention scale already in q); cos, sin (N, D) with rows `table_stride` apart; keys,
 * values (N, Hkv, S, D), into which this step's rotated k and its v go at position `col`,
 * read at positions 0..col, with bias (N, S) added to the scores (or none: NULL). Where
 * `shared_keys` is not NULL, rows come in groups of G that share a prompt: shared_keys,
 * shared_values (N / G, Hkv, P, D) with shared_bias (N / G, P) are read first, as if
 * they stood before each row's own keys. One softmax over all of a row's positions; out
 * (N, H D). Query head h reads key/value head h / (H / Hkv); the bias is 0, or the
 * dtype's minimum on prompt padding. */
void lk_rope_attend(const float *restrict qkv, const float *restrict cos,
                    const float *restrict sin, int64_t table_stride, float *restrict keys,
                    float *restrict values, const float *restrict bias, int64_t S,
                    int64_t col, const float *restrict shared_keys,
                    const float *restrict shared_values, const float *restrict shared_bias,
                    int64_t P, int64_t G, float *restrict out, int64_t N, int64_t H,
                    int64_t Hkv, int64_t D) {
    int64_t width = (H + 2 * Hkv) * D, rep = H / Hkv;
    if (!shared_keys) P = 0;
    float q[D], weights[P + col + 1];
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + n * table_stride, *s = sin + n * table_stride;
        const float *row = qkv + n * width, *b = bias ? bias + n * S : 0;
        for (int64_t g = 0; g < Hkv; g++) {
            int64_t at = ((n * Hkv + g) * S + col) * D;
            rope_row(row + (H + g) * D, keys + at, c, s, D);
            memcpy(values + at, row + (H + Hkv + g) * D, (size_t)D * sizeof(float));
        }
        for (int64_t h = 0; h < H; h++) {
            int64_t own = (n * Hkv + h / rep) * S * D, prompt = (n / G * Hkv + h / rep) * P * D;
            rope_row(row + h * D, q, c, s, D);
            float top = -FLT_MAX;
            if (P)
                top = scores(q, shared_keys + prompt, shared_bias + n / G * P, weights, P, D,
                             top);
            top = scores(q, keys + own, b, weights + P, col + 1, D, top);
            for (int64_t j = 0; j < P + col + 1; j++) weights[j] = lk_exp(weights[j] - top);
            float total = sum_of(weights, P + col + 1);
            float *o = out + (n * H + h) * D;
            for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
            if (P) weighted_sum(weights, shared_values + prompt, o, P, D, total);
            weighted_sum(weights + P, values + own, o, col + 1, D, total);
        }
    }
}
