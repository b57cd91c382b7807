/* ======================= 4-bit weight x int8 activation GEMV (W4A8, decode projections) =======================
 * A weight row holds blocks of ACT_BLOCK = 32 columns, each stored as 4-bit codes c with a float16 scale d and
 * minimum m (the weight is m + c * d: Q4_1's form, llama.cpp's 4-bit weights with a minimum); the activations are
 * quantize_acts' int8 blocks of 32 (scale s, codes q: llama.cpp's Q8 activations). Per output and block,
 *     sum_k (s q_k) (m + c_k d) = (s d) sum_k q_k c_k + m (s sum_k q_k),
 * the first sum exact in integers, the second quantize_acts' xsum. The blocks are added in float32. Decode reads
 * every weight once, and a 4-bit weight is half an INT8 one's bytes (plus 4 bytes of scale and minimum a block).
 * Part of kernels.c, after gemv.c (gemv_args, gemv_store, ACT_BLOCK, the row blocking) and pages.c (f16_to_f32).
 *
 * Code layout: a row's W4_STEP / 2-byte lines, one per W4_STEP = 128 columns (K rounded up to 128): column i of
 * the 128 in the low nibble of byte i, column 64 + i in its high nibble, so that one 64-byte load holds two of
 * the activations' 64-column steps, each a mask away (confkv.hf.int4_blocks.pack_int4_blocks). Scales and
 * minima: (K rounded up to 128) / 32 a row, the padding blocks' zero. */

enum { W4_STEP = 128 };

/* a 4-bit weight row's blocks of 32 (its scales and minima per row) */
static inline int64_t w4_blocks(const gemv_args *a) { return (a->K + W4_STEP - 1) / W4_STEP * (W4_STEP / ACT_BLOCK); }


/* the code of column k of a row's packed codes w */
static inline int32_t w4_code(const uint8_t *w, int64_t k) {
    const uint8_t byte = w[(k / W4_STEP) * (W4_STEP / 2) + k % (W4_STEP / 2)];
    return k % W4_STEP < W4_STEP / 2 ? byte & 15 : byte >> 4;
}

/* the sum over the activations' blocks of minimum times xsum (activation row m): the minima's share of output n */
static inline float w4_minima(const gemv_args *a, int64_t m, int64_t n) {
    const int64_t blocks = a->Kq / ACT_BLOCK;
    const uint16_t *minimum = a->wmin + n * w4_blocks(a);
    const float *xsum = a->xsum + m * blocks;
    float s = 0.0f;
    for (int64_t b = 0; b < blocks; b++) s = fmaf(f16_to_f32(minimum[b]), xsum[b], s);
    return s;
}

/* the portable loop: output rows [n0, n1) of all M activation rows, block by block in order */
static __attribute__((unused)) void gemv_rows_w4_c(const gemv_args *a, int64_t n0, int64_t n1) {
    const int64_t Kq = a->Kq, blocks = Kq / ACT_BLOCK, wblocks = w4_blocks(a);
    const uint16_t *scales = (const uint16_t *)a->scale;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *w = (const uint8_t *)a->w + n * (wblocks * ACT_BLOCK / 2);
        for (int64_t m = 0; m < a->M; m++) {
            const int8_t *q = a->xq + m * Kq;
            const float *xs = a->xs + m * (Kq / ACT_STEP) * 16;
            float s = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (int64_t k = b * ACT_BLOCK; k < (b + 1) * ACT_BLOCK; k++) dot += (int32_t)q[k] * w4_code(w, k);
                const float act_scale = xs[(b / 2) * 16 + (b % 2) * 8];
                s = fmaf((float)dot, act_scale * f16_to_f32(scales[n * wblocks + b]), s);
            }
            gemv_store(a, m, n, s + w4_minima(a, m, n));
        }
    }
}

#if defined(CONFKV_GEMV_VNNI)
/* w4_minima 16 blocks at a time (the minima widened by the hardware) */
static inline float w4_minima16(const gemv_args *a, int64_t m, int64_t n) {
    const int64_t blocks = a->Kq / ACT_BLOCK;
    const uint16_t *minimum = a->wmin + n * w4_blocks(a);
    const float *xsum = a->xsum + m * blocks;
    __m512 s = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 16) {
        const __mmask16 some = blocks - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (blocks - b)) - 1u);
        s = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(some, minimum + b)),
                            _mm512_maskz_loadu_ps(some, xsum + b), s);
    }
    return _mm512_reduce_add_ps(s);
}

/* the lanes' weight scales of step j (lanes 0-7 block 2j, 8-15 block 2j + 1) from the 16 blocks of steps
 * j - j % 8 .. j - j % 8 + 7 widened in scale16 */
static inline __m512 w4_step_scales(__m512 scale16, int64_t j) {
    const int at = (int)(2 * (j % 8));
    return _mm512_permutexvar_ps(_mm512_set_epi32(at + 1, at + 1, at + 1, at + 1, at + 1, at + 1, at + 1, at + 1, at,
                                                  at, at, at, at, at, at, at), scale16);
}

/* output rows [n, n + NB) for the M <= 4 quantised activation rows: per 128 columns each row's 64 code bytes give
 * two steps' 64 unsigned codes (low nibbles, then high ones: column order), and vpdpbusd sums four code x
 * activation products per lane (exact in int32; lanes 0-7 block 2j, 8-15 block 2j + 1), which one multiply-add by
 * the lanes' activation scale times weight scale moves into float32. The block scales of a row are widened 16
 * at a time (8 steps). */
static inline __attribute__((always_inline)) void gemv_block_w4(const gemv_args *a, int64_t n, const int M,
                                                                const int NB) {
    __m512 acc[4][8], scale16[8];
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    const int64_t Kq = a->Kq, steps = Kq / ACT_STEP, wblocks = w4_blocks(a), row_bytes = wblocks * ACT_BLOCK / 2;
    const uint8_t *w = (const uint8_t *)a->w + n * row_bytes;
    const uint16_t *scales = (const uint16_t *)a->scale + n * wblocks;
    const __m512i low = _mm512_set1_epi8(0x0F);
    /* the rows two blocks ahead (NB * row_bytes bytes, contiguous), NB lines a pair of steps (as gemv_block_avx512) */
    const char *next = (const char *)(w + 2 * NB * row_bytes);
    for (int64_t j = 0; j < steps; j += 2) {
        for (int p = 0; p < NB; p++) _mm_prefetch(next + ((j / 2) * NB + p) * 64, _MM_HINT_T0);
        if (j % 8 == 0) { /* the next 16 blocks' scales of each row (fewer at the row's end) */
            const int64_t left = wblocks - 2 * j;
            const __mmask16 some = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            for (int b = 0; b < NB; b++)
                scale16[b] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(some, scales + b * wblocks + 2 * j));
        }
        const int pair = j + 1 < steps; /* the line's second step exists in the activations */
        __m512i x[4], x2[4];
        __m512 xs[4], xs2[4];
        for (int m = 0; m < M; m++) {
            x[m] = _mm512_loadu_si512((const void *)(a->xq + m * Kq + j * ACT_STEP));
            xs[m] = _mm512_loadu_ps(a->xs + (m * steps + j) * 16);
            if (pair) {
                x2[m] = _mm512_loadu_si512((const void *)(a->xq + m * Kq + (j + 1) * ACT_STEP));
                xs2[m] = _mm512_loadu_ps(a->xs + (m * steps + j + 1) * 16);
            }
        }
        for (int b = 0; b < NB; b++) {
            const __m512i line = _mm512_loadu_si512((const void *)(w + b * row_bytes + (j / 2) * (W4_STEP / 2)));
            const __m512i first = _mm512_and_si512(line, low);
            const __m512 scale = w4_step_scales(scale16[b], j);
            for (int m = 0; m < M; m++)
                acc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), first, x[m])),
                                            _mm512_mul_ps(xs[m], scale), acc[m][b]);
            if (pair) {
                const __m512i second = _mm512_and_si512(_mm512_srli_epi16(line, 4), low);
                const __m512 scale2 = w4_step_scales(scale16[b], j + 1);
                for (int m = 0; m < M; m++)
                    acc[m][b] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), second, x2[m])),
                        _mm512_mul_ps(xs2[m], scale2), acc[m][b]);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) gemv_store(a, m, n + b, _mm512_reduce_add_ps(acc[m][b]) + w4_minima16(a, m, n + b));
}

static void gemv_rows_w4_vnni(const gemv_args *a, int64_t n0, int64_t n1) {
    GEMV_ROWS_IN_BLOCKS(gemv_block_w4, a, n0, n1);
}
#endif

#if !defined(CONFKV_GEMV_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONFKV_GEMV_W4_AVX2 1
/* w4_minima 8 blocks at a time, the last blocks one by one */
static inline float w4_minima8(const gemv_args *a, int64_t m, int64_t n) {
    const int64_t blocks = a->Kq / ACT_BLOCK;
    const uint16_t *minimum = a->wmin + n * w4_blocks(a);
    const float *xsum = a->xsum + m * blocks;
    __m256 s = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8)
        s = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(minimum + b))), _mm256_loadu_ps(xsum + b), s);
    float t = sum_lanes8(s);
    for (; b < blocks; b++) t = fmaf(f16_to_f32(minimum[b]), xsum[b], t);
    return t;
}

/* W4A8 on AVX2 CPUs without VNNI: output rows [n, n + NB) for the M <= 4 quantised activation rows, a row's
 * 64-byte line (128 columns) a step: its low nibbles are the codes of blocks 4L, 4L + 1 (bytes 0-31, 32-63), its
 * high nibbles those of 4L + 2, 4L + 3. vpmaddubsw multiplies the unsigned codes (0..15) by the signed activations
 * (a pair at most 2 * 15 * 127, exact in int16) and vpmaddwd by ones sums two pairs a lane (4 columns, exactly); one
 * multiply-add by the block's activation scale times its weight scale moves the 8 lanes into float32. The minima's
 * share is added at the end (w4_minima8). */
static inline __attribute__((always_inline)) void gemv_block_w4_avx2(const gemv_args *a, int64_t n, const int M,
                                                                     const int NB) {
    __m256 acc[4][8];
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = _mm256_setzero_ps();
    const int64_t Kq = a->Kq, steps = Kq / ACT_STEP, wblocks = w4_blocks(a), row_bytes = wblocks * ACT_BLOCK / 2;
    const uint8_t *w = (const uint8_t *)a->w + n * row_bytes;
    const uint16_t *scales = (const uint16_t *)a->scale + n * wblocks;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const char *next = (const char *)(w + 2 * NB * row_bytes); /* as gemv_block_w4: NB lines a pair of steps */
    for (int64_t j = 0; j < steps; j += 2) {
        for (int p = 0; p < NB; p++) _mm_prefetch(next + ((j / 2) * NB + p) * 64, _MM_HINT_T0);
        const int blocks = j + 1 < steps ? 4 : 2; /* the line's second step exists in the activations */
        __m256i x[4][4];
        __m256 xs[4][4];
        for (int m = 0; m < M; m++)
            for (int k = 0; k < blocks; k++) { /* block 2j + k: step j + k / 2, its half k % 2 */
                x[m][k] = _mm256_loadu_si256((const __m256i *)(a->xq + m * Kq + j * ACT_STEP + k * ACT_BLOCK));
                xs[m][k] = _mm256_loadu_ps(a->xs + (m * steps + j + k / 2) * 16 + (k % 2) * 8);
            }
        for (int b = 0; b < NB; b++) {
            const uint8_t *line = w + b * row_bytes + (j / 2) * (W4_STEP / 2);
            const __m256i first = _mm256_loadu_si256((const __m256i *)line);
            const __m256i second = _mm256_loadu_si256((const __m256i *)(line + 32));
            __m256i codes[4];
            codes[0] = _mm256_and_si256(first, low);
            codes[1] = _mm256_and_si256(second, low);
            codes[2] = _mm256_and_si256(_mm256_srli_epi16(first, 4), low);
            codes[3] = _mm256_and_si256(_mm256_srli_epi16(second, 4), low);
            for (int k = 0; k < blocks; k++) {
                const __m256 scale = _mm256_set1_ps(f16_to_f32(scales[b * wblocks + 2 * j + k]));
                for (int m = 0; m < M; m++) {
                    const __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(codes[k], x[m][k]), ones);
                    acc[m][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fours), _mm256_mul_ps(xs[m][k], scale), acc[m][b]);
                }
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int b = 0; b < NB; b++) gemv_store(a, m, n + b, sum_lanes8(acc[m][b]) + w4_minima8(a, m, n + b));
}

static void gemv_rows_w4_avx2(const gemv_args *a, int64_t n0, int64_t n1) {
    GEMV_ROWS_IN_BLOCKS(gemv_block_w4_avx2, a, n0, n1);
}
#endif

/* output rows [n0, n1) of every activation row (the VNNI blocks four activation rows at a time) */
static void gemv_rows_w4(const gemv_args *a, int64_t n0, int64_t n1) {
#ifdef CONFKV_GEMV_VNNI
    in_blocks_of_four_rows(a, n0, n1, gemv_rows_w4_vnni);
#elif defined(CONFKV_GEMV_W4_AVX2)
    in_blocks_of_four_rows(a, n0, n1, gemv_rows_w4_avx2);
#else
    gemv_rows_w4_c(a, n0, n1);
#endif
}
