/* Memory read bandwidth: best of REPEATS passes over one BYTES-long buffer, each OpenMP thread reading
 * its own contiguous slice (threads and their places from OMP_NUM_THREADS / OMP_PLACES).
 *
 *     membw BYTES REPEATS HUGE      (HUGE 1: madvise(MADV_HUGEPAGE) on the 2 MiB-aligned buffer)
 *
 * Prints one JSON object on stdout. The buffer is first written by the thread that later reads each
 * slice (its pages land on that thread's NUMA node). The sum of every word is printed, so the compiler
 * cannot drop the loads. Each pass also records the least CPU time any thread got over the pass's wall
 * time ("cpu_fraction"): below about 0.9 the threads were descheduled (a busy machine) and the figure is
 * the machine's share, not its bandwidth. Built and run by benchmarks/host.py.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double clock_s(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* AnonHugePages of this process in bytes (/proc/self/smaps_rollup), -1 when unknown */
static long long anon_huge_bytes(void) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    long long kb = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %lld kB", &kb) == 1) break;
    fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s BYTES REPEATS HUGE\n", argv[0]);
        return 2;
    }
    size_t bytes = (size_t)strtoull(argv[1], NULL, 10) & ~(size_t)63;
    int repeats = atoi(argv[2]), huge = atoi(argv[3]);
    void *buf = NULL;
    if (bytes == 0 || repeats < 1 || posix_memalign(&buf, 2u << 20, bytes) != 0) {
        fprintf(stderr, "bad size or out of memory\n");
        return 2;
    }
    int madvise_ok = huge ? madvise(buf, bytes, MADV_HUGEPAGE) == 0 : 0;
    uint64_t *words = buf;
    size_t n = bytes / sizeof(uint64_t);
    int threads = omp_get_max_threads();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) words[i] = i;
    long long huge_bytes = anon_huge_bytes();
    double best = 1e30, total = 0.0, best_cpu_fraction = 0.0;
    uint64_t sink = 0;
    printf("{\"bytes\": %zu, \"threads\": %d, \"repeats\": %d, \"seconds\": [", bytes, threads, repeats);
    for (int r = 0; r < repeats; r++) {
        uint64_t sum = 0;
        double least_cpu = 1e30;
        double start = clock_s(CLOCK_MONOTONIC);
#pragma omp parallel reduction(+ : sum) reduction(min : least_cpu)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            size_t lo = n * (size_t)t / (size_t)nt, hi = n * (size_t)(t + 1) / (size_t)nt;
            double cpu0 = clock_s(CLOCK_THREAD_CPUTIME_ID);
            for (size_t i = lo; i < hi; i++) sum += words[i];
            least_cpu = clock_s(CLOCK_THREAD_CPUTIME_ID) - cpu0;
        }
        double secs = clock_s(CLOCK_MONOTONIC) - start;
        sink += sum;
        total += secs;
        if (secs < best) {
            best = secs;
            best_cpu_fraction = least_cpu / secs;
        }
        printf("%s%.9f", r ? ", " : "", secs);
    }
    printf("], \"best_s\": %.9f, \"best_bytes_per_s\": %.1f, \"mean_bytes_per_s\": %.1f, \"cpu_fraction\": %.3f, "
           "\"huge_pages_requested\": %d, \"madvise_ok\": %d, \"anon_huge_pages_bytes\": %lld, \"sink\": %llu}\n",
           best, (double)bytes / best, (double)bytes * repeats / total, best_cpu_fraction, huge, madvise_ok, huge_bytes,
           (unsigned long long)(sink & 0xffff));
    free(buf);
    return 0;
}
