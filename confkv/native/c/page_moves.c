/* A cold tier's pages dropped in one call (confkv/tiers/cold.py's drop_pages): every page tensor keeps, in each
 * row (sequence b, KV head h), its live pages but the dropped ones, in order, at the front. Part of kernels.c.
 *
 * What it computes is the torch path's (cold.py: a mask of the dropped pages, a stable argsort, then a gather of
 * every tensor along its page axis): pure moves of bytes, so the same bytes. Tensors: `count` tensors src[t]
 * [B, H, capacity[t], page_bytes[t] bytes] contiguous, whose first N pages per row are live; dst[t]
 * [B, H, capacity_out[t], page_bytes[t]] contiguous receives the N - M kept pages of each row at its front (dst[t]
 * may be src[t], with the same capacity: the pages move down in place; the pages past N - M are then left as they
 * were). dropped [B, H, M] int64 contiguous: per row, M distinct page numbers in [0, N).
 * Returns 0; 1 when an index is out of range or repeated in a row, or a destination cannot hold the kept pages
 * (nothing written); 2 out of memory (nothing written). */
int confkv_keep_pages(int64_t B, int64_t H, int64_t N, int64_t M, const int64_t *dropped, int count,
                      void *const *src, const int64_t *capacity, void *const *dst, const int64_t *capacity_out,
                      const int64_t *page_bytes) {
    if (B < 0 || H < 0 || N < 0 || M < 0 || M > N || count < 0) return 1;
    for (int t = 0; t < count; t++)
        if (capacity[t] < N || capacity_out[t] < N - M || page_bytes[t] < 0 ||
            (B * H > 0 && dst[t] == src[t] && capacity_out[t] != capacity[t])) /* (no row: no storage, both NULL) */
            return 1;
    unsigned char *gone = calloc((size_t)(B * H * N > 0 ? B * H * N : 1), 1);
    if (!gone) return 2;
    for (int64_t row = 0; row < B * H; row++) /* check every row before a byte moves */
        for (int64_t i = 0; i < M; i++) {
            const int64_t page = dropped[row * M + i];
            if (page < 0 || page >= N || gone[row * N + page]) {
                free(gone);
                return 1;
            }
            gone[row * N + page] = 1;
        }
    for (int t = 0; t < count; t++) {
        const int64_t size = page_bytes[t];
        for (int64_t row = 0; row < B * H; row++) {
            const char *from = (const char *)src[t] + row * capacity[t] * size;
            char *to = (char *)dst[t] + row * capacity_out[t] * size;
            int64_t written = 0;
            for (int64_t page = 0; page < N;) { /* runs of kept pages, one move each */
                if (gone[row * N + page]) {
                    page++;
                    continue;
                }
                int64_t end = page;
                while (end < N && !gone[row * N + end]) end++;
                if (to + written * size != from + page * size)
                    memmove(to + written * size, from + page * size, (size_t)((end - page) * size));
                written += end - page;
                page = end;
            }
        }
    }
    free(gone);
    return 0;
}
