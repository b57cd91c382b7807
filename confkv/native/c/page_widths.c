/* The read of key pages whose channels each have a width of their own (format "channel_bits",
 * confkv/tiers/channel_bits.py; issue 31). Part of kernels.c; page_tasks.c scores a page segment with
 * widths_scores when its meta[48] is set. Its values are KIVI's, read by the other readers.
 *
 * Codes. A token's key codes are packed channel after channel, channel d's code in widths[d] bits (0-8) at bit
 * offset[d] = widths[0] + ... + widths[d - 1] of the row, least significant bit first (channel_bits.pack). A code
 * spans at most two bytes, and a code's bits lie inside its row, so code d is
 *     ((row[lo] | row[hi] << 8) >> (offset % 8)) & (2^width - 1),  lo = offset / 8, hi = lo + 1,
 * with both indices clamped to the row's last byte: the second byte is only needed when the code crosses into it,
 * and where it does not, the mask drops what it adds; a width-0 channel (code 0: its group's minimum holds the
 * mean) past the row's last code masks everything. So no read leaves the row, whatever the widths say.
 * Keys. Per channel and key group of G tokens a float16 scale and minimum, x = minimum + code * scale as the torch
 * decode computes it (channel_bits.dequantize_groups); outliers are written over the dequantized row; each row is
 * scored as the row-by-row reader scores it (pages.c: page_scores). */

/* where each channel's code sits in a row of C bytes (a page's widths [D]): low and high byte, shift, mask */
typedef struct {
    int32_t *lo, *hi, *shift;
    uint32_t *mask;
} width_layout;

static void layout_widths(const uint8_t *widths, int64_t D, int64_t C, width_layout *w) {
    int64_t at = 0;
    for (int64_t d = 0; d < D; d++) {
        const int width = widths[d] > 8 ? 8 : widths[d];
        const int64_t lo = at / 8 < C - 1 ? at / 8 : C - 1;
        w->lo[d] = (int32_t)lo;
        w->hi[d] = (int32_t)(lo + 1 < C ? lo + 1 : C - 1);
        w->shift[d] = (int32_t)(at % 8);
        w->mask[d] = (1u << width) - 1u;
        at += width;
    }
}

/* the D codes of one packed row, as floats in channel order */
static inline void unpack_widths(const uint8_t *restrict row, const width_layout *w, int64_t D, float *restrict codes) {
    const int32_t *restrict lo = w->lo, *restrict hi = w->hi, *restrict shift = w->shift;
    const uint32_t *restrict mask = w->mask;
    for (int64_t d = 0; d < D; d++)
        codes[d] = (float)((((uint32_t)row[lo[d]] | (uint32_t)row[hi[d]] << 8) >> shift[d]) & mask[d]);
}

/* the key widths of page `page` of sequence b, KV head j: [D] uint8 (meta [49..51] its strides, ptrs[13]) */
static inline const uint8_t *page_widths(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t page) {
    return (const uint8_t *)p[13] + b * m[49] + j * m[50] + page * m[51];
}

/* scores of the selected pages [k0, k1) of a channel-widths page segment (meta m, pointers p: see pages.c) for the
 * R query rows qf [R, D] (pre-scaled): s[r * total + slot], hidden slots -inf. buf: the task's work buffer (8 * D
 * floats used: codes, scale, minimum, key, then the layout's four int arrays), scratch: its outlier scratch. */
static void widths_scores(const page_args *a, const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0,
                          int64_t k1, const float *qf, float *scores, float *buf, int32_t *scratch) {
    const int64_t P = m[3], G = m[5], C = m[7], D = a->D, R = a->R, total = a->total, O = m[35];
    float *codes = buf, *scale = buf + D, *minimum = buf + 2 * D, *key = buf + 3 * D;
    width_layout layout = {(int32_t *)(buf + 4 * D), (int32_t *)(buf + 5 * D), (int32_t *)(buf + 6 * D),
                           (uint32_t *)(buf + 7 * D)};
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
            unpack_widths(v.key_codes + t * C, &layout, D, codes);
            for (int64_t d = 0; d < D; d++) key[d] = minimum[d] + codes[d] * scale[d];
            if (O) restore_outliers(&outliers, t, NULL, key);
            for (int64_t r = 0; r < R; r++) s[r * total + t] = dot_tree(qf + r * D, key, D);
        }
    }
}
