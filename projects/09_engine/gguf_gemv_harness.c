/* One-row (or m-row) GEMV rate of gguf_linear.c's kernel, in C with no Python in the loop (issue 32, ad hoc:
 * no record comes of it). "hot": a 512 x 2048-equivalent weight called 200 times (in L2 on most x86);
 * "cold": 24 copies of an 8192 x 2048-equivalent weight in turn (far beyond L3). -DHUGE advises the copies for
 * transparent huge pages, as gguf_linear._tile_buffer does for the engine's weights.
 *   gcc -O3 -march=native -fopenmp-simd -ffp-contract=fast -fno-trapping-math [-DHUGE] \
 *       -o /tmp/gemv projects/09_engine/gguf_gemv_harness.c -lm -lpthread
 *   /tmp/gemv TYPE [m] [threads] [k]     (TYPE: ggml's number, 2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K)
 * Prints the median and p80 GB/s of weight bytes over 41 hot and 9 cold timings. */
#include "../../kernel_lab/csrc/cpu/gguf_linear.c"
#include <stdio.h>
#include <sys/mman.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int cmpd(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return x < y ? -1 : x > y; }
int main(int argc, char **argv) {
    int type = atoi(argv[1]), m = argc > 2 ? atoi(argv[2]) : 1, threads = argc > 3 ? atoi(argv[3]) : 1;
    int64_t k = argc > 4 ? atoi(argv[4]) : 2048, nhot = 512 * 2048 / k, ncold = 8192 * 2048 / k, ncopies = 24;
    int64_t bb = type == 12 ? 144 : type == 13 ? 176 : type == 14 ? 210 : type == 2 ? 18 : type == 3 ? 20 : 34;
    int64_t bw = is_kquant(type) ? 256 : 32;
    uint16_t h = 0x2000; /* a small fp16 */
    srand(1);
    int64_t rowbytes = k / bw * bb;
    uint8_t *raw = malloc(ncold * rowbytes);
    for (int64_t i = 0; i < ncold * rowbytes; i++) raw[i] = rand();
    for (int64_t b = 0; b < ncold * k / bw; b++) {
        uint8_t *p = raw + b * bb;
        if (type == 14) memcpy(p + 208, &h, 2); else { memcpy(p, &h, 2); if (type == 12 || type == 13 || type == 3) memcpy(p + 2, &h, 2); }
    }
    int64_t tb = tile_bytes_for(type, k / QK);
    int64_t cold_bytes = (ncold / 8) * tb;
    uint8_t **cold = malloc(sizeof(void *) * ncopies);
    for (int c = 0; c < ncopies; c++) { cold[c] = aligned_alloc(1 << 21, (cold_bytes + (1<<21) - 1) & ~((1<<21)-1));
#ifdef HUGE
 madvise(cold[c], (cold_bytes + (1<<21) - 1) & ~((1<<21)-1), MADV_HUGEPAGE);
#endif
 kl_gguf_pack(type, raw, ncold, k, cold[c]); }
    float *x = malloc(sizeof(float) * m * k), *y = malloc(sizeof(float) * m * ncold);
    for (int64_t i = 0; i < m * k; i++) x[i] = (rand() / (float)RAND_MAX) - 0.5f;
    double hot[41], cd[9];
    int64_t hot_bytes = (nhot / 8) * tb;
    for (int it = 0; it < 41; it++) {
        double t0 = now();
        for (int r = 0; r < 200; r++) kl_gguf_linear(type, cold[0], nhot, k, x, m, k, y, nhot, threads);
        hot[it] = hot_bytes * 200 / (now() - t0) / 1e9;
    }
    for (int it = 0; it < 9; it++) {
        double t0 = now();
        for (int c = 0; c < ncopies; c++) kl_gguf_linear(type, cold[c], ncold, k, x, m, k, y, ncold, threads);
        cd[it] = cold_bytes * ncopies / (now() - t0) / 1e9;
    }
    qsort(hot, 41, sizeof(double), cmpd); qsort(cd, 9, sizeof(double), cmpd);
    printf("type %d m=%d t=%d hot %.1f GB/s (p80 %.1f)  cold %.1f GB/s (p80 %.1f)  checksum %g\n", type, m, threads, hot[20], hot[32], cd[4], cd[7], y[0] + y[ncold - 1]);
    return 0;
}
