/* The coordinator in-process on a loop thread, driven over loopback by the
 * engine's C client: plans of the real specs, buffer dtypes by FQN, attach
 * rules, state transitions per strategy, the Session stream, lost ranks,
 * and bad input that must not hurt it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "plan/memory.h"

#include "support/coord_fixture.h"
#include "server/coordinator.h"
#include "support/testutil.h"

typedef sp_coord_fixture fixture;
#define start sp_coord_fixture_start
#define stop sp_coord_fixture_stop

#define MODEL(name) SP_EXAMPLES "/models/" name ".json"
#define PATH(m) SP_COORD_PATH(m)

#define call sp_coord_fixture_call
#define get_job sp_coord_fixture_get_job
#define free_msg sp_test_free_msg
#define expect_code sp_test_expect_status

/* ---------------- plans ---------------- */

static void test_plans_of_real_specs(void **state) {
  (void)state;
  const struct {
    const char *spec, *wrap, *world;
  } cases[] = {
      {"resnet50", "Bottleneck", "8"},
      {"mobilenet_v3_small", NULL, "3"},
      {"vit_b_16", "EncoderBlock", "16"},
      {"gpt2", "GPT2Block", "7"},
      {"llama2_7b", "LlamaDecoderLayer", "64"},
      {"llama2_70b", "LlamaDecoderLayer", "1024"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char model[512];
    snprintf(model, sizeof model, "%s/models/%s.json", SP_EXAMPLES,
             cases[i].spec);
    const char *flags[] = {"world-size",
                           cases[i].world,
                           "param-dtype",
                           "bfloat16",
                           cases[i].wrap ? "wrap-type" : NULL,
                           cases[i].wrap,
                           NULL};
    fixture fx;
    start(&fx, model, flags, 0);
    /* the coordinator's plan is the one this process computes */
    sp_model *m;
    sp_diag d;
    assert_int_equal(sp_model_load_file(model, &m, &d), 0);
    sp_job job;
    sp_job_init(&job);
    for (size_t k = 0; flags[k]; k += 2)
      sp_job_apply_flag(&job, flags[k], flags[k + 1], &d);
    sp_plan *pl;
    assert_int_equal(sp_plan_build(m, &job, &pl, &d), 0);

    Shardplane__V1__GetJobResponse *j = get_job(&fx);
    assert_string_equal(j->plan_version, pl->version_hex);
    assert_string_equal(j->model_name, cases[i].spec);
    assert_int_equal(j->n_units, pl->n_units);
    assert_int_equal(j->ranks->never_attached, pl->world_size);
    free_msg(j);

    uint64_t t0 = uv_hrtime();
    Shardplane__V1__GetPlanRequest q = SHARDPLANE__V1__GET_PLAN_REQUEST__INIT;
    sp_rpc_status st;
    Shardplane__V1__Plan *p = (Shardplane__V1__Plan *)call(
        &fx, PATH("GetPlan"), &q.base, &shardplane__v1__plan__descriptor, &st);
    expect_code(&st, SP_RPC_OK, NULL);
    assert_int_equal(p->n_units, pl->n_units);
    assert_int_equal(p->n_buffers, pl->n_buffers);
    for (size_t u = 0; u < pl->n_units; u++) {
      assert_int_equal(p->units[u]->numel, pl->units[u].numel);
      assert_int_equal(p->units[u]->shard_numel, pl->units[u].shard_numel);
      assert_int_equal(p->units[u]->n_entries, pl->units[u].n_entries);
    }
    free_msg(p);
    /* the last rank's shard, parameter by parameter */
    q.by_rank = true;
    q.rank = pl->world_size - 1;
    p = (Shardplane__V1__Plan *)call(&fx, PATH("GetPlan"), &q.base,
                                     &shardplane__v1__plan__descriptor, &st);
    expect_code(&st, SP_RPC_OK, NULL);
    assert_int_equal(p->n_shards, pl->n_units);
    for (size_t u = 0; u < pl->n_units; u++) {
      size_t n;
      sp_plan_shard_params(pl, (uint32_t)u, q.rank, NULL, 0, &n);
      assert_int_equal(p->shards[u]->n_params, n);
    }
    free_msg(p);
    uint64_t ms = (uv_hrtime() - t0) / 1000000;
    printf("%s W=%s: GetPlan whole + one rank in %llu ms\n", cases[i].spec,
           cases[i].world, (unsigned long long)ms);
    assert_true(ms < 2000);

    /* every module, page by page */
    Shardplane__V1__ListModulesRequest lm =
        SHARDPLANE__V1__LIST_MODULES_REQUEST__INIT;
    lm.page_size = 50;
    size_t seen = 0;
    char token[32] = "";
    do {
      lm.page_token = token;
      Shardplane__V1__ListModulesResponse *r =
          (Shardplane__V1__ListModulesResponse *)call(
              &fx, PATH("ListModules"), &lm.base,
              &shardplane__v1__list_modules_response__descriptor, &st);
      expect_code(&st, SP_RPC_OK, NULL);
      for (size_t k = 0; k < r->n_modules; k++)
        assert_string_equal(r->modules[k]->fqn, m->modules[seen + k].fqn);
      seen += r->n_modules;
      snprintf(token, sizeof token, "%s", r->next_page_token);
      assert_int_equal(r->total, m->n_modules);
      free_msg(r);
    } while (token[0] != '\0');
    assert_int_equal(seen, m->n_modules);

    /* where a parameter lives */
    Shardplane__V1__LocateParamRequest lp =
        SHARDPLANE__V1__LOCATE_PARAM_REQUEST__INIT;
    lp.fqn = (char *)m->params[0].fqn;
    Shardplane__V1__ParamLocation *loc = (Shardplane__V1__ParamLocation *)call(
        &fx, PATH("LocateParam"), &lp.base,
        &shardplane__v1__param_location__descriptor, &st);
    expect_code(&st, SP_RPC_OK, NULL);
    int64_t total = 0;
    for (size_t k = 0; k < loc->n_slices; k++) total += loc->slices[k]->numel;
    assert_int_equal(total, m->params[0].numel);
    free_msg(loc);

    sp_plan_free(pl);
    sp_job_clear(&job);
    sp_model_free(m);
    stop(&fx);
  }
}

static void test_tied_alias_located(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  Shardplane__V1__LocateParamRequest q =
      SHARDPLANE__V1__LOCATE_PARAM_REQUEST__INIT;
  q.fqn = "lm_head.weight";
  sp_rpc_status st;
  Shardplane__V1__ParamLocation *loc = (Shardplane__V1__ParamLocation *)call(
      &fx, PATH("LocateParam"), &q.base,
      &shardplane__v1__param_location__descriptor, &st);
  expect_code(&st, SP_RPC_OK, NULL);
  assert_true(loc->is_alias);
  assert_string_equal(loc->flattened_as, "transformer.wte.weight");
  assert_true(loc->n_slices >= 2); /* the embedding spans several ranks */
  free_msg(loc);
  q.fqn = "transformer.nope";
  assert_null(call(&fx, PATH("LocateParam"), &q.base,
                   &shardplane__v1__param_location__descriptor, &st));
  expect_code(&st, SP_RPC_NOT_FOUND, "transformer.nope");
  stop(&fx);
}

/* Same local name "stat", five dtypes: every FQN keeps its own dtype. */
static void test_buffer_dtypes_by_fqn(void **state) {
  (void)state;
  static const char *const orig[] = {"float64", "float16", "bfloat16", "int64",
                                     "bool"};
  for (int with = 0; with < 2; with++) {
    const char *flags[] = {
        "world-size", "2", "wrap-type", "Block", with ? "buffer-dtype" : NULL,
        "float16",    NULL};
    fixture fx;
    start(&fx, SP_TEST_DATA "/same_name_buffers.json", flags, 0);
    Shardplane__V1__ListBuffersRequest q =
        SHARDPLANE__V1__LIST_BUFFERS_REQUEST__INIT;
    q.prefix = "";
    sp_rpc_status st;
    Shardplane__V1__ListBuffersResponse *r =
        (Shardplane__V1__ListBuffersResponse *)call(
            &fx, PATH("ListBuffers"), &q.base,
            &shardplane__v1__list_buffers_response__descriptor, &st);
    expect_code(&st, SP_RPC_OK, NULL);
    assert_int_equal(r->n_buffers, 10);
    for (size_t i = 0; i < r->n_buffers; i++) {
      const Shardplane__V1__BufferInfo *b = r->buffers[i];
      int block = b->fqn[5] - '0';
      sp_dtype o;
      bool counter = strstr(b->fqn, "num_batches_tracked") != NULL;
      sp_dtype_parse(counter ? "int64" : orig[block], &o);
      assert_int_equal(b->original_dtype, o);
      sp_dtype want = with && sp_dtype_is_floating(o) ? SP_FLOAT16 : o;
      assert_int_equal(b->compute_dtype, want);
      assert_int_equal(b->owner_unit, block + 1);
    }
    free_msg(r);
    /* a prefix filter finds one block's buffers */
    q.prefix = "block2.";
    r = (Shardplane__V1__ListBuffersResponse *)call(
        &fx, PATH("ListBuffers"), &q.base,
        &shardplane__v1__list_buffers_response__descriptor, &st);
    assert_int_equal(r->n_buffers, 2);
    assert_int_equal(r->buffers[0]->original_dtype, SP_BFLOAT16);
    free_msg(r);
    stop(&fx);
  }
}

/* ---------------- ranks ---------------- */

static int attach(fixture *fx, uint32_t rank, uint32_t world,
                  const char *version, const char *session, char *out_session,
                  sp_rpc_status *st) {
  Shardplane__V1__AttachRequest q = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  q.rank = rank;
  q.world_size = world;
  q.host = "testhost";
  q.pid = 4242;
  q.device = "cpu";
  q.plan_version = (char *)version;
  q.session_id = (char *)(session ? session : "");
  Shardplane__V1__AttachResponse *r = (Shardplane__V1__AttachResponse *)call(
      fx, PATH("Attach"), &q.base, &shardplane__v1__attach_response__descriptor,
      st);
  if (r == NULL) return -1;
  if (out_session) snprintf(out_session, 64, "%s", r->session_id);
  free_msg(r);
  return 0;
}

static void test_attach_rules(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "GPT2Block", NULL};
  fixture fx;
  start(&fx, MODEL("gpt2"), flags, 0);
  Shardplane__V1__GetJobResponse *j = get_job(&fx);
  char version[32];
  snprintf(version, sizeof version, "%s", j->plan_version);
  free_msg(j);
  sp_rpc_status st;
  char s0[64], s0b[64];
  assert_int_equal(attach(&fx, 4, 4, version, NULL, NULL, &st), -1);
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "ranks 0-3");
  assert_int_equal(attach(&fx, 0, 8, version, NULL, NULL, &st), -1);
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "world size 8");
  assert_int_equal(attach(&fx, 0, 4, "0000000000000000", NULL, NULL, &st), -1);
  expect_code(&st, SP_RPC_FAILED_PRECONDITION, "plan version");
  assert_int_equal(attach(&fx, 0, 4, version, NULL, s0, &st), 0);
  assert_int_equal(strlen(s0), 32);
  /* a second attach of a live rank */
  assert_int_equal(attach(&fx, 0, 4, version, NULL, NULL, &st), -1);
  expect_code(&st, SP_RPC_ALREADY_EXISTS, "already attached");
  assert_int_equal(attach(&fx, 0, 4, version, "not-the-session", NULL, &st),
                   -1);
  expect_code(&st, SP_RPC_ALREADY_EXISTS, NULL);
  /* reattach with the session id keeps the session */
  assert_int_equal(attach(&fx, 0, 4, version, s0, s0b, &st), 0);
  assert_string_equal(s0, s0b);
  j = get_job(&fx);
  assert_int_equal(j->ranks->attached, 1);
  assert_int_equal(j->ranks->never_attached, 3);
  free_msg(j);
  /* detach, then a fresh attach gets a new session */
  Shardplane__V1__DetachRequest dq = SHARDPLANE__V1__DETACH_REQUEST__INIT;
  dq.rank = 0;
  dq.session_id = "wrong";
  assert_null(call(&fx, PATH("Detach"), &dq.base,
                   &shardplane__v1__detach_response__descriptor, &st));
  expect_code(&st, SP_RPC_PERMISSION_DENIED, NULL);
  dq.session_id = s0;
  free_msg(call(&fx, PATH("Detach"), &dq.base,
                &shardplane__v1__detach_response__descriptor, &st));
  expect_code(&st, SP_RPC_OK, NULL);
  assert_int_equal(attach(&fx, 0, 4, version, NULL, s0b, &st), 0);
  assert_string_not_equal(s0, s0b);
  stop(&fx);
}

static int report(fixture *fx, uint32_t rank, const char *session, int machine,
                  uint32_t unit, int to, sp_rpc_status *st) {
  Shardplane__V1__Transition t = SHARDPLANE__V1__TRANSITION__INIT;
  t.machine = (Shardplane__V1__Machine)machine;
  t.unit = unit;
  t.state = to;
  t.step = 1;
  Shardplane__V1__ReportTransitionRequest q =
      SHARDPLANE__V1__REPORT_TRANSITION_REQUEST__INIT;
  q.rank = rank;
  q.session_id = (char *)session;
  q.transition = &t;
  free_msg(call(fx, PATH("ReportTransition"), &q.base,
                &shardplane__v1__report_transition_response__descriptor, st));
  return st->code;
}

enum {
  ROOT = SHARDPLANE__V1__MACHINE__MACHINE_ROOT,
  HANDLE = SHARDPLANE__V1__MACHINE__MACHINE_HANDLE
};

/* One training step as FSDP1 runs it: root forward, units forward in
 * order, backward in reverse, final callback. */
static void normal_step(fixture *fx, uint32_t rank, const char *session,
                        uint32_t n_units) {
  sp_rpc_status st;
  assert_int_equal(
      report(fx, rank, session, ROOT, 0, SP_ROOT_FORWARD_BACKWARD, &st), 0);
  for (uint32_t u = 0; u < n_units; u++) {
    assert_int_equal(
        report(fx, rank, session, HANDLE, u, SP_HANDLE_FORWARD, &st), 0);
    assert_int_equal(report(fx, rank, session, HANDLE, u, SP_HANDLE_IDLE, &st),
                     0);
  }
  for (uint32_t u = n_units; u-- > 0;) {
    assert_int_equal(
        report(fx, rank, session, HANDLE, u, SP_HANDLE_BACKWARD_PRE, &st), 0);
    assert_int_equal(
        report(fx, rank, session, HANDLE, u, SP_HANDLE_BACKWARD_POST, &st), 0);
    assert_int_equal(report(fx, rank, session, HANDLE, u, SP_HANDLE_IDLE, &st),
                     0);
  }
  assert_int_equal(report(fx, rank, session, ROOT, 0, SP_ROOT_IDLE, &st), 0);
}

static void test_transitions_per_strategy(void **state) {
  (void)state;
  const char *strategies[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                              "HYBRID_SHARD"};
  for (int s = 0; s < 4; s++) {
    const char *flags[] = {
        "world-size", "4",           "wrap-type",        "Block",
        "strategy",   strategies[s], "shard-group-size", "2",
        NULL};
    fixture fx;
    start(&fx, SP_TEST_DATA "/same_name_buffers.json", flags, 0);
    Shardplane__V1__GetJobResponse *j = get_job(&fx);
    uint32_t n_units = j->n_units;
    char version[32], sess[64];
    snprintf(version, sizeof version, "%s", j->plan_version);
    free_msg(j);
    sp_rpc_status st;
    assert_int_equal(attach(&fx, 1, 4, version, NULL, sess, &st), 0);
    normal_step(&fx, 1, sess, n_units);
    normal_step(&fx, 1, sess, n_units);
    /* illegal: a post-backward without a pre-backward */
    assert_int_equal(
        report(&fx, 1, sess, HANDLE, 2, SP_HANDLE_BACKWARD_POST, &st),
        SP_RPC_FAILED_PRECONDITION);
    assert_non_null(strstr(st.message, "IDLE -> BACKWARD_POST"));
    assert_non_null(strstr(st.message, "legal from IDLE"));
    /* summon during forward/backward is refused too */
    report(&fx, 1, sess, ROOT, 0, SP_ROOT_FORWARD_BACKWARD, &st);
    assert_int_equal(
        report(&fx, 1, sess, ROOT, 0, SP_ROOT_SUMMON_FULL_PARAMS, &st),
        SP_RPC_FAILED_PRECONDITION);
    /* bad values */
    assert_int_equal(report(&fx, 1, sess, HANDLE, 99, SP_HANDLE_IDLE, &st),
                     SP_RPC_INVALID_ARGUMENT);
    assert_int_equal(report(&fx, 1, sess, HANDLE, 0, 42, &st),
                     SP_RPC_INVALID_ARGUMENT);
    assert_int_equal(report(&fx, 9, sess, ROOT, 0, SP_ROOT_IDLE, &st),
                     SP_RPC_INVALID_ARGUMENT);
    assert_int_equal(report(&fx, 2, sess, ROOT, 0, SP_ROOT_IDLE, &st),
                     SP_RPC_FAILED_PRECONDITION); /* not attached */
    /* alerts were recorded on the rank */
    j = get_job(&fx);
    assert_int_equal(j->alerts, 2);
    assert_int_equal(j->n_recent_alerts, 2);
    assert_int_equal(j->recent_alerts[0]->rank, 1);
    free_msg(j);
    Shardplane__V1__ListRanksRequest lq =
        SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
    lq.with_unit_states = true;
    Shardplane__V1__ListRanksResponse *lr =
        (Shardplane__V1__ListRanksResponse *)call(
            &fx, PATH("ListRanks"), &lq.base,
            &shardplane__v1__list_ranks_response__descriptor, &st);
    expect_code(&st, SP_RPC_OK, NULL);
    const Shardplane__V1__RankInfo *r1 = lr->ranks[1];
    assert_int_equal(r1->status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
    assert_int_equal(r1->alerts, 2);
    assert_int_equal(r1->transitions, 2 * (2 + 5 * n_units) + 1);
    assert_int_equal(r1->root_state, SP_ROOT_FORWARD_BACKWARD);
    assert_int_equal(r1->n_unit_states, n_units);
    assert_int_equal(lr->ranks[0]->status,
                     SHARDPLANE__V1__RANK_STATUS__NEVER_ATTACHED);
    free_msg(lr);
    stop(&fx);
  }
}

/* ---------------- Session stream and lost ranks ---------------- */

static Shardplane__V1__Event *next_event(sp_rpc_sync_stream *w,
                                         uint64_t wait_ms) {
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  int rc = sp_rpc_sync_stream_recv(w, &shardplane__v1__event__descriptor,
                                   wait_ms, &m, &st);
  if (rc != 0) fail_msg("no event: %s (%s)", sp_strerror(rc), st.message);
  return (Shardplane__V1__Event *)m;
}

/* One training step of transitions (2 + 5 units) into tv/tp. */
static size_t step_transitions(Shardplane__V1__Transition *tv,
                               Shardplane__V1__Transition **tp,
                               uint32_t n_units, uint64_t step) {
  size_t k = 0;
#define AG_T(m, u, to)                            \
  do {                                            \
    shardplane__v1__transition__init(&tv[k]);     \
    tv[k].machine = (Shardplane__V1__Machine)(m); \
    tv[k].unit = (u);                             \
    tv[k].state = (to);                           \
    tv[k].step = step;                            \
    tp[k] = &tv[k];                               \
    k++;                                          \
  } while (0)
  AG_T(ROOT, 0, SP_ROOT_FORWARD_BACKWARD);
  for (uint32_t u = 0; u < n_units; u++) {
    AG_T(HANDLE, u, SP_HANDLE_FORWARD);
    AG_T(HANDLE, u, SP_HANDLE_IDLE);
  }
  for (uint32_t u = n_units; u-- > 0;) {
    AG_T(HANDLE, u, SP_HANDLE_BACKWARD_PRE);
    AG_T(HANDLE, u, SP_HANDLE_BACKWARD_POST);
    AG_T(HANDLE, u, SP_HANDLE_IDLE);
  }
  AG_T(ROOT, 0, SP_ROOT_IDLE);
#undef AG_T
  return k;
}

static void test_session_stream_and_loss(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "Block", NULL};
  fixture fx;
  start(&fx, SP_TEST_DATA "/same_name_buffers.json", flags, 600);
  Shardplane__V1__GetJobResponse *j = get_job(&fx);
  char version[32], s0[64], s1[64];
  snprintf(version, sizeof version, "%s", j->plan_version);
  uint32_t n_units = j->n_units;
  free_msg(j);
  /* a watcher sees attach, lost and alert events */
  sp_rpc_sync *wcli;
  assert_int_equal(sp_rpc_sync_open(fx.addr, 2000, &wcli), 0);
  sp_rpc_sync_stream *w;
  assert_int_equal(sp_rpc_sync_stream_open(wcli, PATH("Watch"), 0, NULL, 0, &w),
                   0);
  Shardplane__V1__WatchRequest wq = SHARDPLANE__V1__WATCH_REQUEST__INIT;
  sp_rpc_sync_stream_send(w, &wq.base);
  sp_rpc_sync_stream_close_send(w);
  /* run the watcher's loop once so its request reaches the coordinator
   * before the events happen */
  ProtobufCMessage *none;
  sp_rpc_status wst;
  assert_int_equal(sp_rpc_sync_stream_recv(w, NULL, 100, &none, &wst),
                   SP_ETIMEDOUT);

  sp_rpc_status st;
  assert_int_equal(attach(&fx, 0, 2, version, NULL, s0, &st), 0);
  assert_int_equal(attach(&fx, 1, 2, version, NULL, s1, &st), 0);
  Shardplane__V1__Event *ev = next_event(w, 2000);
  if (ev->kind != SHARDPLANE__V1__EVENT_KIND__RANK_ATTACHED)
    fail_msg("event %d rank %u: %s", ev->kind, ev->rank, ev->message);
  assert_int_equal(ev->rank, 0);
  free_msg(ev);
  ev = next_event(w, 2000);
  assert_int_equal(ev->rank, 1);
  free_msg(ev);

  /* rank 0 streams a whole step in one batch, then an illegal one */
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(fx.cli, PATH("Session"), 0, NULL, 0, &s), 0);
  size_t n = 2 + 5 * n_units;
  Shardplane__V1__Transition *tv = calloc(n + 1, sizeof *tv);
  Shardplane__V1__Transition **tp = calloc(n + 1, sizeof *tp);
  size_t k = step_transitions(tv, tp, n_units, 7);
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.rank = 0;
  up.session_id = s0;
  up.seq = 1;
  up.step = 7;
  up.n_transitions = k;
  up.transitions = tp;
  assert_int_equal(sp_rpc_sync_stream_send(s, &up.base), 0);
  ProtobufCMessage *m;
  assert_int_equal(
      sp_rpc_sync_stream_recv(s, &shardplane__v1__session_down__descriptor,
                              2000, &m, &st),
      0);
  Shardplane__V1__SessionDown *down = (Shardplane__V1__SessionDown *)m;
  assert_int_equal(down->acked_seq, 1);
  assert_int_equal(down->n_rejections, 0);
  free_msg(down);
  shardplane__v1__transition__init(&tv[0]);
  tv[0].machine = SHARDPLANE__V1__MACHINE__MACHINE_HANDLE;
  tv[0].unit = 0;
  tv[0].state = SP_HANDLE_BACKWARD_POST;
  tv[0].step = 7;
  up.seq = 2;
  up.n_transitions = 1;
  up.session_id = ""; /* later messages need not repeat it */
  assert_int_equal(sp_rpc_sync_stream_send(s, &up.base), 0);
  assert_int_equal(
      sp_rpc_sync_stream_recv(s, &shardplane__v1__session_down__descriptor,
                              2000, &m, &st),
      0);
  down = (Shardplane__V1__SessionDown *)m;
  assert_int_equal(down->acked_seq, 2);
  assert_int_equal(down->n_rejections, 1);
  assert_non_null(strstr(down->rejections[0]->reason, "BACKWARD_POST"));
  free_msg(down);
  ev = next_event(w, 2000);
  assert_int_equal(ev->kind, SHARDPLANE__V1__EVENT_KIND__ALERT);
  free_msg(ev);
  free(tv);
  free(tp);

  /* rank 1 never heartbeats while rank 0 keeps its session alive: rank 1
   * is lost after the timeout, and rank 0 is told to abort its
   * collectives */
  bool lost1 = false, saw_abort = false, saw_lost_alert = false;
  uint64_t t0 = uv_hrtime(), seq = 3;
  up.n_transitions = 0;
  while ((!lost1 || !saw_abort || !saw_lost_alert) &&
         uv_hrtime() - t0 < 3000000000ull) {
    up.seq = seq++;
    assert_int_equal(sp_rpc_sync_stream_send(s, &up.base), 0);
    while (sp_rpc_sync_stream_recv(s, &shardplane__v1__session_down__descriptor,
                                   50, &m, &st) == 0) {
      down = (Shardplane__V1__SessionDown *)m;
      if (down->command == SHARDPLANE__V1__COMMAND__ABORT) {
        saw_abort = true;
        assert_non_null(strstr(down->reason, "rank 1"));
        assert_true(down->has_culprit);
        assert_int_equal(down->culprit, 1);
      }
      free_msg(down);
    }
    if (sp_rpc_sync_stream_recv(w, &shardplane__v1__event__descriptor, 50, &m,
                                &st) == 0) {
      ev = (Shardplane__V1__Event *)m;
      if (ev->kind == SHARDPLANE__V1__EVENT_KIND__ALERT) {
        /* the first loss is the culprit's: a LOST alert naming rank 0 as
         * its victim */
        assert_non_null(ev->alert);
        assert_int_equal(ev->alert->kind,
                         SHARDPLANE__V1__ALERT_KIND__ALERT_LOST);
        assert_int_equal(ev->alert->n_culprits, 1);
        assert_int_equal(ev->alert->culprits[0], 1);
        assert_int_equal(ev->alert->n_victims, 1);
        assert_int_equal(ev->alert->victims[0], 0);
        saw_lost_alert = true;
        free_msg(ev);
        continue;
      }
      if (ev->kind != SHARDPLANE__V1__EVENT_KIND__RANK_LOST || ev->rank != 1)
        fail_msg("event %d rank %u: %s (after %llu ms)", ev->kind, ev->rank,
                 ev->message,
                 (unsigned long long)((uv_hrtime() - t0) / 1000000));
      assert_non_null(strstr(ev->message, "no heartbeat"));
      lost1 = true;
      free_msg(ev);
    }
  }
  assert_true(lost1);
  assert_true(saw_abort);
  assert_true(saw_lost_alert);

  /* closing rank 0's stream marks it lost as well */
  sp_rpc_sync_stream_close_send(s);
  while (sp_rpc_sync_stream_recv(s, NULL, 2000, &m, &st) == 0) free(m);
  sp_rpc_sync_stream_close(s);
  ev = next_event(w, 2000);
  assert_int_equal(ev->kind, SHARDPLANE__V1__EVENT_KIND__RANK_LOST);
  assert_int_equal(ev->rank, 0);
  free_msg(ev);
  j = get_job(&fx);
  assert_int_equal(j->ranks->lost, 2);
  /* rank 0 is rank 1's victim, not a second culprit: one alert, and the
   * job failed with rank 1's verdict */
  assert_int_equal(j->alerts, 2); /* the illegal transition and rank 1 */
  assert_int_equal(j->state, SHARDPLANE__V1__JOB_STATE__JOB_FAILED);
  assert_non_null(strstr(j->verdict, "rank 1 was lost"));
  free_msg(j);
  sp_rpc_sync_stream_close(w);
  sp_rpc_sync_close(wcli);
  stop(&fx);
}

/* ---------------- agents: many ranks on one connection ---------------- */

#define AG_WORLD 64u
#define AG_PER 8u
#define AG_N (AG_WORLD / AG_PER)

static void get_conns(sp_coord *c, void *arg) {
  sp_rpc_server_stats st;
  sp_rpc_server_get_stats(c->srv, &st);
  *(uint64_t *)arg = st.connections_open;
}

static void get_waiters(sp_coord *c, void *arg) {
  sp_kvstore_stats st;
  sp_kvstore_get_stats(c->store, &st);
  *(size_t *)arg = st.waiters;
}

/* 64 ranks on 8 connections, as 8 hosts' agents carry them: each
 * connection has its 8 ranks' store waits and Session streams open at
 * once; every rank attaches, is released from one rendezvous, reports a
 * step, is listed (in pages) with its own state and detaches. */
static void test_agents_share_connections(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "64", "wrap-type", "Block", NULL};
  fixture fx;
  start(&fx, SP_TEST_DATA "/same_name_buffers.json", flags, 60000);
  Shardplane__V1__GetJobResponse *j = get_job(&fx);
  char version[32];
  snprintf(version, sizeof version, "%s", j->plan_version);
  uint32_t n_units = j->n_units;
  free_msg(j);
  sp_rpc_sync *ag[AG_N];
  for (uint32_t a = 0; a < AG_N; a++)
    assert_int_equal(sp_rpc_sync_open(fx.addr, 2000, &ag[a]), 0);
  static char sid[AG_WORLD][64];
  sp_rpc_status st;
  ProtobufCMessage *m;

  /* attach, and the rendezvous: every rank adds, then waits for "go" */
  int64_t last = -1;
  for (uint32_t r = 0; r < AG_WORLD; r++) {
    Shardplane__V1__AttachRequest q = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
    q.rank = r;
    q.world_size = AG_WORLD;
    q.host = "agenthost";
    q.pid = 1000 + r;
    q.device = "cpu";
    q.plan_version = version;
    Shardplane__V1__AttachResponse *ar =
        (Shardplane__V1__AttachResponse *)sp_test_unary(
            ag[r / AG_PER], PATH("Attach"), &q.base,
            &shardplane__v1__attach_response__descriptor, 5000, &st);
    if (ar == NULL) fail_msg("rank %u: Attach: %s", r, st.message);
    snprintf(sid[r], sizeof sid[r], "%s", ar->session_id);
    free_msg(ar);
    Shardplane__V1__StoreAddRequest aq =
        SHARDPLANE__V1__STORE_ADD_REQUEST__INIT;
    aq.key = "rdzv";
    aq.delta = 1;
    Shardplane__V1__StoreAddResponse *sr =
        (Shardplane__V1__StoreAddResponse *)sp_test_unary(
            ag[r / AG_PER], PATH("StoreAdd"), &aq.base,
            &shardplane__v1__store_add_response__descriptor, 5000, &st);
    assert_non_null(sr);
    assert_int_equal(sr->value, (int64_t)r + 1);
    if (sr->value == AG_WORLD) last = r;
    free_msg(sr);
  }
  assert_int_equal(last, AG_WORLD - 1);
  sp_rpc_sync_stream *wait[AG_WORLD];
  Shardplane__V1__StoreGetRequest gq = SHARDPLANE__V1__STORE_GET_REQUEST__INIT;
  gq.key = "go";
  gq.wait = true;
  for (uint32_t r = 0; r < AG_WORLD; r++) {
    assert_int_equal(sp_rpc_sync_stream_open(ag[r / AG_PER], PATH("StoreGet"),
                                             10000, NULL, 0, &wait[r]),
                     0);
    assert_int_equal(sp_rpc_sync_stream_send(wait[r], &gq.base), 0);
    assert_int_equal(sp_rpc_sync_stream_close_send(wait[r]), 0);
  }
  /* each agent's loop writes its 8 waits out; then all 64 wait at once */
  size_t waiters = 0;
  for (int i = 0; i < 200 && waiters < AG_WORLD; i++) {
    for (uint32_t a = 0; a < AG_N; a++)
      assert_int_equal(
          sp_rpc_sync_stream_recv(wait[a * AG_PER], NULL, 5, &m, &st),
          SP_ETIMEDOUT);
    sp_coord_fixture_run(&fx, get_waiters, &waiters);
  }
  assert_int_equal(waiters, AG_WORLD);
  uint64_t conns = 0;
  sp_coord_fixture_run(&fx, get_conns, &conns);
  assert_int_equal(conns, AG_N + 1); /* and the fixture's own client */
  Shardplane__V1__StoreSetRequest setq =
      SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  setq.key = "go";
  setq.value.data = (uint8_t *)"1";
  setq.value.len = 1;
  free_msg(sp_test_unary(ag[last / AG_PER], PATH("StoreSet"), &setq.base,
                         &shardplane__v1__store_set_response__descriptor, 5000,
                         &st));
  assert_int_equal(st.code, SP_RPC_OK);
  for (uint32_t r = 0; r < AG_WORLD; r++) {
    assert_int_equal(
        sp_rpc_sync_stream_recv(wait[r],
                                &shardplane__v1__store_get_response__descriptor,
                                5000, &m, &st),
        0);
    Shardplane__V1__StoreGetResponse *g = (Shardplane__V1__StoreGetResponse *)m;
    assert_true(g->found);
    assert_int_equal(g->value.len, 1);
    free_msg(g);
    sp_rpc_sync_stream_close(wait[r]);
  }

  /* every rank's Session stream on its agent's connection, a step each */
  size_t per_step = 2 + 5 * (size_t)n_units;
  Shardplane__V1__Transition *tv = calloc(per_step, sizeof *tv);
  Shardplane__V1__Transition **tp = calloc(per_step, sizeof *tp);
  assert_non_null(tv);
  assert_non_null(tp);
  sp_rpc_sync_stream *sess[AG_WORLD];
  for (uint32_t r = 0; r < AG_WORLD; r++) {
    assert_int_equal(sp_rpc_sync_stream_open(ag[r / AG_PER], PATH("Session"), 0,
                                             NULL, 0, &sess[r]),
                     0);
    Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
    up.rank = r;
    up.session_id = sid[r];
    up.seq = 1;
    /* rank r is at step r + 1: each rank's own state is checked below */
    up.step = r + 1;
    up.n_transitions = step_transitions(tv, tp, n_units, r + 1);
    up.transitions = tp;
    assert_int_equal(sp_rpc_sync_stream_send(sess[r], &up.base), 0);
  }
  for (uint32_t r = 0; r < AG_WORLD; r++) {
    assert_int_equal(
        sp_rpc_sync_stream_recv(
            sess[r], &shardplane__v1__session_down__descriptor, 5000, &m, &st),
        0);
    Shardplane__V1__SessionDown *d = (Shardplane__V1__SessionDown *)m;
    assert_int_equal(d->acked_seq, 1);
    assert_int_equal(d->n_rejections, 0);
    free_msg(d);
  }
  free(tv);
  free(tp);

  /* ListRanks in pages of 24: 0-23, 24-47, 48-63, then none */
  for (uint32_t first = 0; first <= AG_WORLD; first += 24) {
    Shardplane__V1__ListRanksRequest lq =
        SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
    lq.with_unit_states = true;
    lq.first_rank = first;
    lq.max_ranks = 24;
    Shardplane__V1__ListRanksResponse *l =
        (Shardplane__V1__ListRanksResponse *)call(
            &fx, PATH("ListRanks"), &lq.base,
            &shardplane__v1__list_ranks_response__descriptor, &st);
    assert_non_null(l);
    size_t want = first >= AG_WORLD       ? 0
                  : AG_WORLD - first < 24 ? AG_WORLD - first
                                          : 24;
    assert_int_equal(l->n_ranks, want);
    for (size_t i = 0; i < l->n_ranks; i++) {
      const Shardplane__V1__RankInfo *k = l->ranks[i];
      assert_int_equal(k->rank, first + i);
      assert_int_equal(k->status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
      assert_int_equal(k->pid, 1000 + k->rank);
      assert_int_equal(k->transitions, per_step);
      assert_int_equal(k->step, k->rank + 1);
      assert_int_equal(k->root_state, SP_ROOT_IDLE);
      assert_int_equal(k->alerts, 0);
      assert_int_equal(k->n_unit_states, n_units);
      for (size_t u = 0; u < k->n_unit_states; u++)
        assert_int_equal(k->unit_states[u], SP_HANDLE_IDLE);
    }
    free_msg(l);
  }
  j = get_job(&fx);
  assert_int_equal(j->ranks->attached, AG_WORLD);
  assert_int_equal(j->state, SHARDPLANE__V1__JOB_STATE__JOB_RUNNING);
  free_msg(j);

  /* detach: each rank's stream ends OK, and the job is complete */
  for (uint32_t r = 0; r < AG_WORLD; r++) {
    Shardplane__V1__DetachRequest dq = SHARDPLANE__V1__DETACH_REQUEST__INIT;
    dq.rank = r;
    dq.session_id = sid[r];
    free_msg(sp_test_unary(ag[r / AG_PER], PATH("Detach"), &dq.base,
                           &shardplane__v1__detach_response__descriptor, 5000,
                           &st));
    assert_int_equal(st.code, SP_RPC_OK);
  }
  for (uint32_t r = 0; r < AG_WORLD; r++) {
    assert_int_equal(sp_rpc_sync_stream_recv(sess[r], NULL, 5000, &m, &st),
                     SP_ENOENT);
    assert_int_equal(st.code, SP_RPC_OK);
    sp_rpc_sync_stream_close(sess[r]);
  }
  j = get_job(&fx);
  assert_int_equal(j->ranks->detached, AG_WORLD);
  assert_int_equal(j->state, SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED);
  free_msg(j);
  for (uint32_t a = 0; a < AG_N; a++) sp_rpc_sync_close(ag[a]);
  stop(&fx);
}

/* ---------------- bad input ---------------- */

static void test_bad_input_is_harmless(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "8", NULL};
  fixture fx;
  start(&fx, MODEL("resnet50"), flags, 0);
  sp_rpc_status st;
  /* bytes that are not a protobuf message: INVALID_ARGUMENT, nothing else */
  sp_rpc_sync_stream *s;
  assert_int_equal(
      sp_rpc_sync_stream_open(fx.cli, PATH("GetPlan"), 2000, NULL, 0, &s), 0);
  const uint8_t junk[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f};
  assert_int_equal(sp_rpc_sync_stream_send_raw(s, junk, sizeof junk), 0);
  sp_rpc_sync_stream_close_send(s);
  ProtobufCMessage *m;
  assert_int_equal(sp_rpc_sync_stream_recv(s, NULL, 2000, &m, &st), SP_ENOENT);
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "GetPlanRequest");
  sp_rpc_sync_stream_close(s);
  Shardplane__V1__GetPlanRequest q = SHARDPLANE__V1__GET_PLAN_REQUEST__INIT;
  /* out-of-range rank and unit */
  q.by_rank = true;
  q.rank = 8;
  assert_null(call(&fx, PATH("GetPlan"), &q.base,
                   &shardplane__v1__plan__descriptor, &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "ranks 0-7");
  q.by_rank = false;
  q.by_unit = true;
  q.unit = 100000;
  assert_null(call(&fx, PATH("GetPlan"), &q.base,
                   &shardplane__v1__plan__descriptor, &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, NULL);
  q.unit_fqn = "layer9";
  assert_null(call(&fx, PATH("GetPlan"), &q.base,
                   &shardplane__v1__plan__descriptor, &st));
  expect_code(&st, SP_RPC_NOT_FOUND, "layer9");
  /* memory model options out of range: the field and the value */
  Shardplane__V1__GetPlanRequest mq = SHARDPLANE__V1__GET_PLAN_REQUEST__INIT;
  Shardplane__V1__MemoryOptions mo = SHARDPLANE__V1__MEMORY_OPTIONS__INIT;
  mq.with_memory = true;
  mq.memory = &mo;
  mo.optimizer = (Shardplane__V1__Optimizer)7;
  assert_null(call(&fx, PATH("GetPlan"), &mq.base,
                   &shardplane__v1__plan__descriptor, &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "memory.optimizer 7");
  mo.optimizer = SHARDPLANE__V1__OPTIMIZER__OPTIMIZER_ADAMW;
  mo.max_inflight_gathers = 1u << 20;
  assert_null(call(&fx, PATH("GetPlan"), &mq.base,
                   &shardplane__v1__plan__descriptor, &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT,
              "memory.max_inflight_gathers 1048576");
  /* and in range: the estimate, AdamW's moments included */
  mo.max_inflight_gathers = 0;
  Shardplane__V1__Plan *mp = (Shardplane__V1__Plan *)call(
      &fx, PATH("GetPlan"), &mq.base, &shardplane__v1__plan__descriptor, &st);
  assert_non_null(mp);
  assert_non_null(mp->memory);
  assert_int_equal(mp->memory->n_categories, SP_MEM_N_CATS);
  assert_string_equal(mp->memory->categories[SP_MEM_OPTIMIZER]->category,
                      "optimizer");
  assert_true(mp->memory->categories[SP_MEM_OPTIMIZER]->peak > 0);
  assert_int_equal(mp->memory->options->max_inflight_gathers, 2);
  free_msg(mp);
  Shardplane__V1__ListBuffersRequest lb =
      SHARDPLANE__V1__LIST_BUFFERS_REQUEST__INIT;
  lb.page_token = "x7";
  assert_null(call(&fx, PATH("ListBuffers"), &lb.base,
                   &shardplane__v1__list_buffers_response__descriptor, &st));
  expect_code(&st, SP_RPC_INVALID_ARGUMENT, "page_token");
  /* the coordinator still answers */
  Shardplane__V1__GetJobResponse *j = get_job(&fx);
  assert_int_equal(j->job->world_size, 8);
  free_msg(j);
  stop(&fx);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plans_of_real_specs),
      cmocka_unit_test(test_tied_alias_located),
      cmocka_unit_test(test_buffer_dtypes_by_fqn),
      cmocka_unit_test(test_attach_rules),
      cmocka_unit_test(test_transitions_per_strategy),
      cmocka_unit_test(test_session_stream_and_loss),
      cmocka_unit_test(test_agents_share_connections),
      cmocka_unit_test(test_bad_input_is_harmless),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
