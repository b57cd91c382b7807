/* The AVX-512 read of packed pages (issue 32): the preset's pages (no outliers, heads of a multiple of 64
 * channels up to 256, key groups and pages of a multiple of 16 tokens, value groups of a multiple of 16 channels,
 * at most 64 query rows x value groups) with the dequantization folded into the arithmetic, so that no key or
 * value row is ever written out. Part of kernels.c; page_tasks.c calls it where simd_pages_fit, and page_codes.c's
 * planar readers elsewhere.
 *
 * Keys. A key group of G tokens shares a per-channel scale s and minimum m, so for a query row q and the middle
 * code mid = (2^bits - 1) / 2
 *     q . (m + c * s) = q . (m + mid * s) + (q * s) . (c - mid):
 * q * s and the first term are computed once a group (R * D products, R dot products), and each token costs its
 * codes unpacked (unpack_registers: multishift, then a 16-entry lookup of (code - mid), in registers) and R * D / 16
 * fused multiply-adds. The 16 running sums of 16 tokens are added by one tree (sum16: 15 pairs of shuffles and adds
 * for 16 scores, 12 of them within 128-bit blocks, where a horizontal sum per score costs about 8 dependent steps).
 * Values. A value row's group of Gv channels shares a per-token scale and minimum, so
 *     sum_t p_t (m_t + c_t * s_t) = sum_t p_t (m_t + mid * s_t) + sum_t (p_t s_t) (c_t - mid):
 * 16 slots at a time, their weights p_t * s_t and the first sum's terms are vectors (the first sum kept 16 slots
 * side by side per row and group, added up and to the output once at the end), then the valid slots' centred codes
 * are added to the R x D sums, which stay in registers over the 16 slots (add_value_block; in slot order).
 * Centring on the middle code keeps both terms about the size of the result: split at the minimum instead, the
 * two terms are about the size of the range and cancel (3e-6 off the row-by-row read where centred is 1e-7).
 * Otherwise the read differs from the row-by-row one only in the order and grouping of float32 products and sums
 * (tests/native/test_native_pages.py bounds them). Slots that hold no token score -inf and are never weighted
 * (their codes are read; their value scales are read but never used: a key group with no valid token is skipped
 * whole). */

#if defined(CONFKV_VBMI)

/* 1 when every page of segment m (R query rows, head dim D) is read here */
static inline int simd_pages_fit(const int64_t *m, int64_t R, int64_t D) {
    return D % 64 == 0 && D <= 256 && m[3] % 16 == 0 && m[5] % 16 == 0 && m[6] % 16 == 0 && !m[35] &&
           R * (D / m[6]) <= 64;
}

/* the unpacking constants of `bits`-bit codes (unpack_simd's tables, built by simd_tables, and the lookup) */
typedef struct {
    __m512i spread, shifts, lanes[4]; /* lanes[k]: byte 16k + i of the codes to the low byte of 32-bit lane i */
    __mmask64 bytes;
    __m512 middle;   /* (2^bits - 1) / 2 */
    __m512 centred;  /* entry e: (e mod 2^bits) - middle, below 8 bits */
    float mid;
    int bits;
} code_layout;

static inline code_layout layout_of(int bits) {
    const int table = bits == 8 ? 2 : bits;
    code_layout l;
    l.bits = bits;
    l.spread = _mm512_loadu_si512(simd_spread[table]);
    l.shifts = _mm512_loadu_si512(simd_shift[table]);
    for (int k = 0; k < 4; k++) {
        uint8_t index[64];
        for (int i = 0; i < 64; i++) index[i] = (uint8_t)(16 * k + i / 4); /* the other 3 bytes of a lane: unread */
        l.lanes[k] = _mm512_loadu_si512(index);
    }
    l.bytes = bits == 8 ? ~(__mmask64)0 : ((__mmask64)1 << (8 * bits)) - 1;
    l.mid = 0.5f * (float)((1 << bits) - 1);
    l.middle = _mm512_set1_ps(l.mid);
    float centred[16];
    for (int e = 0; e < 16; e++) centred[e] = bits == 8 ? 0.0f : (float)(e % (1 << bits)) - l.mid;
    l.centred = _mm512_loadu_ps(centred);
    return l;
}

/* the D codes of one packed row (D % 64 == 0, channel order) less the middle code, as floats in c[D / 16]. Below 8
 * bits the 64 codes of 8 * bits bytes are spread and shifted into bytes (as unpack_simd, without the mask), each
 * 16 of them moved to the low byte of a 32-bit lane (`lanes`), and that lane's low 4 bits look up (code - middle)
 * in a table of 16 floats whose entries repeat every 2^bits (so the bits above the code are read and ignored):
 * two instructions for 16 codes where the conversion took four, and the same floats, exactly. */
static inline void unpack_registers(const uint8_t *restrict src, int64_t D, const code_layout *l, __m512 *c) {
    for (int64_t d = 0; d < D; d += 64, src += 8 * l->bits) {
        __m512i codes = _mm512_maskz_loadu_epi8(l->bytes, src);
        if (l->bits != 8) {
            codes = _mm512_multishift_epi64_epi8(l->shifts, _mm512_permutexvar_epi8(l->spread, codes));
            for (int k = 0; k < 4; k++)
                c[d / 16 + k] = _mm512_permutexvar_ps(_mm512_permutexvar_epi8(l->lanes[k], codes), l->centred);
        } else {
            c[d / 16] = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(codes))), l->middle);
            c[d / 16 + 1] = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 1))),
                                          l->middle);
            c[d / 16 + 2] = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 2))),
                                          l->middle);
            c[d / 16 + 3] = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 3))),
                                          l->middle);
        }
    }
}

/* lane i of the result: the sum of the 16 lanes of v[i] (the v are overwritten). Each level adds pairs of
 * vectors' halves put side by side: first within each 128-bit block (32-bit then 64-bit interleaves, after which
 * block k of w[j] holds block k's sums of tokens 4j .. 4j + 3), then across blocks (two 128-bit block shuffles), so
 * that lane i ends with token i's sum: 15 shuffle pairs and adds for 16 sums, 12 of them in-block. */
static inline __m512 sum16(__m512 *v) {
    for (int i = 0; i < 8; i++) /* block k of v[i]: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of tokens a, b = 2i, 2i + 1 */
        v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* block k of v[i]: block k's sums of tokens 4i .. 4i + 3 */
        const __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
        v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* blocks: [v0: 0 + 1, v0: 2 + 3, v1: 0 + 1, v1: 2 + 3] */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* the scores of 16 tokens (their packed key rows at codes, C bytes apart) for the R query rows: folded [R, 16 * V]
 * (q * s), bias [R] (q . centre); s[r * total + e] (-inf where valid[e] is 0). Always inlined, so that a constant V
 * unrolls the sums */
static inline __attribute__((always_inline)) void score_tokens16(const uint8_t *codes, int64_t C,
                                                                 const code_layout *l, int64_t V, const float *folded,
                                                                 const float *bias, int64_t R, const uint8_t *valid,
                                                                 float *s, int64_t total) {
    __m512 c[16][16]; /* the 16 tokens' codes less the middle one [token][vector] */
    for (int64_t e = 0; e < 16; e++)
        unpack_registers(codes + e * C, 16 * V, l, c[e]);
    const __mmask16 seen = _mm512_cmpneq_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)valid)),
                                                   _mm512_setzero_si512());
    for (int64_t r = 0; r < R; r++) {
        __m512 f[16], lane[16];
        for (int64_t i = 0; i < V; i++) f[i] = _mm512_loadu_ps(folded + r * 16 * V + 16 * i);
        for (int64_t e = 0; e < 16; e++) {
            __m512 acc = _mm512_mul_ps(f[0], c[e][0]);
            for (int64_t i = 1; i < V; i++) acc = _mm512_fmadd_ps(f[i], c[e][i], acc);
            lane[e] = acc;
        }
        const __m512 got = _mm512_add_ps(sum16(lane), _mm512_set1_ps(bias[r]));
        _mm512_storeu_ps(s + r * total, _mm512_mask_blend_ps(seen, _mm512_set1_ps(-INFINITY), got));
    }
}

/* adds the n value rows c[0 .. n) (codes less the middle one) weighted by step[rg][token[e]] (p * s of that row,
 * rg = row * groups + value group) to the rows r0 .. r0 + rows of acc [R, 16 * V] (value group g = vector i /
 * per_group). The sums of 4 vectors of each row stay in registers over the n rows (up to 16 chains of multiply-adds
 * side by side), which are added in slot order, one multiply-add each, as the row-by-row read adds them. Always
 * inlined, so that a constant `rows` keeps the sums in registers (V % 4 == 0: simd_pages_fit) */
static inline __attribute__((always_inline)) void add_value_regs(float *acc, int64_t r0, int64_t rows, int64_t V,
                                                                 int64_t groups, int64_t per_group,
                                                                 const float (*step)[16], const int *token,
                                                                 const __m512 (*c)[16], int64_t n) {
    for (int64_t i0 = 0; i0 < V; i0 += 4) {
        __m512 sum[4][4];
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < 4; i++) sum[r][i] = _mm512_loadu_ps(acc + (r0 + r) * 16 * V + 16 * (i0 + i));
        if (per_group % 4 == 0) { /* the 4 vectors in one value group: one weight a row */
            const float *weights[4];
            for (int64_t r = 0; r < rows; r++) weights[r] = step[(r0 + r) * groups + i0 / per_group];
            for (int64_t e = 0; e < n; e++) {
                const int slot = token[e];
                for (int64_t r = 0; r < rows; r++) {
                    const __m512 weight = _mm512_set1_ps(weights[r][slot]);
                    for (int64_t i = 0; i < 4; i++) sum[r][i] = _mm512_fmadd_ps(weight, c[e][i0 + i], sum[r][i]);
                }
            }
        } else
            for (int64_t e = 0; e < n; e++)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t i = 0; i < 4; i++)
                        sum[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(step[(r0 + r) * groups + (i0 + i) / per_group][token[e]]),
                                                    c[e][i0 + i], sum[r][i]);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < 4; i++) _mm512_storeu_ps(acc + (r0 + r) * 16 * V + 16 * (i0 + i), sum[r][i]);
    }
}

/* add_value_regs for every row, 4 rows at a time (a constant count, so the sums stay in registers) */
static inline __attribute__((always_inline)) void add_value_block(float *acc, int64_t R, int64_t V, int64_t groups,
                                                                  int64_t per_group, const float (*step)[16],
                                                                  const int *token, const __m512 (*c)[16],
                                                                  int64_t n) {
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) add_value_regs(acc, r0, 4, V, groups, per_group, step, token, c, n);
    switch (R - r0) {
    case 3: add_value_regs(acc, r0, 3, V, groups, per_group, step, token, c, n); break;
    case 2: add_value_regs(acc, r0, 2, V, groups, per_group, step, token, c, n); break;
    case 1: add_value_regs(acc, r0, 1, V, groups, per_group, step, token, c, n); break;
    default: break;
    }
}

/* scores of the selected pages k0 .. k1 of one paged segment (meta m, pointers p) for the R query rows qf [R, D]
 * (pre-scaled), as planar_scores; buf holds R * D + R + D floats */
static void simd_scores(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0, int64_t k1,
                        const float *qf, int64_t R, int64_t D, int64_t total, float *scores, float *buf) {
    const int64_t P = m[3], G = m[5], C = m[7], V = D / 16;
    const int bits = (int)m[4];
    const code_layout l = layout_of(bits);
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
                const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + 16 * i)));
                const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(km + 16 * i)));
                _mm512_storeu_ps(centre + 16 * i, _mm512_fmadd_ps(scale, l.middle, minimum));
                for (int64_t r = 0; r < R; r++)
                    _mm512_storeu_ps(folded + r * D + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(qf + r * D + 16 * i), scale));
            }
            for (int64_t r = 0; r < R; r++) bias[r] = dot_tree(qf + r * D, centre, D);
            for (int64_t t0 = first; t0 < first + G; t0 += 16) {
                const uint8_t *codes = v.key_codes + t0 * C;
                float *to = s + t0;
                if (V == 4) /* a constant V: the sums unrolled, each query row's folded row held in registers */
                    score_tokens16(codes, C, &l, 4, folded, bias, R, v.valid + t0, to, total);
                else if (V == 8)
                    score_tokens16(codes, C, &l, 8, folded, bias, R, v.valid + t0, to, total);
                else
                    score_tokens16(codes, C, &l, V, folded, bias, R, v.valid + t0, to, total);
            }
        }
    }
}

/* adds the selected pages' values weighted by probs [R, total] (this segment's columns) to acc [R, D], as
 * planar_values (channel order here), 16 slots at a time: their weights times the value scales (p * s) and the
 * centres' sums (p (m + mid * s), 16 slots side by side) as vectors, then the valid slots' codes unpacked and added
 * (add_value_block). The centres' sums are added to the output once, at the end. */
static void simd_values(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0, int64_t k1,
                        const float *probs, int64_t R, int64_t D, int64_t total, float *acc) {
    const int64_t P = m[3], Gv = m[6], C = m[34], groups = D / Gv, V = D / 16, per_group = Gv / 16, RG = R * groups;
    const code_layout l = layout_of((int)m[33]);
    __m512 low[64]; /* sum_t p_t (m_t + mid * s_t), slot t in lane t % 16 [r * groups + g] (RG <= 64: simd_pages_fit) */
    for (int64_t rg = 0; rg < RG; rg++) low[rg] = _mm512_setzero_ps();
    float step[64][16];   /* p_t * s_t of the 16 slots [r * groups + g][slot] */
    __m512 c[16][16];     /* the valid slots' codes less the middle one [n][vector] */
    int token[16];        /* their slots */
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        if (page < 0) continue;
        const page_view v = view_page(p, m, b, j, page);
        const float *w = probs + k * P;
        for (int64_t t0 = 0; t0 < P; t0 += 16) {
            const __mmask16 seen = _mm512_cmpneq_epi32_mask(
                _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(v.valid + t0))), _mm512_setzero_si512());
            if (!seen) continue;
            for (int64_t g = 0; g < groups; g++) {
                float scales[16], minima[16];
                for (int e = 0; e < 16; e++) { /* float16, exactly */
                    scales[e] = _cvtsh_ss(v.value_scale[(t0 + e) * groups + g]);
                    minima[e] = _cvtsh_ss(v.value_min[(t0 + e) * groups + g]);
                }
                const __m512 scale = _mm512_loadu_ps(scales);
                const __m512 centre = _mm512_fmadd_ps(scale, l.middle, _mm512_loadu_ps(minima));
                for (int64_t r = 0; r < R; r++) {
                    const __m512 weight = _mm512_loadu_ps(w + r * total + t0);
                    _mm512_storeu_ps(step[r * groups + g], _mm512_mul_ps(weight, scale));
                    low[r * groups + g] = _mm512_mask3_fmadd_ps(weight, centre, low[r * groups + g], seen);
                }
            }
            int64_t n = 0;
            for (int e = 0; e < 16; e++)
                if (seen >> e & 1) {
                    unpack_registers(v.value_codes + (t0 + e) * C, D, &l, c[n]);
                    token[n++] = e;
                }
            if (V == 4) /* a constant V: unrolled */
                add_value_block(acc, R, 4, groups, per_group, (const float (*)[16])step, token, (const __m512 (*)[16])c, n);
            else if (V == 8)
                add_value_block(acc, R, 8, groups, per_group, (const float (*)[16])step, token, (const __m512 (*)[16])c, n);
            else
                add_value_block(acc, R, V, groups, per_group, (const float (*)[16])step, token, (const __m512 (*)[16])c, n);
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float centres = _mm512_reduce_add_ps(low[r * groups + g]);
            for (int64_t d = g * Gv; d < (g + 1) * Gv; d++) acc[r * D + d] += centres;
        }
}

#endif
