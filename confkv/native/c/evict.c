/* Eviction of a hot region's slots in one call: which slots leave, and the rows of every per-slot tensor
 * split into the kept slots and the dropped ones. Part of kernels.c.
 *
 * What it computes is confkv/store/hot_tier.py's select_kept + dropped_slots + two gathers (the torch path,
 * which stays the reference): per (sequence b, KV head h) of a region of L valid slots, the priority of slot s
 * is +inf when it is protected (positions[s] > current[b] - protect, or positions[s] < sinks) and scores[s]
 * otherwise; the `drop` slots of lowest priority leave, the others stay, both in slot order.
 *
 * It refuses (returns 1, nothing written) every case where that selection is not unique or not the torch
 * path's: a NaN priority, a tie across the boundary between the last slot dropped and the first kept (torch's
 * topk may break it either way), and a dropped slot of priority +inf (a protected slot: the torch path then
 * keeps more than asked, its floor of protected tokens). So whenever it returns 0, its split is the torch
 * path's, row for row and byte for byte. 2: out of memory (nothing written).
 *
 * Tensors: scores [B, H, L] float32, positions [B, H, L] int64, current [B] int64, all contiguous. The rows
 * to split: `count` tensors src[t] [B, H, L, row_bytes[t] bytes] contiguous, written to kept[t]
 * [B, H, L - drop, row] and dropped[t] [B, H, drop, row]. 0 < drop < L.
 *
 * confkv_age_evict_rows does a decode step's ageing with it (confkv/store/layer.py's _age, then _evict): the region
 * split is the concatenation of the older region and the FP window's oldest slots, read in place from both, and the
 * window's other slots are copied out too; the same rule, the same refusals. In the steady state (as many slots aged
 * as dropped) the kept slots may be written over the older region itself. */

typedef struct {
    float priority;
    int64_t slot;
} ranked_slot;

/* ascending priority (no NaN reaches it). The order of equal priorities does not matter: the slots dropped are
 * those below the first one kept, since a tie across that boundary is refused. */
static int by_priority(const void *a, const void *b) {
    const float x = ((const ranked_slot *)a)->priority, y = ((const ranked_slot *)b)->priority;
    return (x > y) - (x < y);
}

/* flags[s] = 1 for the `drop` slots of one head that leave; 0 when that choice is unique and takes no
 * protected slot, else 1 (flags then undefined) */
static int choose_dropped(const float *scores, const int64_t *positions, int64_t L, int64_t drop,
                          int64_t newest, int64_t protect, int64_t sinks, ranked_slot *work, unsigned char *flags) {
    for (int64_t s = 0; s < L; s++) {
        const int protected_slot = positions[s] > newest - protect || positions[s] < sinks;
        const float p = protected_slot ? INFINITY : scores[s];
        if (p != p) return 1;
        work[s].priority = p;
        work[s].slot = s;
        flags[s] = 0;
    }
    if (drop == 1) { /* the common decode step: one pass for the lowest and the next lowest */
        int64_t low = 0;
        float second = INFINITY;
        int has_second = 0;
        for (int64_t s = 1; s < L; s++) {
            if (work[s].priority < work[low].priority) {
                second = work[low].priority;
                low = s;
                has_second = 1;
            } else if (!has_second || work[s].priority < second) {
                second = work[s].priority;
                has_second = 1;
            }
        }
        /* a tie: refused (every slot protected is one too: the lowest is then +inf, and so is the next) */
        if (has_second && second == work[low].priority) return 1;
        flags[low] = 1;
        return 0;
    }
    qsort(work, (size_t)L, sizeof(ranked_slot), by_priority);
    const float last = work[drop - 1].priority;
    if (last == INFINITY || work[drop].priority == last) return 1; /* drop < L: the entry point refuses others */
    for (int64_t i = 0; i < drop; i++) flags[work[i].slot] = 1;
    return 0;
}

/* The split of the concatenation of `old` [B, H, L_old, row] and the first `aged` slots of `recent` [B, H, L_recent,
 * row] (L = L_old + aged slots, scores and positions [B, H, L] of that concatenation): the kept slots to kept[t]
 * [B, H, L - drop, row] and the dropped ones to dropped[t] [B, H, drop, row], both in slot order, and recent's
 * other slots (aged .. L_recent - 1) to recent_kept[t] [B, H, L_recent - aged, row] (skipped when NULL). aged = 0
 * with L_recent = 0 is confkv_evict_rows' split of `old` alone. 0, 1 (refused, nothing written) or 2 (no memory). */
static int split_rows(int64_t B, int64_t H, int64_t L_old, int64_t L_recent, int64_t aged, int64_t drop,
                      const float *scores, const int64_t *positions, const int64_t *current, int64_t protect,
                      int64_t sinks, int64_t count, void *const *old_src, void *const *recent_src, void *const *kept,
                      void *const *dropped, void *const *recent_kept, const int64_t *row_bytes) {
    const int64_t L = L_old + aged;
    if (drop <= 0 || drop >= L || aged > L_recent || L_old < 0) return 1; /* aged >= 0: the entry points' */
    const int64_t heads = B * H, keep = L - drop;
    unsigned char *flags = malloc((size_t)(heads * L));
    ranked_slot *work = malloc(sizeof(ranked_slot) * (size_t)L);
    if (!flags || !work) {
        free(flags);
        free(work);
        return 2;
    }
    for (int64_t u = 0; u < heads; u++) {
        const int64_t b = u / H;
        if (choose_dropped(scores + u * L, positions + u * L, L, drop, current[b], protect, sinks, work,
                           flags + u * L)) {
            free(flags);
            free(work);
            return 1;
        }
    }
    free(work);
    for (int64_t t = 0; t < count; t++) {
        const int64_t row = row_bytes[t];
        for (int64_t u = 0; u < heads; u++) {
            const char *from_old = (const char *)old_src[t] + u * L_old * row;
            const char *from_recent = aged ? (const char *)recent_src[t] + u * L_recent * row : NULL;
            char *stay = (char *)kept[t] + u * keep * row, *leave = (char *)dropped[t] + u * drop * row;
            const unsigned char *flag = flags + u * L;
            /* runs of slots that go the same way, in slot order; the older region's and the window's apart. Slot s
             * is written to kept slot <= s, so kept may be old_src itself (in place: keep == L_old): memmove */
            for (int64_t s = 0; s < L;) {
                const int64_t part_end = s < L_old ? L_old : L;
                const char *from = s < L_old ? from_old + s * row : from_recent + (s - L_old) * row;
                int64_t end = s + 1;
                while (end < part_end && flag[end] == flag[s]) end++;
                const size_t bytes = (size_t)((end - s) * row);
                if (flag[s]) {
                    memcpy(leave, from, bytes);
                    leave += bytes;
                } else {
                    if (stay != from) memmove(stay, from, bytes);
                    stay += bytes;
                }
                s = end;
            }
            if (recent_kept && L_recent > aged) /* aged > 0 here: from_recent is set */
                memcpy((char *)recent_kept[t] + u * (L_recent - aged) * row, from_recent + aged * row,
                       (size_t)((L_recent - aged) * row));
        }
    }
    free(flags);
    return 0;
}

int confkv_evict_rows(int64_t B, int64_t H, int64_t L, int64_t drop, const float *scores, const int64_t *positions,
                      const int64_t *current, int64_t protect, int64_t sinks, int64_t count, void *const *src,
                      void *const *kept, void *const *dropped, const int64_t *row_bytes) {
    return split_rows(B, H, L, 0, 0, drop, scores, positions, current, protect, sinks, count, src, NULL, kept,
                      dropped, NULL, row_bytes);
}

/* A decode step's ageing and eviction in one call: the oldest `aged` slots of the FP window `recent` join the older
 * region `old`, and the `drop` slots of lowest priority of that concatenation leave (confkv_evict_rows' rule and
 * refusals, over scores / positions [B, H, L_old + aged] of the concatenation). Writes kept[t], dropped[t] and
 * recent_kept[t] (the window's other slots) as split_rows says; 0 < aged <= L_recent. kept[t] may be old_src[t]
 * itself when aged == drop (the older region keeps its length: rewritten in place, every dropped row read before
 * it is written over). */
int confkv_age_evict_rows(int64_t B, int64_t H, int64_t L_old, int64_t L_recent, int64_t aged, int64_t drop,
                          const float *scores, const int64_t *positions, const int64_t *current, int64_t protect,
                          int64_t sinks, int64_t count, void *const *old_src, void *const *recent_src,
                          void *const *kept, void *const *dropped, void *const *recent_kept,
                          const int64_t *row_bytes) {
    if (aged <= 0) return 1;
    return split_rows(B, H, L_old, L_recent, aged, drop, scores, positions, current, protect, sinks, count, old_src,
                      recent_src, kept, dropped, recent_kept, row_bytes);
}

/* confkv_age_evict_rows with the priorities worked out here, where a policy's score is an EMA plus a recency bonus
 * read from a table (ConfKVPolicy.scores, confkv/policies/confkv.py; CONF-KV, METHOD.md step 3): for slot s of the
 * concatenation, age = max(current[b] - position[s], 0) with current[b] = seen[b] - 1, and
 *   score[s] = ema[s] + weight * table[min(age, table_len - 1)]
 * in float32, the product rounded before the sum as torch's two ops round them (the build's -ffp-contract=off keeps
 * them apart). ema and positions are read from the older region ([B, H, L_old]) and the window's oldest `aged`
 * slots ([B, H, L_recent]) in place, as the rows are; seen [B] int64 (real tokens seen); the table's last entry is
 * 0. The same split, refusals and return values as confkv_age_evict_rows. */
int confkv_age_evict_rows_ema(int64_t B, int64_t H, int64_t L_old, int64_t L_recent, int64_t aged, int64_t drop,
                              const float *old_ema, const float *recent_ema, const int64_t *old_positions,
                              const int64_t *recent_positions, const int64_t *seen, float weight, const float *table,
                              int64_t table_len, int64_t protect, int64_t sinks, int64_t count,
                              void *const *old_src, void *const *recent_src, void *const *kept,
                              void *const *dropped, void *const *recent_kept, const int64_t *row_bytes) {
    if (aged <= 0 || aged > L_recent || L_old < 0 || table_len <= 0 || B <= 0 || H <= 0) return 1;
    const int64_t L = L_old + aged;
    float *scores = malloc(sizeof(float) * (size_t)(B * H * L));
    int64_t *positions = malloc(sizeof(int64_t) * (size_t)(B * H * L));
    int64_t *current = malloc(sizeof(int64_t) * (size_t)B);
    if (!scores || !positions || !current) {
        free(scores);
        free(positions);
        free(current);
        return 2;
    }
    for (int64_t b = 0; b < B; b++) current[b] = seen[b] - 1;
    for (int64_t u = 0; u < B * H; u++) {
        const int64_t now = current[u / H];
        for (int64_t s = 0; s < L; s++) {
            const int64_t at = s < L_old ? u * L_old + s : u * L_recent + (s - L_old);
            const int64_t position = s < L_old ? old_positions[at] : recent_positions[at];
            const float ema = s < L_old ? old_ema[at] : recent_ema[at];
            int64_t age = now - position;
            if (age < 0) age = 0;
            if (age > table_len - 1) age = table_len - 1;
            const float bonus = weight * table[age];
            positions[u * L + s] = position;
            scores[u * L + s] = ema + bonus;
        }
    }
    const int status = split_rows(B, H, L_old, L_recent, aged, drop, scores, positions, current, protect, sinks, count,
                                  old_src, recent_src, kept, dropped, recent_kept, row_bytes);
    free(scores);
    free(positions);
    free(current);
    return status;
}
