/* KIVI pages encoded and decoded in one call each (issue 32: "demotion and quantization of a page run in C"): the
 * codes, float16 scales and minima of tiers/formats.py's KiviFormat (and tiers/lowbit.py's quantize_keys /
 * quantize_values), for pages already in the basis they are quantized in (a rotation, or keys before the rotary
 * embedding, is applied by the caller in torch). A ladder's step down decodes a page and encodes it again at fewer
 * bits, and the open page seals into one: in torch each is some twenty small calls.
 *
 * The same float32 operations as lowbit's, in the same order (IEEE division, round half to even, no contraction):
 *   bottom, top = the smallest and largest valid entry of the group (0 and 0 for a group with none);
 *   minimum = float16(bottom); scale = float16((top - minimum) / (2^bits - 1));
 *   code = round(clamp((x - minimum) / (scale > 0 ? scale : 1), 0, 2^bits - 1));
 * so codes, scales and minima equal torch's bit for bit, but for a zero minimum's sign where a group's least entries
 * are zeros of both signs (torch's min keeps either, as its vectorisation falls; the value, the codes and the decoded
 * entries are the same). Decoding is minimum + code * scale, where the product is exact in float32 (an 8-bit code
 * times an 11-bit float16 significand), so fused or not it rounds once.
 * Keys: a group is `group` tokens of one channel (the valid slots only); values: `vgroup` channels of one token
 * (every slot). Codes are packed as lowbit.pack does it: code d of a row at bit bits * d of its bytes (2, 4 and
 * 8 bits: whole bytes; 3 bits: 8 codes to a 3-byte word). A page holding a NaN, an infinity or a value past
 * float16's range declines the whole call (1, nothing promised written): the torch code handles those. */

/* (f32_to_f16: c/int8_rows.c; f16_to_f32: c/pages.c) */

/* row [D] codes -> packed bytes [D * bits / 8] */
static void pack_row(const uint8_t *restrict codes, int64_t D, int bits, uint8_t *restrict out) {
    switch (bits) {
    case 8:
        memcpy(out, codes, (size_t)D);
        break;
    case 4:
        for (int64_t i = 0; i < D / 2; i++) out[i] = (uint8_t)(codes[2 * i] | codes[2 * i + 1] << 4);
        break;
    case 2:
        for (int64_t i = 0; i < D / 4; i++)
            out[i] = (uint8_t)(codes[4 * i] | codes[4 * i + 1] << 2 | codes[4 * i + 2] << 4 | codes[4 * i + 3] << 6);
        break;
    default: /* 3 bits: 8 codes in a 3-byte word */
        for (int64_t w = 0; w < D / 8; w++) {
            uint32_t word = 0;
            for (int i = 0; i < 8; i++) word |= (uint32_t)codes[8 * w + i] << (3 * i);
            for (int b = 0; b < 3; b++) out[3 * w + b] = (uint8_t)(word >> (8 * b));
        }
    }
}

/* packed bytes -> row [D] codes as floats (pages.c's unpack_row without its tables, which the read builds) */
static void unpack_codes_row(const uint8_t *restrict packed, int64_t D, int bits, float *restrict out) {
    switch (bits) {
    case 8:
        for (int64_t d = 0; d < D; d++) out[d] = (float)packed[d];
        break;
    case 4:
        for (int64_t i = 0; i < D / 2; i++) {
            out[2 * i] = (float)(packed[i] & 15u);
            out[2 * i + 1] = (float)(packed[i] >> 4);
        }
        break;
    case 2:
        for (int64_t i = 0; i < D / 4; i++)
            for (int c = 0; c < 4; c++) out[4 * i + c] = (float)((packed[i] >> (2 * c)) & 3u);
        break;
    default: /* 3 bits */
        for (int64_t w = 0; w < D / 8; w++) {
            const uint32_t word = (uint32_t)packed[3 * w] | (uint32_t)packed[3 * w + 1] << 8 |
                                  (uint32_t)packed[3 * w + 2] << 16;
            for (int c = 0; c < 8; c++) out[8 * w + c] = (float)((word >> (3 * c)) & 7u);
        }
    }
}

/* float16 scale and minimum of a group whose valid entries run from bottom to top (found: any valid entry); also
 * as floats, the scale as the division uses it (a zero scale, a constant group, divides by 1) */
static inline void group_range(float bottom, float top, int found, int bits, uint16_t *scale, uint16_t *minimum,
                               float *divide_by, float *minimum_float) {
    if (!found) bottom = top = 0.0f;
    *minimum = f32_to_f16(bottom);
    *minimum_float = f16_to_f32(*minimum);
    *scale = f32_to_f16((top - *minimum_float) / (float)((1 << bits) - 1));
    const float s = f16_to_f32(*scale);
    *divide_by = s > 0.0f ? s : 1.0f;
}

/* codes [n] of x [n] over per-entry minima and divisors (keys: a channel's; values: the group's, repeated) */
static void level_codes(const float *restrict x, const float *restrict minimum, const float *restrict divide_by,
                        int64_t n, int bits, uint8_t *restrict codes) {
    const float top = (float)((1 << bits) - 1);
    for (int64_t i = 0; i < n; i++) {
        float u = (x[i] - minimum[i]) / divide_by[i];
        u = u < 0.0f ? 0.0f : (u > top ? top : u);
        codes[i] = (uint8_t)nearbyintf(u); /* half to even, as torch.round */
    }
}

static int encodable(const float *x, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; i++) ok &= fabsf(x[i]) < 65520.0f; /* not NaN, infinite, or rounding to infinity */
    return ok;
}

/* keys, values [N, P, D] float32 (N pages of P tokens); valid [N, P] (bytes 0 / 1). Writes key_codes [N, P, D * kb /
 * 8], key_scale / key_min [N, P / group, D] (float16 bits), value_codes [N, P, D * vb / 8], value_scale / value_min
 * [N, P, D / vgroup]. Returns 0, 1 (a value it declines, see above) or 2 (out of memory). */
int confkv_kivi_encode(const float *keys, const float *values, const uint8_t *valid, int64_t N, int64_t P, int64_t D,
                       int key_bits, int value_bits, int64_t group, int64_t vgroup, uint8_t *key_codes,
                       uint16_t *key_scale, uint16_t *key_min, uint8_t *value_codes, uint16_t *value_scale,
                       uint16_t *value_min) {
    if (!encodable(keys, N * P * D) || !encodable(values, N * P * D)) return 1;
    /* codes of a key group [group, D]; per channel: bottom, top, minimum, divisor */
    uint8_t *codes = malloc((size_t)(group * D > 0 ? group * D : 1));
    float *work = malloc(sizeof(float) * (size_t)(4 * D > 0 ? 4 * D : 1));
    if (!codes || !work) {
        free(codes);
        free(work);
        return 2;
    }
    float *bottom = work, *top = work + D, *minimum = work + 2 * D, *divide_by = work + 3 * D;
    const int64_t key_width = D * key_bits / 8, value_width = D * value_bits / 8, groups = P / group;
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t t0 = n * P + g * group; /* the group's first row */
            const float *k = keys + t0 * D;
            int found = 0;
            for (int64_t t = 0; t < group; t++) {
                if (!valid[t0 + t]) continue;
                const float *row = k + t * D;
                for (int64_t d = 0; d < D; d++) {
                    bottom[d] = found && bottom[d] <= row[d] ? bottom[d] : row[d];
                    top[d] = found && top[d] >= row[d] ? top[d] : row[d];
                }
                found = 1;
            }
            uint16_t *scale = key_scale + (n * groups + g) * D, *low = key_min + (n * groups + g) * D;
            for (int64_t d = 0; d < D; d++)
                group_range(found ? bottom[d] : 0.0f, found ? top[d] : 0.0f, found, key_bits, scale + d, low + d,
                            divide_by + d, minimum + d);
            for (int64_t t = 0; t < group; t++) {
                level_codes(k + t * D, minimum, divide_by, D, key_bits, codes + t * D);
                pack_row(codes + t * D, D, key_bits, key_codes + (t0 + t) * key_width);
            }
        }
        for (int64_t t = n * P; t < (n + 1) * P; t++) {
            const float *row = values + t * D;
            for (int64_t g = 0; g < D / vgroup; g++) {
                const int64_t at = t * (D / vgroup) + g;
                float low = row[g * vgroup], high = row[g * vgroup], divisor, min_float;
                for (int64_t c = g * vgroup; c < (g + 1) * vgroup; c++) {
                    low = low <= row[c] ? low : row[c];
                    high = high >= row[c] ? high : row[c];
                }
                group_range(low, high, 1, value_bits, value_scale + at, value_min + at, &divisor, &min_float);
                for (int64_t c = g * vgroup; c < (g + 1) * vgroup; c++) {
                    minimum[c] = min_float;
                    divide_by[c] = divisor;
                }
            }
            level_codes(row, minimum, divide_by, D, value_bits, codes);
            pack_row(codes, D, value_bits, value_codes + t * value_width);
        }
    }
    free(codes);
    free(work);
    return 0;
}

/* The inverse: keys, values [N, P, D] float32 = minimum + code * scale, from confkv_kivi_encode's layout. Returns 0,
 * or 2 (out of memory). */
int confkv_kivi_decode(const uint8_t *key_codes, const uint16_t *key_scale, const uint16_t *key_min,
                       const uint8_t *value_codes, const uint16_t *value_scale, const uint16_t *value_min, int64_t N,
                       int64_t P, int64_t D, int key_bits, int value_bits, int64_t group, int64_t vgroup, float *keys,
                       float *values) {
    float *minimum = malloc(sizeof(float) * (size_t)(2 * D > 0 ? 2 * D : 1)), *scale = minimum + D;
    if (!minimum) return 2;
    const int64_t key_width = D * key_bits / 8, value_width = D * value_bits / 8, groups = P / group;
    for (int64_t row = 0; row < N * P; row++) {
        if (row % group == 0) { /* a key group's first row (pages hold whole groups): its channels' ranges */
            const int64_t at_group = (row / P * groups + row % P / group) * D;
            for (int64_t d = 0; d < D; d++) {
                minimum[d] = f16_to_f32(key_min[at_group + d]);
                scale[d] = f16_to_f32(key_scale[at_group + d]);
            }
        }
        float *k = keys + row * D, *v = values + row * D;
        unpack_codes_row(key_codes + row * key_width, D, key_bits, k);
        for (int64_t d = 0; d < D; d++) k[d] = minimum[d] + k[d] * scale[d];
        unpack_codes_row(value_codes + row * value_width, D, value_bits, v);
        for (int64_t g = 0; g < D / vgroup; g++) {
            const float low = f16_to_f32(value_min[row * (D / vgroup) + g]);
            const float step = f16_to_f32(value_scale[row * (D / vgroup) + g]);
            for (int64_t c = g * vgroup; c < (g + 1) * vgroup; c++) v[c] = low + v[c] * step;
        }
    }
    free(minimum);
    return 0;
}
