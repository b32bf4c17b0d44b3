/* Bearer tokens and roles, attacked: a coordinator with a token file and a
 * real job of two shardplane-worker processes; every attack must fail for
 * the attacker and leave the job running to its end. Also the token file
 * (hashes only, errors naming file:line), `shardplane token create`, the
 * per-token store quota, and the engine refusing a call before it reads
 * the body. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/clock.h"
#include "grpc/health/v1/health.pb-c.h"
#include "rpc/coord_service.h"
#include "support/auth_fixture.h"
#include "support/coord_fixture.h"
#include "support/test_certs.h"
#include "support/testutil.h"
#include "base/proc.h"

extern char **environ;

#define MLP SP_EXAMPLES "/mlp.json"
#define M(name) SP_COORD_PATH(name)
#define BAD_TOKEN "missing or invalid bearer token"

static const char *const k_world2[] = {"world-size", "2", NULL};

/* A client of fx carrying token (NULL: none). */
static sp_rpc_sync *client(const sp_coord_fixture *fx, const char *token) {
  sp_rpc_client_opts o = {.connect_timeout_ms = 5000,
                          .max_send_message = 16u << 20,
                          .token = token};
  sp_rpc_sync *c;
  assert_int_equal(sp_rpc_sync_open_opts(fx->addr, &o, &c), 0);
  return c;
}

/* One call whose status must be `code` mentioning `substr`. */
static void expect(sp_rpc_sync *c, const char *method,
                   const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *desc, int code,
                   const char *substr) {
  sp_rpc_status st;
  sp_test_free_msg(sp_test_unary(c, method, req, desc, 5000, &st));
  sp_test_expect_status(&st, code, substr);
}

static uint32_t attached(sp_rpc_sync *reader) {
  Shardplane__V1__ListRanksRequest q = SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__ListRanksResponse *r = (void *)sp_test_unary(
      reader, M("ListRanks"), &q.base,
      &shardplane__v1__list_ranks_response__descriptor, 5000, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  uint32_t n = 0;
  for (size_t i = 0; i < r->n_ranks; i++)
    n += r->ranks[i]->status == SHARDPLANE__V1__RANK_STATUS__ATTACHED;
  sp_test_free_msg(r);
  return n;
}

/* shardplane-worker rank r of fx's job, with the token in token_file;
 * its stderr in dir/rank-r.err. */
static pid_t start_worker(const sp_coord_fixture *fx, int r,
                          const char *token_file, const char *steps,
                          const char *dir) {
  char rs[16], err[1024];
  snprintf(rs, sizeof rs, "%d", r);
  snprintf(err, sizeof err, "%s/rank-%d.err", dir, r);
  const char *argv[] = {SP_BIN_DIR "/shardplane-worker",
                        "--coordinator",
                        fx->addr,
                        "--insecure",
                        "--token-file",
                        token_file,
                        "--rank",
                        rs,
                        "--steps",
                        steps,
                        "--log-every",
                        "0",
                        "--checkpoint",
                        "none",
                        NULL};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, err, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) fail_msg("cannot start a worker: %s", strerror(rc));
  return pid;
}

/* The worker's exit status within timeout_s (128 + signal; -1: killed at
 * the deadline). */
static int wait_worker(pid_t pid, double timeout_s) {
  double end = sp_clock_s() + timeout_s;
  int st;
  while (sp_clock_s() < end) {
    if (waitpid(pid, &st, WNOHANG) == pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    sp_test_sleep_ms(10);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return -1;
}

static void expect_exit(pid_t pid, int want, const char *dir, int r) {
  int got = wait_worker(pid, 60);
  if (got == want) return;
  char err[1024];
  snprintf(err, sizeof err, "%s/rank-%d.err", dir, r);
  char *e = sp_test_read_file(err);
  fail_msg("rank %d: exit %d, want %d: %s", r, got, want, e);
}

static void wait_attached(sp_rpc_sync *reader, uint32_t n) {
  double end = sp_clock_s() + 20;
  while (attached(reader) < n) {
    if (sp_clock_s() > end) fail_msg("the workers did not attach");
    sp_test_sleep_ms(10);
  }
}

/* Every attack from outside, and from tokens of too small a role, before
 * and while a real job runs: each fails, and the job finishes. */
static void test_attacks_leave_the_job_running(void **state) {
  (void)state;
  sp_tauth a;
  sp_tauth_make(&a);
  sp_coord_fixture fx;
  sp_coord_fixture_start_auth(&fx, MLP, k_world2, 0, a.token_file, NULL);
  sp_rpc_sync *anon = client(&fx, NULL);
  sp_rpc_sync *forged =
      client(&fx, "spt_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA");
  sp_rpc_sync *reader = client(&fx, a.token[SP_ROLE_READER]);
  sp_rpc_sync *worker = client(&fx, a.token[SP_ROLE_WORKER]);

  /* Health answers anyone, and says only that the service serves */
  Grpc__Health__V1__HealthCheckRequest hq =
      GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  hq.service = (char *)SP_COORD_SERVICE;
  sp_rpc_status st;
  Grpc__Health__V1__HealthCheckResponse *h = (void *)sp_test_unary(
      anon, "/grpc.health.v1.Health/Check", &hq.base,
      &grpc__health__v1__health_check_response__descriptor, 5000, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  assert_int_equal(
      h->status,
      GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  sp_test_free_msg(h);

  /* anonymous and forged queries */
  Shardplane__V1__GetPlanRequest pq = SHARDPLANE__V1__GET_PLAN_REQUEST__INIT;
  Shardplane__V1__ListRanksRequest lq =
      SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  Shardplane__V1__StoreGetRequest gq = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  gq.key = "comm/world/0";
  sp_rpc_sync *outsiders[] = {anon, forged};
  for (int i = 0; i < 2; i++) {
    expect(outsiders[i], M("GetPlan"), &pq.base,
           &shardplane__v1__plan__descriptor, SP_RPC_UNAUTHENTICATED,
           BAD_TOKEN);
    expect(outsiders[i], M("ListRanks"), &lq.base,
           &shardplane__v1__list_ranks_response__descriptor,
           SP_RPC_UNAUTHENTICATED, BAD_TOKEN);
    expect(outsiders[i], M("StoreGet"), &gq.base,
           &shardplane__v1__store_get_response__descriptor,
           SP_RPC_UNAUTHENTICATED, BAD_TOKEN);
  }

  /* an anonymous Attach of a rank nobody attached yet ... */
  Shardplane__V1__GetJobResponse *job = NULL;
  Shardplane__V1__GetJobRequest jq = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  job = (void *)sp_test_unary(reader, M("GetJob"), &jq.base,
                              &shardplane__v1__get_job_response__descriptor,
                              5000, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  Shardplane__V1__AttachRequest aq = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  aq.rank = 1;
  aq.world_size = 2;
  aq.host = "attacker";
  aq.plan_version = job->plan_version;
  expect(anon, M("Attach"), &aq.base,
         &shardplane__v1__attach_response__descriptor, SP_RPC_UNAUTHENTICATED,
         BAD_TOKEN);
  /* ... or by a reader: the role may not */
  expect(reader, M("Attach"), &aq.base,
         &shardplane__v1__attach_response__descriptor, SP_RPC_PERMISSION_DENIED,
         "role reader, which may not call Attach");
  assert_int_equal(attached(reader), 0);

  /* ... and the real workers then attach and train */
  char *dir = sp_test_mkdtemp();
  pid_t w[2];
  for (int r = 0; r < 2; r++)
    w[r] = start_worker(&fx, r, a.file[SP_ROLE_WORKER], "60", dir);
  wait_attached(reader, 2);

  /* anonymous writes that would break the running job's communicators */
  Shardplane__V1__StoreSetRequest sq = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  sq.key = "comm/world/0";
  sq.value = (ProtobufCBinaryData){5, (uint8_t *)"bogus"};
  expect(anon, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor,
         SP_RPC_UNAUTHENTICATED, BAD_TOKEN);
  Shardplane__V1__StoreAddRequest adq = SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
  adq.key = "comm/world/leaving";
  adq.delta = -100;
  expect(anon, M("StoreAdd"), &adq.base,
         &shardplane__v1__store_add_response__descriptor,
         SP_RPC_UNAUTHENTICATED, BAD_TOKEN);
  /* a reader reads, but neither writes nor aborts */
  expect(reader, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor,
         SP_RPC_PERMISSION_DENIED, "role reader, which may not call StoreSet");
  Shardplane__V1__AbortRequest abq = SHARDPLANE__V1__ABORT_REQUEST__INIT;
  abq.reason = "attack";
  expect(reader, M("Abort"), &abq.base,
         &shardplane__v1__abort_response__descriptor, SP_RPC_PERMISSION_DENIED,
         "role reader, which may not call Abort");
  /* a worker token neither aborts nor detaches a rank whose session it
   * does not hold, nor writes outside the communicators' keys */
  expect(worker, M("Abort"), &abq.base,
         &shardplane__v1__abort_response__descriptor, SP_RPC_PERMISSION_DENIED,
         "role worker, which may not call Abort");
  Shardplane__V1__DetachRequest dq = SHARDPLANE__V1__DETACH_REQUEST__INIT;
  dq.rank = 1;
  dq.session_id = "";
  expect(worker, M("Detach"), &dq.base,
         &shardplane__v1__detach_response__descriptor, SP_RPC_PERMISSION_DENIED,
         "wrong session id for rank 1");
  Shardplane__V1__StoreSetRequest oq = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  oq.key = "job/config";
  expect(worker, M("StoreSet"), &oq.base,
         &shardplane__v1__store_set_response__descriptor,
         SP_RPC_PERMISSION_DENIED, "only store keys under \"comm/\"");
  /* the attacks ran while the job did */
  assert_int_equal(attached(reader), 2);
  for (int r = 0; r < 2; r++) expect_exit(w[r], 0, dir, r);
  printf(
      "  anonymous, forged, reader and worker attacks refused; the job "
      "of 2 ranks finished\n");

  sp_test_free_msg(job);
  sp_rpc_sync_close(anon);
  sp_rpc_sync_close(forged);
  sp_rpc_sync_close(reader);
  sp_rpc_sync_close(worker);
  sp_coord_fixture_stop(&fx);
  sp_test_rmtree(dir);
  free(dir);
  sp_tauth_free(&a);
}

/* An admin token aborts the job: every rank's Session gets ABORT with the
 * reason, and the workers stop at once. */
static void test_admin_aborts(void **state) {
  (void)state;
  sp_tauth a;
  sp_tauth_make(&a);
  sp_coord_fixture fx;
  sp_coord_fixture_start_auth(&fx, MLP, k_world2, 0, a.token_file, NULL);
  sp_rpc_sync *admin = client(&fx, a.token[SP_ROLE_ADMIN]);
  char *dir = sp_test_mkdtemp();
  pid_t w[2];
  for (int r = 0; r < 2; r++)
    w[r] = start_worker(&fx, r, a.file[SP_ROLE_WORKER], "100000", dir);
  wait_attached(admin, 2);
  Shardplane__V1__AbortRequest abq = SHARDPLANE__V1__ABORT_REQUEST__INIT;
  abq.reason = "maintenance";
  sp_rpc_status st;
  double t0 = sp_clock_s();
  Shardplane__V1__AbortResponse *ar = (void *)sp_test_unary(
      admin, M("Abort"), &abq.base, &shardplane__v1__abort_response__descriptor,
      5000, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  /* attached ranks whose Session stream is not bound yet (a loaded
   * machine) get the ABORT when it binds: 0 to 2 at once */
  assert_true(ar->sessions <= 2);
  sp_test_free_msg(ar);
  /* every rank hears it, with the reason and who sent it */
  for (int r = 0; r < 2; r++) {
    char path[1024];
    snprintf(path, sizeof path, "%s/rank-%d.err", dir, r);
    char *e = NULL;
    for (double end = sp_clock_s() + 20; sp_clock_s() < end;) {
      free(e);
      e = sp_test_read_file(path);
      if (strstr(e, "job aborted by token \"test-admin\": maintenance")) break;
      sp_test_sleep_ms(20);
    }
    if (strstr(e, "job aborted by token \"test-admin\": maintenance") == NULL)
      fail_msg("rank %d did not get the ABORT: %s", r, e);
    free(e);
  }
  printf("  admin aborted the job: both ranks got ABORT within %.0f ms\n",
         (sp_clock_s() - t0) * 1000);
  /* the abort sticks: no rank attaches any more */
  Shardplane__V1__GetJobRequest jq = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  Shardplane__V1__GetJobResponse *job = (void *)sp_test_unary(
      admin, M("GetJob"), &jq.base,
      &shardplane__v1__get_job_response__descriptor, 5000, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  Shardplane__V1__AttachRequest aq = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  aq.world_size = 2;
  aq.plan_version = job->plan_version;
  expect(admin, M("Attach"), &aq.base,
         &shardplane__v1__attach_response__descriptor,
         SP_RPC_FAILED_PRECONDITION, "job aborted by token");
  sp_test_free_msg(job);
  /* and they stop, also a rank whose ABORT came while it was still
   * opening its communicators (the ABORT here follows the attach at once) */
  for (int r = 0; r < 2; r++) {
    int code = wait_worker(w[r], 20);
    printf("  rank %d: exit %d %.0f ms after the abort\n", r, code,
           (sp_clock_s() - t0) * 1000);
    assert_true(code > 0);
  }
  sp_rpc_sync_close(admin);
  sp_coord_fixture_stop(&fx);
  sp_test_rmtree(dir);
  free(dir);
  sp_tauth_free(&a);
}

/* A rank belongs to the token that attached it: another worker token
 * cannot detach it or speak for its session even with its session id; an
 * admin detaches it without one. */
static void test_rank_belongs_to_its_token(void **state) {
  (void)state;
  sp_tauth a;
  sp_tauth_make(&a);
  char other[SP_AUTH_TOKEN_LEN + 1];
  sp_diag d = {{0}};
  assert_int_equal(sp_auth_token_new(other, &d), 0);
  assert_int_equal(
      sp_auth_file_add(a.token_file, other, SP_ROLE_WORKER, "other-worker", &d),
      0);
  sp_coord_fixture fx;
  sp_coord_fixture_start_auth(&fx, MLP, k_world2, 0, a.token_file, NULL);
  sp_rpc_sync *mine = client(&fx, a.token[SP_ROLE_WORKER]);
  sp_rpc_sync *theirs = client(&fx, other);
  sp_rpc_sync *admin = client(&fx, a.token[SP_ROLE_ADMIN]);
  Shardplane__V1__GetJobRequest jq = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__GetJobResponse *job = (void *)sp_test_unary(
      mine, M("GetJob"), &jq.base,
      &shardplane__v1__get_job_response__descriptor, 5000, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  Shardplane__V1__AttachRequest aq = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  aq.rank = 0;
  aq.world_size = 2;
  aq.plan_version = job->plan_version;
  Shardplane__V1__AttachResponse *ar = (void *)sp_test_unary(
      mine, M("Attach"), &aq.base, &shardplane__v1__attach_response__descriptor,
      5000, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  /* even knowing the session id, another token does not own the rank */
  Shardplane__V1__DetachRequest dq = SHARDPLANE__V1__DETACH_REQUEST__INIT;
  dq.rank = 0;
  dq.session_id = ar->session_id;
  expect(theirs, M("Detach"), &dq.base,
         &shardplane__v1__detach_response__descriptor, SP_RPC_PERMISSION_DENIED,
         "attached with another token");
  aq.session_id = ar->session_id;
  expect(theirs, M("Attach"), &aq.base,
         &shardplane__v1__attach_response__descriptor, SP_RPC_PERMISSION_DENIED,
         "attached with another token");
  Shardplane__V1__Transition t = SHARDPLANE__V1__TRANSITION__INIT;
  t.state = 2;
  Shardplane__V1__ReportTransitionRequest rq =
      SHARDPLANE__V1__REPORT_TRANSITION_REQUEST__INIT;
  rq.rank = 0;
  rq.session_id = ar->session_id;
  rq.transition = &t;
  expect(theirs, M("ReportTransition"), &rq.base,
         &shardplane__v1__report_transition_response__descriptor,
         SP_RPC_PERMISSION_DENIED, "attached with another token");
  assert_int_equal(attached(admin), 1);
  /* the admin detaches it without the session id */
  dq.session_id = "";
  expect(admin, M("Detach"), &dq.base,
         &shardplane__v1__detach_response__descriptor, SP_RPC_OK, NULL);
  assert_int_equal(attached(admin), 0);
  /* and the owner's session is gone */
  dq.session_id = ar->session_id;
  expect(mine, M("Detach"), &dq.base,
         &shardplane__v1__detach_response__descriptor,
         SP_RPC_FAILED_PRECONDITION, "not attached");
  sp_test_free_msg(ar);
  sp_test_free_msg(job);
  sp_rpc_sync_close(mine);
  sp_rpc_sync_close(theirs);
  sp_rpc_sync_close(admin);
  sp_coord_fixture_stop(&fx);
  sp_tauth_free(&a);
}

static void count_body(sp_coord *c, void *arg) {
  sp_rpc_server_stats *s = arg;
  sp_rpc_server_get_stats(c->srv, s);
}

/* An unauthenticated 8 MiB StoreSet is refused on its headers: the body is
 * never kept (the server's body counter does not move), while the same
 * call with a token is taken in whole. */
static void test_refused_before_the_body(void **state) {
  (void)state;
  sp_tauth a;
  sp_tauth_make(&a);
  sp_coord_fixture fx;
  sp_coord_fixture_start_auth(&fx, MLP, k_world2, 0, a.token_file, NULL);
  size_t n = 8u << 20;
  uint8_t *big = calloc(1, n);
  assert_non_null(big);
  Shardplane__V1__StoreSetRequest sq = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  sq.key = "comm/big";
  sq.value = (ProtobufCBinaryData){n, big};
  sp_rpc_server_stats before, after;
  sp_coord_fixture_run(&fx, count_body, &before);
  sp_rpc_sync *anon = client(&fx, NULL);
  expect(anon, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor,
         SP_RPC_UNAUTHENTICATED, BAD_TOKEN);
  sp_coord_fixture_run(&fx, count_body, &after);
  printf(
      "  refused 8 MiB StoreSet: %llu body bytes kept, %llu bytes "
      "arrived\n",
      (unsigned long long)(after.body_bytes - before.body_bytes),
      (unsigned long long)(after.bytes_in - before.bytes_in));
  assert_int_equal(after.body_bytes, before.body_bytes);
  assert_int_equal(after.calls_refused, before.calls_refused + 1);
  /* an authenticated one goes through whole (the quota holds 8 MiB) */
  sp_rpc_sync *admin = client(&fx, a.token[SP_ROLE_ADMIN]);
  expect(admin, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor, SP_RPC_OK, NULL);
  sp_coord_fixture_run(&fx, count_body, &before);
  assert_true(before.body_bytes - after.body_bytes >= n);
  sp_rpc_sync_close(anon);
  sp_rpc_sync_close(admin);
  free(big);
  sp_coord_fixture_stop(&fx);
  sp_tauth_free(&a);
}

/* The per-token quota counts the keys a token holds now: at the limit a
 * new key is refused naming the quota; deleting one makes room; replacing
 * a key's value costs only the difference. */
static void test_store_quota(void **state) {
  (void)state;
  sp_tauth a;
  sp_tauth_make(&a);
  sp_coord_fixture fx;
  sp_coord_auth_quota q = {.keys = 2, .bytes = 64};
  sp_coord_fixture_start_auth(&fx, MLP, k_world2, 0, a.token_file, &q);
  sp_rpc_sync *w = client(&fx, a.token[SP_ROLE_WORKER]);
  Shardplane__V1__StoreSetRequest sq = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  sq.value = (ProtobufCBinaryData){4, (uint8_t *)"1234"};
  const char *keys[] = {"comm/a", "comm/b"};
  for (int i = 0; i < 2; i++) {
    sq.key = (char *)keys[i];
    expect(w, M("StoreSet"), &sq.base,
           &shardplane__v1__store_set_response__descriptor, SP_RPC_OK, NULL);
  }
  sq.key = "comm/c";
  expect(w, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor,
         SP_RPC_RESOURCE_EXHAUSTED, "at most 2 keys (--store-quota-keys)");
  Shardplane__V1__StoreAddRequest adq = SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
  adq.key = "comm/c";
  adq.delta = 1;
  expect(w, M("StoreAdd"), &adq.base,
         &shardplane__v1__store_add_response__descriptor,
         SP_RPC_RESOURCE_EXHAUSTED, "store quota of token \"test-worker\"");
  /* replacing a key's value within the byte quota is fine; past it not */
  sq.key = "comm/a";
  sq.value = (ProtobufCBinaryData){
      40, (uint8_t *)"0123456789012345678901234567890123456789"};
  expect(w, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor, SP_RPC_OK, NULL);
  sq.value.len = 60;
  uint8_t sixty[60] = {0};
  sq.value.data = sixty;
  expect(w, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor,
         SP_RPC_RESOURCE_EXHAUSTED, "at most 64 bytes");
  Shardplane__V1__StoreDeleteRequest dq =
      SHARDPLANE__V1__STORE_DELETE_REQUEST__INIT;
  dq.key = "comm/b";
  expect(w, M("StoreDelete"), &dq.base,
         &shardplane__v1__store_delete_response__descriptor, SP_RPC_OK, NULL);
  sq.key = "comm/c";
  sq.value = (ProtobufCBinaryData){4, (uint8_t *)"1234"};
  expect(w, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor, SP_RPC_OK, NULL);
  /* another token has a quota of its own */
  sp_rpc_sync *admin = client(&fx, a.token[SP_ROLE_ADMIN]);
  sq.key = "job/note";
  expect(admin, M("StoreSet"), &sq.base,
         &shardplane__v1__store_set_response__descriptor, SP_RPC_OK, NULL);
  sp_rpc_sync_close(w);
  sp_rpc_sync_close(admin);
  sp_coord_fixture_stop(&fx);
  sp_tauth_free(&a);
}

/* The token file holds hashes, never tokens; a malformed line is an error
 * naming file:line, from the library and from the program. */
static void test_token_file(void **state) {
  (void)state;
  sp_tauth a;
  sp_tauth_make(&a);
  char *text = sp_test_read_file(a.token_file);
  for (int r = SP_ROLE_WORKER; r <= SP_ROLE_ADMIN; r++) {
    assert_null(strstr(text, a.token[r]));
    assert_null(strstr(text, a.token[r] + 4)); /* not even the random part */
  }
  size_t lines = 0;
  for (const char *p = text; *p; p = strchr(p, '\n') + 1, lines++)
    assert_int_equal(strncmp(p, "sha256:", 7), 0);
  assert_int_equal(lines, 3);
  struct stat sb;
  assert_int_equal(stat(a.token_file, &sb), 0);
  assert_int_equal(sb.st_mode & 0777, 0600);
  free(text);

  char *bad = sp_test_path(a.dir, "bad-tokens");
  const char *body =
      "# two good lines, then a bad hash\n"
      "sha256:0000000000000000000000000000000000000000000000"
      "000000000000000000 worker w1\n"
      "sha256:00000000000000000000000000000000000000000000000"
      "0000000000000000g reader r1\n";
  sp_test_write_file(bad, body, strlen(body));
  chmod(bad, 0600);
  sp_coord_auth *t = NULL;
  sp_diag d = {{0}};
  assert_int_equal(sp_coord_auth_load(bad, NULL, &t, &d), SP_EFORMAT);
  char where[1100];
  snprintf(where, sizeof where, "%s:3:", bad);
  if (strstr(d.msg, where) == NULL) fail_msg("no %s in: %s", where, d.msg);
  printf("  %s\n", d.msg);
  /* the program says the same and does not start */
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "%s/shardplane-coordinator --model %s --listen 127.0.0.1:0 "
           "--insecure --token-file %s 2>&1",
           SP_BIN_DIR, MLP, bad);
  char *out;
  assert_int_equal(sp_test_shell(cmd, &out), 1);
  if (strstr(out, where) == NULL) fail_msg("no %s in: %s", where, out);
  free(out);
  /* a token file others may change is refused */
  chmod(a.token_file, 0620);
  assert_int_equal(sp_coord_auth_load(a.token_file, NULL, &t, &d), SP_ESTATE);
  assert_non_null(strstr(d.msg, "chmod 600"));
  free(bad);
  sp_tauth_free(&a);
}

/* `shardplane token create` prints a fresh token and appends only its
 * hash; the coordinator accepts it, and the CLI presents it from a token
 * file or $SHARDPLANE_TOKEN (a world-readable token file is refused). */
static void test_token_create_and_use(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *tf = sp_test_path(dir, "tokens");
  char cmd[4096], *out;
  snprintf(cmd, sizeof cmd,
           "%s/shardplane token create --role reader --token-file %s "
           "--name ops 2>/dev/null",
           SP_BIN_DIR, tf);
  assert_int_equal(sp_test_shell(cmd, &out), 0);
  assert_int_equal(strncmp(out, "spt_", 4), 0);
  assert_int_equal(strlen(out), SP_AUTH_TOKEN_LEN + 1);
  out[SP_AUTH_TOKEN_LEN] = '\0';
  char *file = sp_test_read_file(tf);
  assert_null(strstr(file, out));
  assert_non_null(strstr(file, " reader ops\n"));
  free(file);
  char *token = out;
  /* bad usage: exit 2 */
  snprintf(cmd, sizeof cmd,
           "%s/shardplane token create --role root --token-file %s 2>&1",
           SP_BIN_DIR, tf);
  assert_int_equal(sp_test_shell(cmd, &out), 2);
  assert_non_null(strstr(out, "--role \"root\""));
  free(out);
  snprintf(cmd, sizeof cmd, "%s/shardplane token create --help", SP_BIN_DIR);
  assert_int_equal(sp_test_shell(cmd, &out), 0);
  assert_non_null(strstr(out, "--token-file FILE"));
  free(out);

  sp_coord_fixture fx;
  sp_coord_fixture_start_auth(&fx, MLP, k_world2, 0, tf, NULL);
  char *mine = sp_test_path(dir, "mine.token");
  sp_diag d = {{0}};
  assert_int_equal(sp_auth_token_write(mine, token, &d), 0);
  snprintf(cmd, sizeof cmd,
           "%s/shardplane status --coordinator %s --insecure --token-file %s "
           "--json 2>&1",
           SP_BIN_DIR, fx.addr, mine);
  assert_int_equal(sp_test_shell(cmd, &out), 0);
  assert_non_null(strstr(out, "\"plan_version\""));
  free(out);
  snprintf(cmd, sizeof cmd,
           "SHARDPLANE_TOKEN=%s %s/shardplane ranks --coordinator %s "
           "--insecure 2>&1",
           token, SP_BIN_DIR, fx.addr);
  assert_int_equal(sp_test_shell(cmd, &out), 0);
  free(out);
  snprintf(cmd, sizeof cmd,
           "%s/shardplane status --coordinator %s --insecure 2>&1", SP_BIN_DIR,
           fx.addr);
  assert_int_equal(sp_test_shell(cmd, &out), 1);
  assert_non_null(strstr(out, "UNAUTHENTICATED"));
  /* the refusal says that no token went, and how to send one */
  assert_non_null(strstr(out, "no token sent (--token-file FILE"));
  free(out);
  /* ... or which token it was refused */
  char *wrong = sp_test_path(dir, "wrong.token");
  assert_int_equal(
      sp_auth_token_write(wrong, "spt_not-a-token-of-this-job", &d), 0);
  snprintf(cmd, sizeof cmd,
           "%s/shardplane status --coordinator %s --insecure --token-file %s "
           "2>&1",
           SP_BIN_DIR, fx.addr, wrong);
  assert_int_equal(sp_test_shell(cmd, &out), 1);
  char want[1200];
  snprintf(want, sizeof want, "(UNAUTHENTICATED): the token of --token-file %s",
           wrong);
  if (strstr(out, want) == NULL) fail_msg("%s", out);
  free(out);
  free(wrong);
  /* a reader may not write the store */
  snprintf(cmd, sizeof cmd,
           "%s/shardplane store set k v --coordinator %s --insecure "
           "--token-file %s 2>&1",
           SP_BIN_DIR, fx.addr, mine);
  assert_int_equal(sp_test_shell(cmd, &out), 1);
  assert_non_null(strstr(out, "PERMISSION_DENIED"));
  free(out);
  chmod(mine, 0644);
  snprintf(cmd, sizeof cmd,
           "%s/shardplane status --coordinator %s --insecure --token-file %s "
           "2>&1",
           SP_BIN_DIR, fx.addr, mine);
  assert_int_equal(sp_test_shell(cmd, &out), 2);
  assert_non_null(strstr(out, "chmod 600"));
  free(out);
  sp_coord_fixture_stop(&fx);
  free(token);
  free(mine);
  free(tf);
  sp_test_rmtree(dir);
  free(dir);
}

/* The coordinator program will not serve cleartext or without tokens
 * unless asked to, and says so. */
static void test_coordinator_flags(void **state) {
  (void)state;
  char cmd[2048], *out;
  const struct {
    const char *flags, *says;
  } cases[] = {
      {"--no-auth", "choose the transport"},
      {"--insecure", "--token-file FILE is required"},
      {"--insecure --no-auth --token-file x", "exclude each other"},
      {"--tls-cert c.pem --no-auth", "--tls-cert and --tls-key go together"},
      {"--insecure --tls-cert c --tls-key k --no-auth", "exclude each other"},
      {"--insecure --no-auth --store-quota-keys 0", "--store-quota-keys \"0\""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    snprintf(cmd, sizeof cmd,
             "%s/shardplane-coordinator --model %s --listen 127.0.0.1:0 %s "
             "2>&1",
             SP_BIN_DIR, MLP, cases[i].flags);
    assert_int_equal(sp_test_shell(cmd, &out), 2);
    if (strstr(out, cases[i].says) == NULL)
      fail_msg("%s: no \"%s\" in: %s", cases[i].flags, cases[i].says, out);
    free(out);
  }
  /* open on purpose: it serves, and warns about both */
  snprintf(cmd, sizeof cmd,
           "%s/shardplane-coordinator --model %s --listen 0.0.0.0:0 --quiet "
           "--insecure --no-auth 2>&1 >/dev/null & p=$!; sleep 0.5; kill $p; "
           "wait $p",
           SP_BIN_DIR, MLP);
  assert_int_equal(sp_test_shell(cmd, &out), 0);
  if (strstr(out, "warning: listening in cleartext on 0.0.0.0:0") == NULL ||
      strstr(out, "warning: --no-auth") == NULL)
    fail_msg("no warnings in: %s", out);
  free(out);
  /* on loopback, cleartext needs no warning */
  snprintf(cmd, sizeof cmd,
           "%s/shardplane-coordinator --model %s --listen 127.0.0.1:0 --quiet "
           "--insecure --no-auth 2>&1 >/dev/null & p=$!; sleep 0.5; kill $p; "
           "wait $p",
           SP_BIN_DIR, MLP);
  assert_int_equal(sp_test_shell(cmd, &out), 0);
  assert_null(strstr(out, "cleartext"));
  assert_non_null(strstr(out, "warning: --no-auth"));
  free(out);
}

/* The exposed setup, end to end: a coordinator serving TLS (then mutual
 * TLS) with a token file, real workers with --tls-ca and the worker token,
 * the command with a reader token; cleartext and an unknown CA fail. */
static void test_tls_and_tokens(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  sp_test_certs certs;
  int crc = sp_test_certs_make(dir, &certs);
  if (crc == SP_EUNSUPPORTED) {
    printf("  SKIPPED: no openssl command to make test certificates\n");
    sp_test_rmtree(dir);
    free(dir);
    skip();
  }
  assert_int_equal(crc, 0);
  sp_tauth a;
  sp_tauth_make(&a);
  for (int mutual = 0; mutual < 2; mutual++) {
    const char *ca[24] = {SP_BIN_DIR "/shardplane-coordinator",
                          "--listen",
                          "127.0.0.1:0",
                          "--model",
                          MLP,
                          "--world-size",
                          "2",
                          "--quiet",
                          "--tls-cert",
                          certs.server_cert,
                          "--tls-key",
                          certs.server_key,
                          "--token-file",
                          a.token_file,
                          NULL};
    if (mutual) {
      ca[14] = "--tls-client-ca";
      ca[15] = certs.ca;
    }
    sp_proc coord;
    sp_diag d = {{0}};
    if (sp_proc_spawn(&coord, (char *const *)ca, false, false,
                      "listening on 127.0.0.1:%d", &d) < 0)
      fail_msg("coordinator: %s", d.msg);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", coord.port);
    const char *client_cert =
        mutual ? " --tls-cert %s --tls-key %s" : "%.0s%.0s";
    char certflags[2048];
    snprintf(certflags, sizeof certflags, client_cert, certs.client_cert,
             certs.client_key);
    if (!mutual) {
      /* two workers train over TLS with the worker token */
      pid_t w[2];
      for (int r = 0; r < 2; r++) {
        char rs[4], err[1024];
        snprintf(rs, sizeof rs, "%d", r);
        snprintf(err, sizeof err, "%s/rank-%d.err", dir, r);
        const char *wa[] = {SP_BIN_DIR "/shardplane-worker",
                            "--coordinator",
                            addr,
                            "--tls-ca",
                            certs.ca,
                            "--token-file",
                            a.file[SP_ROLE_WORKER],
                            "--rank",
                            rs,
                            "--steps",
                            "3",
                            "--log-every",
                            "0",
                            "--checkpoint",
                            "none",
                            NULL};
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_addopen(&fa, 2, err,
                                         O_WRONLY | O_CREAT | O_TRUNC, 0644);
        assert_int_equal(
            posix_spawn(&w[r], wa[0], &fa, NULL, (char *const *)wa, environ),
            0);
        posix_spawn_file_actions_destroy(&fa);
      }
      for (int r = 0; r < 2; r++) expect_exit(w[r], 0, dir, r);
    }
    char cmd[8192], *out;
    snprintf(cmd, sizeof cmd,
             "%s/shardplane ranks --coordinator %s --tls-ca %s%s "
             "--token-file %s 2>&1",
             SP_BIN_DIR, addr, certs.ca, certflags, a.file[SP_ROLE_READER]);
    assert_int_equal(sp_test_shell(cmd, &out), 0);
    if (!mutual && strstr(out, "DETACHED") == NULL)
      fail_msg("the TLS job's ranks: %s", out);
    free(out);
    /* cleartext to a TLS coordinator, and a CA it does not use */
    snprintf(cmd, sizeof cmd,
             "%s/shardplane status --coordinator %s --insecure --token-file "
             "%s --timeout-ms 1000 2>&1",
             SP_BIN_DIR, addr, a.file[SP_ROLE_READER]);
    assert_true(sp_test_shell(cmd, &out) != 0);
    free(out);
    snprintf(cmd, sizeof cmd,
             "%s/shardplane status --coordinator %s --tls-ca %s%s "
             "--token-file %s --timeout-ms 1000 2>&1",
             SP_BIN_DIR, addr, certs.other_ca, certflags,
             a.file[SP_ROLE_READER]);
    assert_true(sp_test_shell(cmd, &out) != 0);
    free(out);
    if (mutual) {
      /* without a client certificate the handshake fails */
      snprintf(cmd, sizeof cmd,
               "%s/shardplane status --coordinator %s --tls-ca %s "
               "--token-file %s --timeout-ms 1000 2>&1",
               SP_BIN_DIR, addr, certs.ca, a.file[SP_ROLE_READER]);
      assert_true(sp_test_shell(cmd, &out) != 0);
      free(out);
    }
    sp_proc_stop(&coord, 5000);
  }
  printf(
      "  TLS and mutual TLS with tokens: a 2-rank job trained, the "
      "command read it; cleartext and a foreign CA refused\n");
  sp_tauth_free(&a);
  sp_test_certs_free(&certs);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_admin_aborts),
      cmocka_unit_test(test_rank_belongs_to_its_token),
      cmocka_unit_test(test_token_file),
      cmocka_unit_test(test_coordinator_flags),
      cmocka_unit_test(test_token_create_and_use),
      cmocka_unit_test(test_refused_before_the_body),
      cmocka_unit_test(test_store_quota),
      cmocka_unit_test(test_attacks_leave_the_job_running),
      cmocka_unit_test(test_tls_and_tokens),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
