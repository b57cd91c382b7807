/* Row-wise kernels: the confidence's terms, RMSNorm (with torch's summation order) and rotary.
 * Part of kernels.c. */
/* The terms of confkv.confidence for each row of logits [B, V] (dtype, rows `row_stride` elements apart),
 * on the temperature-1 distribution, float32: out[3 b ..] = entropy H, log p1, log p2 (the two largest
 * log-probabilities; log p2 = log p1 when V = 1). One pass for the top two, one for
 * Z = sum exp(x - top) and S = sum exp(x - top) (x - top); H = log Z - S / Z. Returns 1 (nothing
 * written for that row and after) at the first row holding a NaN or an infinity: the caller's torch code
 * handles those rows. */
int confkv_confidence_terms(const void *logits, int dtype, int64_t B, int64_t V, int64_t row_stride, float *out) {
    float *row = malloc(sizeof(float) * (size_t)V);
    if (!row) return 2;
    for (int64_t b = 0; b < B; b++) {
        load_row(at(logits, dtype, b * row_stride), dtype, V, row);
        float top = -INFINITY, second = -INFINITY;
        int finite = 1;
        for (int64_t v = 0; v < V; v++) {
            const float x = row[v];
            finite &= isfinite(x) != 0;
            if (x > top) {
                second = top;
                top = x;
            } else if (x > second) {
                second = x;
            }
        }
        if (!finite) {
            free(row);
            return 1;
        }
        float z = 0.0f, s = 0.0f;
#pragma omp simd reduction(+ : z, s)
        for (int64_t v = 0; v < V; v++) {
            const float d = row[v] - top, e = exp_nonpositive(d);
            z += e;
            s += e * d;
        }
        const float log_z = logf(z);
        out[3 * b] = log_z - s / z;
        out[3 * b + 1] = -log_z;
        out[3 * b + 2] = V > 1 ? second - top - log_z : -log_z;
    }
    free(row);
    return 0;
}

/* The float32 sum of a[0..n) in the order of torch's CPU sum over a contiguous last dimension
 * (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum -> vectorized_inner_sum): `lanes`-wide
 * vectors V_0.. of a, four interleaved vector accumulators (acc_k sums V_{4i+k}) cascaded over
 * levels of 2^p steps, the leftover vectors into acc_0, then acc_0 + acc_1 + acc_2 + acc_3, then
 * the scalar tail and the lanes added one by one (rows shorter than a vector: the same with
 * lanes = 1). Reproducing it makes the RMSNorm's mean, and so
 * its bfloat16 output, bit-identical to torch's; loader-side calibration checks `lanes` against
 * torch at run time (0: a plain double-precision sum, no claim of bit equality). */
static float torch_order_sum(const float *a, int64_t n, int lanes) {
    if (lanes <= 0 || lanes > 16) {
        double s = 0.0;
        for (int64_t i = 0; i < n; i++) s += a[i];
        return (float)s;
    }
    if (n < lanes) lanes = 1; /* torch's scalar inner sum: the same cascade on single floats */
    enum { LEVELS = 4, ILP = 4 };
    const int64_t vectors = n / lanes, size = vectors / ILP;
    int64_t log2 = 0;
    while ((INT64_C(1) << log2) < size) log2++;
    const int64_t power = log2 / LEVELS > 4 ? log2 / LEVELS : 4, step = INT64_C(1) << power, mask = step - 1;
    float acc[LEVELS][ILP][16] = {{{0}}};
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) acc[0][k][l] += a[((i * ILP) + k) * lanes + l];
        for (int level = 1; level < LEVELS; level++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (level * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += a[((i * ILP) + k) * lanes + l];
    for (int level = 1; level < LEVELS; level++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = size * ILP; v < vectors; v++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += a[v * lanes + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < n; t++) total += a[t];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

/* torch_order_sum of a[0..n), exported for the loader's calibration against torch.sum */
float confkv_torch_order_sum(const float *a, int64_t n, int lanes) {
    return torch_order_sum(a, n, lanes);
}

/* LlamaRMSNorm (transformers): h = x.float(); y = (h * rsqrt(mean(h^2) + eps)).to(x.dtype);
 * out = weight * y, in out_dtype (float32 if x or weight is, else bfloat16). mean = sum / n with
 * the sum in torch's order (`lanes`, see torch_order_sum).
 *   x [rows, n] (row stride x_sr), weight [n], out [rows, n] contiguous. */
void confkv_rms_norm(const void *x, int x_dtype, int64_t x_sr, const void *weight, int w_dtype, void *out,
                     int out_dtype, int64_t rows, int64_t n, float eps, int lanes) {
    float *squares = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!squares) return; /* the caller's n is a hidden size: never fails in practice */
    for (int64_t i = 0; i < rows; i++) {
        const void *src = at(x, x_dtype, i * x_sr);
        for (int64_t d = 0; d < n; d++) {
            const float h = x_dtype == F32 ? ((const float *)src)[d] : bf16_to_f32(((const uint16_t *)src)[d]);
            squares[d] = h * h;
        }
        const float inv = 1.0f / sqrtf(torch_order_sum(squares, n, lanes) / (float)n + eps);
        for (int64_t d = 0; d < n; d++) {
            const float h = x_dtype == F32 ? ((const float *)src)[d] : bf16_to_f32(((const uint16_t *)src)[d]);
            const float w = w_dtype == F32 ? ((const float *)weight)[d] : bf16_to_f32(((const uint16_t *)weight)[d]);
            const float y = w * round_to(h * inv, x_dtype);
            if (out_dtype == F32) ((float *)out)[i * n + d] = y;
            else ((uint16_t *)out)[i * n + d] = f32_to_bf16(y);
        }
    }
    free(squares);
}

/* Rotary embedding x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]), every
 * product and the sum rounded to `dtype` as torch does for elementwise ops of that dtype.
 *   x [B, Q, H, D] (strides x_sb, x_sq, x_sh), cos and sin [B, Q, D] (strides c_sb, c_sq),
 *   out [B, Q, H, D] contiguous; x, cos, sin and out all of `dtype`. */
void confkv_rotary(const void *x, int64_t x_sb, int64_t x_sq, int64_t x_sh, const void *cos, const void *sin,
                   int64_t c_sb, int64_t c_sq, int dtype, void *out, int64_t B, int64_t Q, int64_t H, int64_t D) {
    const int64_t half = D / 2;
    float c[D > 0 ? D : 1], s[D > 0 ? D : 1], v[D > 0 ? D : 1], o[D > 0 ? D : 1];
    for (int64_t b = 0; b < B; b++) {
        for (int64_t q = 0; q < Q; q++) {
            load_row(at(cos, dtype, b * c_sb + q * c_sq), dtype, D, c);
            load_row(at(sin, dtype, b * c_sb + q * c_sq), dtype, D, s);
            for (int64_t h = 0; h < H; h++) {
                load_row(at(x, dtype, b * x_sb + q * x_sq + h * x_sh), dtype, D, v);
                for (int64_t d = 0; d < D; d++) {
                    const float rotated = d < half ? -v[d + half] : v[d - half];
                    o[d] = round_to(round_to(v[d] * c[d], dtype) + round_to(rotated * s[d], dtype), dtype);
                }
                store_row(o, dtype, D, (char *)out + ((b * Q + q) * H + h) * D * (dtype == BF16 ? 2 : 4));
            }
        }
    }
}
