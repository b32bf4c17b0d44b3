/* Cast bandwidth against memcpy of the same bytes, measured in the same run.
 *
 * For each cast and each path this CPU supports it times the cast and a
 * memcpy that moves exactly as many bytes (read + written: a float32 ->
 * bfloat16 cast of n elements reads 4n and writes 2n bytes, so the baseline
 * copies 3n), alternating the two in every repetition so both see the same
 * machine state, and keeps the best of each. The headline is the ratio: a
 * streaming cast is memory-bound, so 1.0 means "as fast as the memory
 * allows". Two sizes: one far beyond the last-level cache (DRAM-resident)
 * and one that stays in L2.
 *
 * --device cuda runs the same casts on the GPU against cudaMemcpy
 * device-to-device of the same bytes, timed with CUDA events.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "base/clock.h"
#include "base/flag.h"
#include "cast/cast.h"
#include "base/sp_error.h"
#include "shardplane/config.h"

#if SHARDPLANE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "cast/cast_cuda.h"
#endif

#define BENCH_ALIGN ((size_t)2 << 20)

typedef struct bench_cast {
  const char *label;
  sp_dtype src, dst;
} bench_cast;

static const bench_cast k_casts[] = {
    {"f32->bf16", SP_FLOAT32, SP_BFLOAT16},
    {"bf16->f32", SP_BFLOAT16, SP_FLOAT32},
    {"f32->f16", SP_FLOAT32, SP_FLOAT16},
    {"f16->f32", SP_FLOAT16, SP_FLOAT32},
    {"f64->f32", SP_FLOAT64, SP_FLOAT32},
    {"f32->f64", SP_FLOAT32, SP_FLOAT64},
};
#define N_CASTS (sizeof k_casts / sizeof k_casts[0])

typedef struct bench_opts {
  size_t size;       /* elements, DRAM-resident run */
  size_t cache_size; /* elements, cache-resident run */
  int reps;
  bool cuda;
  bool hugepages;
} bench_opts;

static void usage(FILE *f) {
  fprintf(f,
          "usage: cast [--size N] [--cache-size N] [--reps N] [--hugepages] "
          "[--device cpu|cuda] [--help]\n"
          "  --size N        elements for the DRAM-resident run "
          "(default 64Mi; K/M/G suffixes are binary)\n"
          "  --cache-size N  elements for the cache-resident run "
          "(default 128Ki; 0 skips it)\n"
          "  --reps N        repetitions, best one counts (default 10)\n"
          "  --device D      cpu (default) or cuda\n"
          "  --hugepages     ask for transparent huge pages on the CPU "
          "buffers (both\n"
          "                  cast and memcpy use them); default: ordinary "
          "pages\n"
          "Prints, per cast and path, bandwidth (bytes read + written per "
          "second) and its ratio to memcpy of the same bytes in the same "
          "run.\n");
}

static int parse_size(const char *s, size_t *out) {
  char *end = NULL;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno != 0 || end == s) return SP_EINVAL;
  unsigned long long mul = 1;
  if (*end == 'K' || *end == 'k')
    mul = 1ull << 10;
  else if (*end == 'M' || *end == 'm')
    mul = 1ull << 20;
  else if (*end == 'G' || *end == 'g')
    mul = 1ull << 30;
  else if (*end != '\0')
    return SP_EINVAL;
  if (mul != 1 && end[1] != '\0' && strcmp(end + 1, "i") != 0) return SP_EINVAL;
  if (v > SIZE_MAX / mul) return SP_ERANGE;
  *out = (size_t)(v * mul);
  return 0;
}

static int parse_args(int argc, char **argv, bench_opts *o) {
  static const struct option opts[] = {
      {"size", required_argument, NULL, 's'},
      {"cache-size", required_argument, NULL, 'c'},
      {"reps", required_argument, NULL, 'r'},
      {"hugepages", no_argument, NULL, 'H'},
      {"device", required_argument, NULL, 'd'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  static const char *const devices[] = {"cpu", "cuda"};
  sp_diag d = {""};
  long long x = 0;
  size_t i = 0;
  int c, rc = 0;
  while (rc == 0 && (c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (c) {
      case 's':
        if (parse_size(optarg, &o->size) != 0 || o->size == 0)
          rc = sp_flag_fail(&d, "--size", optarg,
                            "a count of elements > 0 "
                            "(K, M, G: binary)");
        break;
      case 'c':
        if (parse_size(optarg, &o->cache_size) != 0)
          rc = sp_flag_fail(&d, "--cache-size", optarg,
                            "a count of elements "
                            "(K, M, G: binary)");
        break;
      case 'r':
        rc = sp_flag_int("--reps", optarg, 1, INT_MAX, &x, &d);
        if (rc == 0) o->reps = (int)x;
        break;
      case 'H': o->hugepages = true; break;
      case 'd':
        rc = sp_flag_choice("--device", optarg, devices, 2, &i, &d);
        if (rc == 0) o->cuda = i == 1;
        break;
      case 'h': usage(stdout); exit(0);
      default: return SP_EINVAL;
    }
  }
  if (rc != 0) {
    fprintf(stderr, "cast: %s\n", d.msg);
    return rc;
  }
  if (optind < argc) {
    fprintf(stderr, "cast: unexpected argument \"%s\"\n", argv[optind]);
    return SP_EINVAL;
  }
  return 0;
}

static void fmt_elems(char *buf, size_t cap, size_t n) {
  if (n % (1u << 20) == 0)
    snprintf(buf, cap, "%zuMi", n >> 20);
  else if (n % (1u << 10) == 0)
    snprintf(buf, cap, "%zuKi", n >> 10);
  else
    snprintf(buf, cap, "%zu", n);
}

static void print_header(const char *baseline) {
  printf("%-10s %-7s %9s %9s %10s %12s %7s\n", "cast", "path", "elements",
         "moved", "cast GB/s", baseline, "ratio");
}

/* bytes: read + written by one pass; times: seconds for one pass. */
static void print_row(const char *label, const char *path, size_t n,
                      double bytes, double t_cast, double t_base) {
  char el[32], mv[32];
  fmt_elems(el, sizeof el, n);
  if (bytes >= (double)(1 << 20))
    snprintf(mv, sizeof mv, "%.0f MiB", bytes / (1 << 20));
  else
    snprintf(mv, sizeof mv, "%.0f KiB", bytes / (1 << 10));
  double bw = bytes / t_cast * 1e-9, base = bytes / t_base * 1e-9;
  printf("%-10s %-7s %9s %9s %10.1f %12.1f %7.2f\n", label, path, el, mv, bw,
         base, bw / base);
  fflush(stdout);
}

/* Something plausible in every format: values spread over a few binades,
 * both signs, no NaN (NaN inputs are rare in training and take a branch in
 * the scalar float16 code that would flatter nothing). */
static void fill_src(void *buf, sp_dtype t, size_t n) {
  uint64_t s = 0x243F6A8885A308D3ull;
  float *tmp = malloc(4096 * sizeof *tmp);
  if (tmp == NULL) abort();
  for (size_t i = 0; i < n; i += 4096) {
    size_t m = n - i < 4096 ? n - i : 4096;
    for (size_t k = 0; k < m; k++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      tmp[k] = (float)((int64_t)(s >> 40) - (1ll << 23)) / (float)(1 << 20);
    }
    int rc = sp_cast_with_path((char *)buf + i * sp_dtype_size(t), t, tmp,
                               SP_FLOAT32, m, SP_CAST_PATH_SCALAR);
    if (rc != 0) abort();
  }
  free(tmp);
}

/* ---- CPU --------------------------------------------------------------- */

static int bench_cpu_size(const bench_opts *o, size_t n, unsigned char *src,
                          unsigned char *dst) {
  /* A cache-resident pass is too short to time alone; repeat it until one
   * sample takes a few milliseconds. */
  int inner = 1;
  if (n * 12 < ((size_t)64 << 20)) {
    inner = (int)(((size_t)256 << 20) / (n * 12 + 1));
    if (inner < 1) inner = 1;
  }
  for (size_t c = 0; c < N_CASTS; c++) {
    const bench_cast *bc = &k_casts[c];
    size_t in = n * sp_dtype_size(bc->src), out = n * sp_dtype_size(bc->dst);
    size_t cpy = (in + out) / 2;
    fill_src(src, bc->src, n);
    for (int p = SP_CAST_PATH_SCALAR; p < SP_CAST_PATH_COUNT; p++) {
      if (!sp_cast_path_available((sp_cast_path)p)) continue;
      double best_cast = 1e30, best_cpy = 1e30;
      for (int r = 0; r < o->reps + 1; r++) { /* +1: warm-up, discarded */
        double t0 = sp_clock_s();
        for (int k = 0; k < inner; k++) memcpy(dst, src, cpy);
        double t1 = sp_clock_s();
        for (int k = 0; k < inner; k++) {
          int rc =
              sp_cast_with_path(dst, bc->dst, src, bc->src, n, (sp_cast_path)p);
          if (rc != 0) {
            fprintf(stderr, "cast: %s\n", sp_strerror(rc));
            return rc;
          }
        }
        double t2 = sp_clock_s();
        if (r == 0) continue;
        if (t1 - t0 < best_cpy) best_cpy = t1 - t0;
        if (t2 - t1 < best_cast) best_cast = t2 - t1;
      }
      print_row(bc->label, sp_cast_path_name((sp_cast_path)p), n,
                (double)(in + out), best_cast / inner, best_cpy / inner);
    }
  }
  return 0;
}

static int bench_cpu(const bench_opts *o) {
  size_t big = o->size > o->cache_size ? o->size : o->cache_size;
  /* 8 bytes per element covers the widest source and destination; memcpy
   * baselines reuse the same buffers (at most 6 bytes per element). */
  /* 2 MiB alignment lets huge pages back the buffers when asked for; the
   * size is rounded up because aligned_alloc wants a multiple. */
  size_t bytes = (big * 8 + BENCH_ALIGN - 1) / BENCH_ALIGN * BENCH_ALIGN;
  unsigned char *src = aligned_alloc(BENCH_ALIGN, bytes);
  unsigned char *dst = aligned_alloc(BENCH_ALIGN, bytes);
  if (src == NULL || dst == NULL) {
    fprintf(stderr, "cast: cannot allocate 2 x %zu MiB\n", big * 8 >> 20);
    free(src);
    free(dst);
    return 1;
  }
  if (o->hugepages) {
    /* Advice only: the kernel may still back the buffers with 4 KiB pages
     * (THP "never", fragmentation); the header says what was asked. */
    (void)madvise(src, bytes, MADV_HUGEPAGE);
    (void)madvise(dst, bytes, MADV_HUGEPAGE);
  }
  /* Fault every page in now so no timed pass pays for it. */
  memset(src, 0, bytes);
  memset(dst, 0, bytes);
  printf("CPU casts, 1 thread, best of %d, %s; best path here: %s\n", o->reps,
         o->hugepages ? "huge pages requested" : "ordinary pages",
         sp_cast_path_name(sp_cast_path_best()));
  printf(
      "baseline: memcpy of the same bytes (read + written) in the same "
      "run; ratio = cast GB/s / memcpy GB/s\n");
  print_header("memcpy GB/s");
  int rc = bench_cpu_size(o, o->size, src, dst);
  if (rc == 0 && o->cache_size > 0)
    rc = bench_cpu_size(o, o->cache_size, src, dst);
  free(src);
  free(dst);
  return rc == 0 ? 0 : 1;
}

/* ---- CUDA -------------------------------------------------------------- */

#if SHARDPLANE_HAVE_CUDA
#define BENCH_CUDA(call)                                                \
  do {                                                                  \
    cudaError_t e_ = (call);                                            \
    if (e_ != cudaSuccess) {                                            \
      fprintf(stderr, "cast: %s: %s\n", #call, cudaGetErrorString(e_)); \
      goto out;                                                         \
    }                                                                   \
  } while (0)

static int bench_cuda(const bench_opts *o) {
  int ndev = 0;
  if (sp_cuda_device_count(&ndev) != 0 || ndev == 0) {
    printf("skipped: no CUDA device\n");
    return 0;
  }
  int rc = 1;
  size_t n = o->size;
  void *src = NULL, *dst = NULL;
  cudaEvent_t e0 = NULL, e1 = NULL, e2 = NULL;
  struct cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  BENCH_CUDA(cudaMalloc(&src, n * 8));
  BENCH_CUDA(cudaMalloc(&dst, n * 8));
  BENCH_CUDA(cudaMemset(src, 0, n * 8));
  BENCH_CUDA(cudaMemset(dst, 0, n * 8));
  BENCH_CUDA(cudaEventCreate(&e0));
  BENCH_CUDA(cudaEventCreate(&e1));
  BENCH_CUDA(cudaEventCreate(&e2));
  printf("CUDA casts on %s, best of %d\n", prop.name, o->reps);
  printf(
      "baseline: cudaMemcpy device-to-device of the same bytes (read + "
      "written) in the same run\n");
  print_header("d2d GB/s");
  for (size_t c = 0; c < N_CASTS; c++) {
    const bench_cast *bc = &k_casts[c];
    size_t in = n * sp_dtype_size(bc->src), out = n * sp_dtype_size(bc->dst);
    size_t cpy = (in + out) / 2;
    float best_cast = 1e30f, best_cpy = 1e30f;
    for (int r = 0; r < o->reps + 1; r++) {
      BENCH_CUDA(cudaEventRecord(e0, 0));
      BENCH_CUDA(cudaMemcpyAsync(dst, src, cpy, cudaMemcpyDeviceToDevice, 0));
      BENCH_CUDA(cudaEventRecord(e1, 0));
      if (sp_cuda_cast(dst, bc->dst, src, bc->src, n, NULL) != 0) goto out;
      BENCH_CUDA(cudaEventRecord(e2, 0));
      BENCH_CUDA(cudaEventSynchronize(e2));
      float t_cpy = 0, t_cast = 0;
      BENCH_CUDA(cudaEventElapsedTime(&t_cpy, e0, e1));
      BENCH_CUDA(cudaEventElapsedTime(&t_cast, e1, e2));
      if (r == 0) continue;
      if (t_cpy < best_cpy) best_cpy = t_cpy;
      if (t_cast < best_cast) best_cast = t_cast;
    }
    print_row(bc->label, "cuda", n, (double)(in + out), best_cast * 1e-3,
              best_cpy * 1e-3);
  }
  rc = 0;
out:
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (e2) cudaEventDestroy(e2);
  cudaFree(src);
  cudaFree(dst);
  return rc;
}
#endif

int main(int argc, char **argv) {
  bench_opts o = {.size = (size_t)64 << 20,
                  .cache_size = (size_t)128 << 10,
                  .reps = 10,
                  .cuda = false};
  if (parse_args(argc, argv, &o) != 0) {
    usage(stderr);
    return 2;
  }
  if (o.cuda) {
#if SHARDPLANE_HAVE_CUDA
    return bench_cuda(&o);
#else
    printf("skipped: no CUDA device (built without CUDA support)\n");
    return 0;
#endif
  }
  return bench_cpu(&o);
}
