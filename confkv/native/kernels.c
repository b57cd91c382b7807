/* confkv native CPU kernels for the decode step (issue 17): plain C99, no torch headers.
 *
 * Built by confkv/native/loader.py with `cc -O3 -march=native -fPIC -shared -ffp-contract=off`
 * (no -ffast-math: NaN and inf propagate as in torch). Tensors come as raw pointers plus
 * element strides; the last dimension is always contiguous. dtype codes: 0 = float32,
 * 1 = bfloat16. Every kernel is single-threaded (decode shapes are small).
 *
 * bfloat16 <-> float32 as torch does it (c10/util/BFloat16.h): widening is bits << 16; narrowing
 * rounds to nearest even, and any NaN becomes the quiet NaN 0x7FC0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* the value of float f after a round trip through `dtype` (one rounding, as torch's .to(dtype)) */
static inline float round_to(float f, int dtype) {
    return dtype == BF16 ? bf16_to_f32(f32_to_bf16(f)) : f;
}

static void load_row(const void *src, int dtype, int64_t n, float *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

static void store_row(const float *src, int dtype, int64_t n, void *dst) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

static inline const char *at(const void *base, int dtype, int64_t offset) {
    return (const char *)base + offset * (dtype == BF16 ? 2 : 4);
}

/* dot product with 16 independent accumulators, so that the compiler vectorises it without
 * reassociating (no -ffast-math) */
static float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] = fmaf(a[i + j], b[i + j], acc[j]);
    float s = 0.0f;
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

/* exp(x) for x <= 0 (a softmax's x - max), branch-free so that it vectorises: Cody-Waite range
 * reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6 polynomial (Cephes expf's coefficients);
 * relative error about 2 ulp. -inf and x < -87.3 give 0; NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    float xc = x < -87.3f ? -87.3f : x;
    xc = x != x ? 0.0f : xc; /* keeps the int conversion below defined; the NaN is restored at the end */
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    float y = p * scale;
    y = x < -87.3f ? 0.0f : y;
    return x != x ? x : y;
}

/* Softmax attention with attention mass over the concatenation of n_seg segments (every slot
 * visible), the contract of confkv.attention.mass_read.mass_read:
 *   query  [B, Hq, Q, D] (strides q_sb, q_sh, q_sq), Hq = Hkv * G
 *   keys[s], values[s]  [B, Hkv, L_s, D] (strides kv_strides[6 s ..]: kb, kh, kl, vb, vh, vl),
 *          dtypes kv_dtypes[2 s], kv_dtypes[2 s + 1]
 *   out    [B, Hq, Q, D] contiguous, in q_dtype;  mass [B, Hkv, sum L_s] float32 contiguous:
 *          softmax probability averaged over the G query heads of a KV head, summed over Q.
 * Scores, softmax and the weighted sum in float32. Returns 0, or 1 when out of memory. */
int confkv_mass_read(const void *query, int q_dtype, int64_t q_sb, int64_t q_sh, int64_t q_sq,
                     int64_t B, int64_t Hq, int64_t Q, int64_t D, int64_t Hkv, int n_seg,
                     const void *const *keys, const void *const *values, const int *kv_dtypes,
                     const int64_t *lengths, const int64_t *kv_strides, float scaling,
                     void *out, float *mass) {
    const int64_t G = Hq / Hkv, R = G * Q;
    int64_t total = 0;
    for (int s = 0; s < n_seg; s++) total += lengths[s];
    float *qf = malloc(sizeof(float) * (size_t)(R * D + R * total + R * D + D));
    if (!qf) return 1;
    float *scores = qf + R * D, *acc = scores + R * total, *row = acc + R * D;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t j = 0; j < Hkv; j++) {
            /* row r = g * Q + q holds query head j * G + g, query q */
            for (int64_t g = 0; g < G; g++)
                for (int64_t q = 0; q < Q; q++)
                    load_row(at(query, q_dtype, b * q_sb + (j * G + g) * q_sh + q * q_sq), q_dtype, D,
                             qf + (g * Q + q) * D);
            int64_t offset = 0;
            for (int s = 0; s < n_seg; s++) {
                const int kd = kv_dtypes[2 * s];
                const int64_t *st = kv_strides + 6 * s;
                for (int64_t l = 0; l < lengths[s]; l++) {
                    const void *src = at(keys[s], kd, b * st[0] + j * st[1] + l * st[2]);
                    const float *k = kd == F32 ? (const float *)src : row;
                    if (kd != F32) load_row(src, kd, D, row);
                    for (int64_t r = 0; r < R; r++) scores[r * total + offset + l] = dot(qf + r * D, k, D) * scaling;
                }
                offset += lengths[s];
            }
            for (int64_t r = 0; r < R; r++) {
                float *p = scores + r * total, top = p[0], sum = 0.0f;
                for (int64_t l = 1; l < total; l++) top = p[l] > top || p[l] != p[l] ? p[l] : top;
                for (int64_t l = 0; l < total; l++) {
                    p[l] = exp_nonpositive(p[l] - top);
                    sum += p[l];
                }
                const float inv = 1.0f / sum;
                for (int64_t l = 0; l < total; l++) p[l] *= inv;
            }
            float *m = mass + (b * Hkv + j) * total;
            for (int64_t l = 0; l < total; l++) m[l] = 0.0f;
            for (int64_t q = 0; q < Q; q++) {
                for (int64_t l = 0; l < total; l++) {
                    float group = 0.0f;
                    for (int64_t g = 0; g < G; g++) group += scores[(g * Q + q) * total + l];
                    m[l] += group / (float)G;
                }
            }
            for (int64_t i = 0; i < R * D; i++) acc[i] = 0.0f;
            offset = 0;
            for (int s = 0; s < n_seg; s++) {
                const int vd = kv_dtypes[2 * s + 1];
                const int64_t *st = kv_strides + 6 * s + 3;
                for (int64_t l = 0; l < lengths[s]; l++) {
                    const void *src = at(values[s], vd, b * st[0] + j * st[1] + l * st[2]);
                    const float *v = vd == F32 ? (const float *)src : row;
                    if (vd != F32) load_row(src, vd, D, row);
                    for (int64_t r = 0; r < R; r++) {
                        const float w = scores[r * total + offset + l];
                        float *a = acc + r * D;
                        for (int64_t d = 0; d < D; d++) a[d] = fmaf(w, v[d], a[d]);
                    }
                }
                offset += lengths[s];
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t q = 0; q < Q; q++)
                    store_row(acc + (g * Q + q) * D, q_dtype, D,
                              (char *)out + (((b * Hq + j * G + g) * Q + q) * D) * (q_dtype == BF16 ? 2 : 4));
        }
    }
    free(qf);
    return 0;
}

/* LlamaRMSNorm (transformers): h = x.float(); y = (h * rsqrt(mean(h^2) + eps)).to(x.dtype);
 * out = weight * y, in out_dtype (float32 if x or weight is, else bfloat16).
 *   x [rows, n] (row stride x_sr), weight [n], out [rows, n] contiguous. */
void confkv_rms_norm(const void *x, int x_dtype, int64_t x_sr, const void *weight, int w_dtype, void *out,
                     int out_dtype, int64_t rows, int64_t n, float eps) {
    for (int64_t i = 0; i < rows; i++) {
        const void *src = at(x, x_dtype, i * x_sr);
        double sum = 0.0;
        for (int64_t d = 0; d < n; d++) {
            const float h = x_dtype == F32 ? ((const float *)src)[d] : bf16_to_f32(((const uint16_t *)src)[d]);
            sum += (double)(h * h);
        }
        const float inv = 1.0f / sqrtf((float)sum / (float)n + eps);
        for (int64_t d = 0; d < n; d++) {
            const float h = x_dtype == F32 ? ((const float *)src)[d] : bf16_to_f32(((const uint16_t *)src)[d]);
            const float w = w_dtype == F32 ? ((const float *)weight)[d] : bf16_to_f32(((const uint16_t *)weight)[d]);
            const float y = w * round_to(h * inv, x_dtype);
            if (out_dtype == F32) ((float *)out)[i * n + d] = y;
            else ((uint16_t *)out)[i * n + d] = f32_to_bf16(y);
        }
    }
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
