/* The read of key pages whose channels each have a width of their own (format "channel_bits",
 * confkv/tiers/channel_bits.py; issue 31). Part of kernels.c; page_tasks.c scores a page segment with
 * widths_scores when its meta[48] is set. Its values are KIVI's, read by the other readers.
 *
 * Codes. A token's key codes are packed channel after channel, channel d's code in widths[d] bits (0-8) at bit
 * offset[d] = widths[0] + ... + widths[d - 1] of the row, least significant bit first (channel_bits.pack). A code
 * spans at most two bytes, and a code's bits lie inside its row, so code d is
 *     ((row[lo] | row[lo + 1] << 8) >> (offset % 8)) & (2^width - 1),  lo = offset / 8,
 * the second byte only needed when the code crosses into it (where it does not, the mask drops what it adds). Each
 * row is copied into a padded buffer (pad_row) and 4 bytes are read at each code's low byte (8 codes a gather with
 * AVX2); lo is clamped to the row's last byte, and the byte after the row repeats the last, as channel_bits.unpack
 * clamps both indices. So no read leaves the row whatever the widths say, and a width-0 channel (code 0: its
 * group's minimum holds the mean) masks everything.
 * Keys. Per channel and key group of G tokens a float16 scale and minimum, x = minimum + code * scale as the torch
 * decode computes it (channel_bits.dequantize_groups). With AVX2 and FMA, heads of a multiple of 8 channels and up
 * to WIDTHS_FUSED_ROWS query rows, a row is unpacked, dequantized and scored in registers (score_row_fused, its
 * outliers added as corrections); otherwise it is dequantized, its outliers written over it, and scored as the
 * row-by-row reader scores it (pages.c: page_scores). Only the order of float32 sums differs from the torch read. */

/* where each channel's code sits in a row of C bytes (a page's widths [D]): its low byte, shift and mask */
typedef struct {
    int32_t *lo, *shift, *mask;
} width_layout;

static void layout_widths(const uint8_t *widths, int64_t D, int64_t C, width_layout *w) {
    int64_t at = 0;
    for (int64_t d = 0; d < D; d++) {
        const int width = widths[d] > 8 ? 8 : widths[d];
        w->lo[d] = (int32_t)(at / 8 < C - 1 ? at / 8 : C - 1);
        w->shift[d] = (int32_t)(at % 8);
        w->mask[d] = (int32_t)((1u << width) - 1u);
        at += width;
    }
}

/* a row of C bytes copied into pad (C + 4 bytes) so that 4 bytes can be read at any of its byte indices: the
 * byte after it repeats its last (where a code's second byte would be clamped to the last, as channel_bits.unpack
 * clamps it), then zeros (bits no mask keeps) */
static inline void pad_row(const uint8_t *row, int64_t C, uint8_t *pad) {
    memcpy(pad, row, (size_t)C);
    pad[C] = row[C - 1];
    pad[C + 1] = pad[C + 2] = pad[C + 3] = 0;
}

#if defined(__AVX2__)
/* codes d .. d + 7 of a padded row as floats: 4 bytes gathered at each low byte, shifted, masked */
static inline __m256 gather_codes(const uint8_t *pad, const width_layout *w, int64_t d) {
    const __m256i word = _mm256_i32gather_epi32((const int *)pad, _mm256_loadu_si256((const __m256i *)(w->lo + d)), 1);
    const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(word, _mm256_loadu_si256((const __m256i *)(w->shift + d))),
                                          _mm256_loadu_si256((const __m256i *)(w->mask + d)));
    return _mm256_cvtepi32_ps(code);
}
#endif

/* the D codes of one padded row, as floats in channel order */
static inline void unpack_widths(const uint8_t *restrict pad, const width_layout *w, int64_t D, float *restrict codes) {
    int64_t d = 0;
#if defined(__AVX2__)
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(codes + d, gather_codes(pad, w, d));
#endif
    for (; d < D; d++) {
        uint32_t word;
        memcpy(&word, pad + w->lo[d], 4);
        codes[d] = (float)((word >> w->shift[d]) & (uint32_t)w->mask[d]);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
enum { WIDTHS_FUSED_ROWS = 16 }; /* query rows the fused scoring keeps in registers */

/* whether rows of D channels for R query rows are scored by score_row_fused */
static inline int widths_fused(int64_t R, int64_t D) { return R <= WIDTHS_FUSED_ROWS && D % 8 == 0; }

/* one padded row's scores for the R query rows qf [R, D]: 8 channels a step, their codes gathered, dequantized
 * (minimum + code * scale, one fused multiply-add) and multiplied into each query row's 8 running sums, which are
 * then added (sum_lanes8). The row's outliers, when it has any, are added after as corrections
 * q_d * (value - dequantized entry), the entry the torch read writes them over. */
static void score_row_fused(const uint8_t *pad, const width_layout *w, const float *scale, const float *minimum,
                            const float *qf, int64_t R, int64_t D, const page_outliers *outliers, int64_t t,
                            float *out) {
    __m256 acc[WIDTHS_FUSED_ROWS];
    for (int64_t r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 key = _mm256_fmadd_ps(gather_codes(pad, w, d), _mm256_loadu_ps(scale + d), _mm256_loadu_ps(minimum + d));
        for (int64_t r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * D + d), key, acc[r]);
    }
    for (int64_t r = 0; r < R; r++) out[r] = sum_lanes8(acc[r]);
    if (!outliers) return;
    for (int32_t i = t ? outliers->end[t - 1] : 0; i < outliers->end[t]; i++) {
        const int32_t e = outliers->order[i];
        const int64_t d = outliers->index[e] - t * D;
        uint32_t word;
        memcpy(&word, pad + w->lo[d], 4);
        const float entry = fmaf((float)((word >> w->shift[d]) & (uint32_t)w->mask[d]), scale[d], minimum[d]);
        const float delta = f16_to_f32(outliers->value[e]) - entry;
        for (int64_t r = 0; r < R; r++) out[r] = fmaf(qf[r * D + d], delta, out[r]);
    }
}
#else
static inline int widths_fused(int64_t R, int64_t D) { (void)R, (void)D; return 0; }
static void score_row_fused(const uint8_t *pad, const width_layout *w, const float *scale, const float *minimum,
                            const float *qf, int64_t R, int64_t D, const page_outliers *outliers, int64_t t,
                            float *out) { (void)pad, (void)w, (void)scale, (void)minimum, (void)qf, (void)R, (void)D,
                                          (void)outliers, (void)t, (void)out; }
#endif

/* the key widths of page `page` of sequence b, KV head j: [D] uint8 (meta [49..51] its strides, ptrs[13]) */
static inline const uint8_t *page_widths(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t page) {
    return (const uint8_t *)p[13] + b * m[49] + j * m[50] + page * m[51];
}

/* scores of the selected pages [k0, k1) of a channel-widths page segment (meta m, pointers p: see pages.c) for the
 * R query rows qf [R, D] (pre-scaled): s[r * total + slot], hidden slots -inf. buf: the task's work buffer (8 * D + R
 * floats used: codes, scale, minimum, key, the layout's three int arrays, the padded row, the fused scores),
 * scratch: its outlier scratch. */
static void widths_scores(const page_args *a, const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0,
                          int64_t k1, const float *qf, float *scores, float *buf, int32_t *scratch) {
    const int64_t P = m[3], G = m[5], C = m[7], D = a->D, R = a->R, total = a->total, O = m[35];
    float *codes = buf, *scale = buf + D, *minimum = buf + 2 * D, *key = buf + 3 * D;
    width_layout layout = {(int32_t *)(buf + 4 * D), (int32_t *)(buf + 5 * D), (int32_t *)(buf + 6 * D)};
    uint8_t *pad = (uint8_t *)(buf + 7 * D); /* C + 4 <= D + 4 bytes: within D floats (D >= 2) */
    const int fused = widths_fused(R, D);
    float *row = buf + 8 * D; /* the fused scoring's R scores: 8 * D + R floats fit the 7 * D + 2 * R * D it has */
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        float *s = scores + k * P;
        if (page < 0) {
            hide_slots(s, R, P, total);
            continue;
        }
        const page_view v = view_page(p, m, b, j, page);
        layout_widths(page_widths(p, m, b, j, page), D, C, &layout);
        page_outliers outliers;
        if (O) outliers = sort_outliers(v.key_outlier_index, v.key_outlier_value, O, P, D, scratch);
        int64_t loaded = -1; /* the key group whose scale and minimum are in the buffers */
        for (int64_t t = 0; t < P; t++) {
            if (!v.valid[t]) {
                for (int64_t r = 0; r < R; r++) s[r * total + t] = -INFINITY;
                continue;
            }
            if (t / G != loaded) {
                loaded = t / G;
                load_f16_row(v.key_scale + loaded * D, D, scale);
                load_f16_row(v.key_min + loaded * D, D, minimum);
            }
            pad_row(v.key_codes + t * C, C, pad);
            if (fused) {
                score_row_fused(pad, &layout, scale, minimum, qf, R, D, O ? &outliers : NULL, t, row);
                for (int64_t r = 0; r < R; r++) s[r * total + t] = row[r];
                continue;
            }
            unpack_widths(pad, &layout, D, codes);
            for (int64_t d = 0; d < D; d++) key[d] = minimum[d] + codes[d] * scale[d];
            if (O) restore_outliers(&outliers, t, NULL, key);
            for (int64_t r = 0; r < R; r++) s[r * total + t] = dot_tree(qf + r * D, key, D);
        }
    }
}
