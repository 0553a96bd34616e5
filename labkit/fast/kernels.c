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

/* Eight floats as one vector (GCC's and clang's vector extension: AVX, or two SSE or NEON
 * registers); loads and stores through memcpy, so no alignment is assumed. */
typedef float v8 __attribute__((vector_size(LANES * sizeof(float))));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* The lanes summed in sum_of_products' order. */
static inline float lanes_sum(v8 a) {
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

/* Scores of q against n keys (n, D) plus an additive bias (or none) into w; their top.
 * Where D is a multiple of LANES, four keys at a time on vectors, each key's sum in
 * sum_of_products' order (the same bits). */
static inline float scores(const float *restrict q, const float *restrict k,
                           const float *restrict bias, float *restrict w, int64_t n, int64_t D,
                           float top) {
    int64_t j = 0;
    if (D % LANES == 0) {
        for (; j + 4 <= n; j += 4) {
            const float *k0 = k + j * D;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = 0; i < D; i += LANES) {
                v8 x = load8(q + i);
                a0 += x * load8(k0 + i);
                a1 += x * load8(k0 + D + i);
                a2 += x * load8(k0 + 2 * D + i);
                a3 += x * load8(k0 + 3 * D + i);
            }
            w[j] = lanes_sum(a0);
            w[j + 1] = lanes_sum(a1);
            w[j + 2] = lanes_sum(a2);
            w[j + 3] = lanes_sum(a3);
        }
    }
    for (; j < n; j++) w[j] = sum_of_products(q, k + j * D, D);
    for (j = 0; j < n; j++) {
        w[j] += bias ? bias[j] : 0.0f;
        top = w[j] > top ? w[j] : top;
    }
    return top;
}

/* o (D) += sum over j of p[j] v[j] (v (n, D)), added in order of j. Where D is a multiple of
 * LANES, 64 columns at a time held in registers (the same bits). */
static inline void weighted_sum(const float *restrict p, const float *restrict v,
                                float *restrict o, int64_t n, int64_t D) {
    if (D % LANES) {
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < D; i++) o[i] += p[j] * v[j * D + i];
        return;
    }
    for (int64_t c = 0; c < D; c += 8 * LANES) {
        int64_t blocks = (D - c < 8 * LANES ? D - c : 8 * LANES) / LANES;
        v8 acc[8];
        for (int64_t b = 0; b < blocks; b++) acc[b] = load8(o + c + b * LANES);
        for (int64_t j = 0; j < n; j++) {
            v8 pj = {0};
            pj += p[j];
            const float *row = v + j * D + c;
            for (int64_t b = 0; b < blocks; b++) acc[b] += pj * load8(row + b * LANES);
        }
        for (int64_t b = 0; b < blocks; b++) store8(o + c + b * LANES, acc[b]);
    }
}

/* One decode step's attention, the part `lk_rope_attend` hands a thread: the (group, head)
 * items lo..hi - 1, item = group * H + head, in that order. */
struct attend {
    const float *qkv, *cos, *sin;
    int64_t table_stride;
    const float *keys, *values, *bias;
    int64_t S, col;
    const float *shared_keys, *shared_values, *shared_bias;
    int64_t P, G;
    float *out;
    int64_t N, H, Hkv, D, lo, hi;
};

static void attend_items(const struct attend *a) {
    int64_t H = a->H, D = a->D, G = a->G, P = a->P, S = a->S;
    int64_t width = (H + 2 * a->Hkv) * D, rep = H / a->Hkv, n_keys = P + a->col + 1;
    float q[D], weights[n_keys];
    for (int64_t item = a->lo; item < a->hi; item++) {
        int64_t first = item / H * G, h = item % H;
        int64_t last = first + G < a->N ? first + G : a->N;
        for (int64_t n = first; n < last; n++) {
            const float *c = a->cos + n * a->table_stride, *s = a->sin + n * a->table_stride;
            const float *b = a->bias ? a->bias + n * S : 0;
            int64_t own = (n * a->Hkv + h / rep) * S * D;
            int64_t prompt = (n / G * a->Hkv + h / rep) * P * D;
            rope_row(a->qkv + n * width + h * D, q, c, s, D);
            float top = -FLT_MAX;
            if (P)
                top = scores(q, a->shared_keys + prompt, a->shared_bias + n / G * P, weights,
                             P, D, top);
            top = scores(q, a->keys + own, b, weights + P, a->col + 1, D, top);
            for (int64_t j = 0; j < n_keys; j++) weights[j] = lk_exp(weights[j] - top);
            float total = sum_of(weights, n_keys);
            for (int64_t j = 0; j < n_keys; j++) weights[j] = weights[j] / total;
            float *o = a->out + (n * H + h) * D;
            for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
            if (P) weighted_sum(weights, a->shared_values + prompt, o, P, D);
            weighted_sum(weights + P, a->values + own, o, a->col + 1, D);
        }
    }
}

/* Threads from the OpenMP runtime torch runs on, when `lk_use_openmp` was given its
 * entry points (GCC's libgomp: GOMP_parallel runs fn(data) on a team of up to n threads,
 * the caller's among them); else one thread. No OpenMP at build time: the kernels use the
 * runtime, and its threads, that the process already has. */
typedef void (*parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*team_fn)(void);
static parallel_fn omp_parallel;
static team_fn omp_thread, omp_threads;

void lk_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    omp_parallel = (parallel_fn)parallel;
    omp_thread = (team_fn)thread_num;
    omp_threads = (team_fn)num_threads;
}

static void attend_share(void *job) {
    struct attend part = *(const struct attend *)job;
    int64_t items = part.hi, t = omp_thread(), n = omp_threads();
    part.lo = items * t / n;
    part.hi = items * (t + 1) / n;
    attend_items(&part);
}

/* One decode step's attention for N rows: qkv (N, (H + 2 Hkv) D) from the q, k, v product
 * (the attention scale already in q); cos, sin (N, D) with rows `table_stride` apart; keys,
 * values (N, Hkv, S, D), into which this step's rotated k and its v go at position `col`,
 * read at positions 0..col, with bias (N, S) added to the scores (or none: NULL). Where
 * `shared_keys` is not NULL, rows come in groups of G that share a prompt: shared_keys,
 * shared_values (N / G, Hkv, P, D) with shared_bias (N / G, P) are read first, as if
 * they stood before each row's own keys. One softmax over all of a row's positions; out
 * (N, H D). Query head h reads key/value head h / (H / Hkv); the bias is 0, or the
 * dtype's minimum on prompt padding. A group's rows go head by head, so that a head's
 * prompt keys and values are read from memory once for the group; each (row, head) is
 * computed alone, the same whatever rows are beside it. The (group, head) items are split
 * into up to `threads` runs of consecutive items, one per OpenMP thread (`lk_use_openmp`):
 * which thread computes an item changes none of its bits. */
void lk_rope_attend(const float *restrict qkv, const float *restrict cos,
                    const float *restrict sin, int64_t table_stride, float *restrict keys,
                    float *restrict values, const float *restrict bias, int64_t S,
                    int64_t col, const float *restrict shared_keys,
                    const float *restrict shared_values, const float *restrict shared_bias,
                    int64_t P, int64_t G, float *restrict out, int64_t N, int64_t H,
                    int64_t Hkv, int64_t D, int64_t threads) {
    int64_t width = (H + 2 * Hkv) * D;
    if (!shared_keys) P = 0;
    for (int64_t n = 0; n < N; n++) {
        const float *c = cos + n * table_stride, *s = sin + n * table_stride;
        const float *row = qkv + n * width;
        for (int64_t g = 0; g < Hkv; g++) {
            int64_t at = ((n * Hkv + g) * S + col) * D;
            rope_row(row + (H + g) * D, keys + at, c, s, D);
            memcpy(values + at, row + (H + Hkv + g) * D, (size_t)D * sizeof(float));
        }
    }
    struct attend job = {qkv, cos, sin, table_stride, keys, values, bias, S, col,
                         shared_keys, shared_values, shared_bias, P, G, out, N, H, Hkv, D,
                         0, (N + G - 1) / G * H};
    if (threads > job.hi) threads = job.hi;
    if (threads > 1 && omp_parallel)
        omp_parallel(attend_share, &job, (unsigned)threads, 0);
    else
        attend_items(&job);
}
