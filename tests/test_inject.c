/* shardplane-worker's --inject (client/worker/inject.c): the parser's
 * answers to good and bad specs, the hook's decisions, and one job per
 * fault showing that the worker does what the fault says. */
#include <dirent.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include <jansson.h>

#include "base/clock.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"
#include "support/coord_fixture.h"
#include "support/job_fixture.h"
#include "support/testutil.h"
#include "worker/inject.h"

#define MLP SP_EXAMPLES "/mlp.json"

/* ---- the parser ---- */

static void test_parse_good(void **state) {
  (void)state;
  sp_inject in = {0};
  sp_diag d = {""};
  assert_int_equal(sp_inject_parse(&in, "stall:rank=2,step=5", &d), 0);
  assert_int_equal(sp_inject_parse(&in,
                                   "stall:step=1,rank=0,unit=3,"
                                   "phase=backward",
                                   &d),
                   0);
  assert_int_equal(sp_inject_parse(&in,
                                   "skip-collective:rank=1,step=2,"
                                   "unit=4",
                                   &d),
                   0);
  assert_int_equal(sp_inject_parse(&in, "wrong-count:rank=3,step=7", &d), 0);
  assert_int_equal(sp_inject_parse(&in, "slow:rank=1,factor=2.5", &d), 0);
  assert_int_equal(sp_inject_parse(&in, "exit:rank=0,step=9", &d), 0);
  assert_int_equal(in.n, 6);
  assert_int_equal(in.faults[0].kind, SP_INJECT_STALL);
  assert_int_equal(in.faults[0].rank, 2);
  assert_int_equal(in.faults[0].step, 5);
  assert_false(in.faults[0].has_unit);
  assert_int_equal(in.faults[0].phase, SP_PHASE_OTHER);
  assert_true(in.faults[1].has_unit);
  assert_int_equal(in.faults[1].unit, 3);
  assert_int_equal(in.faults[1].phase, SP_PHASE_BACKWARD);
  assert_int_equal(in.faults[2].kind, SP_INJECT_SKIP);
  assert_int_equal(in.faults[2].unit, 4);
  assert_int_equal(in.faults[3].kind, SP_INJECT_WRONG_COUNT);
  assert_true(in.faults[4].factor == 2.5);
  assert_int_equal(in.faults[5].kind, SP_INJECT_EXIT);
  assert_int_equal(in.faults[5].step, 9);
}

static void test_parse_bad(void **state) {
  (void)state;
  static const struct {
    const char *spec, *err;
  } cases[] = {
      {"hang:rank=1,step=2",
       "--inject \"hang:rank=1,step=2\": expected "
       "KIND:KEY=VALUE,... with KIND one of stall, "
       "skip-collective, wrong-count, slow, exit"},
      {"stall",
       "expected stall:rank=R,step=S[,unit=U,phase=forward|"
       "backward]"},
      {"stall:rank=1", "step is required"},
      {"exit:step=3", "rank is required"},
      {"slow:rank=1", "factor is required"},
      {"stall:rank=x,step=2", "rank: expected an integer in [0, "},
      {"stall:rank=1,step=0", "step: expected an integer in [1, "},
      {"stall:rank=1,step=2,phase=sideways",
       "phase: expected forward or backward, got \"sideways\""},
      {"exit:rank=1,step=2,unit=3", "exit takes no key \"unit\""},
      {"wrong-count:rank=1,step=2,phase=forward",
       "wrong-count takes no key \"phase\""},
      {"stall:rank=1,rank=2,step=2", "rank given twice"},
      {"stall:rank=1,step", "\"step\": expected KEY=VALUE"},
      {"slow:rank=1,factor=0.5", "factor: expected a number in [1, 1000]"},
      {"slow:rank=1,factor=nan", "factor: expected a number in [1, 1000]"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sp_inject in = {0};
    sp_diag d = {""};
    int rc = sp_inject_parse(&in, cases[i].spec, &d);
    if (rc != SP_EINVAL || strstr(d.msg, cases[i].err) == NULL ||
        strstr(d.msg, "--inject") == NULL)
      fail_msg("%s: rc %d, \"%s\"; want \"%s\"", cases[i].spec, rc, d.msg,
               cases[i].err);
    assert_int_equal(in.n, 0);
  }
  /* at most SP_INJECT_MAX */
  sp_inject in = {0};
  sp_diag d = {""};
  for (int i = 0; i < SP_INJECT_MAX; i++)
    assert_int_equal(sp_inject_parse(&in, "exit:rank=0,step=1", &d), 0);
  assert_int_equal(sp_inject_parse(&in, "exit:rank=0,step=1", &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "at most 16 faults"));
}

/* ---- the hook's decisions (no session: nothing here stalls) ---- */

static void test_hook(void **state) {
  (void)state;
  sp_inject in = {0};
  sp_diag d = {""};
  assert_int_equal(sp_inject_parse(&in,
                                   "skip-collective:rank=1,step=2,"
                                   "unit=3",
                                   &d),
                   0);
  assert_int_equal(sp_inject_parse(&in, "wrong-count:rank=1,step=2", &d), 0);
  assert_int_equal(sp_inject_parse(&in, "exit:rank=0,step=1", &d), 0);
  sp_inject_start(&in, NULL, 1);
  assert_true(sp_inject_wants_hook(&in));
  uint64_t n = 100;
  sp_inject_step(&in, 1); /* rank 0's exit is not this rank's */
  /* step 1: nothing */
  assert_int_equal(
      sp_inject_before_collective(&in, SP_PHASE_FORWARD, SP_COMM_WORLD,
                                  SP_OP_ALL_GATHER, 3, &n),
      0);
  sp_inject_step(&in, 2);
  /* another unit's gather goes on; unit 3's is skipped, once */
  assert_int_equal(
      sp_inject_before_collective(&in, SP_PHASE_FORWARD, SP_COMM_WORLD,
                                  SP_OP_ALL_GATHER, 2, &n),
      0);
  assert_int_equal(
      sp_inject_before_collective(&in, SP_PHASE_FORWARD, SP_COMM_WORLD,
                                  SP_OP_ALL_GATHER, 3, &n),
      1);
  assert_int_equal(
      sp_inject_before_collective(&in, SP_PHASE_BACKWARD, SP_COMM_WORLD,
                                  SP_OP_ALL_GATHER, 3, &n),
      0);
  /* the first reduction of the step loses an element, once; a caller's
   * all-reduce between steps and the replica half are left alone */
  assert_int_equal(
      sp_inject_before_collective(&in, SP_PHASE_OTHER, SP_COMM_WORLD,
                                  SP_OP_ALL_REDUCE, 0, &n),
      0);
  assert_int_equal(n, 100);
  assert_int_equal(
      sp_inject_before_collective(&in, SP_PHASE_BACKWARD, SP_COMM_REPLICA,
                                  SP_OP_ALL_REDUCE, 4, &n),
      0);
  assert_int_equal(n, 100);
  assert_int_equal(
      sp_inject_before_collective(&in, SP_PHASE_BACKWARD, SP_COMM_SHARD,
                                  SP_OP_REDUCE_SCATTER, 4, &n),
      0);
  assert_int_equal(n, 99);
  assert_int_equal(
      sp_inject_before_collective(&in, SP_PHASE_BACKWARD, SP_COMM_SHARD,
                                  SP_OP_REDUCE_SCATTER, 3, &n),
      0);
  assert_int_equal(n, 99);
  /* a rank no fault names needs no hook */
  sp_inject other = in;
  sp_inject_start(&other, NULL, 5);
  assert_false(sp_inject_wants_hook(&other));
}

/* ---- one job per fault ---- */

static char *read_err(const char *dir, int rank) {
  char name[32];
  snprintf(name, sizeof name, "rank-%d.err", rank);
  char *path = sp_test_path(dir, name);
  char *s = sp_test_read_file(path);
  free(path);
  return s;
}

static void expect_err(const char *dir, int rank, const char *needle) {
  char *s = read_err(dir, rank);
  if (strstr(s, needle) == NULL)
    fail_msg("rank %d's stderr has no \"%s\": %s", rank, needle, s);
  printf("  rank %d: ...%s\n", rank, needle);
  free(s);
}

static Shardplane__V1__ListRanksResponse *ranks_of(sp_rpc_sync *cli) {
  Shardplane__V1__ListRanksRequest q = SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  sp_rpc_status st;
  return (void *)sp_test_unary(cli, SP_COORD_PATH("ListRanks"), &q.base,
                               &shardplane__v1__list_ranks_response__descriptor,
                               2000, &st);
}

/* Whether process pid has a thread called name. */
static bool has_thread(pid_t pid, const char *name) {
  char dirpath[64];
  snprintf(dirpath, sizeof dirpath, "/proc/%d/task", (int)pid);
  DIR *dir = opendir(dirpath);
  if (dir == NULL) return false;
  bool found = false;
  struct dirent *e;
  while (!found && (e = readdir(dir)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char path[400], comm[32] = "";
    snprintf(path, sizeof path, "%s/%s/comm", dirpath, e->d_name);
    FILE *f = fopen(path, "r");
    if (f == NULL) continue;
    if (fgets(comm, sizeof comm, f) != NULL) {
      comm[strcspn(comm, "\n")] = '\0';
      found = strcmp(comm, name) == 0;
    }
    fclose(f);
  }
  closedir(dir);
  return found;
}

static const char *const k_cflags[] = {"--wrap-type", "Linear",
                                       "--heartbeat-timeout-ms", "1000", NULL};

/* exit: rank 1 dies as step 3 begins; rank 0 fails (its peer is lost). */
static void test_exit(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *wflags[] = {"--steps", "100000",   "--checkpoint",
                          "none",    "--inject", "exit:rank=1,step=3",
                          NULL};
  sp_tjob j;
  sp_tjob_start(&j, MLP, k_cflags, 2, wflags, dir);
  assert_int_equal(sp_tjob_wait(&j, 30), 0);
  assert_int_equal(j.status[1], 1);
  assert_int_equal(j.status[0], 1);
  expect_err(dir, 1, "rank 1: --inject exit: dying at the start of step 3");
  sp_test_rmtree(dir);
  free(dir);
}

/* stall: rank 1 blocks before its first collective of step 2 for good;
 * its heartbeats go on, so the coordinator hears from it well within the
 * heartbeat timeout long after the stall began, and neither rank is lost
 * or moves past step 2. */
static void test_stall_keeps_heartbeats(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  const char *wflags[] = {"--steps",
                          "100000",
                          "--checkpoint",
                          "none",
                          "--comm-timeout-ms",
                          "60000",
                          "--inject",
                          "stall:rank=1,step=2,phase=forward",
                          NULL};
  sp_tjob j;
  sp_tjob_start(&j, MLP, k_cflags, 2, wflags, dir);
  sp_rpc_sync *cli;
  sp_rpc_client_opts o = {.connect_timeout_ms = 5000,
                          .token = j.auth.token[SP_ROLE_READER]};
  assert_int_equal(sp_rpc_sync_open_opts(j.addr, &o, &cli), 0);
  /* until rank 1 reports step 2 */
  double end = sp_clock_s() + 20;
  uint64_t step1 = 0;
  while (sp_clock_s() < end && step1 < 2) {
    Shardplane__V1__ListRanksResponse *r = ranks_of(cli);
    if (r != NULL && r->n_ranks == 2) step1 = r->ranks[1]->step;
    sp_test_free_msg(r);
    usleep(50000);
  }
  assert_int_equal(step1, 2);
  /* three heartbeat timeouts later */
  sp_test_sleep_ms(3000);
  for (int k = 0; k < 2; k++) {
    Shardplane__V1__ListRanksResponse *r = ranks_of(cli);
    assert_non_null(r);
    for (int rk = 0; rk < 2; rk++) {
      const Shardplane__V1__RankInfo *ri = r->ranks[rk];
      printf("  rank %d: status %d, step %llu, last heard %llu ms ago\n", rk,
             (int)ri->status, (unsigned long long)ri->step,
             (unsigned long long)ri->last_heard_ms_ago);
      assert_int_equal(ri->status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
      assert_true(ri->last_heard_ms_ago < 1000);
      assert_true(ri->step <= 2);
    }
    sp_test_free_msg(r);
    sp_test_sleep_ms(500);
  }
  sp_rpc_sync_close(cli);
  for (int r = 0; r < 2; r++) {
    int st;
    assert_int_equal(waitpid(j.w[r], &st, WNOHANG), 0); /* still there */
  }
  expect_err(dir, 1, "rank 1: --inject stall: blocking before unit");
  /* a stack dump of the hung rank says which thread is which (the
   * training thread is the main one, with the program's name) */
  static const char *const names[] = {"shardplane-work", "session", "comm",
                                      "gloo", "gloo-watchdog"};
  const char *absent = NULL;
  for (size_t i = 0; i < 5 && absent == NULL; i++)
    if (!has_thread(j.w[1], names[i])) absent = names[i];
  /* the stalled job is killed at the deadline */
  assert_int_equal(sp_tjob_wait(&j, 0.5), 0);
  /* after the wait, which kills the job: a failure must not leave it */
  if (absent != NULL) fail_msg("rank 1 has no thread called %s", absent);
  assert_int_equal(j.status[0], -1);
  assert_int_equal(j.status[1], -1);
  sp_test_rmtree(dir);
  free(dir);
}

/* skip-collective and wrong-count: a real desynchronisation; the job
 * cannot finish (the collectives time out or fail), and the rank says
 * what it did. */
static void run_desync(const char *spec, int rank, const char *needle) {
  char *dir = sp_test_mkdtemp();
  const char *wflags[] = {
      "--steps", "20",       "--checkpoint", "none", "--comm-timeout-ms",
      "3000",    "--inject", spec,           NULL};
  sp_tjob j;
  sp_tjob_start(&j, MLP, k_cflags, 2, wflags, dir);
  assert_int_equal(sp_tjob_wait(&j, 30), 0);
  printf("  %s: exit statuses %d, %d\n", spec, j.status[0], j.status[1]);
  assert_int_not_equal(j.status[0], 0);
  assert_int_not_equal(j.status[1], 0);
  expect_err(dir, rank, needle);
  sp_test_rmtree(dir);
  free(dir);
}

static void test_skip_collective(void **state) {
  (void)state;
  run_desync("skip-collective:rank=1,step=2", 1,
             "rank 1: --inject skip-collective: skipping unit");
}

static void test_wrong_count(void **state) {
  (void)state;
  run_desync("wrong-count:rank=0,step=2", 0,
             "rank 0: --inject wrong-count: unit");
}

/* The median of rank 0's step times (--stats). */
static double median_step(const char *stats) {
  json_error_t e;
  json_t *j = json_load_file(stats, 0, &e);
  assert_non_null(j);
  json_t *a = json_object_get(j, "step_seconds");
  size_t n = json_array_size(a);
  assert_true(n >= 4);
  double *v = calloc(n, sizeof *v);
  for (size_t i = 0; i < n; i++) v[i] = json_number_value(json_array_get(a, i));
  for (size_t i = 1; i < n; i++)
    for (size_t k = i; k > 0 && v[k - 1] > v[k]; k--) {
      double t = v[k];
      v[k] = v[k - 1];
      v[k - 1] = t;
    }
  double m = v[n / 2];
  free(v);
  json_decref(j);
  return m;
}

/* slow: rank 0 sleeps 3x its step's time at the end of each step, so its
 * steps (--stats) take several times as long as in the same job without
 * the fault. */
static void test_slow(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *stats = sp_test_path(dir, "stats.json");
  double med[2];
  for (int k = 0; k < 2; k++) {
    const char *wflags[] = {"--steps",
                            "12",
                            "--checkpoint",
                            "none",
                            "--global-batch",
                            "2048",
                            "--stats",
                            stats,
                            k ? "--inject" : NULL,
                            "slow:rank=0,factor=4",
                            NULL};
    sp_tjob_run(MLP, k_cflags, 2, wflags, 60);
    med[k] = median_step(stats);
  }
  printf(
      "  median step of rank 0: %.2f ms, slowed 4x %.2f ms "
      "(%.1fx)\n",
      med[0] * 1e3, med[1] * 1e3, med[1] / med[0]);
  assert_true(med[1] > 2 * med[0]);
  free(stats);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_good),
      cmocka_unit_test(test_parse_bad),
      cmocka_unit_test(test_hook),
      cmocka_unit_test(test_exit),
      cmocka_unit_test(test_stall_keeps_heartbeats),
      cmocka_unit_test(test_skip_collective),
      cmocka_unit_test(test_wrong_count),
      cmocka_unit_test(test_slow),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
