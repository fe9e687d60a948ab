/* The copy crew: threads that stay between calls, so that a transfer cut into several shares
 * does not start and join a thread per share (about 30 us each on a 2-core VM, more than
 * copying a whole page).
 *
 * run_shares() posts its shares as the crew's job and wakes the members; then the calling
 * thread and the members take shares one at a time until none is left, and the caller waits
 * for those it did not run itself. A member that is slow to wake (its core busy) finds
 * nothing left to take, so a call is never slower than the caller copying alone, however
 * busy the machine (but for a layer-wise transfer, below). Which shares are left is one 64-bit word, the `claim`: the job's
 * generation, its share count and the next share to take, so that a member that wakes for a
 * job already done cannot take a share of the next one (its compare-and-swap fails on the
 * generation). A member that has just worked spins for a few microseconds before it sleeps on
 * the futex, so back-to-back transfers find it awake.
 *
 * One call uses the crew at a time; a call that finds it in use (another thread's transfer,
 * or the copy queue's) starts threads of its own for its shares, as before the crew. A forked
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

static uint32_t generation;  /* bumped per job: the members' futex word */
static uint64_t claim;       /* generation << 32 | share count << 16 | next share to take */
static const Share *job;     /* the job's shares, valid while the job has one not yet done */
static uint32_t done;        /* shares of the job done: the caller's futex word */
static uint32_t busy;        /* 1 while a call uses the crew */
static int hired;            /* members started; changed only by the call holding `busy` */
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

/* Take and run shares of job `gen` until none is left (or another job is posted), at most
 * `most` of them. */
static void help(uint32_t gen, int most) {
    uint64_t c = __atomic_load_n(&claim, __ATOMIC_ACQUIRE);
    int taken = 0;
    while (taken < most) {
        uint32_t next = (uint32_t)(c & 0xffff), count = (uint32_t)((c >> 16) & 0xffff);
        if ((uint32_t)(c >> 32) != gen || next >= count)
            return;
        const Share *shares = __atomic_load_n(&job, __ATOMIC_RELAXED); /* the job's if the swap succeeds */
        if (!__atomic_compare_exchange_n(&claim, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue; /* c now holds the word as it is */
        taken++;
        run_share(&shares[next]);
        if (__atomic_add_fetch(&done, 1, __ATOMIC_ACQ_REL) == count)
            wake(&done, 1);
        c = __atomic_load_n(&claim, __ATOMIC_ACQUIRE);
    }
}

static void *serve(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg; /* the generation when hired */
    for (;;) {
        seen = await_change(&generation, seen);
        help(seen, MAX_SHARES);
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
            break; /* fewer members: the caller takes what they do not (not layer-wise) */
        pthread_detach(thread);
        hired++;
    }
    pthread_sigmask(SIG_SETMASK, &before, NULL);
}

static void *run_alone(void *share) {
    run_share(share);
    return NULL;
}

/* The shares on threads started for this call (while another call uses the crew). */
static int run_on_new_threads(const Share *shares, Py_ssize_t count) {
    pthread_t threads[MAX_SHARES];
    Py_ssize_t started = 0;
    int failed = 0;
    for (Py_ssize_t i = 1; i < count; i++) {
        if (pthread_create(&threads[i], NULL, run_alone, (void *)&shares[i]) != 0)
            break;
        started = i;
    }
    run_share(&shares[0]);
    for (Py_ssize_t i = started + 1; i < count; i++) /* threads that could not start: run here */
        run_share(&shares[i]);
    for (Py_ssize_t i = 1; i <= started; i++)
        failed |= pthread_join(threads[i], NULL) != 0;
    return failed;
}

int run_shares(const Share *shares, Py_ssize_t count) {
    if (count <= 1) {
        if (count == 1)
            run_share(&shares[0]);
        return 0;
    }
    pthread_once(&once, register_fork_handler);
    if (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE) != 0)
        return run_on_new_threads(shares, count);
    int layered = shares[0].progress != NULL;
    hire((int)count - 1);
    if (layered && hired < (int)count - 1) { /* the caller would not take the shares left over */
        __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
        return run_on_new_threads(shares, count);
    }
    uint32_t gen = generation + 1;
    __atomic_store_n(&job, shares, __ATOMIC_RELAXED); /* published by the release below */
    __atomic_store_n(&done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&claim, (uint64_t)gen << 32 | (uint64_t)count << 16, __ATOMIC_RELEASE);
    __atomic_store_n(&generation, gen, __ATOMIC_RELEASE);
    wake(&generation, (int)count - 1);
    /* A layer-wise transfer's shares each hold a part of every layer: one share run after
     * another would hold back every layer's end until the last share, so the caller runs one
     * and leaves the others to the members, however late they start. */
    help(gen, layered ? 1 : MAX_SHARES);
    uint32_t now;
    while ((now = __atomic_load_n(&done, __ATOMIC_ACQUIRE)) != (uint32_t)count)
        await_change(&done, now);
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
    return 0;
}
