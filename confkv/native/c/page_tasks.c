/* The page read's tasks and entry point (confkv_page_read; issue 32). Part of kernels.c, after pages.c (the
 * operands, the dense and row-by-row page readers) and page_codes.c (the fast page readers).
 *
 * A unit (a sequence and KV head) is read in three steps: its slots' scores (task_scores), their exps and the
 * values they weigh (task_values), then the softmax denominators applied, the masses and the output (unit_finish).
 * Few units (batch 1: 3 KV heads on 2 threads) would leave threads idle, so their pages are read in slices,
 * each step a pool call over the slices (page_parts). */

/* a task's buffers: the query rows, the output, a value per row, the work buffers (row_buffer), and, with a
 * rotation, the query rows and output in it (R * D each but the work buffers and the row values) */
static int64_t row_buffer(const page_args *a) { return planar_scratch(a->R, a->D) + a->outlier_ints; } /* >= 4 * D */
static int64_t task_floats(const page_args *a) { return (a->rotation ? 4 : 2) * a->R * a->D + a->R + row_buffer(a); }

typedef struct {
    float *query, *out, *rows, *buf, *query_turned, *out_turned;
} task_work;

static task_work work_of(const page_args *a, int64_t task) {
    const int64_t RD = a->R * a->D;
    float *base = a->work + task * a->work_stride;
    task_work w = {base, base + RD, base + 2 * RD, base + 2 * RD + a->R, NULL, NULL};
    if (a->rotation) {
        w.query_turned = w.buf + row_buffer(a);
        w.out_turned = w.query_turned + RD;
    }
    return w;
}

/* the larger of a and b, NaN if either is (the row maxima of the slices combined as max_or_nan does) */
static inline float larger_or_nan(float a, float b) { return a != a || b != b ? NAN : (a > b ? a : b); }

/* the pages [*k0, *k1) of the K of a page segment that slice `part` reads */
static inline void slice_pages(const page_args *a, int64_t K, int64_t part, int64_t *k0, int64_t *k1) {
    *k0 = K * part / a->parts;
    *k1 = K * (part + 1) / a->parts;
}

/* the slots [*first, *end) of segment m that slice `part` reads (a dense segment: part 0, whole) */
static inline void slice_slots(const page_args *a, const int64_t *m, int64_t part, int64_t *first, int64_t *end) {
    if (m[0] == SEG_DENSE) {
        *first = 0;
        *end = part == 0 ? m[1] : 0;
        return;
    }
    int64_t k0, k1;
    slice_pages(a, m[2], part, &k0, &k1);
    *first = k0 * m[3];
    *end = k1 * m[3];
}

/* the scores of task's slice of its unit's slots (the query rows scaled, as the block-wise read) */
static void task_scores(const void *ctx, int64_t task) {
    const page_args *a = (const page_args *)ctx;
    const int64_t unit = task / a->parts, part = task % a->parts, b = unit / a->Hkv, j = unit % a->Hkv;
    const int64_t G = a->G, Q = a->Q, D = a->D, R = a->R, total = a->total;
    const task_work w = work_of(a, task);
    float *qf = w.query, *scores = a->scores + unit * R * total;
    /* row r = g * Q + q holds query head j * G + g, query q */
    for (int64_t g = 0; g < G; g++)
        for (int64_t q = 0; q < Q; q++) {
            const float *src = a->query + ((b * a->Hq + j * G + g) * Q + q) * D;
            for (int64_t d = 0; d < D; d++) qf[(g * Q + q) * D + d] = src[d] * a->scaling;
        }
    const float *rot = a->rotation;
    if (rot) /* (R q) . (R k) = q . k: rotated pages score the query turned into their basis. Entry e of a row is
              * its products summed in channel order d, as a dot product would; the D entries are summed side by
              * side (each its own chain, so they vectorize), which leaves every entry's sum as it was. */
        for (int64_t r = 0; r < R; r++) {
            float *restrict turned = w.query_turned + r * D;
            for (int64_t e = 0; e < D; e++) turned[e] = 0.0f;
            for (int64_t d = 0; d < D; d++) {
                const float x = qf[r * D + d];
                const float *restrict row = rot + d * D;
                for (int64_t e = 0; e < D; e++) turned[e] = fmaf(x, row[e], turned[e]);
            }
        }
    int64_t offset = 0;
    for (int s = 0; s < a->n_seg; s++) {
        const int64_t *m = a->meta + PR_META * s;
        const void *const *p = a->ptrs + PR_PTRS * s;
        if (m[0] == SEG_DENSE) {
            if (part == 0) dense_scores(a, p, m, b, j, qf, scores + offset, w.buf);
        } else {
            int64_t k0, k1;
            slice_pages(a, m[2], part, &k0, &k1);
            const float *query = rot && m[32] == 1 ? w.query_turned : qf;
            if (m[48])
                widths_scores(a, p, m, b, j, k0, k1, query, scores + offset, w.buf, outlier_scratch(a, w.buf));
            else
#if defined(CONFKV_VBMI)
            if (simd_pages_fit(m, R, D))
                simd_scores(p, m, b, j, k0, k1, query, R, D, total, scores + offset, w.buf);
            else
#elif defined(CONFKV_AVX2_PAGES)
            if (avx2_pages_fit(m, R, D))
                avx2_scores(p, m, b, j, k0, k1, query, R, D, total, scores + offset, w.buf);
            else
#endif
            if (planar(m))
                planar_scores(p, m, a->channels + s * 4 * D, b, j, k0, k1, query, R, D, total, scores + offset, w.buf,
                              outlier_scratch(a, w.buf));
            else
                page_scores(a, p, m, b, j, k0, k1, query, scores + offset, w.buf);
        }
        offset += m[1];
    }
    float *tops = a->tops + task * R; /* the slice's largest score per row */
    for (int64_t r = 0; r < R; r++) tops[r] = -INFINITY;
    offset = 0;
    for (int s = 0; s < a->n_seg; s++) {
        const int64_t *m = a->meta + PR_META * s;
        int64_t first, end;
        slice_slots(a, m, part, &first, &end);
        if (first < end)
            for (int64_t r = 0; r < R; r++)
                tops[r] = larger_or_nan(tops[r], max_or_nan(scores + r * total + offset + first, end - first));
        offset += m[1];
    }
}

/* task's slice: its scores to exp(score - row max), their sums, and the values they weigh (unnormalised). The row
 * max is over every slice of the unit (NaN if a score is NaN); a row that sees nothing gets -1e30 (the
 * block-wise read's running max starts there), so its exps are 0. */
static void task_values(const void *ctx, int64_t task) {
    const page_args *a = (const page_args *)ctx;
    const int64_t unit = task / a->parts, part = task % a->parts, b = unit / a->Hkv, j = unit % a->Hkv;
    const int64_t D = a->D, R = a->R, total = a->total;
    const task_work w = work_of(a, task);
    float *scores = a->scores + unit * R * total, *sums = a->sums + task * R, *top = w.rows;
    for (int64_t r = 0; r < R; r++) {
        float t = -INFINITY;
        for (int64_t other = 0; other < a->parts; other++)
            t = larger_or_nan(t, a->tops[(unit * a->parts + other) * R + r]);
        top[r] = t < -1e30f ? -1e30f : t;
        sums[r] = 0.0f;
    }
    for (int64_t i = 0; i < R * D; i++) w.out[i] = 0.0f;
    if (a->rotation)
        for (int64_t i = 0; i < R * D; i++) w.out_turned[i] = 0.0f;
    int64_t offset = 0;
    for (int s = 0; s < a->n_seg; s++) {
        const int64_t *m = a->meta + PR_META * s, L = m[1];
        const void *const *p = a->ptrs + PR_PTRS * s;
        int64_t first, end, k0 = 0, k1 = 0;
        slice_slots(a, m, part, &first, &end);
        if (m[0] == SEG_PAGES) slice_pages(a, m[2], part, &k0, &k1);
        if (first < end) {
            for (int64_t r = 0; r < R; r++) {
                float *e = scores + r * total + offset;
                for (int64_t l = first; l < end; l++) e[l] = exp_nonpositive(e[l] - top[r]);
                sums[r] += sum(e + first, end - first);
            }
            if (m[0] == SEG_DENSE)
                dense_values(a, p, m, b, j, scores + offset, w.out, w.buf);
            else {
                float *out = a->rotation && m[32] ? w.out_turned : w.out;
#if defined(CONFKV_VBMI)
                if (simd_pages_fit(m, R, D))
                    simd_values(p, m, b, j, k0, k1, scores + offset, R, D, total, out);
                else
#elif defined(CONFKV_AVX2_PAGES)
                if (avx2_pages_fit(m, R, D))
                    avx2_values(p, m, b, j, k0, k1, scores + offset, R, D, total, out);
                else
#endif
                if (planar(m))
                    planar_values(p, m, a->channels + s * 4 * D + 2 * D, b, j, k0, k1, scores + offset, R, D, total,
                                  out, w.buf, outlier_scratch(a, w.buf));
                else
                    page_values(a, p, m, b, j, k0, k1, scores + offset, out, w.buf);
            }
        }
        offset += L;
    }
}

static float torch_order_sum(const float *a, int64_t n, int lanes); /* rows.c */

/* torch_order_sum of a[0..n) with `lanes` (8 or 16) a compile-time constant, for rows of fewer than 64 vectors (a page's
 * slots): there torch's cascade never reaches its second level (its first step is 16 vectors a sum, rows.c), so the
 * sum is four vector accumulators taken round-robin, the vectors left over into the first, the four added in order,
 * the scalar tail, then the lanes one by one; the same adds in the same order as torch_order_sum (its levels' adds
 * of zeros change no sum that starts from +0), in loops the compiler vectorises. */
static inline __attribute__((always_inline)) float short_torch_order_sum(const float *a, int64_t n, const int lanes) {
    const int64_t vectors = n / lanes, size = vectors / 4;
    float acc[4][16] = {{0}};
    for (int64_t i = 0; i < size; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++) acc[k][l] += a[(i * 4 + k) * lanes + l];
    for (int64_t v = size * 4; v < vectors; v++)
        for (int l = 0; l < lanes; l++) acc[0][l] += a[v * lanes + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < lanes; l++) acc[0][l] += acc[k][l];
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < n; t++) total += a[t];
    for (int l = 0; l < lanes; l++) total += acc[0][l];
    return total;
}

/* a page's slots' masses summed in torch's order (torch_order_sum, faster for short rows) */
static float page_mass_sum(const float *a, int64_t n, int lanes) {
    if (n >= lanes && n < 64 * lanes) {
        if (lanes == 8) return short_torch_order_sum(a, n, 8);
        if (lanes == 16) return short_torch_order_sum(a, n, 16);
    }
    return torch_order_sum(a, n, lanes);
}

/* page_mass_sum, exported for its test against torch.sum */
float confkv_page_mass_sum(const float *a, int64_t n, int lanes) { return page_mass_sum(a, n, lanes); }

/* after a unit's masses (slot_mass, segment s's L slots of sequence b, KV head j): what the segment asks updated
 * from them in place (meta[48]), so that the store's Python makes no call for it:
 * UPDATE_STATISTIC, a dense segment's linear statistic (CONF-KV's EMA; policies' linear_observe):
 *     stat = fmaf(mass, gain, stat * scale), which is torch's stat.mul_(scale).add_(mass, alpha=gain) bit for bit
 *     (decode_step.c's update; scale and gain the float32 bits in meta[51], meta[52]);
 * UPDATE_PAGE_HEAT, a page segment's heat [B, Hkv, N]: each read page's heat += its P slots' masses summed in
 *     torch's order (torch_order_sum, lanes meta[51]), as the cold tier's observe (sum(-1), scatter_add_) adds them;
 *     pages a sequence does not read (k >= its count) get nothing (their slots' masses are 0 there). */
static void update_in_place(const page_args *a, int s, int64_t b, int64_t j, const float *slot_mass) {
    const int64_t *m = a->meta + PR_META * s;
    const void *const *p = a->ptrs + PR_PTRS * s;
    const int64_t *u = m + PR_META - PR_UPDATE_META;
    float *target = (float *)p[PR_PTRS - 1];
    if (u[0] == UPDATE_NONE || !target) return;
    target += b * u[1] + j * u[2];
    if (u[0] == UPDATE_STATISTIC) {
        uint32_t bits[2] = {(uint32_t)u[3], (uint32_t)u[4]};
        float scale, gain;
        memcpy(&scale, &bits[0], sizeof scale);
        memcpy(&gain, &bits[1], sizeof gain);
        for (int64_t l = 0; l < m[1]; l++) target[l] = fmaf(slot_mass[l], gain, target[l] * scale);
    } else if (u[0] == UPDATE_PAGE_HEAT && m[0] == SEG_PAGES) {
        for (int64_t k = 0; k < m[2]; k++) {
            const int64_t page = page_of(p, m, b, j, k);
            if (page >= 0) target[page] += page_mass_sum(slot_mass + k * m[3], m[3], (int)u[3]);
        }
    }
}

/* the unit's slices added (in slice order) and divided by the softmax denominators, the rotated pages' share
 * turned back, the masses, the output rows written */
static void unit_finish(const void *ctx, int64_t unit) {
    const page_args *a = (const page_args *)ctx;
    const int64_t b = unit / a->Hkv, j = unit % a->Hkv, G = a->G, Q = a->Q, D = a->D, R = a->R, total = a->total;
    const int64_t parts = a->parts;
    const task_work first = work_of(a, unit * parts);
    float *acc = first.out, *acc_turned = first.out_turned, *scores = a->scores + unit * R * total;
    float *inv = first.rows; /* the row maxima are no longer needed */
    for (int64_t r = 0; r < R; r++) {
        float norm = 0.0f;
        for (int64_t part = 0; part < parts; part++) norm += a->sums[(unit * parts + part) * R + r];
        norm = norm < 1.17549435e-38f ? 1.17549435e-38f : norm; /* as the block-wise read's clamp */
        inv[r] = 1.0f / norm;
    }
    for (int64_t part = 1; part < parts; part++) {
        const task_work w = work_of(a, unit * parts + part);
        for (int64_t i = 0; i < R * D; i++) acc[i] += w.out[i];
        if (a->rotation)
            for (int64_t i = 0; i < R * D; i++) acc_turned[i] += w.out_turned[i];
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t d = 0; d < D; d++) {
            acc[r * D + d] *= inv[r];
            if (a->rotation) acc_turned[r * D + d] *= inv[r];
        }
    const float *rot_t = a->rotation_t;
    if (rot_t) /* the rotated pages' share of the output back to the model's basis: x = y @ rotation^T, entry d from
                * x[d] adding y[e] * rotation[d][e] in order e; the D entries side by side, as the query's turn */
        for (int64_t r = 0; r < R; r++) {
            float *restrict x = acc + r * D;
            const float *restrict y = acc_turned + r * D;
            for (int64_t e = 0; e < D; e++) {
                const float ye = y[e];
                const float *restrict column = rot_t + e * D;
                for (int64_t d = 0; d < D; d++) x[d] = fmaf(ye, column[d], x[d]);
            }
        }
    if (a->mass) {
        int64_t offset = 0;
        for (int s = 0; s < a->n_seg; s++) {
            const int64_t L = a->meta[PR_META * s + 1];
            if (a->mass[s]) {
                float *slot_mass = a->mass[s] + (b * a->Hkv + j) * L;
                for (int64_t l = 0; l < L; l++) slot_mass[l] = 0.0f;
                for (int64_t q = 0; q < Q; q++)
                    for (int64_t l0 = 0; l0 < L; l0 += 16) { /* 16 slots side by side, each summed in order g */
                        const int64_t n = L - l0 < 16 ? L - l0 : 16;
                        float group[16] = {0.0f};
                        for (int64_t g = 0; g < G; g++) {
                            const float *row = scores + (g * Q + q) * total + offset + l0, weight = inv[g * Q + q];
                            for (int64_t i = 0; i < n; i++) group[i] += row[i] * weight;
                        }
                        for (int64_t i = 0; i < n; i++) slot_mass[l0 + i] += group[i] / (float)G;
                    }
                update_in_place(a, s, b, j, slot_mass);
            }
            offset += L;
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t q = 0; q < Q; q++)
            memcpy(a->out + ((b * a->Hq + j * G + g) * Q + q) * D, acc + (g * Q + q) * D, (size_t)D * sizeof(float));
}

/* a unit read whole by one task (parts == 1) */
static void unit_read(const void *ctx, int64_t unit) {
    task_scores(ctx, unit);
    task_values(ctx, unit);
    unit_finish(ctx, unit);
}

/* the slices a unit's pages are read in: enough tasks to share 2-4 threads evenly when the units are few and
 * the read is big enough to pay for three pool calls (a function of the shapes only) */
static int64_t page_parts(int64_t units, int64_t work) {
    if (work < mass_min_parallel || units >= 12) return 1;
    const int64_t parts = (12 + units - 1) / units;
    return parts < 4 ? parts : 4;
}

/* fn(ctx, 0 .. n - 1) on the pool when `parallel` (and the pool runs), else in this thread */
static void run_tasks(void (*fn)(const void *, int64_t), const page_args *a, int64_t n, int threads, int parallel) {
    if (!parallel || pool_run(fn, a, n, threads))
        for (int64_t i = 0; i < n; i++) fn(a, i);
}

/* 1 when the read takes page segment m's bit widths, groups and outlier count (heads of D channels) */
static int page_meta_taken(const int64_t *m, int64_t D) {
    for (int which = 0; which < 2; which++) {
        const int64_t bits = m[which ? 33 : 4];
        if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return 0;
    }
    return !(m[5] < 1 || m[3] % m[5] || m[6] < 1 || D % m[6] || m[35] < 0 || m[32] < 0 || m[32] > 2 ||
             m[48] < 0 || m[48] > 1 || (m[48] && m[7] < 1));
}

/* Softmax attention with attention mass over the concatenation of n_seg segments, each dense (keys / values
 * [B, Hkv, L, D] float32 or bfloat16, an optional bool visibility mask broadcast to [B, Hkv, Q, L] by its
 * strides) or a set of selected packed KIVI pages (confkv.attention.segments.PagedSegment, keys and values
 * each at 2, 3, 4 or 8 bits, maybe with outliers):
 *   query [B, Hq, Q, D] float32 contiguous, Hq = Hkv * G; out the same
 *   dense meta: [0] 0, [1] L, [2] key dtype, [3] value dtype, [4..6] key strides (b, h, l), [7..9] value
 *       strides, [10..13] mask strides (b, h, q, l); ptrs: keys, values, mask (NULL: all visible)
 *   paged meta and ptrs: see page_scores
 *   mass[s] [B, Hkv, L_s] float32 contiguous (mass NULL: none): the softmax probability of each slot averaged
 *       over the G query heads of its KV head, summed over the Q queries; 0 where hidden. With its mass, a
 *       segment's statistic or page heat is updated in place when its last PR_UPDATE_META entries ask it
 *       (update_in_place).
 *   rotation [D, D] float32 row-major, an orthogonal matrix (or NULL): the pages whose meta[32] is 1 hold
 *       keys and values coded as k @ rotation, v @ rotation (a Hadamard-rotated format, confkv.tiers.hadamard);
 *       their scores take (query @ rotation) and their weighted values are turned back by rotation^T. Pages
 *       whose meta[32] is 2 hold only their values so (keys at per-channel widths, page_widths.c).
 * Scores (query * scaling) . key, one softmax and the weighted sum in float32 (every score held at once: B * Hq
 * * Q * total floats, which the read plan caps). The B * Hkv units, or their slices (page_parts), run on up to
 * `threads` threads (the GEMV's pool) when the read is big enough. Returns 0, 1 when out of memory, 2 for a
 * bit width, group or outlier storage it does not take. */
int confkv_page_read(const float *query, int64_t B, int64_t Hq, int64_t Q, int64_t D, int64_t Hkv, int n_seg,
                     const void *const *ptrs, const int64_t *meta, float scaling, float *out, float *const *mass,
                     const float *rotation, int threads) {
    page_args a = {query, Hq, Q, D, Hkv, Hq / Hkv, (Hq / Hkv) * Q, 0, n_seg, ptrs, meta, scaling, out, mass, rotation};
    for (int s = 0; s < n_seg; s++) {
        const int64_t *m = meta + PR_META * s;
        if (m[0] == SEG_PAGES) {
            if (!page_meta_taken(m, D)) return 2;
            if (m[35] && !(ptrs[PR_PTRS * s + 9] && ptrs[PR_PTRS * s + 10] && ptrs[PR_PTRS * s + 11] &&
                           ptrs[PR_PTRS * s + 12]))
                return 2;
            if (m[48] && !ptrs[PR_PTRS * s + 13]) return 2;
            /* a page's rows (P x D), then the sort (P + O) */
            const int64_t outlier_need = m[35] ? m[3] * D + m[3] + m[35] : 0;
            if (outlier_need > a.outlier_ints) a.outlier_ints = outlier_need;
            if (m[48] && widths_scratch(m, D, a.R) > a.outlier_ints) a.outlier_ints = widths_scratch(m, D, a.R);
        }
        a.total += m[1];
    }
    build_code_tables();
    build_block_tables();
    simd_tables();
    const int64_t units = B * Hkv;
    a.parts = page_parts(units, units * a.R * a.total * D);
    const int64_t tasks = units * a.parts;
    a.work_stride = task_floats(&a);
    int32_t *channels = malloc(sizeof(int32_t) * (size_t)(n_seg * 4 * D));
    const int64_t turn = rotation ? D * D : 0; /* the rotation transposed, for the output's turn back */
    float *floats = malloc(sizeof(float) * (size_t)(units * a.R * a.total + 2 * tasks * a.R + tasks * a.work_stride +
                                                    turn));
    if (!channels || !floats) {
        free(channels);
        free(floats);
        return 1;
    }
    for (int s = 0; s < n_seg; s++) {
        const int64_t *m = meta + PR_META * s;
        if (m[0] == SEG_PAGES && planar(m)) { /* the key codes' plane order, then the value codes' */
            planar_channels((int)m[4], D, m[6], channels + s * 4 * D, channels + s * 4 * D + D);
            planar_channels((int)m[33], D, m[6], channels + s * 4 * D + 2 * D, channels + s * 4 * D + 3 * D);
        }
    }
    a.channels = channels;
    a.scores = floats;
    a.sums = a.scores + units * a.R * a.total;
    a.tops = a.sums + tasks * a.R;
    a.work = a.tops + tasks * a.R;
    if (rotation) {
        a.rotation_t = a.work + tasks * a.work_stride;
        for (int64_t d = 0; d < D; d++)
            for (int64_t e = 0; e < D; e++) a.rotation_t[e * D + d] = rotation[d * D + e];
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    const int parallel = threads >= 2 && tasks >= 2 && units * a.R * a.total * D >= mass_min_parallel;
    if (a.parts == 1) {
        run_tasks(unit_read, &a, units, threads, parallel);
    } else {
        run_tasks(task_scores, &a, tasks, threads, parallel);
        run_tasks(task_values, &a, tasks, threads, parallel);
        run_tasks(unit_finish, &a, units, threads, parallel);
    }
    free(floats);
    free(channels);
    return 0;
}

/* Which reader confkv_page_read gives a page segment (meta m, PR_META entries as for the read) read by R = Hq / Hkv
 * * Q query rows of D channels: 4 the channel-widths reader of its keys (page_widths.c), 2 the AVX-512 reader
 * (page_simd.c), 3 the AVX2 reader (page_avx2.c, built where the AVX-512 one is not), 1 the plane-order reader
 * (page_codes.c), 0 the
 * row-by-row reader (pages.c), -1 none (the read refuses the segment). The read's own dispatch, asked without
 * reading (tests, the bench). */
int confkv_page_reader(const int64_t *m, int64_t R, int64_t D) {
    if (!page_meta_taken(m, D)) return -1;
    if (m[48]) return 4; /* its keys; its values take the reader named for its other entries */
#if defined(CONFKV_VBMI)
    if (simd_pages_fit(m, R, D)) return 2;
#elif defined(CONFKV_AVX2_PAGES)
    if (avx2_pages_fit(m, R, D)) return 3;
#else
    (void)R, (void)D;
#endif
    return planar(m) ? 1 : 0;
}
