/* The attention read of a prefill chunk (confkv_prefill_read): many bfloat16 query rows over dense segments
 * (bfloat16 as the model keeps them, or float32: cold pages dequantized), with masks, with or without the
 * attention mass. Part of kernels.c.
 *
 * The B * Hkv * ceil(G * Q / R) units (a block of R query rows of one KV head: 32, or 16 / 8 for long keys) are
 * independent. Each walks the keys PF_KEYS at a time: the scores of every block some row sees, kept ([R, keys]
 * floats, at most prefill_score_bytes) with each row's maximum; then, row by row, p = exp(s - max) / sum in place; then
 * the mass and p @ v, block by block (the values widened to float32 once per block, for all the rows).
 *
 * Arithmetic: a score is the float32 sum of bfloat16 products (exact in float32), by `vdpbf16ps` where
 * the CPU has AVX512-BF16 (the keys packed first, 16 keys a vector, two channels a lane), times `scaling`
 * (float32 keys: float32 products, fused multiply-adds, as torch's float32 bmm);
 * the softmax and p @ v are float32 (values widened from bfloat16); the output is rounded to bfloat16
 * once. The same contract as the block-wise read (confkv/attention/blockwise.py), up to the order of the
 * float32 sums, except that vdpbf16ps reads a bfloat16 subnormal (below 1.2e-38) as zero. Masked slots get
 * probability 0; a row that sees nothing gets a zero output; a NaN score makes its row NaN. A block of keys
 * that no row of the unit sees is skipped (the causal corner of a chunk).
 *
 * The mass of a slot sums p over the unit's rows, per unit (no two threads add into one float), then over
 * the units of a KV head in order and / G: the same floats with any number of threads. */

/* PF_ROWS: most query rows a unit takes (fewer for long keys: confkv_prefill_read); PF_KEYS: keys a block */
enum { PF_ROWS = 32, PF_KEYS = 64, PF_META = 14 };
/* a unit's kept scores ([rows, keys] floats) stay within this many bytes (half of a 1 MiB level-2 cache) */
static const int64_t prefill_score_bytes = 1 << 19;

typedef struct {
    const uint16_t *query;
    int64_t q_sb, q_sh, q_sq;
    int64_t Hq, Q, D, Hkv, G, rows, R, blocks; /* R: query rows a unit (8, 16 or 32) */
    int n_seg;
    const void *const *keys, *const *values;
    const uint8_t *const *masks;
    const int64_t *meta; /* PF_META per segment: see confkv_prefill_read */
    float scaling;
    uint16_t *out;
    float *const *mass;
    int64_t *seg_start;  /* per segment: its first slot in the padded key list (a multiple of PF_KEYS) */
    int64_t *seg_word;   /* per segment: its first word in a (b, j)'s packed keys */
    int64_t padded;      /* the padded key list's length */
    int64_t words;       /* packed words per (b, j) */
    uint32_t *packed;    /* per (b, j): each segment's keys, 16 keys a group: bfloat16 keys as D / 2 words (word i
                          * of key l at i * 16 + l % 16), float32 keys as D floats (channel d at d * 16 + l % 16) */
    float *partial;      /* per unit: padded floats of mass, or NULL */
    int portable;
    volatile int failed;
} prefill_args;

/* packs the keys of (b, j) = unit, 16 keys a group: a bfloat16 key's word i (channels 2i, 2i + 1) at
 * [i * 16 + l % 16], a float32 key's channel d at [d * 16 + l % 16]; the padding keys are zero */
static void prefill_pack(const void *ctx, int64_t unit) {
    const prefill_args *a = (const prefill_args *)ctx;
    const int64_t b = unit / a->Hkv, j = unit % a->Hkv, D = a->D, D2 = D / 2;
    uint32_t *packed = a->packed + unit * a->words;
    memset(packed, 0, sizeof(uint32_t) * (size_t)a->words);
    for (int s = 0; s < a->n_seg; s++) {
        const int64_t *m = a->meta + PF_META * s;
        const int wide = m[12] == F32;
        const int64_t per_key = wide ? D : D2;
        const char *keys = at(a->keys[s], (int)m[12], b * m[1] + j * m[2]);
        for (int64_t l = 0; l < m[0]; l++) {
            uint32_t *group = packed + a->seg_word[s] + (l / 16) * 16 * per_key + l % 16;
            if (wide) {
                const uint32_t *row = (const uint32_t *)(keys + l * m[3] * 4);
                for (int64_t d = 0; d < D; d++) group[d * 16] = row[d];
            } else {
                const uint16_t *row = (const uint16_t *)(keys + l * m[3] * 2);
                for (int64_t i = 0; i < D2; i++) group[i * 16] = (uint32_t)row[2 * i] | ((uint32_t)row[2 * i + 1] << 16);
            }
        }
    }
}

/* S[r * stride + k] = q_r . key_k (unscaled) for the R rows of words qw [R, D/2] and the
 * PF_KEYS keys of `keys` (four packed groups of 16). Plain C: the bfloat16 products summed in order. */
static void prefill_scores_c(const uint32_t *qw, const uint32_t *keys, int64_t D2, float *S, int64_t stride, int R) {
    for (int r = 0; r < R; r++)
        for (int k = 0; k < PF_KEYS; k++) {
            const uint32_t *group = keys + (k / 16) * 16 * D2 + k % 16;
            float s = 0.0f;
            for (int64_t i = 0; i < D2; i++) {
                const uint32_t q = qw[r * D2 + i], w = group[i * 16];
                s = fmaf(bf16_to_f32((uint16_t)q), bf16_to_f32((uint16_t)w), s);
                s = fmaf(bf16_to_f32((uint16_t)(q >> 16)), bf16_to_f32((uint16_t)(w >> 16)), s);
            }
            S[r * stride + k] = s;
        }
}

/* the same for float32 keys (D floats a key) and the float32 query rows qf [R, D] */
static void prefill_scores_f32_c(const float *qf, const float *keys, int64_t D, float *S, int64_t stride, int R) {
    for (int r = 0; r < R; r++)
        for (int k = 0; k < PF_KEYS; k++) {
            const float *group = keys + (k / 16) * 16 * D + k % 16;
            float s = 0.0f;
            for (int64_t d = 0; d < D; d++) s = fmaf(qf[r * D + d], group[d * 16], s);
            S[r * stride + k] = s;
        }
}

/* acc[r, :] += sum_k P[r * stride + k] * vf[k, :] for the R rows. Plain C. */
static void prefill_values_c(const float *P, int64_t stride, const float *vf, int64_t D, float *acc, int R) {
    for (int r = 0; r < R; r++)
        for (int k = 0; k < PF_KEYS; k++) {
            const float w = P[r * stride + k];
            for (int64_t d = 0; d < D; d++) acc[r * D + d] = fmaf(w, vf[k * D + d], acc[r * D + d]);
        }
}

#if defined(__AVX512BF16__)
/* prefill_scores_c by vdpbf16ps: eight rows against 32 keys (16 accumulators) at a time */
static void prefill_scores_bf16(const uint32_t *qw, const uint32_t *keys, int64_t D2, float *S, int64_t stride, int R) {
    for (int r0 = 0; r0 < R; r0 += 8)
        for (int g = 0; g < PF_KEYS / 16; g += 2) {
            const uint32_t *k0 = keys + g * 16 * D2, *k1 = k0 + 16 * D2;
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t i = 0; i < D2; i++) {
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512(k0 + i * 16);
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512(k1 + i * 16);
                for (int r = 0; r < 8; r++) {
                    const __m512bh q = (__m512bh)_mm512_set1_epi32((int)qw[(r0 + r) * D2 + i]);
                    acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], q, w0);
                    acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], q, w1);
                }
            }
            for (int r = 0; r < 8; r++) {
                _mm512_storeu_ps(S + (r0 + r) * stride + g * 16, acc[2 * r]);
                _mm512_storeu_ps(S + (r0 + r) * stride + g * 16 + 16, acc[2 * r + 1]);
            }
        }
}

/* prefill_scores_f32_c with AVX-512: eight rows against 32 keys at a time, one channel a step */
static void prefill_scores_f32_avx512(const float *qf, const float *keys, int64_t D, float *S, int64_t stride, int R) {
    for (int r0 = 0; r0 < R; r0 += 8)
        for (int g = 0; g < PF_KEYS / 16; g += 2) {
            const float *k0 = keys + g * 16 * D, *k1 = k0 + 16 * D;
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                const __m512 w0 = _mm512_loadu_ps(k0 + d * 16), w1 = _mm512_loadu_ps(k1 + d * 16);
                for (int r = 0; r < 8; r++) {
                    const __m512 q = _mm512_set1_ps(qf[(r0 + r) * D + d]);
                    acc[2 * r] = _mm512_fmadd_ps(q, w0, acc[2 * r]);
                    acc[2 * r + 1] = _mm512_fmadd_ps(q, w1, acc[2 * r + 1]);
                }
            }
            for (int r = 0; r < 8; r++) {
                _mm512_storeu_ps(S + (r0 + r) * stride + g * 16, acc[2 * r]);
                _mm512_storeu_ps(S + (r0 + r) * stride + g * 16 + 16, acc[2 * r + 1]);
            }
        }
}

/* four rows times nc * 16 channels from d0, over the PF_KEYS keys (4 * nc accumulators) */
static inline __attribute__((always_inline)) void prefill_values_tile(const float *P, int64_t stride, const float *vf,
                                                                      int64_t D, float *acc, int r0, int64_t d0,
                                                                      const int nc) {
    __m512 a[16], v[4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < nc; c++) a[r * nc + c] = _mm512_loadu_ps(acc + (r0 + r) * D + d0 + 16 * c);
    for (int k = 0; k < PF_KEYS; k++) {
        for (int c = 0; c < nc; c++) v[c] = _mm512_loadu_ps(vf + k * D + d0 + 16 * c);
        for (int r = 0; r < 4; r++) {
            const __m512 w = _mm512_set1_ps(P[(r0 + r) * stride + k]);
            for (int c = 0; c < nc; c++) a[r * nc + c] = _mm512_fmadd_ps(w, v[c], a[r * nc + c]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(acc + (r0 + r) * D + d0 + 16 * c, a[r * nc + c]);
}

/* prefill_values_c with AVX-512 (D a multiple of 16): the same products, each channel's sum in key order */
static void prefill_values_avx512(const float *P, int64_t stride, const float *vf, int64_t D, float *acc, int R) {
    for (int r0 = 0; r0 < R; r0 += 4)
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            const int64_t left = (D - d0) / 16;
            if (left >= 4) prefill_values_tile(P, stride, vf, D, acc, r0, d0, 4);
            else if (left == 3) prefill_values_tile(P, stride, vf, D, acc, r0, d0, 3);
            else if (left == 2) prefill_values_tile(P, stride, vf, D, acc, r0, d0, 2);
            else prefill_values_tile(P, stride, vf, D, acc, r0, d0, 1);
        }
}
#endif

/* whether the AVX512-BF16 kernels run for head size D (else the plain C ones) */
static int prefill_fast(const prefill_args *a) {
#if defined(__AVX512BF16__)
    return !a->portable && a->D % 16 == 0;
#else
    (void)a;
    return 0;
#endif
}

/* bit k set when slot k (< keys) is visible in the mask row `row` (slot stride st; NULL: all visible) */
static inline uint64_t prefill_row_bits(const uint8_t *row, int64_t st, int keys, int fast) {
    const uint64_t live = keys == 64 ? ~0ull : ((1ull << keys) - 1);
    if (row == NULL) return live;
#if defined(__AVX512BW__)
    if (fast && st == 1) {
        const __m512i bytes = _mm512_maskz_loadu_epi8((__mmask64)live, row);
        return (uint64_t)_mm512_test_epi8_mask(bytes, bytes);
    }
#endif
    (void)fast;
    uint64_t bits = 0;
    for (int k = 0; k < keys; k++) bits |= (uint64_t)(row[k * st] != 0) << k;
    return bits;
}

/* the scaled, masked scores of the unit's rows r0 .. r0 + rows - 1 over the keys k0 .. k0 + PF_KEYS - 1 of
 * segment s, into S [R rows, stride floats apart] (rows past `rows`, keys past the segment and
 * masked slots: -inf); 0, and S untouched, when no row sees any of them */
static int prefill_block_scores(const prefill_args *a, int64_t b, int64_t j, int s, int64_t k0, int64_t r0,
                                int64_t rows, const uint32_t *qw, const float *qf, const uint32_t *packed, float *S,
                                int64_t stride) {
    const int64_t *m = a->meta + PF_META * s;
    const int keys = m[0] - k0 < PF_KEYS ? (int)(m[0] - k0) : PF_KEYS;
    const uint8_t *mask = m[7] ? a->masks[s] + b * m[8] + j * m[9] + k0 * m[11] : NULL;
    const int fast = prefill_fast(a);
    const int R = (int)a->R;
    uint64_t bits[PF_ROWS], any = 0;
    for (int r = 0; r < R; r++) {
        bits[r] = r < rows ? prefill_row_bits(mask ? mask + ((r0 + r) % a->Q) * m[10] : NULL, m[11], keys, fast) : 0;
        any |= bits[r];
    }
    if (!any) return 0;
    const int wide = m[12] == F32;
    const uint32_t *group = packed + a->seg_word[s] + k0 * (wide ? a->D : a->D / 2);
#if defined(__AVX512BF16__)
    if (fast) {
        if (wide) prefill_scores_f32_avx512(qf, (const float *)group, a->D, S, stride, R);
        else prefill_scores_bf16(qw, group, a->D / 2, S, stride, R);
        const __m512 hidden = _mm512_set1_ps(-INFINITY), scaling = _mm512_set1_ps(a->scaling);
        for (int r = 0; r < R; r++)
            for (int g = 0; g < PF_KEYS / 16; g++) {
                float *at16 = S + r * stride + 16 * g;
                const __mmask16 seen = (__mmask16)(bits[r] >> (16 * g));
                _mm512_storeu_ps(at16, _mm512_mask_mul_ps(hidden, seen, _mm512_loadu_ps(at16), scaling));
            }
        return 1;
    }
#endif
    if (wide) prefill_scores_f32_c(qf, (const float *)group, a->D, S, stride, R);
    else prefill_scores_c(qw, group, a->D / 2, S, stride, R);
    for (int r = 0; r < R; r++)
        for (int k = 0; k < PF_KEYS; k++)
            S[r * stride + k] = (bits[r] >> k) & 1 ? S[r * stride + k] * a->scaling : -INFINITY;
    return 1;
}

/* one unit: rows blk * R .. of KV head j of sequence b (unit = (b * Hkv + j) * blocks + blk). The
 * scores of every block some row sees are kept ([R, padded] floats) between the three passes:
 * scores and each row's maximum; probabilities; the mass and p @ v. */
static void prefill_unit(const void *ctx, int64_t unit) {
    prefill_args *a = (prefill_args *)ctx;
    const int64_t bj = unit / a->blocks, blk = unit % a->blocks, b = bj / a->Hkv, j = bj % a->Hkv;
    const int R = (int)a->R;
    const int64_t D = a->D, D2 = D / 2, r0 = blk * R, padded = a->padded, n_blocks = padded / PF_KEYS;
    const int64_t rows = a->rows - r0 < R ? a->rows - r0 : R;
    const size_t floats = (size_t)(R * D2 + R * D + R * padded + PF_KEYS * D + R * D + 2 * R + n_blocks);
    float *scratch = malloc(sizeof(float) * floats);
    if (!scratch) {
        a->failed = 1;
        return;
    }
    uint32_t *qw = (uint32_t *)scratch;
    float *qf = scratch + R * D2, *S = qf + R * D, *vf = S + R * padded, *acc = vf + PF_KEYS * D;
    float *top = acc + R * D, *inv = top + R;
    unsigned char *seen = (unsigned char *)(inv + R); /* per block of PF_KEYS slots: some row sees it */
    const uint32_t *packed = a->packed + bj * a->words;
    /* row r = g * Q + q holds query head j * G + g, query q */
    for (int64_t r = 0; r < R; r++) {
        if (r < rows) {
            const int64_t g = (r0 + r) / a->Q, q = (r0 + r) % a->Q;
            const uint16_t *row = a->query + b * a->q_sb + (j * a->G + g) * a->q_sh + q * a->q_sq;
            memcpy(qw + r * D2, row, sizeof(uint16_t) * D);
            load_row(row, BF16, D, qf + r * D);
        } else {
            memset(qw + r * D2, 0, sizeof(uint32_t) * D2);
            memset(qf + r * D, 0, sizeof(float) * D);
        }
        top[r] = -1e30f; /* finite: exp(-inf - top) = 0 for a row that sees nothing */
    }
    for (int s = 0; s < a->n_seg; s++)
        for (int64_t k0 = 0; k0 < a->meta[PF_META * s]; k0 += PF_KEYS) {
            const int64_t slot = a->seg_start[s] + k0;
            seen[slot / PF_KEYS] = (unsigned char)prefill_block_scores(a, b, j, s, k0, r0, rows, qw, qf, packed, S + slot, padded);
            if (!seen[slot / PF_KEYS]) continue;
            for (int r = 0; r < rows; r++) {
                const float *row = S + r * padded + slot;
                float high = top[r];
                for (int k = 0; k < PF_KEYS; k++) high = row[k] > high ? row[k] : high;
                top[r] = high;
            }
        }
    for (int64_t r = 0; r < R; r++) { /* p = exp(s - max) / sum, in place; rows past `rows` are 0 */
        float *row = S + r * padded, total = 0.0f;
        const float high = top[r];
        for (int64_t block = 0; block < n_blocks; block++) {
            if (!seen[block]) continue;
            float *p = row + block * PF_KEYS, add = 0.0f;
#pragma omp simd reduction(+ : add)
            for (int k = 0; k < PF_KEYS; k++) {
                p[k] = exp_nonpositive(p[k] - high);
                add += p[k];
            }
            total += add;
        }
        inv[r] = r < rows && total != 0.0f ? 1.0f / total : 0.0f; /* a NaN total stays NaN */
        const float scale = inv[r];
        for (int64_t block = 0; block < n_blocks; block++) {
            if (!seen[block]) continue;
            float *p = row + block * PF_KEYS;
#pragma omp simd
            for (int k = 0; k < PF_KEYS; k++) p[k] *= scale;
        }
    }
    memset(acc, 0, sizeof(float) * (size_t)(R * D));
    float *partial = a->partial ? a->partial + unit * padded : NULL;
    if (partial) memset(partial, 0, sizeof(float) * (size_t)padded);
    for (int s = 0; s < a->n_seg; s++) {
        const int64_t *m = a->meta + PF_META * s;
        const char *values = at(a->values[s], (int)m[13], b * m[4] + j * m[5]);
        for (int64_t k0 = 0; k0 < m[0]; k0 += PF_KEYS) {
            const int64_t slot = a->seg_start[s] + k0;
            if (!seen[slot / PF_KEYS]) continue;
            const float *P = S + slot;
            if (partial)
                for (int r = 0; r < rows; r++)
#pragma omp simd
                    for (int k = 0; k < PF_KEYS; k++) partial[slot + k] += P[r * padded + k];
            const int64_t keys = m[0] - k0 < PF_KEYS ? m[0] - k0 : PF_KEYS;
            for (int64_t k = 0; k < PF_KEYS; k++) { /* keys past the segment: zero (their p is 0, 0 * garbage is not) */
                if (k < keys) load_row(values + (k0 + k) * m[6] * (m[13] == F32 ? 4 : 2), (int)m[13], D, vf + k * D);
                else memset(vf + k * D, 0, sizeof(float) * (size_t)D);
            }
#if defined(__AVX512BF16__)
            if (prefill_fast(a)) prefill_values_avx512(P, padded, vf, D, acc, R);
            else
#endif
                prefill_values_c(P, padded, vf, D, acc, R);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t g = (r0 + r) / a->Q, q = (r0 + r) % a->Q;
        store_row(acc + r * D, BF16, D, a->out + (((b * a->Hq + j * a->G + g) * a->Q + q) * D));
    }
    free(scratch);
}

/* mass[s][(b, j), l] = sum over the units of (b, j), in order, of their partial mass, / G */
static void prefill_reduce(const void *ctx, int64_t bj) {
    const prefill_args *a = (const prefill_args *)ctx;
    for (int s = 0; s < a->n_seg; s++) {
        const int64_t L = a->meta[PF_META * s];
        float *mass = a->mass[s] + bj * L;
        for (int64_t l = 0; l < L; l++) {
            float sum = 0.0f;
            for (int64_t blk = 0; blk < a->blocks; blk++) sum += a->partial[(bj * a->blocks + blk) * a->padded + a->seg_start[s] + l];
            mass[l] = sum / (float)a->G;
        }
    }
}

/* 1 when this build has the AVX512-BF16 kernels (the read plan takes the path only then) */
int confkv_prefill_vectorised(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Softmax attention of a prefill chunk over the concatenation of n_seg dense segments:
 *   query   [B, Hq, Q, D] bfloat16 (strides q_sb, q_sh, q_sq; channels contiguous), Hq = Hkv * G, D even
 *   keys[s], values[s]  [B, Hkv, L_s, D] bfloat16 or float32 (dtype codes in meta), channels contiguous
 *   masks[s]  bool (one byte) [B, Hkv, Q, L_s] as strides (0 where broadcast), true = visible; ignored where
 *             the segment has none
 *   meta[PF_META s ..] = L_s, key strides (b, h, l), value strides (b, h, l), has mask, mask strides (b, h, q, l),
 *             key dtype, value dtype
 *   out     [B, Hq, Q, D] bfloat16, contiguous
 *   mass[s] [B, Hkv, L_s] float32 contiguous (NULL: no mass): each slot's probability averaged over the G
 *           query heads of its KV head and summed over the Q queries
 * on up to `threads` threads of the pool; `portable` = 1 runs the plain C arithmetic even where the CPU has
 * AVX512-BF16 (the tests reach both). Returns 0, or 1 when out of memory. */
int confkv_prefill_read(const void *query, int64_t q_sb, int64_t q_sh, int64_t q_sq, int64_t B, int64_t Hq,
                        int64_t Q, int64_t D, int64_t Hkv, int n_seg, const void *const *keys,
                        const void *const *values, const uint8_t *const *masks, const int64_t *meta, float scaling,
                        void *out, float *const *mass, int threads, int portable) {
    int64_t seg_start[64], seg_word[64];
    if (n_seg > 64 || D % 2) return 2;
    int64_t padded = 0, words = 0;
    for (int s = 0; s < n_seg; s++) {
        const int64_t length = (meta[PF_META * s] + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
        seg_start[s] = padded;
        seg_word[s] = words;
        padded += length;
        words += length * (meta[PF_META * s + 12] == F32 ? D : D / 2);
    }
    /* rows a unit: 32, or 16 / 8 where 32 rows' kept scores would pass prefill_score_bytes (long keys) */
    int64_t R = PF_ROWS;
    while (R > 8 && R * padded * (int64_t)sizeof(float) > prefill_score_bytes) R /= 2;
    const int64_t G = Hq / Hkv, rows = G * Q, blocks = (rows + R - 1) / R;
    prefill_args a = {(const uint16_t *)query, q_sb, q_sh, q_sq, Hq, Q, D, Hkv, G, rows, R, blocks, n_seg, keys, values,
                      masks, meta, scaling, (uint16_t *)out, mass, seg_start, seg_word, padded, words, NULL, NULL,
                      portable, 0};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    a.packed = malloc(sizeof(uint32_t) * (size_t)(B * Hkv * words) + 1);
    a.partial = mass ? malloc(sizeof(float) * (size_t)(B * Hkv * blocks * padded) + 1) : NULL;
    if (!a.packed || (mass && !a.partial)) {
        free(a.packed);
        free(a.partial);
        return 1;
    }
    /* pool_run is asked only for two threads or more: with one it would still hand chunks to idle workers */
    const int pool = threads >= 2;
    if (!pool || pool_run(prefill_pack, &a, B * Hkv, threads))
        for (int64_t u = 0; u < B * Hkv; u++) prefill_pack(&a, u);
    if (!pool || pool_run(prefill_unit, &a, B * Hkv * blocks, threads))
        for (int64_t u = 0; u < B * Hkv * blocks; u++) prefill_unit(&a, u);
    if (mass && !a.failed && (!pool || pool_run(prefill_reduce, &a, B * Hkv, threads)))
        for (int64_t u = 0; u < B * Hkv; u++) prefill_reduce(&a, u);
    free(a.packed);
    free(a.partial);
    return a.failed ? 1 : 0;
}
