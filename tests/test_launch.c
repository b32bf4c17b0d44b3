/* A worker's identity from the environment, as launchers set it, and the
 * address its Gloo peers reach it at. */
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
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
#include "support/job_fixture.h"
#include "support/testutil.h"

extern char **environ;

static const char *const k_vars[] = {
    "RANK",         "LOCAL_RANK",    "WORLD_SIZE",   "LOCAL_WORLD_SIZE",
    "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", SP_COORDINATOR_ENV};

static int clear_env(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof k_vars / sizeof k_vars[0]; i++)
    unsetenv(k_vars[i]);
  return 0;
}

static void test_nothing_set(void **state) {
  (void)state;
  sp_launch_env e;
  sp_diag d = {{0}};
  assert_int_equal(sp_launch_env_read(&e, &d), 0);
  assert_int_equal(e.rank, -1);
  assert_int_equal(e.local_rank, -1);
  assert_int_equal(e.world_size, -1);
  assert_int_equal(e.local_world_size, -1);
  assert_null(e.coordinator);
  assert_null(e.rank_var);
}

static void test_torchrun(void **state) {
  (void)state;
  setenv("RANK", "5", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_WORLD_SIZE", "4", 1);
  setenv(SP_COORDINATOR_ENV, "10.0.0.1:7700", 1);
  /* torchrun's names win over Slurm's where both are set */
  setenv("SLURM_PROCID", "3", 1);
  sp_launch_env e;
  sp_diag d = {{0}};
  assert_int_equal(sp_launch_env_read(&e, &d), 0);
  assert_int_equal(e.rank, 5);
  assert_string_equal(e.rank_var, "RANK");
  assert_int_equal(e.local_rank, 1);
  assert_int_equal(e.world_size, 8);
  assert_int_equal(e.local_world_size, 4);
  assert_string_equal(e.coordinator, "10.0.0.1:7700");
}

static void test_slurm(void **state) {
  (void)state;
  setenv("SLURM_PROCID", "6", 1);
  setenv("SLURM_LOCALID", "2", 1);
  setenv("SLURM_NTASKS", "16", 1);
  sp_launch_env e;
  sp_diag d = {{0}};
  assert_int_equal(sp_launch_env_read(&e, &d), 0);
  assert_int_equal(e.rank, 6);
  assert_string_equal(e.rank_var, "SLURM_PROCID");
  assert_int_equal(e.local_rank, 2);
  assert_string_equal(e.local_rank_var, "SLURM_LOCALID");
  assert_int_equal(e.world_size, 16);
  assert_string_equal(e.world_size_var, "SLURM_NTASKS");
}

static void test_bad_values_name_the_variable(void **state) {
  (void)state;
  sp_launch_env e;
  sp_diag d = {{0}};
  setenv("RANK", "two", 1);
  assert_int_equal(sp_launch_env_read(&e, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "$RANK"));
  assert_non_null(strstr(d.msg, "two"));
  setenv("RANK", "4", 1);
  setenv("WORLD_SIZE", "0", 1);
  assert_int_equal(sp_launch_env_read(&e, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "$WORLD_SIZE"));
  setenv("WORLD_SIZE", "4", 1);
  assert_int_equal(sp_launch_env_read(&e, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "$RANK=4 is not below $WORLD_SIZE=4"));
}

static void test_local_addr_loopback(void **state) {
  (void)state;
  char a[64];
  sp_diag d = {{0}};
  assert_int_equal(sp_local_addr_toward("127.0.0.1:7700", a, sizeof a, &d), 0);
  assert_string_equal(a, "127.0.0.1");
  assert_int_equal(sp_local_addr_toward("localhost:7700", a, sizeof a, &d), 0);
  assert_true(strcmp(a, "127.0.0.1") == 0 || strcmp(a, "::1") == 0);
  assert_int_equal(sp_local_addr_toward("no port", a, sizeof a, &d), SP_EINVAL);
}

/* Toward another host, the address is that of an interface that is not
 * loopback: the one the route to it leaves from. */
static void test_local_addr_route(void **state) {
  (void)state;
  char a[64];
  sp_diag d = {{0}};
  int rc = sp_local_addr_toward("192.0.2.1:7700", a, sizeof a, &d);
  if (rc == SP_EIO) {
    print_message("skipped: no route off this host (%s)\n", d.msg);
    skip();
  }
  assert_int_equal(rc, 0);
  assert_true(strncmp(a, "127.", 4) != 0);
}

static pid_t spawn_env_worker(const char *const *env_add, const char *err) {
  char *envp[256];
  size_t n = 0;
  for (const char *const *p = env_add; *p; p++) envp[n++] = (char *)*p;
  for (char **e = environ; *e && n < 254; e++) envp[n++] = *e;
  envp[n] = NULL;
  const char *argv[] = {SP_BIN_DIR "/shardplane-worker",
                        "--log-every",
                        "0",
                        "--steps",
                        "2",
                        "--insecure",
                        NULL};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (err != NULL)
    posix_spawn_file_actions_addopen(&fa, 2, err, O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, (char *const *)argv, envp);
  posix_spawn_file_actions_destroy(&fa);
  assert_int_equal(rc, 0);
  return pid;
}

static int wait_exit(pid_t pid, double timeout_s) {
  double end = sp_clock_s() + timeout_s;
  int st;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (sp_clock_s() > end) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    sp_test_sleep_ms(20);
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Rank 1 of a 2-rank job gets everything from the environment, as under
 * torchrun; rank 0 from its flags. Both train. */
static void test_worker_from_env(void **state) {
  (void)state;
  const char *const wflags[] = {"--steps", "2", NULL};
  sp_tjob j;
  /* the fixture starts a 1-worker job; the coordinator must want 2 */
  const char *const cf2[] = {"--world-size", "2", NULL};
  sp_tjob_start(&j, SP_EXAMPLES "/mlp.json", cf2, 1, wflags, NULL);
  char coord[96], token[96];
  snprintf(coord, sizeof coord, SP_COORDINATOR_ENV "=%s", j.addr);
  /* the token from the environment too */
  snprintf(token, sizeof token, "SHARDPLANE_TOKEN=%s",
           j.auth.token[SP_ROLE_WORKER]);
  const char *const env[] = {"RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1",
                             coord,    token,          NULL};
  pid_t w1 = spawn_env_worker(env, NULL);
  int st1 = wait_exit(w1, 60);
  int ok = sp_tjob_wait(&j, 60);
  assert_int_equal(st1, 0);
  assert_int_equal(ok, 1);
}

/* A launcher that started another number of processes than the job has
 * ranks is named at once, instead of a rendezvous that never completes. */
static void test_world_size_mismatch(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *err = sp_test_path(dir, "worker.err");
  sp_tjob j;
  const char *const cf2[] = {"--world-size", "2", NULL};
  const char *const wflags[] = {"--steps", "2", NULL};
  sp_tjob_start(&j, SP_EXAMPLES "/mlp.json", cf2, 1, wflags, NULL);
  char coord[96], token[96];
  snprintf(coord, sizeof coord, SP_COORDINATOR_ENV "=%s", j.addr);
  snprintf(token, sizeof token, "SHARDPLANE_TOKEN=%s",
           j.auth.token[SP_ROLE_WORKER]);
  const char *const env[] = {"RANK=1", "WORLD_SIZE=3", coord, token, NULL};
  pid_t w1 = spawn_env_worker(env, err);
  int st1 = wait_exit(w1, 60);
  sp_tjob_wait(&j, 0.5); /* rank 0 waits for a rank 1 that left: stop it */
  char *msg = sp_test_read_file(err);
  assert_int_equal(st1, 1);
  assert_non_null(strstr(msg,
                         "$WORLD_SIZE=3 but the coordinator's job has "
                         "world size 2"));
  free(msg);
  free(err);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_nothing_set, clear_env),
      cmocka_unit_test_setup(test_torchrun, clear_env),
      cmocka_unit_test_setup(test_slurm, clear_env),
      cmocka_unit_test_setup(test_bad_values_name_the_variable, clear_env),
      cmocka_unit_test_setup(test_local_addr_loopback, clear_env),
      cmocka_unit_test_setup(test_local_addr_route, clear_env),
      cmocka_unit_test_setup(test_worker_from_env, clear_env),
      cmocka_unit_test_setup(test_world_size_mismatch, clear_env),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
