/* The store's in-place decode step in one call (confkv_decode_step): the new token written into its
 * window slot, the mass read of mass_read.c over the older region and the window, the policy's
 * statistics updated. Part of kernels.c, after mass_read.c. */
/* One layer's FP window buffer and older region, fixed between two changes of either (see
 * confkv/native/decode.py, which mirrors this struct and rebuilds it when the store replaces one). */
typedef struct {
    int64_t B, Hkv, Hq, D, capacity;
    int kv_dtype;
    void *window_keys, *window_values; /* [B, Hkv, C, D] contiguous */
    int64_t *window_positions;         /* [B, Hkv, C] */
    uint8_t *window_valid;             /* [B, C] bool */
    const void *old_keys, *old_values; /* [B, Hkv, L_old, D] with the strides below */
    int64_t old_length, old_key_strides[3], old_value_strides[3];
    int n_stats;                       /* the regions' statistics (the new slot's are zeroed) */
    int linear;                        /* 1: stat = stat * scale + mass * gain here; 0: the masses go out */
    float *window_stats[MAX_STATS];    /* [B, Hkv, C] float32 contiguous */
    float *old_stats[MAX_STATS];       /* [B, Hkv, L_old] float32 contiguous */
    float stat_scale[MAX_STATS], stat_gain[MAX_STATS];
} decode_plan;

/* LayerStore.decode_step's in-place path in one call. Writes one new token per sequence into slot
 * `length` (< capacity) of the window: key / value [B, Hkv, 1, D] (strides k_sb, k_sh / v_sb, v_sh, the
 * plan's dtype), position[b] int64, valid, zero statistics. Then the mass read of query [B, Hq, 1, D]
 * (dtype q_dtype, strides q_sb, q_sh) over the old region's L_old slots and the window's length + 1
 * (confkv_mass_read's contract) into out [B, Hq, 1, D] contiguous; then, when the plan is linear,
 * stat = stat * scale + mass * gain for each statistic (the policy's observe, float32), else the masses go
 * to mass_old [B, Hkv, L_old] and mass_window [B, Hkv, length + 1] float32. Returns 0, 1 when out of memory,
 * 2 when `length` is outside the window. */
int confkv_decode_step(const decode_plan *p, const void *query, int q_dtype, int64_t q_sb, int64_t q_sh,
                       const void *key, int64_t k_sb, int64_t k_sh, const void *value, int64_t v_sb, int64_t v_sh,
                       const int64_t *position, int64_t length, float scaling, void *out, float *mass_old,
                       float *mass_window, int threads) {
    if (length < 0 || length >= p->capacity || p->n_stats < 0 || p->n_stats > MAX_STATS) return 2;
    const int64_t B = p->B, H = p->Hkv, D = p->D, C = p->capacity, bytes = p->kv_dtype == BF16 ? 2 : 4;
    for (int64_t b = 0; b < B; b++) {
        p->window_valid[b * C + length] = 1;
        for (int64_t j = 0; j < H; j++) {
            const int64_t slot = (b * H + j) * C + length;
            memcpy((char *)p->window_keys + slot * D * bytes, (const char *)key + (b * k_sb + j * k_sh) * bytes,
                   (size_t)(D * bytes));
            memcpy((char *)p->window_values + slot * D * bytes,
                   (const char *)value + (b * v_sb + j * v_sh) * bytes, (size_t)(D * bytes));
            p->window_positions[slot] = position[b];
            for (int k = 0; k < p->n_stats; k++) p->window_stats[k][slot] = 0.0f;
        }
    }
    const int64_t meta[18] = {p->old_length, p->kv_dtype, p->kv_dtype, p->old_key_strides[0], p->old_key_strides[1],
                              p->old_key_strides[2], p->old_value_strides[0], p->old_value_strides[1],
                              p->old_value_strides[2],
                              length + 1, p->kv_dtype, p->kv_dtype, H * C * D, C * D, D, H * C * D, C * D, D};
    const void *keys[2] = {p->old_keys, p->window_keys}, *values[2] = {p->old_values, p->window_values};
    float *stats[2 * MAX_STATS];
    for (int k = 0; k < p->n_stats; k++) {
        stats[k] = p->old_stats[k];
        stats[p->n_stats + k] = p->window_stats[k];
    }
    const int64_t stat_rows[2] = {p->old_length, C};
    float *scratch_mass = NULL;
    if (p->linear) { /* the masses only feed the statistics: scratch rows */
        scratch_mass = malloc(sizeof(float) * (size_t)(B * H * (p->old_length + length + 1)));
        if (!scratch_mass) return 1;
        mass_old = scratch_mass;
        mass_window = scratch_mass + B * H * p->old_length;
    }
    float *mass[2] = {mass_old, mass_window};
    mass_args a = {query, q_dtype, q_sb, q_sh, 0, p->Hq, 1, D, H, p->Hq / H, p->Hq / H, 0, 2, keys, values, meta,
                   scaling, out, mass, NULL, 0, p->linear ? p->n_stats : 0, stats, stat_rows, p->stat_scale,
                   p->stat_gain};
    const int status = mass_read_run(&a, B, threads);
    free(scratch_mass);
    return status;
}
