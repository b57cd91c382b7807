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
    /* W4A8 (wbits == 4, with xq; gemv_w4.c): w holds 4-bit codes [N, K128 / 2] (K128: K rounded up to 128),
     * scale [N, K128 / 32] float16 block scales, wmin [N, K128 / 32] float16 block minima (weight = minimum +
     * code * scale); xsum [M, Kq / 32] each activation block's scale times the sum of its int8 codes (set by
     * quantize_acts). wbits is 8 otherwise. */
    int wbits;
    const uint16_t *wmin;
    const float *xsum;
} gemv_args;

static inline float value_at(const void *p, int dtype, int64_t i) {
    return dtype == F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* out[m, n] from the float32 dot product `acc`: times the scale, rounded to od, plus the bias rounded again
 * (torch's `_weight_int8pack_mm(...) + bias`) */
static inline void gemv_store(const gemv_args *a, int64_t m, int64_t n, float acc) {
    float y = round_to(a->wbits == 4 ? acc : acc * value_at(a->scale, a->sd, n), a->od); /* W4: scaled per block */
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

/* output rows [n0, n1) of a->M <= 4 activation rows through BLOCK(a, n, M, NB), M and NB constants in each
 * call so that the block's accumulators stay in registers: blocks of NB = 8 rows (M <= 2) or 4, then single rows */
#define GEMV_ROWS_IN_BLOCKS(BLOCK, a, n0, n1)                                                                   \
    do {                                                                                                      \
        const int M_ = (int)(a)->M, nb_ = M_ <= 2 ? 8 : 4;                                                    \
        int64_t n_ = (n0);                                                                                    \
        for (; n_ + nb_ <= (n1); n_ += nb_) {                                                                 \
            if (M_ == 1) BLOCK(a, n_, 1, 8);                                                                  \
            else if (M_ == 2) BLOCK(a, n_, 2, 8);                                                             \
            else if (M_ == 3) BLOCK(a, n_, 3, 4);                                                             \
            else BLOCK(a, n_, 4, 4);                                                                          \
        }                                                                                                     \
        for (; n_ < (n1); n_++) {                                                                             \
            if (M_ == 1) BLOCK(a, n_, 1, 1);                                                                  \
            else if (M_ == 2) BLOCK(a, n_, 2, 1);                                                             \
            else if (M_ == 3) BLOCK(a, n_, 3, 1);                                                             \
            else BLOCK(a, n_, 4, 1);                                                                          \
        }                                                                                                     \
    } while (0)

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


static void gemv_rows_avx512(const gemv_args *a, int64_t n0, int64_t n1) {
    GEMV_ROWS_IN_BLOCKS(gemv_block_avx512, a, n0, n1);
}
#endif

#if !defined(CONFKV_GEMV_AVX512) && defined(__AVX2__) && defined(__FMA__)
#define CONFKV_GEMV_AVX2 1
#include <immintrin.h>
/* 8 int8 weights widened to float32 (exact) */
static inline __m256 weights8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* W8A16 on AVX2 CPUs without AVX-512: gemv_block_avx512 with 8 lanes, 16 columns a step (two vectors a row), M * NB
 * sums in registers, each weight vector widened once and used by the M rows; a row's last, partial 16 columns are
 * copied into a zeroed buffer (the row is read no further than its K bytes; the activations are zero past K) */
static inline __attribute__((always_inline)) void gemv_block_avx2(const gemv_args *a, int64_t n, const int M,
                                                                  const int NB) {
    __m256 acc[4][8];
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = _mm256_setzero_ps();
    const int64_t K = a->K, Kp = a->Kp;
    const int8_t *w = a->w + n * K;
    const char *next = (const char *)(w + 2 * NB * K); /* as the AVX-512 block: the rows two blocks ahead */
    const int ahead = NB >= 4 ? NB / 4 : 1;
    for (int64_t k = 0; k < K; k += 16) {
        for (int p = 0; p < ahead; p++) _mm_prefetch(next + ((k / 16) * ahead + p) * 64, _MM_HINT_T0);
        __m256 x0[4], x1[4];
        for (int m = 0; m < M; m++) {
            x0[m] = _mm256_loadu_ps(a->xf + m * Kp + k);
            x1[m] = _mm256_loadu_ps(a->xf + m * Kp + k + 8);
        }
        for (int b = 0; b < NB; b++) {
            const int8_t *row = w + b * K + k;
            int8_t tail[16] = {0};
            if (k + 16 > K) {
                memcpy(tail, row, (size_t)(K - k));
                row = tail;
            }
            const __m256 w0 = weights8(row), w1 = weights8(row + 8);
            for (int m = 0; m < M; m++)
                acc[m][b] = _mm256_fmadd_ps(x1[m], w1, _mm256_fmadd_ps(x0[m], w0, acc[m][b]));
        }
    }
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) gemv_store(a, m, n + b, sum_lanes8(acc[m][b]));
}

static void gemv_rows_avx2(const gemv_args *a, int64_t n0, int64_t n1) {
    GEMV_ROWS_IN_BLOCKS(gemv_block_avx2, a, n0, n1);
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
    GEMV_ROWS_IN_BLOCKS(gemv_block_vnni, a, n0, n1);
}
#endif

#if !defined(CONFKV_GEMV_VNNI) && defined(__AVX2__) && defined(__FMA__)
#define CONFKV_GEMV_A8_AVX2 1
#include <immintrin.h>
/* W8A8 on AVX2 CPUs without AVX-512 VNNI: output rows [n, n + NB) for the M <= 4 quantised activation rows, 32
 * columns (one activation block) a step. vpmaddubsw multiplies unsigned by signed bytes, so each weight vector is
 * taken as |w| (unsigned: 0..128) and each activation vector as q with w's sign (q in -127..127, so -q is a byte);
 * a pair of products is at most 2 * 128 * 127 < 2^15 (exact in int16), and vpmaddwd by ones sums two pairs into
 * each int32 lane: 4 columns a lane, exactly. One multiply-add by the block's activation scale moves the 8 lanes
 * into the float32 accumulators, which are added at the end (the 4-column sums in another order than the
 * portable loop's blocks of 32: tests/native/test_native_w8a8.py bounds both). A row's last, partial block is
 * copied into a zeroed buffer (the row is read no further than its K bytes); the activations are zero past K. */
static inline __attribute__((always_inline)) void gemv_block_a8_avx2(const gemv_args *a, int64_t n, const int M,
                                                                     const int NB) {
    __m256 acc[4][8];
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = _mm256_setzero_ps();
    const int64_t K = a->K, Kq = a->Kq, steps = Kq / ACT_STEP;
    const int8_t *w = a->w + n * K;
    const __m256i ones = _mm256_set1_epi16(1);
    const char *next = (const char *)(w + 2 * NB * K); /* as the AVX-512 block: the rows two blocks ahead */
    const int ahead = NB >= 2 ? NB / 2 : 1;           /* cache lines per 32 columns of NB rows */
    for (int64_t k = 0; k < K; k += ACT_BLOCK) {
        for (int p = 0; p < ahead; p++) _mm_prefetch(next + ((k / ACT_BLOCK) * ahead + p) * 64, _MM_HINT_T0);
        __m256i x[4];
        __m256 scale[4];
        for (int m = 0; m < M; m++) {
            x[m] = _mm256_loadu_si256((const __m256i *)(a->xq + m * Kq + k));
            scale[m] = _mm256_loadu_ps(a->xs + (m * steps + k / ACT_STEP) * 16 + ((k % ACT_STEP) / ACT_BLOCK) * 8);
        }
        for (int b = 0; b < NB; b++) {
            __m256i wv;
            if (k + ACT_BLOCK <= K) {
                wv = _mm256_loadu_si256((const __m256i *)(w + b * K + k));
            } else {
                int8_t tail[ACT_BLOCK] = {0};
                memcpy(tail, w + b * K + k, (size_t)(K - k));
                wv = _mm256_loadu_si256((const __m256i *)tail);
            }
            const __m256i magnitude = _mm256_abs_epi8(wv);
            for (int m = 0; m < M; m++) {
                const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[m], wv));
                const __m256i fours = _mm256_madd_epi16(pairs, ones);
                acc[m][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fours), scale[m], acc[m][b]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) gemv_store(a, m, n + b, sum_lanes8(acc[m][b]));
}

static void gemv_rows_a8_avx2(const gemv_args *a, int64_t n0, int64_t n1) {
    GEMV_ROWS_IN_BLOCKS(gemv_block_a8_avx2, a, n0, n1);
}
#endif

static void gemv_rows_w4(const gemv_args *a, int64_t n0, int64_t n1); /* gemv_w4.c */

/* activation rows [m0, m0 + 4) of `a` (fewer at the end) as a call of their own: the per-row operands offset */
static __attribute__((unused)) gemv_args rows_from(const gemv_args *a, int64_t m0) {
    gemv_args part = *a;
    part.M = a->M - m0 < 4 ? a->M - m0 : 4;
    part.xf = a->xf + m0 * a->Kp;
    if (a->xq) {
        part.xq = a->xq + m0 * a->Kq;
        part.xs = a->xs + m0 * (a->Kq / ACT_STEP) * 16;
        part.xcorr = a->xcorr + m0 * (a->Kq / ACT_STEP) * 16;
        if (a->xsum) part.xsum = a->xsum + m0 * (a->Kq / ACT_BLOCK);
    }
    part.out = (char *)a->out + m0 * a->N * (a->od == BF16 ? 2 : 4);
    return part;
}

/* rows(part, n0, n1) for each block of at most four activation rows of a (the VNNI and AVX-512 row kernels hold
 * four rows' sums in registers) */
static __attribute__((unused)) void in_blocks_of_four_rows(const gemv_args *a, int64_t n0, int64_t n1,
                                                           void (*rows)(const gemv_args *, int64_t, int64_t)) {
    for (int64_t m0 = 0; m0 < a->M; m0 += 4) {
        const gemv_args part = rows_from(a, m0);
        rows(&part, n0, n1);
    }
}

static void gemv_rows(const gemv_args *a, int64_t n0, int64_t n1) {
    if (a->wbits == 4) {
        gemv_rows_w4(a, n0, n1);
        return;
    }
    if (a->xq) {
#ifdef CONFKV_GEMV_VNNI
        in_blocks_of_four_rows(a, n0, n1, gemv_rows_vnni);
#elif defined(CONFKV_GEMV_A8_AVX2)
        in_blocks_of_four_rows(a, n0, n1, gemv_rows_a8_avx2);
#else
        gemv_rows_a8_c(a, n0, n1);
#endif
        return;
    }
#ifdef CONFKV_GEMV_AVX512
    in_blocks_of_four_rows(a, n0, n1, gemv_rows_avx512);
#elif defined(CONFKV_GEMV_AVX2)
    in_blocks_of_four_rows(a, n0, n1, gemv_rows_avx2);
#else
    gemv_rows_c(a, n0, n1);
#endif
}
