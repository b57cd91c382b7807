/* New slots appended to every per-slot tensor of a hot region or a cold tier's open page in one call
 * (confkv/store/read.py's _append_one, confkv/tiers/cold.py's demote): what torch.cat([tensor, new], dim=2) writes,
 * for each tensor, into a fresh tensor M slots longer. Part of kernels.c.
 *
 * Tensors: `count` tensors src[t] [B, H, L, row_bytes[t] bytes] contiguous, dst[t] [B, H, L + M, row_bytes[t]]
 * contiguous; new slot i of (b, h) comes from new_rows[t] + b * s[0] + h * s[1] + i * s[2], s = new_strides + 3t
 * (bytes; a stride may be 0, to repeat a row), or is zeros where new_rows[t] is NULL (a statistic's start). Pure
 * moves of bytes, so the bytes torch.cat and a zero pad write. Returns 0, 1 for a negative size (nothing written). */
int confkv_append_rows(int64_t B, int64_t H, int64_t L, int64_t M, int64_t count, void *const *src,
                       void *const *dst, const void *const *new_rows, const int64_t *new_strides,
                       const int64_t *row_bytes) {
    if (B < 0 || H < 0 || L < 0 || M < 0 || count < 0) return 1;
    for (int64_t t = 0; t < count; t++)
        if (row_bytes[t] < 0) return 1;
    for (int64_t t = 0; t < count; t++) {
        const int64_t size = row_bytes[t], *s = new_strides + 3 * t;
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t row = b * H + h;
                char *to = (char *)dst[t] + row * (L + M) * size;
                memcpy(to, (const char *)src[t] + row * L * size, (size_t)(L * size));
                for (int64_t i = 0; i < M; i++) {
                    char *slot = to + (L + i) * size;
                    if (new_rows[t])
                        memcpy(slot, (const char *)new_rows[t] + b * s[0] + h * s[1] + i * s[2], (size_t)size);
                    else
                        memset(slot, 0, (size_t)size);
                }
            }
    }
    return 0;
}
