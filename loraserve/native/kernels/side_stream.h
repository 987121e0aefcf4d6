/* A second prefetch stream a product runs beside its own reads: memory the caller reads right after it
 * (the layer's LoRA term's weights, gemm_linear_prefetch / quant_gemm's `side`). `side` = {num_runs, runs
 * per segment (0: no split), then num_runs runs of (address, bytes per row, rows, row stride in bytes)}.
 * With a split, thread t of nth fetches segments [segs t / nth, segs (t + 1) / nth): lora_fused's own
 * split of a segment-major step, so each thread warms the L2 it reads them from; else every thread
 * fetches all. Walked line by line; each piece of a thread's work asks for its share of the lines before
 * it starts (a few dozen at most, which the core keeps in flight while it computes). */
#ifndef LORASERVE_SIDE_STREAM_H
#define LORASERVE_SIDE_STREAM_H

#include <stdint.h>

typedef struct {
    const int64_t *runs;
    int64_t num, r, row;
    const char *at;
} side_t;

/* Moves to the next row that has bytes (or past the last run), at its first line. */
static void side_next_row(side_t *sd) {
    for (;;) {
        if (++sd->row >= sd->runs[4 * sd->r + 2]) sd->row = 0, sd->r++;
        if (sd->r >= sd->num) return;
        const int64_t *run = sd->runs + 4 * sd->r;
        if (run[1] > 0 && run[2] > 0) {
            sd->at = (const char *)((uintptr_t)(run[0] + sd->row * run[3]) & ~(uintptr_t)63);
            return;
        }
        sd->row = run[2]; /* an empty run: on to the next */
    }
}

/* Prefetches the next `count` lines of the stream into L2. */
static inline void side_fetch(side_t *sd, int64_t count) {
    for (int64_t j = 0; j < count && sd->r < sd->num; j++) {
        __builtin_prefetch(sd->at, 0, 2);
        const int64_t *run = sd->runs + 4 * sd->r;
        sd->at += 64;
        if ((intptr_t)sd->at >= run[0] + sd->row * run[3] + run[1]) side_next_row(sd);
    }
}

/* The lines of runs [0, num): each row from its first line to its end. */
static int64_t side_lines(const int64_t *runs, int64_t num) {
    int64_t lines = 0;
    for (int64_t i = 0; i < num; i++) {
        const int64_t *run = runs + 4 * i;
        if (run[1] <= 0) continue;
        for (int64_t row = 0; row < run[2]; row++) {
            const uintptr_t first = (uintptr_t)(run[0] + row * run[3]);
            lines += (int64_t)(((first + (uintptr_t)run[1] + 63) & ~(uintptr_t)63) - (first & ~(uintptr_t)63)) / 64;
        }
    }
    return lines;
}

/* Thread tid of nth's share of `side` (or NULL) into sd, at its first line; returns its lines (0: none,
 * also for a list whose runs do not make whole segments: nothing is fetched). */
static int64_t side_share(const int64_t *side, int64_t tid, int64_t nth, side_t *sd) {
    *sd = (side_t){NULL, 0, 0, -1, NULL};
    if (side == NULL || side[0] <= 0 || side[1] < 0 || (side[1] > 0 && side[0] % side[1] != 0)) return 0;
    const int64_t per_seg = side[1] > 0 ? side[1] : side[0], segs = side[0] / per_seg;
    const int64_t s0 = side[1] > 0 ? segs * tid / nth : 0, s1 = side[1] > 0 ? segs * (tid + 1) / nth : segs;
    if (s1 <= s0) return 0;
    sd->runs = side + 2 + 4 * per_seg * s0, sd->num = per_seg * (s1 - s0);
    side_next_row(sd); /* row -1 of run 0: the first row with bytes */
    return side_lines(sd->runs, sd->num);
}

#endif
