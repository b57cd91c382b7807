/* The fast read of a packed page (issue 32): codes unpacked in plane order, so that the unpacking vectorises
 * (with AVX-512 VBMI and heads of a multiple of 64 channels: in channel order, 64 codes a multishift). Part of
 * kernels.c; page_tasks.c calls it for segments whose value group Gv is a multiple of 8 and pages.c's
 * page_scores / page_values for the others (one row at a time in channel order).
 *
 * Plane order. lowbit.pack puts code d of a row at bit bits * d of its bytes: a byte holds 8 / bits codes
 * (2, 4, 8 bits), a 3-byte word 8 codes (3 bits). Unpacking code d to position d interleaves, which does not
 * vectorise; within each value group of Gv channels this unpacks the first code of every byte (word), then the
 * second, and so on: position p = g * Gv + c * W + w holds channel d = g * Gv + w * n + c (n codes a unit, W =
 * Gv / n units a group). A dot product does not care about the order of its terms, so the query, the key
 * group's scale and minimum are put in the same order (once per segment and group), and the values' weighted
 * sum is kept in it and put back at the end. A value group keeps its channels, so its scale applies to a
 * contiguous run. Each key and value row is dequantized as lowbit does it (minimum + code * scale); only the
 * order of a score's terms differs from the row-by-row read (dot_tree). */

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define CONFKV_VBMI 1 /* unpack_simd: 64 codes a multishift */
#endif

/* the channel at plane position p (see above), for codes of `bits` bits in value groups of Gv channels */
static inline int64_t planar_channel(int64_t p, int bits, int64_t Gv) {
    const int64_t n = bits == 3 ? 8 : 8 / bits, W = Gv / n, g = p / Gv, rest = p % Gv;
    return g * Gv + (rest % W) * n + rest / W;
}

/* 1 when rows of D codes are unpacked by unpack_simd (in channel order) */
static inline int unpacks_in_channel_order(int64_t D) {
#if defined(CONFKV_VBMI)
    return D % 64 == 0;
#else
    (void)D;
    return 0;
#endif
}

/* the channel of every plane position of rows of `bits`-bit codes (channel order with unpack_simd), then the plane
 * position of every channel (where an outlier of that channel is written) */
static void planar_channels(int bits, int64_t D, int64_t Gv, int32_t *channel, int32_t *position) {
    for (int64_t p = 0; p < D; p++)
        channel[p] = unpacks_in_channel_order(D) ? (int32_t)p : (int32_t)planar_channel(p, bits, Gv);
    for (int64_t p = 0; p < D; p++) position[channel[p]] = (int32_t)p;
}

#if defined(CONFKV_VBMI)
/* unpack_simd's byte spread and shifts per bit width (index 2, 3, 4; 8 needs none), built once before any read
 * (simd_tables, from confkv_page_read) */
static uint8_t simd_spread[5][64], simd_shift[5][64];
static int simd_tables_built;

static void simd_tables(void) {
    if (simd_tables_built) return;
    for (int bits = 2; bits <= 4; bits++)
        for (int i = 0; i < 64; i++) {
            simd_spread[bits][i] = (uint8_t)(i % 8 < bits ? bits * (i / 8) + i % 8 : 0);
            simd_shift[bits][i] = (uint8_t)(bits * (i % 8));
        }
    simd_tables_built = 1;
}

/* D % 64 == 0 codes of one packed row, in channel order, 64 at a time: the 8 * bits bytes of 64 codes are
 * spread so that 64-bit lane k holds the `bits` bytes of codes 8k .. 8k + 7, one multishift takes each code's
 * 8 bits at bit bits * c of its lane, and the mask keeps its `bits` */
static void unpack_simd(const uint8_t *restrict src, int bits, int64_t D, float *restrict dst) {
    const int table = bits == 8 ? 2 : bits; /* 8 bits: no spread, no shift */
    const __m512i spread_index = _mm512_loadu_si512(simd_spread[table]), shifts = _mm512_loadu_si512(simd_shift[table]);
    const __m512i keep = _mm512_set1_epi8((char)((1 << bits) - 1));
    const __mmask64 bytes = bits == 8 ? ~(__mmask64)0 : ((__mmask64)1 << (8 * bits)) - 1;
    for (int64_t d = 0; d < D; d += 64, src += 8 * bits) {
        __m512i codes = _mm512_maskz_loadu_epi8(bytes, src);
        if (bits != 8)
            codes = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, _mm512_permutexvar_epi8(spread_index, codes)), keep);
        _mm512_storeu_ps(dst + d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(codes))));
        _mm512_storeu_ps(dst + d + 16, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 1))));
        _mm512_storeu_ps(dst + d + 32, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 2))));
        _mm512_storeu_ps(dst + d + 48, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(codes, 3))));
    }
}
#else
static void simd_tables(void) {}
#endif

/* dot product in 16 running sums (term i goes to sum i % 16), then the sums added as a tree: sum l + sum l + 8,
 * then + 4, + 2, + 1 (a chain of 16 dependent adds is what `omp simd reduction` leaves without -ffast-math).
 * With AVX-512 the 16 sums are one register, added by the same tree in registers. */
#if defined(__AVX512F__)
static inline float dot_tree(const float *restrict a, const float *restrict b, int64_t n) {
    __m512 lane = _mm512_setzero_ps();
    const int64_t whole = n - n % 16;
    for (int64_t i = 0; i < whole; i += 16) lane = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), lane);
    if (whole < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - whole)) - 1u);
        lane = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + whole), _mm512_maskz_loadu_ps(tail, b + whole),
                                     lane, tail);
    }
    const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(lane), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lane), 1)));
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#else
static inline float dot_tree(const float *restrict a, const float *restrict b, int64_t n) {
    float lane[16] = {0};
    const int64_t whole = n - n % 16;
    for (int64_t i = 0; i < whole; i += 16)
        for (int l = 0; l < 16; l++) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int64_t i = whole; i < n; i++) lane[i - whole] = fmaf(a[i], b[i], lane[i - whole]);
    for (int width = 8; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lane[l] += lane[l + width];
    return lane[0];
}
#endif

/* the D codes of one packed row as floats, in plane order (Gv % 8 == 0) */
static void unpack_planar(const uint8_t *restrict src, int bits, int64_t D, int64_t Gv, float *restrict dst) {
#if defined(CONFKV_VBMI)
    if (unpacks_in_channel_order(D)) {
        unpack_simd(src, bits, D, dst);
        return;
    }
#endif
    if (bits == 8) {
        for (int64_t d = 0; d < D; d++) dst[d] = (float)src[d];
        return;
    }
    for (int64_t g = 0; g < D / Gv; g++) {
        float *restrict o = dst + g * Gv;
        if (bits == 3) { /* words of 3 bytes, 8 codes each, 32 words at a time */
            const int64_t W = Gv / 8;
            const uint8_t *s = src + g * 3 * W;
            uint32_t word[32];
            for (int64_t w0 = 0; w0 < W; w0 += 32) {
                const int64_t n = W - w0 < 32 ? W - w0 : 32;
                for (int64_t w = 0; w < n; w++) {
                    const uint8_t *b = s + 3 * (w0 + w);
                    word[w] = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16;
                }
                for (int c = 0; c < 8; c++)
                    for (int64_t w = 0; w < n; w++) o[c * W + w0 + w] = (float)((word[w] >> (3 * c)) & 7u);
            }
        } else if (bits == 4) {
            const int64_t W = Gv / 2;
            const uint8_t *restrict s = src + g * W;
            for (int64_t w = 0; w < W; w++) {
                o[w] = (float)(s[w] & 15u);
                o[W + w] = (float)(s[w] >> 4);
            }
        } else { /* 2 bits */
            const int64_t W = Gv / 4;
            const uint8_t *restrict s = src + g * W;
            for (int c = 0; c < 4; c++)
                for (int64_t w = 0; w < W; w++) o[c * W + w] = (float)((s[w] >> (2 * c)) & 3u);
        }
    }
}

enum { VALUE_BLOCK = 4 }; /* value rows added to the weighted sum per pass over it */

/* work buffers of one unit for the fast path: codes, scale and minimum rows (D each), VALUE_BLOCK key or value
 * rows (D each), and the query rows and the weighted sum in plane order (R * D each) */
static int64_t planar_scratch(int64_t R, int64_t D) { return (3 + VALUE_BLOCK) * D + 2 * R * D; }

/* a page with outliers, scored: its valid key rows dequantized whole into rows (P * D floats, the task's outlier
 * scratch), its outliers' corrections added once (patch_outliers: a patch per row would branch on every row), then
 * each valid row scored as planar_scores scores it; slots that hold no token get -inf */
static void planar_page_scores_patched(const page_view *v, const int64_t *m, const int32_t *channel,
                                       const float *query, int64_t R, int64_t D, int64_t total, float *s, float *buf,
                                       float *rows) {
    const int64_t P = m[3], G = m[5], Gv = m[6], C = m[7], O = m[35];
    const int bits = (int)m[4];
    float *codes = buf, *scale = buf + D, *minimum = buf + 2 * D;
    const uint8_t *valid = v->valid;
    int64_t loaded = -1; /* the key group whose scale and minimum (plane order) are in the buffers */
    for (int64_t t = 0; t < P; t++) {
        if (!valid[t]) {
            for (int64_t r = 0; r < R; r++) s[r * total + t] = -INFINITY;
            continue;
        }
        if (t / G != loaded) {
            loaded = t / G;
            for (int64_t i = 0; i < D; i++) {
                scale[i] = f16_to_f32(v->key_scale[loaded * D + channel[i]]);
                minimum[i] = f16_to_f32(v->key_min[loaded * D + channel[i]]);
            }
        }
        unpack_planar(v->key_codes + t * C, bits, D, Gv, codes);
        for (int64_t i = 0; i < D; i++) rows[t * D + i] = minimum[i] + codes[i] * scale[i];
    }
    patch_outliers(v->key_outlier_index, v->key_outlier_value, O, P, D, channel + D, rows);
    for (int64_t t = 0; t < P; t++)
        if (valid[t])
            for (int64_t r = 0; r < R; r++) s[r * total + t] = dot_tree(query + r * D, rows + t * D, D);
}

/* scores of the selected pages of one paged segment (meta m, pointers p: see pages.c) for the R query rows qf
 * [R, D] (pre-scaled); s[r * total + slot]; hidden slots -inf. channel: the key codes' plane order (channel per
 * position, then position per channel); scratch: the task's outlier scratch (planar_page_scores_patched) */
static void planar_scores(const void *const *p, const int64_t *m, const int32_t *channel, int64_t b, int64_t j,
                          int64_t k0, int64_t k1, const float *qf, int64_t R, int64_t D, int64_t total, float *scores,
                          float *buf, int32_t *scratch) {
    const int64_t P = m[3], G = m[5], Gv = m[6], C = m[7];
    const int bits = (int)m[4];
    float *codes = buf, *scale = buf + D, *minimum = buf + 2 * D, *key = buf + 3 * D;
    float *query = buf + (3 + VALUE_BLOCK) * D;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < D; i++) query[r * D + i] = qf[r * D + channel[i]];
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        float *s = scores + k * P;
        if (page < 0) {
            hide_slots(s, R, P, total);
            continue;
        }
        const page_view v = view_page(p, m, b, j, page);
        if (m[35]) {
            planar_page_scores_patched(&v, m, channel, query, R, D, total, s, buf, (float *)scratch);
            continue;
        }
        const uint8_t *valid = v.valid, *kc = v.key_codes;
        const uint16_t *ks = v.key_scale, *km = v.key_min;
        for (int64_t first = 0; first < P; first += G) {
            int any = 0;
            for (int64_t t = first; t < first + G; t++) any |= valid[t];
            if (any) /* the key group's per-channel scale and minimum, in plane order */
                for (int64_t i = 0; i < D; i++) {
                    scale[i] = f16_to_f32(ks[(first / G) * D + channel[i]]);
                    minimum[i] = f16_to_f32(km[(first / G) * D + channel[i]]);
                }
            for (int64_t t = first; t < first + G; t++) {
                if (!valid[t]) {
                    for (int64_t r = 0; r < R; r++) s[r * total + t] = -INFINITY;
                    continue;
                }
                unpack_planar(kc + t * C, bits, D, Gv, codes);
                for (int64_t i = 0; i < D; i++) key[i] = minimum[i] + codes[i] * scale[i];
                for (int64_t r = 0; r < R; r++) s[r * total + t] = dot_tree(query + r * D, key, D);
            }
        }
    }
}

/* a value row from its codes (plane order): a value group keeps its channels, so its minimum and scale apply to a
 * contiguous run */
static inline void dequantize_values_row(const float *codes, const float *scale, const float *minimum, int64_t groups,
                                         int64_t Gv, float *value) {
    for (int64_t g = 0; g < groups; g++) {
        const float low = minimum[g], step = scale[g];
        float *restrict v = value + g * Gv;
        const float *restrict c = codes + g * Gv;
        for (int64_t d = 0; d < Gv; d++) v[d] = low + c[d] * step;
    }
}

/* adds the n (<= VALUE_BLOCK) value rows vrow, of slots slot, weighted by w[r * total + slot], to weighted [R, D],
 * acc = fma(p, value, acc) in slot order (the rounding of the row-by-row read) */
static inline void add_value_rows(float *weighted, int64_t R, int64_t D, const float *w, int64_t total,
                                  const float *const *vrow, const int64_t *slot, int64_t n) {
    for (int64_t r = 0; r < R; r++) {
        float *restrict o = weighted + r * D;
        if (n == VALUE_BLOCK) {
            const float w0 = w[r * total + slot[0]], w1 = w[r * total + slot[1]];
            const float w2 = w[r * total + slot[2]], w3 = w[r * total + slot[3]];
            const float *restrict v0 = vrow[0], *restrict v1 = vrow[1], *restrict v2 = vrow[2];
            const float *restrict v3 = vrow[3];
            for (int64_t i = 0; i < D; i++)
                o[i] = fmaf(w3, v3[i], fmaf(w2, v2[i], fmaf(w1, v1[i], fmaf(w0, v0[i], o[i]))));
        } else {
            for (int64_t e = 0; e < n; e++) {
                const float weight = w[r * total + slot[e]];
                const float *restrict v = vrow[e];
                for (int64_t i = 0; i < D; i++) o[i] = fmaf(weight, v[i], o[i]);
            }
        }
    }
}

/* a page with outliers, its values added to weighted (plane order): its valid value rows dequantized whole into rows
 * (P * D floats), its outliers' corrections added once, then added VALUE_BLOCK rows a pass as planar_values adds
 * them */
static void planar_page_values_patched(const page_view *v, const int64_t *m, const int32_t *channel, const float *w,
                                       int64_t R, int64_t D, int64_t total, float *weighted, float *buf, float *rows) {
    const int64_t P = m[3], Gv = m[6], C = m[34], groups = D / Gv, O = m[35];
    const int bits = (int)m[33];
    float *codes = buf, *scale = buf + D, *minimum = buf + 2 * D;
    for (int64_t t = 0; t < P; t++) {
        if (!v->valid[t]) continue;
        load_f16_row(v->value_scale + t * groups, groups, scale);
        load_f16_row(v->value_min + t * groups, groups, minimum);
        unpack_planar(v->value_codes + t * C, bits, D, Gv, codes);
        dequantize_values_row(codes, scale, minimum, groups, Gv, rows + t * D);
    }
    patch_outliers(v->value_outlier_index, v->value_outlier_value, O, P, D, channel + D, rows);
    int64_t slot[VALUE_BLOCK], n = 0;
    const float *vrow[VALUE_BLOCK];
    for (int64_t t = 0; t <= P; t++) {
        if (t < P && v->valid[t]) {
            vrow[n] = rows + t * D;
            slot[n++] = t;
        }
        if (n == VALUE_BLOCK || (t == P && n)) {
            add_value_rows(weighted, R, D, w, total, vrow, slot, n);
            n = 0;
        }
    }
}

/* adds the selected pages' values weighted by probs [R, total] (this segment's columns) to acc [R, D]: acc is
 * put in plane order, each value row dequantized as lowbit does it (minimum + code * scale) and added in slot
 * order, acc = fma(p, value, acc) (the rounding of the row-by-row read; VALUE_BLOCK rows a pass over acc), and
 * acc put back. channel: the value codes' plane order (as planar_scores'); scratch: the task's outlier scratch
 * (planar_page_values_patched) */
static void planar_values(const void *const *p, const int64_t *m, const int32_t *channel, int64_t b, int64_t j,
                          int64_t k0, int64_t k1, const float *probs, int64_t R, int64_t D, int64_t total, float *acc,
                          float *buf, int32_t *scratch) {
    const int64_t P = m[3], Gv = m[6], C = m[34], groups = D / Gv;
    const int bits = (int)m[33];
    float *codes = buf, *scale = buf + D, *minimum = buf + 2 * D, *block = buf + 3 * D;
    float *weighted = buf + (3 + VALUE_BLOCK) * D + R * D;
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < D; i++) weighted[r * D + i] = acc[r * D + channel[i]];
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        if (page < 0) continue;
        const page_view v = view_page(p, m, b, j, page);
        const float *w = probs + k * P;
        if (m[35]) {
            planar_page_values_patched(&v, m, channel, w, R, D, total, weighted, buf, (float *)scratch);
            continue;
        }
        const uint8_t *valid = v.valid, *vc = v.value_codes;
        const uint16_t *vs = v.value_scale, *vm = v.value_min;
        int64_t slot[VALUE_BLOCK], n = 0;
        const float *vrow[VALUE_BLOCK] = {block, block + D, block + 2 * D, block + 3 * D};
        for (int64_t t = 0; t <= P; t++) {
            if (t < P && valid[t]) { /* dequantize the row into the block */
                load_f16_row(vs + t * groups, groups, scale);
                load_f16_row(vm + t * groups, groups, minimum);
                unpack_planar(vc + t * C, bits, D, Gv, codes);
                dequantize_values_row(codes, scale, minimum, groups, Gv, block + n * D);
                slot[n++] = t;
            }
            if (n == VALUE_BLOCK || (t == P && n)) { /* add the block's rows, in slot order */
                add_value_rows(weighted, R, D, w, total, vrow, slot, n);
                n = 0;
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < D; i++) acc[r * D + channel[i]] = weighted[r * D + i];
}
