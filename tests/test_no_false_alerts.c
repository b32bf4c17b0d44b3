/* No false alert: 2,000 normal steps (500 under a sanitizer) across the
 * strategies and mixed precision, 4 real ranks over Gloo, with another
 * process burning a core all along, give no DESYNC, STALL or STRAGGLER
 * alert (nor any other), and every job ends COMPLETED. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/clock.h"
#include "rpc/coord_service.h"
#include "support/coord_fixture.h"
#include "support/job_fixture.h"
#include "support/testutil.h"

#define MLP SP_EXAMPLES "/mlp.json"

/* Steps of each of the 4 jobs: 2,000 in all. A sanitizer build runs a
 * quarter of them, every strategy still, so that the detectors are checked
 * at its pace too without its 100 s (the suite runs twice in CI). */
#ifdef __SANITIZE_ADDRESS__
#define JOB_STEPS 125
#else
#define JOB_STEPS 500
#endif
#define STR_(x) #x
#define STR(x) STR_(x)

static pid_t g_burner = -1;

static int stop_burner(void **state) {
  (void)state;
  if (g_burner > 0) {
    kill(g_burner, SIGKILL);
    waitpid(g_burner, NULL, 0);
    g_burner = -1;
  }
  return 0;
}

static void test_no_false_alerts(void **state) {
  (void)state;
  static const struct {
    const char *strategy, *group;
    bool mp;
  } cfgs[] = {{"FULL_SHARD", NULL, false},
              {"SHARD_GRAD_OP", NULL, true},
              {"NO_SHARD", NULL, false},
              {"HYBRID_SHARD", "2", true}};
  g_burner = fork();
  if (g_burner == 0) {
    /* it must not outlive a test that failed half way */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    for (volatile uint64_t x = 0;; x++) {
    }
  }
  assert_true(g_burner > 0);
  int total = 0;
  for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++) {
    char *dir = sp_test_mkdtemp();
    const char *cflags[] = {"--wrap-type",
                            "Linear",
                            "--strategy",
                            cfgs[i].strategy,
                            cfgs[i].mp ? "--param-dtype" : "--stall-timeout-ms",
                            cfgs[i].mp ? "bfloat16" : "10000",
                            cfgs[i].group ? "--shard-group-size" : NULL,
                            cfgs[i].group,
                            NULL};
    const char *wflags[] = {"--steps", STR(JOB_STEPS), "--checkpoint", "none",
                            NULL};
    sp_tjob j;
    double t0 = sp_clock_s();
    sp_tjob_start(&j, MLP, cflags, 4, wflags, dir);
    sp_rpc_sync *cli;
    sp_rpc_client_opts o = {.connect_timeout_ms = 5000,
                            .token = j.auth.token[SP_ROLE_READER]};
    assert_int_equal(sp_rpc_sync_open_opts(j.addr, &o, &cli), 0);
    Shardplane__V1__GetJobResponse *g = NULL;
    while (sp_clock_s() - t0 < 300) {
      Shardplane__V1__GetJobRequest q = SHARDPLANE__V1__GET_JOB_REQUEST__INIT;
      sp_rpc_status st;
      sp_test_free_msg(g);
      g = (void *)sp_test_unary(cli, SP_COORD_PATH("GetJob"), &q.base,
                                &shardplane__v1__get_job_response__descriptor,
                                2000, &st);
      if (g && g->state >= SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED) break;
      usleep(100000);
    }
    sp_rpc_sync_close(cli);
    assert_non_null(g);
    for (size_t k = 0; k < g->n_recent_alerts; k++)
      printf("  alert %d: %s\n", g->recent_alerts[k]->kind,
             g->recent_alerts[k]->message);
    printf("%s%s: %llu steps in %.1f s, state %d, %u alerts\n",
           cfgs[i].strategy, cfgs[i].mp ? " (bfloat16)" : "",
           (unsigned long long)g->progress->step, sp_clock_s() - t0, g->state,
           g->alerts);
    assert_int_equal(g->state, SHARDPLANE__V1__JOB_STATE__JOB_COMPLETED);
    assert_int_equal(g->alerts, 0);
    total += (int)g->progress->step;
    sp_test_free_msg(g);
    assert_int_equal(sp_tjob_wait(&j, 60), 4);
    sp_test_rmtree(dir);
    free(dir);
  }
  printf("no false alert over %d steps\n", total);
  assert_int_equal(total, 4 * JOB_STEPS);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_no_false_alerts, stop_burner),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
