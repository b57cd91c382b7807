/* The worker pool's workers (confkv/native/c/pool.c): they take chunks while calls run, and they sleep when
 * none does. Both are about the pool's use of the machine, not about its results (the caller computes every
 * chunk a worker leaves, so a worker that never wakes, or one that spins for ever, still gives right answers):
 *   1. calls of 64 chunks of a few microseconds each: a worker must take chunks in some of them;
 *   2. then the caller sleeps for 300 ms: the process may use a small part of that in CPU time (a worker spins
 *      for `spin_ns`, 50 us, after its last call, then sleeps), far below a spinning worker's share even on
 *      a loaded machine (a quarter of a core under a load of 8 on 2 cores: 75 ms).
 * Built and run by test_native_pool.py; prints "<calls with a worker's chunk> of <calls> calls, <idle CPU> ms". */
#include "c/common.h" /* first: it defines _GNU_SOURCE; from the kernels' source directory (-I) */
#include <stdio.h>
#include <time.h>
#include "c/pool.c"

static pthread_t caller;

typedef struct { int by_worker; } tally;

static void note_chunk(const void *ctx, int64_t chunk) {
    (void)chunk;
    if (!pthread_equal(pthread_self(), caller)) __atomic_store_n(&((tally *)ctx)->by_worker, 1, __ATOMIC_SEQ_CST);
    for (volatile int spin = 0; spin < 2000; spin++) {} /* a few microseconds, as a real chunk */
}

static double process_cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    const int calls = argc > 1 ? atoi(argv[1]) : 400;
    caller = pthread_self();
    int helped = 0;
    for (int call = 0; call < calls; call++) {
        tally ctx = {0};
        if (pool_run(note_chunk, &ctx, 64, 2)) { fprintf(stderr, "no worker could start\n"); return 2; }
        helped += ctx.by_worker;
    }
    const double before = process_cpu_ms();
    const struct timespec nap = {0, 300000000};
    nanosleep(&nap, NULL);
    const double idle = process_cpu_ms() - before;
    printf("%d of %d calls, %.1f ms\n", helped, calls, idle);
    return 0;
}
