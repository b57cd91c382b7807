/* Symmetric INT8 rows, one scale a row, in one call each: the hot tier's INT8 tokens (confkv/quant.py's per-token
 * rule: keys divided by their frozen channel scale first) and the ladder's INT8 open page (tiers/cold_read.py's
 * rule: float16 scales). Each does its torch code's float32 arithmetic in the same order (IEEE division, round half
 * to even, no contraction: built with -ffp-contract=off), so codes, scales and decoded rows equal torch's bit for
 * bit. A row holding a NaN or an infinity declines the whole call (1, nothing promised written): the torch code
 * handles those. */

/* float32 -> float16, round to nearest even (as torch's .to(torch.float16)); finite inputs only */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const float a = fabsf(f);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7C00u); /* rounds to infinity */
    if (a < 6.103515625e-05f) {                           /* below float16's smallest normal: a multiple of 2^-24 */
        const float scaled = a * 16777216.0f;             /* exact: a power of two */
        return (uint16_t)(sign | (uint32_t)nearbyintf(scaled));
    }
    uint32_t m = u & 0x7FFFFFFFu;
    const uint32_t rest = m & 0x1FFFu, half = 0x1000u;
    m >>= 13;
    if (rest > half || (rest == half && (m & 1u))) m++;
    return (uint16_t)(sign | (m - ((127u - 15u) << 10)));
}

/* (float16 -> float32: f16_to_f32, c/pages.c) */

static inline int8_t int8_code(float x) {
    const float r = nearbyintf(x); /* the default rounding mode: half to even, as torch.round */
    return (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
}

/* Rows [rows, n] of `src` (dtype F32 / BF16, rows contiguous) to codes [rows, n] and one scale a row.
 * divisor: NULL, or float32 [rows / per_divisor, n]: row r is divided by divisor row r / per_divisor first (keys by
 * their channel scale). half_scales 0 (quant.py): scale = absmax / 127 as float32 [rows], codes = round(x / scale),
 * a zero scale dividing by 1. half_scales 1 (the open page): scale = float16(absmax / 127) [rows] as uint16,
 * codes = round(x / max(float(scale), 1e-30)). Codes are clamped to +-127. Returns 0, 1 (a non-finite value), or
 * 2 (out of memory). */
int confkv_int8_rows(const void *src, int dtype, int64_t rows, int64_t n, const float *divisor, int64_t per_divisor,
                     int half_scales, int8_t *codes, void *scales) {
    float *row = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (!row) return 2;
    for (int64_t r = 0; r < rows; r++) {
        load_row(at(src, dtype, r * n), dtype, n, row);
        if (divisor) {
            const float *by = divisor + (r / per_divisor) * n;
            for (int64_t i = 0; i < n; i++) row[i] = row[i] / by[i];
        }
        float top = 0.0f;
        int finite = 1;
        for (int64_t i = 0; i < n; i++) {
            const float a = fabsf(row[i]);
            finite &= isfinite(a) != 0;
            top = a > top ? a : top;
        }
        if (!finite) {
            free(row);
            return 1;
        }
        float scale = top / 127.0f, by;
        if (half_scales) {
            const uint16_t stored = f32_to_f16(scale);
            ((uint16_t *)scales)[r] = stored;
            by = f16_to_f32(stored);
            by = by < 1e-30f ? 1e-30f : by;
        } else {
            ((float *)scales)[r] = scale;
            by = scale > 0.0f ? scale : 1.0f;
        }
        for (int64_t i = 0; i < n; i++) codes[r * n + i] = int8_code(row[i] / by);
    }
    free(row);
    return 0;
}

/* The inverse: out [rows, n] (dtype F32 / BF16) = (code * scale) [* multiplier row r / per_multiplier], in float32,
 * rounded once to the dtype (quant.py's dequantize_keys / dequantize_values; cold_read.py's decoded_open).
 * half_scales: scales are float16 (uint16) rather than float32. multiplier: NULL or float32 [rows / per, n]. */
void confkv_int8_rows_decode(const int8_t *codes, const void *scales, int half_scales, int64_t rows, int64_t n,
                             const float *multiplier, int64_t per_multiplier, int dtype, void *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float scale = half_scales ? f16_to_f32(((const uint16_t *)scales)[r]) : ((const float *)scales)[r];
        const int8_t *q = codes + r * n;
        const float *by = multiplier ? multiplier + (r / per_multiplier) * n : NULL;
        if (dtype == F32) {
            float *o = (float *)out + r * n;
            for (int64_t i = 0; i < n; i++) o[i] = by ? ((float)q[i] * scale) * by[i] : (float)q[i] * scale;
        } else {
            uint16_t *o = (uint16_t *)out + r * n;
            for (int64_t i = 0; i < n; i++)
                o[i] = f32_to_bf16(by ? ((float)q[i] * scale) * by[i] : (float)q[i] * scale);
        }
    }
}
