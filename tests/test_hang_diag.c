/* Hang diagnosis end to end: 4 real ranks over Gloo, a fault injected at a
 * chosen rank, step and unit (shardplane-worker --inject), under every
 * strategy where the fault applies, and the coordinator's verdict, which
 * must name exactly that rank, the unit, the collective and its sequence
 * number. The sequence number is checked against the ranks' own flight
 * recorders (GetTrace): the collective the healthy ranks are waiting in,
 * or the one at which the culprit's fingerprint differs. Prints the time
 * from the fault to the verdict, measured on the workers' clock (the same
 * machine's): for a desync from the moment both fingerprints existed, for
 * a stall from the culprit's last event; a straggler's verdict must come
 * within 20 steps. */
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

#include "base/clock.h"
#include "lib/shardplane.h"
#include "rpc/coord_service.h"
#include "support/coord_fixture.h"
#include "support/job_fixture.h"
#include "support/testutil.h"

#define MLP SP_EXAMPLES "/mlp.json"
#define WORLD 4
#define STALL_MS 2000
#define FAULT_STEP 3

/* The issue's bounds: a desync within 1 s of the second fingerprint, a
 * stall within the threshold and 1 s, a straggler within 20 steps. */
#define DESYNC_BOUND_S 1.0
#define STALL_BOUND_S (STALL_MS / 1000.0 + 1.0)
#define STRAGGLER_STEPS 20
/* A sanitizer build runs several times slower and its steps' own times
 * scatter more: that build checks the verdict, the optimized one the
 * bound. */
#if defined(__SANITIZE_ADDRESS__)
#define CHECK_STRAGGLER_STEPS 0
#else
#define CHECK_STRAGGLER_STEPS 1
#endif

#define STALL SHARDPLANE__V1__ALERT_KIND__STALL
#define DESYNC SHARDPLANE__V1__ALERT_KIND__DESYNC
#define AG SHARDPLANE__V1__COLLECTIVE_OP__ALL_GATHER
#define RS SHARDPLANE__V1__COLLECTIVE_OP__REDUCE_SCATTER
#define AR SHARDPLANE__V1__COLLECTIVE_OP__ALL_REDUCE
#define C_WORLD SHARDPLANE__V1__COMM_KIND__COMM_WORLD
#define C_SHARD SHARDPLANE__V1__COMM_KIND__COMM_SHARD
#define C_REPLICA SHARDPLANE__V1__COMM_KIND__COMM_REPLICA

typedef struct fault_case {
  const char *strategy;
  const char *group; /* --shard-group-size, or NULL */
  const char *inject;
  int kind; /* the alert expected */
  uint32_t culprit;
  int op;              /* the collective's op, or 0: not fixed by the fault */
  int comm;            /* its communicator kind */
  int64_t unit;        /* its unit, or -1: not fixed by the fault */
  const char *want[4]; /* phrases the verdict must contain */
} fault_case;

typedef struct seen {
  Shardplane__V1__Alert *alert; /* the first alert of the kind */
  double verdict_s;             /* when it showed (realtime clock) */
  uint64_t step;                /* the job's step then (slowest rank) */
} seen;

static Shardplane__V1__Alert *copy_alert(const Shardplane__V1__Alert *a) {
  size_t len = protobuf_c_message_get_packed_size(&a->base);
  uint8_t *buf = malloc(len + 1);
  assert_non_null(buf);
  protobuf_c_message_pack(&a->base, buf);
  Shardplane__V1__Alert *c = shardplane__v1__alert__unpack(NULL, len, buf);
  free(buf);
  assert_non_null(c);
  return c;
}

static sp_rpc_sync *reader(sp_tjob *j) {
  sp_rpc_sync *cli;
  sp_rpc_client_opts o = {.connect_timeout_ms = 5000,
                          .token = j->auth.token[SP_ROLE_READER]};
  assert_int_equal(sp_rpc_sync_open_opts(j->addr, &o, &cli), 0);
  return cli;
}

/* Polls GetVerdict until an open alert of `kind` shows. */
static void wait_verdict(sp_rpc_sync *cli, int kind, double timeout_s,
                         seen *out) {
  memset(out, 0, sizeof *out);
  double end = sp_clock_s() + timeout_s;
  while (sp_clock_s() < end && out->alert == NULL) {
    Shardplane__V1__GetVerdictRequest q =
        SHARDPLANE__V1__GET_VERDICT_REQUEST__INIT;
    sp_rpc_status st;
    Shardplane__V1__Verdict *v =
        (void *)sp_test_unary(cli, SP_COORD_PATH("GetVerdict"), &q.base,
                              &shardplane__v1__verdict__descriptor, 2000, &st);
    if (v != NULL) {
      for (size_t i = 0; i < v->n_open_alerts && out->alert == NULL; i++) {
        if ((int)v->open_alerts[i]->kind != kind) continue;
        out->alert = copy_alert(v->open_alerts[i]);
        out->verdict_s = (double)sp_session_time_us() / 1e6;
        out->step = v->progress ? v->progress->step : 0;
      }
      sp_test_free_msg(v);
    }
    if (out->alert == NULL) usleep(20000);
  }
  if (out->alert == NULL)
    fail_msg("no verdict of kind %d in %.0f s", kind, timeout_s);
}

/* A rank's flight recorder, pulled live by the coordinator. */
static Shardplane__V1__FlightRecord *trace(sp_rpc_sync *cli, uint32_t rank) {
  Shardplane__V1__GetTraceRequest q = SHARDPLANE__V1__GET_TRACE_REQUEST__INIT;
  q.rank = rank;
  sp_rpc_status st;
  Shardplane__V1__FlightRecord *r = (void *)sp_test_unary(
      cli, SP_COORD_PATH("GetTrace"), &q.base,
      &shardplane__v1__flight_record__descriptor, 5000, &st);
  if (r == NULL) fail_msg("GetTrace of rank %u: %s", rank, st.message);
  return r;
}

static uint64_t last_event_us(const Shardplane__V1__FlightRecord *r) {
  uint64_t t = 0;
  for (size_t i = 0; i < r->n_transitions; i++)
    if (r->transitions[i]->time_us > t) t = r->transitions[i]->time_us;
  for (size_t i = 0; i < r->n_collectives; i++)
    if (r->collectives[i]->time_us > t) t = r->collectives[i]->time_us;
  return t;
}

/* The record of `seq` on communicator kind `comm` (issued, not its
 * completion), or NULL. */
static const Shardplane__V1__Collective *issued(
    const Shardplane__V1__FlightRecord *r, int comm, uint64_t seq) {
  for (size_t i = 0; i < r->n_collectives; i++) {
    const Shardplane__V1__Collective *c = r->collectives[i];
    if ((int)c->comm == comm && c->seq == seq && !c->completed) return c;
  }
  return NULL;
}

/* The collective a rank waits in on `comm`: the first it issued and has
 * not completed (a communicator runs them in order). */
static const Shardplane__V1__Collective *pending(
    const Shardplane__V1__FlightRecord *r, int comm) {
  const Shardplane__V1__Collective *best = NULL;
  for (size_t i = 0; i < r->n_collectives; i++) {
    const Shardplane__V1__Collective *c = r->collectives[i];
    if ((int)c->comm != comm || c->completed) continue;
    bool done = false;
    for (size_t k = 0; k < r->n_collectives && !done; k++)
      done = r->collectives[k]->completed &&
             (int)r->collectives[k]->comm == comm &&
             r->collectives[k]->seq == c->seq;
    if (!done && (best == NULL || c->seq < best->seq)) best = c;
  }
  return best;
}

static bool same_fingerprint(const Shardplane__V1__Collective *a,
                             const Shardplane__V1__Collective *b) {
  return a->op == b->op && a->unit == b->unit && a->dtype == b->dtype &&
         a->count == b->count;
}

/* Checks the alert's collective against the recorders and returns the
 * time (workers' clock, s) the fault became visible. */
static double check_against_traces(sp_rpc_sync *cli, const fault_case *fc,
                                   const Shardplane__V1__Alert *a) {
  /* a lost rank's peers are aborted and gone: nothing to compare */
  if (fc->kind != STALL && fc->kind != DESYNC) return 0;
  Shardplane__V1__FlightRecord *rec[WORLD] = {0};
  for (uint32_t r = 0; r < WORLD; r++) rec[r] = trace(cli, r);
  double t = 0;
  const Shardplane__V1__Collective *col = a->collective;
  if (fc->kind == SHARDPLANE__V1__ALERT_KIND__STALL) {
    assert_non_null(col);
    /* every rank that shares the communicator with the culprit and has
     * issued the collective is waiting in exactly that one */
    size_t waiting = 0;
    for (uint32_t r = 0; r < WORLD; r++) {
      if (r == fc->culprit) continue;
      const Shardplane__V1__Collective *p = pending(rec[r], (int)col->comm);
      if (p == NULL || p->comm_index != col->comm_index) continue;
      if (p->seq != col->seq || !same_fingerprint(p, col))
        fail_msg(
            "rank %u waits in #%llu of unit %u, the verdict names "
            "#%llu of unit %u",
            r, (unsigned long long)p->seq, p->unit,
            (unsigned long long)col->seq, col->unit);
      waiting++;
    }
    assert_true(waiting > 0);
    assert_null(issued(rec[fc->culprit], (int)col->comm, col->seq));
    t = (double)last_event_us(rec[fc->culprit]) / 1e6;
  } else if (fc->kind == SHARDPLANE__V1__ALERT_KIND__DESYNC) {
    assert_non_null(col);
    const Shardplane__V1__Collective *mine =
        issued(rec[fc->culprit], (int)col->comm, col->seq);
    assert_non_null(mine);
    /* the culprit's fingerprint differs from every peer's that issued it;
     * the desync exists once both have been issued */
    double first_peer = 0;
    for (uint32_t r = 0; r < WORLD; r++) {
      if (r == fc->culprit) continue;
      const Shardplane__V1__Collective *p =
          issued(rec[r], (int)col->comm, col->seq);
      if (p == NULL || p->comm_index != mine->comm_index) continue;
      assert_false(same_fingerprint(p, mine));
      double tp = (double)p->time_us / 1e6;
      if (first_peer == 0 || tp < first_peer) first_peer = tp;
    }
    assert_true(first_peer > 0);
    double tm = (double)mine->time_us / 1e6;
    t = tm > first_peer ? tm : first_peer;
  }
  for (uint32_t r = 0; r < WORLD; r++)
    if (rec[r]) sp_test_free_msg(rec[r]);
  return t;
}

/* The job of the case running, so that a case that fails half way leaves
 * no process behind (its workers would train on for 100,000 steps). */
static sp_tjob g_job;
static bool g_job_live;

static int end_job(void **state) {
  (void)state;
  if (g_job_live) sp_tjob_wait(&g_job, 0);
  g_job_live = false;
  return 0;
}

static void run_case(const fault_case *fc) {
  char *dir = sp_test_mkdtemp();
  char stall[16];
  snprintf(stall, sizeof stall, "%d", STALL_MS);
  const char *cflags[] = {"--wrap-type",
                          "Linear",
                          "--strategy",
                          fc->strategy,
                          "--stall-timeout-ms",
                          stall,
                          fc->group ? "--shard-group-size" : NULL,
                          fc->group,
                          NULL};
  const char *wflags[] = {"--steps", "100000",   "--checkpoint",
                          "none",    "--inject", fc->inject,
                          NULL};
  sp_tjob *j = &g_job;
  double t0 = (double)sp_session_time_us() / 1e6;
  sp_tjob_start(j, MLP, cflags, WORLD, wflags, dir);
  g_job_live = true;
  sp_rpc_sync *cli = reader(j);
  seen s;
  wait_verdict(cli, fc->kind, 60, &s);
  const Shardplane__V1__Alert *a = s.alert;
  printf("%s %s: %s\n", fc->strategy, fc->inject, a->message);
  assert_int_equal(a->n_culprits, 1);
  assert_int_equal(a->culprits[0], fc->culprit);
  for (size_t i = 0; i < 4 && fc->want[i]; i++)
    if (strstr(a->message, fc->want[i]) == NULL)
      fail_msg("the verdict \"%s\" does not say \"%s\"", a->message,
               fc->want[i]);
  if (fc->kind == STALL || fc->kind == DESYNC) {
    assert_non_null(a->collective);
    if (fc->op > 0) assert_int_equal(a->collective->op, fc->op);
    assert_int_equal(a->collective->comm, fc->comm);
    if (fc->unit >= 0) assert_int_equal(a->collective->unit, fc->unit);
    char n[64];
    snprintf(n, sizeof n, "#%llu", (unsigned long long)a->collective->seq);
    if (strstr(a->message, n) == NULL)
      fail_msg("the verdict \"%s\" does not name collective %s", a->message, n);
  }
  if (fc->kind == SHARDPLANE__V1__ALERT_KIND__ALERT_LOST) {
    /* the others are its victims, never culprits */
    printf("  victims:");
    for (size_t i = 0; i < a->n_victims; i++) printf(" %u", a->victims[i]);
    printf("\n");
    assert_int_equal(a->n_victims, WORLD - 1);
    for (size_t i = 0; i < a->n_victims; i++)
      assert_int_not_equal(a->victims[i], fc->culprit);
  }
  double t_fault = check_against_traces(cli, fc, a);
  if (fc->kind == SHARDPLANE__V1__ALERT_KIND__STRAGGLER) {
    printf("  flagged at step %llu (bound %d), %.1f s after the start\n",
           (unsigned long long)s.step, STRAGGLER_STEPS, s.verdict_s - t0);
    if (CHECK_STRAGGLER_STEPS) assert_true(s.step <= STRAGGLER_STEPS);
  } else if (t_fault > 0) {
    double dt = s.verdict_s - t_fault;
    double bound = fc->kind == SHARDPLANE__V1__ALERT_KIND__DESYNC
                       ? DESYNC_BOUND_S
                       : STALL_BOUND_S;
    printf("  verdict %.2f s after the fault (bound %.1f s)\n", dt, bound);
    assert_true(dt <= bound);
  }
  sp_rpc_sync_close(cli);
  sp_tjob_wait(j, 1);
  g_job_live = false;
  shardplane__v1__alert__free_unpacked(s.alert, NULL);
  sp_test_rmtree(dir);
  free(dir);
}

/* (a) a rank that has not reached the collective its peers wait in */
static void test_stall_full_shard(void **state) {
  (void)state;
  run_case(&(fault_case){
      "FULL_SHARD",
      NULL,
      "stall:rank=2,step=3,unit=1,phase=forward",
      STALL,
      2,
      AG,
      C_WORLD,
      1,
      {"rank 2 has not issued ALL_GATHER #", "of unit 1 (layers.0) on world",
       "ranks 0, 1, 3 have been waiting", "step 3"}});
}

static void test_stall_full_shard_backward(void **state) {
  (void)state;
  run_case(&(fault_case){"FULL_SHARD",
                         NULL,
                         "stall:rank=0,step=3,unit=2,phase=backward",
                         STALL,
                         0,
                         0,
                         C_WORLD,
                         2,
                         {"rank 0 has not issued ", "of unit 2 ",
                          "ranks 1-3 have been waiting", NULL}});
}

static void test_stall_shard_grad_op(void **state) {
  (void)state;
  run_case(&(fault_case){"SHARD_GRAD_OP",
                         NULL,
                         "stall:rank=1,step=3,unit=2,phase=backward",
                         STALL,
                         1,
                         RS,
                         C_WORLD,
                         2,
                         {"rank 1 has not issued REDUCE_SCATTER #",
                          "of unit 2 ", "on world", NULL}});
}

static void test_stall_no_shard(void **state) {
  (void)state;
  run_case(&(fault_case){"NO_SHARD",
                         NULL,
                         "stall:rank=3,step=3,unit=1,phase=backward",
                         STALL,
                         3,
                         AR,
                         C_WORLD,
                         1,
                         {"rank 3 has not issued ALL_REDUCE #", "of unit 1 ",
                          "ranks 0-2 have been waiting", NULL}});
}

static void test_stall_hybrid_shard(void **state) {
  (void)state;
  run_case(&(fault_case){"HYBRID_SHARD",
                         "2",
                         "stall:rank=3,step=3,unit=1,phase=forward",
                         STALL,
                         3,
                         AG,
                         C_SHARD,
                         1,
                         {"rank 3 has not issued ALL_GATHER #", "of unit 1 ",
                          "on shard group 1", "rank 2 has been waiting"}});
}

/* one reduction with a different count */
static void test_desync_wrong_count_full_shard(void **state) {
  (void)state;
  run_case(&(fault_case){
      "FULL_SHARD",
      NULL,
      "wrong-count:rank=1,step=3",
      DESYNC,
      1,
      RS,
      C_WORLD,
      -1,
      {"desync on world at collective #", "rank 1 issued", NULL}});
}

static void test_desync_wrong_count_no_shard(void **state) {
  (void)state;
  run_case(&(fault_case){
      "NO_SHARD",
      NULL,
      "wrong-count:rank=2,step=3",
      DESYNC,
      2,
      AR,
      C_WORLD,
      -1,
      {"desync on world at collective #", "rank 2 issued", NULL}});
}

static void test_desync_wrong_count_hybrid(void **state) {
  (void)state;
  run_case(&(fault_case){
      "HYBRID_SHARD",
      "2",
      "wrong-count:rank=0,step=3",
      DESYNC,
      0,
      RS,
      C_SHARD,
      -1,
      {"desync on shard group 0 at collective #", "rank 0 issued", NULL}});
}

/* one all-gather skipped: the culprit's next collective meets its peers'
 * skipped one at the same sequence number */
static void test_desync_skip_full_shard(void **state) {
  (void)state;
  run_case(
      &(fault_case){"FULL_SHARD",
                    NULL,
                    "skip-collective:rank=3,step=3,unit=2",
                    DESYNC,
                    3,
                    0,
                    C_WORLD,
                    -1,
                    {"desync on world at collective #",
                     "issued ALL_GATHER of unit 2 ", "rank 3 issued", NULL}});
}

static void test_desync_skip_shard_grad_op(void **state) {
  (void)state;
  run_case(
      &(fault_case){"SHARD_GRAD_OP",
                    NULL,
                    "skip-collective:rank=2,step=3,unit=1",
                    DESYNC,
                    2,
                    0,
                    C_WORLD,
                    -1,
                    {"desync on world at collective #",
                     "issued ALL_GATHER of unit 1 ", "rank 2 issued", NULL}});
}

/* (c) a rank whose process is gone */
static void test_lost_exit(void **state) {
  (void)state;
  run_case(&(fault_case){"FULL_SHARD",
                         NULL,
                         "exit:rank=1,step=3",
                         SHARDPLANE__V1__ALERT_KIND__ALERT_LOST,
                         1,
                         0,
                         0,
                         -1,
                         {"rank 1", NULL}});
}

/* a rank whose compute is 1.5x slower */
static void test_straggler(void **state) {
  (void)state;
  run_case(&(fault_case){"FULL_SHARD",
                         NULL,
                         "slow:rank=2,factor=1.5",
                         SHARDPLANE__V1__ALERT_KIND__STRAGGLER,
                         2,
                         0,
                         0,
                         -1,
                         {"rank 2 is a straggler", NULL}});
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_stall_full_shard, end_job),
      cmocka_unit_test_teardown(test_stall_full_shard_backward, end_job),
      cmocka_unit_test_teardown(test_stall_shard_grad_op, end_job),
      cmocka_unit_test_teardown(test_stall_no_shard, end_job),
      cmocka_unit_test_teardown(test_stall_hybrid_shard, end_job),
      cmocka_unit_test_teardown(test_desync_wrong_count_full_shard, end_job),
      cmocka_unit_test_teardown(test_desync_wrong_count_no_shard, end_job),
      cmocka_unit_test_teardown(test_desync_wrong_count_hybrid, end_job),
      cmocka_unit_test_teardown(test_desync_skip_full_shard, end_job),
      cmocka_unit_test_teardown(test_desync_skip_shard_grad_op, end_job),
      cmocka_unit_test_teardown(test_lost_exit, end_job),
      cmocka_unit_test_teardown(test_straggler, end_job),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
