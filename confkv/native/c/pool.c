/* ---- the worker pool: threads created once, woken per call, rows handed out in chunks ----
 * A call cuts the output rows into chunks; the caller and the workers claim them one at a time from
 * `ticket` (generation << 32 | next chunk), so a worker that wakes late (a loaded machine, a sleeping
 * worker) takes fewer chunks instead of holding the caller up: the caller waits only for chunks that a
 * worker has claimed. A worker spins (pause) for up to `spin_ns` after its last call, then sleeps on a
 * condition variable; the caller bumps `generation` and signals only when some worker sleeps
 * (Dekker-style: both sides use sequentially consistent atomics, and the sleeper re-checks the
 * generation under the mutex). fork(): the child starts with no workers (pthread_atfork) and creates
 * them again on its first call. A second thread calling while the pool is busy computes alone. */

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int workers;           /* started; only the caller that holds `busy` creates more */
    int busy;              /* a call owns the pool */
    int sleepers;          /* workers waiting on `wake` */
    uint64_t generation;   /* bumped once per parallel call */
    uint64_t born;         /* the generation when the newest worker was created: its first wait starts there */
    uint64_t ticket;       /* (generation & 0xFFFFFFFF) << 32 | the next unclaimed chunk */
    int64_t done;          /* chunks finished in the current generation */
    int64_t spin_ns;       /* how long an idle worker spins before it sleeps */
    int64_t chunks;        /* of the current call */
    int64_t active;        /* threads taking part in the current call (CONFKV_POOL_STATIC only) */
    int64_t acked;         /* workers through the current generation (CONFKV_POOL_STATIC only) */
    void (*task)(const void *ctx, int64_t chunk); /* computes one chunk of the current call */
    const void *ctx;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .spin_ns = 50000};

#ifndef POOL_PAUSE_WHILE_ARMING
#define POOL_PAUSE_WHILE_ARMING()
#endif
#ifndef POOL_PAUSE_WHEN_WOKEN
#define POOL_PAUSE_WHEN_WOKEN()
#endif

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

#ifdef CONFKV_POOL_STATIC
/* Built for ThreadSanitizer (loader.SANITIZERS["thread"]): chunk i goes to thread i % active (the caller is 0,
 * worker w is w), so every call of more than one chunk runs on two threads whatever the timing, and a race
 * between two chunks' memory is reported on every run. Not for speed: a late worker holds the caller up.
 * The caller waits until every worker (those past `active` too) has seen the call and left it (`acked`): a
 * worker outside one call that woke late read the next call's `active` and `chunks` while the caller armed
 * it, ran chunks of it before it started, counted them in its `done` and let it return early (CI's
 * ThreadSanitizer: the caller wrote `task` while that worker still read it). */
static __thread int64_t pool_slot;
#endif

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

#define LOAD(p) __atomic_load_n(p, __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n(p, v, __ATOMIC_SEQ_CST)

static void pool_after_fork_in_child(void) {
    /* the parent's workers do not exist here; the lock may have been held by one of them */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = pool.busy = pool.sleepers = 0;
}

static void pool_register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

/* the next chunk of generation `generation` into *index; 0 when that generation has none left (or is over) */
static int pool_claim(uint64_t generation, int64_t *index) {
    uint64_t ticket = LOAD(&pool.ticket);
    for (;;) {
        if ((ticket >> 32) != (generation & 0xFFFFFFFFu) || (int64_t)(ticket & 0xFFFFFFFFu) >= LOAD(&pool.chunks)) return 0;
        if (__atomic_compare_exchange_n(&pool.ticket, &ticket, ticket + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            *index = (int64_t)(ticket & 0xFFFFFFFFu);
            return 1;
        }
    }
}

/* claim and compute chunks of `generation` until none is left */
static void pool_work(uint64_t generation) {
    int64_t index;
#ifdef CONFKV_POOL_STATIC
    (void)generation; /* the caller cannot start another call before this thread's chunks are done */
    for (index = pool_slot; index < LOAD(&pool.chunks) && pool_slot < LOAD(&pool.active); index += LOAD(&pool.active)) {
        pool.task(pool.ctx, index);
        __atomic_add_fetch(&pool.done, 1, __ATOMIC_SEQ_CST);
    }
    return;
#endif
    while (pool_claim(generation, &index)) {
        pool.task(pool.ctx, index);
        __atomic_add_fetch(&pool.done, 1, __ATOMIC_SEQ_CST);
    }
}

/* a worker's whole life: wait for a generation, take chunks, wait again */
static void *pool_worker(void *arg) {
#ifdef CONFKV_POOL_STATIC
    pool_slot = (int64_t)(intptr_t)arg;
#endif
    (void)arg;
    uint64_t seen = LOAD(&pool.born); /* not the generation now: the caller may have bumped it already */
    for (;;) {
        const int64_t start = now_ns(), spin = LOAD(&pool.spin_ns);
        for (unsigned i = 1; LOAD(&pool.generation) == seen; i++) {
            cpu_relax();
            if ((i & 15) == 0 && now_ns() - start >= spin) {
                pthread_mutex_lock(&pool.lock);
                __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                while (LOAD(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        seen = LOAD(&pool.generation);
        POOL_PAUSE_WHEN_WOKEN(); /* nothing, except in tests/native/pool_stress.c, which makes a worker late */
        pool_work(seen);
#ifdef CONFKV_POOL_STATIC
        __atomic_add_fetch(&pool.acked, 1, __ATOMIC_SEQ_CST);
#endif
    }
    return NULL;
}

/* start workers until there are `wanted`; returns how many run (fewer when pthread_create fails) */
static int pool_grow(int wanted) {
    sigset_t all, saved;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &saved); /* workers never take the process's signals */
    STORE(&pool.born, LOAD(&pool.generation));
    while (pool.workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, pool_worker, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    return pool.workers;
}

/* task(ctx, 0 .. chunks - 1) on the caller and up to threads - 1 workers, each chunk once; 0 when done, 1 when
 * the pool is busy or no worker could start (the caller then computes alone) */
static int pool_run(void (*task)(const void *, int64_t), const void *ctx, int64_t chunks, int threads) {
    int idle = 0;
    if (!__atomic_compare_exchange_n(&pool.busy, &idle, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) return 1;
    pthread_once(&pool_once, pool_register_fork_handler);
    if (pool_grow(threads - 1) < 1) {
        STORE(&pool.busy, 0);
        return 1;
    }
    /* the ticket takes the new generation's tag first: a worker still in pool_claim for the previous call
     * (it just finished its last chunk) then finds no chunk of its generation, whatever `chunks` is; with the
     * old tag still there, a larger `chunks` let it claim a chunk of this call as one of the last call's,
     * and count it done once too often (the caller then returned before a chunk was written) */
    const uint64_t generation = LOAD(&pool.generation) + 1;
    STORE(&pool.ticket, (generation & 0xFFFFFFFFu) << 32);
    pool.task = task;
    pool.ctx = ctx;
    STORE(&pool.chunks, chunks);
    STORE(&pool.active, (int64_t)(threads < pool.workers + 1 ? threads : pool.workers + 1));
    POOL_PAUSE_WHILE_ARMING(); /* nothing, except in tests/native/pool_stress.c, which widens this window */
    STORE(&pool.done, 0);
    STORE(&pool.acked, 0);
    STORE(&pool.generation, generation);
    if (LOAD(&pool.sleepers)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    pool_work(generation);
    const int64_t start = now_ns();
    for (unsigned i = 1; LOAD(&pool.done) < pool.chunks; i++) { /* chunks a worker claimed and still computes */
        cpu_relax();
        if ((i & 255) == 0 && now_ns() - start > 20000) sched_yield(); /* that worker was descheduled */
    }
#ifdef CONFKV_POOL_STATIC
    while (LOAD(&pool.acked) < pool.workers) sched_yield(); /* no worker still inside this call */
#endif
    STORE(&pool.busy, 0);
    return 0;
}

/* the smallest product (M * N * K multiply-adds) worth waking a worker for: below it the hand-off
 * (about a microsecond) costs more than the second core saves */
