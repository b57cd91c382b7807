/* The INT8 GEMV's entry points: products cut into chunks for the pool, the activations widened (and,
 * for W8A8, quantised), confkv_int8_gemv / confkv_int8_linear. Part of kernels.c. */
static int64_t gemv_min_parallel = 65536;

/* up to MAX_PARTS products of one call, cut into chunks of output rows for the pool */
typedef struct {
    int parts;
    int64_t part_start[MAX_PARTS + 1], part_rows[MAX_PARTS]; /* a part's first chunk; its rows per chunk */
    gemv_args job[MAX_PARTS];
} gemv_job;

static void gemv_chunk(const void *ctx, int64_t index) {
    const gemv_job *j = (const gemv_job *)ctx;
    int p = 0;
    while (index >= j->part_start[p + 1]) p++;
    const int64_t n0 = (index - j->part_start[p]) * j->part_rows[p], end = n0 + j->part_rows[p];
    gemv_rows(&j->job[p], n0, end < j->job[p].N ? end : j->job[p].N);
}

/* the products a[0..parts) (parts <= MAX_PARTS, e.g. the q, k and v projections of one input) on up to
 * `threads` threads: in parallel when they are big enough together, else one after another on the caller */
static void gemv_many(const gemv_args *a, int parts, int threads) {
    int64_t work = 0, rows = 0;
    for (int p = 0; p < parts; p++) {
        work += a[p].M * a[p].N * a[p].K;
        rows += a[p].N;
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads >= 2 && work >= gemv_min_parallel && rows >= 16) {
        /* each part in about 2 chunks per thread, whole 8-row blocks, at least 16 rows: long contiguous
         * runs of weight rows for the prefetchers (a decode step's fused layers at 2 threads, interleaved
         * A/B runs of benchmarks/native_layer_loop.py, both interleaved: 4.7-7.9 ms against 7.0-11 ms with 8 chunks per thread) */
        gemv_job job = {.parts = parts};
        for (int p = 0; p < parts; p++) {
            int64_t chunk = (a[p].N + 2 * threads - 1) / (2 * threads);
            chunk = chunk < 16 ? 16 : (chunk + 7) & ~(int64_t)7;
            job.job[p] = a[p];
            job.part_rows[p] = chunk;
            job.part_start[p + 1] = job.part_start[p] + (a[p].N + chunk - 1) / chunk;
        }
        if (!pool_run(gemv_chunk, &job, job.part_start[parts], threads)) return;
    }
    for (int p = 0; p < parts; p++) gemv_rows(&a[p], 0, a[p].N);
}

/* rows [M, K] of x (xd, rows x_sr elements apart) widened to float32, each zero-padded to *Kp = K rounded up
 * to 16; NULL when out of memory */
static float *widen_rows(const void *x, int xd, int64_t x_sr, int64_t M, int64_t K, int64_t *Kp) {
    *Kp = (K + 15) & ~(int64_t)15;
    float *xf = malloc(sizeof(float) * (size_t)(M * *Kp > 0 ? M * *Kp : 1));
    if (!xf) return NULL;
    for (int64_t m = 0; m < M; m++) {
        load_row(at(x, xd, m * x_sr), xd, K, xf + m * *Kp);
        for (int64_t k = K; k < *Kp; k++) xf[m * *Kp + k] = 0.0f;
    }
    return xf;
}

/* The W8A8 activations of rows xf [M, K] (float32, rows Kp apart), in one buffer: per row, each block of
 * ACT_BLOCK values quantised to int8 with the scale s = max|x| / 127 (q = x / s rounded half to even, as
 * torch.round; an all-zero block: s = 0, q = 0), the row zero-padded to Kq = K rounded up to 64; the scales
 * of blocks 2j and 2j + 1 repeated over lanes 0-7 and 8-15 of xs[m, j, 0..16); xcorr[m, j, lane] = -128 times
 * the sum of the lane's four activations (the VNNI GEMV's unsigned weights add it back); xsum[m, block] the
 * block's scale times the sum of its codes (the W4A8 GEMV's minima multiply it). Sets a->xq, xs, xcorr, xsum,
 * Kq; returns the buffer to free, or NULL when out of memory. */
static void *quantize_acts(gemv_args *a, int64_t M) {
    const int64_t K = a->K, Kq = (K + ACT_STEP - 1) / ACT_STEP * ACT_STEP, steps = Kq / ACT_STEP;
    const int64_t blocks = Kq / ACT_BLOCK;
    char *buffer = malloc((size_t)(M * Kq + 64) + sizeof(float) * (size_t)(M * steps * 16 * 2 + M * blocks));
    if (!buffer) return NULL;
    int8_t *q = (int8_t *)buffer;
    float *xs = (float *)(buffer + ((M * Kq + 63) / 64) * 64);
    int32_t *corr = (int32_t *)(xs + M * steps * 16);
    float *xsum = (float *)(corr + M * steps * 16);
    for (int64_t m = 0; m < M; m++) {
        const float *x = a->xf + m * a->Kp;
        for (int64_t b0 = 0; b0 < Kq; b0 += ACT_BLOCK) {
            const int64_t b1 = b0 + ACT_BLOCK < K ? b0 + ACT_BLOCK : K;
            float top = 0.0f;
            for (int64_t k = b0; k < b1; k++) top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
            const float scale = top / 127.0f;
            for (int64_t k = b0; k < b0 + ACT_BLOCK; k++)
                q[m * Kq + k] = (int8_t)(k < b1 && scale > 0.0f ? (int32_t)nearbyintf(x[k] / scale) : 0);
            const int64_t j = b0 / ACT_STEP, half = (b0 % ACT_STEP) / ACT_BLOCK;
            for (int lane = 0; lane < 8; lane++) xs[(m * steps + j) * 16 + half * 8 + lane] = scale;
            int32_t codes = 0;
            for (int64_t k = b0; k < b0 + ACT_BLOCK; k++) codes += q[m * Kq + k];
            xsum[m * blocks + b0 / ACT_BLOCK] = scale * (float)codes;
        }
        for (int64_t i = 0; i < steps * 16; i++) { /* lane i % 16 of step i / 16 sums activations 4i .. 4i + 3 */
            const int8_t *four = q + m * Kq + 4 * i;
            corr[m * steps * 16 + i] = -128 * ((int32_t)four[0] + four[1] + four[2] + four[3]);
        }
    }
    a->xq = q;
    a->xs = xs;
    a->xcorr = corr;
    a->xsum = xsum;
    a->Kq = Kq;
    return buffer;
}

/* out [M, N] (contiguous, od) = x [M, K] (rows x_sr elements apart, xd) times w [N, K] int8 with the
 * per-row scale [N] (sd) and optional bias [N] (bd, NULL for none), on up to `threads` threads.
 * Returns 0, or 1 when out of memory. */
static int int8_gemv(const void *x, int xd, int64_t x_sr, int64_t M, int64_t K, const int8_t *w, int64_t N,
                     const void *scale, int sd, const void *bias, int bd, void *out, int od, int a8, int threads,
                     const uint16_t *wmin) {
    int64_t Kp;
    float *xf = widen_rows(x, xd, x_sr, M, K, &Kp);
    if (!xf) return 1;
    gemv_args a = {xf, M, K, Kp, N, w, scale, bias, sd, bd, od, out, NULL, NULL, NULL, 0, wmin ? 4 : 8, wmin, NULL};
    void *acts = a8 || wmin ? quantize_acts(&a, M) : NULL;
    if ((a8 || wmin) && !acts) {
        free(xf);
        return 1;
    }
    gemv_many(&a, 1, threads);
    free(acts);
    free(xf);
    return 0;
}

int confkv_int8_gemv(const void *x, int xd, int64_t x_sr, int64_t M, int64_t K, const int8_t *w, int64_t N,
                     const void *scale, int sd, const void *bias, int bd, void *out, int od, int threads) {
    return int8_gemv(x, xd, x_sr, M, K, w, N, scale, sd, bias, bd, out, od, 0, threads, NULL);
}

/* confkv_int8_gemv with the weight's operands prepared once (fewer arguments through ctypes per call):
 * plan = {w, N, K, scale, sd, bias (0: none), bd, activations (0: float, W8A16; 8: int8 blocks, W8A8),
 * weight bits (8; 4: W4A8, gemv_w4.c, w the codes and scale the block scales), block minima (W4A8, else 0)}
 * as int64 (PLAN_LENGTH entries) */
int confkv_int8_linear(const int64_t *plan, const void *x, int xd, int64_t x_sr, int64_t M, void *out, int threads) {
    const uint16_t *wmin = plan[8] == 4 ? (const uint16_t *)(intptr_t)plan[9] : NULL;
    return int8_gemv(x, xd, x_sr, M, plan[2], (const int8_t *)(intptr_t)plan[0], plan[1], (const void *)(intptr_t)plan[3],
                     (int)plan[4], (const void *)(intptr_t)plan[5], (int)plan[6], out, xd, plan[7] == 8, threads, wmin);
}

/* settings (benchmarks, tests): the idle workers' spin before they sleep (ns; < 0 keeps it) and the
 * smallest product run in parallel (< 0 keeps it); returns the number of workers now running */
int confkv_gemv_configure(int64_t spin_ns, int64_t min_parallel) {
    if (spin_ns >= 0) STORE(&pool.spin_ns, spin_ns);
    if (min_parallel >= 0) gemv_min_parallel = min_parallel;
    return LOAD(&pool.workers);
}
