/* The coordinator's /metrics exposition (coord_metrics.c), rendered from
 * an in-process coordinator: fake ranks (Session streams of their own)
 * attach and report steps, loss, throughput and memory, and the values
 * exposed are checked; the per-rank series go above the rank limit; the
 * reports start afresh when a rank attaches afresh; a real session of the
 * client library reports its throughput and memory; promtool accepts the
 * whole exposition, lint included; and what rendering costs at 1,024 and
 * 100,000 ranks. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/textbuf.h"
#include "lib/shardplane.h"
#include "plan/state.h"
#include "server/coord_diag.h"
#include "server/coord_metrics.h"
#include "server/coord_ranks.h"
#include "server/coordinator.h"
#include "support/coord_fixture.h"
#include "support/fake_rank.h"
#include "support/testutil.h"
#include "support/tmpdir.h"

#define PATH(m) SP_COORD_PATH(m)
#define MODEL SP_TEST_DATA "/same_name_buffers.json"
#define WORLD 4
#define ROOT SHARDPLANE__V1__MACHINE__MACHINE_ROOT
#define MIB (UINT64_C(1) << 20)

/* ---- fake ranks ---- */

typedef struct job {
  sp_coord_fixture fx;
  char version[SP_FAKE_VERSION_MAX];
  sp_fake_rank f[WORLD];
} job;

static void attach_one(job *j, uint32_t r) {
  sp_fake_rank_attach(&j->f[r], &j->fx, j->version, r, WORLD, "testhost");
}

/* What a rank reports besides its events: rank r's figures. */
static void reports(Shardplane__V1__SessionUp *up, uint32_t r) {
  up->has_loss = true;
  up->loss = 2.5 + r;
  up->total_steps = 100;
  up->tokens_per_step = 1000u * (r + 1);
  up->mem_bytes = (r + 1) * MIB;
  up->mem_peak_bytes = (r + 1) * 2 * MIB;
  /* the last rank's peak is twice its prediction, the others' half */
  up->mem_predicted_bytes = r == WORLD - 1 ? (r + 1) * MIB : (r + 1) * 4 * MIB;
}

/* Rank r's steps first..last, each (100 + 10 r) ms on its clock: the root
 * enters FORWARD_BACKWARD at a step's start and leaves it just before
 * the next. batched: all in one message (as a worker sends several steps
 * at once), else one message a step. */
static void steps(sp_fake_rank *f, int first, int last, bool batched) {
  enum { MAX = 16 };
  assert_true(last - first + 1 <= MAX);
  uint64_t len_us = (100u + 10u * f->rank) * 1000u;
  Shardplane__V1__Transition t[2 * MAX];
  Shardplane__V1__Transition *tp[2 * MAX];
  size_t nt = 0;
  for (int s = first; s <= last; s++) {
    uint64_t t0 = 1700000000000000ull + (uint64_t)s * len_us;
    for (int i = 0; i < 2; i++) {
      shardplane__v1__transition__init(&t[nt]);
      t[nt].machine = ROOT;
      t[nt].state = i == 0 ? SP_ROOT_FORWARD_BACKWARD : SP_ROOT_IDLE;
      t[nt].step = (uint64_t)s;
      t[nt].time_us = t0 + (i == 0 ? 0 : len_us - 1000u);
      tp[nt] = &t[nt];
      nt++;
    }
    if (!batched || s == last) {
      Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
      up.step = (uint64_t)s;
      up.n_transitions = nt;
      up.transitions = tp;
      reports(&up, f->rank);
      sp_fake_rank_send_up(f, &up);
      nt = 0;
    }
  }
}

/* One collective issued on the world at seq with count elements. */
static void issue(sp_fake_rank *f, uint64_t seq, uint64_t count) {
  Shardplane__V1__Collective k = SHARDPLANE__V1__COLLECTIVE__INIT;
  k.comm = SHARDPLANE__V1__COMM_KIND__COMM_WORLD;
  k.seq = seq;
  k.op = SHARDPLANE__V1__COLLECTIVE_OP__ALL_GATHER;
  k.unit = 1;
  k.dtype = SHARDPLANE__V1__DTYPE__FLOAT32;
  k.count = count;
  Shardplane__V1__Collective *kp = &k;
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.n_collectives = 1;
  up.collectives = &kp;
  sp_fake_rank_send_up(f, &up);
}

static void job_start(job *j, uint32_t attach) {
  const char *flags[] = {"world-size", "4", "wrap-type", "Block", NULL};
  sp_fake_job_start(&j->fx, MODEL, flags, j->version, sizeof j->version, NULL);
  memset(j->f, 0, sizeof j->f);
  for (uint32_t r = 0; r < attach; r++) attach_one(j, r);
}

static void job_stop(job *j) {
  for (uint32_t r = 0; r < WORLD; r++) sp_fake_rank_close(&j->f[r]);
  sp_coord_fixture_stop(&j->fx);
}

/* ---- the exposition ---- */

typedef struct render_arg {
  char *text;
  size_t len;
  int rc;
  double best_ms; /* of `times` renders */
  int times;
} render_arg;

static void do_render(sp_coord *c, void *arg) {
  render_arg *a = arg;
  a->best_ms = INFINITY;
  for (int i = 0; i < (a->times ? a->times : 1); i++) {
    sp_textbuf b;
    sp_textbuf_init(&b, 0);
    uint64_t t0 = uv_hrtime();
    a->rc = sp_coord_metrics_render(c, &b);
    double ms = (double)(uv_hrtime() - t0) / 1e6;
    if (ms < a->best_ms) a->best_ms = ms;
    free(a->text);
    a->text = NULL;
    if (a->rc == 0) a->rc = sp_textbuf_take(&b, &a->text, &a->len);
    sp_textbuf_free(&b);
  }
}

/* The exposition now (the caller frees it). */
static char *render(sp_coord_fixture *fx) {
  render_arg a = {0};
  sp_coord_fixture_run(fx, do_render, &a);
  assert_int_equal(a.rc, 0);
  assert_non_null(a.text);
  return a.text;
}

/* The value of the sample `series` (its name and labels exactly as
 * written), NAN when there is none. */
static double value(const char *text, const char *series) {
  size_t n = strlen(series);
  for (const char *p = text; *p != '\0';) {
    if (strncmp(p, series, n) == 0 && p[n] == ' ')
      return strtod(p + n + 1, NULL);
    const char *nl = strchr(p, '\n');
    if (nl == NULL) break;
    p = nl + 1;
  }
  return NAN;
}

static bool has(const char *text, const char *s) {
  return strstr(text, s) != NULL;
}

static void expect(const char *text, const char *series, double want) {
  double got = value(text, series);
  if (!(fabs(got - want) <= 1e-9 * fabs(want) + 1e-12))
    fail_msg("%s: %g, expected %g", series, got, want);
}

/* Renders until series has the value want (the job's progress follows
 * the detectors' tick), at most wait_ms; returns the text (freed by the
 * caller). */
static char *render_until(sp_coord_fixture *fx, const char *series, double want,
                          uint64_t wait_ms) {
  uint64_t t0 = uv_hrtime();
  for (;;) {
    char *t = render(fx);
    if (value(t, series) == want) return t;
    if ((uv_hrtime() - t0) / 1000000u > wait_ms) {
      fail_msg("%s stayed %g (expected %g)", series, value(t, series), want);
    }
    free(t);
    sp_test_sleep_ms(50);
  }
}

static void set_rank_limit(sp_coord *c, void *arg) {
  c->cfg.metrics_rank_limit = *(uint32_t *)arg;
}

static double unix_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define ATTACH_OK                                                     \
  "shardplane_rpc_calls_total{service=\"shardplane.v1.Coordinator\"," \
  "method=\"Attach\",code=\"OK\"}"

/* Four ranks attach and run five steps (ranks 0 and 1 a message a step,
 * 2 and 3 all five in one); a store key is set: the job, the ranks, the
 * steps, the store and the calls as exposed. Then the rank limit below
 * the world takes the per-rank series away, and a rank's broken stream is
 * a LOST alert with its diagnosis delay. */
static void test_values(void **state) {
  (void)state;
  job j;
  job_start(&j, WORLD);
  double before = unix_now();
  for (uint32_t r = 0; r < WORLD; r++) steps(&j.f[r], 1, 5, r >= 2);
  Shardplane__V1__StoreSetRequest sq = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  sq.key = "rdzv/nccl";
  sq.value.data = (uint8_t *)"0123456789";
  sq.value.len = 10;
  sp_rpc_status st;
  sp_test_free_msg(sp_coord_fixture_call(
      &j.fx, PATH("StoreSet"), &sq.base,
      &shardplane__v1__store_set_response__descriptor, &st));
  sp_test_expect_status(&st, SP_RPC_OK, NULL);

  char *t = render_until(&j.fx, "shardplane_job_step", 5, 5000);
  double after = unix_now();
  printf("%s", t);
  /* the job */
  expect(t, "shardplane_job_state{state=\"running\"}", 1);
  expect(t, "shardplane_job_state{state=\"waiting\"}", 0);
  expect(t, "shardplane_job_world_size", WORLD);
  expect(t, "shardplane_job_incarnation", 0);
  expect(t, "shardplane_job_restarts_total", 0);
  expect(t, "shardplane_job_total_steps", 100);
  expect(t, "shardplane_job_loss", 2.5);
  double sps = value(t, "shardplane_job_steps_per_second");
  assert_false(isnan(sps));
  /* steps per second times the ranks' 1000 + 2000 + 3000 + 4000 */
  expect(t, "shardplane_job_tokens_per_second", sps * 10000);
  double last = value(t, "shardplane_job_last_step_timestamp_seconds");
  assert_true(last >= before - 1 && last <= after + 1);
  assert_true(value(t, "shardplane_job_uptime_seconds") > 0);
  assert_true(has(t, "shardplane_job_info{model=\"") &&
              has(t, ",strategy=\"FULL_SHARD\"} 1\n"));
  /* the ranks */
  expect(t, "shardplane_ranks{status=\"attached\"}", WORLD);
  expect(t, "shardplane_ranks{status=\"lost\"}", 0);
  expect(t, "shardplane_ranks_by_state{state=\"IDLE\"}", WORLD);
  expect(t, "shardplane_ranks_by_state{state=\"FORWARD_BACKWARD\"}", 0);
  expect(t, "shardplane_metrics_per_rank", 1);
  expect(t, "shardplane_rank_step{rank=\"3\"}", 5);
  expect(t, "shardplane_rank_state{rank=\"0\"}", SP_ROOT_IDLE);
  expect(t, "shardplane_rank_status{rank=\"1\"}", 1);
  expect(t, "shardplane_rank_memory_bytes{rank=\"2\"}", 3 * MIB);
  expect(t, "shardplane_rank_memory_peak_bytes{rank=\"2\"}", 6 * MIB);
  expect(t, "shardplane_rank_memory_predicted_bytes{rank=\"2\"}", 12 * MIB);
  expect(t, "shardplane_rank_tokens_per_step{rank=\"1\"}", 2000);
  assert_true(value(t, "shardplane_rank_last_heard_seconds{rank=\"0\"}") < 5);
  expect(t, "shardplane_rank_memory_bytes_max", 4 * MIB);
  expect(t, "shardplane_rank_memory_peak_over_predicted_max", 2);
  /* the steps: four closed a rank, batched or not, of 100, 110, 120 and
   * 130 ms */
  expect(t, "shardplane_step_duration_seconds_count", 16);
  expect(t, "shardplane_step_duration_seconds_sum", 4 * 0.46);
  expect(t, "shardplane_step_duration_seconds_bucket{le=\"0.1\"}", 4);
  expect(t, "shardplane_step_duration_seconds_bucket{le=\"0.25\"}", 16);
  expect(t, "shardplane_step_duration_seconds_bucket{le=\"+Inf\"}", 16);
  expect(t, "shardplane_step_time_seconds{quantile=\"0.5\"}", 0.11);
  expect(t, "shardplane_step_time_seconds{quantile=\"0.9\"}", 0.13);
  expect(t, "shardplane_step_time_seconds{quantile=\"0.99\"}", 0.13);
  expect(t, "shardplane_collective_seq_lag{comm=\"world\",index=\"0\"}", 0);
  expect(t, "shardplane_collective_seq_lag_max{comm=\"world\"}", 0);
  /* the control plane */
  assert_true(value(t, ATTACH_OK) >= WORLD);
  assert_true(value(t,
                    "shardplane_rpc_duration_seconds_count{service="
                    "\"shardplane.v1.Coordinator\",method=\"Attach\"}") >=
              WORLD);
  expect(t, "shardplane_store_keys", 1);
  expect(t, "shardplane_store_bytes", 9 + 10);
  assert_true(value(t, "shardplane_rpc_streams_open") >= WORLD);
  assert_true(value(t, "shardplane_rpc_connections_open") >= WORLD);
  assert_true(value(t, "shardplane_rpc_bytes_received_total") > 0);
  expect(t, "shardplane_http_requests_total", 0);
  /* the diagnosis: nothing yet */
  expect(t, "shardplane_alerts_total", 0);
  expect(t, "shardplane_alerts_open{kind=\"stall\"}", 0);
  expect(t, "shardplane_diagnosis_delay_seconds_count{kind=\"lost\"}", 0);
  free(t);

  /* a rank limit below the world: aggregates only */
  uint32_t limit = WORLD - 1;
  sp_coord_fixture_run(&j.fx, set_rank_limit, &limit);
  t = render(&j.fx);
  expect(t, "shardplane_metrics_per_rank", 0);
  assert_false(has(t, "{rank=\""));
  expect(t, "shardplane_rank_memory_bytes_max", 4 * MIB);
  expect(t, "shardplane_ranks{status=\"attached\"}", WORLD);
  /* the world's communicator alone is within the limit */
  expect(t, "shardplane_collective_seq_lag{comm=\"world\",index=\"0\"}", 0);
  free(t);
  limit = 0; /* the default, 1,024 */
  sp_coord_fixture_run(&j.fx, set_rank_limit, &limit);

  /* rank 3's stream breaks: it is lost, the job failed */
  sp_fake_rank_close(&j.f[3]);
  t = render_until(&j.fx, "shardplane_ranks{status=\"lost\"}", 1, 5000);
  expect(t, "shardplane_job_state{state=\"failed\"}", 1);
  expect(t, "shardplane_alerts_raised_total{kind=\"lost\"}", 1);
  expect(t, "shardplane_alerts_open{kind=\"lost\"}", 1);
  expect(t, "shardplane_alerts_total", 1);
  expect(t, "shardplane_diagnosis_delay_seconds_count{kind=\"lost\"}", 1);
  /* the break is the evidence: diagnosed at once */
  assert_true(
      value(t, "shardplane_diagnosis_delay_seconds_sum{kind=\"lost\"}") < 0.5);
  expect(t, "shardplane_rank_status{rank=\"3\"}", 2);
  /* attached ranks only */
  expect(t, "shardplane_rank_memory_bytes_max", 3 * MIB);
  /* its last figures stay until it attaches afresh */
  expect(t, "shardplane_rank_memory_bytes{rank=\"3\"}", 4 * MIB);
  free(t);
  job_stop(&j);
}

/* A rank that attaches afresh (a new process) has reported nothing yet:
 * its last process's figures are not shown as its own. */
static void test_reports_reset_on_fresh_attach(void **state) {
  (void)state;
  job j;
  job_start(&j, 1); /* the job waits for the others: a loss ends nothing */
  steps(&j.f[0], 1, 2, false);
  char *t = render(&j.fx);
  expect(t, "shardplane_rank_memory_bytes{rank=\"0\"}", MIB);
  expect(t, "shardplane_rank_tokens_per_step{rank=\"0\"}", 1000);
  free(t);
  sp_fake_rank_close(&j.f[0]);
  t = render_until(&j.fx, "shardplane_ranks{status=\"lost\"}", 1, 5000);
  free(t);
  attach_one(&j, 0);
  t = render(&j.fx);
  expect(t, "shardplane_ranks{status=\"attached\"}", 1);
  assert_false(has(t, "shardplane_rank_memory_bytes{rank=\"0\"}"));
  assert_false(has(t, "shardplane_rank_tokens_per_step{rank=\"0\"}"));
  assert_true(
      isnan(value(t, "shardplane_rank_memory_peak_over_predicted_max")));
  expect(t, "shardplane_rank_memory_bytes_max", 0);
  free(t);
  job_stop(&j);
}

/* The client library's session sends what the trainer sets with its next
 * message. */
static void test_session_reports(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "1", "wrap-type", "Block", NULL};
  sp_coord_fixture fx;
  sp_coord_fixture_start(&fx, MODEL, flags, 0);
  sp_session_opts o = {
      .coordinator = fx.addr, .rank = 0, .connect_timeout_ms = 5000};
  sp_session *s = NULL;
  sp_diag d = {""};
  if (sp_session_open(&o, &s, &d) != 0) fail_msg("open: %s", d.msg);
  sp_session_set_throughput(s, 4096);
  sp_session_set_memory(s, 5 * MIB, 7 * MIB, 8 * MIB);
  sp_session_set_progress(s, 1.25, 10);
  sp_session_set_step(s, 1); /* an event, for a message to carry them */
  assert_int_equal(sp_session_flush(s, 5000, &d), 0);
  char *t = render(&fx);
  expect(t, "shardplane_rank_tokens_per_step{rank=\"0\"}", 4096);
  expect(t, "shardplane_rank_memory_bytes{rank=\"0\"}", 5 * MIB);
  expect(t, "shardplane_rank_memory_peak_bytes{rank=\"0\"}", 7 * MIB);
  expect(t, "shardplane_rank_memory_predicted_bytes{rank=\"0\"}", 8 * MIB);
  expect(t, "shardplane_rank_memory_peak_over_predicted_max", 7.0 / 8.0);
  expect(t, "shardplane_job_loss", 1.25);
  expect(t, "shardplane_job_total_steps", 10);
  free(t);
  assert_int_equal(sp_session_close(s, 5000, &d), 0);
  sp_coord_fixture_stop(&fx);
}

/* Real workers (shardplane-worker, the MLP trainer) report their
 * throughput and memory: the coordinator shows each rank's samples a
 * step, its resident memory and the memory model's prediction. */
static void test_worker_reports(void **state) {
  (void)state;
  const char *flags[] = {"world-size", "2", "wrap-type", "Linear", NULL};
  sp_coord_fixture fx;
  sp_coord_fixture_start(&fx, SP_TEST_DATA "/mlp_buffers.json", flags, 0);
  char *dir = sp_test_mkdtemp();
  int pid[2];
  for (int r = 0; r < 2; r++) {
    char rs[8], out[4200], err[4200];
    snprintf(rs, sizeof rs, "%d", r);
    snprintf(out, sizeof out, "%s/rank-%d.out", dir, r);
    snprintf(err, sizeof err, "%s/rank-%d.err", dir, r);
    char *argv[] = {SP_BIN_DIR "/shardplane-worker",
                    "--coordinator",
                    fx.addr,
                    "--rank",
                    rs,
                    "--insecure",
                    "--steps",
                    "3",
                    "--global-batch",
                    "24",
                    "--log-every",
                    "0",
                    NULL};
    pid[r] = sp_test_spawn_logged(out, err, argv);
  }
  for (int r = 0; r < 2; r++) {
    int st = sp_test_wait_exit(pid[r], 120);
    if (st != 0) {
      char path[4200];
      snprintf(path, sizeof path, "%s/rank-%d.err", dir, r);
      char *e = sp_test_read_file(path);
      fail_msg("worker %d: exit %d: %s", r, st, e);
    }
  }
  sp_test_rmtree(dir);
  free(dir);
  char *t = render(&fx);
  expect(t, "shardplane_job_state{state=\"completed\"}", 1);
  for (int r = 0; r < 2; r++) {
    char series[96];
    snprintf(series, sizeof series,
             "shardplane_rank_tokens_per_step{rank=\"%d\"}", r);
    expect(t, series, 12); /* 24 samples a step over 2 ranks */
    snprintf(series, sizeof series, "shardplane_rank_memory_bytes{rank=\"%d\"}",
             r);
    double now = value(t, series);
    snprintf(series, sizeof series,
             "shardplane_rank_memory_peak_bytes{rank=\"%d\"}", r);
    double peak = value(t, series);
    snprintf(series, sizeof series,
             "shardplane_rank_memory_predicted_bytes{rank=\"%d\"}", r);
    double pred = value(t, series);
    printf(
        "  rank %d: %.1f MiB in use, %.1f MiB at most, %.1f MiB "
        "predicted\n",
        r, now / (double)MIB, peak / (double)MIB, pred / (double)MIB);
    assert_true(now > MIB && peak >= now && pred > MIB);
  }
  double ratio = value(t, "shardplane_rank_memory_peak_over_predicted_max");
  assert_true(ratio > 0.1 && ratio < 10);
  free(t);
  sp_coord_fixture_stop(&fx);
}

/* ---- promtool ---- */

static char *g_name_saved;
static void odd_model_name(sp_coord *c, void *arg) {
  (void)arg;
  if (g_name_saved == NULL) {
    g_name_saved = c->model->name;
    static char odd[] = "gpt \"tiny\"\\v2\nnext line";
    c->model->name = odd;
  } else {
    c->model->name = g_name_saved;
    g_name_saved = NULL;
  }
}

/* promtool check metrics on text: its output (the problems, lint
 * included), empty when none; fails the test when promtool is missing. */
static char *promtool_check(const char *text, int *status) {
  char *dir = sp_test_mkdtemp();
  char *file = sp_test_path(dir, "metrics.txt");
  sp_test_write_file(file, text, strlen(text));
  char *out = NULL;
  if (sp_test_shell("command -v promtool >/dev/null", &out) != 0)
    fail_msg(
        "promtool not found: it comes with the prometheus package "
        "(scripts/deps.sh installs it)");
  free(out);
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "promtool check metrics < '%s' 2>&1", file);
  *status = sp_test_shell(cmd, &out);
  sp_test_rmtree(dir);
  free(file);
  free(dir);
  return out;
}

static void expect_promtool_clean(const char *text, const char *when) {
  int status;
  char *out = promtool_check(text, &status);
  if (status != 0 || out[0] != '\0') {
    printf("%s\npromtool says:\n%s\n", text, out);
    fail_msg("promtool check metrics (%s): exit %d:\n%s", when, status, out);
  }
  free(out);
}

/* The whole exposition passes promtool, lint included: fresh, then with
 * steps, a desync (alerts, delays, a seq lag), and a model name that
 * needs escaping. */
static void test_promtool(void **state) {
  (void)state;
  job j;
  job_start(&j, WORLD);
  char *t = render(&j.fx);
  expect_promtool_clean(t, "fresh");
  free(t);
  for (uint32_t r = 0; r < WORLD; r++) steps(&j.f[r], 1, 3, false);
  /* rank 0 issues another fingerprint than ranks 1 and 2; rank 3 none */
  issue(&j.f[0], 1, 10);
  issue(&j.f[1], 1, 11);
  issue(&j.f[2], 1, 11);
  sp_coord_fixture_run(&j.fx, odd_model_name, NULL);
  t = render_until(&j.fx, "shardplane_alerts_raised_total{kind=\"desync\"}", 1,
                   5000);
  sp_coord_fixture_run(&j.fx, odd_model_name, NULL);
  assert_true(
      has(t, "model=\"gpt \\\"tiny\\\"\\\\v2\\nnext line\",plan_version="));
  expect(t, "shardplane_alerts_open{kind=\"desync\"}", 1);
  expect(t, "shardplane_diagnosis_delay_seconds_count{kind=\"desync\"}", 1);
  assert_true(
      value(t, "shardplane_diagnosis_delay_seconds_sum{kind=\"desync\"}") <
      1.0);
  expect(t, "shardplane_collective_seq_lag{comm=\"world\",index=\"0\"}", 1);
  expect(t, "shardplane_collective_seq_lag_max{comm=\"world\"}", 1);
  expect_promtool_clean(t, "after steps and a desync");
  /* promtool does find problems: the check is real */
  int status;
  char *out = promtool_check("# TYPE x_count gauge\nx_count 1\n", &status);
  assert_int_not_equal(status, 0);
  assert_true(out[0] != '\0');
  free(out);
  free(t);
  job_stop(&j);
}

/* ---- cost ---- */

/* Every rank as attached (a state dir's restore), with a full window of
 * step times and a collective issued: what a scrape of a running job
 * walks. */
static void fill_world(sp_coord *c, void *arg) {
  (void)arg;
  uint32_t w = c->plan->world_size;
  size_t nu = c->plan->n_units;
  uint8_t *units = malloc(nu ? nu : 1);
  assert_non_null(units);
  memset(units, SP_HANDLE_IDLE, nu);
  for (uint32_t r = 0; r < w; r++) {
    sp_coord_db_rank dr = {.rank = r,
                           .status = SHARDPLANE__V1__RANK_STATUS__ATTACHED,
                           .session_id = "",
                           .host = "host",
                           .device = "cpu",
                           .pid = r,
                           .step = 100 + r % 3,
                           .root = SP_ROOT_IDLE,
                           .units = units,
                           .n_units = nu};
    assert_int_equal(sp_coord_ranks_restore(c, &dr), 0);
  }
  free(units);
  sp_coord_diag_rank *d = (sp_coord_diag_rank *)sp_coord_diag_ranks(c);
  for (uint32_t r = 0; r < w; r++) {
    d[r].n_steps = SP_DIAG_STEP_WINDOW;
    for (uint32_t i = 0; i < SP_DIAG_STEP_WINDOW; i++)
      d[r].step_ms[i] = 100.0f + (float)((r * 7 + i * 13) % 50);
    d[r].comm[0].issued.seq = 1000 + r % 5;
  }
}

static void cost_at(uint32_t world, double goal_ms) {
  char ws[16];
  snprintf(ws, sizeof ws, "%u", world);
  const char *flags[] = {"world-size", ws, "wrap-type", "Block", NULL};
  sp_coord_fixture fx;
  sp_coord_fixture_start(&fx, MODEL, flags, 0);
  sp_coord_fixture_run(&fx, fill_world, NULL);
  render_arg a = {.times = 5};
  sp_coord_fixture_run(&fx, do_render, &a);
  assert_int_equal(a.rc, 0);
  printf(
      "  %u ranks: %.2f ms a render (best of 5), %zu bytes (goal %.0f "
      "ms)\n",
      world, a.best_ms, a.len, goal_ms);
  expect(a.text, "shardplane_ranks{status=\"attached\"}", world);
  expect(a.text, "shardplane_metrics_per_rank",
         world <= SP_COORD_METRICS_RANK_LIMIT);
  if (world > SP_COORD_METRICS_RANK_LIMIT) {
    /* aggregates alone: no series a rank */
    assert_false(has(a.text, "{rank=\""));
    assert_true(a.len < (64u << 10));
  }
  expect(a.text, "shardplane_collective_seq_lag_max{comm=\"world\"}", 4);
#ifdef SP_TEST_ASAN
  goal_ms *= 4; /* instrumented memory accesses */
#endif
  assert_true(a.best_ms < goal_ms);
  free(a.text);
  sp_coord_fixture_stop(&fx);
}

static void test_render_cost(void **state) {
  (void)state;
  cost_at(1024, 20);
  cost_at(100000, 100);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_values),
      cmocka_unit_test(test_reports_reset_on_fresh_attach),
      cmocka_unit_test(test_session_reports),
      cmocka_unit_test(test_worker_reports),
      cmocka_unit_test(test_promtool),
      cmocka_unit_test(test_render_cost),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
