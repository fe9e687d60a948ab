/* The copy crew: threads that stay between calls, so that a transfer copied by several
 * threads does not start and join a thread per call (about 30 us each on a 2-core VM, more
 * than copying a whole page).
 *
 * run_job() posts its job and wakes as many members as the job may use; then the calling
 * thread and the members take the job's pieces one at a time, in order, until none is left,
 * and the caller waits for those it did not run itself. A member that is slow to wake (its
 * core busy) finds fewer pieces, or none, left to take, so a call is never much slower than
 * the caller copying alone, however busy the machine: at worst it waits for the one piece a
 * member holds. Which pieces are left is one 64-bit word, the `claim`: the job's generation
 * (24 bits), its piece count and the next piece to take (20 bits each), so that a member that
 * wakes for a job already done cannot take a piece of the next one (its compare-and-swap
 * fails on the generation). A member that has just worked spins for a few microseconds
 * before it sleeps on the futex, so back-to-back transfers find it awake; a job's seats
 * (its threads - 1) keep more of those awake members than it asked for from joining it.
 *
 * One call uses the crew at a time; a call that finds it in use (another thread's transfer,
 * or the copy queue's) starts threads of its own that take its pieces the same way. A forked
 * child starts with no crew (fork copies no thread) and hires one when it first needs it.
 */
#include "_native.h"

#include <pthread.h>
#include <signal.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

enum { SPIN_NS = 30000 }; /* how long a member or the caller spins before it sleeps */

static uint32_t generation; /* bumped per job: the members' futex word */
static uint64_t claim;      /* generation << 40 | piece count << 20 | next piece to take */
static Job *job;            /* the posted job, valid while it has a piece not yet done */
static uint32_t done;       /* pieces of the job done: the caller's futex word */
static uint32_t seats;      /* members the posted job may still take (its threads - 1) */
static uint32_t busy;       /* 1 while a call uses the crew */
static int hired;           /* members started; changed only by the call holding `busy` */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Until *word != seen: spin up to SPIN_NS, then sleep on the futex; returns the new value. */
static uint32_t await_change(uint32_t *word, uint32_t seen) {
    uint32_t now;
    int64_t until = 0;
#ifndef __linux__
    long nap_ns = 20000; /* no futex: naps that grow to 1 ms, so an idle member is cheap */
#endif
    for (int i = 0; (now = __atomic_load_n(word, __ATOMIC_ACQUIRE)) == seen; i++) {
        if (i % 64 == 0) {
            int64_t t = now_ns();
            if (until == 0)
                until = t + SPIN_NS;
            else if (t >= until) {
#ifdef __linux__
                syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
                struct timespec ts = {0, nap_ns};
                nanosleep(&ts, NULL);
                nap_ns = nap_ns < 500000 ? nap_ns * 2 : 1000000;
#endif
                continue;
            }
        }
        relax();
    }
    return now;
}

static void wake(uint32_t *word, int count) {
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, count, NULL, NULL, 0);
#else
    (void)word;
    (void)count;
#endif
}

enum { PIECE_BITS = 20, GEN_MASK = (1 << 24) - 1 };

/* Take and run pieces of job `gen` until none is left (or another job is posted). */
static void help(uint32_t gen) {
    uint64_t c = __atomic_load_n(&claim, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t next = (uint32_t)(c & MAX_PIECES), count = (uint32_t)((c >> PIECE_BITS) & MAX_PIECES);
        if ((uint32_t)(c >> (2 * PIECE_BITS)) != (gen & GEN_MASK) || next >= count)
            return;
        Job *posted = __atomic_load_n(&job, __ATOMIC_RELAXED); /* the job's if the swap succeeds */
        if (!__atomic_compare_exchange_n(&claim, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue; /* c now holds the word as it is */
        run_piece(posted, next);
        if (__atomic_add_fetch(&done, 1, __ATOMIC_ACQ_REL) == count)
            wake(&done, 1);
        c = __atomic_load_n(&claim, __ATOMIC_ACQUIRE);
    }
}

/* A seat on the posted job: members beyond its threads - 1 (awake from an earlier job that
 * used more) stay out. A member late for a job may take a seat of the next one and find
 * nothing to do: that job then has fewer helpers, never more. */
static int take_seat(void) {
    uint32_t left = __atomic_load_n(&seats, __ATOMIC_ACQUIRE);
    while (left > 0)
        if (__atomic_compare_exchange_n(&seats, &left, left - 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 1;
    return 0;
}

static void *serve(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg; /* the generation when hired */
    for (;;) {
        seen = await_change(&generation, seen);
        if (take_seat())
            help(seen);
    }
    return NULL;
}

/* In a forked child: no member exists, and no call is under way. */
static void forget_crew(void) {
    hired = 0;
    busy = 0;
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_crew); }

/* Start members until there are `want`, with every signal blocked (a signal meant for the
 * process is handled by a thread that runs Python, never by a member). Called holding `busy`. */
static void hire(int want) {
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &before);
    while (hired < want) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, serve, (void *)(uintptr_t)generation) != 0)
            break; /* fewer members: the others take what they do not */
        pthread_detach(thread);
        hired++;
    }
    pthread_sigmask(SIG_SETMASK, &before, NULL);
}

/* Threads started for one call (while another call uses the crew) take its pieces through
 * a counter of the call's own. */
typedef struct {
    Job *job;
    Py_ssize_t next;
} Local;

static void *take_local(void *arg) {
    Local *local = arg;
    Py_ssize_t i;
    while ((i = __atomic_fetch_add(&local->next, 1, __ATOMIC_ACQ_REL)) < local->job->count)
        run_piece(local->job, i);
    return NULL;
}

static int run_on_new_threads(Job *j) {
    pthread_t threads[MAX_THREADS];
    Local local = {j, 0};
    Py_ssize_t started = 0;
    int failed = 0;
    while (started < j->threads - 1 && started < j->count - 1 &&
           pthread_create(&threads[started], NULL, take_local, &local) == 0)
        started++;
    take_local(&local);
    for (Py_ssize_t i = 0; i < started; i++)
        failed |= pthread_join(threads[i], NULL) != 0;
    return failed;
}

int run_job(Job *j) {
    Py_ssize_t helpers = j->threads - 1 < j->count - 1 ? j->threads - 1 : j->count - 1;
    if (helpers <= 0) {
        for (Py_ssize_t i = 0; i < j->count; i++)
            run_piece(j, i);
        return 0;
    }
    pthread_once(&once, register_fork_handler);
    if (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE) != 0)
        return run_on_new_threads(j);
    hire((int)helpers);
    uint32_t gen = generation + 1;
    __atomic_store_n(&job, j, __ATOMIC_RELAXED); /* published by the release below */
    __atomic_store_n(&done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&seats, (uint32_t)helpers, __ATOMIC_RELAXED); /* published by the release below */
    __atomic_store_n(&claim, (uint64_t)(gen & GEN_MASK) << (2 * PIECE_BITS) | (uint64_t)j->count << PIECE_BITS,
                     __ATOMIC_RELEASE);
    __atomic_store_n(&generation, gen, __ATOMIC_RELEASE);
    wake(&generation, (int)helpers);
    help(gen);
    uint32_t now;
    while ((now = __atomic_load_n(&done, __ATOMIC_ACQUIRE)) != (uint32_t)j->count)
        await_change(&done, now);
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
    return 0;
}
