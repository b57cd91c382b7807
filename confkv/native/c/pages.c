/* The attention read over dense segments (with visibility masks) and packed KIVI cold pages (issue 32): the
 * operands of a call, the formats' helpers, and the readers of dense segments and of pages one row at a time in
 * channel order (pages whose value group is not a multiple of 8; page_codes.c reads the others). Part of
 * kernels.c; the tasks and the entry point, confkv_page_read, are in page_tasks.c.
 *
 * A page is read still packed: its key and value codes (2, 3, 4 or 8 bits, packed as confkv/tiers/lowbit.py
 * packs them) are unpacked and dequantized one token row at a time into a D-float buffer (L1), never as a
 * whole segment. Keys: per channel, one float16 (scale, minimum) per G tokens; values: per token, one per Gv
 * channels; x = minimum + code * scale, as lowbit.dequantize_* (addcmul) computes it. Values may be coded at a
 * width of their own (meta[33]), and a page may keep outliers apart (confkv/tiers/outliers.py: O entries per page
 * and tensor, float16 corrections at int16 flat indices t * D + d: the entry less what its codes decode to): they
 * are added to the dequantized rows (a whole page at once, or row by row) before use, as outliers.restore adds them
 * to the dequantized page, or to the scores and outputs after a packed read (add_corrections). */

/* a segment's entries: PR_META int64 and PR_PTRS pointers, of which the last PR_UPDATE_META and the last pointer say
 * what the read updates in place from the segment's masses (update_in_place, page_tasks.c) */
enum { PR_META = 57, PR_PTRS = 15, PR_UPDATE_META = 5 };
enum { UPDATE_NONE = 0, UPDATE_STATISTIC = 1, UPDATE_PAGE_HEAT = 2 };
enum { SEG_DENSE = 0, SEG_PAGES = 1 };

/* float16 -> float32, exactly (normals, subnormals, zeros, inf, NaN) */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    uint32_t u;
    if (exponent == 0x1Fu) {
        u = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (!mantissa) {
        u = sign;
    } else { /* subnormal: mantissa * 2^-24, exact in float32 */
        const float f = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* n float16 values as floats (8 at a time with F16C: the conversion is exact, so the same floats) */
static void load_f16_row(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = f16_to_f32(src[i]);
}

/* the codes of one byte as floats: 2 bits (4 codes) and 4 bits (2 codes), low bits first (lowbit.pack);
 * built once, before the first read (confkv_page_read) */
static float codes2[256][4], codes4[256][2];
static int code_tables_built;

static void build_code_tables(void) {
    if (code_tables_built) return;
    for (int b = 0; b < 256; b++) {
        for (int c = 0; c < 4; c++) codes2[b][c] = (float)((b >> (2 * c)) & 3);
        for (int c = 0; c < 2; c++) codes4[b][c] = (float)((b >> (4 * c)) & 15);
    }
    code_tables_built = 1;
}

/* the D codes of one packed row (lowbit.pack: code i of a word sits at bit bits * i of the little-endian word) */
static void unpack_row(const uint8_t *restrict src, int bits, int64_t D, float *restrict dst) {
    switch (bits) {
    case 8:
        for (int64_t d = 0; d < D; d++) dst[d] = (float)src[d];
        break;
    case 4:
        for (int64_t i = 0; i < D / 2; i++) memcpy(dst + 2 * i, codes4[src[i]], 2 * sizeof(float));
        break;
    case 2:
        for (int64_t i = 0; i < D / 4; i++) memcpy(dst + 4 * i, codes2[src[i]], 4 * sizeof(float));
        break;
    default: /* 3 bits: 8 codes in 3 bytes */
        for (int64_t w = 0; w < D / 8; w++) {
            const uint32_t word = (uint32_t)src[3 * w] | (uint32_t)src[3 * w + 1] << 8 | (uint32_t)src[3 * w + 2] << 16;
            for (int c = 0; c < 8; c++) dst[8 * w + c] = (float)((word >> (3 * c)) & 7u);
        }
    }
}

/* whether a page segment takes the fast read (page_codes.c): its value group is a multiple of 8 */
static inline int planar(const int64_t *m) { return m[6] % 8 == 0; }

/* one call's operands (see confkv_page_read). The read of query heads j * G .. j * G + G - 1 of sequence b over KV
 * head j is unit b * Hkv + j; a unit's pages are read in `parts` slices, each a task (task = unit * parts + part):
 * part p reads pages K * p / parts .. K * (p + 1) / parts - 1 of every page segment, part 0 the dense segments
 * too. `parts` follows from the shapes only (page_parts), so a read gives the same bits at any thread count. */
typedef struct {
    const float *query; /* [B, Hq, Q, D] float32 contiguous */
    int64_t Hq, Q, D, Hkv, G, R, total;
    int n_seg;
    const void *const *ptrs; /* PR_PTRS per segment */
    const int64_t *meta;     /* PR_META per segment */
    float scaling;
    float *out;              /* [B, Hq, Q, D] float32 contiguous */
    float *const *mass;      /* per segment [B, Hkv, L_s] float32 contiguous, or NULL */
    const float *rotation;   /* [D, D] float32 row-major (y = x @ rotation), the basis of the pages whose meta[32]
                              * is set, or NULL */
    const int32_t *channels; /* [n_seg, 4, D]: a planar segment's key channel per plane position, key plane
                              * position per channel, and the same for values (page_codes.c) */
    int64_t outlier_ints;    /* 4-byte words of scratch a task needs for a page's outliers (outlier_scratch) */
    int64_t parts;
    float *scores;           /* [units, R, total]: scores, then exp(score - row max) */
    float *sums;             /* [tasks, R]: each task's share of the softmax denominators */
    float *tops;             /* [tasks, R]: each task's largest score per row (NaN if one is NaN) */
    float *work;             /* per task work_stride floats (task_work) */
    int64_t work_stride;
    float *rotation_t;       /* [D, D] the rotation transposed (rotation_t[e * D + d] = rotation[d * D + e]), or NULL */
} page_args;

/* scores of a dense segment's L slots for the R rows (qf pre-scaled), masked slots -inf */
static void dense_scores(const page_args *a, const void *const *p, const int64_t *m, int64_t b, int64_t j,
                         const float *qf, float *scores, float *row) {
    const int64_t L = m[1], R = a->R, Q = a->Q, total = a->total;
    const int kd = (int)m[2];
    scores_segment(qf, R, a->D, at(p[0], kd, b * m[4] + j * m[5]), kd, m[6], L, 1.0f, scores, total, row);
    if (!p[2]) return;
    const uint8_t *vis = (const uint8_t *)p[2] + b * m[10] + j * m[11];
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *v = vis + (r % Q) * m[12];
        float *s = scores + r * total;
        for (int64_t l = 0; l < L; l++)
            if (!v[l * m[13]]) s[l] = -INFINITY;
    }
}

static void dense_values(const page_args *a, const void *const *p, const int64_t *m, int64_t b, int64_t j,
                         const float *probs, float *acc, float *row) {
    const int vd = (int)m[3];
    weighted_sum_segment(probs, a->total, a->R, a->D, at(p[1], vd, b * m[7] + j * m[8]), vd, m[9], m[1], acc, row);
}

/* paged segment meta: [1] L = K * P, [2] K, [3] P, [4] key bits, [5] G, [6] Gv, [7] C (packed key bytes per
 * row), [8..9] index strides (b, h), [10] counts stride, [11..13] valid strides (b, h, n),
 * [14..16] key codes, [17..19] key scale, [20..22] key min, [23..25] value codes, [26..28] value scale,
 * [29..31] value min strides (b, h, n), [32] 1: keys and values coded in the call's rotation (their scores
 * take the rotated query, their values add to the rotated output), 2: the values only (the keys in the model's
 * basis), [33] value bits, [34] Cv (packed value
 * bytes per row), [35] O: outliers per page and tensor (0: none), [36..38] key outlier index, [39..41] key
 * outlier value, [42..44] value outlier index, [45..47] value outlier value strides (b, h, n), [48] 1: each key
 * channel at a width of its own (page_widths.c; C then the bytes of a row of them), [49..51] the key widths'
 * strides (b, h, n); within a page every tensor is contiguous.
 * ptrs: index, counts, valid, key codes, key scale, key min, value codes, value scale, value min, key outlier
 * index, key outlier value, value outlier index, value outlier value (those four NULL when O is 0), key widths
 * ([B, Hkv, N, D] uint8; NULL when meta[48] is 0).
 * Either kind, the update in place (update_in_place): [52] what (UPDATE_*), [53..54] the target's strides (b, h;
 * its slots or pages contiguous), [55..56] a statistic's scale and gain as float32 bits, or [55] the lanes of
 * torch's sum order for page heat; ptrs[14] the float32 target (a dense segment's statistic [B, Hkv, L], a page
 * segment's heat [B, Hkv, N]). */
static inline int64_t page_of(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k) {
    const int64_t page = ((const int64_t *)p[0])[b * m[8] + j * m[9] + k];
    const int64_t count = ((const int64_t *)p[1])[b * m[10]];
    return k < count ? page : -1;
}

/* the tensors of page `page` of sequence b, KV head j (ptrs p, meta m; within a page every tensor is contiguous) */
typedef struct {
    const uint8_t *valid, *key_codes, *value_codes;
    const uint16_t *key_scale, *key_min, *value_scale, *value_min;
    const int16_t *key_outlier_index, *value_outlier_index;
    const uint16_t *key_outlier_value, *value_outlier_value;
} page_view;

static page_view view_page(const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t page) {
    page_view v;
    v.valid = (const uint8_t *)p[2] + b * m[11] + j * m[12] + page * m[13];
    v.key_codes = (const uint8_t *)p[3] + b * m[14] + j * m[15] + page * m[16];
    v.key_scale = (const uint16_t *)p[4] + b * m[17] + j * m[18] + page * m[19];
    v.key_min = (const uint16_t *)p[5] + b * m[20] + j * m[21] + page * m[22];
    v.value_codes = (const uint8_t *)p[6] + b * m[23] + j * m[24] + page * m[25];
    v.value_scale = (const uint16_t *)p[7] + b * m[26] + j * m[27] + page * m[28];
    v.value_min = (const uint16_t *)p[8] + b * m[29] + j * m[30] + page * m[31];
    v.key_outlier_index = v.value_outlier_index = NULL;
    v.key_outlier_value = v.value_outlier_value = NULL;
    if (m[35]) {
        v.key_outlier_index = (const int16_t *)p[9] + b * m[36] + j * m[37] + page * m[38];
        v.key_outlier_value = (const uint16_t *)p[10] + b * m[39] + j * m[40] + page * m[41];
        v.value_outlier_index = (const int16_t *)p[11] + b * m[42] + j * m[43] + page * m[44];
        v.value_outlier_value = (const uint16_t *)p[12] + b * m[45] + j * m[46] + page * m[47];
    }
    return v;
}

/* log2(D) for heads of a power of two channels (an index's row by a shift, not a division), else -1 */
static inline int row_shift(int64_t D) {
    if (D & (D - 1)) return -1;
    int shift = 0;
    while (((int64_t)1 << shift) < D) shift++;
    return shift;
}

/* One page's O outlier corrections of a tensor added to its P dequantized rows (rows [P, D]; channel d of row t at
 * rows[t * D + position[d]], position NULL: d), for the readers that dequantize a whole page first
 * (page_codes.c); entries outside the page are left out. */
static void patch_outliers(const int16_t *index, const uint16_t *value, int64_t O, int64_t P, int64_t D,
                           const int32_t *position, float *rows) {
    const int32_t entries = (int32_t)(P * D);
    const int shift = row_shift(D);
    for (int64_t e = 0; e < O; e++) {
        const int32_t i = index[e];
        if (i < 0 || i >= entries) continue;
        const int64_t t = shift >= 0 ? i >> shift : i / (int32_t)D, d = i - t * D;
        rows[t * D + (position ? position[d] : d)] += f16_to_f32(value[e]);
    }
}

/* One page's O outliers of a tensor sorted by row (a counting sort): after it, the entries of row t are
 * order[t ? end[t - 1] : 0 .. end[t] - 1]. scratch: P + O int32s (end, then order). Entries outside the page
 * (index < 0 or >= P * D) are left out. */
typedef struct {
    const int16_t *index;
    const uint16_t *value;
    const int32_t *end, *order;
    int64_t D;
} page_outliers;

static page_outliers sort_outliers(const int16_t *index, const uint16_t *value, int64_t O, int64_t P, int64_t D,
                                   int32_t *scratch) {
    int32_t *end = scratch, *order = scratch + P;
    page_outliers o = {index, value, end, order, D};
    const int32_t entries = (int32_t)(P * D);
    const int shift = row_shift(D);
    for (int64_t t = 0; t < P; t++) end[t] = 0;
    for (int64_t e = 0; e < O; e++) {
        const int32_t i = index[e];
        if (i >= 0 && i < entries) end[shift >= 0 ? i >> shift : i / (int32_t)D]++;
    }
    int32_t total = 0;
    for (int64_t t = 0; t < P; t++) { /* end[t]: where row t's entries start, then (as they are placed) end */
        const int32_t n = end[t];
        end[t] = total;
        total += n;
    }
    for (int64_t e = 0; e < O; e++) {
        const int32_t i = index[e];
        if (i >= 0 && i < entries) order[end[shift >= 0 ? i >> shift : i / (int32_t)D]++] = (int32_t)e;
    }
    return o;
}

/* row t's outlier corrections added to its dequantized entries: channel d at row[position[d]] (position NULL: d) */
static inline void restore_outliers(const page_outliers *o, int64_t t, const int32_t *position, float *row) {
    for (int32_t i = t ? o->end[t - 1] : 0; i < o->end[t]; i++) {
        const int32_t e = o->order[i];
        const int64_t d = o->index[e] - t * o->D;
        row[position ? position[d] : d] += f16_to_f32(o->value[e]);
    }
}

/* A page's outlier corrections of one tensor added after a read that never writes the page out dequantized (the
 * AVX2 reader, the block read of per-channel key widths): for each entry of a valid token t in [t0, t1) (indices
 * outside the page left out; an index that repeats adds each of its corrections, as the torch read does) and each
 * query row r < R, with c the entry's correction and d its channel,
 *   to_scores 1 (keys):   out[r * out_stride + t] += in[r * in_stride + d] * c   (q_d c to the token's score)
 *   to_scores 0 (values): out[r * out_stride + d] += in[r * in_stride + t] * c   (p_t c to the channel's output).
 * Always inlined, so that to_scores and R (add_corrections) are constants */
static inline __attribute__((always_inline)) void add_corrections_rows(const int16_t *index, const uint16_t *value,
                                                                       int64_t O, int64_t P, int64_t D,
                                                                       const uint8_t *valid, int64_t t0, int64_t t1,
                                                                       int64_t R, const float *in, int64_t in_stride,
                                                                       float *out, int64_t out_stride, int to_scores) {
    const uint32_t entries = (uint32_t)(P * D);
    const int shift = row_shift(D);
    for (int64_t e = 0; e < O; e++) {
        const uint32_t i = (uint32_t)(int32_t)index[e]; /* a negative index wraps past every page */
        if (i >= entries) continue;
        const int64_t t = shift >= 0 ? (int64_t)(i >> shift) : (int64_t)(i / (uint32_t)D), d = (int64_t)i - t * D;
        if (t < t0 || t >= t1 || !valid[t]) continue;
#if defined(__F16C__)
        const float c = _cvtsh_ss(value[e]); /* exactly as f16_to_f32 */
#else
        const float c = f16_to_f32(value[e]);
#endif
        const int64_t at = to_scores ? t : d, from = to_scores ? d : t;
        for (int64_t r = 0; r < R; r++)
            out[r * out_stride + at] = fmaf(in[r * in_stride + from], c, out[r * out_stride + at]);
    }
}

/* add_corrections_rows with R a constant for 1-4 query rows a KV head */
static inline __attribute__((always_inline)) void add_corrections(const int16_t *index, const uint16_t *value,
                                                                  int64_t O, int64_t P, int64_t D,
                                                                  const uint8_t *valid, int64_t t0, int64_t t1,
                                                                  int64_t R, const float *in, int64_t in_stride,
                                                                  float *out, int64_t out_stride, int to_scores) {
#define CONFKV_CORRECTIONS(rows) \
    add_corrections_rows(index, value, O, P, D, valid, t0, t1, rows, in, in_stride, out, out_stride, to_scores)
    switch (R) {
    case 1: CONFKV_CORRECTIONS(1); break;
    case 2: CONFKV_CORRECTIONS(2); break;
    case 3: CONFKV_CORRECTIONS(3); break;
    case 4: CONFKV_CORRECTIONS(4); break;
    default: CONFKV_CORRECTIONS(R); break;
    }
#undef CONFKV_CORRECTIONS
}

static int64_t planar_scratch(int64_t R, int64_t D); /* page_codes.c */

/* a task's scratch for a page's outliers (page_args.outlier_ints 4-byte words, after its float work buffer): the
 * row-by-row readers sort them by row in it (P + O int32s), the fast readers dequantize the page in it (P * D
 * floats) */
static inline int32_t *outlier_scratch(const page_args *a, float *buf) {
    return (int32_t *)(buf + planar_scratch(a->R, a->D));
}

/* the P slots of a rank with no page, hidden in the R score rows s[r * total + t] */
static void hide_slots(float *s, int64_t R, int64_t P, int64_t total) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t t = 0; t < P; t++) s[r * total + t] = -INFINITY;
}

static void page_scores(const page_args *a, const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0,
                        int64_t k1, const float *qf, float *scores, float *buf) {
    const int64_t P = m[3], G = m[5], C = m[7], D = a->D, R = a->R, total = a->total, O = m[35];
    const int bits = (int)m[4];
    float *codes = buf, *scale = buf + D, *minimum = buf + 2 * D, *key = buf + 3 * D;
    int32_t *scratch = outlier_scratch(a, buf);
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        float *s = scores + k * P;
        if (page < 0) {
            hide_slots(s, R, P, total);
            continue;
        }
        const page_view v = view_page(p, m, b, j, page);
        const uint8_t *valid = v.valid, *kc = v.key_codes;
        const uint16_t *ks = v.key_scale, *km = v.key_min;
        page_outliers outliers;
        if (O) outliers = sort_outliers(v.key_outlier_index, v.key_outlier_value, O, P, D, scratch);
        int64_t loaded = -1; /* the key group whose scale and minimum are in the buffers */
        for (int64_t t = 0; t < P; t++) {
            if (!valid[t]) {
                for (int64_t r = 0; r < R; r++) s[r * total + t] = -INFINITY;
                continue;
            }
            if (t / G != loaded) {
                loaded = t / G;
                load_f16_row(ks + loaded * D, D, scale);
                load_f16_row(km + loaded * D, D, minimum);
            }
            unpack_row(kc + t * C, bits, D, codes);
            for (int64_t d = 0; d < D; d++) key[d] = minimum[d] + codes[d] * scale[d];
            if (O) restore_outliers(&outliers, t, NULL, key);
            for (int64_t r = 0; r < R; r++) s[r * total + t] = dot(qf + r * D, key, D);
        }
    }
}

static void page_values(const page_args *a, const void *const *p, const int64_t *m, int64_t b, int64_t j, int64_t k0,
                        int64_t k1, const float *probs, float *acc, float *buf) {
    const int64_t P = m[3], Gv = m[6], C = m[34], D = a->D, R = a->R, total = a->total, groups = D / Gv, O = m[35];
    const int bits = (int)m[33];
    float *codes = buf, *scale = buf + D, *minimum = buf + 2 * D, *value = buf + 3 * D;
    int32_t *scratch = outlier_scratch(a, buf);
    for (int64_t k = k0; k < k1; k++) {
        const int64_t page = page_of(p, m, b, j, k);
        if (page < 0) continue;
        const page_view v = view_page(p, m, b, j, page);
        const uint8_t *valid = v.valid, *vc = v.value_codes;
        const uint16_t *vs = v.value_scale, *vm = v.value_min;
        const float *w = probs + k * P;
        page_outliers outliers;
        if (O) outliers = sort_outliers(v.value_outlier_index, v.value_outlier_value, O, P, D, scratch);
        for (int64_t t = 0; t < P; t++) {
            if (!valid[t]) continue;
            load_f16_row(vs + t * groups, groups, scale);
            load_f16_row(vm + t * groups, groups, minimum);
            unpack_row(vc + t * C, bits, D, codes);
            for (int64_t g = 0; g < groups; g++) {
                const float low = minimum[g], step = scale[g];
                float *restrict v = value + g * Gv;
                const float *restrict c = codes + g * Gv;
                for (int64_t d = 0; d < Gv; d++) v[d] = low + c[d] * step;
            }
            if (O) restore_outliers(&outliers, t, NULL, value);
            for (int64_t r = 0; r < R; r++) {
                const float weight = w[r * total + t];
                float *o = acc + r * D;
                for (int64_t d = 0; d < D; d++) o[d] = fmaf(weight, value[d], o[d]);
            }
        }
    }
}

