/* Hang diagnosis against synthetic ranks: each fake rank is a Session
 * stream of its own driven with SessionUp messages, so the test chooses
 * every fingerprint, timestamp and silence. Desync (the verdict string,
 * the sides, the time from the mismatching fingerprint to the alert, on
 * the world and on a HYBRID_SHARD shard group), stall (a rank that has not
 * issued the collective its peers wait in; a collective nobody completes),
 * victims and the culprit in every ABORT, stragglers with the step
 * percentiles, the job's state and progress, Attach refused after the job
 * ended, GetTrace and GetDump with a fake worker answering FLIGHT_DUMP, and
 * a dump written when the coordinator shuts down mid-gather. */
#include <jansson.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "plan/state.h"
#include "server/coordinator.h"
#include "support/coord_fixture.h"
#include "support/fake_rank.h"
#include "support/testutil.h"

#define PATH(m) SP_COORD_PATH(m)
#define MODEL SP_TEST_DATA "/same_name_buffers.json"
#define WORLD 4
/* ASan and a loaded 2-CPU machine: the bounds below are the issue's,
 * plus this much for the machine (printed with every figure). */
#define SLACK_MS 400

static uint64_t now_ms(void) { return uv_hrtime() / 1000000u; }

typedef struct job {
  sp_coord_fixture fx;
  char version[SP_FAKE_VERSION_MAX];
  uint32_t n_units;
  sp_fake_rank f[WORLD];
  sp_rpc_sync *wcli;
  sp_rpc_sync_stream *w;
} job;

static void get_forgiven(sp_coord *c, void *arg) {
  *(uint64_t *)arg = sp_coord_diag_forgiven_ms(c);
}

/* The stall bound: the threshold + 1 s, plus the coordinator's own pauses
 * since `before` (forgiven every rank, so the verdict comes that much
 * later) and the machine's slack. */
static uint64_t stall_bound(job *j, uint32_t thr, uint64_t before) {
  uint64_t now;
  sp_coord_fixture_run(&j->fx, get_forgiven, &now);
  uint64_t b = thr + 1000u + (now - before) + SLACK_MS;
  printf("  (coordinator paused %llu ms meanwhile; bound %llu ms)\n",
         (unsigned long long)(now - before), (unsigned long long)b);
  return b;
}

static void set_stall(sp_coord *c, void *arg) {
  c->cfg.diag.stall_timeout_ms = *(uint32_t *)arg;
}

static char g_unit1[128];
static void unit1_name(sp_coord *c, void *arg) {
  (void)arg;
  snprintf(g_unit1, sizeof g_unit1, "%s", sp_plan_unit_fqn(c->plan, 1));
}

static void heartbeat(sp_fake_rank *f) {
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  sp_fake_rank_send_up(f, &up);
}

static void transition(sp_fake_rank *f, int machine, uint32_t unit, int state,
                       uint64_t step, uint64_t t_us) {
  sp_fake_rank_transition(f, machine, unit, state, step, t_us, NULL);
}

static void collective(sp_fake_rank *f, int comm, uint32_t index, uint64_t seq,
                       int op, uint32_t unit, uint64_t count, bool done,
                       uint64_t step) {
  Shardplane__V1__Collective k = SHARDPLANE__V1__COLLECTIVE__INIT;
  k.comm = (Shardplane__V1__CommKind)comm;
  k.comm_index = index;
  k.seq = seq;
  k.op = (Shardplane__V1__CollectiveOp)op;
  k.unit = unit;
  k.dtype = SHARDPLANE__V1__DTYPE__BFLOAT16;
  k.count = count;
  k.completed = done;
  k.step = step;
  Shardplane__V1__Collective *kp = &k;
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.step = step;
  up.n_collectives = 1;
  up.collectives = &kp;
  sp_fake_rank_send_up(f, &up);
}

/* An all-reduce of the step (issued and completed at time_us, the
 * training thread having waited waited_us for it). */
static void waited(sp_fake_rank *f, uint64_t seq, uint64_t step,
                   uint64_t time_us, uint64_t waited_us) {
  Shardplane__V1__Collective k[2];
  Shardplane__V1__Collective *kp[2] = {&k[0], &k[1]};
  for (int i = 0; i < 2; i++) {
    shardplane__v1__collective__init(&k[i]);
    k[i].comm = SHARDPLANE__V1__COMM_KIND__COMM_WORLD;
    k[i].seq = seq;
    k[i].op = SHARDPLANE__V1__COLLECTIVE_OP__ALL_REDUCE;
    k[i].dtype = SHARDPLANE__V1__DTYPE__FLOAT32;
    k[i].count = 1;
    k[i].completed = i == 1;
    k[i].step = step;
    k[i].time_us = time_us;
  }
  k[1].waited_us = waited_us;
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.step = step;
  up.n_collectives = 2;
  up.collectives = kp;
  sp_fake_rank_send_up(f, &up);
}

#define AG SHARDPLANE__V1__COLLECTIVE_OP__ALL_GATHER
#define RS SHARDPLANE__V1__COLLECTIVE_OP__REDUCE_SCATTER
#define WORLD_C SHARDPLANE__V1__COMM_KIND__COMM_WORLD
#define ROOT SHARDPLANE__V1__MACHINE__MACHINE_ROOT
#define HANDLE SHARDPLANE__V1__MACHINE__MACHINE_HANDLE

static void job_start(job *j, const char *const *flags, uint32_t stall_ms) {
  Shardplane__V1__GetJobResponse *g;
  sp_fake_job_start(&j->fx, MODEL, flags, j->version, sizeof j->version, &g);
  j->n_units = g->n_units;
  assert_int_equal(g->state, SHARDPLANE__V1__JOB_STATE__JOB_WAITING);
  sp_test_free_msg(g);
  assert_true(j->n_units >= 2);
  sp_coord_fixture_run(&j->fx, set_stall, &stall_ms);
  sp_coord_fixture_run(&j->fx, unit1_name, NULL);
  /* a watcher for the alerts */
  assert_int_equal(sp_rpc_sync_open(j->fx.addr, 2000, &j->wcli), 0);
  assert_int_equal(
      sp_rpc_sync_stream_open(j->wcli, PATH("Watch"), 0, NULL, 0, &j->w), 0);
  Shardplane__V1__WatchRequest wq = SHARDPLANE__V1__WATCH_REQUEST__INIT;
  wq.kinds = (Shardplane__V1__EventKind[]){SHARDPLANE__V1__EVENT_KIND__ALERT};
  wq.n_kinds = 1;
  sp_rpc_sync_stream_send(j->w, &wq.base);
  sp_rpc_sync_stream_close_send(j->w);
  ProtobufCMessage *none;
  sp_rpc_status st;
  sp_rpc_sync_stream_recv(j->w, NULL, 100, &none, &st);
  for (uint32_t r = 0; r < WORLD; r++)
    sp_fake_rank_attach(&j->f[r], &j->fx, j->version, r, WORLD, "testhost");
  for (uint32_t r = 0; r < WORLD; r++) heartbeat(&j->f[r]);
}

/* The fake ranks and the watcher, closed (before or after the
 * coordinator stops). */
static void job_close_clients(job *j) {
  for (uint32_t r = 0; r < WORLD; r++) sp_fake_rank_close(&j->f[r]);
  sp_rpc_sync_stream_close(j->w);
  sp_rpc_sync_close(j->wcli);
}

static void job_stop(job *j) {
  job_close_clients(j);
  sp_coord_fixture_stop(&j->fx);
}

/* The next ALERT event within wait_ms, every rank heartbeating meanwhile
 * (a stall is a silence with heartbeats); NULL when none came. */
static Shardplane__V1__Event *next_alert(job *j, uint64_t wait_ms) {
  uint64_t t0 = now_ms();
  while (now_ms() - t0 < wait_ms) {
    ProtobufCMessage *m;
    sp_rpc_status st;
    if (sp_rpc_sync_stream_recv(j->w, &shardplane__v1__event__descriptor, 100,
                                &m, &st) == 0) {
      Shardplane__V1__Event *ev = (Shardplane__V1__Event *)m;
      if (ev->kind == SHARDPLANE__V1__EVENT_KIND__ALERT) return ev;
      sp_test_free_msg(ev);
    }
    for (uint32_t r = 0; r < WORLD; r++)
      if (j->f[r].s) heartbeat(&j->f[r]);
  }
  return NULL;
}

static Shardplane__V1__Verdict *get_verdict(job *j) {
  Shardplane__V1__GetVerdictRequest q =
      SHARDPLANE__V1__GET_VERDICT_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__Verdict *v = (Shardplane__V1__Verdict *)sp_coord_fixture_call(
      &j->fx, PATH("GetVerdict"), &q.base, &shardplane__v1__verdict__descriptor,
      &st);
  if (v == NULL) fail_msg("GetVerdict: %s", st.message);
  return v;
}

static void expect_ranks(const uint32_t *v, size_t n, const uint32_t *want,
                         size_t nw) {
  assert_int_equal(n, nw);
  for (size_t i = 0; i < n; i++) assert_int_equal(v[i], want[i]);
}

/* ---------------- desync ---------------- */

static void test_desync_world(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  job_start(&j, flags, 60000);
  for (uint32_t r = 0; r < WORLD; r++)
    transition(&j.f[r], ROOT, 0, SP_ROOT_FORWARD_BACKWARD, 1, 0);
  for (uint32_t r = 0; r < 3; r++) {
    transition(&j.f[r], HANDLE, 1, SP_HANDLE_FORWARD, 1, 0);
    collective(&j.f[r], WORLD_C, 0, 1, AG, 1, 100, false, 1);
  }
  /* no alert while the fingerprints agree */
  Shardplane__V1__Event *ev = next_alert(&j, 300);
  assert_null(ev);
  transition(&j.f[3], HANDLE, 1, SP_HANDLE_FORWARD, 1, 0);
  transition(&j.f[3], HANDLE, 1, SP_HANDLE_IDLE, 1, 0);
  transition(&j.f[3], HANDLE, 1, SP_HANDLE_BACKWARD_PRE, 1, 0);
  uint64_t t0 = now_ms();
  collective(&j.f[3], WORLD_C, 0, 1, RS, 1, 100, false, 1);
  ev = next_alert(&j, 1000 + SLACK_MS);
  uint64_t dt = now_ms() - t0;
  assert_non_null(ev);
  printf("desync: fingerprint to alert %llu ms (bound 1000 + %d)\n",
         (unsigned long long)dt, SLACK_MS);
  assert_true(dt <= 1000 + SLACK_MS);
  assert_non_null(ev->alert);
  assert_int_equal(ev->alert->kind, SHARDPLANE__V1__ALERT_KIND__DESYNC);
  char want[1024];
  snprintf(want, sizeof want,
           "desync on world at collective #1: ranks 0-2 issued ALL_GATHER of "
           "unit 1 (%s), bfloat16 x 100 (last event: FORWARD of unit 1, step "
           "1); rank 3 issued REDUCE_SCATTER of unit 1 (%s), bfloat16 x 100 "
           "(last event: BACKWARD_PRE of unit 1, step 1)",
           g_unit1, g_unit1);
  assert_string_equal(ev->alert->message, want);
  expect_ranks(ev->alert->culprits, ev->alert->n_culprits, (uint32_t[]){3}, 1);
  expect_ranks(ev->alert->victims, ev->alert->n_victims, (uint32_t[]){0, 1, 2},
               3);
  assert_non_null(ev->alert->collective);
  assert_int_equal(ev->alert->collective->seq, 1);
  assert_int_equal(ev->alert->collective->op, RS);
  sp_test_free_msg(ev);
  Shardplane__V1__Verdict *v = get_verdict(&j);
  assert_false(v->healthy);
  assert_string_equal(v->headline, want);
  assert_int_equal(v->n_open_alerts, 1);
  sp_test_free_msg(v);
  job_stop(&j);
}

static void test_desync_shard_group(void **state) {
  (void)state;
  const char *flags[] = {
      "world-size",       "4", "wrap-type", "Block", "strategy", "HYBRID_SHARD",
      "shard-group-size", "2", NULL};
  job j;
  job_start(&j, flags, 60000);
  int shard = SHARDPLANE__V1__COMM_KIND__COMM_SHARD;
  /* shard group 0 (ranks 0, 1) agrees; in group 1 rank 3 sends another
   * count; the same seq on different groups is no desync */
  collective(&j.f[0], shard, 0, 7, AG, 1, 64, false, 1);
  collective(&j.f[1], shard, 0, 7, AG, 1, 64, false, 1);
  collective(&j.f[2], shard, 1, 7, AG, 1, 32, false, 1);
  assert_null(next_alert(&j, 300));
  uint64_t t0 = now_ms();
  collective(&j.f[3], shard, 1, 7, AG, 1, 48, false, 1);
  Shardplane__V1__Event *ev = next_alert(&j, 1000 + SLACK_MS);
  assert_non_null(ev);
  printf("desync (shard group): fingerprint to alert %llu ms\n",
         (unsigned long long)(now_ms() - t0));
  assert_int_equal(ev->alert->kind, SHARDPLANE__V1__ALERT_KIND__DESYNC);
  assert_non_null(strstr(ev->alert->message,
                         "desync on shard group 1 at collective #7: rank 2 "
                         "issued ALL_GATHER"));
  assert_non_null(strstr(ev->alert->message, "bfloat16 x 48"));
  /* a tie: the later side is named */
  expect_ranks(ev->alert->culprits, ev->alert->n_culprits, (uint32_t[]){3}, 1);
  expect_ranks(ev->alert->victims, ev->alert->n_victims, (uint32_t[]){2}, 1);
  assert_int_equal(ev->alert->collective->comm, shard);
  assert_int_equal(ev->alert->collective->comm_index, 1);
  sp_test_free_msg(ev);
  job_stop(&j);
}

/* ---------------- stall, victims, job end ---------------- */

static void test_stall_names_the_rank_and_its_victims(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  uint32_t thr = 1500;
  job_start(&j, flags, thr);
  Shardplane__V1__GetJobResponse *g = sp_coord_fixture_get_job(&j.fx);
  assert_int_equal(g->state, SHARDPLANE__V1__JOB_STATE__JOB_RUNNING);
  sp_test_free_msg(g);
  uint64_t p0;
  sp_coord_fixture_run(&j.fx, get_forgiven, &p0);
  for (uint32_t r = 0; r < WORLD; r++) {
    transition(&j.f[r], ROOT, 0, SP_ROOT_FORWARD_BACKWARD, 4, 0);
    transition(&j.f[r], HANDLE, 0, SP_HANDLE_FORWARD, 4, 0);
  }
  /* rank 2's last event: the clock runs from here */
  uint64_t t0 = now_ms();
  for (uint32_t r = 0; r < WORLD; r++)
    if (r != 2) collective(&j.f[r], WORLD_C, 0, 5, AG, 1, 100, false, 4);
  /* the wait itself is generous; the bound is checked after */
  Shardplane__V1__Event *ev = next_alert(&j, thr + 10000);
  uint64_t dt = now_ms() - t0;
  assert_non_null(ev);
  printf("stall: last event to verdict %llu ms (threshold %u)\n",
         (unsigned long long)dt, thr);
  assert_true(dt >= thr);
  assert_true(dt <= stall_bound(&j, thr, p0));
  assert_int_equal(ev->alert->kind, SHARDPLANE__V1__ALERT_KIND__STALL);
  char head[512], tail[256];
  snprintf(head, sizeof head,
           "rank 2 has not issued ALL_GATHER #5 of unit 1 (%s) on world; "
           "ranks 0, 1, 3 have been waiting in it for ",
           g_unit1);
  snprintf(tail, sizeof tail,
           " s; rank 2's last event: FORWARD of unit 0, "
           "step 4");
  const char *msg = ev->alert->message;
  assert_memory_equal(msg, head, strlen(head));
  assert_string_equal(msg + strlen(msg) - strlen(tail), tail);
  expect_ranks(ev->alert->culprits, ev->alert->n_culprits, (uint32_t[]){2}, 1);
  expect_ranks(ev->alert->victims, ev->alert->n_victims, (uint32_t[]){0, 1, 3},
               3);
  assert_int_equal(ev->alert->collective->seq, 5);
  sp_test_free_msg(ev);

  /* rank 0 fails because of it: a victim of rank 2, and the others' ABORT
   * names rank 2 */
  sp_rpc_sync_stream_close_send(j.f[0].s);
  sp_rpc_sync_stream_close(j.f[0].s);
  j.f[0].s = NULL;
  bool all = false;
  for (uint64_t t1 = now_ms(); !all && now_ms() - t1 < 3000;) {
    all = true;
    for (uint32_t r = 1; r < WORLD; r++) {
      sp_fake_rank_drain(&j.f[r], 50);
      all &= j.f[r].aborted;
    }
  }
  assert_true(all);
  for (uint32_t r = 1; r < WORLD; r++) {
    assert_true(j.f[r].has_culprit);
    assert_int_equal(j.f[r].culprit, 2);
    assert_non_null(strstr(j.f[r].reason, "rank 2 has not issued"));
  }
  Shardplane__V1__ListRanksRequest lq =
      SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__ListRanksResponse *lr =
      (Shardplane__V1__ListRanksResponse *)sp_coord_fixture_call(
          &j.fx, PATH("ListRanks"), &lq.base,
          &shardplane__v1__list_ranks_response__descriptor, &st);
  assert_non_null(lr);
  assert_int_equal(lr->ranks[0]->status, SHARDPLANE__V1__RANK_STATUS__LOST);
  assert_true(lr->ranks[0]->victim);
  assert_int_equal(lr->ranks[0]->victim_of, 2);
  assert_false(lr->ranks[2]->victim);
  assert_int_equal(lr->ranks[2]->alerts, 1);
  sp_test_free_msg(lr);
  /* no LOST alert for a victim */
  assert_null(next_alert(&j, 300));
  g = sp_coord_fixture_get_job(&j.fx);
  assert_int_equal(g->state, SHARDPLANE__V1__JOB_STATE__JOB_FAILED);
  assert_non_null(strstr(g->verdict, "rank 2 has not issued"));
  assert_int_equal(g->recent_alerts[g->n_recent_alerts - 1]->kind,
                   SHARDPLANE__V1__ALERT_KIND__STALL);
  sp_test_free_msg(g);
  /* the job ended: no new rank attaches */
  Shardplane__V1__AttachRequest q = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  q.rank = 0;
  q.world_size = WORLD;
  q.host = "testhost";
  q.plan_version = j.version;
  void *a =
      sp_coord_fixture_call(&j.fx, PATH("Attach"), &q.base,
                            &shardplane__v1__attach_response__descriptor, &st);
  assert_null(a);
  sp_test_expect_status(&st, SP_RPC_FAILED_PRECONDITION,
                        "the job ended (FAILED at step 4: rank 2 has not");
  assert_non_null(strstr(st.message, "start a new coordinator"));
  job_stop(&j);
}

static void test_stall_in_the_network(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  uint32_t thr = 1200;
  job_start(&j, flags, thr);
  uint64_t p0;
  sp_coord_fixture_run(&j.fx, get_forgiven, &p0);
  for (uint32_t r = 0; r < WORLD; r++)
    collective(&j.f[r], WORLD_C, 0, 3, AG, 1, 100, false, 2);
  uint64_t t0 = now_ms();
  Shardplane__V1__Event *ev = next_alert(&j, thr + 10000);
  assert_non_null(ev);
  uint64_t dt = now_ms() - t0;
  printf("stall (network): last event to verdict %llu ms (threshold %u)\n",
         (unsigned long long)dt, thr);
  assert_true(dt <= stall_bound(&j, thr, p0));
  assert_int_equal(ev->alert->kind, SHARDPLANE__V1__ALERT_KIND__STALL);
  char head[512];
  snprintf(head, sizeof head,
           "every member of world (ranks 0-3) issued ALL_GATHER of unit 1 "
           "(%s), bfloat16 x 100, collective #3, and none has completed it "
           "for ",
           g_unit1);
  assert_memory_equal(ev->alert->message, head, strlen(head));
  assert_non_null(strstr(ev->alert->message,
                         "the network or the collective library, not a rank"));
  assert_int_equal(ev->alert->n_culprits, 0);
  assert_int_equal(ev->alert->n_victims, 4);
  sp_test_free_msg(ev);
  /* it completes: the stall closes and the verdict is healthy again */
  for (uint32_t r = 0; r < WORLD; r++)
    collective(&j.f[r], WORLD_C, 0, 3, AG, 1, 100, true, 2);
  Shardplane__V1__Verdict *v = NULL;
  for (uint64_t t1 = now_ms(); now_ms() - t1 < 2000;) {
    for (uint32_t r = 0; r < WORLD; r++)
      transition(&j.f[r], ROOT, 0, SP_ROOT_FORWARD_BACKWARD, 2, 0);
    for (uint32_t r = 0; r < WORLD; r++)
      transition(&j.f[r], ROOT, 0, SP_ROOT_IDLE, 2, 0);
    sp_test_free_msg(v);
    v = get_verdict(&j);
    if (v->healthy) break;
  }
  assert_true(v->healthy);
  assert_memory_equal(v->headline, "healthy: all 4 ranks at step 2, ", 32);
  sp_test_free_msg(v);
  job_stop(&j);
}

/* Ranks started with different step counts: the one that finished first
 * detached, and the others wait for it in the next step's first
 * collective. */
static void test_stall_after_a_rank_left(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  uint32_t thr = 1200;
  job_start(&j, flags, thr);
  for (uint32_t r = 0; r < WORLD; r++) {
    transition(&j.f[r], ROOT, 0, SP_ROOT_FORWARD_BACKWARD, 10, 0);
    collective(&j.f[r], WORLD_C, 0, 1, AG, 1, 100, false, 10);
    collective(&j.f[r], WORLD_C, 0, 1, AG, 1, 100, true, 10);
    transition(&j.f[r], ROOT, 0, SP_ROOT_IDLE, 10, 0);
  }
  Shardplane__V1__DetachRequest q = SHARDPLANE__V1__DETACH_REQUEST__INIT;
  q.rank = 2;
  q.session_id = j.f[2].session;
  sp_rpc_status st;
  void *m =
      sp_coord_fixture_call(&j.fx, PATH("Detach"), &q.base,
                            &shardplane__v1__detach_response__descriptor, &st);
  assert_non_null(m);
  sp_test_free_msg(m);
  sp_rpc_sync_stream_close(j.f[2].s);
  j.f[2].s = NULL;
  uint64_t p0;
  sp_coord_fixture_run(&j.fx, get_forgiven, &p0);
  for (uint32_t r = 0; r < WORLD; r++)
    if (r != 2) collective(&j.f[r], WORLD_C, 0, 2, AG, 1, 100, false, 11);
  uint64_t t0 = now_ms();
  Shardplane__V1__Event *ev = next_alert(&j, thr + 10000);
  assert_non_null(ev);
  uint64_t dt = now_ms() - t0;
  printf("stall (a rank left): last event to verdict %llu ms\n",
         (unsigned long long)dt);
  assert_true(dt <= stall_bound(&j, thr, p0));
  assert_int_equal(ev->alert->kind, SHARDPLANE__V1__ALERT_KIND__STALL);
  char head[512];
  snprintf(head, sizeof head,
           "rank 2 has not issued ALL_GATHER #2 of unit 1 (%s) on world; "
           "ranks 0, 1, 3 have been waiting in it for ",
           g_unit1);
  assert_memory_equal(ev->alert->message, head, strlen(head));
  const char *tail = "rank 2's last event: IDLE, step 10 (then it detached)";
  const char *msg = ev->alert->message;
  assert_string_equal(msg + strlen(msg) - strlen(tail), tail);
  expect_ranks(ev->alert->culprits, ev->alert->n_culprits, (uint32_t[]){2}, 1);
  sp_test_free_msg(ev);
  job_stop(&j);
}

/* ---------------- stragglers ---------------- */

/* One step of every rank on synthetic clocks: every step takes 100 ms on
 * every rank (the collectives make them wait for each other); a rank
 * computes busy_us of it (the slow rank slow_us), and waits the rest:
 * the step's one collective reports the wait (waited_us) that fills it */
static void sync_step(job *j, int s, uint32_t slow, uint64_t slow_us) {
  uint64_t t = 1700000000000000ull + (uint64_t)s * 100000u;
  for (uint32_t r = 0; r < WORLD; r++) {
    uint64_t busy = r == slow ? slow_us : 40000u;
    sp_fake_rank *f = &j->f[r];
    transition(f, ROOT, 0, SP_ROOT_FORWARD_BACKWARD, (uint64_t)s, t);
    transition(f, HANDLE, 1, SP_HANDLE_FORWARD, (uint64_t)s, t + 1000);
    transition(f, HANDLE, 1, SP_HANDLE_IDLE, (uint64_t)s, t + 1000 + busy / 2);
    transition(f, HANDLE, 1, SP_HANDLE_BACKWARD_PRE, (uint64_t)s, t + 50000);
    transition(f, HANDLE, 1, SP_HANDLE_BACKWARD_POST, (uint64_t)s,
               t + 50000 + busy / 2);
    transition(f, HANDLE, 1, SP_HANDLE_IDLE, (uint64_t)s, t + 99000);
    waited(f, (uint64_t)s, (uint64_t)s, t + 99500, 100000u - busy);
    /* no optimizer time between steps: compute is the units' alone */
    transition(f, ROOT, 0, SP_ROOT_IDLE, (uint64_t)s, t + 100000);
  }
}

static void test_straggler_within_20_steps(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  job_start(&j, flags, 60000);
  /* rank 1 computes 1.5x as long as the others */
  int flagged_at = -1;
  for (int s = 1; s <= 22 && flagged_at < 0; s++) {
    sync_step(&j, s, 1, 60000u);
    Shardplane__V1__Event *ev = next_alert(&j, SP_DIAG_TICK_MS + 50);
    if (ev != NULL) {
      assert_int_equal(ev->alert->kind, SHARDPLANE__V1__ALERT_KIND__STRAGGLER);
      expect_ranks(ev->alert->culprits, ev->alert->n_culprits, (uint32_t[]){1},
                   1);
      assert_memory_equal(ev->alert->message,
                          "rank 1 is a straggler: its own time (the step less "
                          "its waits on peers) is 1.50x the job's median, "
                          "60.0 ms a step against 40.0 ms",
                          128);
      flagged_at = s;
      sp_test_free_msg(ev);
    }
  }
  printf("straggler (1.5x): flagged after step %d (bound 20)\n", flagged_at);
  assert_true(flagged_at > 0 && flagged_at <= 20);
  Shardplane__V1__ListRanksRequest lq =
      SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__ListRanksResponse *lr =
      (Shardplane__V1__ListRanksResponse *)sp_coord_fixture_call(
          &j.fx, PATH("ListRanks"), &lq.base,
          &shardplane__v1__list_ranks_response__descriptor, &st);
  assert_non_null(lr);
  for (uint32_t r = 0; r < WORLD; r++) {
    assert_true(lr->ranks[r]->step_p50_ms > 99.9 &&
                lr->ranks[r]->step_p50_ms < 100.1);
    assert_true(lr->ranks[r]->step_p99_ms > 99.9 &&
                lr->ranks[r]->step_p99_ms < 100.1);
    double want = r == 1 ? 1.5 : 1.0;
    assert_true(lr->ranks[r]->straggler_score > want - 0.01 &&
                lr->ranks[r]->straggler_score < want + 0.01);
  }
  sp_test_free_msg(lr);
  /* the others are not flagged */
  assert_null(next_alert(&j, 300));
  job_stop(&j);
}

/* Steps far shorter than the detector's tick: ranks are judged as their
 * steps close, not on the tick, so the steps a straggler must stay over
 * the bar are steps. Judged on the tick alone, 20 steps coming within one
 * tick were judged once, and the rank went unflagged until the next. */
static void test_straggler_between_ticks(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  job_start(&j, flags, 60000);
  /* nine even steps, and a tick to take the job's median from */
  for (int s = 1; s <= 9; s++) sync_step(&j, s, 1, 40000u);
  assert_null(next_alert(&j, SP_DIAG_TICK_MS + 50));
  /* rank 1 turns 1.5x slow at step 10; steps 10..30 come at once */
  for (int s = 10; s <= 30; s++) sync_step(&j, s, 1, 60000u);
  Shardplane__V1__Event *ev = next_alert(&j, 2 * SP_DIAG_TICK_MS + 50);
  assert_non_null(ev);
  assert_int_equal(ev->alert->kind, SHARDPLANE__V1__ALERT_KIND__STRAGGLER);
  expect_ranks(ev->alert->culprits, ev->alert->n_culprits, (uint32_t[]){1}, 1);
  sp_test_free_msg(ev);
  /* it was flagged by step 30, 20 steps after it turned slow, without a
   * step since: were it judged on the tick, the first tick after the
   * burst would only begin its stretch over the bar */
  assert_null(next_alert(&j, 300));
  job_stop(&j);
}

/* As a real worker sends them: n steps (first..first+n-1) of every rank
 * in one message each, the transitions first and the collectives after,
 * so a step closes before the message's completions say what of it was
 * waiting. Timings as sync_step's. */
static void batched_steps(job *j, int first, int n, uint32_t slow,
                          uint64_t slow_us) {
  enum { MAX_STEPS = 4, T_PER_STEP = 7 };
  assert_true(n <= MAX_STEPS);
  for (uint32_t r = 0; r < WORLD; r++) {
    Shardplane__V1__Transition t[MAX_STEPS * T_PER_STEP];
    Shardplane__V1__Transition *tp[MAX_STEPS * T_PER_STEP];
    Shardplane__V1__Collective k[MAX_STEPS * 2];
    Shardplane__V1__Collective *kp[MAX_STEPS * 2];
    size_t nt = 0, nk = 0;
    uint64_t busy = r == slow ? slow_us : 40000u;
    for (int s = first; s < first + n; s++) {
      uint64_t t0 = 1700000000000000ull + (uint64_t)s * 100000u;
      const struct {
        int machine, state;
        uint64_t at;
      } ev[T_PER_STEP] = {
          {ROOT, SP_ROOT_FORWARD_BACKWARD, t0},
          {HANDLE, SP_HANDLE_FORWARD, t0 + 1000},
          {HANDLE, SP_HANDLE_IDLE, t0 + 1000 + busy / 2},
          {HANDLE, SP_HANDLE_BACKWARD_PRE, t0 + 50000},
          {HANDLE, SP_HANDLE_BACKWARD_POST, t0 + 50000 + busy / 2},
          {HANDLE, SP_HANDLE_IDLE, t0 + 99000},
          {ROOT, SP_ROOT_IDLE, t0 + 100000},
      };
      for (int e = 0; e < T_PER_STEP; e++, nt++) {
        shardplane__v1__transition__init(&t[nt]);
        t[nt].machine = (Shardplane__V1__Machine)ev[e].machine;
        t[nt].unit = ev[e].machine == HANDLE ? 1 : 0;
        t[nt].state = ev[e].state;
        t[nt].step = (uint64_t)s;
        t[nt].time_us = ev[e].at;
        tp[nt] = &t[nt];
      }
      for (int i = 0; i < 2; i++, nk++) {
        shardplane__v1__collective__init(&k[nk]);
        k[nk].comm = SHARDPLANE__V1__COMM_KIND__COMM_WORLD;
        k[nk].seq = (uint64_t)s;
        k[nk].op = SHARDPLANE__V1__COLLECTIVE_OP__ALL_REDUCE;
        k[nk].dtype = SHARDPLANE__V1__DTYPE__FLOAT32;
        k[nk].count = 1;
        k[nk].completed = i == 1;
        k[nk].step = (uint64_t)s;
        k[nk].time_us = t0 + 99500;
        k[nk].waited_us = i == 1 ? 100000u - busy : 0;
        kp[nk] = &k[nk];
      }
    }
    Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
    up.step = (uint64_t)(first + n - 1);
    up.n_transitions = nt;
    up.transitions = tp;
    up.n_collectives = nk;
    up.collectives = kp;
    sp_fake_rank_send_up(&j->f[r], &up);
  }
}

static void expect_scores(job *j, const double *want, const char *when) {
  Shardplane__V1__ListRanksRequest lq =
      SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__ListRanksResponse *lr =
      (Shardplane__V1__ListRanksResponse *)sp_coord_fixture_call(
          &j->fx, PATH("ListRanks"), &lq.base,
          &shardplane__v1__list_ranks_response__descriptor, &st);
  assert_non_null(lr);
  for (uint32_t r = 0; r < WORLD; r++) {
    double got = lr->ranks[r]->straggler_score;
    printf("%s: rank %u scores %.3f (want %.2f)\n", when, r, got, want[r]);
    if (got < want[r] - 0.01 || got > want[r] + 0.01)
      fail_msg("%s: rank %u scores %.3f, want %.2f", when, r, got, want[r]);
  }
  sp_test_free_msg(lr);
}

/* The score of a rank as fast as the others is 1.00, also when a
 * message brings several steps at once (as workers batch them): the
 * waits the message carries after its transitions are taken off the
 * steps they ended in before the rank is judged. Judged at the step's
 * close, equal ranks scored 1.43 here (2.1 to 2.8 in a real job); with
 * the waits of 3 steps taken all off the last one, a 1.5x slow rank
 * scored 1.14. */
static void test_straggler_score_of_batched_steps(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  job_start(&j, flags, 60000);
  for (int s = 1; s <= 24; s += 4) batched_steps(&j, s, 4, 1, 40000u);
  /* a tick takes the job's median */
  sp_test_sleep_ms(2 * SP_DIAG_TICK_MS);
  batched_steps(&j, 25, 4, 1, 40000u);
  expect_scores(&j, (const double[]){1, 1, 1, 1}, "equal ranks");
  /* rank 1 turns 1.5x slow: a window of its slow steps */
  for (int s = 29; s <= 48; s += 4) batched_steps(&j, s, 4, 1, 60000u);
  sp_test_sleep_ms(2 * SP_DIAG_TICK_MS);
  expect_scores(&j, (const double[]){1, 1.5, 1, 1}, "rank 1 1.5x slow");
  job_stop(&j);
}

/* ---------------- job state and progress ---------------- */

static void test_job_completes_and_refuses_attach(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  job_start(&j, flags, 60000);
  for (uint64_t s = 1; s <= 20; s++) {
    for (uint32_t r = 0; r < WORLD; r++) {
      Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
      up.step = s;
      up.total_steps = 20;
      up.has_loss = r == 0;
      up.loss = 3.0 - 0.05 * (double)s;
      sp_fake_rank_send_up(&j.f[r], &up);
    }
    if (s == 10) {
      uv_sleep(700); /* a rate to measure */
      Shardplane__V1__Verdict *v = get_verdict(&j);
      assert_true(v->healthy);
      assert_int_equal(v->state, SHARDPLANE__V1__JOB_STATE__JOB_RUNNING);
      assert_int_equal(v->progress->step, 10);
      assert_int_equal(v->progress->total_steps, 20);
      assert_true(v->progress->has_loss);
      assert_true(v->progress->loss > 2.49 && v->progress->loss < 2.51);
      assert_memory_equal(v->headline, "healthy: all 4 ranks at step 10, ", 33);
      assert_non_null(strstr(v->headline, "loss 2.5"));
      sp_test_free_msg(v);
    }
  }
  for (uint32_t r = 0; r < WORLD; r++) {
    Shardplane__V1__DetachRequest q = SHARDPLANE__V1__DETACH_REQUEST__INIT;
    q.rank = r;
    q.session_id = j.f[r].session;
    sp_rpc_status st;
    void *m = sp_coord_fixture_call(
        &j.fx, PATH("Detach"), &q.base,
        &shardplane__v1__detach_response__descriptor, &st);
    assert_non_null(m);
    sp_test_free_msg(m);
    Shardplane__V1__GetJobResponse *g = sp_coord_fixture_get_job(&j.fx);
    assert_int_equal(g->state, r + 1 < WORLD
                                   ? SHARDPLANE__V1__JOB_STATE__JOB_RUNNING
                                   : SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED);
    sp_test_free_msg(g);
  }
  Shardplane__V1__GetJobResponse *g = sp_coord_fixture_get_job(&j.fx);
  assert_int_equal(g->progress->step, 20);
  assert_true(g->progress->eta_s == 0);
  sp_test_free_msg(g);
  Shardplane__V1__AttachRequest q = SHARDPLANE__V1__ATTACH_REQUEST__INIT;
  q.rank = 1;
  q.world_size = WORLD;
  q.host = "testhost";
  q.plan_version = j.version;
  sp_rpc_status st;
  void *a =
      sp_coord_fixture_call(&j.fx, PATH("Attach"), &q.base,
                            &shardplane__v1__attach_response__descriptor, &st);
  assert_null(a);
  sp_test_expect_status(&st, SP_RPC_FAILED_PRECONDITION, NULL);
  assert_string_equal(st.message,
                      "the job ended (COMPLETED at step 20); "
                      "start a new coordinator");
  Shardplane__V1__Verdict *v = get_verdict(&j);
  assert_string_equal(v->headline,
                      "completed: all 4 ranks finished at step 20");
  sp_test_free_msg(v);
  job_stop(&j);
}

/* ---------------- GetTrace and GetDump ---------------- */

typedef struct answerer {
  sp_fake_rank *f;
  volatile bool stop;
  int answered;
} answerer;

/* A worker's recorder: two events, answered on its own thread while the
 * test's thread waits in GetTrace. */
static void answer_loop(void *arg) {
  answerer *a = arg;
  while (!a->stop) {
    a->f->dump_asked = false;
    sp_fake_rank_drain(a->f, 50);
    if (!a->f->dump_asked) continue;
    Shardplane__V1__Transition t = SHARDPLANE__V1__TRANSITION__INIT;
    t.machine = HANDLE;
    t.unit = 1;
    t.state = SP_HANDLE_FORWARD;
    t.step = 9;
    t.time_us = 100;
    Shardplane__V1__Transition *tp = &t;
    Shardplane__V1__Collective k = SHARDPLANE__V1__COLLECTIVE__INIT;
    k.seq = 41;
    k.op = AG;
    k.unit = 1;
    k.dtype = SHARDPLANE__V1__DTYPE__BFLOAT16;
    k.count = 100;
    k.time_us = 200;
    k.step = 9;
    Shardplane__V1__Collective *kp = &k;
    Shardplane__V1__FlightRecord fr = SHARDPLANE__V1__FLIGHT_RECORD__INIT;
    fr.rank = 99; /* the coordinator trusts the stream, not this */
    fr.request_id = a->f->dump_id;
    fr.n_transitions = 1;
    fr.transitions = &tp;
    fr.n_collectives = 1;
    fr.collectives = &kp;
    fr.recorded = 2;
    fr.capacity = 1024;
    fr.time_us = 300;
    Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
    up.flight = &fr;
    sp_fake_rank_send_up(a->f, &up);
    a->answered++;
  }
}

static void test_trace_and_dump(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  job_start(&j, flags, 60000);
  answerer an = {.f = &j.f[1]};
  uv_thread_t th;
  assert_int_equal(uv_thread_create(&th, answer_loop, &an), 0);

  Shardplane__V1__GetTraceRequest tq = SHARDPLANE__V1__GET_TRACE_REQUEST__INIT;
  tq.rank = 1;
  tq.last_n = 50;
  sp_rpc_status st;
  Shardplane__V1__FlightRecord *fr =
      (Shardplane__V1__FlightRecord *)sp_coord_fixture_call(
          &j.fx, PATH("GetTrace"), &tq.base,
          &shardplane__v1__flight_record__descriptor, &st);
  if (fr == NULL) fail_msg("GetTrace: %s", st.message);
  assert_int_equal(fr->rank, 1);
  assert_int_equal(fr->n_transitions, 1);
  assert_int_equal(fr->n_collectives, 1);
  assert_int_equal(fr->collectives[0]->seq, 41);
  assert_int_equal(fr->capacity, 1024);
  assert_int_equal(j.f[1].dump_last_n, 50);
  sp_test_free_msg(fr);

  /* rank 2 is attached but does not answer: DEADLINE_EXCEEDED */
  tq.rank = 2;
  void *m = sp_test_unary(j.fx.cli, PATH("GetTrace"), &tq.base,
                          &shardplane__v1__flight_record__descriptor,
                          SP_DIAG_TRACE_WAIT_MS + 3000, &st);
  assert_null(m);
  sp_test_expect_status(&st, SP_RPC_DEADLINE_EXCEEDED,
                        "rank 2 did not answer FLIGHT_DUMP within 3000 ms");

  /* the dump: rank 1's recorder, the others' errors, the coordinator's
   * view (rank 3's stream is gone first: no open session) */
  sp_rpc_sync_stream_close(j.f[3].s);
  j.f[3].s = NULL;
  uv_sleep(200);
  Shardplane__V1__GetDumpRequest dq = SHARDPLANE__V1__GET_DUMP_REQUEST__INIT;
  Shardplane__V1__GetDumpResponse *dr =
      (Shardplane__V1__GetDumpResponse *)sp_test_unary(
          j.fx.cli, PATH("GetDump"), &dq.base,
          &shardplane__v1__get_dump_response__descriptor,
          SP_DIAG_TRACE_WAIT_MS + 3000, &st);
  if (dr == NULL) fail_msg("GetDump: %s", st.message);
  json_error_t je;
  json_t *doc = json_loadb((const char *)dr->json.data, dr->json.len, 0, &je);
  if (doc == NULL) fail_msg("dump is not JSON: %s", je.text);
  assert_string_equal(json_string_value(json_object_get(doc, "format")),
                      "shardplane.dump/v1");
  assert_true(json_integer_value(json_object_get(doc, "taken_unix_ms")) > 0);
  json_t *jb = json_object_get(doc, "job");
  assert_string_equal(json_string_value(json_object_get(jb, "strategy")),
                      "FULL_SHARD");
  assert_string_equal(json_string_value(json_object_get(jb, "state")),
                      "FAILED"); /* rank 3 was lost */
  assert_int_equal(json_integer_value(json_object_get(jb, "world_size")), 4);
  json_t *alerts = json_object_get(doc, "alerts");
  json_t *last = json_array_get(alerts, json_array_size(alerts) - 1);
  assert_string_equal(json_string_value(json_object_get(last, "kind")), "LOST");
  assert_int_equal(
      json_integer_value(json_array_get(json_object_get(last, "culprits"), 0)),
      3);
  json_t *ranks = json_object_get(doc, "ranks");
  assert_int_equal(json_array_size(ranks), 4);
  json_t *r1 = json_array_get(ranks, 1);
  assert_string_equal(json_string_value(json_object_get(r1, "status")),
                      "ATTACHED");
  assert_int_equal(json_integer_value(json_object_get(r1, "pid")), 1001);
  json_t *ev = json_object_get(json_object_get(r1, "flight"), "events");
  assert_int_equal(json_array_size(ev), 2);
  json_t *e0 = json_array_get(ev, 0), *e1 = json_array_get(ev, 1);
  assert_string_equal(json_string_value(json_object_get(e0, "type")),
                      "transition");
  assert_string_equal(json_string_value(json_object_get(e0, "state")),
                      "FORWARD");
  assert_string_equal(json_string_value(json_object_get(e1, "type")),
                      "collective");
  assert_string_equal(json_string_value(json_object_get(e1, "op")),
                      "ALL_GATHER");
  assert_string_equal(json_string_value(json_object_get(e1, "dtype")),
                      "bfloat16");
  assert_string_equal(json_string_value(json_object_get(e1, "comm")), "world");
  json_t *r2 = json_array_get(ranks, 2), *r3 = json_array_get(ranks, 3);
  assert_true(json_is_null(json_object_get(r2, "flight")));
  assert_non_null(strstr(json_string_value(json_object_get(r2, "flight_error")),
                         "did not answer"));
  assert_true(json_is_null(json_object_get(r3, "flight")));
  assert_non_null(strstr(json_string_value(json_object_get(r3, "flight_error")),
                         "no open session stream (LOST)"));
  json_decref(doc);
  sp_test_free_msg(dr);
  an.stop = true;
  uv_thread_join(&th);
  assert_int_equal(an.answered, 2);
  job_stop(&j);
}

static void set_dump_dir(sp_coord *c, void *arg) { c->cfg.diag.dump_dir = arg; }

static void abort_on_stall(sp_coord *c, void *arg) {
  (void)arg;
  c->cfg.diag.abort_on_stall = true;
}

/* With --on-stall abort and a dump dir, every rank is asked for its
 * flight record before it is told to abort: a worker aborts and exits,
 * and one asked after that could be gone before the request came (the
 * dump then lacked the records that show the stall). */
static void test_stall_dump_asked_before_abort(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  job_start(&j, flags, 1000);
  char *dir = sp_test_mkdtemp();
  sp_coord_fixture_run(&j.fx, set_dump_dir, dir);
  sp_coord_fixture_run(&j.fx, abort_on_stall, NULL);
  for (uint32_t r = 0; r < WORLD; r++)
    transition(&j.f[r], ROOT, 0, SP_ROOT_FORWARD_BACKWARD, 4, 0);
  for (uint32_t r = 0; r < WORLD; r++)
    if (r != 2) collective(&j.f[r], WORLD_C, 0, 5, AG, 1, 100, false, 4);
  Shardplane__V1__Event *ev = next_alert(&j, 10000);
  assert_non_null(ev);
  assert_int_equal(ev->alert->kind, SHARDPLANE__V1__ALERT_KIND__STALL);
  sp_test_free_msg(ev);
  for (uint32_t r = 0; r < WORLD; r++) {
    for (uint64_t t1 = now_ms();
         !(j.f[r].aborted && j.f[r].dump_asked) && now_ms() - t1 < 3000;)
      sp_fake_rank_drain(&j.f[r], 50);
    printf("  rank %u: FLIGHT_DUMP %s, ABORT %s%s\n", r,
           j.f[r].dump_asked ? "asked" : "not asked",
           j.f[r].aborted ? "sent" : "not sent",
           j.f[r].dump_after_abort ? " (the dump asked after it)" : "");
    assert_true(j.f[r].aborted);
    assert_true(j.f[r].dump_asked);
    assert_false(j.f[r].dump_after_abort);
  }
  job_stop(&j);
  sp_test_rmtree(dir);
  free(dir);
}

/* A dump still gathering the ranks' flight records when the coordinator
 * shuts down is written with what came: shardplane run stops its
 * coordinator once a job failed, often before the aborted ranks answer,
 * and the dump of the failure was then lost. */
static void test_dump_written_at_shutdown(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  job j;
  job_start(&j, flags, 60000);
  char *dir = sp_test_mkdtemp();
  sp_coord_fixture_run(&j.fx, set_dump_dir, dir);
  /* rank 3 lost: the dump asks ranks 0 to 2, which never answer */
  sp_rpc_sync_stream_close(j.f[3].s);
  j.f[3].s = NULL;
  Shardplane__V1__Event *ev = next_alert(&j, 5000);
  assert_non_null(ev);
  sp_test_free_msg(ev);
  sp_coord_fixture_stop(&j.fx); /* within the ranks' 3 s to answer */
  char *path = sp_test_first_file(dir, ".json");
  printf("  dump in %s: %s\n", dir, path ? path : "none");
  assert_non_null(path);
  assert_non_null(strstr(path, "/dump-"));
  json_error_t je;
  json_t *doc = json_load_file(path, 0, &je);
  if (doc == NULL) fail_msg("%s: %s", path, je.text);
  json_t *ranks = json_object_get(doc, "ranks");
  assert_int_equal(json_array_size(ranks), 4);
  for (size_t r = 0; r < 3; r++) {
    const char *why = json_string_value(
        json_object_get(json_array_get(ranks, r), "flight_error"));
    assert_non_null(why);
    assert_string_equal(why,
                        "the coordinator shut down before it answered "
                        "FLIGHT_DUMP");
  }
  json_decref(doc);
  free(path);
  job_close_clients(&j);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_desync_world),
      cmocka_unit_test(test_desync_shard_group),
      cmocka_unit_test(test_stall_names_the_rank_and_its_victims),
      cmocka_unit_test(test_stall_in_the_network),
      cmocka_unit_test(test_stall_after_a_rank_left),
      cmocka_unit_test(test_straggler_within_20_steps),
      cmocka_unit_test(test_straggler_between_ticks),
      cmocka_unit_test(test_straggler_score_of_batched_steps),
      cmocka_unit_test(test_job_completes_and_refuses_attach),
      cmocka_unit_test(test_trace_and_dump),
      cmocka_unit_test(test_dump_written_at_shutdown),
      cmocka_unit_test(test_stall_dump_asked_before_abort),
  };
  /* streams the coordinator ends may be written once more */
  signal(SIGPIPE, SIG_IGN);
  return cmocka_run_group_tests(tests, NULL, NULL);
}
