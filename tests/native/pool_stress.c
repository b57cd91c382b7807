/* The worker pool (confkv/native/c/pool.c) under stress: calls of 2 chunks on 2 threads and then 64 chunks on
 * 3, alternating, each chunk counted by its task; every chunk of every call must run exactly once, and before
 * its call returns. POOL_PAUSE_WHILE_ARMING widens the window in which the caller arms a call (a loaded
 * machine can deschedule the caller there for as long): before the fix a worker leaving the last call claimed
 * a chunk of the new one in about half the calls. POOL_PAUSE_WHEN_WOKEN makes a worker late to see a call (the
 * second worker, outside the 2-thread calls): built with -DCONFKV_POOL_STATIC (ThreadSanitizer's split), such a
 * worker read the next call's shape while the caller armed it and ran its chunks twice before the fix.
 * Built and run by test_native_pool.py; prints "<wrong> of <calls> calls wrong". */
#include "c/common.h" /* first: it defines _GNU_SOURCE (usleep); from the kernels' source directory (-I) */
#include <stdio.h>
#include <unistd.h>
#define POOL_PAUSE_WHILE_ARMING() usleep(30)
#define POOL_PAUSE_WHEN_WOKEN() usleep(20)
#include "c/pool.c"

typedef struct { int *counts; } counted;

static void count_chunk(const void *ctx, int64_t chunk) {
    __atomic_add_fetch(&((const counted *)ctx)->counts[chunk], 1, __ATOMIC_SEQ_CST);
    for (volatile int spin = 0; spin < 200; spin++) {} /* a chunk takes a little time, as a real one */
}

int main(int argc, char **argv) {
    const int calls = argc > 1 ? atoi(argv[1]) : 2000;
    static int counts[2][64];
    int wrong = 0;
    for (int call = 0; call < calls; call++) {
        const int chunks = call % 2 ? 64 : 2;
        counted ctx = {counts[call % 2]};
        memset(ctx.counts, 0, sizeof(counts[0]));
        if (pool_run(count_chunk, &ctx, chunks, call % 2 ? 3 : 2)) { fprintf(stderr, "no worker could start\n"); return 2; }
        for (int chunk = 0; chunk < 64; chunk++)
            if (ctx.counts[chunk] != (chunk < chunks)) { wrong++; break; }
    }
    printf("%d of %d calls wrong\n", wrong, calls);
    return wrong != 0;
}
