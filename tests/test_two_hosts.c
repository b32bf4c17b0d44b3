/* Two hosts for real: two network namespaces joined by a veth pair, the
 * coordinator and rank 0 in one, rank 1 in the other, so every address a
 * worker advertises must be one the other host can reach. Then the link of
 * rank 1's host goes down: for less than the heartbeat timeout the job
 * goes on; for longer, rank 1 is named lost, the job ends and nothing is
 * left running. The control plane is exposed as on a cluster network: TLS
 * (the workers verify the coordinator's certificate) and bearer tokens.
 * Needs root, iproute2 and the openssl command; otherwise it says
 * skipped. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/clock.h"
#include "base/proc.h"
#include "support/auth_fixture.h"
#include "support/netns_fixture.h"
#include "support/test_certs.h"
#include "support/testutil.h"

extern char **environ;

static sp_tnet g_net;         /* the two hosts */
static char *g_dir;           /* logs */
static sp_test_certs g_certs; /* the coordinator's certificate and its CA */
static sp_tauth g_auth;       /* the job's tokens */

static void link_set(int host, const char *updown) {
  assert_int_equal(sp_tnet_sh("%s -n %s link set %s %s", g_net.ip,
                              g_net.ns[host], g_net.veth[host], updown),
                   0);
}

/* A process inside host's namespace; its stdout on *out_fd when asked
 * for, its stderr in g_dir/<log>. */
static pid_t spawn_in(int host, const char *const *args, int *out_fd,
                      const char *log) {
  const char *argv[64] = {g_net.ip, "netns", "exec", g_net.ns[host]};
  size_t n = 4;
  for (; *args && n < 63; args++) argv[n++] = *args;
  argv[n] = NULL;
  int p[2] = {-1, -1};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (out_fd) {
    assert_int_equal(pipe2(p, O_CLOEXEC), 0);
    posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  }
  char *path = sp_test_path(g_dir, log);
  posix_spawn_file_actions_addopen(&fa, 2, path, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, (char *const *)argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  free(path);
  assert_int_equal(rc, 0);
  if (out_fd) {
    close(p[1]);
    *out_fd = p[0];
  }
  return pid;
}

/* Exit status (128 + signal), or -1 if still running at the deadline
 * (then it is killed). */
static int wait_exit(pid_t pid, double until) {
  int st;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (sp_clock_s() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      return -1;
    }
    sp_test_sleep_ms(20);
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Reads rank 0's progress lines until one says step >= step. */
static void wait_step(int fd, int step, double until) {
  char line[512];
  while (sp_clock_s() < until) {
    if (sp_proc_read_line(fd, line, sizeof line, 1000) != 0) continue;
    for (char *p = line; (p = strstr(p, "step ")) != NULL; p += 5) {
      int s;
      if (sscanf(p, "step %d/", &s) == 1 && s >= step) return;
    }
  }
  fail_msg("rank 0 never reached step %d", step);
}

typedef struct job {
  sp_proc coord;
  pid_t coord_pid, w[2];
  int progress; /* rank 0's stdout */
  char caddr[64];
} job;

static void job_start(job *j, int steps, int hb_timeout_ms) {
  char listen[64], st[16], hb[16];
  snprintf(listen, sizeof listen, "%s:0", g_net.addr[0]);
  snprintf(st, sizeof st, "%d", steps);
  snprintf(hb, sizeof hb, "%d", hb_timeout_ms);
  const char *ca[] = {g_net.ip,
                      "netns",
                      "exec",
                      g_net.ns[0],
                      SP_BIN_DIR "/shardplane-coordinator",
                      "--listen",
                      listen,
                      "--model",
                      SP_EXAMPLES "/mlp.json",
                      "--world-size",
                      "2",
                      "--heartbeat-timeout-ms",
                      hb,
                      "--tls-cert",
                      g_certs.server_cert,
                      "--tls-key",
                      g_certs.server_key,
                      "--token-file",
                      g_auth.token_file,
                      NULL};
  char fmt[64];
  snprintf(fmt, sizeof fmt, "listening on %s:%%d", g_net.addr[0]);
  sp_diag d = {{0}};
  if (sp_proc_spawn(&j->coord, (char *const *)ca, false, false, fmt, &d) != 0)
    fail_msg("coordinator: %s", d.msg);
  snprintf(j->caddr, sizeof j->caddr, "%s:%d", g_net.addr[0], j->coord.port);
  for (int r = 0; r < 2; r++) {
    char rs[4], log[32];
    snprintf(rs, sizeof rs, "%d", r);
    snprintf(log, sizeof log, "rank-%d.err", r);
    /* the certificate names the coordinator "localhost": the name it is
     * verified against, whatever address reaches it */
    const char *wa[] = {SP_BIN_DIR "/shardplane-worker",
                        "--coordinator",
                        j->caddr,
                        "--tls-ca",
                        g_certs.ca,
                        "--tls-server-name",
                        "localhost",
                        "--token-file",
                        g_auth.file[SP_ROLE_WORKER],
                        "--rank",
                        rs,
                        "--steps",
                        st,
                        "--log-every",
                        "10",
                        "--comm-timeout-ms",
                        "5000",
                        NULL};
    j->w[r] = spawn_in(r, wa, r == 0 ? &j->progress : NULL, log);
  }
}

static char *log_of(const char *name) {
  char *p = sp_test_path(g_dir, name);
  char *s = sp_test_read_file(p);
  free(p);
  return s;
}

/* The job across the two hosts trains, and a link outage shorter than the
 * heartbeat timeout is ridden out: TCP retransmits, heartbeats resume. */
static void test_short_outage(void **state) {
  (void)state;
  job j;
  job_start(&j, 400, 4000);
  double until = sp_clock_s() + 90;
  wait_step(j.progress, 50, until);
  link_set(1, "down");
  sp_test_sleep_ms(1000);
  /* training was under way: without rank 1 rank 0 cannot have finished */
  int st;
  assert_int_equal(waitpid(j.w[0], &st, WNOHANG), 0);
  link_set(1, "up");
  int s0 = wait_exit(j.w[0], until), s1 = wait_exit(j.w[1], until);
  int sc = sp_proc_stop(&j.coord, 5000);
  close(j.progress);
  if (s0 != 0 || s1 != 0) {
    char *e0 = log_of("rank-0.err"), *e1 = log_of("rank-1.err");
    fail_msg("rank 0 exited %d, rank 1 %d\nrank 0: %s\nrank 1: %s", s0, s1, e0,
             e1);
  }
  assert_int_equal(sc, 0);
}

/* Longer than the heartbeat timeout: rank 1 is named lost, rank 0 is
 * aborted naming it, and once the link is back rank 1 ends too. */
static void test_long_outage(void **state) {
  (void)state;
  job j;
  job_start(&j, 100000, 2000);
  double until = sp_clock_s() + 60;
  wait_step(j.progress, 50, until);
  double t0 = sp_clock_s();
  link_set(1, "down");
  int s0 = wait_exit(j.w[0], t0 + 30);
  double verdict_s = sp_clock_s() - t0;
  link_set(1, "up");
  int s1 = wait_exit(j.w[1], sp_clock_s() + 30);
  int sc = sp_proc_stop(&j.coord, 5000);
  close(j.progress);
  char *e0 = log_of("rank-0.err");
  print_message("rank 0 ended %.1f s after the link went down: %d\n", verdict_s,
                s0);
  assert_int_equal(s0, 1);
  assert_non_null(strstr(e0, "rank 1"));
  assert_true(s1 > 0); /* ended by itself, not still running */
  assert_int_equal(sc, 0);
  /* nothing of the job is left on either host */
  for (int h = 0; h < 2; h++)
    assert_int_equal(
        sp_tnet_sh("test -z \"$(%s netns pids %s)\"", g_net.ip, g_net.ns[h]),
        0);
  free(e0);
}

static int teardown(void **state) {
  (void)state;
  sp_tnet_down(&g_net);
  return 0;
}

int main(void) {
  char why[256];
  if (sp_tnet_up(&g_net, why, sizeof why) != 0) return sp_test_skip(why);
  g_dir = sp_test_mkdtemp();
  if (sp_test_certs_make(g_dir, &g_certs) != 0) {
    sp_tnet_down(&g_net);
    return sp_test_skip("cannot make test certificates (openssl command)");
  }
  sp_tauth_make(&g_auth);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_short_outage),
      cmocka_unit_test(test_long_outage),
  };
  int rc = cmocka_run_group_tests(tests, NULL, teardown);
  sp_tauth_free(&g_auth);
  sp_test_certs_free(&g_certs);
  sp_test_rmtree(g_dir);
  free(g_dir);
  return rc;
}
