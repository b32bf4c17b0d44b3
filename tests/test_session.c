/* The session of libshardplane (client/lib/session/session.c) against a real
 * coordinator in-process: open (job, spec, plan, version, attach), the
 * store from several threads, a whole training step reported and seen by
 * ListRanks, local refusal of illegal transitions, queue overflow,
 * heartbeats, ABORT, detach, no_report, and the per-event cost. */
#include <dirent.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "support/auth_fixture.h"
#include "support/coord_fixture.h"
#include "server/coordinator.h"
#include "lib/session/plan_wire.h"
#include "lib/session/session_internal.h"
#include "lib/shardplane.h"
#include "support/testutil.h"

typedef sp_coord_fixture fixture;
#define start sp_coord_fixture_start
#define stop sp_coord_fixture_stop
#define expect_code sp_test_expect_status
#define call sp_coord_fixture_call
#define get_job sp_coord_fixture_get_job
#define free_msg sp_test_free_msg

#define MODEL(name) SP_EXAMPLES "/models/" name ".json"
#define PATH(m) SP_COORD_PATH(m)

static Shardplane__V1__ListRanksResponse *list_ranks(fixture *fx) {
  Shardplane__V1__ListRanksRequest q = SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  q.with_unit_states = true;
  sp_rpc_status st;
  ProtobufCMessage *r =
      call(fx, PATH("ListRanks"), &q.base,
           &shardplane__v1__list_ranks_response__descriptor, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  return (Shardplane__V1__ListRanksResponse *)r;
}

static sp_session_opts opts_for(const fixture *fx, uint32_t rank) {
  sp_session_opts o = {
      .coordinator = fx->addr, .rank = rank, .connect_timeout_ms = 5000};
  return o;
}

static sp_session *open_ok(const sp_session_opts *o) {
  sp_session *s = NULL;
  sp_diag d = {""};
  int rc = sp_session_open(o, &s, &d);
  if (rc != 0) fail_msg("sp_session_open: %s: %s", sp_strerror(rc), d.msg);
  return s;
}

static void close_ok(sp_session *s) {
  sp_diag d = {""};
  int rc = sp_session_close(s, 5000, &d);
  if (rc != 0) fail_msg("sp_session_close: %s: %s", sp_strerror(rc), d.msg);
}

static void flush_ok(sp_session *s) {
  sp_diag d = {""};
  int rc = sp_session_flush(s, 5000, &d);
  if (rc != 0) fail_msg("sp_session_flush: %s: %s", sp_strerror(rc), d.msg);
}

/* ---------------- helpers without a coordinator ---------------- */

static void test_plan_version_check(void **state) {
  (void)state;
  sp_diag d = {""};
  assert_int_equal(
      sp_session_check_plan_version("0123456789abcdef", "0123456789abcdef", &d),
      0);
  assert_int_equal(
      sp_session_check_plan_version("0123456789abcdef", "fedcba9876543210", &d),
      SP_ESTATE);
  assert_non_null(strstr(d.msg, "0123456789abcdef"));
  assert_non_null(strstr(d.msg, "fedcba9876543210"));
  assert_int_equal(sp_session_check_plan_version("", "", &d), SP_ESTATE);
  assert_int_equal(sp_session_check_plan_version(NULL, "x", NULL), SP_ESTATE);

  assert_int_equal(sp_session_rpc_error(SP_RPC_OK), 0);
  assert_int_equal(sp_session_rpc_error(SP_RPC_ALREADY_EXISTS), SP_EEXIST);
  assert_int_equal(sp_session_rpc_error(SP_RPC_FAILED_PRECONDITION), SP_ESTATE);
  assert_int_equal(sp_session_rpc_error(SP_RPC_INVALID_ARGUMENT), SP_EINVAL);
  assert_int_equal(sp_session_rpc_error(SP_RPC_DEADLINE_EXCEEDED),
                   SP_ETIMEDOUT);
  assert_int_equal(sp_session_rpc_error(SP_RPC_NOT_FOUND), SP_ENOENT);
  assert_int_equal(sp_session_rpc_error(SP_RPC_UNAVAILABLE), SP_EIO);
  assert_int_equal(sp_session_rpc_error(SP_RPC_UNIMPLEMENTED), SP_EUNSUPPORTED);
}

/* An explicit empty full-precision list must survive the wire, or a worker
 * would fall back to FSDP's default (_BatchNorm) and build another plan. */
static void test_wire_job_full_precision_set(void **state) {
  (void)state;
  Shardplane__V1__Job m = SHARDPLANE__V1__JOB__INIT;
  Shardplane__V1__MixedPrecision mp = SHARDPLANE__V1__MIXED_PRECISION__INIT;
  m.world_size = 2;
  m.strategy = SHARDPLANE__V1__SHARDING_STRATEGY__FULL_SHARD;
  m.mixed_precision = &mp;
  mp.enabled = true;
  mp.full_precision_types_set = true;
  sp_job j;
  sp_job_init(&j);
  assert_int_equal(sp_wire_job(&m, &j), 0);
  assert_true(j.mp.full_precision_types_set);
  assert_int_equal(j.mp.full_precision_types.n, 0);
  sp_job_clear(&j);
  mp.full_precision_types_set = false;
  sp_job_init(&j);
  assert_int_equal(sp_wire_job(&m, &j), 0);
  assert_false(j.mp.full_precision_types_set);
  sp_job_clear(&j);
}

/* ---------------- GetModelSpec ---------------- */

static void test_get_model_spec(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  char *file = sp_test_read_file(MODEL("gpt2"));
  size_t flen = strlen(file);
  Shardplane__V1__GetJobResponse *j = get_job(&fx);

  /* whole, and in 1000-byte pieces */
  for (uint32_t piece = 0; piece <= 1000; piece += 1000) {
    char *got = malloc(flen + 1);
    uint64_t off = 0, total = 0;
    do {
      Shardplane__V1__GetModelSpecRequest q =
          SHARDPLANE__V1__GET_MODEL_SPEC_REQUEST__INIT;
      q.offset = off;
      q.max_bytes = piece;
      sp_rpc_status st;
      Shardplane__V1__GetModelSpecResponse *r =
          (Shardplane__V1__GetModelSpecResponse *)call(
              &fx, PATH("GetModelSpec"), &q.base,
              &shardplane__v1__get_model_spec_response__descriptor, &st);
      expect_code(&st, SP_RPC_OK, NULL);
      assert_string_equal(r->model_name, "gpt2");
      assert_string_equal(r->plan_version, j->plan_version);
      assert_int_equal(r->total_bytes, flen);
      assert_int_equal(r->offset, off);
      if (piece) assert_true(r->spec_json.len <= piece);
      assert_true(off + r->spec_json.len <= flen);
      memcpy(got + off, r->spec_json.data, r->spec_json.len);
      off += r->spec_json.len;
      total = r->total_bytes;
      free_msg(r);
    } while (off < total);
    assert_memory_equal(got, file, flen);
    free(got);
  }
  /* past the end */
  Shardplane__V1__GetModelSpecRequest q =
      SHARDPLANE__V1__GET_MODEL_SPEC_REQUEST__INIT;
  q.offset = flen + 1;
  sp_rpc_status st;
  assert_null(call(&fx, PATH("GetModelSpec"), &q.base,
                   &shardplane__v1__get_model_spec_response__descriptor, &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "past the end");
  free_msg(j);
  free(file);
  stop(&fx);
}

/* ---------------- open, plan, attach, close ---------------- */

static void test_open_builds_the_coordinators_plan(void **state) {
  (void)state;
  const char *flags[] = {
      "world-size",  "4",        "wrap-type", "LlamaDecoderLayer",
      "param-dtype", "bfloat16", NULL};
  fixture fx;
  start(&fx, MODEL("llama2_7b"), flags, 0);
  sp_session_opts o = opts_for(&fx, 2);
  o.device = "cuda:2";
  sp_session *s = open_ok(&o);
  Shardplane__V1__GetJobResponse *j = get_job(&fx);
  const sp_plan *pl = sp_session_plan(s);
  assert_non_null(pl);
  assert_string_equal(pl->version_hex, j->plan_version);
  assert_int_equal(pl->n_units, j->n_units);
  assert_int_equal(pl->n_units, 33); /* root + 32 decoder layers */
  assert_int_equal(sp_session_rank(s), 2);
  assert_int_equal(sp_session_world(s), 4);
  assert_string_equal(sp_session_model(s)->name, "llama2_7b");
  assert_int_equal(sp_session_job(s)->mp.param_dtype, SP_BFLOAT16);
  assert_string_equal(sp_session_coordinator(s), fx.addr);
  assert_int_equal(j->ranks->attached, 1);
  free_msg(j);
  Shardplane__V1__ListRanksResponse *l = list_ranks(&fx);
  assert_int_equal(l->ranks[2]->status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
  assert_string_equal(l->ranks[2]->device, "cuda:2");
  free_msg(l);
  assert_int_equal(sp_session_dropped(s), 0);
  assert_false(sp_session_aborted(s, NULL, 0));

  close_ok(s);
  l = list_ranks(&fx);
  assert_int_equal(l->ranks[2]->status, SHARDPLANE__V1__RANK_STATUS__DETACHED);
  free_msg(l);
  /* the rank can come back after a clean detach */
  s = open_ok(&o);
  close_ok(s);
  stop(&fx);
}

static void test_open_errors(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 0);
  sp_session *s = open_ok(&o);
  sp_session *s2 = (sp_session *)&o; /* must be reset to NULL */
  sp_diag d = {""};

  /* the same rank twice */
  assert_int_equal(sp_session_open(&o, &s2, &d), SP_EEXIST);
  assert_null(s2);
  assert_non_null(strstr(d.msg, "already attached"));
  /* a rank outside the job */
  o.rank = 2;
  assert_int_equal(sp_session_open(&o, &s2, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "ranks 0-1"));
  /* bad options */
  assert_int_equal(sp_session_open(NULL, &s2, &d), SP_EINVAL);
  o.coordinator = "no-port";
  assert_int_equal(sp_session_open(&o, &s2, &d), SP_EINVAL);
  o = opts_for(&fx, 1);
  o.queue_events = (size_t)SP_SESSION_QUEUE_MAX + 1;
  assert_int_equal(sp_session_open(&o, &s2, &d), SP_EINVAL);
  /* nobody listening: a port that was just free */
  uv_loop_t loop;
  uv_loop_init(&loop);
  uv_tcp_t tcp;
  uv_tcp_init(&loop, &tcp);
  struct sockaddr_in sa;
  uv_ip4_addr("127.0.0.1", 0, &sa);
  assert_int_equal(uv_tcp_bind(&tcp, (struct sockaddr *)&sa, 0), 0);
  int len = sizeof sa;
  uv_tcp_getsockname(&tcp, (struct sockaddr *)&sa, &len);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(sa.sin_port));
  uv_close((uv_handle_t *)&tcp, NULL);
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);
  o = opts_for(&fx, 1);
  o.coordinator = addr;
  o.connect_timeout_ms = 300;
  uint64_t t0 = uv_hrtime();
  assert_int_equal(sp_session_open(&o, &s2, &d), SP_ETIMEDOUT);
  assert_non_null(strstr(d.msg, "unreachable"));
  assert_true((uv_hrtime() - t0) / 1000000 < 5000);

  close_ok(s);
  assert_int_equal(sp_session_close(NULL, 0, NULL), 0);
  stop(&fx);
}

/* ---------------- store ---------------- */

typedef struct setter {
  sp_session *s;
  uint64_t delay_ms;
  int rc;
} setter;

static void set_later(void *arg) {
  setter *x = arg;
  sp_test_sleep_ms((unsigned)x->delay_ms);
  sp_diag d;
  x->rc = sp_session_store_set(x->s, "late", "value", 5, &d);
}

static void test_store(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 0);
  sp_session *s = open_ok(&o);
  sp_diag d = {""};
  uint8_t *v;
  size_t n;

  assert_int_equal(sp_session_store_set(s, "k", "abc", 3, &d), 0);
  assert_int_equal(sp_session_store_get(s, "k", 0, &v, &n, &d), 0);
  assert_int_equal(n, 3);
  assert_memory_equal(v, "abc", 3);
  free(v);
  /* empty values are values */
  assert_int_equal(sp_session_store_set(s, "empty", NULL, 0, &d), 0);
  assert_int_equal(sp_session_store_get(s, "empty", 0, &v, &n, &d), 0);
  assert_int_equal(n, 0);
  free(v);
  int64_t x;
  assert_int_equal(sp_session_store_add(s, "ctr", 5, &x, &d), 0);
  assert_int_equal(x, 5);
  assert_int_equal(sp_session_store_add(s, "ctr", -2, &x, &d), 0);
  assert_int_equal(x, 3);
  /* add on a value that is not a number: the coordinator says why */
  assert_int_equal(sp_session_store_add(s, "k", 1, &x, &d), SP_ESTATE);
  assert_non_null(strstr(d.msg, "store add"));

  /* absent, without and with a wait */
  assert_int_equal(sp_session_store_get(s, "nope", 0, &v, &n, &d), SP_ENOENT);
  assert_null(v);
  uint64_t t0 = uv_hrtime();
  assert_int_equal(sp_session_store_get(s, "nope", 200, &v, &n, &d),
                   SP_ETIMEDOUT);
  uint64_t ms = (uv_hrtime() - t0) / 1000000;
  assert_true(ms >= 150 && ms < 3000);
  assert_non_null(strstr(d.msg, "nope"));

  /* a get that waits for a set from another thread of the same process */
  setter st = {s, 200, -1};
  uv_thread_t th;
  assert_int_equal(uv_thread_create(&th, set_later, &st), 0);
  assert_int_equal(sp_session_store_get(s, "late", 5000, &v, &n, &d), 0);
  uv_thread_join(&th);
  assert_int_equal(st.rc, 0);
  assert_int_equal(n, 5);
  assert_memory_equal(v, "value", 5);
  free(v);

  /* the communicator's view of the same store */
  sp_comm_store cs = sp_session_comm_store(s);
  assert_int_equal(cs.set(cs.user, "cs", "1", 1, &d), 0);
  assert_int_equal(cs.get(cs.user, "cs", 1000, &v, &n, &d), 0);
  assert_int_equal(n, 1);
  free(v);

  /* bad arguments */
  assert_int_equal(sp_session_store_set(s, "", "x", 1, &d), SP_EINVAL);
  assert_int_equal(sp_session_store_set(s, "k", NULL, 1, &d), SP_EINVAL);
  close_ok(s);
  stop(&fx);
}

/* ---------------- reporting ---------------- */

/* One training step as FSDP runs it: forward in unit order, backward in
 * reverse. Returns the number of transitions. */
static uint64_t run_step(sp_session *s, uint64_t step) {
  const sp_plan *pl = sp_session_plan(s);
  uint32_t nu = (uint32_t)pl->n_units;
  sp_diag d = {""};
  uint64_t n = 0;
#define TR(m, u, to)                                        \
  do {                                                      \
    int rc_ = sp_session_transition(s, (m), (u), (to), &d); \
    if (rc_ != 0) fail_msg("transition: %s", d.msg);        \
    n++;                                                    \
  } while (0)
  sp_session_set_step(s, step);
  TR(SP_MACHINE_ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
  for (uint32_t u = 0; u < nu; u++) {
    TR(SP_MACHINE_HANDLE, u, SP_HANDLE_FORWARD);
    sp_session_collective(s, SP_COMM_WORLD, SP_OP_ALL_GATHER, u, SP_FLOAT32,
                          1000 + u);
    TR(SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE);
  }
  for (uint32_t u = nu; u-- > 0;) {
    TR(SP_MACHINE_HANDLE, u, SP_HANDLE_BACKWARD_PRE);
    TR(SP_MACHINE_HANDLE, u, SP_HANDLE_BACKWARD_POST);
    sp_session_collective(s, SP_COMM_WORLD, SP_OP_REDUCE_SCATTER, u, SP_FLOAT32,
                          2000 + u);
    TR(SP_MACHINE_HANDLE, u, SP_HANDLE_IDLE);
  }
  TR(SP_MACHINE_ROOT, 0, SP_ROOT_IDLE);
#undef TR
  return n;
}

static void test_training_step_reported(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 1);
  sp_session *s = open_ok(&o);
  uint32_t nu = (uint32_t)sp_session_plan(s)->n_units;
  assert_int_equal(nu, 13);
  sp_diag d = {""};

  /* mid-step: the coordinator sees the same states */
  sp_session_set_step(s, 1);
  assert_int_equal(sp_session_transition(s, SP_MACHINE_ROOT, 0,
                                         SP_ROOT_FORWARD_BACKWARD, &d),
                   0);
  assert_int_equal(
      sp_session_transition(s, SP_MACHINE_HANDLE, 3, SP_HANDLE_FORWARD, &d), 0);
  assert_int_equal(sp_session_state(s, SP_MACHINE_HANDLE, 3),
                   SP_HANDLE_FORWARD);
  flush_ok(s);
  Shardplane__V1__ListRanksResponse *l = list_ranks(&fx);
  Shardplane__V1__RankInfo *r = l->ranks[1];
  assert_int_equal(r->root_state, SP_ROOT_FORWARD_BACKWARD);
  assert_int_equal(r->n_unit_states, nu);
  assert_int_equal(r->unit_states[3], SP_HANDLE_FORWARD);
  assert_int_equal(r->unit_states[4], SP_HANDLE_IDLE);
  assert_int_equal(r->transitions, 2);
  assert_int_equal(r->step, 1);
  free_msg(l);
  assert_int_equal(
      sp_session_transition(s, SP_MACHINE_HANDLE, 3, SP_HANDLE_IDLE, &d), 0);
  assert_int_equal(
      sp_session_transition(s, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, &d), 0);

  /* whole steps */
  uint64_t n = 2 + 2 + run_step(s, 2) + run_step(s, 3);
  assert_int_equal(n, 4 + 2 * (2 + 5 * nu));
  flush_ok(s);
  l = list_ranks(&fx);
  r = l->ranks[1];
  assert_int_equal(r->status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
  assert_int_equal(r->step, 3);
  assert_int_equal(r->root_state, SP_ROOT_IDLE);
  for (uint32_t u = 0; u < nu; u++)
    assert_int_equal(r->unit_states[u], SP_HANDLE_IDLE);
  assert_int_equal(r->transitions, n);
  assert_int_equal(r->alerts, 0);
  /* the last collective: unit 0's reduce-scatter of step 3 */
  assert_non_null(r->last_collective);
  assert_int_equal(r->last_collective->seq, 4 * nu);
  assert_int_equal(r->last_collective->op,
                   SHARDPLANE__V1__COLLECTIVE_OP__REDUCE_SCATTER);
  assert_int_equal(r->last_collective->unit, 0);
  assert_int_equal(r->last_collective->count, 2000);
  free_msg(l);
  assert_int_equal(sp_session_dropped(s), 0);
  close_ok(s);
  l = list_ranks(&fx);
  assert_int_equal(l->ranks[1]->status, SHARDPLANE__V1__RANK_STATUS__DETACHED);
  free_msg(l);
  stop(&fx);
}

static void test_illegal_transition_refused_locally(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 0);
  sp_session *s = open_ok(&o);
  sp_diag d = {""};
  assert_int_equal(sp_session_transition(s, SP_MACHINE_HANDLE, 2,
                                         SP_HANDLE_BACKWARD_POST, &d),
                   SP_ESTATE);
  assert_non_null(strstr(d.msg, "rank 0"));
  assert_non_null(strstr(d.msg, "unit 2"));
  assert_non_null(strstr(d.msg, "legal"));
  assert_int_equal(sp_session_state(s, SP_MACHINE_HANDLE, 2), SP_HANDLE_IDLE);
  assert_int_equal(
      sp_session_transition(s, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, &d),
      SP_ESTATE);
  /* not a state, not a unit */
  assert_int_equal(sp_session_transition(s, SP_MACHINE_HANDLE, 0, 9, &d),
                   SP_EINVAL);
  assert_int_equal(
      sp_session_transition(s, SP_MACHINE_HANDLE, 999, SP_HANDLE_FORWARD, &d),
      SP_EINVAL);
  assert_int_equal(sp_session_transition(s, (sp_machine)7, 0, 1, &d),
                   SP_EINVAL);
  /* nothing was queued */
  flush_ok(s);
  Shardplane__V1__ListRanksResponse *l = list_ranks(&fx);
  assert_int_equal(l->ranks[0]->transitions, 0);
  assert_int_equal(l->ranks[0]->alerts, 0);
  free_msg(l);
  close_ok(s);
  stop(&fx);
}

static void test_queue_overflow_counted(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 0);
  o.queue_events = 5; /* rounded up to 8 */
  sp_session *s = open_ok(&o);
  const uint64_t n = 200000;
  uint64_t last = 0;
  for (uint64_t i = 0; i < n; i++)
    last = sp_session_collective(s, SP_COMM_WORLD, SP_OP_ALL_REDUCE, 0,
                                 SP_FLOAT32, i);
  assert_int_equal(last, n); /* sequence numbers count every call */
  uint64_t dropped = sp_session_dropped(s);
  printf("queue of 8: %llu of %llu collectives dropped\n",
         (unsigned long long)dropped, (unsigned long long)n);
  assert_true(dropped > 0);
  assert_true(dropped < n);
  /* what was queued arrives */
  flush_ok(s);
  assert_int_equal(sp_session_dropped(s), dropped);
  close_ok(s);
  stop(&fx);
}

/* A dropped transition makes the coordinator's view diverge: later
 * reports are rejected, and flush says so. */
static void test_dropped_transition_rejected(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "1", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 0);
  o.queue_events = 2;
  sp_session *s = open_ok(&o);
  sp_diag d = {""};
  /* rounds of an odd number of transitions with a pause between them: the
   * ring of two takes the first pair of each round, and the pairs start
   * alternately from IDLE and from FORWARD_BACKWARD */
  int i = 0;
  for (int round = 0; round < 20; round++) {
    for (int k = 0; k < 51; k++, i++)
      assert_int_equal(sp_session_transition(
                           s, SP_MACHINE_ROOT, 0,
                           i % 2 ? SP_ROOT_IDLE : SP_ROOT_FORWARD_BACKWARD, &d),
                       0);
    sp_test_sleep_ms(5);
  }
  if (sp_session_dropped(s) == 0) {
    close_ok(s);
    stop(&fx);
    skip();
  }
  int rc = sp_session_flush(s, 5000, &d);
  assert_int_equal(rc, SP_ESTATE);
  assert_non_null(strstr(d.msg, "rejected"));
  /* close reports it too */
  assert_int_equal(sp_session_close(s, 5000, &d), SP_ESTATE);
  stop(&fx);
}

static void test_heartbeat_keeps_rank_alive(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 300);
  sp_session_opts o = opts_for(&fx, 0);
  sp_session *s = open_ok(&o);
  /* the training thread sends nothing for four timeouts */
  sp_test_sleep_ms(1200);
  Shardplane__V1__ListRanksResponse *l = list_ranks(&fx);
  assert_int_equal(l->ranks[0]->status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
  assert_true(l->ranks[0]->last_heard_ms_ago < 300);
  free_msg(l);
  assert_false(sp_session_aborted(s, NULL, 0));
  close_ok(s);
  stop(&fx);
}

/* A worker process stopped for 1.5 s (SIGSTOP, as a host's scheduler or
 * pager may hold it) says so when it runs again: its next SessionUp
 * carries a scheduling gap of about as long, which the coordinator keeps
 * (ListRanks' sched_gap_ms). The worker is a real process of its own,
 * forked before the coordinator's thread starts, that opens its session
 * at the address a pipe gives it. */
static void test_stopped_worker_reports_its_gap(void **state) {
  (void)state;
  int to_child[2], from_child[2];
  assert_int_equal(pipe(to_child), 0);
  assert_int_equal(pipe(from_child), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(to_child[1]);
    close(from_child[0]);
    char addr[64] = "";
    ssize_t n = read(to_child[0], addr, sizeof addr - 1);
    if (n <= 0) _exit(2);
    addr[n] = '\0';
    sp_session_opts o = {
        .coordinator = addr, .rank = 0, .connect_timeout_ms = 5000};
    sp_session *s = NULL;
    sp_diag d = {""};
    if (sp_session_open(&o, &s, &d) != 0) _exit(3);
    if (write(from_child[1], "k", 1) != 1) _exit(4);
    for (;;) pause(); /* until killed */
  }
  close(to_child[0]);
  close(from_child[1]);
  const char *flags[] = {"world-size", "1", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  assert_int_equal(write(to_child[1], fx.addr, strlen(fx.addr)),
                   (ssize_t)strlen(fx.addr));
  char ok = 0;
  assert_int_equal(read(from_child[0], &ok, 1), 1);
  sp_test_sleep_ms(300);
  assert_int_equal(kill(pid, SIGSTOP), 0);
  sp_test_sleep_ms(1500);
  assert_int_equal(kill(pid, SIGCONT), 0);
  uint64_t gap = 0;
  for (int i = 0; i < 300 && gap < 1000; i++) {
    Shardplane__V1__ListRanksResponse *l = list_ranks(&fx);
    gap = l->ranks[0]->sched_gap_ms;
    assert_int_equal(l->ranks[0]->status,
                     SHARDPLANE__V1__RANK_STATUS__ATTACHED);
    free_msg(l);
    if (gap < 1000) sp_test_sleep_ms(10);
  }
  kill(pid, SIGKILL);
  int st;
  waitpid(pid, &st, 0);
  close(to_child[1]);
  close(from_child[0]);
  stop(&fx);
  if (gap < 1000)
    fail_msg("the gap reported: %llu ms", (unsigned long long)gap);
}

typedef struct abort_seen {
  atomic_int calls;
  char reason[256];
} abort_seen;

/* The reason is written before the count is published (the test thread
 * reads it once it sees the count). */
static void on_abort(void *user, const char *reason) {
  abort_seen *a = user;
  if (atomic_load(&a->calls) == 0)
    snprintf(a->reason, sizeof a->reason, "%s", reason);
  atomic_fetch_add(&a->calls, 1);
}

static void wait_abort(abort_seen *a) {
  for (int i = 0; i < 500 && atomic_load(&a->calls) == 0; i++)
    sp_test_sleep_ms(10);
}

static void test_abort_when_a_peer_is_lost(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  abort_seen seen = {0};
  sp_session_opts o = opts_for(&fx, 0);
  o.on_abort = on_abort;
  o.user = &seen;
  sp_session *s = open_ok(&o);

  /* rank 1 attaches by hand, opens its stream, then drops it */
  Shardplane__V1__GetJobResponse *j = get_job(&fx);
  Shardplane__V1__AttachRequest aq = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  aq.rank = 1;
  aq.world_size = 2;
  aq.plan_version = j->plan_version;
  sp_rpc_status st;
  Shardplane__V1__AttachResponse *ar = (Shardplane__V1__AttachResponse *)call(
      &fx, PATH("Attach"), &aq.base,
      &shardplane__v1__attach_response__descriptor, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  sp_rpc_sync_stream *ss;
  assert_int_equal(
      sp_rpc_sync_stream_open(fx.cli, PATH("Session"), 0, NULL, 0, &ss), 0);
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.rank = 1;
  up.session_id = ar->session_id;
  up.seq = 1;
  assert_int_equal(sp_rpc_sync_stream_send(ss, &up.base), 0);
  ProtobufCMessage *m;
  assert_int_equal(
      sp_rpc_sync_stream_recv(ss, &shardplane__v1__session_down__descriptor,
                              2000, &m, &st),
      0);
  free_msg(m);
  assert_int_equal(atomic_load(&seen.calls), 0);
  sp_rpc_sync_stream_close(ss); /* cancels: rank 1 is lost */
  /* the cancel goes out when the client's loop runs next */
  free_msg(get_job(&fx));

  wait_abort(&seen);
  assert_int_equal(atomic_load(&seen.calls), 1);
  /* the coordinator names the culprit, and the victim says it is not */
  assert_non_null(strstr(seen.reason, "aborted: rank 1 was lost"));
  assert_non_null(strstr(seen.reason, "not this rank's fault"));
  char why[256];
  assert_true(sp_session_aborted(s, why, sizeof why));
  assert_string_equal(why, seen.reason);
  /* the stream goes on: reports still arrive, the close is clean */
  sp_diag d;
  assert_int_equal(sp_session_transition(s, SP_MACHINE_ROOT, 0,
                                         SP_ROOT_FORWARD_BACKWARD, &d),
                   0);
  flush_ok(s);
  close_ok(s);
  assert_int_equal(atomic_load(&seen.calls), 1);
  free_msg(ar);
  free_msg(j);
  stop(&fx);
}

/* ---------------- hang diagnosis: fingerprints, recorder ---------------- */

/* Asks for the flight record as the coordinator's FLIGHT_DUMP does and
 * returns what went out (the real decode and answer, through the
 * background thread). */
static Shardplane__V1__FlightRecord *dump(sp_session *s, uint64_t id,
                                          uint32_t last_n) {
  uint64_t before = sp_session_flight_dumps(s);
  Shardplane__V1__SessionDown m = SHARDPLANE__V1__SESSION_DOWN__INIT;
  m.command = SHARDPLANE__V1__COMMAND__FLIGHT_DUMP;
  m.request_id = id;
  m.last_n = last_n;
  assert_int_equal(sp_session_test_down(s, &m), 0);
  for (int i = 0; i < 500 && sp_session_flight_dumps(s) == before; i++)
    sp_test_sleep_ms(10);
  assert_int_equal(sp_session_flight_dumps(s), before + 1);
  Shardplane__V1__FlightRecord *fr = sp_session_test_last_flight(s);
  assert_non_null(fr);
  return fr;
}

/* Whether a thread of this process is called name (/proc/self/task). */
static bool thread_named(const char *name) {
  DIR *dir = opendir("/proc/self/task");
  if (dir == NULL) return false;
  bool found = false;
  struct dirent *e;
  while (!found && (e = readdir(dir)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char path[300], comm[32] = "";
    snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
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

/* HYBRID_SHARD, 4 ranks in shard groups of 2: rank 3 is in shard group 1
 * and replica group 1. Each communicator counts its own collectives from
 * 1; a completion follows its issue with the same fingerprint; every
 * event has the worker's time (monotone here, one thread) and its step. */
static void test_fingerprints_per_communicator(void **state) {
  (void)state;
  const char *flags[] = {"world-size",       "4",        "wrap-type",
                         "GPT2Block",        "strategy", "HYBRID_SHARD",
                         "shard-group-size", "2",        NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 3);
  sp_session *s = open_ok(&o);
  /* the background thread says what it is in a stack dump or top -H */
  assert_true(thread_named("session"));
  uint64_t t0 = sp_session_time_us();
  sp_session_set_step(s, 1);
  assert_int_equal(sp_session_collective(s, SP_COMM_WORLD, SP_OP_ALL_REDUCE, 0,
                                         SP_FLOAT64, 1),
                   1);
  uint64_t g1 = sp_session_collective(s, SP_COMM_SHARD, SP_OP_ALL_GATHER, 1,
                                      SP_FLOAT32, 10);
  uint64_t g2 = sp_session_collective(s, SP_COMM_SHARD, SP_OP_REDUCE_SCATTER, 1,
                                      SP_FLOAT32, 10);
  uint64_t r1 = sp_session_collective(s, SP_COMM_REPLICA, SP_OP_ALL_REDUCE, 1,
                                      SP_FLOAT32, 10);
  assert_int_equal(g1, 1);
  assert_int_equal(g2, 2);
  assert_int_equal(r1, 1);
  sp_session_collective_done(s, SP_COMM_SHARD, g1, 0, 0);
  sp_session_collective_done(s, SP_COMM_SHARD, g2, 0, 0);
  sp_session_collective_done(s, SP_COMM_REPLICA, r1, 0, 0);
  sp_session_set_step(s, 2);
  uint64_t g3 = sp_session_collective(s, SP_COMM_SHARD, SP_OP_ALL_GATHER, 2,
                                      SP_BFLOAT16, 20);
  assert_int_equal(g3, 3);
  sp_session_collective_done(s, SP_COMM_SHARD, g3, 0, 0);
  /* an invalid communicator is refused, nothing queued */
  assert_int_equal(sp_session_collective(s, (sp_comm_kind)7, SP_OP_ALL_GATHER,
                                         0, SP_FLOAT32, 1),
                   0);
  flush_ok(s);
  uint64_t t1 = sp_session_time_us();

  Shardplane__V1__FlightRecord *fr = dump(s, 77, 0);
  assert_int_equal(fr->request_id, 77);
  assert_int_equal(fr->rank, 3);
  assert_int_equal(fr->capacity, 2000);
  assert_int_equal(fr->recorded, 9); /* 5 issues, 4 completions */
  assert_int_equal(fr->n_transitions, 0);
  assert_int_equal(fr->n_collectives, 9);
  assert_true(fr->time_us >= t1);
  /* kind, seq, completed, step, unit, count, op */
  static const struct {
    int comm;
    uint64_t seq;
    bool done;
    uint64_t step;
    uint32_t unit;
    uint64_t count;
    int op;
  } want[9] = {
      {SP_COMM_WORLD, 1, false, 1, 0, 1, SP_OP_ALL_REDUCE},
      {SP_COMM_SHARD, 1, false, 1, 1, 10, SP_OP_ALL_GATHER},
      {SP_COMM_SHARD, 2, false, 1, 1, 10, SP_OP_REDUCE_SCATTER},
      {SP_COMM_REPLICA, 1, false, 1, 1, 10, SP_OP_ALL_REDUCE},
      {SP_COMM_SHARD, 1, true, 1, 1, 10, SP_OP_ALL_GATHER},
      {SP_COMM_SHARD, 2, true, 1, 1, 10, SP_OP_REDUCE_SCATTER},
      {SP_COMM_REPLICA, 1, true, 1, 1, 10, SP_OP_ALL_REDUCE},
      {SP_COMM_SHARD, 3, false, 2, 2, 20, SP_OP_ALL_GATHER},
      {SP_COMM_SHARD, 3, true, 2, 2, 20, SP_OP_ALL_GATHER},
  };
  static const uint32_t index_of[3] = {0, 1, 1}; /* 3 / 2, 3 % 2 */
  uint64_t prev = t0;
  for (size_t i = 0; i < 9; i++) {
    const Shardplane__V1__Collective *c = fr->collectives[i];
    assert_int_equal(c->comm, want[i].comm);
    assert_int_equal(c->comm_index, index_of[want[i].comm]);
    assert_int_equal(c->seq, want[i].seq);
    assert_int_equal(c->completed, want[i].done);
    assert_int_equal(c->step, want[i].step);
    assert_int_equal(c->unit, want[i].unit);
    assert_int_equal(c->count, want[i].count);
    assert_int_equal(c->op, want[i].op);
    assert_int_equal(c->dtype, i >= 7   ? SP_BFLOAT16
                               : i == 0 ? SP_FLOAT64
                                        : SP_FLOAT32);
    assert_true(c->time_us >= prev);
    assert_true(c->time_us <= t1);
    prev = c->time_us;
  }
  shardplane__v1__flight_record__free_unpacked(fr, NULL);

  /* the last 3 only, for another request */
  fr = dump(s, 78, 3);
  assert_int_equal(fr->request_id, 78);
  assert_int_equal(fr->n_collectives, 3);
  assert_int_equal(fr->collectives[0]->comm, SP_COMM_REPLICA);
  assert_true(fr->collectives[0]->completed);
  assert_int_equal(fr->collectives[2]->seq, 3);
  assert_true(fr->collectives[2]->completed);
  shardplane__v1__flight_record__free_unpacked(fr, NULL);
  close_ok(s);
  stop(&fx);
}

/* The recorder keeps the last flight_events events, transitions and
 * collectives in their order, and counts all it saw. */
static void test_flight_recorder_keeps_the_last(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 0);
  o.flight_events = 5;
  sp_session *s = open_ok(&o);
  sp_diag d;
  sp_session_set_step(s, 4);
  for (int i = 0; i < 10; i++)
    sp_session_collective(s, SP_COMM_WORLD, SP_OP_ALL_GATHER, 1, SP_FLOAT32,
                          (uint64_t)i);
  assert_int_equal(sp_session_transition(s, SP_MACHINE_ROOT, 0,
                                         SP_ROOT_FORWARD_BACKWARD, &d),
                   0);
  flush_ok(s);
  Shardplane__V1__FlightRecord *fr = dump(s, 5, 0);
  assert_int_equal(fr->capacity, 5);
  assert_int_equal(fr->recorded, 11);
  assert_int_equal(fr->n_collectives, 4); /* seqs 7..10 */
  for (size_t i = 0; i < 4; i++)
    assert_int_equal(fr->collectives[i]->seq, 7 + i);
  assert_int_equal(fr->n_transitions, 1);
  assert_int_equal(fr->transitions[0]->state, SP_ROOT_FORWARD_BACKWARD);
  assert_int_equal(fr->transitions[0]->step, 4);
  assert_true(fr->transitions[0]->time_us >= fr->collectives[3]->time_us);
  shardplane__v1__flight_record__free_unpacked(fr, NULL);
  close_ok(s);
  /* the option's bound */
  o.flight_events = 100001;
  sp_session *bad = NULL;
  sp_diag bd = {""};
  assert_int_equal(sp_session_open(&o, &bad, &bd), SP_EINVAL);
  assert_non_null(strstr(bd.msg, "flight_events 100001"));
  stop(&fx);
}

/* An ABORT naming a culprit: the victim's reason says whose fault it is;
 * the culprit itself is told it is at fault. */
static void test_abort_names_the_culprit(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  abort_seen seen = {0};
  sp_session_opts o = opts_for(&fx, 0);
  o.on_abort = on_abort;
  o.user = &seen;
  sp_session *s = open_ok(&o);
  uint32_t who = 99;
  assert_false(sp_session_culprit(s, &who));
  Shardplane__V1__SessionDown m = SHARDPLANE__V1__SESSION_DOWN__INIT;
  m.command = SHARDPLANE__V1__COMMAND__ABORT;
  m.reason = (char *)"rank 1 stalled before unit 3's all-gather at step 2";
  m.has_culprit = true;
  m.culprit = 1;
  assert_int_equal(sp_session_test_down(s, &m), 0);
  wait_abort(&seen);
  assert_int_equal(atomic_load(&seen.calls), 1);
  assert_string_equal(seen.reason,
                      "aborted: rank 1 stalled before unit 3's "
                      "all-gather at step 2, not this rank's fault");
  assert_true(sp_session_culprit(s, &who));
  assert_int_equal(who, 1);
  close_ok(s);
  stop(&fx);
}

static void test_abort_when_the_coordinator_goes(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  abort_seen seen = {0};
  sp_session_opts o = opts_for(&fx, 0);
  o.on_abort = on_abort;
  o.user = &seen;
  o.connect_timeout_ms = 300;
  sp_session *s = open_ok(&o);
  stop(&fx);
  wait_abort(&seen);
  assert_int_equal(atomic_load(&seen.calls), 1);
  assert_non_null(strstr(seen.reason, "Session stream ended"));
  assert_true(sp_session_aborted(s, NULL, 0));
  sp_diag d = {""};
  assert_int_not_equal(sp_session_flush(s, 1000, &d), 0);
  uint64_t t0 = uv_hrtime();
  int rc = sp_session_close(s, 1000, &d);
  assert_int_not_equal(rc, 0);
  assert_non_null(strstr(d.msg, "Session stream ended"));
  assert_true((uv_hrtime() - t0) / 1000000 < 3000);
  assert_int_equal(atomic_load(&seen.calls), 1);
}

static void test_no_report(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 300);
  sp_session_opts o = opts_for(&fx, 0);
  o.no_report = true;
  sp_session *s = open_ok(&o);
  run_step(s, 5);
  sp_diag d = {""};
  assert_int_equal(sp_session_transition(s, SP_MACHINE_ROOT, 0,
                                         SP_ROOT_FORWARD_BACKWARD, &d),
                   0);
  assert_int_equal(sp_session_state(s, SP_MACHINE_ROOT, 0),
                   SP_ROOT_FORWARD_BACKWARD);
  /* still checked locally */
  assert_int_equal(sp_session_transition(s, SP_MACHINE_HANDLE, 0,
                                         SP_HANDLE_BACKWARD_POST, &d),
                   SP_ESTATE);
  flush_ok(s);
  sp_test_sleep_ms(700); /* heartbeats keep it attached */
  Shardplane__V1__ListRanksResponse *l = list_ranks(&fx);
  assert_int_equal(l->ranks[0]->status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
  assert_int_equal(l->ranks[0]->transitions, 0);
  assert_int_equal(l->ranks[0]->root_state, SP_ROOT_IDLE);
  assert_null(l->ranks[0]->last_collective);
  /* heartbeats carry the step */
  assert_int_equal(l->ranks[0]->step, 5);
  free_msg(l);
  close_ok(s);
  stop(&fx);
}

/* Reporting switched off and on between steps (bench/step measures its
 * cost that way): the coordinator sees exactly the reported steps and
 * stays in step with the rank; switching mid-step is refused. */
static void test_set_report(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "1", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  sp_session_opts o = opts_for(&fx, 0);
  sp_session *s = open_ok(&o);
  sp_diag d = {""};
  uint64_t reported = run_step(s, 1);
  assert_int_equal(sp_session_set_report(s, false, &d), 0);
  run_step(s, 2);
  assert_int_equal(sp_session_set_report(s, true, &d), 0);
  reported += run_step(s, 3);
  /* mid-step: the coordinator would fall behind the rank */
  assert_int_equal(sp_session_transition(s, SP_MACHINE_ROOT, 0,
                                         SP_ROOT_FORWARD_BACKWARD, &d),
                   0);
  assert_int_equal(sp_session_set_report(s, false, &d), SP_ESTATE);
  assert_non_null(strstr(d.msg, "between steps"));
  assert_int_equal(
      sp_session_transition(s, SP_MACHINE_ROOT, 0, SP_ROOT_IDLE, &d), 0);
  reported += 2;
  flush_ok(s);
  Shardplane__V1__ListRanksResponse *l = list_ranks(&fx);
  assert_int_equal(l->ranks[0]->transitions, reported);
  assert_int_equal(l->ranks[0]->root_state, SP_ROOT_IDLE);
  assert_int_equal(l->ranks[0]->alerts, 0);
  free_msg(l);
  close_ok(s);
  stop(&fx);
}

/* The cost of a report on the training thread: a table check and a ring
 * store. Printed; asserted only against gross regressions (sanitizers and
 * a shared machine distort it). */
static void test_per_event_cost(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  for (int nr = 0; nr < 2; nr++) {
    sp_session_opts o = opts_for(&fx, 0);
    o.no_report = nr;
    sp_session *s = open_ok(&o);
    sp_diag d;
    const int per_round = 30000; /* under half the default queue */
    uint64_t best = UINT64_MAX, sum = 0;
    const int rounds = 10;
    for (int r = 0; r < rounds; r++) {
      uint64_t t0 = uv_hrtime();
      for (int i = 0; i < per_round; i += 2) {
        sp_session_transition(s, SP_MACHINE_HANDLE, 1, SP_HANDLE_FORWARD, &d);
        sp_session_transition(s, SP_MACHINE_HANDLE, 1, SP_HANDLE_IDLE, &d);
      }
      uint64_t dt = uv_hrtime() - t0;
      sum += dt;
      if (dt < best) best = dt;
      flush_ok(s);
    }
    double ns_best = (double)best / per_round;
    double ns_mean = (double)sum / ((double)per_round * rounds);
    printf(
        "sp_session_transition%s: %.1f ns/event best round, %.1f mean; "
        "%llu dropped\n",
        nr ? " (no_report)" : "", ns_best, ns_mean,
        (unsigned long long)sp_session_dropped(s));
    assert_true(ns_best < 2000.0);
    if (!nr) {
      Shardplane__V1__ListRanksResponse *l = list_ranks(&fx);
      assert_int_equal(l->ranks[0]->transitions, (uint64_t)per_round * rounds);
      free_msg(l);
    }
    close_ok(s);
  }
  stop(&fx);
}

/* sp_session_opts.token reaches both of the session's connections: the
 * blocking calls (GetJob, Attach, the store pool) and the Session stream,
 * whose first acknowledgement sp_session_open waits for. Without it the
 * open fails naming the coordinator's refusal; with a worker token the
 * store takes comm/ keys only. */
static void test_token(void **state) {
  (void)state;
  sp_tauth a;
  sp_tauth_make(&a);
  fixture fx;
  sp_coord_fixture_start_auth(&fx, MODEL("gpt2"), NULL, 0, a.token_file, NULL);
  sp_session_opts o = opts_for(&fx, 0);
  sp_session *s = NULL;
  sp_diag d = {""};
  assert_int_equal(sp_session_open(&o, &s, &d), SP_EINVAL);
  if (strstr(d.msg, "UNAUTHENTICATED") == NULL) fail_msg("%s", d.msg);
  o.token = "not a token";
  assert_int_equal(sp_session_open(&o, &s, &d), SP_EINVAL);
  o.token = a.token[SP_ROLE_READER];
  assert_int_equal(sp_session_open(&o, &s, &d), SP_ESTATE);
  if (strstr(d.msg, "may not call Attach") == NULL) fail_msg("%s", d.msg);
  o.token = a.token[SP_ROLE_WORKER];
  s = open_ok(&o);
  assert_int_equal(sp_session_store_set(s, "comm/test/0", "x", 1, &d), 0);
  assert_int_equal(sp_session_store_set(s, "elsewhere", "x", 1, &d), SP_ESTATE);
  assert_non_null(strstr(d.msg, "under \"comm/\""));
  close_ok(s);
  stop(&fx);
  sp_tauth_free(&a);
}

int main(int argc, char **argv) {
  /* one test by name: test_session test_store */
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plan_version_check),
      cmocka_unit_test(test_wire_job_full_precision_set),
      cmocka_unit_test(test_get_model_spec),
      cmocka_unit_test(test_open_builds_the_coordinators_plan),
      cmocka_unit_test(test_open_errors),
      cmocka_unit_test(test_store),
      cmocka_unit_test(test_training_step_reported),
      cmocka_unit_test(test_illegal_transition_refused_locally),
      cmocka_unit_test(test_queue_overflow_counted),
      cmocka_unit_test(test_dropped_transition_rejected),
      cmocka_unit_test(test_heartbeat_keeps_rank_alive),
      cmocka_unit_test(test_stopped_worker_reports_its_gap),
      cmocka_unit_test(test_abort_when_a_peer_is_lost),
      cmocka_unit_test(test_abort_when_the_coordinator_goes),
      cmocka_unit_test(test_fingerprints_per_communicator),
      cmocka_unit_test(test_flight_recorder_keeps_the_last),
      cmocka_unit_test(test_abort_names_the_culprit),
      cmocka_unit_test(test_no_report),
      cmocka_unit_test(test_set_report),
      cmocka_unit_test(test_per_event_cost),
      cmocka_unit_test(test_token),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
