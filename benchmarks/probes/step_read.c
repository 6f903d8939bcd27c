/* A plain read of one decode step's weights in a batch-1 step's call pattern: LAYERS x the per-layer weights
 * (SIZE bytes each, in order), then TAIL bytes (the lm_head), one OpenMP region per weight, each thread summing
 * its contiguous share with 64-byte vector loads, all in one 2 MiB-aligned buffer marked for huge pages (as the
 * engine's weight arena is). Before each sweep a 256 MiB buffer is written, so the weights come from DRAM. Best
 * and median of SWEEPS sweeps. The same read as probes/linears_read.c (which hard-codes the demo model's bf16
 * layer shapes and prints text) for any shapes, with the lm_head, as one JSON object on stdout: what streaming
 * the weights costs before any arithmetic, the floor under a batch-1 step's weight stream
 * (benchmarks/profiling.py fixed-costs runs it each round beside the read probe).
 *
 *     step_read SWEEPS LAYERS TAIL SIZE...      (threads from OMP_NUM_THREADS)
 *
 * The sum of every word read is printed ("sink"), so the loads are not dropped.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* the sum of words [lo, hi) of w, two independent chains (the compiler vectorises each) */
static uint64_t read_span(const uint64_t *w, size_t lo, size_t hi) {
    uint64_t a = 0, b = 0;
    size_t i = lo;
    for (; i + 16 <= hi; i += 16)
        for (int j = 0; j < 8; j++) a += w[i + j], b += w[i + 8 + j];
    for (; i < hi; i++) a += w[i];
    return a + b;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s SWEEPS LAYERS TAIL SIZE...\n", argv[0]);
        return 2;
    }
    int sweeps = atoi(argv[1]), layers = atoi(argv[2]), per_layer = argc - 4;
    size_t tail = (size_t)strtoull(argv[3], NULL, 10) & ~(size_t)63;
    size_t sizes[64];
    if (sweeps < 1 || layers < 1 || per_layer > 64) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    size_t total = tail;
    for (int i = 0; i < per_layer; i++) {
        sizes[i] = (size_t)strtoull(argv[4 + i], NULL, 10) & ~(size_t)63;
        total += (size_t)layers * sizes[i];
    }
    size_t alloc = (total + (2u << 20)) & ~(size_t)((2u << 20) - 1), flush_bytes = 256u << 20;
    char *buf = NULL, *flush = NULL;
    if (posix_memalign((void **)&buf, 2u << 20, alloc) || posix_memalign((void **)&flush, 2u << 20, flush_bytes)) {
        fprintf(stderr, "out of memory\n");
        return 2;
    }
    madvise(buf, alloc, MADV_HUGEPAGE);
    madvise(flush, flush_bytes, MADV_HUGEPAGE);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < alloc; i += 64) buf[i] = (char)i;
    double secs[256];
    if (sweeps > 256) sweeps = 256;
    uint64_t sink = 0;
    for (int s = 0; s < sweeps; s++) {
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < flush_bytes; i += 64) flush[i]++;
        double t0 = now();
        size_t off = 0;
        for (int l = 0; l <= layers; l++) {
            for (int i = 0; i < (l < layers ? per_layer : 1); i++) {
                size_t n = (l < layers ? sizes[i] : tail) / 8;
                const uint64_t *w = (const uint64_t *)(buf + off);
                off += n * 8;
                uint64_t sum = 0;
#pragma omp parallel reduction(+ : sum)
                {
                    int t = omp_get_thread_num(), nt = omp_get_num_threads();
                    sum += read_span(w, n * (size_t)t / (size_t)nt, n * (size_t)(t + 1) / (size_t)nt);
                }
                sink += sum;
            }
        }
        secs[s] = now() - t0;
    }
    double best = secs[0];
    for (int s = 1; s < sweeps; s++) best = secs[s] < best ? secs[s] : best;
    qsort(secs, (size_t)sweeps, sizeof secs[0], cmp);
    double median = sweeps % 2 ? secs[sweeps / 2] : 0.5 * (secs[sweeps / 2 - 1] + secs[sweeps / 2]);
    printf("{\"bytes\": %zu, \"threads\": %d, \"sweeps\": %d, \"regions\": %d, \"best_s\": %.9f, \"median_s\": %.9f, "
           "\"best_bytes_per_s\": %.1f, \"median_bytes_per_s\": %.1f, \"sink\": %llu}\n",
           total, omp_get_max_threads(), sweeps, layers * per_layer + 1, best, median, (double)total / best,
           (double)total / median, (unsigned long long)(sink & 0xffff));
    free(buf);
    free(flush);
    return 0;
}
