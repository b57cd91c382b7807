/* The AVX2 read of packed pages (issue 32), for CPUs without AVX-512 VBMI (page_simd.c's reader): the same
 * algebra on 8-lane vectors, so that no key or value row is written out dequantized. Part of kernels.c, after
 * page_simd.c; page_tasks.c calls it where avx2_pages_fit. It takes the preset's pages (heads of a multiple of 32
 * channels up to 256, key groups and pages of a multiple of 8 tokens, value groups of a multiple of 8 channels, at
 * most 64 query rows x value groups), at 2, 3, 4 or 8 bits, with or without outliers: a page's outliers are stored
 * as corrections c (the entry less what its codes give), added after its packed read (pages.c: add_corrections),
 * q_d * c to a token's score and p_t * c to the output's channel d.
 *
 * Codes. lowbit.pack puts code d of a row at bit bits * (d % 8) of the `bits`-byte word d / 8 (a byte per 8 / bits
 * codes, 3 bytes per 8 codes at 3 bits), so 8 codes are `bits` bytes: they are read as one integer (those bytes; at
 * 3 bits 4 inside a row, the 4th masked off; never past a row), set in all 8 lanes, shifted right by bits * lane and
 * masked, then converted less the middle code mid = (2^bits - 1) / 2 (8 bits: 8 bytes widened).
 * Keys. A key group of G tokens shares a per-channel scale s and minimum m, so for a query row q
 *     q . (m + c * s) = q . (m + mid * s) + (q * s) . (c - mid):
 * q * s and the first term once a group, then each token costs its codes unpacked (once, into registers) and
 * R * D / 8 multiply-adds.
 * The running sums of 8 tokens are added by one tree (sum8: 7 horizontal adds and two block shuffles for 8 scores).
 * Values. A value row's group of Gv channels shares a per-token scale and minimum, so
 *     sum_t p_t (m_t + c_t * s_t) = sum_t p_t (m_t + mid * s_t) + sum_t (p_t s_t) (c_t - mid):
 * 8 slots at a time, the weights p_t * s_t and the first sum's terms are vectors (the first sum kept 8 slots side
 * by side per row and group, added to the output once at the end), then the valid slots' centred codes are added to
 * the R x D sums, which stay in registers over the 8 slots (avx2_value_block), in slot order.
 * Centring on the middle code keeps both terms about the size of the result (page_simd.c says why). Otherwise the
 * read differs from the row-by-row one only in the order and grouping of float32 products and sums
 * (tests/native/test_native_pages.py bounds them). Slots that hold no token score -inf and are never weighted;
 * a key group with no valid token is skipped whole. */

#if !defined(CONFKV_VBMI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONFKV_AVX2_PAGES 1
#include <immintrin.h>

/* 1 when every page of segment m (R query rows, head dim D) is read here */
static inline int avx2_pages_fit(const int64_t *m, int64_t R, int64_t D) {
    return D % 32 == 0 && D <= 256 && m[3] % 8 == 0 && m[5] % 8 == 0 && m[6] % 8 == 0 && R * (D / m[6]) <= 64;
}

/* the unpacking constants of `bits`-bit codes */
typedef struct {
    __m256i shifts, mask; /* lane i: bits * i; 2^bits - 1 */
    __m256 middle;        /* (2^bits - 1) / 2 */
    int bits;
} avx2_layout;

static inline avx2_layout avx2_layout_of(int bits) {
    avx2_layout l;
    l.bits = bits;
    l.shifts = _mm256_setr_epi32(0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits);
    l.mask = _mm256_set1_epi32((1 << bits) - 1);
    l.middle = _mm256_set1_ps(0.5f * (float)((1 << bits) - 1));
    return l;
}

/* the 8 codes of `bits` (a constant where inlined) bytes as one integer, reading exactly those bytes (little-endian:
 * byte k at bits 8k, as lowbit.pack writes the word; assembled byte by byte at 3 bits, which a 3-byte memcpy may
 * leave to a call) */
static inline __attribute__((always_inline)) uint32_t avx2_word(const uint8_t *src, int bits) {
    if (bits == 3) return (uint32_t)src[0] | (uint32_t)src[1] << 8 | (uint32_t)src[2] << 16;
    uint32_t w = 0;
    memcpy(&w, src, (size_t)bits);
    return w;
}

/* the D codes of one packed row (D % 8 == 0, channel order) less the middle code, as floats in c[D / 8] */
static inline __attribute__((always_inline)) void avx2_unpack(const uint8_t *restrict src, int64_t D,
                                                               const avx2_layout *l, __m256 *c) {
    const int bits = l->bits;
    for (int64_t i = 0; i < D / 8; i++) {
        __m256i codes;
        if (bits == 8)
            codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8 * i)));
        else if (bits == 4)
            codes = _mm256_set1_epi32((int)avx2_word(src + 4 * i, 4));
        else if (bits == 3 && i + 1 < D / 8) { /* a word inside the row: its 4 bytes, the 4th masked off below */
            uint32_t w;
            memcpy(&w, src + 3 * i, 4);
            codes = _mm256_set1_epi32((int)w);
        } else if (bits == 3)
            codes = _mm256_set1_epi32((int)avx2_word(src + 3 * i, 3));
        else
            codes = _mm256_set1_epi32((int)avx2_word(src + 2 * i, 2));
        if (bits != 8) codes = _mm256_and_si256(_mm256_srlv_epi32(codes, l->shifts), l->mask);
        c[i] = _mm256_sub_ps(_mm256_cvtepi32_ps(codes), l->middle);
    }
}

/* avx2_unpack with the bit width a constant in each branch (the word reads then take exactly their bytes) */
static inline __attribute__((always_inline)) void avx2_unpack_row(const uint8_t *restrict src, int64_t D,
                                                                   const avx2_layout *l, __m256 *c) {
    avx2_layout k = *l;
    switch (l->bits) {
    case 8: k.bits = 8; avx2_unpack(src, D, &k, c); break;
    case 4: k.bits = 4; avx2_unpack(src, D, &k, c); break;
    case 3: k.bits = 3; avx2_unpack(src, D, &k, c); break;
    default: k.bits = 2; avx2_unpack(src, D, &k, c); break;
    }
}

/* lane i of the result: the sum of the 8 lanes of v[i]. Horizontal adds within 128-bit blocks (after two levels
 * block k of u0 holds the block-k sums of tokens 0-3, of u1 those of tokens 4-7), then the blocks added. */
static inline __m256 sum8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* [8] lanes all ones where valid[e] is not 0 (8 bytes) */
static inline __m256 avx2_seen(const uint8_t *valid) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)valid));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setzero_si256()));
}

/* one token's sums (codes c [V]) for `rows` query rows (folded q * s [rows, 8 * V]): sum r goes to out[8 * r] (a row
 * of lane[8][8]); each sum a product then V - 1 multiply-adds in channel order. Always inlined: constant rows and V
 * keep the sums in registers */
static inline __attribute__((always_inline)) void avx2_token_rows(const float *folded, int64_t V, int64_t rows,
                                                                  const __m256 *c, __m256 *out) {
    __m256 acc[3];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_mul_ps(_mm256_loadu_ps(folded + r * 8 * V), c[0]);
    for (int64_t i = 1; i < V; i++)
        for (int64_t r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(folded + r * 8 * V + 8 * i), c[i], acc[r]);
    for (int64_t r = 0; r < rows; r++) out[8 * r] = acc[r];
}

/* the scores of 8 tokens (their packed key rows at codes, C bytes apart) for the R query rows: folded [R, 8 * V]
 * (q * s), bias [R] (q . centre); s[r * total + e] (-inf where valid[e] is 0). Token by token: its codes unpacked
 * into registers once, then each row's sum of V multiply-adds (the factors of q * s read from memory, one a
 * multiply-add), so that no code is written out and read back (a load a multiply-add instead of two); rows in
 * blocks of 8, each block's sums of the 8 tokens added by one tree. Always inlined, so that a constant V unrolls
 * the sums */
static inline __attribute__((always_inline)) void avx2_score_tokens8(const uint8_t *codes, int64_t C,
                                                                     const avx2_layout *l, int64_t V,
                                                                     const float *folded, const float *bias, int64_t R,
                                                                     const uint8_t *valid, float *s, int64_t total) {
    const __m256 seen = avx2_seen(valid), hidden = _mm256_set1_ps(-INFINITY);
    for (int64_t r0 = 0; r0 < R; r0 += 8) {
        const int64_t rows = R - r0 < 8 ? R - r0 : 8;
        __m256 lane[8][8]; /* [row - r0][token]: the token's 8 partial sums of that row */
        for (int64_t e = 0; e < 8; e++) {
            __m256 c[32]; /* the token's codes less the middle one */
            avx2_unpack_row(codes + e * C, 8 * V, l, c);
            int64_t r = 0;
            for (; r + 3 <= rows; r += 3) /* 3 rows' sums side by side (a constant count: in registers) */
                avx2_token_rows(folded + (r0 + r) * 8 * V, V, 3, c, &lane[r][e]);
            switch (rows - r) {
            case 2: avx2_token_rows(folded + (r0 + r) * 8 * V, V, 2, c, &lane[r][e]); break;
            case 1: avx2_token_rows(folded + (r0 + r) * 8 * V, V, 1, c, &lane[r][e]); break;
            default: break;
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            const __m256 got = _mm256_add_ps(sum8(lane[r]), _mm256_set1_ps(bias[r0 + r]));
            _mm256_storeu_ps(s + (r0 + r) * total, _mm256_blendv_ps(hidden, got, seen));
        }
    }
}

/* scores of the selected pages k0 .. k1 of one paged segment (meta m, pointers p) for the R query rows qf [R, D]
 * (pre-scaled), as planar_scores; buf holds R * D + R + D floats */
static void avx2_scores(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0, int64_t k1,
                        const float *qf, int64_t R, int64_t D, int64_t total, float *scores, float *buf) {
    const int64_t P = m[3], G = m[5], C = m[7], V = D / 8;
    const avx2_layout l = avx2_layout_of((int)m[4]);
    float *folded = buf, *bias = buf + R * D, *centre = bias + R; /* q * s [R, D], q . centre [R], m + mid * s [D] */
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        float *s = scores + k * P;
        if (page < 0) {
            hide_slots(s, R, P, total);
            continue;
        }
        const page_view v = view_page(p, m, b, j, page);
        for (int64_t first = 0; first < P; first += G) {
            int any = 0;
            for (int64_t t = first; t < first + G; t++) any |= v.valid[t];
            if (!any) {
                for (int64_t r = 0; r < R; r++)
                    for (int64_t t = first; t < first + G; t++) s[r * total + t] = -INFINITY;
                continue;
            }
            const uint16_t *ks = v.key_scale + (first / G) * D, *km = v.key_min + (first / G) * D;
            for (int64_t i = 0; i < V; i++) {
                const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + 8 * i)));
                const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(km + 8 * i)));
                _mm256_storeu_ps(centre + 8 * i, _mm256_fmadd_ps(scale, l.middle, minimum));
                for (int64_t r = 0; r < R; r++)
                    _mm256_storeu_ps(folded + r * D + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(qf + r * D + 8 * i), scale));
            }
            for (int64_t r = 0; r < R; r++) bias[r] = dot_tree(qf + r * D, centre, D);
            for (int64_t t0 = first; t0 < first + G; t0 += 8) {
                const uint8_t *codes = v.key_codes + t0 * C;
                float *to = s + t0;
                if (V == 8) /* a constant V: the sums unrolled (heads of 64 and 128 channels) */
                    avx2_score_tokens8(codes, C, &l, 8, folded, bias, R, v.valid + t0, to, total);
                else if (V == 16)
                    avx2_score_tokens8(codes, C, &l, 16, folded, bias, R, v.valid + t0, to, total);
                else
                    avx2_score_tokens8(codes, C, &l, V, folded, bias, R, v.valid + t0, to, total);
            }
        }
        if (m[35]) /* outliers: q_d * correction added to their tokens' scores */
            add_corrections(v.key_outlier_index, v.key_outlier_value, m[35], P, D, v.valid, 0, P, R, qf, D, s, total,
                            1);
    }
}

/* adds the n value rows c[0 .. n) (codes less the middle one) weighted by step[rg][token[e]] (p * s of that row,
 * rg = row * groups + value group) to the rows r0 .. r0 + rows of acc [R, 8 * V] (value group g = vector i /
 * per_group), 4 vectors at a time: rows x 4 sums stay in registers over the n rows and are added in slot order,
 * one multiply-add each. Always inlined, so that a constant `rows` keeps the sums in registers (V % 4 == 0) */
static inline __attribute__((always_inline)) void avx2_value_regs(float *acc, int64_t r0, int64_t rows, int64_t V,
                                                                  int64_t groups, int64_t per_group,
                                                                  const float (*step)[8], const int *token,
                                                                  const __m256 (*c)[32], int64_t n) {
    for (int64_t i0 = 0; i0 < V; i0 += 4) {
        __m256 sum[3][4];
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < 4; i++) sum[r][i] = _mm256_loadu_ps(acc + (r0 + r) * 8 * V + 8 * (i0 + i));
        if (per_group % 4 == 0) { /* the 4 vectors in one value group: one weight a row */
            const float *weights[3];
            for (int64_t r = 0; r < rows; r++) weights[r] = step[(r0 + r) * groups + i0 / per_group];
            for (int64_t e = 0; e < n; e++) {
                const int slot = token[e];
                for (int64_t r = 0; r < rows; r++) {
                    const __m256 weight = _mm256_set1_ps(weights[r][slot]);
                    for (int64_t i = 0; i < 4; i++) sum[r][i] = _mm256_fmadd_ps(weight, c[e][i0 + i], sum[r][i]);
                }
            }
        } else
            for (int64_t e = 0; e < n; e++)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t i = 0; i < 4; i++)
                        sum[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(step[(r0 + r) * groups + (i0 + i) / per_group][token[e]]),
                                                    c[e][i0 + i], sum[r][i]);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < 4; i++) _mm256_storeu_ps(acc + (r0 + r) * 8 * V + 8 * (i0 + i), sum[r][i]);
    }
}

/* avx2_value_regs for every row, 3 rows at a time (12 sums, a weight and a code in the 16 registers) */
static inline __attribute__((always_inline)) void avx2_value_block(float *acc, int64_t R, int64_t V, int64_t groups,
                                                                   int64_t per_group, const float (*step)[8],
                                                                   const int *token, const __m256 (*c)[32],
                                                                   int64_t n) {
    int64_t r0 = 0;
    for (; r0 + 3 <= R; r0 += 3) avx2_value_regs(acc, r0, 3, V, groups, per_group, step, token, c, n);
    switch (R - r0) {
    case 2: avx2_value_regs(acc, r0, 2, V, groups, per_group, step, token, c, n); break;
    case 1: avx2_value_regs(acc, r0, 1, V, groups, per_group, step, token, c, n); break;
    default: break;
    }
}

/* the valid ones (bits_seen) of 8 value rows (packed at codes, C bytes apart) unpacked into c, then added to acc
 * (avx2_value_block). Always inlined, so that a constant V unrolls the unpacking as well as the sums */
static inline __attribute__((always_inline)) void avx2_value_slots8(float *acc, int64_t R, int64_t V, int64_t groups,
                                                                    int64_t per_group, float (*step)[8],
                                                                    const uint8_t *codes, int64_t C,
                                                                    const avx2_layout *l, int bits_seen,
                                                                    __m256 (*c)[32], int *token) {
    int64_t n = 0;
    for (int e = 0; e < 8; e++)
        if (bits_seen >> e & 1) {
            avx2_unpack_row(codes + e * C, 8 * V, l, c[n]);
            token[n++] = e;
        }
    avx2_value_block(acc, R, V, groups, per_group, (const float (*)[8])step, token, (const __m256 (*)[32])c, n);
}

/* adds the selected pages' values weighted by probs [R, total] (this segment's columns) to acc [R, D] (channel
 * order), 8 slots at a time: their weights times the value scales (p * s) and the centres' sums (p (m + mid * s),
 * 8 slots side by side) as vectors, then the valid slots' codes unpacked and added (avx2_value_block). The centres'
 * sums are added to the output once, at the end. */
static void avx2_values(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0, int64_t k1,
                        const float *probs, int64_t R, int64_t D, int64_t total, float *acc) {
    const int64_t P = m[3], Gv = m[6], C = m[34], groups = D / Gv, V = D / 8, per_group = Gv / 8, RG = R * groups;
    const avx2_layout l = avx2_layout_of((int)m[33]);
    __m256 low[64]; /* sum_t p_t (m_t + mid * s_t), slot t in lane t % 8 [r * groups + g] (RG <= 64: avx2_pages_fit) */
    for (int64_t rg = 0; rg < RG; rg++) low[rg] = _mm256_setzero_ps();
    float step[64][8];  /* p_t * s_t of the 8 slots [r * groups + g][slot] */
    __m256 c[8][32];    /* the valid slots' codes less the middle one [n][vector] */
    int token[8];       /* their slots */
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        if (page < 0) continue;
        const page_view v = view_page(p, m, b, j, page);
        const float *w = probs + k * P;
        for (int64_t t0 = 0; t0 < P; t0 += 8) {
            const __m256 seen = avx2_seen(v.valid + t0);
            const int bits_seen = _mm256_movemask_ps(seen);
            if (!bits_seen) continue;
            for (int64_t g = 0; g < groups; g++) {
                uint16_t scale_bits[8], min_bits[8];
                for (int e = 0; e < 8; e++) {
                    scale_bits[e] = v.value_scale[(t0 + e) * groups + g];
                    min_bits[e] = v.value_min[(t0 + e) * groups + g];
                }
                const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scale_bits)); /* exactly */
                const __m256 centre = _mm256_fmadd_ps(scale, l.middle,
                                                      _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)min_bits)));
                for (int64_t r = 0; r < R; r++) {
                    const __m256 weight = _mm256_loadu_ps(w + r * total + t0);
                    _mm256_storeu_ps(step[r * groups + g], _mm256_mul_ps(weight, scale));
                    const __m256 more = _mm256_fmadd_ps(weight, centre, low[r * groups + g]);
                    low[r * groups + g] = _mm256_blendv_ps(low[r * groups + g], more, seen); /* hidden slots: unread */
                }
            }
            const uint8_t *codes = v.value_codes + t0 * C;
            if (V == 8) /* a constant V: the unpacking and the sums unrolled */
                avx2_value_slots8(acc, R, 8, groups, per_group, step, codes, C, &l, bits_seen, c, token);
            else if (V == 16)
                avx2_value_slots8(acc, R, 16, groups, per_group, step, codes, C, &l, bits_seen, c, token);
            else
                avx2_value_slots8(acc, R, V, groups, per_group, step, codes, C, &l, bits_seen, c, token);
        }
        if (m[35]) /* outliers: p_t * correction added to their channels' outputs */
            add_corrections(v.value_outlier_index, v.value_outlier_value, m[35], P, D, v.valid, 0, P, R, w, total, acc,
                            D, 0);
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float centres = sum_lanes8(low[r * groups + g]);
            for (int64_t d = g * Gv; d < (g + 1) * Gv; d++) acc[r * D + d] += centres;
        }
}

#endif
