/* The coordinator's durability, with real processes: a coordinator with
 * --state-dir that is SIGKILLed and started again loses no acknowledged
 * store write and applies no retried StoreAdd twice; a training job whose
 * coordinator is killed at random moments (and restarted on its port and
 * state dir) finishes with the checkpoint of an undisturbed run, bit for
 * bit, and so does `shardplane run`, which restarts its coordinator
 * itself; a second coordinator on a state dir, or one of another job, is
 * refused, and so is one whose database holds what the job cannot have;
 * the rank registrations and the alert log survive, and a rank that does
 * not reattach is declared lost after the reattach grace; a worker whose
 * coordinator stays away past --coordinator-grace fails naming the
 * coordinator. The training tests also show that the events a worker
 * could not deliver while the coordinator was away are a gap, not a
 * rejected transition: a rejection would make the worker exit non-zero.
 *
 * The random delays come from a seed printed at the start (SP_TEST_SEED
 * sets it) so a failure can be replayed.
 */
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include <cmocka.h>
#include <sqlite3.h>

#include "base/clock.h"
#include "base/proc.h"
#include "plan/state.h"
#include "rpc/coord_service.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"
#include "support/coord_fixture.h"
#include "support/job_fixture.h"
#include "support/testutil.h"

extern char **environ;

#define COORD SP_BIN_DIR "/shardplane-coordinator"
#define SHARDPLANE SP_BIN_DIR "/shardplane"
#define MLP SP_EXAMPLES "/mlp.json"

static sp_test_rng g_rng;

/* Children a failed test would leave running (cmocka leaves the test
 * function at the failed assertion): the teardown ends them. */
#define MAX_TRACKED 64
static pid_t g_tracked[MAX_TRACKED];

static void track(pid_t pid) {
  for (int i = 0; i < MAX_TRACKED; i++)
    if (g_tracked[i] <= 0) {
      g_tracked[i] = pid;
      return;
    }
}

static int end_tracked(void **state) {
  (void)state;
  for (int i = 0; i < MAX_TRACKED; i++) {
    pid_t p = g_tracked[i];
    g_tracked[i] = 0;
    /* only a child of ours not yet reaped: never a pid reused since */
    if (p > 0 && waitpid(p, NULL, WNOHANG) == 0) {
      kill(p, SIGKILL);
      waitpid(p, NULL, 0);
    }
  }
  return 0;
}

/* ---- processes ---- */

/* A coordinator of `world` ranks with state dir `state` on `port` (0: a
 * free one). */
static void coord_start(sp_proc *p, const char *state, int world, int port) {
  char ws[16], listen[64];
  snprintf(ws, sizeof ws, "%d", world);
  snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
  const char *argv[] = {COORD, "--listen",     listen,      "--model",
                        MLP,   "--world-size", ws,          "--state-dir",
                        state, "--insecure",   "--no-auth", "--quiet",
                        NULL};
  sp_diag d = {{0}};
  if (sp_proc_spawn(p, (char *const *)argv, false, false,
                    "listening on 127.0.0.1:%d", &d) < 0)
    fail_msg("coordinator: %s", d.msg);
  track(p->pid);
}

static void track_job(const sp_tjob *j) {
  track(j->coord.pid);
  for (int r = 0; r < j->n; r++) track(j->w[r]);
}

static void kill9(pid_t *pid) {
  assert_true(*pid > 0);
  assert_int_equal(kill(*pid, SIGKILL), 0);
  waitpid(*pid, NULL, 0);
  *pid = 0;
}

/* Runs argv to its end (at most timeout_s), stderr into err_path; returns
 * the exit status (-1 when it had to be killed). */
static int run_to_end(char *const *argv, const char *err_path,
                      double timeout_s) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, err_path,
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  pid_t pid;
  assert_int_equal(posix_spawn(&pid, argv[0], &fa, NULL, argv, environ), 0);
  posix_spawn_file_actions_destroy(&fa);
  track(pid);
  return sp_test_wait_exit(pid, timeout_s);
}

static void expect_in_file(const char *path, const char *needle) {
  char *s = sp_test_read_file(path);
  if (strstr(s, needle) == NULL)
    fail_msg("no \"%s\" in %s, which says: %s", needle, path, s);
  free(s);
}

/* Waits until every one of n ranks is attached to the coordinator (asked
 * with `token`). */
static void wait_attached(const char *addr, const char *token, uint32_t n,
                          double timeout_s) {
  sp_rpc_sync *cli;
  sp_rpc_client_opts o = {.connect_timeout_ms = 5000, .token = token};
  assert_int_equal(sp_rpc_sync_open_opts(addr, &o, &cli), 0);
  double end = sp_clock_s() + timeout_s;
  uint32_t attached = 0;
  while (sp_clock_s() < end) {
    Shardplane__V1__ListRanksRequest q =
        SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
    sp_rpc_status st;
    Shardplane__V1__ListRanksResponse *r = (void *)sp_test_unary(
        cli, SP_COORD_PATH("ListRanks"), &q.base,
        &shardplane__v1__list_ranks_response__descriptor, 2000, &st);
    attached = 0;
    for (size_t i = 0; r != NULL && i < r->n_ranks; i++)
      attached += r->ranks[i]->status == SHARDPLANE__V1__RANK_STATUS__ATTACHED;
    sp_test_free_msg(r);
    if (attached == n) break;
    usleep(20000);
  }
  sp_rpc_sync_close(cli);
  if (attached != n)
    fail_msg("%u of %u ranks attached after %.0f s", attached, n, timeout_s);
}

/* ---- store calls ---- */

static ProtobufCMessage *call(sp_rpc_sync *cli, const char *method,
                              const ProtobufCMessage *q,
                              const ProtobufCMessageDescriptor *desc,
                              sp_rpc_status *st) {
  ProtobufCMessage *r = NULL;
  if (sp_rpc_sync_unary(cli, method, q, desc, 2000, &r, st) != 0)
    st->code = SP_RPC_UNKNOWN;
  return r;
}

static int64_t add(sp_rpc_sync *cli, const char *key, int64_t delta,
                   const char *id) {
  Shardplane__V1__StoreAddRequest q = SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
  q.key = (char *)key;
  q.delta = delta;
  q.request_id = (char *)id;
  sp_rpc_status st;
  Shardplane__V1__StoreAddResponse *r =
      (void *)call(cli, SP_COORD_PATH("StoreAdd"), &q.base,
                   &shardplane__v1__store_add_response__descriptor, &st);
  if (st.code != SP_RPC_OK || r == NULL)
    fail_msg("StoreAdd %s: %s: %s", key, sp_rpc_code_name(st.code), st.message);
  int64_t v = r->value;
  sp_test_free_msg(r);
  return v;
}

/* The value of key, or NULL when absent (malloc'd). */
static char *get(sp_rpc_sync *cli, const char *key) {
  Shardplane__V1__StoreGetRequest q = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  q.key = (char *)key;
  sp_rpc_status st;
  Shardplane__V1__StoreGetResponse *r =
      (void *)call(cli, SP_COORD_PATH("StoreGet"), &q.base,
                   &shardplane__v1__store_get_response__descriptor, &st);
  if (st.code != SP_RPC_OK || r == NULL)
    fail_msg("StoreGet %s: %s: %s", key, sp_rpc_code_name(st.code), st.message);
  char *v = NULL;
  if (r->found) {
    v = malloc(r->value.len + 1);
    assert_non_null(v);
    memcpy(v, r->value.data, r->value.len);
    v[r->value.len] = '\0';
  }
  sp_test_free_msg(r);
  return v;
}

/* ---- (1) acknowledged writes survive kill -9 ---- */

#define WRITERS 4
#define PER_WRITER 500 /* 2,000 writes in all */

typedef struct writer {
  char addr[64];
  int id;
  bool acked[PER_WRITER];
  _Atomic int *n_acked;
} writer;

static void write_keys(void *arg) {
  writer *w = arg;
  sp_rpc_sync *cli;
  if (sp_rpc_sync_open(w->addr, 2000, &cli) != 0) return;
  for (int i = 0; i < PER_WRITER; i++) {
    char key[32], val[32];
    snprintf(key, sizeof key, "w%d/%d", w->id, i);
    snprintf(val, sizeof val, "value %d of writer %d", i, w->id);
    Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
    q.key = key;
    q.value.data = (uint8_t *)val;
    q.value.len = strlen(val);
    sp_rpc_status st;
    ProtobufCMessage *r =
        call(cli, SP_COORD_PATH("StoreSet"), &q.base,
             &shardplane__v1__store_set_response__descriptor, &st);
    sp_test_free_msg(r);
    if (st.code != SP_RPC_OK) break; /* the coordinator is gone */
    w->acked[i] = true;
    atomic_fetch_add(w->n_acked, 1);
  }
  sp_rpc_sync_close(cli);
}

static void test_acked_writes_survive_kill(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *st_dir = sp_test_path(dir, "state");
  sp_proc co;
  coord_start(&co, st_dir, 2, 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", co.port);

  /* the kill comes after a random number of acknowledged writes, so it
   * always lands while writes are in flight */
  int kill_after = 200 + (int)sp_test_rng_below(&g_rng, 1600);
  static writer ws[WRITERS];
  _Atomic int n_acked = 0;
  uv_thread_t th[WRITERS];
  for (int t = 0; t < WRITERS; t++) {
    memset(&ws[t], 0, sizeof ws[t]);
    snprintf(ws[t].addr, sizeof ws[t].addr, "%s", addr);
    ws[t].id = t;
    ws[t].n_acked = &n_acked;
    assert_int_equal(uv_thread_create(&th[t], write_keys, &ws[t]), 0);
  }
  double end = sp_clock_s() + 60;
  while (atomic_load(&n_acked) < kill_after && sp_clock_s() < end) usleep(200);
  int at_kill = atomic_load(&n_acked);
  kill9(&co.pid);
  for (int t = 0; t < WRITERS; t++) uv_thread_join(&th[t]);
  int acked = atomic_load(&n_acked);
  assert_true(at_kill >= kill_after);
  assert_true(acked < WRITERS * PER_WRITER);

  coord_start(&co, st_dir, 2, 0);
  snprintf(addr, sizeof addr, "127.0.0.1:%d", co.port);
  sp_rpc_sync *cli;
  assert_int_equal(sp_rpc_sync_open(addr, 5000, &cli), 0);
  int present = 0, extra = 0;
  for (int t = 0; t < WRITERS; t++)
    for (int i = 0; i < PER_WRITER; i++) {
      char key[32], val[32];
      snprintf(key, sizeof key, "w%d/%d", t, i);
      snprintf(val, sizeof val, "value %d of writer %d", i, t);
      char *v = get(cli, key);
      if (ws[t].acked[i]) {
        if (v == NULL) fail_msg("acknowledged write %s lost", key);
        assert_string_equal(v, val);
        present++;
      } else if (v != NULL) {
        /* committed, its answer lost with the process: allowed */
        assert_string_equal(v, val);
        extra++;
      }
      free(v);
    }
  printf(
      "  kill -9 after %d acknowledged writes (target %d): all %d "
      "acknowledged of 2000 present after the restart (%d more committed "
      "unanswered)\n",
      at_kill, kill_after, present, extra);

  /* a retried StoreAdd (same request id) is applied once, across a
   * restart too */
  assert_int_equal(add(cli, "ctr", 5, "sess:1"), 5);
  assert_int_equal(add(cli, "ctr", 5, "sess:1"), 5);
  assert_int_equal(add(cli, "ctr", 5, "sess:2"), 10);
  sp_rpc_sync_close(cli);
  kill9(&co.pid);
  coord_start(&co, st_dir, 2, 0);
  snprintf(addr, sizeof addr, "127.0.0.1:%d", co.port);
  assert_int_equal(sp_rpc_sync_open(addr, 5000, &cli), 0);
  assert_int_equal(add(cli, "ctr", 5, "sess:2"), 10);
  char *v = get(cli, "ctr");
  assert_non_null(v);
  assert_string_equal(v, "10");
  free(v);
  printf(
      "  StoreAdd retried with its request id, before and after a "
      "kill -9: applied once\n");
  sp_rpc_sync_close(cli);
  sp_proc_stop(&co, 5000);
  sp_test_rmtree(dir);
  free(st_dir);
  free(dir);
}

/* ---- (2) a training job rides out coordinator kills ---- */

#define STEPS "60"

static void job_flags(const char **f, const char *ck) {
  const char *v[] = {"--steps",
                     STEPS,
                     "--global-batch",
                     "24",
                     "--checkpoint-dir",
                     ck,
                     "--checkpoint",
                     "full",
                     "--checkpoint-every",
                     "20",
                     "--coordinator-grace",
                     "30",
                     NULL};
  memcpy(f, v, sizeof v);
}

/* Ranks still running; a rank that ended fails the test with its stderr
 * (dir/rank-R.err). */
static int live_workers(sp_tjob *j, const char *dir) {
  int live = 0;
  for (int r = 0; r < j->n; r++) {
    if (j->w[r] <= 0) continue;
    int st;
    pid_t p = waitpid(j->w[r], &st, WNOHANG);
    if (p == 0) {
      live++;
    } else if (p == j->w[r]) {
      char name[32];
      snprintf(name, sizeof name, "rank-%d.err", r);
      char *path = sp_test_path(dir, name), *err = sp_test_read_file(path);
      fail_msg("rank %d ended (status %d) before the job did: %s", r, st, err);
    }
  }
  return live;
}

static void test_training_rides_out_kills(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *ref = sp_test_path(dir, "ref"), *ck = sp_test_path(dir, "ck");
  char *st_dir = sp_test_path(dir, "state");
  const char *wf[16];
  job_flags(wf, ref);
  sp_tjob_run(MLP, NULL, 4, wf, 120);

  job_flags(wf, ck);
  const char *cf[] = {"--state-dir", st_dir, NULL};
  sp_tjob j;
  sp_tjob_start(&j, MLP, cf, 4, wf, dir);
  track_job(&j);
  /* the first kill may land in the workers' start (job, attach,
   * rendezvous), the second one in training */
  for (int k = 0; k < 2; k++) {
    unsigned delay = k == 0 ? (unsigned)sp_test_rng_below(&g_rng, 400)
                            : 100 + (unsigned)sp_test_rng_below(&g_rng, 500);
    sp_test_sleep_ms(delay);
    int live = live_workers(&j, dir);
    printf("  kill -9 of the coordinator %u ms after %s (%d ranks running)\n",
           delay, k == 0 ? "the workers started" : "its restart", live);
    if (k == 0 && live != 4)
      fail_msg(
          "the job ended before the first kill: the test needs more "
          "steps");
    sp_tjob_restart_coord(&j, MLP, cf);
    track(j.coord.pid);
  }
  int ok = sp_tjob_wait(&j, 120);
  for (int r = 0; r < 4; r++)
    if (j.status[r] != 0) {
      char name[32];
      snprintf(name, sizeof name, "rank-%d.err", r);
      char *p = sp_test_path(dir, name), *err = sp_test_read_file(p);
      printf("  rank %d: status %d: %s\n", r, j.status[r], err);
      free(err);
      free(p);
    }
  assert_int_equal(ok, 4);
  sp_tjob_same_tensors(ref, "full/model.safetensors", ck,
                       "full/model.safetensors");
  printf(
      "  4 ranks, %s steps, 2 coordinator kills: the final checkpoint "
      "equals the undisturbed run's, bit for bit\n",
      STEPS);
  sp_test_rmtree(dir);
  free(st_dir);
  free(ck);
  free(ref);
  free(dir);
}

/* ---- (3) shardplane run restarts its coordinator ---- */

static pid_t start_run(const char *dir, const char *ck) {
  char *out = sp_test_path(dir, "out"), *err = sp_test_path(dir, "err");
  const char *argv[] = {SHARDPLANE,
                        "run",
                        "--nproc",
                        "2",
                        "--model",
                        MLP,
                        "--steps",
                        "400",
                        "--log-every",
                        "20",
                        "--checkpoint-dir",
                        ck,
                        "--coordinator-grace",
                        "30",
                        NULL};
  pid_t pid = sp_test_spawn_logged(out, err, (char *const *)argv);
  track(pid);
  free(out);
  free(err);
  return pid;
}

static int wait_exit(pid_t pid, double timeout_s) {
  return sp_test_wait_exit(pid, timeout_s);
}

static bool file_has(const char *path, const char *needle) {
  char *s = sp_test_read_file(path);
  bool yes = strstr(s, needle) != NULL;
  free(s);
  return yes;
}

static void test_run_restarts_its_coordinator(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *a = sp_test_path(dir, "a"), *b = sp_test_path(dir, "b");
  /* undisturbed */
  char *refdir = sp_test_path(dir, "refrun");
  assert_int_equal(mkdir(refdir, 0777), 0);
  assert_int_equal(wait_exit(start_run(refdir, a), 120), 0);

  char *rundir = sp_test_path(dir, "run");
  assert_int_equal(mkdir(rundir, 0777), 0);
  pid_t run = start_run(rundir, b);
  char *out = sp_test_path(rundir, "out"), *err = sp_test_path(rundir, "err");
  double end = sp_clock_s() + 60;
  while (!file_has(out, "step 20/") && sp_clock_s() < end) usleep(10000);
  assert_true(file_has(out, "step 20/"));
  /* the coordinator's pid is in its state dir's lock file */
  char *lock = sp_test_path(b, "coordinator-state/coordinator.lock");
  char *pid_s = sp_test_read_file(lock);
  pid_t cpid = (pid_t)atol(pid_s);
  assert_true(cpid > 0);
  bool mid_run = !file_has(out, "step 400/");
  kill9(&cpid);
  printf("  killed the coordinator of shardplane run (pid %s) %s\n",
         strtok(pid_s, "\n"), mid_run ? "mid-run" : "late");
  assert_true(mid_run);
  int rc = wait_exit(run, 120);
  if (rc != 0) {
    char *e = sp_test_read_file(err);
    fail_msg("shardplane run exited %d: %s", rc, e);
  }
  expect_in_file(err, "restarted it on 127.0.0.1:");
  sp_tjob_same_tensors(a, "full/model.safetensors", b,
                       "full/model.safetensors");
  printf(
      "  shardplane run restarted it and finished with the undisturbed "
      "run's checkpoint\n");
  free(pid_s);
  free(lock);
  free(out);
  free(err);
  free(rundir);
  free(refdir);
  sp_test_rmtree(dir);
  free(a);
  free(b);
  free(dir);
}

/* ---- (4) one coordinator per state dir, one job per state dir ---- */

static void test_state_dir_refusals(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *st_dir = sp_test_path(dir, "state");
  char *err = sp_test_path(dir, "err");
  sp_proc co;
  coord_start(&co, st_dir, 2, 0);
  const char *second[] = {COORD,  "--listen",     "127.0.0.1:0", "--model",
                          MLP,    "--world-size", "2",           "--state-dir",
                          st_dir, "--insecure",   "--no-auth",   NULL};
  assert_int_equal(run_to_end((char *const *)second, err, 30), 1);
  expect_in_file(err, st_dir);
  expect_in_file(err, "in use by another coordinator");
  sp_proc_stop(&co, 5000);

  const char *other[] = {COORD,  "--listen",     "127.0.0.1:0", "--model",
                         MLP,    "--world-size", "3",           "--state-dir",
                         st_dir, "--insecure",   "--no-auth",   NULL};
  assert_int_equal(run_to_end((char *const *)other, err, 30), 1);
  expect_in_file(err, st_dir);
  expect_in_file(err, "belongs to another job");
  expect_in_file(err, "plan version");
  /* the same job is still welcome */
  coord_start(&co, st_dir, 2, 0);
  sp_proc_stop(&co, 5000);
  /* a file is no state dir */
  char *file = sp_test_path(dir, "file");
  sp_test_write_file(file, "x", 1);
  const char *on_file[] = {COORD, "--listen",     "127.0.0.1:0", "--model",
                           MLP,   "--world-size", "2",           "--state-dir",
                           file,  "--insecure",   "--no-auth",   NULL};
  assert_int_equal(run_to_end((char *const *)on_file, err, 30), 1);
  expect_in_file(err, "is not a directory");
  free(file);
  /* bad usage: exit 2, naming the flag */
  const char *empty[] = {COORD,       "--model",     MLP, "--insecure",
                         "--no-auth", "--state-dir", "",  NULL};
  assert_int_equal(run_to_end((char *const *)empty, err, 30), 2);
  expect_in_file(err, "--state-dir");
  const char *zero[] = {COORD,        "--model",   MLP,
                        "--insecure", "--no-auth", "--reattach-grace-ms",
                        "0",          NULL};
  assert_int_equal(run_to_end((char *const *)zero, err, 30), 2);
  expect_in_file(err, "--reattach-grace-ms");
  const char *wgrace[] = {SP_BIN_DIR "/shardplane-worker",
                          "--coordinator",
                          "127.0.0.1:1",
                          "--rank",
                          "0",
                          "--coordinator-grace",
                          "soon",
                          NULL};
  assert_int_equal(run_to_end((char *const *)wgrace, err, 30), 2);
  expect_in_file(err, "--coordinator-grace");
  const char *rgrace[] = {
      SHARDPLANE, "run", "--nproc", "2", "--model", MLP, "--coordinator-grace",
      "0",        NULL};
  assert_int_equal(run_to_end((char *const *)rgrace, err, 30), 2);
  expect_in_file(err, "--coordinator-grace");
  printf(
      "  a second coordinator on a state dir and one of another job are "
      "refused, naming the dir; so is a file; bad values of --state-dir, "
      "--reattach-grace-ms and --coordinator-grace are bad usage\n");
  free(err);
  sp_test_rmtree(dir);
  free(st_dir);
  free(dir);
}

/* ---- (5) past the grace period a worker fails naming the coordinator ---- */

static void test_worker_gives_up_after_grace(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *st_dir = sp_test_path(dir, "state");
  const char *cf[] = {"--state-dir", st_dir, NULL};
  const char *wf[] = {"--steps",
                      "1000000",
                      "--global-batch",
                      "24",
                      "--checkpoint",
                      "none",
                      "--coordinator-grace",
                      "1",
                      NULL};
  sp_tjob j;
  sp_tjob_start(&j, MLP, cf, 2, wf, dir);
  track_job(&j);
  wait_attached(j.addr, j.auth.token[SP_ROLE_READER], 2, 60);
  char addr[128];
  snprintf(addr, sizeof addr, "the coordinator at %s", j.addr);
  double t0 = sp_clock_s();
  kill9(&j.coord.pid);
  int ok = sp_tjob_wait(&j, 60);
  double took = sp_clock_s() - t0;
  assert_int_equal(ok, 0);
  for (int r = 0; r < 2; r++) {
    assert_true(j.status[r] > 0);
    char name[32];
    snprintf(name, sizeof name, "rank-%d.err", r);
    char *p = sp_test_path(dir, name);
    expect_in_file(p, addr);
    expect_in_file(p, "grace period");
    free(p);
  }
  /* 1 s of grace; the rest is the abort and the process's end */
  assert_true(took >= 1.0);
  printf(
      "  coordinator gone for good: both workers failed %.1f s later "
      "naming %s\n",
      took, j.addr);
  sp_test_rmtree(dir);
  free(st_dir);
  free(dir);
}

/* ---- (6) registrations and alerts survive; a rank that does not come
 * back is lost after the reattach grace; a tampered database is refused ---- */

static void coord_start_flags(sp_proc *p, const char *state, int world,
                              const char *grace_ms) {
  char ws[16];
  snprintf(ws, sizeof ws, "%d", world);
  const char *argv[] = {COORD,
                        "--listen",
                        "127.0.0.1:0",
                        "--model",
                        MLP,
                        "--world-size",
                        ws,
                        "--state-dir",
                        state,
                        "--reattach-grace-ms",
                        grace_ms,
                        "--quiet",
                        "--insecure",
                        "--no-auth",
                        NULL};
  sp_diag d = {{0}};
  if (sp_proc_spawn(p, (char *const *)argv, false, false,
                    "listening on 127.0.0.1:%d", &d) < 0)
    fail_msg("coordinator: %s", d.msg);
  track(p->pid);
}

static Shardplane__V1__ListRanksResponse *list_ranks(sp_rpc_sync *cli) {
  Shardplane__V1__ListRanksRequest q = SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__ListRanksResponse *r = (void *)sp_test_unary(
      cli, SP_COORD_PATH("ListRanks"), &q.base,
      &shardplane__v1__list_ranks_response__descriptor, 2000, &st);
  if (r == NULL) fail_msg("ListRanks: %s", st.message);
  return r;
}

static void test_ranks_and_alerts_survive(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *st_dir = sp_test_path(dir, "state");
  sp_proc co;
  coord_start_flags(&co, st_dir, 2, "400");
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", co.port);
  sp_rpc_sync *cli;
  assert_int_equal(sp_rpc_sync_open(addr, 5000, &cli), 0);
  Shardplane__V1__GetJobRequest jq = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__GetJobResponse *job = (void *)sp_test_unary(
      cli, SP_COORD_PATH("GetJob"), &jq.base,
      &shardplane__v1__get_job_response__descriptor, 2000, &st);
  assert_non_null(job);
  Shardplane__V1__AttachRequest aq = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  aq.rank = 1;
  aq.world_size = 2;
  aq.host = "h1";
  aq.pid = 4242;
  aq.device = "cpu";
  aq.plan_version = job->plan_version;
  Shardplane__V1__AttachResponse *ar = (void *)sp_test_unary(
      cli, SP_COORD_PATH("Attach"), &aq.base,
      &shardplane__v1__attach_response__descriptor, 2000, &st);
  assert_non_null(ar);
  /* an illegal transition (IDLE -> BACKWARD_POST): an alert */
  Shardplane__V1__Transition t = SHARDPLANE__V1__TRANSITION__INIT;
  t.machine = SHARDPLANE__V1__MACHINE__MACHINE_HANDLE;
  t.unit = 0;
  t.state = SP_HANDLE_BACKWARD_POST;
  Shardplane__V1__ReportTransitionRequest rq =
      SHARDPLANE__V1__REPORT_TRANSITION_REQUEST__INIT;
  rq.rank = 1;
  rq.session_id = ar->session_id;
  rq.transition = &t;
  sp_test_free_msg(sp_test_unary(
      cli, SP_COORD_PATH("ReportTransition"), &rq.base,
      &shardplane__v1__report_transition_response__descriptor, 2000, &st));
  assert_int_equal(st.code, SP_RPC_FAILED_PRECONDITION);
  /* a refusal is not a write the client waits for; a store write's answer
   * comes after the commit that holds the alert too */
  Shardplane__V1__StoreSetRequest sq = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  sq.key = "sync";
  sp_test_free_msg(sp_test_unary(
      cli, SP_COORD_PATH("StoreSet"), &sq.base,
      &shardplane__v1__store_set_response__descriptor, 2000, &st));
  assert_int_equal(st.code, SP_RPC_OK);
  sp_rpc_sync_close(cli);
  kill9(&co.pid);

  coord_start_flags(&co, st_dir, 2, "400");
  snprintf(addr, sizeof addr, "127.0.0.1:%d", co.port);
  assert_int_equal(sp_rpc_sync_open(addr, 5000, &cli), 0);
  Shardplane__V1__ListRanksResponse *lr = list_ranks(cli);
  assert_int_equal(lr->n_ranks, 2);
  assert_int_equal(lr->ranks[1]->status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
  assert_string_equal(lr->ranks[1]->host, "h1");
  assert_int_equal(lr->ranks[1]->pid, 4242);
  assert_int_equal(lr->ranks[1]->alerts, 1);
  assert_int_equal(lr->ranks[0]->status,
                   SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED);
  sp_test_free_msg(lr);
  Shardplane__V1__GetJobResponse *j2 = (void *)sp_test_unary(
      cli, SP_COORD_PATH("GetJob"), &jq.base,
      &shardplane__v1__get_job_response__descriptor, 2000, &st);
  assert_non_null(j2);
  assert_int_equal(j2->alerts, 1);
  assert_int_equal(j2->n_recent_alerts, 1);
  assert_non_null(strstr(j2->recent_alerts[0]->message, "BACKWARD_POST"));
  sp_test_free_msg(j2);
  /* the session id is still good for the rank's own calls */
  Shardplane__V1__ReportTransitionRequest ok = rq;
  t.state = SP_HANDLE_FORWARD;
  sp_test_free_msg(sp_test_unary(
      cli, SP_COORD_PATH("ReportTransition"), &ok.base,
      &shardplane__v1__report_transition_response__descriptor, 2000, &st));
  assert_int_equal(st.code, SP_RPC_OK);
  /* ... but it never opens its Session stream again: lost after 400 ms */
  double end = sp_clock_s() + 10;
  int status = 0;
  while (sp_clock_s() < end) {
    lr = list_ranks(cli);
    status = lr->ranks[1]->status;
    sp_test_free_msg(lr);
    if (status == SHARDPLANE__V1__RANK_STATUS__LOST) break;
    usleep(50000);
  }
  assert_int_equal(status, SHARDPLANE__V1__RANK_STATUS__LOST);
  printf(
      "  rank registration, session id and alert log restored; a rank "
      "that did not reattach within 400 ms was declared lost\n");
  sp_rpc_sync_close(cli);
  sp_proc_stop(&co, 5000);

  /* the database is input too: a rank the job does not have is refused */
  char *db_path = sp_test_path(st_dir, "coordinator.db");
  sqlite3 *db;
  assert_int_equal(sqlite3_open(db_path, &db), SQLITE_OK);
  assert_int_equal(sqlite3_exec(db, "UPDATE ranks SET rank = 7 WHERE rank = 1",
                                NULL, NULL, NULL),
                   SQLITE_OK);
  sqlite3_close(db);
  char *err = sp_test_path(dir, "err");
  const char *argv[] = {COORD,  "--listen",     "127.0.0.1:0", "--model",
                        MLP,    "--world-size", "2",           "--state-dir",
                        st_dir, "--insecure",   "--no-auth",   NULL};
  assert_int_equal(run_to_end((char *const *)argv, err, 30), 1);
  expect_in_file(err, "a rank row out of bounds");
  printf("  a state dir with a rank the job does not have is refused\n");
  free(err);
  free(db_path);
  sp_test_free_msg(ar);
  sp_test_free_msg(job);
  sp_test_rmtree(dir);
  free(st_dir);
  free(dir);
}

int main(void) {
  const char *seed = getenv("SP_TEST_SEED");
  g_rng.s = seed ? strtoull(seed, NULL, 0) : (uint64_t)time(NULL);
  printf("seed %llu (SP_TEST_SEED replays it)\n", (unsigned long long)g_rng.s);
  fflush(stdout);
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_acked_writes_survive_kill, end_tracked),
      cmocka_unit_test_teardown(test_state_dir_refusals, end_tracked),
      cmocka_unit_test_teardown(test_ranks_and_alerts_survive, end_tracked),
      cmocka_unit_test_teardown(test_worker_gives_up_after_grace, end_tracked),
      cmocka_unit_test_teardown(test_training_rides_out_kills, end_tracked),
      cmocka_unit_test_teardown(test_run_restarts_its_coordinator, end_tracked),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
