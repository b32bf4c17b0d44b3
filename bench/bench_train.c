/* Training throughput of the GPT-2 models.
 *
 * Rounds (--rounds, default 3) of, in this order: a one-rank job
 * (shardplane-coordinator and one shardplane-worker) training gpt2-mini
 * with AdamW; PyTorch 1.13 training the same model (bench/train_torch.py:
 * the same model, batch shape, optimizer and BLAS threads); a two-rank
 * job on the same global batch (one BLAS thread a rank: the machine's
 * cores shared) and, when --threads is not 1, a one-rank job with one
 * thread as its baseline. Each job's figure is its median step after the
 * warm-up; the peers alternate (A B A B ...) because the machine is
 * shared and its speed drifts, so each round's ratio compares neighbours
 * in time, and the result is the median of the rounds' ratios.
 *
 * 1. tokens/s of W = 1 against torch: the ratio, PASS when >= 1.2. The
 *    fairness is printed: torch's busy threads (measured) and our BLAS
 *    threads and communication thread.
 * 2. W = 2 against W = 1: the speed-up, and where rank 0's step time goes
 *    (the worker's --stats, of the step nearest the median of the round
 *    nearest the median: the model's kernels; waiting in the runtime's
 *    schedule calls, the collectives compute did not hide; clipping and
 *    the optimizer; the rest; and, overlapping them, the time the
 *    runtime's communication thread was busy with collectives and their
 *    casts).
 * 3. Rank 0's memory in GPT-2 training at W = 1 and 2 against the memory
 *    model (sp_mem_estimate_plan, AdamW): the runtime's counted reserved
 *    peak equal to the prediction, and the process's RSS growth (VmHWM
 *    after the steps minus VmRSS before sp_fsdp_new) within 10 % of the
 *    prediction plus the activations the worker allocated (which the
 *    runtime does not hold); PASS or FAIL each.
 * Any FAIL exits 1. Without torch the benchmark fails: its peer is the
 * figure's baseline. Both peers get the same OpenBLAS kernels: on a
 * virtual CPU that hides its model OpenBLAS falls back to Prescott's, and
 * the worker then runs itself with OPENBLAS_CORETYPE set
 * (client/worker/blas_kernels.h); so does torch here. */
#include <cblas.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/proc.h"
#include "plan/memory.h"
#include "predict.h"
#include "support/capture.h"
#include "support/stats.h"
#include "support/tmpdir.h"
#include "worker/blas_kernels.h"

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
#define MAX_ROUNDS 15
#define GOAL 1.2
#define MIB (1024.0 * 1024.0)

typedef struct opts {
  const char *model;
  int steps, warmup, batch, seq, threads, rounds;
  bool ckpt; /* --checkpointing: both peers recompute each block */
} opts;

/* The median after the warm-up of the array `key` of a stats object. */
static int med_of(json_t *root, const char *key, const opts *o, double *out) {
  json_t *a = json_object_get(root, key);
  if (json_array_size(a) != (size_t)o->steps) return -1;
  double v[1024];
  size_t n = 0;
  for (int i = o->warmup; i < o->steps && n < 1024; i++)
    v[n++] = json_number_value(json_array_get(a, (size_t)i));
  *out = sp_test_median(v, n);
  return 0;
}

typedef struct job_result {
  double step_s, compute_s, wait_s, optim_s, comm_s;
  /* rank 0's memory in training (bytes) */
  uint64_t counted_reserved, activations;
  long long rss_before, rss_hwm;
} job_result;

static uint64_t jbytes(json_t *acct, const char *what, const char *field) {
  return (uint64_t)json_integer_value(
      json_object_get(json_object_get(acct, what), field));
}

/* The memory part of a worker's --stats. */
static int read_memory(json_t *root, job_result *res) {
  json_t *mem = json_object_get(root, "memory");
  json_t *train = json_object_get(mem, "train");
  if (!train) return -1;
  res->rss_before = json_integer_value(json_object_get(mem, "rss_before"));
  res->rss_hwm = json_integer_value(json_object_get(train, "rss_hwm"));
  res->activations =
      (uint64_t)json_integer_value(json_object_get(mem, "activations"));
  res->counted_reserved =
      jbytes(json_object_get(train, "counted"), "reserved", "peak");
  return res->rss_before > 0 && res->rss_hwm > 0 && res->activations > 0 ? 0
                                                                         : -1;
}

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
  char *ca[] = {SP_BIN_DIR "/shardplane-coordinator",
                "--listen",
                "127.0.0.1:0",
                "--model",
                (char *)o->model,
                "--world-size",
                ws,
                "--wrap-type",
                "GPT2Block",
                "--quiet",
                "--insecure",
                "--no-auth",
                NULL};
  sp_proc coord;
  sp_diag d = {{0}};
  if (sp_proc_spawn(&coord, ca, false, false, "listening on 127.0.0.1:%d", &d) <
      0) {
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
                  /* torch's AdamW (train_torch.py), not the spec's
                   * recipe: its betas, decay, constant lr, no clipping */
                  "--optimizer", "adamw", "--lr", "1e-3", "--betas",
                  "0.9,0.999", "--weight-decay", "0.01", "--lr-schedule",
                  "constant", "--clip-grad-norm", "0", "--eval-every", "0",
                  "--log-every", "0", "--checkpoint", "none", "--stats", stats,
                  o->ckpt ? "--activation-checkpointing" : NULL, NULL};
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
    fprintf(stderr, "bench/train: a worker of the %d-rank job failed\n", world);
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
            fabs(json_number_value(json_array_get(steps_a, at)) - res->step_s))
      at = i;
  for (int k = 0; rc == 0 && k < 4; k++) {
    json_t *a = json_object_get(root, keys[k]);
    if (json_array_size(a) != (size_t)o->steps)
      rc = -1;
    else
      *parts[k] = json_number_value(json_array_get(a, at));
  }
  if (rc == 0) res->step_s = json_number_value(json_array_get(steps_a, at));
  if (rc == 0) rc = read_memory(root, res);
  if (rc < 0)
    fprintf(stderr,
            "bench/train: %s: not the stats of %d GPT-2 "
            "steps\n",
            stats, o->steps);
  json_decref(root);
  return rc;
}

/* PyTorch's median step time and its busy threads. */
static int run_torch(const opts *o, double *step_s, int *busy) {
  char cmd[8192];
  snprintf(cmd, sizeof cmd, "'%s' '%s/train_torch.py' '%s' %d %d %d %d%s",
           PYTHON, SP_BENCH_DIR, o->model, o->steps, o->batch, o->seq,
           o->threads, o->ckpt ? " ckpt" : "");
  char *buf;
  int st;
  if (sp_test_capture(cmd, &buf, &st) != 0) return -1;
  if (st != 0) {
    fprintf(stderr,
            "bench/train: the PyTorch peer failed (exit %d): %s "
            "needs python3-torch (scripts/deps.sh installs it)\n",
            st, PYTHON);
    free(buf);
    return -1;
  }
  json_error_t je;
  json_t *root = json_loads(buf, 0, &je);
  int rc = root ? med_of(root, "step_seconds", o, step_s) : -1;
  *busy = (int)json_integer_value(json_object_get(root, "busy_threads"));
  json_decref(root);
  if (rc < 0) fprintf(stderr, "bench/train: the PyTorch peer said: %s\n", buf);
  free(buf);
  return rc;
}

/* The memory model's reserved peak per rank for the jobs run_job starts
 * (FULL_SHARD, which W = 1 makes NO_SHARD; GPT2Block units; AdamW; the
 * worker's limiter and prefetch). */
static int predict(const opts *o, int world, uint64_t *reserved) {
  sp_diag d = {{0}};
  char ws[16];
  snprintf(ws, sizeof ws, "%d", world);
  const char *flags[] = {"world-size", ws, "wrap-type", "GPT2Block", NULL};
  sp_mem_opts mo;
  sp_mem_opts_default(&mo);
  mo.optimizer = SP_MEM_OPT_ADAMW;
  sp_mem_estimate e;
  int rc = sp_bench_predict(o->model, flags, &mo, &e, &d);
  if (rc == 0) *reserved = e.acct.reserved.peak;
  if (rc < 0) fprintf(stderr, "bench/train: the memory model: %s\n", d.msg);
  return rc;
}

/* The memory check of one job; true when both parts hold. */
static bool memory_row(const opts *o, int world, const job_result *r) {
  uint64_t pred = 0;
  if (predict(o, world, &pred) < 0) return false;
  double grown = (double)(r->rss_hwm - r->rss_before);
  double want = (double)pred + (double)r->activations;
  bool exact = r->counted_reserved == pred;
  bool rss_ok = fabs(grown / want - 1) <= 0.10;
  printf(
      "  memory W=%d rank 0: runtime counted %.1f MiB, model %.1f MiB "
      "(%s: equal); RSS grew %.1f MiB = %.3f x (model + activations "
      "%.1f MiB = %.1f MiB) (%s: within 10 %%)\n",
      world, (double)r->counted_reserved / MIB, (double)pred / MIB,
      exact ? "PASS" : "FAIL", grown / MIB, grown / want,
      (double)r->activations / MIB, want / MIB, rss_ok ? "PASS" : "FAIL");
  return exact && rss_ok;
}

/* At W = 1 the runtime has no communication thread: its work (copies)
 * runs in the schedule calls, so it is part of the waiting. */
static void print_split(int world, const job_result *r) {
  double other = r->step_s - r->compute_s - r->wait_s - r->optim_s;
  printf(
      "  W=%d rank 0: step %.3f s = compute %.3f + %s %.3f + "
      "clip/optimizer %.3f + other %.3f; %s %.3f%s\n",
      world, r->step_s, r->compute_s,
      world == 1 ? "the runtime's calls (its copies included)"
                 : "waiting in the runtime (collectives not hidden)",
      r->wait_s, r->optim_s, other,
      world == 1 ? "of which collectives" : "communication thread busy",
      r->comm_s, world == 1 ? "" : " (overlapping)");
}

/* The index of v's median (the lower one of an even count). */
static size_t median_at(const double *v, size_t n) {
  double s[MAX_ROUNDS];
  memcpy(s, v, n * sizeof *v);
  double m = sp_test_median(s, n);
  size_t at = 0;
  for (size_t i = 0; i < n; i++)
    if (fabs(v[i] - m) < fabs(v[at] - m)) at = i;
  return at;
}

int main(int argc, char **argv) {
  /* 7 measured steps: an odd count has a median step */
  opts o = {SP_EXAMPLES "/models/gpt2-mini.json", 9, 2, 8, 256, 1, 3, false};
  static const struct option lo[] = {{"model", required_argument, NULL, 'm'},
                                     {"steps", required_argument, NULL, 's'},
                                     {"warmup", required_argument, NULL, 'w'},
                                     {"batch", required_argument, NULL, 'b'},
                                     {"seq-len", required_argument, NULL, 'T'},
                                     {"threads", required_argument, NULL, 't'},
                                     {"rounds", required_argument, NULL, 'r'},
                                     {"checkpointing", no_argument, NULL, 'c'},
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
      case 'r': o.rounds = atoi(optarg); break;
      case 'c': o.ckpt = true; break;
      default:
        fprintf(c == 'h' ? stdout : stderr,
                "usage: bench/train [--model SPEC] [--steps N] [--warmup N] "
                "[--batch B] [--seq-len T] [--threads N] [--rounds R] "
                "[--checkpointing]\n"
                "defaults: gpt2-mini, 9 steps of which the first 2 warm up "
                "(medians of the rest), batch 8, 256 tokens, 1 BLAS thread, "
                "3 rounds of the peers in turn (medians of the rounds)\n"
                "exit 0: every check passed; 1: a check failed or a peer "
                "did not run; 2: bad usage\n");
        return c == 'h' ? 0 : 2;
    }
  }
  if (o.steps < 1 || o.steps > 1000 || o.warmup < 0 || o.warmup >= o.steps ||
      o.batch < 2 || o.batch % 2 || o.seq < 1 || o.threads < 1 ||
      o.rounds < 1 || o.rounds > MAX_ROUNDS) {
    fprintf(stderr,
            "bench/train: --steps in [1, 1000] above --warmup, an "
            "even --batch, --seq-len and --threads >= 1, --rounds in "
            "[1, %d]\n",
            MAX_ROUNDS);
    return 2;
  }
  if (access(PYTHON, X_OK) != 0) {
    fprintf(stderr,
            "bench/train: no %s: the PyTorch peer needs it "
            "(python3-torch)\n",
            PYTHON);
    return 1;
  }
  /* the kernels OpenBLAS would pick on real hardware, for both peers */
  const char *want = sp_blas_coretype_wanted();
  if (want) setenv("OPENBLAS_CORETYPE", want, 1);
  char tmp[64];
  if (sp_test_tmpdir("/tmp", "sp-bench-train", tmp, sizeof tmp) != 0) {
    fprintf(stderr, "bench/train: mkdtemp %s: %s\n", tmp, strerror(errno));
    return 1;
  }
  double tokens = (double)o.batch * o.seq;
  printf(
      "bench/train: %s, batch %d x %d tokens, AdamW, %s%d BLAS thread%s, "
      "%d round%s (W=1, PyTorch, W=2 in turn), medians of steps %d..%d "
      "(OpenBLAS kernels: %s)\n",
      o.model, o.batch, o.seq,
      o.ckpt ? "activation checkpointing (both peers), " : "", o.threads,
      o.threads == 1 ? "" : "s", o.rounds,
      o.rounds == 1 ? "" : "s", o.warmup + 1, o.steps,
      getenv("OPENBLAS_CORETYPE") ? getenv("OPENBLAS_CORETYPE")
                                  : openblas_get_corename());
  fflush(stdout); /* before the children's lines */
  job_result one[MAX_ROUNDS], two[MAX_ROUNDS], base[MAX_ROUNDS];
  double torch_s[MAX_ROUNDS], ratio[MAX_ROUNDS], speedup[MAX_ROUNDS];
  int busy = 0, rc = 0, n = 0;
  for (; rc == 0 && n < o.rounds; n++) {
    rc = run_job(&o, 1, o.threads, tmp, &one[n]);
    if (rc == 0) rc = run_torch(&o, &torch_s[n], &busy);
    base[n] = one[n];
    if (rc == 0 && o.threads != 1) rc = run_job(&o, 1, 1, tmp, &base[n]);
    if (rc == 0) rc = run_job(&o, 2, 1, tmp, &two[n]);
    if (rc != 0) break;
    ratio[n] = torch_s[n] / one[n].step_s;
    speedup[n] = base[n].step_s / two[n].step_s;
    printf(
        "  round %d: W=1 %.0f tokens/s, PyTorch %.0f (ratio %.2f); "
        "W=2 %.0f (speed-up %.2f)\n",
        n + 1, tokens / one[n].step_s, tokens / torch_s[n], ratio[n],
        tokens / two[n].step_s, speedup[n]);
    fflush(stdout);
  }
  bool pass = rc == 0;
  if (rc == 0) {
    size_t r1 = median_at(ratio, (size_t)n), r2 = median_at(speedup, (size_t)n);
    double steps1[MAX_ROUNDS], steps_t[MAX_ROUNDS];
    for (int i = 0; i < n; i++) {
      steps1[i] = one[i].step_s;
      steps_t[i] = torch_s[i];
    }
    double m1 = sp_test_median(steps1, (size_t)n);
    double mt = sp_test_median(steps_t, (size_t)n);
    printf(
        "  W=1 shardplane %8.0f tokens/s (median %.3f s/step; %d BLAS "
        "thread%s; the runtime's collectives, copies at W=1, %.3f s a "
        "step on the training thread)\n",
        tokens / m1, m1, o.threads, o.threads == 1 ? "" : "s", one[r1].comm_s);
    printf(
        "  PyTorch 1.13   %8.0f tokens/s (median %.3f s/step; "
        "torch.set_num_threads(%d), OPENBLAS_NUM_THREADS=%d: %d busy "
        "thread%s measured)\n",
        tokens / mt, mt, o.threads, o.threads, busy, busy == 1 ? "" : "s");
    bool met = ratio[r1] >= GOAL;
    printf("  ratio %.2f, the median of %d round%s (goal >= %.1f: %s)\n",
           ratio[r1], n, n == 1 ? "" : "s", GOAL, met ? "PASS" : "FAIL");
    pass = pass && met;
    printf(
        "  W=2 vs W=1 (1 BLAS thread a rank, the same cores): %.0f vs "
        "%.0f tokens/s, speed-up %.2f (the median of %d round%s; the "
        "split below is that round's)\n",
        tokens / two[r2].step_s, tokens / base[r2].step_s, speedup[r2], n,
        n == 1 ? "" : "s");
    print_split(1, &base[r2]);
    print_split(2, &two[r2]);
    bool m_ok = memory_row(&o, 1, &one[n - 1]);
    m_ok = memory_row(&o, 2, &two[n - 1]) && m_ok;
    pass = pass && m_ok;
  }
  rmdir(tmp);
  return pass ? 0 : 1;
}
