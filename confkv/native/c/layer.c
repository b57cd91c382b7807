/* ================= one Llama-family decoder layer around its attention, in two calls (lean decoder) =================
 * The torch lines of confkv/hf/lean.py with weight-only INT8 projections, each step rounded to the activations'
 * dtype `xd` as torch rounds it: RMSNorm (confkv_rms_norm), the projections (the GEMV above, several products
 * of one input in one pool call), rotary (confkv_rotary), SiLU and the products and sums of the gated MLP.
 * Plans are confkv_int8_linear's {w, N, K, scale, sd, bias, bd, activations, weight bits, minima} (4-bit weights:
 * gemv_w4.c); every tensor is contiguous. */

static gemv_args plan_args(const int64_t *plan, const float *xf, int64_t M, int64_t Kp, void *out, int od) {
    const int w4 = plan[8] == 4;
    const gemv_args a = {xf, M, plan[2], Kp, plan[1], (const int8_t *)(intptr_t)plan[0], (const void *)(intptr_t)plan[3],
                         (const void *)(intptr_t)plan[5], (int)plan[4], (int)plan[6], od, out, NULL, NULL, NULL, 0,
                         w4 ? 4 : 8, w4 ? (const uint16_t *)(intptr_t)plan[9] : NULL, NULL};
    return a;
}

/* the products of one input `parts` (same K), W8A16 or, when the first plan says so, W8A8 (the activations
 * quantised once for all of them); 0, or 1 when out of memory */
static int gemv_plans(gemv_args *parts, int count, const int64_t *plan, int64_t M, int threads) {
    void *acts = NULL;
    if (plan[7] == 8 || plan[8] == 4) {
        if (!(acts = quantize_acts(&parts[0], M))) return 1;
        for (int p = 1; p < count; p++) {
            parts[p].xq = parts[0].xq;
            parts[p].xs = parts[0].xs;
            parts[p].xcorr = parts[0].xcorr;
            parts[p].xsum = parts[0].xsum;
            parts[p].Kq = parts[0].Kq;
        }
    }
    gemv_many(parts, count, threads);
    free(acts);
    return 0;
}

/* the attention's inputs: n = RMSNorm(x), q = rotary(q_proj(n)), k = rotary(k_proj(n)), v = v_proj(n)
 *   x [B * Q, K] (xd), norm_w [K] (xd), cos and sin [B, Q, D] (strides c_sb, c_sq; xd);
 *   q_out [B, Q, Hq, D], k_out [B, Q, Hkv, D], v_out [B, Q, Hkv, D] (xd). Returns 0, 1 when out of memory. */
int confkv_lean_qkv(const void *x, int xd, int64_t B, int64_t Q, int64_t K, const void *norm_w, float eps, int lanes,
                    const int64_t *plan_q, const int64_t *plan_k, const int64_t *plan_v, const void *cos,
                    const void *sin, int64_t c_sb, int64_t c_sq, int64_t D, void *q_out, void *k_out, void *v_out,
                    int threads) {
    const int64_t M = B * Q, es = xd == BF16 ? 2 : 4, Nq = plan_q[1], Nk = plan_k[1];
    int64_t Kp;
    void *normed = malloc((size_t)(M * K * es)), *q = malloc((size_t)(M * Nq * es)), *k = malloc((size_t)(M * Nk * es));
    float *xf = NULL;
    int status = 1;
    if (!normed || !q || !k) goto done;
    confkv_rms_norm(x, xd, K, norm_w, xd, normed, xd, M, K, eps, lanes);
    if (!(xf = widen_rows(normed, xd, K, M, K, &Kp))) goto done;
    gemv_args parts[3] = {plan_args(plan_q, xf, M, Kp, q, xd), plan_args(plan_k, xf, M, Kp, k, xd),
                          plan_args(plan_v, xf, M, Kp, v_out, xd)};
    if (gemv_plans(parts, 3, plan_q, M, threads)) goto done;
    confkv_rotary(q, Q * Nq, Nq, D, cos, sin, c_sb, c_sq, xd, q_out, B, Q, Nq / D, D);
    confkv_rotary(k, Q * Nk, Nk, D, cos, sin, c_sb, c_sq, xd, k_out, B, Q, Nk / D, D);
    status = 0;
done:
    free(normed);
    free(q);
    free(k);
    free(xf);
    return status;
}

/* out = a + b for rows [M, K] of dtype xd, each sum rounded once (torch's add); left and right: K floats each */
static void add_rows(const void *a, const void *b, void *out, int xd, int64_t M, int64_t K, float *left, float *right) {
    for (int64_t m = 0; m < M; m++) {
        load_row(at(a, xd, m * K), xd, K, left);
        load_row(at(b, xd, m * K), xd, K, right);
        for (int64_t d = 0; d < K; d++) left[d] = left[d] + right[d];
        store_row(left, xd, K, (char *)out + m * K * (xd == BF16 ? 2 : 4));
    }
}

/* g[i] = round(round(silu(g[i])) * u[i]) (rounding to xd), silu(x) = x * sigmoid(x) with sigmoid from
 * exp(-|x|) <= 1 (exp_nonpositive, branch-free, so the loop vectorises): within a few float32 ulps of
 * torch's x / (1 + exp(-x)); +-inf and NaN as torch's (NaN for -inf, as -inf / inf there) */
static void silu_times(float *restrict g, const float *restrict u, int64_t n, int xd) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i], e = exp_nonpositive(-fabsf(x));
        const float sigmoid = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        g[i] = round_to(round_to(x * sigmoid, xd) * u[i], xd);
    }
}

/* the layer after its attention read: h = hidden + o_proj(attn); n = RMSNorm(h);
 * out = h + down_proj(silu(gate_proj(n)) * up_proj(n)) (silu_times)
 *   attn [M, A], hidden and out [M, K], norm_w [K], all xd. Returns 0, 1 when out of memory. */
int confkv_lean_mlp(const void *attn, const void *hidden, int xd, int64_t M, int64_t A, int64_t K,
                    const int64_t *plan_o, const void *norm_w, float eps, int lanes, const int64_t *plan_gate,
                    const int64_t *plan_up, const int64_t *plan_down, void *out, int threads) {
    const int64_t es = xd == BF16 ? 2 : 4, I = plan_gate[1];
    int64_t Kp;
    float *xf = NULL, *row = malloc(sizeof(float) * (size_t)((K > I ? K : I) * 2));
    void *h = malloc((size_t)(M * K * es)), *normed = malloc((size_t)(M * K * es));
    void *gate = malloc((size_t)(M * I * es)), *up = malloc((size_t)(M * I * es));
    int status = 1;
    if (!row || !h || !normed || !gate || !up) goto done;
    float *left = row, *right = row + (K > I ? K : I);
    /* h = hidden + o_proj(attn), the sum rounded once */
    if (!(xf = widen_rows(attn, xd, A, M, A, &Kp))) goto done;
    gemv_args o = plan_args(plan_o, xf, M, Kp, normed, xd); /* `normed` holds o_proj's output for now */
    if (gemv_plans(&o, 1, plan_o, M, threads)) goto done;
    add_rows(hidden, normed, h, xd, M, K, left, right);
    free(xf);
    /* the gated MLP */
    confkv_rms_norm(h, xd, K, norm_w, xd, normed, xd, M, K, eps, lanes);
    if (!(xf = widen_rows(normed, xd, K, M, K, &Kp))) goto done;
    gemv_args gate_up[2] = {plan_args(plan_gate, xf, M, Kp, gate, xd), plan_args(plan_up, xf, M, Kp, up, xd)};
    if (gemv_plans(gate_up, 2, plan_gate, M, threads)) goto done;
    for (int64_t m = 0; m < M; m++) { /* silu(gate) * up, each rounded; the product back into `gate` */
        load_row(at(gate, xd, m * I), xd, I, left);
        load_row(at(up, xd, m * I), xd, I, right);
        silu_times(left, right, I, xd);
        store_row(left, xd, I, (char *)gate + m * I * es);
    }
    free(xf);
    if (!(xf = widen_rows(gate, xd, I, M, I, &Kp))) goto done;
    gemv_args down = plan_args(plan_down, xf, M, Kp, normed, xd); /* `normed` now holds down_proj's output */
    if (gemv_plans(&down, 1, plan_down, M, threads)) goto done;
    add_rows(h, normed, out, xd, M, K, left, right);
    status = 0;
done:
    free(xf);
    free(row);
    free(h);
    free(normed);
    free(gate);
    free(up);
    return status;
}
