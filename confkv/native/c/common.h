/* Shared by every part of kernels.c (one translation unit): headers, dtype codes, bfloat16 conversion,
 * row loads and stores, the float32 reductions and exp for x <= 0. */
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

#if defined(__AVX__)
#include <immintrin.h>
/* the sum of x's 8 lanes: the two halves added, then the pairs, then the last two (the vector readers' and GEMVs'
 * ending; AVX-512 sums end here after adding their halves) */
static inline float sum_lanes8(__m256 x) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

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
