/* confkv native CPU kernels for the decode step (issue 17): plain C99, no torch headers.
 *
 * Built by confkv/native/loader.py with `cc -O3 -march=native -fPIC -shared -std=c99 -ffp-contract=off
 * -fopenmp-simd` (no -ffast-math: NaN and inf propagate as in torch). Tensors come as raw pointers plus
 * element strides; the last dimension is always contiguous. dtype codes: 0 = float32, 1 = bfloat16.
 * The INT8 GEMV and the mass read split their work over a persistent worker pool (built with -pthread);
 * the other kernels are single-threaded (decode shapes are small).
 *
 * bfloat16 <-> float32 as torch does it (c10/util/BFloat16.h): widening is bits << 16; narrowing
 * rounds to nearest even, and any NaN becomes the quiet NaN 0x7FC0.
 *
 * One translation unit (the parts share static helpers and the pool), built from its parts in c/:
 */
#include "c/common.h"     /* headers, dtype codes, bfloat16, row loads / stores, reductions, exp */
#include "c/mass_read.c"  /* the attention read with attention mass */
#include "c/decode_step.c" /* the store's in-place decode step around it */
#include "c/pages.c"      /* the read of dense segments with masks and packed KIVI cold pages */
#include "c/page_codes.c" /* its fast path: codes unpacked in plane order, 64 codes a multishift */
#include "c/page_simd.c"  /* its fastest path (AVX-512): dequantization folded into the sums */
#include "c/page_avx2.c"  /* the same on AVX2 CPUs without AVX-512 VBMI */
#include "c/page_widths.c" /* keys at a width per channel (format channel_bits) */
#include "c/page_tasks.c" /* its tasks (slices of a unit's pages) and entry point */
#include "c/prefill.c"    /* the read of a prefill chunk: many query rows, dense bfloat16 segments, masks */
#include "c/rows.c"       /* the confidence's terms, RMSNorm, rotary */
#include "c/gemv.c"       /* the INT8 GEMV's row kernels (W8A16 and W8A8) */
#include "c/gemv_w4.c"    /* the 4-bit weight GEMV's row kernels (W4A8) */
#include "c/pool.c"       /* the worker pool */
#include "c/gemv_calls.c" /* the GEMV's entry points */
#include "c/layer.c"      /* one Llama-family layer around its attention, in two calls */
#include "c/evict.c"      /* a hot region's eviction: which slots leave, and every row split in one call */
#include "c/page_moves.c" /* a cold tier's pages dropped, the rest kept in order, in one call */
#include "c/int8_rows.c"  /* INT8 rows with one scale each: the hot tier's tokens and the open page's */
#include "c/page_encode.c" /* KIVI pages encoded and decoded in one call: seals and the ladder's step-downs */
