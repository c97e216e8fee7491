/* The all-reduce of the captured decode step under tensor parallelism: the row-parallel outputs
 * (o_proj, down_proj, a sparse layer's experts) summed over the ranks from C, so that a rank's
 * decode step stays one native call (docs/architecture.md, "Tensor parallelism").
 *
 * It speaks shm/exchange.py's protocol on the same segment, so its rounds and the Python
 * collectives of the same step (the embedding's all-reduce, the logits' all-gather) are one
 * sequence of rounds: member r's control line (64 bytes) holds the round it last published, its
 * pid and its abort flag; the payload slots are [parity][member]. A round: copy x into this
 * round's parity slot, publish the round number (a release store: the payload is visible first),
 * wait until every other member has published it (acquire loads), add the slots in rank order.
 * The sum is the Python all-reduce's (distributed.all_reduce: slot 0 + slot 1, then each further
 * slot), one pass per slot, so the same bits on every rank and the same bits as the eager step.
 *
 * Waiting spins on the peer's round, yielding the core each turn. A waiting rank never hangs on
 * a peer that is gone: it returns TP_PEER_ABORTED as soon as the peer's abort flag is set (a rank
 * whose step failed sets it: tp_abort), TP_PEER_EXITED when the peer's process no longer runs
 * (checked every half second, as the Python exchange checks), TP_TIMED_OUT past the group's
 * timeout. Then it sets its own flag too, so that a rank waiting for it stops in turn. */
#include <sched.h>
#include <stdio.h>
#include <time.h>

#include "cpu_kernels.h"

#define CONTROL_LINE 64 /* bytes of one member's control line (shm/exchange.py, _LINE) */

static int64_t *control(const decode_tp *tp, int64_t member) {
    return (int64_t *)((char *)tp->segment + member * CONTROL_LINE);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The process exists and is not a zombie (a dead rank its parent has not reaped yet). */
static int alive(int64_t pid) {
    char path[64], stat[512];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    const size_t n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = 0;
    const char *end = strrchr(stat, ')');
    if (!end || end[1] != ' ') return 0;
    return end[2] != 'Z' && end[2] != 'X';
}

void tp_abort(const decode_tp *tp) { __atomic_store_n(control(tp, tp->rank) + 2, 1, __ATOMIC_RELEASE); }

static int wait_for(const decode_tp *tp, int64_t peer, int64_t round) {
    const int64_t *line = control(tp, peer);
    const double start = now_s();
    double check = start;
    for (unsigned spins = 1; __atomic_load_n(line, __ATOMIC_ACQUIRE) < round; spins++) {
        if (__atomic_load_n(line + 2, __ATOMIC_ACQUIRE)) return TP_PEER_ABORTED;
        sched_yield();
        if (spins & 1023) continue;
        const double t = now_s();
        if (t - check < 0.5) continue;
        check = t;
        const int64_t pid = __atomic_load_n(line + 1, __ATOMIC_RELAXED);
        if (pid && !alive(pid)) return TP_PEER_EXITED;
        if (t - start > tp->timeout_s) return TP_TIMED_OUT;
    }
    return 0;
}

int tp_all_reduce_f32(decode_tp *tp, float *x, int64_t n) {
    const int64_t bytes = n * (int64_t)sizeof(float);
    int64_t *mine = control(tp, tp->rank);
    const int64_t round = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1; /* only this rank writes it */
    char *slots = (char *)tp->segment + tp->size * CONTROL_LINE + (round & 1) * tp->size * tp->slot_bytes;
    memcpy(slots + tp->rank * tp->slot_bytes, x, bytes);
    __atomic_store_n(mine, round, __ATOMIC_RELEASE);
    for (int64_t peer = 0; peer < tp->size; peer++) {
        if (peer == tp->rank) continue;
        const int failed = wait_for(tp, peer, round);
        if (failed) {
            tp->failed_peer = peer;
            tp_abort(tp);
            return failed;
        }
    }
    /* One pass per slot: the compiler may not regroup the additions across passes (the library
     * is built with -fassociative-math), so the order is the Python all-reduce's. */
    const float *p0 = (const float *)slots, *p1 = (const float *)(slots + tp->slot_bytes);
    for (int64_t i = 0; i < n; i++) x[i] = p0[i] + p1[i];
    for (int64_t r = 2; r < tp->size; r++) {
        const float *p = (const float *)(slots + r * tp->slot_bytes);
        for (int64_t i = 0; i < n; i++) x[i] += p[i];
    }
    return 0;
}
