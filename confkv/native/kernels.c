/* confkv native CPU kernels for the decode step (issue 17): plain C99, no torch headers.
 *
 * Built by confkv/native/loader.py with `cc -O3 -march=native -fPIC -shared -std=c99 -ffp-contract=off
 * -fopenmp-simd` (no -ffast-math: NaN and inf propagate as in torch). Tensors come as raw pointers plus
 * element strides; the last dimension is always contiguous. dtype codes: 0 = float32,
 * 1 = bfloat16. Every kernel is single-threaded (decode shapes are small) except the INT8 GEMV at the
 * end, which splits its output rows over a persistent worker pool (built with -pthread).
 *
 * bfloat16 <-> float32 as torch does it (c10/util/BFloat16.h): widening is bits << 16; narrowing
 * rounds to nearest even, and any NaN becomes the quiet NaN 0x7FC0.
 */
#define _GNU_SOURCE /* pthread, clock_gettime, sched_yield under -std=c99 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };
enum { MAX_THREADS = 16, MAX_PARTS = 3 }; /* the worker pool's threads; products of one pool call */

/* the worker pool (defined with the INT8 GEMV below): task(ctx, 0 .. chunks - 1) over up to `threads` threads */
static int pool_run(void (*task)(const void *, int64_t), const void *ctx, int64_t chunks, int threads);
typedef struct mass_args mass_args;
static int mass_read_run(mass_args *a, int64_t B, int threads);

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* the value of float f after a round trip through `dtype` (one rounding, as torch's .to(dtype)) */
static inline float round_to(float f, int dtype) {
    return dtype == BF16 ? bf16_to_f32(f32_to_bf16(f)) : f;
}

static void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

static void store_row(const float *src, int dtype, int64_t n, void *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

static inline const char *at(const void *base, int dtype, int64_t offset) {
    return (const char *)base + offset * (dtype == BF16 ? 2 : 4);
}

/* dot product; `omp simd reduction` (built with -fopenmp-simd: no OpenMP runtime) lets the compiler
 * vectorise this one sum without -ffast-math */
static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

static float sum(const float *restrict a, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i];
    return s;
}

/* max of a[0..n), NaN if any is NaN (as torch's softmax propagates it); n >= 1 */
static float max_or_nan(const float *restrict a, int64_t n) {
    float top = a[0];
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        top = a[i] > top ? a[i] : top;
        nan |= a[i] != a[i];
    }
    return nan ? a[0] - a[0] + NAN : top;
}

/* exp(x) for x <= 0 (a softmax's x - max), branch-free so that it vectorises: Cody-Waite range
 * reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6 polynomial (Cephes expf's coefficients);
 * relative error about 2 ulp. -inf and x < -87.3 give 0; NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    float xc = x < -87.3f ? -87.3f : x;
    xc = x != x ? 0.0f : xc; /* keeps the int conversion below defined; the NaN is restored at the end */
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    union { int32_t i; float f; } scale; /* 2^n, built in the exponent field */
    scale.i = ((int32_t)n + 127) << 23;
    float y = p * scale.f;
    y = x < -87.3f ? 0.0f : y;
    return x != x ? x : y;
}

/* scores[r * stride + l] = scaling * q_r . k_l for the R query rows qf [R, D] and the L keys at
 * `keys` (row stride ks elements, dtype kd). Generic C; see the AVX-512 version below. */
static void scores_c(const float *qf, int64_t R, int64_t D, const void *keys, int kd, int64_t ks, int64_t L,
                     float scaling, float *scores, int64_t stride, float *row) {
    for (int64_t l = 0; l < L; l++) {
        const void *src = at(keys, kd, l * ks);
        const float *k = kd == F32 ? (const float *)src : row;
        if (kd != F32) load_row(src, kd, D, row);
        for (int64_t r = 0; r < R; r++) scores[r * stride + l] = dot(qf + r * D, k, D) * scaling;
    }
}

/* acc[r, :] += sum_l p[r * stride + l] * v_l for the L values at `values` (row stride vs, dtype vd). */
static void weighted_sum_c(const float *p, int64_t stride, int64_t R, int64_t D, const void *values, int vd,
                           int64_t vs, int64_t L, float *acc, float *row) {
    for (int64_t l = 0; l < L; l++) {
        const void *src = at(values, vd, l * vs);
        const float *v = vd == F32 ? (const float *)src : row;
        if (vd != F32) load_row(src, vd, D, row);
        for (int64_t r = 0; r < R; r++) {
            const float w = p[r * stride + l];
            float *a = acc + r * D;
            for (int64_t d = 0; d < D; d++) a[d] = fmaf(w, v[d], a[d]);
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* The same two loops with AVX-512 for D a multiple of 16 up to 256 (the compiler alone does not
 * vectorise the dot products' final sums without -ffast-math); `nc` = D / 16 is a constant where
 * inlined for D = 64 and 128, so the rows stay in registers. */
static inline __m512 load16(const char *src, int dtype) {
    if (dtype == F32) return _mm512_loadu_ps((const float *)src);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __attribute__((always_inline)) void scores_avx512(
    const float *qf, int64_t R, const int nc, const void *keys, int kd, int64_t ks, int64_t L, float scaling,
    float *scores, int64_t stride) {
    const int64_t bytes = kd == BF16 ? 2 : 4;
    __m512 k[16];
    for (int64_t l = 0; l < L; l++) {
        const char *src = (const char *)keys + l * ks * bytes;
        for (int c = 0; c < nc; c++) k[c] = load16(src + c * 16 * bytes, kd);
        for (int64_t r = 0; r < R; r++) {
            const float *q = qf + r * nc * 16;
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
            for (int c = 1; c < nc; c++) sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), k[c], sum);
            scores[r * stride + l] = _mm512_reduce_add_ps(sum) * scaling;
        }
    }
}

static inline __attribute__((always_inline)) void weighted_sum_avx512(
    const float *p, int64_t stride, int64_t R, const int nc, const void *values, int vd, int64_t vs, int64_t L,
    float *acc) {
    const int64_t bytes = vd == BF16 ? 2 : 4;
    const int block = 16 / nc; /* rows per pass over the values: block * nc accumulators in registers */
    __m512 a[16], v[16];
    for (int64_t r0 = 0; r0 < R; r0 += block) {
        const int rows = R - r0 < block ? (int)(R - r0) : block;
        for (int i = 0; i < block * nc; i++) a[i] = _mm512_setzero_ps();
        for (int64_t l = 0; l < L; l++) {
            const char *src = (const char *)values + l * vs * bytes;
            for (int c = 0; c < nc; c++) v[c] = load16(src + c * 16 * bytes, vd);
            for (int rr = 0; rr < block; rr++) { /* rows past R get weight 0 and are not stored */
                const __m512 w = _mm512_set1_ps(rr < rows ? p[(r0 + rr) * stride + l] : 0.0f);
                for (int c = 0; c < nc; c++) a[rr * nc + c] = _mm512_fmadd_ps(w, v[c], a[rr * nc + c]);
            }
        }
        for (int rr = 0; rr < rows; rr++)
            for (int c = 0; c < nc; c++) {
                float *out = acc + (r0 + rr) * nc * 16 + 16 * c;
                _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), a[rr * nc + c]));
            }
    }
}
#endif

static void scores_segment(const float *qf, int64_t R, int64_t D, const void *keys, int kd, int64_t ks, int64_t L,
                           float scaling, float *scores, int64_t stride, float *row) {
#if defined(__AVX512F__)
    if (D == 64) return scores_avx512(qf, R, 4, keys, kd, ks, L, scaling, scores, stride);
    if (D == 128) return scores_avx512(qf, R, 8, keys, kd, ks, L, scaling, scores, stride);
    if (D % 16 == 0 && D <= 256) return scores_avx512(qf, R, (int)(D / 16), keys, kd, ks, L, scaling, scores, stride);
#endif
    scores_c(qf, R, D, keys, kd, ks, L, scaling, scores, stride, row);
}

static void weighted_sum_segment(const float *p, int64_t stride, int64_t R, int64_t D, const void *values, int vd,
                                 int64_t vs, int64_t L, float *acc, float *row) {
#if defined(__AVX512F__)
    if (D == 64) return weighted_sum_avx512(p, stride, R, 4, values, vd, vs, L, acc);
    if (D == 128) return weighted_sum_avx512(p, stride, R, 8, values, vd, vs, L, acc);
    if (D % 16 == 0 && D <= 256) return weighted_sum_avx512(p, stride, R, (int)(D / 16), values, vd, vs, L, acc);
#endif
    weighted_sum_c(p, stride, R, D, values, vd, vs, L, acc, row);
}

/* one call's operands (see confkv_mass_read) */
struct mass_args {
    const void *query;
    int q_dtype;
    int64_t q_sb, q_sh, q_sq, Hq, Q, D, Hkv, G, R, total;
    int n_seg;
    const void *const *keys, *const *values;
    const int64_t *meta;
    float scaling;
    void *out;
    float *const *mass;
    float *scratch;         /* R * D + R * total + R * D + D floats for each pair that runs at once */
    int64_t scratch_stride; /* floats between two pairs' scratch (0: one scratch, the pairs in turn) */
    /* optional: after its mass, each slot's statistics become stat * stat_scale[k] + mass * stat_gain[k]
     * (the linear observe of confkv_decode_step); stats[s * n_stats + k] is segment s's [B, Hkv, L_s] float32 */
    int n_stats;
    float *const *stats;
    const int64_t *stat_rows; /* per segment: floats between two (sequence, KV head) rows of its statistics */
    const float *stat_scale, *stat_gain;
};

static int64_t mass_scratch(const mass_args *a) { return a->R * a->D + a->R * a->total + a->R * a->D + a->D; }

/* the read of query heads j * G .. j * G + G - 1 of sequence b over KV head j: unit = b * Hkv + j */
static void mass_read_unit(const void *ctx, int64_t unit) {
    const mass_args *a = (const mass_args *)ctx;
    const int64_t b = unit / a->Hkv, j = unit % a->Hkv, G = a->G, Q = a->Q, D = a->D, R = a->R, total = a->total;
    float *qf = a->scratch + unit * a->scratch_stride;
    float *scores = qf + R * D, *acc = scores + R * total, *row = acc + R * D;
    /* row r = g * Q + q holds query head j * G + g, query q */
    for (int64_t g = 0; g < G; g++)
        for (int64_t q = 0; q < Q; q++)
            load_row(at(a->query, a->q_dtype, b * a->q_sb + (j * G + g) * a->q_sh + q * a->q_sq), a->q_dtype, D,
                     qf + (g * Q + q) * D);
    int64_t offset = 0;
    for (int s = 0; s < a->n_seg; s++) {
        const int64_t *m = a->meta + 9 * s;
        scores_segment(qf, R, D, at(a->keys[s], (int)m[1], b * m[3] + j * m[4]), (int)m[1], m[5], m[0], a->scaling,
                       scores + offset, total, row);
        offset += m[0];
    }
    for (int64_t r = 0; r < R; r++) {
        float *p = scores + r * total;
        const float top = max_or_nan(p, total);
        for (int64_t l = 0; l < total; l++) p[l] = exp_nonpositive(p[l] - top);
        const float inv = 1.0f / sum(p, total);
        for (int64_t l = 0; l < total; l++) p[l] *= inv;
    }
    for (int64_t i = 0; i < R * D; i++) acc[i] = 0.0f;
    offset = 0;
    for (int s = 0; s < a->n_seg; s++) {
        const int64_t *m = a->meta + 9 * s, L = m[0];
        float *slot_mass = a->mass[s] + (b * a->Hkv + j) * L;
        for (int64_t l = 0; l < L; l++) slot_mass[l] = 0.0f;
        for (int64_t q = 0; q < Q; q++) {
            for (int64_t l = 0; l < L; l++) {
                float group = 0.0f;
                for (int64_t g = 0; g < G; g++) group += scores[(g * Q + q) * total + offset + l];
                slot_mass[l] += group / (float)G;
            }
        }
        for (int k = 0; k < a->n_stats; k++) { /* torch's stat.mul_(scale).add_(mass, alpha=gain) */
            float *stat = a->stats[s * a->n_stats + k] + (b * a->Hkv + j) * a->stat_rows[s];
            const float scale = a->stat_scale[k], gain = a->stat_gain[k];
            for (int64_t l = 0; l < L; l++) stat[l] = fmaf(slot_mass[l], gain, stat[l] * scale);
        }
        weighted_sum_segment(scores + offset, total, R, D, at(a->values[s], (int)m[2], b * m[6] + j * m[7]),
                             (int)m[2], m[8], L, acc, row);
        offset += L;
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t q = 0; q < Q; q++)
            store_row(acc + (g * Q + q) * D, a->q_dtype, D,
                      (char *)a->out + (((b * a->Hq + j * G + g) * Q + q) * D) * (a->q_dtype == BF16 ? 2 : 4));
}

/* the smallest read (multiply-adds of the scores) that is split over threads */
static const int64_t mass_min_parallel = 65536;

/* Softmax attention with attention mass over the concatenation of n_seg segments (every slot
 * visible), the contract of confkv.attention.mass_read.mass_read:
 *   query  [B, Hq, Q, D] (strides q_sb, q_sh, q_sq), Hq = Hkv * G
 *   keys[s], values[s]  [B, Hkv, L_s, D]; meta[9 s ..] = L_s, key dtype, value dtype, key strides
 *          (b, h, l), value strides (b, h, l)
 *   out    [B, Hq, Q, D] contiguous, in q_dtype
 *   mass[s] [B, Hkv, L_s] float32 contiguous: the softmax probability of each slot averaged over
 *          the G query heads of its KV head, summed over the Q queries.
 * Scores, softmax and the weighted sum in float32. The B * Hkv (sequence, KV head) pairs are independent:
 * on up to `threads` threads (the GEMV's pool) when the read is big enough, each pair computed exactly as
 * alone. Returns 0, or 1 when out of memory. */
int confkv_mass_read(const void *query, int q_dtype, int64_t q_sb, int64_t q_sh, int64_t q_sq,
                     int64_t B, int64_t Hq, int64_t Q, int64_t D, int64_t Hkv, int n_seg,
                     const void *const *keys, const void *const *values, const int64_t *meta, float scaling,
                     void *out, float *const *mass, int threads) {
    mass_args a = {query, q_dtype, q_sb, q_sh, q_sq, Hq, Q, D, Hkv, Hq / Hkv, (Hq / Hkv) * Q, 0, n_seg, keys, values,
                   meta, scaling, out, mass, NULL, 0, 0, NULL, NULL, NULL, NULL};
    return mass_read_run(&a, B, threads);
}

/* runs the B * Hkv pairs of `a` (a.total set by the caller or here) on up to `threads` threads; 0 or 1 (out of memory) */
static int mass_read_run(mass_args *a_in, int64_t B, int threads) {
    mass_args a = *a_in;
    a.total = 0;
    for (int s = 0; s < a.n_seg; s++) a.total += a.meta[9 * s];
    const int64_t units = B * a.Hkv, D = a.D;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int parallel = threads >= 2 && units >= 2 && units * a.R * a.total * D >= mass_min_parallel;
    a.scratch_stride = parallel ? mass_scratch(&a) : 0;
    a.scratch = malloc(sizeof(float) * (size_t)(parallel ? units * a.scratch_stride : mass_scratch(&a)));
    if (!a.scratch) return 1;
    if (!parallel || pool_run(mass_read_unit, &a, units, threads))
        for (int64_t unit = 0; unit < units; unit++) mass_read_unit(&a, unit);
    free(a.scratch);
    return 0;
}

enum { MAX_STATS = 8 };

/* One layer's FP window buffer and older region, fixed between two changes of either (see
 * confkv/native/decode.py, which mirrors this struct and rebuilds it when the store replaces one). */
typedef struct {
    int64_t B, Hkv, Hq, D, capacity;
    int kv_dtype;
    void *window_keys, *window_values; /* [B, Hkv, C, D] contiguous */
    int64_t *window_positions;         /* [B, Hkv, C] */
    uint8_t *window_valid;             /* [B, C] bool */
    const void *old_keys, *old_values; /* [B, Hkv, L_old, D] with the strides below */
    int64_t old_length, old_key_strides[3], old_value_strides[3];
    int n_stats;                       /* the regions' statistics (the new slot's are zeroed) */
    int linear;                        /* 1: stat = stat * scale + mass * gain here; 0: the masses go out */
    float *window_stats[MAX_STATS];    /* [B, Hkv, C] float32 contiguous */
    float *old_stats[MAX_STATS];       /* [B, Hkv, L_old] float32 contiguous */
    float stat_scale[MAX_STATS], stat_gain[MAX_STATS];
} decode_plan;

/* LayerStore.decode_step's in-place path in one call. Writes one new token per sequence into slot
 * `length` (< capacity) of the window: key / value [B, Hkv, 1, D] (strides k_sb, k_sh / v_sb, v_sh, the
 * plan's dtype), position[b] int64, valid, zero statistics. Then the mass read of query [B, Hq, 1, D]
 * (dtype q_dtype, strides q_sb, q_sh) over the old region's L_old slots and the window's length + 1
 * (confkv_mass_read's contract) into out [B, Hq, 1, D] contiguous; then, when the plan is linear,
 * stat = stat * scale + mass * gain for each statistic (the policy's observe, float32), else the masses go
 * to mass_old [B, Hkv, L_old] and mass_window [B, Hkv, length + 1] float32. Returns 0, 1 when out of memory,
 * 2 when `length` is outside the window. */
int confkv_decode_step(const decode_plan *p, const void *query, int q_dtype, int64_t q_sb, int64_t q_sh,
                       const void *key, int64_t k_sb, int64_t k_sh, const void *value, int64_t v_sb, int64_t v_sh,
                       const int64_t *position, int64_t length, float scaling, void *out, float *mass_old,
                       float *mass_window, int threads) {
    if (length < 0 || length >= p->capacity || p->n_stats < 0 || p->n_stats > MAX_STATS) return 2;
    const int64_t B = p->B, H = p->Hkv, D = p->D, C = p->capacity, bytes = p->kv_dtype == BF16 ? 2 : 4;
    for (int64_t b = 0; b < B; b++) {
        p->window_valid[b * C + length] = 1;
        for (int64_t j = 0; j < H; j++) {
            const int64_t slot = (b * H + j) * C + length;
            memcpy((char *)p->window_keys + slot * D * bytes, (const char *)key + (b * k_sb + j * k_sh) * bytes,
                   (size_t)(D * bytes));
            memcpy((char *)p->window_values + slot * D * bytes,
                   (const char *)value + (b * v_sb + j * v_sh) * bytes, (size_t)(D * bytes));
            p->window_positions[slot] = position[b];
            for (int k = 0; k < p->n_stats; k++) p->window_stats[k][slot] = 0.0f;
        }
    }
    const int64_t meta[18] = {p->old_length, p->kv_dtype, p->kv_dtype, p->old_key_strides[0], p->old_key_strides[1],
                              p->old_key_strides[2], p->old_value_strides[0], p->old_value_strides[1],
                              p->old_value_strides[2],
                              length + 1, p->kv_dtype, p->kv_dtype, H * C * D, C * D, D, H * C * D, C * D, D};
    const void *keys[2] = {p->old_keys, p->window_keys}, *values[2] = {p->old_values, p->window_values};
    float *stats[2 * MAX_STATS];
    for (int k = 0; k < p->n_stats; k++) {
        stats[k] = p->old_stats[k];
        stats[p->n_stats + k] = p->window_stats[k];
    }
    const int64_t stat_rows[2] = {p->old_length, C};
    float *scratch_mass = NULL;
    if (p->linear) { /* the masses only feed the statistics: scratch rows */
        scratch_mass = malloc(sizeof(float) * (size_t)(B * H * (p->old_length + length + 1)));
        if (!scratch_mass) return 1;
        mass_old = scratch_mass;
        mass_window = scratch_mass + B * H * p->old_length;
    }
    float *mass[2] = {mass_old, mass_window};
    mass_args a = {query, q_dtype, q_sb, q_sh, 0, p->Hq, 1, D, H, p->Hq / H, p->Hq / H, 0, 2, keys, values, meta,
                   scaling, out, mass, NULL, 0, p->linear ? p->n_stats : 0, stats, stat_rows, p->stat_scale,
                   p->stat_gain};
    const int status = mass_read_run(&a, B, threads);
    free(scratch_mass);
    return status;
}

/* The terms of confkv.confidence for each row of logits [B, V] (dtype, rows `row_stride` elements apart),
 * on the temperature-1 distribution, float32: out[3 b ..] = entropy H, log p1, log p2 (the two largest
 * log-probabilities; log p2 = log p1 when V = 1). One pass for the top two, one for
 * Z = sum exp(x - top) and S = sum exp(x - top) (x - top); H = log Z - S / Z. Returns 1 (nothing
 * written for that row and after) at the first row holding a NaN or an infinity: the caller's torch code
 * handles those rows. */
int confkv_confidence_terms(const void *logits, int dtype, int64_t B, int64_t V, int64_t row_stride, float *out) {
    float *row = malloc(sizeof(float) * (size_t)V);
    if (!row) return 2;
    for (int64_t b = 0; b < B; b++) {
        load_row(at(logits, dtype, b * row_stride), dtype, V, row);
        float top = -INFINITY, second = -INFINITY;
        int finite = 1;
        for (int64_t v = 0; v < V; v++) {
            const float x = row[v];
            finite &= isfinite(x) != 0;
            if (x > top) {
                second = top;
                top = x;
            } else if (x > second) {
                second = x;
            }
        }
        if (!finite) {
            free(row);
            return 1;
        }
        float z = 0.0f, s = 0.0f;
#pragma omp simd reduction(+ : z, s)
        for (int64_t v = 0; v < V; v++) {
            const float d = row[v] - top, e = exp_nonpositive(d);
            z += e;
            s += e * d;
        }
        const float log_z = logf(z);
        out[3 * b] = log_z - s / z;
        out[3 * b + 1] = -log_z;
        out[3 * b + 2] = V > 1 ? second - top - log_z : -log_z;
    }
    free(row);
    return 0;
}

/* The float32 sum of a[0..n) in the order of torch's CPU sum over a contiguous last dimension
 * (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum -> vectorized_inner_sum): `lanes`-wide
 * vectors V_0.. of a, four interleaved vector accumulators (acc_k sums V_{4i+k}) cascaded over
 * levels of 2^p steps, the leftover vectors into acc_0, then acc_0 + acc_1 + acc_2 + acc_3, then
 * the scalar tail and the lanes added one by one (rows shorter than a vector: the same with
 * lanes = 1). Reproducing it makes the RMSNorm's mean, and so
 * its bfloat16 output, bit-identical to torch's; loader-side calibration checks `lanes` against
 * torch at run time (0: a plain double-precision sum, no claim of bit equality). */
static float torch_order_sum(const float *a, int64_t n, int lanes) {
    if (lanes <= 0 || lanes > 16) {
        double s = 0.0;
        for (int64_t i = 0; i < n; i++) s += a[i];
        return (float)s;
    }
    if (n < lanes) lanes = 1; /* torch's scalar inner sum: the same cascade on single floats */
    enum { LEVELS = 4, ILP = 4 };
    const int64_t vectors = n / lanes, size = vectors / ILP;
    int64_t log2 = 0;
    while ((INT64_C(1) << log2) < size) log2++;
    const int64_t power = log2 / LEVELS > 4 ? log2 / LEVELS : 4, step = INT64_C(1) << power, mask = step - 1;
    float acc[LEVELS][ILP][16] = {{{0}}};
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) acc[0][k][l] += a[((i * ILP) + k) * lanes + l];
        for (int level = 1; level < LEVELS; level++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (level * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += a[((i * ILP) + k) * lanes + l];
    for (int level = 1; level < LEVELS; level++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = size * ILP; v < vectors; v++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += a[v * lanes + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < n; t++) total += a[t];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* torch_order_sum of a[0..n), exported for the loader's calibration against torch.sum */
float confkv_torch_order_sum(const float *a, int64_t n, int lanes) {
    return torch_order_sum(a, n, lanes);
}

/* LlamaRMSNorm (transformers): h = x.float(); y = (h * rsqrt(mean(h^2) + eps)).to(x.dtype);
 * out = weight * y, in out_dtype (float32 if x or weight is, else bfloat16). mean = sum / n with
 * the sum in torch's order (`lanes`, see torch_order_sum).
 *   x [rows, n] (row stride x_sr), weight [n], out [rows, n] contiguous. */
void confkv_rms_norm(const void *x, int x_dtype, int64_t x_sr, const void *weight, int w_dtype, void *out,
                     int out_dtype, int64_t rows, int64_t n, float eps, int lanes) {
    float *squares = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!squares) return; /* the caller's n is a hidden size: never fails in practice */
    for (int64_t i = 0; i < rows; i++) {
        const void *src = at(x, x_dtype, i * x_sr);
        for (int64_t d = 0; d < n; d++) {
            const float h = x_dtype == F32 ? ((const float *)src)[d] : bf16_to_f32(((const uint16_t *)src)[d]);
            squares[d] = h * h;
        }
        const float inv = 1.0f / sqrtf(torch_order_sum(squares, n, lanes) / (float)n + eps);
        for (int64_t d = 0; d < n; d++) {
            const float h = x_dtype == F32 ? ((const float *)src)[d] : bf16_to_f32(((const uint16_t *)src)[d]);
            const float w = w_dtype == F32 ? ((const float *)weight)[d] : bf16_to_f32(((const uint16_t *)weight)[d]);
            const float y = w * round_to(h * inv, x_dtype);
            if (out_dtype == F32) ((float *)out)[i * n + d] = y;
            else ((uint16_t *)out)[i * n + d] = f32_to_bf16(y);
        }
    }
    free(squares);
}

/* Rotary embedding x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]), every
 * product and the sum rounded to `dtype` as torch does for elementwise ops of that dtype.
 *   x [B, Q, H, D] (strides x_sb, x_sq, x_sh), cos and sin [B, Q, D] (strides c_sb, c_sq),
 *   out [B, Q, H, D] contiguous; x, cos, sin and out all of `dtype`. */
void confkv_rotary(const void *x, int64_t x_sb, int64_t x_sq, int64_t x_sh, const void *cos, const void *sin,
                   int64_t c_sb, int64_t c_sq, int dtype, void *out, int64_t B, int64_t Q, int64_t H, int64_t D) {
    const int64_t half = D / 2;
    float c[D > 0 ? D : 1], s[D > 0 ? D : 1], v[D > 0 ? D : 1], o[D > 0 ? D : 1];
    for (int64_t b = 0; b < B; b++) {
        for (int64_t q = 0; q < Q; q++) {
            load_row(at(cos, dtype, b * c_sb + q * c_sq), dtype, D, c);
            load_row(at(sin, dtype, b * c_sb + q * c_sq), dtype, D, s);
            for (int64_t h = 0; h < H; h++) {
                load_row(at(x, dtype, b * x_sb + q * x_sq + h * x_sh), dtype, D, v);
                for (int64_t d = 0; d < D; d++) {
                    const float rotated = d < half ? -v[d + half] : v[d - half];
                    o[d] = round_to(round_to(v[d] * c[d], dtype) + round_to(rotated * s[d], dtype), dtype);
                }
                store_row(o, dtype, D, (char *)out + ((b * Q + q) * H + h) * D * (dtype == BF16 ? 2 : 4));
            }
        }
    }
}

/* ======================= INT8 weight x float activation GEMV (decode projections) =======================
 * out[m, n] = round(sum_k x[m, k] * w[n, k] * scale[n]) (+ bias[n], rounded again), the contract of
 * torch._weight_int8pack_mm (weight-only INT8, per-output-channel scale; the "W8A16" scheme of
 * LLM.int8()'s weight path) followed by `out + bias`: products and sums in float32, the scale applied
 * to the float32 sum, one rounding to the output dtype. Decode has M = 1..4 activation rows, so the
 * step reads every weight once: the kernel streams w and keeps x (widened to float32) in L1. */

/* one call's operands:
 *   xf [M, Kp] float32: the activations widened, each row zero-padded to Kp = K rounded up to 16
 *   w [N, K] int8 row-major; scale [N] (dtype sd); bias [N] (dtype bd) or NULL; out [M, N] contiguous (od) */
typedef struct {
    const float *xf;
    int64_t M, K, Kp, N;
    const int8_t *w;
    const void *scale, *bias;
    int sd, bd, od;
    void *out;
    /* W8A8 (xq != NULL): the activations quantised by quantize_acts, the product in integers (see there) */
    const int8_t *xq;
    const float *xs;
    const int32_t *xcorr;
    int64_t Kq;
} gemv_args;

static inline float value_at(const void *p, int dtype, int64_t i) {
    return dtype == F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* out[m, n] from the float32 dot product `acc`: times the scale, rounded to od, plus the bias rounded again
 * (torch's `_weight_int8pack_mm(...) + bias`) */
static inline void gemv_store(const gemv_args *a, int64_t m, int64_t n, float acc) {
    float y = round_to(acc * value_at(a->scale, a->sd, n), a->od);
    if (a->bias) y = y + value_at(a->bias, a->bd, n);
    if (a->od == F32) ((float *)a->out)[m * a->N + n] = y;
    else ((uint16_t *)a->out)[m * a->N + n] = f32_to_bf16(y);
}

/* the portable loop: output rows [n0, n1) of all M activation rows (any M) */
static __attribute__((unused)) void gemv_rows_c(const gemv_args *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = a->w + n * a->K;
        for (int64_t m = 0; m < a->M; m++) {
            const float *x = a->xf + m * a->Kp;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < a->K; k++) s = fmaf(x[k], (float)w[k], s);
            gemv_store(a, m, n, s);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CONFKV_GEMV_AVX512 1
/* 16 int8 weights widened to float32 (exact); `mask` keeps the first lanes of a row's tail, the rest read as 0 */
static inline __m512 weights16(const int8_t *p, __mmask16 mask) {
    const __m128i bytes = mask == 0xFFFF ? _mm_loadu_si128((const __m128i *)p) : _mm_maskz_loadu_epi8(mask, p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

/* output rows [n, n + NB) for activation rows [0, M), M <= 4, NB <= 8 (both constants where inlined):
 * M * NB accumulators in registers, each weight vector widened once and used by the M rows */
static inline __attribute__((always_inline)) void gemv_block_avx512(const gemv_args *a, int64_t n, const int M,
                                                                    const int NB) {
    __m512 acc[4][8];
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    const int64_t K = a->K, Kp = a->Kp, full = K & ~(int64_t)15;
    const int8_t *w = a->w + n * K;
    /* the rows two blocks ahead (NB * K bytes, contiguous) are prefetched NB / 4 lines per 16 columns:
     * a block's 8 short rows at a stride of K bytes are no stream the hardware prefetcher follows well
     * (a decode step's 211 projections at 1 thread on a loaded machine: 15 ms with it, 22 ms without;
     * benchmarks/native_micro.py --kernels sweep) */
    const char *next = (const char *)(w + 2 * NB * K);
    const int ahead = NB >= 4 ? NB / 4 : 1;
    for (int64_t k = 0; k < Kp; k += 16) {
        for (int p = 0; p < ahead; p++) _mm_prefetch(next + ((k / 16) * ahead + p) * 64, _MM_HINT_T0);
        const __mmask16 mask = k < full ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - full)) - 1u);
        __m512 x[4];
        for (int m = 0; m < M; m++) x[m] = _mm512_loadu_ps(a->xf + m * Kp + k);
        for (int b = 0; b < NB; b++) {
            const __m512 wv = weights16(w + b * K + k, mask);
            for (int m = 0; m < M; m++) acc[m][b] = _mm512_fmadd_ps(x[m], wv, acc[m][b]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) gemv_store(a, m, n + b, _mm512_reduce_add_ps(acc[m][b]));
}

/* rows [n0, n1) for M <= 4: blocks of 8 output rows (M <= 2: 8-16 independent FMA chains) or 4 (M = 3, 4) */
static void gemv_rows_avx512(const gemv_args *a, int64_t n0, int64_t n1) {
    const int M = (int)a->M, nb = M <= 2 ? 8 : 4;
    int64_t n = n0;
    for (; n + nb <= n1; n += nb) {
        switch (M) {
        case 1: gemv_block_avx512(a, n, 1, 8); break;
        case 2: gemv_block_avx512(a, n, 2, 8); break;
        case 3: gemv_block_avx512(a, n, 3, 4); break;
        default: gemv_block_avx512(a, n, 4, 4); break;
        }
    }
    for (; n < n1; n++) {
        switch (M) {
        case 1: gemv_block_avx512(a, n, 1, 1); break;
        case 2: gemv_block_avx512(a, n, 2, 1); break;
        case 3: gemv_block_avx512(a, n, 3, 1); break;
        default: gemv_block_avx512(a, n, 4, 1); break;
        }
    }
}
#endif

/* output rows [n0, n1) of every activation row, in groups of up to 4 activation rows */
/* W8A8: blocks of ACT_BLOCK activations share one scale; rows of the quantised activations are padded
 * to a multiple of 64 (one AVX-512 VNNI step) */
enum { ACT_BLOCK = 32, ACT_STEP = 64 };

/* the portable W8A8 loop: out[m, n] = scale[n] * (sum over blocks b of xscale_b * sum_{k in b} q_k w_k), the
 * integer sums exact, the blocks added in order in float32 */
static __attribute__((unused)) void gemv_rows_a8_c(const gemv_args *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *w = a->w + n * a->K;
        for (int64_t m = 0; m < a->M; m++) {
            const int8_t *q = a->xq + m * a->Kq;
            const float *xs = a->xs + m * (a->Kq / ACT_STEP) * 16;
            float s = 0.0f;
            for (int64_t b0 = 0; b0 < a->K; b0 += ACT_BLOCK) {
                int32_t dot = 0;
                const int64_t b1 = b0 + ACT_BLOCK < a->K ? b0 + ACT_BLOCK : a->K;
                for (int64_t k = b0; k < b1; k++) dot += (int32_t)q[k] * (int32_t)w[k];
                s = fmaf((float)dot, xs[(b0 / ACT_STEP) * 16 + ((b0 % ACT_STEP) / ACT_BLOCK) * 8], s);
            }
            gemv_store(a, m, n, s);
        }
    }
}

#if defined(CONFKV_GEMV_AVX512) && defined(__AVX512VNNI__)
#define CONFKV_GEMV_VNNI 1
/* output rows [n, n + NB) for the M <= 4 quantised activation rows: per 64 columns, each weight vector has
 * its sign bit flipped (w + 128, unsigned) and vpdpbusd sums four byte products per lane (exact in int32);
 * lanes 0-7 hold one block of 32, lanes 8-15 the next, so one multiply-add by the blocks' scales moves
 * them into the float32 accumulators. Each lane's sum starts at -128 times its four activations (xcorr), so
 * that the flip's 128 * sum(q) cancels in integers and every block's sum is exact. */
static inline __attribute__((always_inline)) void gemv_block_vnni(const gemv_args *a, int64_t n, const int M,
                                                                  const int NB) {
    __m512 acc[4][8];
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    const int64_t K = a->K, Kq = a->Kq, steps = Kq / ACT_STEP;
    const int8_t *w = a->w + n * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const char *next = (const char *)(w + 2 * NB * K);
    const int ahead = NB >= 4 ? NB / 4 : 1;
    for (int64_t j = 0; j < steps; j++) {
        const int64_t k = j * ACT_STEP;
        for (int p = 0; p < ahead * 4; p++) _mm_prefetch(next + (j * ahead * 4 + p) * 64, _MM_HINT_T0);
        const __mmask64 mask = k + ACT_STEP <= K ? ~(__mmask64)0 : (((__mmask64)1 << (K - k)) - 1);
        __m512i x[4], start[4];
        __m512 scale[4];
        for (int m = 0; m < M; m++) {
            x[m] = _mm512_loadu_si512((const void *)(a->xq + m * Kq + k));
            start[m] = _mm512_loadu_si512((const void *)(a->xcorr + (m * steps + j) * 16));
            scale[m] = _mm512_loadu_ps(a->xs + (m * steps + j) * 16);
        }
        for (int b = 0; b < NB; b++) {
            const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + b * K + k), flip);
            for (int m = 0; m < M; m++)
                acc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start[m], wv, x[m])), scale[m],
                                            acc[m][b]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) gemv_store(a, m, n + b, _mm512_reduce_add_ps(acc[m][b]));
}

static void gemv_rows_vnni(const gemv_args *a, int64_t n0, int64_t n1) {
    const int M = (int)a->M, nb = M <= 2 ? 8 : 4;
    int64_t n = n0;
    for (; n + nb <= n1; n += nb) {
        switch (M) {
        case 1: gemv_block_vnni(a, n, 1, 8); break;
        case 2: gemv_block_vnni(a, n, 2, 8); break;
        case 3: gemv_block_vnni(a, n, 3, 4); break;
        default: gemv_block_vnni(a, n, 4, 4); break;
        }
    }
    for (; n < n1; n++) {
        switch (M) {
        case 1: gemv_block_vnni(a, n, 1, 1); break;
        case 2: gemv_block_vnni(a, n, 2, 1); break;
        case 3: gemv_block_vnni(a, n, 3, 1); break;
        default: gemv_block_vnni(a, n, 4, 1); break;
        }
    }
}
#endif

static void gemv_rows(const gemv_args *a, int64_t n0, int64_t n1) {
    if (a->xq) {
#ifdef CONFKV_GEMV_VNNI
        const int64_t out_bytes = a->od == BF16 ? 2 : 4;
        for (int64_t m0 = 0; m0 < a->M; m0 += 4) {
            gemv_args part = *a;
            part.M = a->M - m0 < 4 ? a->M - m0 : 4;
            part.xq = a->xq + m0 * a->Kq;
            part.xs = a->xs + m0 * (a->Kq / ACT_STEP) * 16;
            part.xcorr = a->xcorr + m0 * (a->Kq / ACT_STEP) * 16;
            part.out = (char *)a->out + m0 * a->N * out_bytes;
            gemv_rows_vnni(&part, n0, n1);
        }
#else
        gemv_rows_a8_c(a, n0, n1);
#endif
        return;
    }
#ifdef CONFKV_GEMV_AVX512
    const int64_t out_bytes = a->od == BF16 ? 2 : 4;
    for (int64_t m0 = 0; m0 < a->M; m0 += 4) {
        gemv_args part = *a;
        part.M = a->M - m0 < 4 ? a->M - m0 : 4;
        part.xf = a->xf + m0 * a->Kp;
        part.out = (char *)a->out + m0 * a->N * out_bytes;
        gemv_rows_avx512(&part, n0, n1);
    }
#else
    gemv_rows_c(a, n0, n1);
#endif
}

/* ---- the worker pool: threads created once, woken per call, rows handed out in chunks ----
 * A call cuts the output rows into chunks; the caller and the workers claim them one at a time from
 * `ticket` (generation << 32 | next chunk), so a worker that wakes late (a loaded machine, a sleeping
 * worker) takes fewer chunks instead of holding the caller up: the caller waits only for chunks that a
 * worker has claimed. A worker spins (pause) for up to `spin_ns` after its last call, then sleeps on a
 * condition variable; the caller bumps `generation` and signals only when some worker sleeps
 * (Dekker-style: both sides use sequentially consistent atomics, and the sleeper re-checks the
 * generation under the mutex). fork(): the child starts with no workers (pthread_atfork) and creates
 * them again on its first call. A second thread calling while the pool is busy computes alone. */

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int workers;           /* started; only the caller that holds `busy` creates more */
    int busy;              /* a call owns the pool */
    int sleepers;          /* workers waiting on `wake` */
    uint64_t generation;   /* bumped once per parallel call */
    uint64_t born;         /* the generation when the newest worker was created: its first wait starts there */
    uint64_t ticket;       /* (generation & 0xFFFFFFFF) << 32 | the next unclaimed chunk */
    int64_t done;          /* chunks finished in the current generation */
    int64_t spin_ns;       /* how long an idle worker spins before it sleeps */
    int64_t chunks;        /* of the current call */
    void (*task)(const void *ctx, int64_t chunk); /* computes one chunk of the current call */
    const void *ctx;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .spin_ns = 50000};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#define LOAD(p) __atomic_load_n(p, __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n(p, v, __ATOMIC_SEQ_CST)

static void pool_after_fork_in_child(void) {
    /* the parent's workers do not exist here; the lock may have been held by one of them */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = pool.busy = pool.sleepers = 0;
}

static void pool_register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

/* the next chunk of generation `generation` into *index; 0 when that generation has none left (or is over) */
static int pool_claim(uint64_t generation, int64_t *index) {
    uint64_t ticket = LOAD(&pool.ticket);
    for (;;) {
        if ((ticket >> 32) != (generation & 0xFFFFFFFFu) || (int64_t)(ticket & 0xFFFFFFFFu) >= LOAD(&pool.chunks)) return 0;
        if (__atomic_compare_exchange_n(&pool.ticket, &ticket, ticket + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            *index = (int64_t)(ticket & 0xFFFFFFFFu);
            return 1;
        }
    }
}

/* claim and compute chunks of `generation` until none is left */
static void pool_work(uint64_t generation) {
    int64_t index;
    while (pool_claim(generation, &index)) {
        pool.task(pool.ctx, index);
        __atomic_add_fetch(&pool.done, 1, __ATOMIC_SEQ_CST);
    }
}

/* a worker's whole life: wait for a generation, take chunks, wait again */
static void *pool_worker(void *arg) {
    (void)arg;
    uint64_t seen = LOAD(&pool.born); /* not the generation now: the caller may have bumped it already */
    for (;;) {
        const int64_t start = now_ns(), spin = LOAD(&pool.spin_ns);
        for (unsigned i = 1; LOAD(&pool.generation) == seen; i++) {
            cpu_relax();
            if ((i & 15) == 0 && now_ns() - start >= spin) {
                pthread_mutex_lock(&pool.lock);
                __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                while (LOAD(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        seen = LOAD(&pool.generation);
        pool_work(seen);
    }
    return NULL;
}

/* start workers until there are `wanted`; returns how many run (fewer when pthread_create fails) */
static int pool_grow(int wanted) {
    sigset_t all, saved;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &saved); /* workers never take the process's signals */
    STORE(&pool.born, LOAD(&pool.generation));
    while (pool.workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, pool_worker, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    return pool.workers;
}

/* task(ctx, 0 .. chunks - 1) on the caller and up to threads - 1 workers, each chunk once; 0 when done, 1 when
 * the pool is busy or no worker could start (the caller then computes alone) */
static int pool_run(void (*task)(const void *, int64_t), const void *ctx, int64_t chunks, int threads) {
    int idle = 0;
    if (!__atomic_compare_exchange_n(&pool.busy, &idle, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return 1;
    pthread_once(&pool_once, pool_register_fork_handler);
    if (pool_grow(threads - 1) < 1) {
        STORE(&pool.busy, 0);
        return 1;
    }
    pool.task = task;
    pool.ctx = ctx;
    pool.chunks = chunks;
    STORE(&pool.done, 0);
    const uint64_t generation = LOAD(&pool.generation) + 1;
    STORE(&pool.ticket, (generation & 0xFFFFFFFFu) << 32);
    STORE(&pool.generation, generation);
    if (LOAD(&pool.sleepers)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    pool_work(generation);
    const int64_t start = now_ns();
    for (unsigned i = 1; LOAD(&pool.done) < pool.chunks; i++) { /* chunks a worker claimed and still computes */
        cpu_relax();
        if ((i & 255) == 0 && now_ns() - start > 20000) sched_yield(); /* that worker was descheduled */
    }
    STORE(&pool.busy, 0);
    return 0;
}

/* the smallest product (M * N * K multiply-adds) worth waking a worker for: below it the hand-off
 * (about a microsecond) costs more than the second core saves */
static int64_t gemv_min_parallel = 65536;

/* up to MAX_PARTS products of one call, cut into chunks of output rows for the pool */
typedef struct {
    int parts;
    int64_t part_start[MAX_PARTS + 1], part_rows[MAX_PARTS]; /* a part's first chunk; its rows per chunk */
    gemv_args job[MAX_PARTS];
} gemv_job;

static void gemv_chunk(const void *ctx, int64_t index) {
    const gemv_job *j = (const gemv_job *)ctx;
    int p = 0;
    while (index >= j->part_start[p + 1]) p++;
    const int64_t n0 = (index - j->part_start[p]) * j->part_rows[p], end = n0 + j->part_rows[p];
    gemv_rows(&j->job[p], n0, end < j->job[p].N ? end : j->job[p].N);
}

/* the products a[0..parts) (parts <= MAX_PARTS, e.g. the q, k and v projections of one input) on up to
 * `threads` threads: in parallel when they are big enough together, else one after another on the caller */
static void gemv_many(const gemv_args *a, int parts, int threads) {
    int64_t work = 0, rows = 0;
    for (int p = 0; p < parts; p++) {
        work += a[p].M * a[p].N * a[p].K;
        rows += a[p].N;
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads >= 2 && work >= gemv_min_parallel && rows >= 16) {
        /* each part in about 2 chunks per thread, whole 8-row blocks, at least 16 rows: long contiguous
         * runs of weight rows for the prefetchers (a decode step's fused layers at 2 threads, interleaved
         * A/B runs of benchmarks/native_layer_loop.py, both interleaved: 4.7-7.9 ms against 7.0-11 ms with 8 chunks per thread) */
        gemv_job job = {.parts = parts};
        for (int p = 0; p < parts; p++) {
            int64_t chunk = (a[p].N + 2 * threads - 1) / (2 * threads);
            chunk = chunk < 16 ? 16 : (chunk + 7) & ~(int64_t)7;
            job.job[p] = a[p];
            job.part_rows[p] = chunk;
            job.part_start[p + 1] = job.part_start[p] + (a[p].N + chunk - 1) / chunk;
        }
        if (!pool_run(gemv_chunk, &job, job.part_start[parts], threads)) return;
    }
    for (int p = 0; p < parts; p++) gemv_rows(&a[p], 0, a[p].N);
}

/* rows [M, K] of x (xd, rows x_sr elements apart) widened to float32, each zero-padded to *Kp = K rounded up
 * to 16; NULL when out of memory */
static float *widen_rows(const void *x, int xd, int64_t x_sr, int64_t M, int64_t K, int64_t *Kp) {
    *Kp = (K + 15) & ~(int64_t)15;
    float *xf = malloc(sizeof(float) * (size_t)(M * *Kp > 0 ? M * *Kp : 1));
    if (!xf) return NULL;
    for (int64_t m = 0; m < M; m++) {
        load_row(at(x, xd, m * x_sr), xd, K, xf + m * *Kp);
        for (int64_t k = K; k < *Kp; k++) xf[m * *Kp + k] = 0.0f;
    }
    return xf;
}

/* The W8A8 activations of rows xf [M, K] (float32, rows Kp apart), in one buffer: per row, each block of
 * ACT_BLOCK values quantised to int8 with the scale s = max|x| / 127 (q = x / s rounded half to even, as
 * torch.round; an all-zero block: s = 0, q = 0), the row zero-padded to Kq = K rounded up to 64; the scales
 * of blocks 2j and 2j + 1 repeated over lanes 0-7 and 8-15 of xs[m, j, 0..16); xcorr[m, j, lane] = -128 times
 * the sum of the lane's four activations (the VNNI GEMV's unsigned weights add it back). Sets a->xq, xs,
 * xcorr, Kq; returns the buffer to free, or NULL when out of memory. */
static void *quantize_acts(gemv_args *a, int64_t M) {
    const int64_t K = a->K, Kq = (K + ACT_STEP - 1) / ACT_STEP * ACT_STEP, steps = Kq / ACT_STEP;
    char *buffer = malloc((size_t)(M * Kq + 64) + sizeof(float) * (size_t)(M * steps * 16 * 2));
    if (!buffer) return NULL;
    int8_t *q = (int8_t *)buffer;
    float *xs = (float *)(buffer + ((M * Kq + 63) / 64) * 64);
    int32_t *corr = (int32_t *)(xs + M * steps * 16);
    for (int64_t m = 0; m < M; m++) {
        const float *x = a->xf + m * a->Kp;
        for (int64_t b0 = 0; b0 < Kq; b0 += ACT_BLOCK) {
            const int64_t b1 = b0 + ACT_BLOCK < K ? b0 + ACT_BLOCK : K;
            float top = 0.0f;
            for (int64_t k = b0; k < b1; k++) top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
            const float scale = top / 127.0f;
            for (int64_t k = b0; k < b0 + ACT_BLOCK; k++)
                q[m * Kq + k] = (int8_t)(k < b1 && scale > 0.0f ? (int32_t)nearbyintf(x[k] / scale) : 0);
            const int64_t j = b0 / ACT_STEP, half = (b0 % ACT_STEP) / ACT_BLOCK;
            for (int lane = 0; lane < 8; lane++) xs[(m * steps + j) * 16 + half * 8 + lane] = scale;
        }
        for (int64_t i = 0; i < steps * 16; i++) { /* lane i % 16 of step i / 16 sums activations 4i .. 4i + 3 */
            const int8_t *four = q + m * Kq + 4 * i;
            corr[m * steps * 16 + i] = -128 * ((int32_t)four[0] + four[1] + four[2] + four[3]);
        }
    }
    a->xq = q;
    a->xs = xs;
    a->xcorr = corr;
    a->Kq = Kq;
    return buffer;
}

/* out [M, N] (contiguous, od) = x [M, K] (rows x_sr elements apart, xd) times w [N, K] int8 with the
 * per-row scale [N] (sd) and optional bias [N] (bd, NULL for none), on up to `threads` threads.
 * Returns 0, or 1 when out of memory. */
static int int8_gemv(const void *x, int xd, int64_t x_sr, int64_t M, int64_t K, const int8_t *w, int64_t N,
                     const void *scale, int sd, const void *bias, int bd, void *out, int od, int a8, int threads) {
    int64_t Kp;
    float *xf = widen_rows(x, xd, x_sr, M, K, &Kp);
    if (!xf) return 1;
    gemv_args a = {xf, M, K, Kp, N, w, scale, bias, sd, bd, od, out, NULL, NULL, NULL, 0};
    void *acts = a8 ? quantize_acts(&a, M) : NULL;
    if (a8 && !acts) {
        free(xf);
        return 1;
    }
    gemv_many(&a, 1, threads);
    free(acts);
    free(xf);
    return 0;
}

int confkv_int8_gemv(const void *x, int xd, int64_t x_sr, int64_t M, int64_t K, const int8_t *w, int64_t N,
                     const void *scale, int sd, const void *bias, int bd, void *out, int od, int threads) {
    return int8_gemv(x, xd, x_sr, M, K, w, N, scale, sd, bias, bd, out, od, 0, threads);
}

/* confkv_int8_gemv with the weight's operands prepared once (fewer arguments through ctypes per call):
 * plan = {w, N, K, scale, sd, bias (0: none), bd, activations (0: float, W8A16; 8: int8 blocks, W8A8)} as int64 */
int confkv_int8_linear(const int64_t *plan, const void *x, int xd, int64_t x_sr, int64_t M, void *out, int threads) {
    return int8_gemv(x, xd, x_sr, M, plan[2], (const int8_t *)(intptr_t)plan[0], plan[1], (const void *)(intptr_t)plan[3],
                     (int)plan[4], (const void *)(intptr_t)plan[5], (int)plan[6], out, xd, plan[7] == 8, threads);
}

/* settings (benchmarks, tests): the idle workers' spin before they sleep (ns; < 0 keeps it) and the
 * smallest product run in parallel (< 0 keeps it); returns the number of workers now running */
int confkv_gemv_configure(int64_t spin_ns, int64_t min_parallel) {
    if (spin_ns >= 0) STORE(&pool.spin_ns, spin_ns);
    if (min_parallel >= 0) gemv_min_parallel = min_parallel;
    return LOAD(&pool.workers);
}

/* ================= one Llama-family decoder layer around its attention, in two calls (lean decoder) =================
 * The torch lines of confkv/hf/lean.py with weight-only INT8 projections, each step rounded to the activations'
 * dtype `xd` as torch rounds it: RMSNorm (confkv_rms_norm), the projections (the GEMV above, several products
 * of one input in one pool call), rotary (confkv_rotary), SiLU and the products and sums of the gated MLP.
 * Plans are confkv_int8_linear's {w, N, K, scale, sd, bias, bd, activations}; every tensor is contiguous. */

static gemv_args plan_args(const int64_t *plan, const float *xf, int64_t M, int64_t Kp, void *out, int od) {
    const gemv_args a = {xf, M, plan[2], Kp, plan[1], (const int8_t *)(intptr_t)plan[0], (const void *)(intptr_t)plan[3],
                         (const void *)(intptr_t)plan[5], (int)plan[4], (int)plan[6], od, out, NULL, NULL, NULL, 0};
    return a;
}

/* the products of one input `parts` (same K), W8A16 or, when the first plan says so, W8A8 (the activations
 * quantised once for all of them); 0, or 1 when out of memory */
static int gemv_plans(gemv_args *parts, int count, const int64_t *plan, int64_t M, int threads) {
    void *acts = NULL;
    if (plan[7] == 8) {
        if (!(acts = quantize_acts(&parts[0], M))) return 1;
        for (int p = 1; p < count; p++) {
            parts[p].xq = parts[0].xq;
            parts[p].xs = parts[0].xs;
            parts[p].xcorr = parts[0].xcorr;
            parts[p].Kq = parts[0].Kq;
        }
    }
    gemv_many(parts, count, threads);
    free(acts);
    return 0;
}

/* the attention's inputs: n = RMSNorm(x), q = rotary(q_proj(n)), k = rotary(k_proj(n)), v = v_proj(n)
 *   x [B * Q, K] (xd), norm_w [K] (xd), cos and sin [B, Q, D] (strides c_sb, c_sq; xd);
 *   q_out [B, Q, Hq, D], k_out [B, Q, Hkv, D], v_out [B, Q, Hkv, D] (xd). Returns 0, 1 when out of memory. */
int confkv_lean_qkv(const void *x, int xd, int64_t B, int64_t Q, int64_t K, const void *norm_w, float eps, int lanes,
                    const int64_t *plan_q, const int64_t *plan_k, const int64_t *plan_v, const void *cos,
                    const void *sin, int64_t c_sb, int64_t c_sq, int64_t D, void *q_out, void *k_out, void *v_out,
                    int threads) {
    const int64_t M = B * Q, es = xd == BF16 ? 2 : 4, Nq = plan_q[1], Nk = plan_k[1];
    int64_t Kp;
    void *normed = malloc((size_t)(M * K * es)), *q = malloc((size_t)(M * Nq * es)), *k = malloc((size_t)(M * Nk * es));
    float *xf = NULL;
    int status = 1;
    if (!normed || !q || !k) goto done;
    confkv_rms_norm(x, xd, K, norm_w, xd, normed, xd, M, K, eps, lanes);
    if (!(xf = widen_rows(normed, xd, K, M, K, &Kp))) goto done;
    gemv_args parts[3] = {plan_args(plan_q, xf, M, Kp, q, xd), plan_args(plan_k, xf, M, Kp, k, xd),
                          plan_args(plan_v, xf, M, Kp, v_out, xd)};
    if (gemv_plans(parts, 3, plan_q, M, threads)) goto done;
    confkv_rotary(q, Q * Nq, Nq, D, cos, sin, c_sb, c_sq, xd, q_out, B, Q, Nq / D, D);
    confkv_rotary(k, Q * Nk, Nk, D, cos, sin, c_sb, c_sq, xd, k_out, B, Q, Nk / D, D);
    status = 0;
done:
    free(normed);
    free(q);
    free(k);
    free(xf);
    return status;
}

/* out = a + b for rows [M, K] of dtype xd, each sum rounded once (torch's add); left and right: K floats each */
static void add_rows(const void *a, const void *b, void *out, int xd, int64_t M, int64_t K, float *left, float *right) {
    for (int64_t m = 0; m < M; m++) {
        load_row(at(a, xd, m * K), xd, K, left);
        load_row(at(b, xd, m * K), xd, K, right);
        for (int64_t d = 0; d < K; d++) left[d] = left[d] + right[d];
        store_row(left, xd, K, (char *)out + m * K * (xd == BF16 ? 2 : 4));
    }
}

/* g[i] = round(round(silu(g[i])) * u[i]) (rounding to xd), silu(x) = x * sigmoid(x) with sigmoid from
 * exp(-|x|) <= 1 (exp_nonpositive, branch-free, so the loop vectorises): within a few float32 ulps of
 * torch's x / (1 + exp(-x)); +-inf and NaN as torch's (NaN for -inf, as -inf / inf there) */
static void silu_times(float *restrict g, const float *restrict u, int64_t n, int xd) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i], e = exp_nonpositive(-fabsf(x));
        const float sigmoid = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        g[i] = round_to(round_to(x * sigmoid, xd) * u[i], xd);
    }
}

/* the layer after its attention read: h = hidden + o_proj(attn); n = RMSNorm(h);
 * out = h + down_proj(silu(gate_proj(n)) * up_proj(n)) (silu_times)
 *   attn [M, A], hidden and out [M, K], norm_w [K], all xd. Returns 0, 1 when out of memory. */
int confkv_lean_mlp(const void *attn, const void *hidden, int xd, int64_t M, int64_t A, int64_t K,
                    const int64_t *plan_o, const void *norm_w, float eps, int lanes, const int64_t *plan_gate,
                    const int64_t *plan_up, const int64_t *plan_down, void *out, int threads) {
    const int64_t es = xd == BF16 ? 2 : 4, I = plan_gate[1];
    int64_t Kp;
    float *xf = NULL, *row = malloc(sizeof(float) * (size_t)((K > I ? K : I) * 2));
    void *h = malloc((size_t)(M * K * es)), *normed = malloc((size_t)(M * K * es));
    void *gate = malloc((size_t)(M * I * es)), *up = malloc((size_t)(M * I * es));
    int status = 1;
    if (!row || !h || !normed || !gate || !up) goto done;
    float *left = row, *right = row + (K > I ? K : I);
    /* h = hidden + o_proj(attn), the sum rounded once */
    if (!(xf = widen_rows(attn, xd, A, M, A, &Kp))) goto done;
    gemv_args o = plan_args(plan_o, xf, M, Kp, normed, xd); /* `normed` holds o_proj's output for now */
    if (gemv_plans(&o, 1, plan_o, M, threads)) goto done;
    add_rows(hidden, normed, h, xd, M, K, left, right);
    free(xf);
    /* the gated MLP */
    confkv_rms_norm(h, xd, K, norm_w, xd, normed, xd, M, K, eps, lanes);
    if (!(xf = widen_rows(normed, xd, K, M, K, &Kp))) goto done;
    gemv_args gate_up[2] = {plan_args(plan_gate, xf, M, Kp, gate, xd), plan_args(plan_up, xf, M, Kp, up, xd)};
    if (gemv_plans(gate_up, 2, plan_gate, M, threads)) goto done;
    for (int64_t m = 0; m < M; m++) { /* silu(gate) * up, each rounded; the product back into `gate` */
        load_row(at(gate, xd, m * I), xd, I, left);
        load_row(at(up, xd, m * I), xd, I, right);
        silu_times(left, right, I, xd);
        store_row(left, xd, I, (char *)gate + m * I * es);
    }
    free(xf);
    if (!(xf = widen_rows(gate, xd, I, M, I, &Kp))) goto done;
    gemv_args down = plan_args(plan_down, xf, M, Kp, normed, xd); /* `normed` now holds down_proj's output */
    if (gemv_plans(&down, 1, plan_down, M, threads)) goto done;
    add_rows(h, normed, out, xd, M, K, left, right);
    status = 0;
done:
    free(xf);
    free(row);
    free(h);
    free(normed);
    free(gate);
    free(up);
    return status;
}
