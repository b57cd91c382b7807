/* The attention read with attention mass (confkv_mass_read); the store's decode step around it is in
 * decode_step.c. Part of kernels.c. */
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
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* The same two loops on 8-lane vectors for CPUs without AVX-512 (D a multiple of 8 up to 256; `nc` = D / 8 a
 * constant where inlined for D = 64 and 128): a key row is loaded once and kept in registers for the R query rows,
 * a value row for `block` rows' sums at a time (the generic loops' dot product reloads and re-sums every row). */
static inline __m256 load8(const char *src, int dtype) {
    if (dtype == F32) return _mm256_loadu_ps((const float *)src);
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline __attribute__((always_inline)) void scores_avx2(
    const float *qf, int64_t R, const int nc, const void *keys, int kd, int64_t ks, int64_t L, float scaling,
    float *scores, int64_t stride) {
    const int64_t bytes = kd == BF16 ? 2 : 4;
    __m256 k[32];
    for (int64_t l = 0; l < L; l++) {
        const char *src = (const char *)keys + l * ks * bytes;
        for (int c = 0; c < nc; c++) k[c] = load8(src + c * 8 * bytes, kd);
        for (int64_t r = 0; r < R; r++) {
            const float *q = qf + r * nc * 8;
            __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(q), k[0]);
            for (int c = 1; c < nc; c++) sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), k[c], sum);
            scores[r * stride + l] = sum_lanes8(sum) * scaling;
        }
    }
}

static inline __attribute__((always_inline)) void weighted_sum_avx2(
    const float *p, int64_t stride, int64_t R, const int nc, const void *values, int vd, int64_t vs, int64_t L,
    float *acc) {
    const int64_t bytes = vd == BF16 ? 2 : 4;
    const int block = nc >= 8 ? 1 : 8 / nc; /* rows per pass over the values: block * nc sums in registers */
    __m256 a[32], v[32];
    for (int64_t r0 = 0; r0 < R; r0 += block) {
        const int rows = R - r0 < block ? (int)(R - r0) : block;
        for (int i = 0; i < block * nc; i++) a[i] = _mm256_setzero_ps();
        for (int64_t l = 0; l < L; l++) {
            const char *src = (const char *)values + l * vs * bytes;
            for (int c = 0; c < nc; c++) v[c] = load8(src + c * 8 * bytes, vd);
            for (int rr = 0; rr < block; rr++) { /* rows past R get weight 0 and are not stored */
                const __m256 w = _mm256_set1_ps(rr < rows ? p[(r0 + rr) * stride + l] : 0.0f);
                for (int c = 0; c < nc; c++) a[rr * nc + c] = _mm256_fmadd_ps(w, v[c], a[rr * nc + c]);
            }
        }
        for (int rr = 0; rr < rows; rr++)
            for (int c = 0; c < nc; c++) {
                float *out = acc + (r0 + rr) * nc * 8 + 8 * c;
                _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), a[rr * nc + c]));
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
#elif defined(__AVX2__) && defined(__FMA__)
    if (D == 64) return scores_avx2(qf, R, 8, keys, kd, ks, L, scaling, scores, stride);
    if (D == 128) return scores_avx2(qf, R, 16, keys, kd, ks, L, scaling, scores, stride);
    if (D % 8 == 0 && D <= 256) return scores_avx2(qf, R, (int)(D / 8), keys, kd, ks, L, scaling, scores, stride);
#endif
    scores_c(qf, R, D, keys, kd, ks, L, scaling, scores, stride, row);
}

static void weighted_sum_segment(const float *p, int64_t stride, int64_t R, int64_t D, const void *values, int vd,
                                 int64_t vs, int64_t L, float *acc, float *row) {
#if defined(__AVX512F__)
    if (D == 64) return weighted_sum_avx512(p, stride, R, 4, values, vd, vs, L, acc);
    if (D == 128) return weighted_sum_avx512(p, stride, R, 8, values, vd, vs, L, acc);
    if (D % 16 == 0 && D <= 256) return weighted_sum_avx512(p, stride, R, (int)(D / 16), values, vd, vs, L, acc);
#elif defined(__AVX2__) && defined(__FMA__)
    if (D == 64) return weighted_sum_avx2(p, stride, R, 8, values, vd, vs, L, acc);
    if (D == 128) return weighted_sum_avx2(p, stride, R, 16, values, vd, vs, L, acc);
    if (D % 8 == 0 && D <= 256) return weighted_sum_avx2(p, stride, R, (int)(D / 8), values, vd, vs, L, acc);
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
