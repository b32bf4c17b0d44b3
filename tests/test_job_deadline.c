/* A job that trains for longer than the deadline of one blocking call to
 * the coordinator: real shardplane-worker processes against a real
 * coordinator, the deadline shortened (--call-timeout-ms) so that the test
 * takes seconds rather than the default's 30 s. The calls after training
 * (leaving the communicators, Detach) run on connections that sat idle
 * since the rendezvous; their deadlines must count from when they are
 * made, so every rank exits 0. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <jansson.h>

#include "support/job_fixture.h"
#include "support/testutil.h"

#define MLP SP_EXAMPLES "/mlp.json"
#define RANKS 2
#define CALL_TIMEOUT_MS 500
/* training must outlast the deadline by this factor for the run to count */
#define OUTLAST 2.0

/* Rank 0's --stats file: the sum of its step durations in seconds, or -1
 * when it wrote none. */
static double training_seconds(const char *path) {
  json_error_t e;
  json_t *root = json_load_file(path, 0, &e);
  if (root == NULL) return -1;
  json_t *steps = json_object_get(root, "step_seconds");
  double sum = 0;
  size_t i;
  json_t *v;
  json_array_foreach(steps, i, v) sum += json_number_value(v);
  json_decref(root);
  return sum;
}

static void print_errors(const char *dir) {
  for (int r = 0; r < RANKS; r++) {
    char name[32];
    snprintf(name, sizeof name, "rank-%d.err", r);
    char *path = sp_test_path(dir, name);
    char *err = sp_test_read_file(path);
    fprintf(stderr, "  rank %d stderr: %s", r, err && *err ? err : "(empty)\n");
    free(err);
    free(path);
  }
}

/* How fast a step is depends on the machine: the steps grow until training
 * lasted OUTLAST times the deadline; every run on the way must end cleanly
 * too. */
static void test_training_longer_than_call_timeout(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *stats = sp_test_path(dir, "stats.json");
  const double want_s = OUTLAST * CALL_TIMEOUT_MS / 1000.0;
  uint32_t steps = 16;
  for (int attempt = 1;; attempt++) {
    char steps_s[16], cto_s[16];
    snprintf(steps_s, sizeof steps_s, "%u", steps);
    snprintf(cto_s, sizeof cto_s, "%d", CALL_TIMEOUT_MS);
    const char *cflags[] = {"--wrap-type", "Linear", NULL};
    const char *wflags[] = {
        "--steps", steps_s,   "--checkpoint", "none", "--call-timeout-ms",
        cto_s,     "--stats", stats,          NULL};
    remove(stats);
    sp_tjob j;
    sp_tjob_start(&j, MLP, cflags, RANKS, wflags, dir);
    int ok = sp_tjob_wait(&j, 120);
    double trained = training_seconds(stats);
    printf(
        "  %u steps: trained %.0f ms with a %d ms call deadline, %d of %d "
        "ranks exited 0\n",
        steps, trained * 1000, CALL_TIMEOUT_MS, ok, RANKS);
    if (ok != RANKS) {
      for (int r = 0; r < RANKS; r++)
        fprintf(stderr, "  rank %d: status %d\n", r, j.status[r]);
      print_errors(dir);
      fail_msg(
          "a job of %u steps (%.0f ms of training) failed with a %d ms "
          "call deadline",
          steps, trained * 1000, CALL_TIMEOUT_MS);
    }
    if (trained < 0) fail_msg("rank 0 wrote no %s", stats);
    if (trained >= want_s) break;
    if (attempt == 6)
      fail_msg("training never lasted %.0f ms (last: %u steps, %.0f ms)",
               want_s * 1000, steps, trained * 1000);
    /* enough for the target with a margin, at most 8 times as many */
    double f = trained > 0 ? 1.5 * want_s / trained : 8;
    steps = (uint32_t)(steps * (f > 8 ? 8 : f < 2 ? 2 : f));
  }
  sp_test_rmtree(dir);
  free(stats);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_training_longer_than_call_timeout),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
