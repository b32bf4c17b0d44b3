/* Training throughput of the GPT-2 models.
 *
 * 1. tokens/s of a real job (shardplane-coordinator and one
 *    shardplane-worker) training gpt2-mini with AdamW, against PyTorch 1.13
 *    (bench/train_torch.py: the same model, batch shape, optimizer and BLAS
 *    threads), measured in the same run: the median step time after a
 *    warm-up, printed as the ratio of our tokens/s to torch's. Goal: 1.2.
 * 2. The same global batch over 2 ranks (one BLAS thread each) against 1
 *    rank: the speed-up, and where rank 0's step time goes (the worker's
 *    --stats, of the step nearest the median: the model's kernels;
 *    waiting in the runtime's schedule calls,
 *    the collectives compute did not hide; clipping and the optimizer;
 *    the rest; and, overlapping them, the time the runtime's communication
 *    thread was busy with collectives and their casts).
 * Without torch the benchmark fails: its peer is the figure's baseline.
 * Both peers get the same OpenBLAS kernels: on a virtual CPU that hides its
 * model OpenBLAS falls back to Prescott's, and the worker then runs itself
 * with OPENBLAS_CORETYPE set (client/worker/main.c); so does torch here. */
#include <cblas.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/proc.h"

extern char **environ;

#ifndef SP_BIN_DIR
#define SP_BIN_DIR "."
#endif
#ifndef SP_EXAMPLES
#define SP_EXAMPLES "examples"
#endif
#ifndef SP_BENCH_DIR
#define SP_BENCH_DIR "bench"
#endif
#define PYTHON "/usr/bin/python3"

typedef struct opts {
  const char *model;
  int steps, warmup, batch, seq, threads;
} opts;

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, size_t n) {
  qsort(v, n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The median after the warm-up of the array `key` of a stats object. */
static int med_of(json_t *root, const char *key, const opts *o, double *out) {
  json_t *a = json_object_get(root, key);
  if (json_array_size(a) != (size_t)o->steps) return -1;
  double v[1024];
  size_t n = 0;
  for (int i = o->warmup; i < o->steps && n < 1024; i++)
    v[n++] = json_number_value(json_array_get(a, (size_t)i));
  *out = median(v, n);
  return 0;
}

typedef struct job_result {
  double step_s, compute_s, wait_s, optim_s, comm_s;
} job_result;

/* A job of `world` ranks, `threads` BLAS threads each. */
static int run_job(const opts *o, int world, int threads, const char *tmp,
                   job_result *res) {
  char ws[16], steps[16], batch[16], seq[16], th[16], stats[4096];
  snprintf(ws, sizeof ws, "%d", world);
  snprintf(steps, sizeof steps, "%d", o->steps);
  snprintf(batch, sizeof batch, "%d", o->batch);
  snprintf(seq, sizeof seq, "%d", o->seq);
  snprintf(th, sizeof th, "%d", threads);
  snprintf(stats, sizeof stats, "%s/stats.json", tmp);
  char *ca[] = {SP_BIN_DIR "/shardplane-coordinator", "--listen",
                "127.0.0.1:0", "--model", (char *)o->model, "--world-size", ws,
                "--wrap-type", "GPT2Block", "--quiet", "--insecure",
                "--no-auth", NULL};
  sp_proc coord;
  sp_diag d = {{0}};
  if (sp_proc_spawn(&coord, ca, false, false, "listening on 127.0.0.1:%d",
                    &d) < 0) {
    fprintf(stderr, "bench/train: %s\n", d.msg);
    return -1;
  }
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", coord.port);
  pid_t w[8] = {0};
  int failed = 0;
  for (int r = 0; r < world; r++) {
    char rs[16];
    snprintf(rs, sizeof rs, "%d", r);
    char *wa[] = {SP_BIN_DIR "/shardplane-worker", "--coordinator", addr,
                  "--insecure", "--rank", rs, "--steps", steps,
                  "--global-batch", batch, "--seq-len", seq, "--threads", th,
                  "--optimizer", "adamw", "--lr", "1e-3", "--eval-every", "0",
                  "--log-every", "0", "--checkpoint", "none", "--stats", stats,
                  NULL};
    if (posix_spawn(&w[r], wa[0], NULL, NULL, wa, environ) != 0) failed = 1;
  }
  for (int r = 0; r < world; r++) {
    int st;
    if (w[r] > 0 && (waitpid(w[r], &st, 0) != w[r] || !WIFEXITED(st) ||
                     WEXITSTATUS(st) != 0))
      failed = 1;
  }
  sp_proc_stop(&coord, 5000);
  if (failed) {
    fprintf(stderr, "bench/train: a worker of the %d-rank job failed\n",
            world);
    return -1;
  }
  json_error_t je;
  json_t *root = json_load_file(stats, 0, &je);
  unlink(stats);
  int rc = root ? 0 : -1;
  if (rc == 0) rc = med_of(root, "step_seconds", o, &res->step_s);
  /* the split is that of the median step itself, so that its parts add
   * up to it (medians of the parts would not) */
  static const char *const keys[] = {"compute_seconds", "wait_seconds",
                                     "optim_seconds", "comm_seconds"};
  double *parts[] = {&res->compute_s, &res->wait_s, &res->optim_s,
                     &res->comm_s};
  json_t *steps_a = root ? json_object_get(root, "step_seconds") : NULL;
  size_t at = (size_t)o->warmup;
  for (size_t i = (size_t)o->warmup; rc == 0 && i < (size_t)o->steps; i++)
    if (json_number_value(json_array_get(steps_a, i)) == res->step_s ||
        fabs(json_number_value(json_array_get(steps_a, i)) - res->step_s) <
            fabs(json_number_value(json_array_get(steps_a, at)) -
                 res->step_s))
      at = i;
  for (int k = 0; rc == 0 && k < 4; k++) {
    json_t *a = json_object_get(root, keys[k]);
    if (json_array_size(a) != (size_t)o->steps)
      rc = -1;
    else
      *parts[k] = json_number_value(json_array_get(a, at));
  }
  if (rc == 0) res->step_s = json_number_value(json_array_get(steps_a, at));
  if (rc < 0) fprintf(stderr, "bench/train: %s: not the stats of %d GPT-2 "
                      "steps\n", stats, o->steps);
  json_decref(root);
  return rc;
}

/* PyTorch's median step time. */
static int run_torch(const opts *o, double *step_s) {
  char cmd[8192];
  snprintf(cmd, sizeof cmd, "'%s' '%s/train_torch.py' '%s' %d %d %d %d",
           PYTHON, SP_BENCH_DIR, o->model, o->steps, o->batch, o->seq,
           o->threads);
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  char buf[1 << 16];
  size_t n = fread(buf, 1, sizeof buf - 1, p);
  buf[n] = '\0';
  int st = pclose(p);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    fprintf(stderr, "bench/train: the PyTorch peer failed (exit %d): %s "
            "needs python3-torch (scripts/deps.sh installs it)\n",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1, PYTHON);
    return -1;
  }
  json_error_t je;
  json_t *root = json_loads(buf, 0, &je);
  int rc = root ? med_of(root, "step_seconds", o, step_s) : -1;
  json_decref(root);
  if (rc < 0) fprintf(stderr, "bench/train: the PyTorch peer said: %s\n", buf);
  return rc;
}

/* What client/worker/main.c does for itself: the kernels OpenBLAS would
 * pick on real hardware, for both peers. */
static void blas_kernels(void) {
  const char *core = openblas_get_corename();
  if (getenv("OPENBLAS_CORETYPE") || !core || strcasecmp(core, "prescott"))
    return;
  __builtin_cpu_init();
  const char *want = __builtin_cpu_supports("avx512f")  ? "SkylakeX"
                     : __builtin_cpu_supports("avx2")   ? "Haswell"
                     : __builtin_cpu_supports("avx")    ? "Sandybridge"
                                                        : NULL;
  if (want) setenv("OPENBLAS_CORETYPE", want, 1);
}

int main(int argc, char **argv) {
  /* 7 measured steps: an odd count has a median step */
  opts o = {SP_EXAMPLES "/models/gpt2-mini.json", 9, 2, 8, 256, 1};
  static const struct option lo[] = {
      {"model", required_argument, NULL, 'm'},
      {"steps", required_argument, NULL, 's'},
      {"warmup", required_argument, NULL, 'w'},
      {"batch", required_argument, NULL, 'b'},
      {"seq-len", required_argument, NULL, 'T'},
      {"threads", required_argument, NULL, 't'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
    switch (c) {
    case 'm': o.model = optarg; break;
    case 's': o.steps = atoi(optarg); break;
    case 'w': o.warmup = atoi(optarg); break;
    case 'b': o.batch = atoi(optarg); break;
    case 'T': o.seq = atoi(optarg); break;
    case 't': o.threads = atoi(optarg); break;
    default:
      fprintf(c == 'h' ? stdout : stderr,
              "usage: bench/train [--model SPEC] [--steps N] [--warmup N] "
              "[--batch B] [--seq-len T] [--threads N]\n"
              "defaults: gpt2-mini, 9 steps of which the first 2 warm up "
              "(medians of the rest), batch 8, 256 tokens, 1 BLAS thread\n");
      return c == 'h' ? 0 : 2;
    }
  }
  if (o.steps < 1 || o.steps > 1000 || o.warmup < 0 ||
      o.warmup >= o.steps || o.batch < 2 || o.batch % 2 || o.seq < 1 ||
      o.threads < 1) {
    fprintf(stderr, "bench/train: --steps in [1, 1000] above --warmup, an "
            "even --batch, --seq-len and --threads >= 1\n");
    return 2;
  }
  if (access(PYTHON, X_OK) != 0) {
    fprintf(stderr, "bench/train: no %s: the PyTorch peer needs it "
            "(python3-torch)\n", PYTHON);
    return 1;
  }
  blas_kernels();
  char tmpl[] = "/tmp/sp-bench-train-XXXXXX";
  char *tmp = mkdtemp(tmpl);
  if (!tmp) {
    fprintf(stderr, "bench/train: mkdtemp %s: %s\n", tmpl, strerror(errno));
    return 1;
  }
  double tokens = (double)o.batch * o.seq;
  printf("bench/train: %s, batch %d x %d tokens, AdamW, %d BLAS thread%s, "
         "medians of steps %d..%d (OpenBLAS kernels: %s)\n", o.model, o.batch,
         o.seq, o.threads, o.threads == 1 ? "" : "s", o.warmup + 1, o.steps,
         getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE")
                                     : openblas_get_corename());
  fflush(stdout); /* before the children's lines */
  job_result one;
  double torch_s;
  int rc = run_job(&o, 1, o.threads, tmp, &one);
  if (rc == 0) rc = run_torch(&o, &torch_s);
  if (rc == 0) {
    printf("  W=1 shardplane %8.0f tokens/s (%.3f s/step)\n",
           tokens / one.step_s, one.step_s);
    printf("  PyTorch 1.13   %8.0f tokens/s (%.3f s/step)\n",
           tokens / torch_s, torch_s);
    printf("  ratio %.2f (goal >= 1.2: %s)\n", torch_s / one.step_s,
           torch_s / one.step_s >= 1.2 ? "met" : "NOT met");
  }
  job_result two, base;
  if (rc == 0) rc = run_job(&o, 1, 1, tmp, &base);
  if (rc == 0) rc = run_job(&o, 2, 1, tmp, &two);
  if (rc == 0) {
    printf("  W=2 vs W=1 (1 BLAS thread a rank): %.0f vs %.0f tokens/s, "
           "speed-up %.2f\n", tokens / two.step_s, tokens / base.step_s,
           base.step_s / two.step_s);
    const job_result *rs[2] = {&base, &two};
    for (int i = 0; i < 2; i++) {
      const job_result *r = rs[i];
      double other = r->step_s - r->compute_s - r->wait_s - r->optim_s;
      printf("  W=%d rank 0: step %.3f s = compute %.3f + waiting in the "
             "runtime (collectives not hidden) %.3f + clip/optimizer %.3f + "
             "other %.3f; communication thread busy %.3f (overlapping)\n",
             i + 1, r->step_s, r->compute_s, r->wait_s, r->optim_s, other,
             r->comm_s);
    }
  }
  rmdir(tmp);
  return rc == 0 ? 0 : 1;
}
