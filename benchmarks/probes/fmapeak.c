/* Peak float32 FMA rate of the cores: each OpenMP thread runs ITERS rounds of ACC independent vector FMAs
 * (acc = acc * m + a, in registers, no memory traffic), best of REPEATS passes.
 *
 *     fmapeak ITERS REPEATS
 *
 * The vectors are as wide as the build's widest float unit (64 bytes with AVX-512, else 32), ACC chains
 * enough to cover the FMA latency on both pipes of current x86 cores. It is the ceiling a float32 GEMM can
 * approach (2 FLOPs per lane per FMA); a library matmul (host.py peak_matmul) may stay well below it.
 * Prints one JSON object on stdout: the best rate over all threads in FLOP/s, per pass the seconds and the
 * least CPU time any thread got over the pass's wall time (below about 0.9: the threads were descheduled).
 * Built and run by benchmarks/host.py.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#define ACC 12

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static double clock_s(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ITERS rounds of ACC FMAs on `seed`-derived registers; returns a lane sum so nothing is dropped */
static float chains(long iters, float seed) {
    vec acc[ACC], m, a;
    for (int l = 0; l < LANES; l++) {
        m[l] = 0.999999f;
        a[l] = seed * 1e-7f;
    }
    for (int j = 0; j < ACC; j++)
        for (int l = 0; l < LANES; l++) acc[j][l] = seed + (float)(j + l);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < ACC; j++) acc[j] = acc[j] * m + a;   /* one vfmadd each: GCC and clang contract a*b + c */
    }
    float s = 0.0f;
    for (int j = 0; j < ACC; j++)
        for (int l = 0; l < LANES; l++) s += acc[j][l];
    return s;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s ITERS REPEATS\n", argv[0]);
        return 2;
    }
    long iters = atol(argv[1]);
    int repeats = atoi(argv[2]);
    if (iters < 1 || repeats < 1) {
        fprintf(stderr, "bad ITERS or REPEATS\n");
        return 2;
    }
    int threads = omp_get_max_threads();
    double best = 1e30, best_cpu_fraction = 0.0;
    float sink = 0.0f;
    printf("{\"threads\": %d, \"lanes\": %d, \"chains\": %d, \"iters\": %ld, \"repeats\": %d, \"seconds\": [",
           threads, LANES, ACC, iters, repeats);
    for (int r = 0; r < repeats; r++) {
        double least_cpu = 1e30, t0 = clock_s(CLOCK_MONOTONIC);
#pragma omp parallel reduction(+ : sink) reduction(min : least_cpu)
        {
            double c0 = clock_s(CLOCK_THREAD_CPUTIME_ID);
            sink += chains(iters, (float)(omp_get_thread_num() + r + 1));
            least_cpu = clock_s(CLOCK_THREAD_CPUTIME_ID) - c0;
        }
        double wall = clock_s(CLOCK_MONOTONIC) - t0;
        printf("%s%.6f", r ? ", " : "", wall);
        if (wall < best) {
            best = wall;
            best_cpu_fraction = least_cpu / wall;
        }
    }
    double flops = 2.0 * LANES * ACC * (double)iters * threads;
    printf("], \"best_flops_per_s\": %.1f, \"cpu_fraction\": %.3f, \"sink\": %g}\n", flops / best,
           best_cpu_fraction, (double)sink);
    return 0;
}
