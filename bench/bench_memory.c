/* What a rank of a real job holds, against what the memory model predicts.
 *
 * For GPT-2 (examples/models/gpt2.json, wrap GPT2Block: a 39.4 M-element
 * root and 12 blocks of 7.1 M) at W = 1, 2, 4, 8 under FULL_SHARD,
 * SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD (shard groups of 2, W >= 2), with
 * float32 and bfloat16 parameters, one shardplane-coordinator and W
 * shardplane-worker processes run 2 steps of the synthetic-gradient cycle
 * (SGD: no optimizer state). Rank 0 reports (--stats) the runtime's counted
 * bytes and its RSS; every row compares them with sp_mem_estimate_plan for
 * the same plan, computed here:
 *   predicted  the model's reserved peak (everything the runtime holds from
 *              the allocator, the pool's cached blocks included);
 *   counted    the runtime's own reserved peak (sp_fsdp_stats.mem);
 *   RSS        VmHWM after the steps minus VmRSS just before sp_fsdp_new:
 *              what the process really grew by.
 * At W = 1 every strategy is NO_SHARD (FSDP's rule), so W = 1 runs once
 * per dtype. FULL_SHARD float32 rows also save a SHARDED checkpoint after
 * the steps, and its peak (both counters restarted before the save) is a
 * row of its own: whatever ckpt.c does today.
 *
 * Goals, each printed with PASS or FAIL (exit 1 on any FAIL):
 *  1. every row: RSS within 10 % of predicted, counted equal to predicted
 *     (and the in-use totals equal), and no allocation after step 1;
 *  2. FULL_SHARD at W = 8: RSS <= 1.15 x (S + F), where S is the sharded
 *     state (shards and their gradients, c elements per unit: falls as
 *     1/W) and F the in-flight floor (sp_mem_estimate.in_flight_floor: the
 *     buffers, the root unit's unsharded parameters and gradient, which
 *     FSDP keeps through the backward, and max_inflight_gathers = 2 times
 *     the largest block's parameters, gradient and reduce output);
 *  3. FULL_SHARD falls as 1/W down to the floor: for W = 4 and 8,
 *     (RSS(W) - F) * W over (RSS(2) - F) * 2, the baseline measured in
 *     the same run, within 15 % of 1.
 * A row that cannot run (a worker fails, or the machine lacks the memory
 * for W copies of it) fails the bench, naming why.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/proc.h"
#include "plan/memory.h"
#include "predict.h"
#include "support/tmpdir.h"

extern char **environ;

#ifndef SP_BIN_DIR
#define SP_BIN_DIR "."
#endif
#ifndef SP_EXAMPLES
#define SP_EXAMPLES "examples"
#endif

#define MIB (1024.0 * 1024.0)
#define MAX_W 8

static const char *const k_strategies[] = {"FULL_SHARD", "SHARD_GRAD_OP",
                                           "NO_SHARD", "HYBRID_SHARD"};
static const char *const k_dtypes[] = {"float32", "bfloat16"};

typedef struct bench_opts {
  const char *model, *wrap;
  int worlds[8];
  int n_worlds;
  int steps;
  bool no_ckpt;
} bench_opts;

/* One configuration and what was measured. */
typedef struct row {
  int world;
  const char *strategy, *dtype;
  bool ckpt; /* also save a SHARDED checkpoint */
  /* predicted */
  sp_mem_estimate e;
  /* measured */
  bool ran;
  char why[8192]; /* when it did not */
  double wall_s;
  long long rss_before, rss_hwm, ck_rss_start, ck_rss_hwm;
  uint64_t counted_reserved, counted_total, ck_reserved, ck_total;
  uint64_t allocs, allocs_step1;
} row;

/* ---- the plan and the model, here ---- */

static int predict(const bench_opts *o, row *r) {
  sp_diag d = {{0}};
  char ws[16];
  snprintf(ws, sizeof ws, "%d", r->world);
  const char *flags[11];
  size_t k = 0;
  flags[k++] = "world-size", flags[k++] = ws;
  flags[k++] = "strategy", flags[k++] = r->strategy;
  flags[k++] = "wrap-type", flags[k++] = o->wrap;
  if (strcmp(r->strategy, "HYBRID_SHARD") == 0)
    flags[k++] = "shard-group-size", flags[k++] = "2";
  if (strcmp(r->dtype, "float32") != 0)
    flags[k++] = "param-dtype", flags[k++] = r->dtype;
  flags[k] = NULL;
  /* what shardplane-worker runs: SGD, limiter 2, BACKWARD_PRE prefetch */
  int rc = sp_bench_predict(o->model, flags, NULL, &r->e, &d);
  if (rc < 0) fprintf(stderr, "bench/memory: %s\n", d.msg);
  return rc;
}

/* ---- running a job ---- */

static long long mem_available(void) {
  FILE *fp = fopen("/proc/meminfo", "r");
  if (!fp) return -1;
  char line[256];
  long long kb = -1;
  while (fgets(line, sizeof line, fp))
    if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) break;
  fclose(fp);
  return kb < 0 ? -1 : kb * 1024;
}

static uint64_t jbytes(json_t *acct, const char *what, const char *field) {
  return (uint64_t)json_integer_value(
      json_object_get(json_object_get(acct, what), field));
}

static int read_stats(const char *path, row *r) {
  json_error_t err;
  json_t *root = json_load_file(path, 0, &err);
  json_t *mem = json_object_get(root, "memory");
  json_t *train = json_object_get(mem, "train");
  if (!train) {
    snprintf(r->why, sizeof r->why, "%s: no memory stats (%s)", path,
             root ? "no \"memory.train\"" : err.text);
    json_decref(root);
    return -1;
  }
  r->rss_before = json_integer_value(json_object_get(mem, "rss_before"));
  r->allocs_step1 = (uint64_t)json_integer_value(
      json_object_get(mem, "allocs_after_first_step"));
  r->rss_hwm = json_integer_value(json_object_get(train, "rss_hwm"));
  json_t *c = json_object_get(train, "counted");
  r->counted_reserved = jbytes(c, "reserved", "peak");
  r->counted_total = jbytes(c, "total", "peak");
  r->allocs = (uint64_t)json_integer_value(json_object_get(c, "allocs"));
  json_t *ck = json_object_get(mem, "checkpoint");
  if (r->ckpt && !ck) {
    snprintf(r->why, sizeof r->why, "%s: no checkpoint stats", path);
    json_decref(root);
    return -1;
  }
  if (ck) {
    r->ck_rss_start = json_integer_value(json_object_get(ck, "rss_start"));
    r->ck_rss_hwm = json_integer_value(json_object_get(ck, "rss_hwm"));
    json_t *kc = json_object_get(ck, "counted");
    r->ck_reserved = jbytes(kc, "reserved", "peak");
    r->ck_total = jbytes(kc, "total", "peak");
  }
  json_decref(root);
  if (r->rss_before <= 0 || r->rss_hwm <= 0) {
    snprintf(r->why, sizeof r->why, "no RSS from /proc/self/status");
    return -1;
  }
  return 0;
}

static int run_row(const bench_opts *o, const char *tmp, row *r) {
  /* W copies of the prediction, a process's baseline (about 160 MB: the
   * session, Gloo, the spec) each, and a margin: refuse rather than push a
   * shared machine into swapping or the OOM killer */
  double need =
      (double)r->world * ((double)r->e.acct.reserved.peak + 200 * MIB) * 1.1;
  if (r->ckpt) need += (double)r->world * 600 * MIB;
  long long avail = mem_available();
  if (avail > 0 && need > (double)avail) {
    snprintf(r->why, sizeof r->why,
             "needs about %.1f GiB for %d ranks, "
             "MemAvailable is %.1f GiB",
             need / (1024 * MIB), r->world, (double)avail / (1024 * MIB));
    return -1;
  }
  char ws[16], steps[16], stats[4096], ckdir[4096];
  snprintf(ws, sizeof ws, "%d", r->world);
  snprintf(steps, sizeof steps, "%d", o->steps);
  snprintf(stats, sizeof stats, "%s/stats.json", tmp);
  snprintf(ckdir, sizeof ckdir, "%s/ckpt", tmp);
  unlink(stats);
  char *ca[24] = {SP_BIN_DIR "/shardplane-coordinator",
                  "--listen",
                  "127.0.0.1:0",
                  "--model",
                  (char *)o->model,
                  "--world-size",
                  ws,
                  "--strategy",
                  (char *)r->strategy,
                  "--wrap-type",
                  (char *)o->wrap,
                  "--quiet",
                  "--insecure",
                  "--no-auth"};
  int k = 14;
  if (strcmp(r->strategy, "HYBRID_SHARD") == 0) {
    ca[k++] = "--shard-group-size";
    ca[k++] = "2";
  }
  if (strcmp(r->dtype, "float32") != 0) {
    ca[k++] = "--param-dtype";
    ca[k++] = (char *)r->dtype;
  }
  ca[k] = NULL;
  sp_proc coord;
  sp_diag d = {{0}};
  if (sp_proc_spawn(&coord, ca, false, false, "listening on 127.0.0.1:%d", &d) <
      0) {
    snprintf(r->why, sizeof r->why, "coordinator: %s", d.msg);
    return -1;
  }
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", coord.port);
  double t0 = sp_clock_s();
  pid_t w[MAX_W];
  bool failed = false;
  /* the workers' progress lines would break the table; errors still show */
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  for (int rk = 0; rk < r->world; rk++) {
    char rs[16];
    snprintf(rs, sizeof rs, "%d", rk);
    /* --synthetic: the GPT-2 specs train for real otherwise */
    char *wa[] = {SP_BIN_DIR "/shardplane-worker",
                  "--coordinator",
                  addr,
                  "--synthetic",
                  "--insecure",
                  "--rank",
                  rs,
                  "--steps",
                  steps,
                  "--log-every",
                  "0",
                  "--stats",
                  stats,
                  "--checkpoint",
                  r->ckpt ? "sharded" : "none",
                  "--checkpoint-dir",
                  ckdir,
                  NULL};
    if (posix_spawn(&w[rk], wa[0], &fa, NULL, wa, environ) != 0) {
      w[rk] = 0;
      failed = true;
    }
  }
  posix_spawn_file_actions_destroy(&fa);
  int bad_rank = -1, bad_status = 0;
  for (int rk = 0; rk < r->world; rk++) {
    int st;
    if (w[rk] > 0 && (waitpid(w[rk], &st, 0) != w[rk] || !WIFEXITED(st) ||
                      WEXITSTATUS(st) != 0)) {
      if (bad_rank < 0) {
        bad_rank = rk;
        bad_status = st;
      }
      failed = true;
    }
  }
  r->wall_s = sp_clock_s() - t0;
  sp_proc_stop(&coord, 5000);
  sp_test_rmtree(ckdir);
  if (failed) {
    snprintf(r->why, sizeof r->why, "worker %d failed (status 0x%x)", bad_rank,
             bad_status);
    return -1;
  }
  int rc = read_stats(stats, r);
  unlink(stats);
  return rc;
}

/* ---- printing and goals ---- */

static double mib(uint64_t b) { return (double)b / MIB; }

static double rss_delta(const row *r) {
  return (double)(r->rss_hwm - r->rss_before);
}

static const char *verdict(bool ok) { return ok ? "PASS" : "FAIL"; }

/* goal 1 for one row */
static bool row_ok(const row *r) {
  double ratio = rss_delta(r) / (double)r->e.acct.reserved.peak;
  return r->ran && fabs(ratio - 1) <= 0.10 &&
         r->counted_reserved == r->e.acct.reserved.peak &&
         r->counted_total == r->e.acct.total.peak &&
         r->allocs == r->allocs_step1;
}

static void print_header(void) {
  printf("%-3s %-14s %-9s %12s %12s %12s %8s %12s %7s %7s %s\n", "W",
         "strategy", "params", "predicted", "counted", "RSS", "RSS/pred",
         "in use pred", "allocs", "wall s", "goal 1");
  printf("%-3s %-14s %-9s %12s %12s %12s %8s %12s %7s %7s\n", "", "", "", "MiB",
         "MiB", "MiB", "", "MiB", "1st/all", "");
}

/* W = 1 runs once for every strategy: FSDP makes each NO_SHARD */
static const char *shown_strategy(const row *r) {
  return r->world == 1 ? "all: NO_SHARD" : r->strategy;
}

static void print_row(const row *r) {
  if (!r->ran) {
    printf(
        "%-3d %-14s %-9s %12.1f %12s %12s %8s %12.1f %7s %7s FAIL (not "
        "run: %s)\n",
        r->world, shown_strategy(r), r->dtype, mib(r->e.acct.reserved.peak),
        "-", "-", "-", mib(r->e.acct.total.peak), "-", "-", r->why);
    return;
  }
  char allocs[32];
  snprintf(allocs, sizeof allocs, "%llu/%llu",
           (unsigned long long)r->allocs_step1, (unsigned long long)r->allocs);
  printf("%-3d %-14s %-9s %12.1f %12.1f %12.1f %8.3f %12.1f %7s %7.1f %s\n",
         r->world, shown_strategy(r), r->dtype, mib(r->e.acct.reserved.peak),
         mib(r->counted_reserved), rss_delta(r) / MIB,
         rss_delta(r) / (double)r->e.acct.reserved.peak,
         mib(r->e.acct.total.peak), allocs, r->wall_s, verdict(row_ok(r)));
  fflush(stdout);
}

static void usage(FILE *f) {
  fputs(
      "usage: bench/memory [--worlds 1,2,4,8] [--steps N] [--model PATH "
      "--wrap-type T] [--no-checkpoint]\n"
      "Peak memory per rank of real GPT-2 jobs (synthetic gradients) on\n"
      "every strategy, float32 and bfloat16 parameters, against the memory\n"
      "model; prints PASS/FAIL per goal and exits 1 on any FAIL.\n",
      f);
}

static int parse_worlds(const char *s, bench_opts *o) {
  o->n_worlds = 0;
  char *end;
  while (*s && o->n_worlds < 8) {
    long w = strtol(s, &end, 10);
    if (end == s || w < 1 || w > MAX_W) return -1;
    o->worlds[o->n_worlds++] = (int)w;
    s = *end == ',' ? end + 1 : end;
    if (*end && *end != ',') return -1;
  }
  return o->n_worlds > 0 ? 0 : -1;
}

int main(int argc, char **argv) {
  bench_opts o = {.model = SP_EXAMPLES "/models/gpt2.json",
                  .wrap = "GPT2Block",
                  .worlds = {1, 2, 4, 8},
                  .n_worlds = 4,
                  .steps = 2};
  static const struct option opts[] = {
      {"worlds", required_argument, NULL, 'w'},
      {"steps", required_argument, NULL, 's'},
      {"model", required_argument, NULL, 'm'},
      {"wrap-type", required_argument, NULL, 't'},
      {"no-checkpoint", no_argument, NULL, 'c'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (c) {
      case 'w':
        if (parse_worlds(optarg, &o) < 0) {
          fprintf(stderr,
                  "bench/memory: --worlds \"%s\": expected a comma "
                  "list of world sizes from 1 to %d\n",
                  optarg, MAX_W);
          return 2;
        }
        break;
      case 's':
        o.steps = atoi(optarg);
        if (o.steps < 2) {
          fprintf(stderr,
                  "bench/memory: --steps \"%s\": at least 2 (the "
                  "second proves no step after the first allocates)\n",
                  optarg);
          return 2;
        }
        break;
      case 'm': o.model = optarg; break;
      case 't': o.wrap = optarg; break;
      case 'c': o.no_ckpt = true; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  signal(SIGPIPE, SIG_IGN);
  /* under $TMPDIR, as the tests and bench/coordinator put theirs */
  char tmp[512];
  if (sp_test_tmpdir(NULL, "shardplane-bench-memory", tmp, sizeof tmp) != 0) {
    perror("bench/memory: mkdtemp");
    return 1;
  }
  static row rows[64];
  int n = 0;
  for (int wi = 0; wi < o.n_worlds; wi++)
    for (int di = 0; di < 2; di++)
      for (int si = 0; si < 4; si++) {
        int w = o.worlds[wi];
        /* W = 1 is NO_SHARD whatever is asked: one run per dtype; HYBRID
         * needs shard groups of 2 */
        if (w == 1 && si > 0) continue;
        if (si == 3 && w < 2) continue;
        rows[n] = (row){
            .world = w, .strategy = k_strategies[si], .dtype = k_dtypes[di]};
        rows[n].ckpt = !o.no_ckpt && si == 0 && di == 0;
        n++;
      }
  printf(
      "bench/memory: %s (wrap %s), %d steps of the synthetic-gradient "
      "cycle per job, SGD, limiter 2, backward prefetch; rank 0's peak "
      "per rank\n(W = 1: every strategy is NO_SHARD, one run)\n\n",
      o.model, o.wrap, o.steps);
  print_header();
  double t_all = sp_clock_s();
  int fails = 0;
  for (int i = 0; i < n; i++) {
    row *r = &rows[i];
    if (predict(&o, r) < 0) return 1;
    r->ran = run_row(&o, tmp, r) == 0;
    print_row(r);
    if (!row_ok(r)) fails++;
  }
  printf(
      "\ngoal 1 (RSS within 10 %% of predicted; counted == predicted; no "
      "allocation after step 1): %d of %d rows %s\n",
      n - fails, n, verdict(fails == 0));

  /* FULL_SHARD: the floor and 1/W */
  printf(
      "\nFULL_SHARD against the floor (S: sharded state, falls as 1/W; F: "
      "in-flight floor)\n");
  printf("%-3s %-9s %12s %12s %12s %12s %10s %14s\n", "W", "params", "RSS MiB",
         "S MiB", "F MiB", "S+F MiB", "RSS/(S+F)", "(RSS-F)W/base");
  bool g2 = false, g2_seen = false, g3 = true;
  int g3_seen = 0;
  for (int di = 0; di < 2; di++) {
    const row *base = NULL;
    for (int i = 0; i < n; i++)
      if (rows[i].world == 2 && strcmp(rows[i].strategy, "FULL_SHARD") == 0 &&
          rows[i].dtype == k_dtypes[di] && rows[i].ran)
        base = &rows[i];
    for (int i = 0; i < n; i++) {
      const row *r = &rows[i];
      if (strcmp(r->strategy, "FULL_SHARD") != 0 || r->world < 2 ||
          r->dtype != k_dtypes[di])
        continue;
      double sf = (double)(r->e.sharded_state + r->e.in_flight_floor);
      double scal = NAN;
      if (r->ran && base)
        scal = (rss_delta(r) - (double)r->e.in_flight_floor) * r->world /
               ((rss_delta(base) - (double)base->e.in_flight_floor) * 2);
      if (!r->ran) {
        printf("%-3d %-9s not run: %s\n", r->world, r->dtype, r->why);
      } else {
        printf("%-3d %-9s %12.1f %12.1f %12.1f %12.1f %10.3f %14.3f\n",
               r->world, r->dtype, rss_delta(r) / MIB, mib(r->e.sharded_state),
               mib(r->e.in_flight_floor), sf / MIB, rss_delta(r) / sf, scal);
      }
      if (r->world == 8) {
        bool ok = r->ran && rss_delta(r) <= 1.15 * sf;
        g2 = g2_seen ? g2 && ok : ok;
        g2_seen = true;
      }
      if (r->world > 2) {
        g3_seen++;
        if (!base) {
          printf("    no W=2 %s baseline for the 1/W check\n", r->dtype);
          g3 = false;
        } else if (!(fabs(scal - 1) <= 0.15)) {
          g3 = false;
        }
      }
    }
  }
  printf("goal 2 (FULL_SHARD at W=8: RSS <= 1.15 x (S + F)): %s\n",
         g2_seen ? verdict(g2) : "FAIL (no W=8 row)");
  printf(
      "goal 3 (FULL_SHARD falls as 1/W to the floor: (RSS-F)*W within "
      "15 %% of W=2's): %s\n",
      g3_seen ? verdict(g3) : "FAIL (no W>2 row)");
  if (!g2_seen || !g2) fails++;
  if (!g3_seen || !g3) fails++;

  if (!o.no_ckpt) {
    printf(
        "\nSHARDED checkpoint save after training (FULL_SHARD float32; "
        "peaks of the save alone, from what training left held)\n");
    printf("%-3s %14s %14s %14s %14s %12s\n", "W", "RSS MiB", "RSS/train",
           "counted MiB", "in use MiB", "train RSS");
    for (int i = 0; i < n; i++) {
      const row *r = &rows[i];
      if (!r->ckpt || !r->ran) continue;
      double ck = (double)(r->ck_rss_hwm - r->rss_before);
      printf("%-3d %14.1f %14.2f %14.1f %14.1f %12.1f\n", r->world, ck / MIB,
             ck / rss_delta(r), mib(r->ck_reserved), mib(r->ck_total),
             rss_delta(r) / MIB);
    }
    printf(
        "(RSS: VmHWM during the save minus VmRSS before the runtime; "
        "counted: the runtime's reserved peak, which excludes the host "
        "copies ckpt.c gathers)\n");
  }
  printf("\nbench/memory: %d rows in %.0f s: %s\n", n, sp_clock_s() - t_all,
         fails ? "FAIL" : "PASS");
  rmdir(tmp);
  return fails ? 1 : 0;
}
