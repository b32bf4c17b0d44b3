/* Losses that are real: a rank silent past the heartbeat timeout is not
 * declared lost while its host's agent says its process is alive and the
 * silence is explained (the host under pressure, or the rank's own
 * scheduling gaps), up to --loss-grace-ms; then it is lost as hung. A
 * process the agent reports gone is lost at once, and an alive one on a
 * quiet host at the timeout as before. Fake ranks and a fake agent
 * against the coordinator in-process, with a short timeout and grace. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "support/coord_fixture.h"
#include "support/fake_rank.h"
#include "server/coordinator.h"
#include "support/testutil.h"

#define MODEL(name) SP_EXAMPLES "/models/" name ".json"
#define PATH(m) SP_COORD_PATH(m)

#define TIMEOUT_MS 400u
#define GRACE_MS 1500u

typedef struct world {
  sp_coord_fixture fx;
  char version[SP_FAKE_VERSION_MAX];
  sp_fake_rank r[2];
  sp_rpc_sync *agent_cli;
  sp_rpc_sync_stream *agent;
} world;

/* Two ranks on host "h1", both bound, and the host's agent registered. */
static void world_start(world *w) {
  memset(w, 0, sizeof *w);
  sp_coord_config cfg = {.model_path = MODEL("gpt2"),
                         .quiet = true,
                         .heartbeat_timeout_ms = TIMEOUT_MS,
                         .loss_grace_ms = GRACE_MS};
  const char *flags[] = {"world-size", "2", NULL};
  sp_coord_fixture_start_cfg(&w->fx, &cfg, flags);
  Shardplane__V1__GetJobResponse *g = sp_coord_fixture_get_job(&w->fx);
  snprintf(w->version, sizeof w->version, "%s", g->plan_version);
  sp_test_free_msg(g);
  for (uint32_t r = 0; r < 2; r++) {
    sp_fake_rank_attach(&w->r[r], &w->fx, w->version, r, 2, "h1");
    Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
    sp_fake_rank_send_up(&w->r[r], &up);
  }
  assert_int_equal(sp_rpc_sync_open(w->fx.addr, 2000, &w->agent_cli), 0);
  assert_int_equal(sp_rpc_sync_stream_open(w->agent_cli, PATH("AgentSession"),
                                           0, NULL, 0, &w->agent),
                   0);
  Shardplane__V1__AgentRegister reg = SHARDPLANE__V1__AGENT_REGISTER__INIT;
  reg.node_rank = 0;
  reg.nproc = 2;
  reg.host = "h1";
  reg.pid = 4242;
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.register_ = &reg;
  assert_int_equal(sp_rpc_sync_stream_send(w->agent, &up.base), 0);
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  assert_int_equal(
      sp_rpc_sync_stream_recv(w->agent, &shardplane__v1__agent_down__descriptor,
                              5000, &m, &st),
      0);
  assert_int_equal(((Shardplane__V1__AgentDown *)m)->command,
                   SHARDPLANE__V1__AGENT_COMMAND__AGENT_START);
  protobuf_c_message_free_unpacked(m, NULL);
}

static void world_stop(world *w) {
  sp_rpc_sync_stream_close(w->agent);
  sp_rpc_sync_close(w->agent_cli);
  for (int r = 0; r < 2; r++) sp_fake_rank_close(&w->r[r]);
  sp_coord_fixture_stop(&w->fx);
}

/* The agent's word: which ranks live (n of them), and the CPU pressure
 * (percent; 0: a quiet host). */
static void agent_alive(world *w, const uint32_t *ranks, size_t n, float cpu) {
  Shardplane__V1__HostPressure p = SHARDPLANE__V1__HOST_PRESSURE__INIT;
  p.has_psi = true;
  p.cpu_some_avg10 = cpu;
  p.memory_some_avg10 = 0.5f;
  p.loadavg_1m = 0.3f;
  p.ncpu = 2;
  Shardplane__V1__WorkersAlive a = SHARDPLANE__V1__WORKERS_ALIVE__INIT;
  a.incarnation = 0;
  a.n_alive_ranks = n;
  a.alive_ranks = (uint32_t *)ranks;
  a.pressure = &p;
  Shardplane__V1__AgentUp up = SHARDPLANE__V1__AGENT_UP__INIT;
  up.alive = &a;
  assert_int_equal(sp_rpc_sync_stream_send(w->agent, &up.base), 0);
  /* the blocking client writes while its loop runs, in a call: read what
   * came down meanwhile (alerts) until nothing more does */
  ProtobufCMessage *m = NULL;
  sp_rpc_status st;
  while (sp_rpc_sync_stream_recv(w->agent,
                                 &shardplane__v1__agent_down__descriptor, 2, &m,
                                 &st) == 0)
    protobuf_c_message_free_unpacked(m, NULL);
}

/* Rank 1 as ListRanks shows it. */
typedef struct seen {
  int status;
  bool withheld;
  uint64_t gap_ms;
  char last_alert[512];
} seen;

static seen rank1(world *w) {
  Shardplane__V1__ListRanksRequest q = SHARDPLANE__V1__LIST_RANKS_REQUEST__INIT;
  sp_rpc_status st;
  Shardplane__V1__ListRanksResponse *l =
      (Shardplane__V1__ListRanksResponse *)sp_coord_fixture_call(
          &w->fx, PATH("ListRanks"), &q.base,
          &shardplane__v1__list_ranks_response__descriptor, &st);
  sp_test_expect_status(&st, SP_RPC_OK, NULL);
  seen s = {.status = l->ranks[1]->status,
            .withheld = l->ranks[1]->loss_withheld,
            .gap_ms = l->ranks[1]->sched_gap_ms};
  snprintf(s.last_alert, sizeof s.last_alert, "%s", l->ranks[1]->last_alert);
  sp_test_free_msg(l);
  return s;
}

static double since_s(uint64_t t0) { return (uv_hrtime() - t0) / 1e9; }

/* Rank 1 goes silent while rank 0 heartbeats and the agent says both are
 * alive (cpu: the pressure it reports): returns when rank 1 is lost (or
 * after limit_s), with when that was seen and whether its loss was
 * withheld meanwhile. */
static double silence(world *w, float cpu, double limit_s, bool *withheld,
                      seen *last) {
  static const uint32_t both[] = {0, 1};
  uint64_t t0 = uv_hrtime();
  *withheld = false;
  while (since_s(t0) < limit_s) {
    Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
    sp_fake_rank_send_up(&w->r[0], &up);
    agent_alive(w, both, 2, cpu);
    *last = rank1(w);
    if (last->status == SHARDPLANE__V1__RANK_STATUS__LOST) return since_s(t0);
    if (last->withheld) *withheld = true;
    sp_test_sleep_ms(50);
  }
  return since_s(t0);
}

static void test_alive_under_pressure_waits_then_hung(void **state) {
  (void)state;
  world w;
  world_start(&w);
  bool withheld;
  seen s;
  double t = silence(&w, 85.0f, 8.0, &withheld, &s);
  assert_int_equal(s.status, SHARDPLANE__V1__RANK_STATUS__LOST);
  /* not lost at the timeout: waited for, then lost past the grace */
  assert_true(withheld);
  if (t < (TIMEOUT_MS + GRACE_MS) / 1000.0 - 0.05)
    fail_msg("lost after %.2f s, within the grace", t);
  if (strstr(s.last_alert, "although its process was alive on host h1") ==
          NULL ||
      strstr(s.last_alert, "hung") == NULL)
    fail_msg("the verdict: %s", s.last_alert);
  world_stop(&w);
}

static void test_alive_on_a_quiet_host_lost_at_timeout(void **state) {
  (void)state;
  world w;
  world_start(&w);
  bool withheld;
  seen s;
  double t = silence(&w, 1.0f, 8.0, &withheld, &s);
  assert_int_equal(s.status, SHARDPLANE__V1__RANK_STATUS__LOST);
  assert_false(withheld);
  /* the timeout and a check period, with room for a loaded machine, but
   * well short of the grace */
  if (t > (TIMEOUT_MS + GRACE_MS) / 1000.0 - 0.3)
    fail_msg("lost only after %.2f s", t);
  assert_non_null(strstr(s.last_alert, "no heartbeat for"));
  world_stop(&w);
}

static void test_own_gaps_explain_the_silence(void **state) {
  (void)state;
  world w;
  world_start(&w);
  /* rank 1 was descheduled for 0.9 s, says so, then goes silent */
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.sched_gap_ms = 900;
  sp_fake_rank_send_up(&w.r[1], &up);
  assert_int_equal(rank1(&w).gap_ms, 900);
  bool withheld;
  seen s;
  double t = silence(&w, 0.0f, 8.0, &withheld, &s);
  assert_int_equal(s.status, SHARDPLANE__V1__RANK_STATUS__LOST);
  assert_true(withheld);
  if (t < (TIMEOUT_MS + GRACE_MS) / 1000.0 - 0.05)
    fail_msg("lost after %.2f s, within the grace", t);
  world_stop(&w);
}

static void test_process_gone_lost_at_once(void **state) {
  (void)state;
  world w;
  world_start(&w);
  static const uint32_t both[] = {0, 1}, only0[] = {0};
  agent_alive(&w, both, 2, 85.0f);
  assert_int_equal(rank1(&w).status, SHARDPLANE__V1__RANK_STATUS__ATTACHED);
  /* rank 1's process is gone; its stream is still open (and the host is
   * loaded): lost at once, well within the heartbeat timeout */
  uint64_t t0 = uv_hrtime();
  agent_alive(&w, only0, 1, 85.0f);
  seen s = rank1(&w);
  for (int i = 0; i < 100 && s.status != SHARDPLANE__V1__RANK_STATUS__LOST;
       i++) {
    sp_test_sleep_ms(5);
    s = rank1(&w);
  }
  assert_int_equal(s.status, SHARDPLANE__V1__RANK_STATUS__LOST);
  if (since_s(t0) > TIMEOUT_MS / 1000.0)
    fail_msg("lost only after %.2f s", since_s(t0));
  if (strstr(s.last_alert, "its process is gone from host h1") == NULL)
    fail_msg("the verdict: %s", s.last_alert);
  world_stop(&w);
}

int main(int argc, char **argv) {
  if (argc > 1) cmocka_set_test_filter(argv[1]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_alive_under_pressure_waits_then_hung),
      cmocka_unit_test(test_alive_on_a_quiet_host_lost_at_timeout),
      cmocka_unit_test(test_own_gaps_explain_the_silence),
      cmocka_unit_test(test_process_gone_lost_at_once),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
