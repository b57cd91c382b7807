/* The read of key pages whose channels each have a width of their own (format "channel_bits",
 * confkv/tiers/channel_bits.py; issue 31). Part of kernels.c; page_tasks.c scores a page segment with
 * widths_scores when its meta[48] is set. Its values are KIVI's, read by the other readers.
 *
 * Codes. A page's P * C bytes hold its channels one after the other, each channel's P codes token after token in
 * its width's bits (0-8), least significant bit first (channel_bits.pack): code (t, d) at bit
 *     at(t, d) = P * (widths[0] + ... + widths[d - 1]) + widths[d] * t,
 * so it is ((page[lo] | page[lo + 1] << 8) >> (at % 8)) & (2^width - 1), lo = at / 8 (a code spans at most two
 * bytes). Byte indices past the page are clamped to its last byte, as channel_bits.unpack clamps them, so no read
 * leaves the page whatever the widths say; widths above 8 are read as 8 (both reads). A width-0 channel (code 0:
 * its group's minimum holds the mean) adds its minimum only.
 * Keys. Per channel and key group of G tokens a float16 scale and minimum, x = minimum + code * scale as the torch
 * decode computes it (channel_bits.dequantize_groups).
 * The block read (AVX2 with FMA and F16C; pages and key groups of a multiple of 8 tokens; a page whose widths fit its
 * bytes): 8 tokens of one channel are `width` whole bytes at P / 8 * (widths before it) + width * t / 8, read as one
 * integer and spread over the 8 lanes (tokens 0-3 from its first 4 bytes, tokens 4-7 from the 4 bytes at width / 2,
 * each lane shifted and masked: block_scores), dequantized with one multiply-add and multiplied into each query
 * row's 8 running sums, one a token, over the page's channels of non-zero width; the sums are the 8 tokens' scores,
 * so none is added across lanes. Outliers are added after, q_d * their corrections (pages.c: add_corrections).
 * Otherwise each token's row is unpacked code by code, dequantized, its outliers' corrections added to it, and
 * scored as the row-by-row reader scores it (pages.c: page_scores). Only the order of
 * float32 sums differs from the torch read. */

/* code (t, d) of a page of `size` bytes whose channel d starts at bit `first` (P * the widths before it), at width
 * 1-8; byte indices clamped to the page (channel_bits.unpack) */
static inline uint32_t widths_code(const uint8_t *page, int64_t size, int32_t first, int width, int64_t t) {
    const int64_t at = first + (int64_t)width * t;
    const int64_t lo = at / 8 < size - 1 ? at / 8 : size - 1, hi = lo + 1 < size - 1 ? lo + 1 : size - 1;
    return (((uint32_t)page[lo] | (uint32_t)page[hi] << 8) >> (at % 8)) & ((1u << width) - 1u);
}

/* a page's channel layout from its widths [D]: each channel's width (at most 8) and first bit, the channels of
 * non-zero width in channel[0 .. n) (n returned), those of width 0 in channel[n .. D); *fits set when every
 * channel's bits fit the page's `size` bytes (the block read's condition: then no read passes the page) */
static int64_t widths_layout(const uint8_t *widths, int64_t D, int64_t P, int64_t size, int32_t *width,
                             int32_t *first, int32_t *channel, int *fits) {
    int64_t at = 0, n = 0, zeros = 0;
    for (int64_t d = 0; d < D; d++) {
        width[d] = widths[d] > 8 ? 8 : widths[d];
        first[d] = (int32_t)at;
        if (width[d])
            channel[n++] = (int32_t)d;
        else
            channel[D - 1 - zeros++] = (int32_t)d;
        at += P * width[d];
    }
    *fits = at <= 8 * size;
    return n;
}

/* the dequantized entry (t, d) of a page (x = minimum + code * scale; a width-0 channel: its minimum) */
static inline float widths_entry(const uint8_t *page, int64_t size, const int32_t *width, const int32_t *first,
                                 const float *scale, const float *minimum, int64_t t, int64_t d) {
    const float code = width[d] ? (float)widths_code(page, size, first[d], width[d], t) : 0.0f;
    return minimum[d] + code * scale[d];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CONFKV_WIDTH_BLOCKS 1
enum { WIDTHS_BLOCK_ROWS = 8, WIDTHS_BLOCK_SUMS = 8 }; /* query rows, and rows x blocks of 8 tokens, whose sums
                                                    * stay in registers at once (block_scores' eight) */

/* per width 0-8: the byte shuffle that puts bytes 0-3 of a 64-bit word in lanes 0-3 and bytes w/2 .. w/2 + 3 in
 * lanes 4-7 (vpshufb works within 128-bit halves: the word is in both), each lane's shift (token i's bit i * w less
 * the bits before its lane's first byte) and the mask 2^w - 1 */
static __m256i block_shuffle[9], block_shift[9], block_mask[9];
static int block_tables_built;

static void build_block_tables(void) {
    if (block_tables_built) return;
    for (int w = 0; w <= 8; w++) {
        int8_t shuffle[32];
        int32_t shift[8];
        for (int i = 0; i < 16; i++) shuffle[i] = (int8_t)(i % 4);               /* lanes 0-3: bytes 0-3 */
        for (int i = 0; i < 16; i++) shuffle[16 + i] = (int8_t)(w / 2 + i % 4); /* lanes 4-7: bytes w/2 .. +3 */
        for (int i = 0; i < 4; i++) {
            shift[i] = i * w;
            shift[4 + i] = 4 * w - 8 * (w / 2) + i * w; /* at most 4 + 3 * 7 with a code of 7 bits: inside the lane */
        }
        block_shuffle[w] = _mm256_loadu_si256((const __m256i *)shuffle);
        block_shift[w] = _mm256_loadu_si256((const __m256i *)shift);
        block_mask[w] = _mm256_set1_epi32((1 << w) - 1);
    }
    block_tables_built = 1;
}

/* a page's channels of non-zero width as the block read takes them, in channel order: the byte where each one's
 * codes start, its width, its scale and minimum (the key group's) and the query rows' entries [rows][n] */
typedef struct {
    const int32_t *start, *width;
    const float *scale, *minimum, *query;
    int64_t n;
} block_channels;

/* scores of tokens t .. t + 8 * blocks - 1 (t % 8 == 0) for `rows` query rows (blocks * rows <= WIDTHS_BLOCK_SUMS;
 * both constants where inlined): each channel's codes of 8 tokens (its `width` bytes at start + width * t / 8 of
 * `page`, read as 8 bytes: the caller pads the page where that passes its end) spread over the lanes, dequantized
 * (minimum + code * scale) and multiplied into each row's 8 sums; written to out[(r * blocks + k) * 8 + e] with the
 * row's sum over the width-0 channels (base[r]) added. Two blocks at a time keep two chains of multiply-adds a row
 * in flight and share each channel's loads. */
static inline __attribute__((always_inline)) void block_scores(const uint8_t *page, const block_channels *c,
                                                               int64_t rows, int64_t blocks, const float *base,
                                                               int64_t t, float *out) {
    /* sum j (< rows * blocks <= 8) is row j / blocks's over block j % blocks: eight named sums, not an array, which
     * the compiler kept in memory as well as in registers (a store a multiply-add) */
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    const int64_t n = c->n, block = t / 8;
    for (int64_t i = 0; i < n; i++) {
        const int w = c->width[i];
        const uint8_t *codes = page + c->start[i] + w * block;
        const __m256 scale = _mm256_broadcast_ss(c->scale + i), minimum = _mm256_broadcast_ss(c->minimum + i);
        const __m256i shuffle = block_shuffle[w], shift = block_shift[w], mask = block_mask[w];
        __m256 key[2];
        for (int64_t k = 0; k < blocks; k++) {
            const __m256i word = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(codes + w * k)));
            const __m256i lanes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(word, shuffle), shift), mask);
            key[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), scale, minimum);
        }
#define CONFKV_BLOCK_SUM(j)                                                                                          \
        if ((j) < rows * blocks)                                                                                     \
            s##j = _mm256_fmadd_ps(_mm256_broadcast_ss(c->query + ((j) / blocks) * n + i), key[(j) % blocks], s##j);
        CONFKV_BLOCK_SUM(0) CONFKV_BLOCK_SUM(1) CONFKV_BLOCK_SUM(2) CONFKV_BLOCK_SUM(3)
        CONFKV_BLOCK_SUM(4) CONFKV_BLOCK_SUM(5) CONFKV_BLOCK_SUM(6) CONFKV_BLOCK_SUM(7)
#undef CONFKV_BLOCK_SUM
    }
#define CONFKV_BLOCK_OUT(j) \
    if ((j) < rows * blocks) _mm256_storeu_ps(out + (j) * 8, _mm256_add_ps(s##j, _mm256_set1_ps(base[(j) / blocks])));
    CONFKV_BLOCK_OUT(0) CONFKV_BLOCK_OUT(1) CONFKV_BLOCK_OUT(2) CONFKV_BLOCK_OUT(3)
    CONFKV_BLOCK_OUT(4) CONFKV_BLOCK_OUT(5) CONFKV_BLOCK_OUT(6) CONFKV_BLOCK_OUT(7)
#undef CONFKV_BLOCK_OUT
}

/* block_scores with the row and block counts constants in each branch, so that the sums stay in registers: two
 * blocks for up to 4 rows, else one */
static void block_scores_rows(const uint8_t *page, const block_channels *c, int64_t rows, int64_t blocks,
                              const float *base, int64_t t, float *out) {
    if (blocks == 2) switch (rows) {
        case 1: block_scores(page, c, 1, 2, base, t, out); return;
        case 2: block_scores(page, c, 2, 2, base, t, out); return;
        case 3: block_scores(page, c, 3, 2, base, t, out); return;
        default: block_scores(page, c, 4, 2, base, t, out); return;
        }
    switch (rows) {
    case 1: block_scores(page, c, 1, 1, base, t, out); break;
    case 2: block_scores(page, c, 2, 1, base, t, out); break;
    case 3: block_scores(page, c, 3, 1, base, t, out); break;
    case 4: block_scores(page, c, 4, 1, base, t, out); break;
    case 5: block_scores(page, c, 5, 1, base, t, out); break;
    case 6: block_scores(page, c, 6, 1, base, t, out); break;
    case 7: block_scores(page, c, 7, 1, base, t, out); break;
    default: block_scores(page, c, 8, 1, base, t, out); break;
    }
}

/* the block read of one page whose widths fit its bytes (width, first, channel: widths_layout's; n channels of
 * non-zero width) for the R query rows qf [R, D]: s[r * total + slot], hidden slots -inf; its outliers'
 * corrections added to their tokens' scores (pages.c: add_corrections), a key group at a time. scale, minimum:
 * D floats each, base: R; ints: the rest of widths_scratch's units */
static void widths_block_page(const page_view *v, const int64_t *m, const int32_t *width, const int32_t *first,
                              const int32_t *channel, int64_t n, const float *qf, int64_t R, int64_t D, int64_t total,
                              float *s, float *scale, float *minimum, float *base, int32_t *ints) {
    const int64_t P = m[3], G = m[5], size = P * m[7];
    int32_t *start = ints, *wide = ints + D;
    float *cscale = (float *)(ints + 2 * D), *cmin = cscale + D, *cquery = cmin + D;
    const uint8_t *page = v->key_codes;
    int64_t end = 0; /* where the page's last 8-byte read ends */
    for (int64_t i = 0; i < n; i++) {
        start[i] = first[channel[i]] / 8;
        wide[i] = width[channel[i]];
        if (start[i] + wide[i] * (P / 8 - 1) + 8 > end) end = start[i] + wide[i] * (P / 8 - 1) + 8;
    }
    if (end > size) { /* reads past the page's last byte: from a copy with 8 zero bytes after it */
        uint8_t *pad = (uint8_t *)(cquery + R * D);
        memcpy(pad, page, (size_t)size);
        memset(pad + size, 0, 8);
        page = pad;
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < n; i++) cquery[r * n + i] = qf[r * D + channel[i]];
    float block[8 * WIDTHS_BLOCK_ROWS]; /* a block's scores [row][token] */
    for (int64_t g0 = 0; g0 < P; g0 += G) {
        load_f16_row(v->key_scale + (g0 / G) * D, D, scale);
        load_f16_row(v->key_min + (g0 / G) * D, D, minimum);
        for (int64_t i = 0; i < n; i++) {
            cscale[i] = scale[channel[i]];
            cmin[i] = minimum[channel[i]];
        }
        for (int64_t r = 0; r < R; r++) { /* the width-0 channels: their minimums */
            float sum = 0.0f;
            for (int64_t i = n; i < D; i++) sum = fmaf(qf[r * D + channel[i]], minimum[channel[i]], sum);
            base[r] = sum;
        }
        int64_t blocks = 1; /* blocks of 8 tokens read at t */
        for (int64_t t = g0; t < g0 + G; t += 8 * blocks) {
            int seen = 0;
            blocks = 1;
            for (int64_t e = t; e < t + 8; e++) seen |= v->valid[e];
            if (!seen) {
                for (int64_t r = 0; r < R; r++)
                    for (int64_t e = t; e < t + 8; e++) s[r * total + e] = -INFINITY;
                continue;
            }
            /* two blocks when the next is in the group and some of its tokens are valid too, and the rows fit */
            if (R <= WIDTHS_BLOCK_SUMS / 2 && t + 16 <= g0 + G)
                for (int64_t e = t + 8; e < t + 16; e++) blocks = v->valid[e] ? 2 : blocks;
            for (int64_t r0 = 0; r0 < R; r0 += WIDTHS_BLOCK_ROWS) {
                const int64_t rows = R - r0 < WIDTHS_BLOCK_ROWS ? R - r0 : WIDTHS_BLOCK_ROWS;
                const block_channels c = {start, wide, cscale, cmin, cquery + r0 * n, n};
                block_scores_rows(page, &c, rows, blocks, base + r0, t, block);
                for (int64_t k = 0; k < blocks; k++) {
                    const __m256 seen_lanes = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(v->valid + t + 8 * k))),
                        _mm256_setzero_si256()));
                    for (int64_t r = 0; r < rows; r++)
                        _mm256_storeu_ps(s + (r0 + r) * total + t + 8 * k,
                                         _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                          _mm256_loadu_ps(block + (r * blocks + k) * 8), seen_lanes));
                }
            }
        }
        if (m[35]) /* the group's outliers: q_d * correction added to their tokens' scores */
            add_corrections(v->key_outlier_index, v->key_outlier_value, m[35], P, D, v->valid, g0, g0 + G, R, qf, D,
                            s, total, 1);
    }
}
#else
static void build_block_tables(void) {}
#endif

/* the key widths of page `page` of sequence b, KV head j: [D] uint8 (meta [49..51] its strides, ptrs[13]) */
static inline const uint8_t *page_widths(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t page) {
    return (const uint8_t *)p[13] + b * m[49] + j * m[50] + page * m[51];
}

/* the 4-byte units of outlier scratch a channel-widths segment's read takes (meta m, heads of D channels, R query
 * rows): its outliers' sort (P + O), then the block read's (widths_block_page: (4 + R) * D and the page's
 * bytes + 8) */
static int64_t widths_scratch(const int64_t *m, int64_t D, int64_t R) {
    return m[3] + m[35] + (4 + R) * D + (m[3] * m[7] + 8 + 3) / 4;
}

/* scores of the selected pages [k0, k1) of a channel-widths page segment (meta m, pointers p: see pages.c) for the
 * R query rows qf [R, D] (pre-scaled): s[r * total + slot], hidden slots -inf. buf: the task's work buffer (6 * D +
 * R floats used: scale, minimum, key, the channels' width and first bit, the list of those of non-zero width, the
 * rows' sums over the width-0 channels), scratch: its outlier scratch (widths_scratch). */
static void widths_scores(const page_args *a, const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0,
                          int64_t k1, const float *qf, float *scores, float *buf, int32_t *scratch) {
    const int64_t P = m[3], G = m[5], C = m[7], D = a->D, R = a->R, total = a->total, O = m[35], size = P * C;
    float *scale = buf, *minimum = buf + D, *key = buf + 2 * D, *base = buf + 6 * D;
    int32_t *width = (int32_t *)(buf + 3 * D), *first = (int32_t *)(buf + 4 * D), *channel = (int32_t *)(buf + 5 * D);
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        float *s = scores + k * P;
        if (page < 0) {
            hide_slots(s, R, P, total);
            continue;
        }
        const page_view v = view_page(p, m, b, j, page);
        int fits;
        const int64_t n = widths_layout(page_widths(p, m, b, j, page), D, P, size, width, first, channel, &fits);
#if defined(CONFKV_WIDTH_BLOCKS)
        if (fits && P % 8 == 0 && G % 8 == 0) {
            widths_block_page(&v, m, width, first, channel, n, qf, R, D, total, s, scale, minimum, base,
                              scratch + P + O);
            continue;
        }
#endif
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
            for (int64_t d = 0; d < D; d++) key[d] = widths_entry(v.key_codes, size, width, first, scale, minimum, t, d);
            if (O) restore_outliers(&outliers, t, NULL, key);
            for (int64_t r = 0; r < R; r++) s[r * total + t] = dot_tree(qf + r * D, key, D);
        }
    }
}
