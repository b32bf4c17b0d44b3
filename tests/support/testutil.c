#include "testutil.h"
#include "shardplane/config.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/clock.h"
#include "capture.h"

#if SHARDPLANE_HAVE_CUDA
#include "cast/cast_cuda.h"
#include "base/sp_error.h"

extern char **environ;
#endif

int sp_test_skip(const char *why) {
  printf("SKIPPED: %s\n", why);
  fflush(stdout);
  return SP_TEST_SKIP_RC;
}

int sp_test_need_cuda_device(void) {
#if !SHARDPLANE_HAVE_CUDA
  return sp_test_skip(
      "built without CUDA (no CUDA toolkit at configure "
      "time, or -DSHARDPLANE_CUDA=OFF as in ./dev test's "
      "sanitizer build)");
#else
  int n = 0;
  int rc = sp_cuda_device_count(&n);
  if (rc != 0) {
    char why[128];
    snprintf(why, sizeof why, "cannot query CUDA devices (%s)",
             sp_strerror(rc));
    return sp_test_skip(why);
  }
  if (n == 0) return sp_test_skip("no CUDA device (or no driver) present");
  return 0;
#endif
}

uint64_t sp_test_rng_next(sp_test_rng *r) {
  uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t sp_test_rng_below(sp_test_rng *r, uint64_t n) {
  return sp_test_rng_next(r) % n;
}

char *sp_test_mkdtemp(void) {
  char path[4096];
  assert_int_equal(sp_test_tmpdir(NULL, "shardplane-test", path, sizeof path),
                   0);
  char *p = strdup(path);
  assert_non_null(p);
  return p;
}

char *sp_test_path(const char *dir, const char *name) {
  size_t n = strlen(dir) + strlen(name) + 2;
  char *p = malloc(n);
  assert_non_null(p);
  snprintf(p, n, "%s/%s", dir, name);
  return p;
}

char *sp_test_first_file(const char *dir, const char *suffix) {
  DIR *d = opendir(dir);
  if (!d) return NULL;
  struct dirent *e;
  char *found = NULL;
  while (!found && (e = readdir(d)) != NULL) {
    size_t n = strlen(e->d_name), m = strlen(suffix);
    if (n > m && strcmp(e->d_name + n - m, suffix) == 0)
      found = sp_test_path(dir, e->d_name);
  }
  closedir(d);
  return found;
}

char *sp_test_read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  size_t cap = 1 << 16, len = 0, n;
  char *buf = malloc(cap);
  assert_non_null(buf);
  while ((n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
    len += n;
    if (len + 1 == cap) {
      cap *= 2;
      buf = realloc(buf, cap);
      assert_non_null(buf);
    }
  }
  fclose(f);
  buf[len] = '\0';
  return buf;
}

void sp_test_write_file(const char *path, const void *data, size_t len) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, len, f), len);
  assert_int_equal(fclose(f), 0);
}

int sp_test_shell(const char *cmd, char **out) {
  int status;
  if (sp_test_capture(cmd, out, &status) != 0) fail_msg("cannot run %s", cmd);
  return status;
}

char *sp_test_dir;

int sp_test_dir_setup(void **state) {
  (void)state;
  sp_test_dir = sp_test_mkdtemp();
  return 0;
}

int sp_test_dir_teardown(void **state) {
  (void)state;
  sp_test_rmtree(sp_test_dir);
  free(sp_test_dir);
  sp_test_dir = NULL;
  return 0;
}

void sp_test_sleep_ms(unsigned ms) {
  struct timespec ts = {.tv_sec = ms / 1000,
                        .tv_nsec = (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

void sp_test_same_f32(const char *what, const float *got, const float *want,
                      size_t n) {
  for (size_t i = 0; i < n; i++)
    if (memcmp(&got[i], &want[i], 4) != 0)
      fail_msg(
          "%s: element %zu of %zu: GPU %.9g, CPU %.9g (bit-exact "
          "expected)",
          what, i, n, (double)got[i], (double)want[i]);
}

int sp_test_spawn_logged(const char *out, const char *err, char *const *argv) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&fa, 2, err, O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  pid_t pid;
  int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) fail_msg("cannot start %s: %s", argv[0], strerror(rc));
  return (int)pid;
}

int sp_test_wait_exit(int pid, double timeout_s) {
  double end = sp_clock_s() + timeout_s;
  while (sp_clock_s() < end) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    usleep(10000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return -1;
}

long sp_test_proc_file(int pid, const char *what, char *buf, size_t cap) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/%s", pid, what);
  FILE *f = fopen(path, "r");
  if (f == NULL) return -1;
  size_t len = fread(buf, 1, cap - 1, f);
  fclose(f);
  buf[len] = '\0';
  return (long)len;
}

size_t sp_test_children(int parent, int *out, size_t cap) {
  DIR *d = opendir("/proc");
  assert_non_null(d);
  struct dirent *e;
  size_t n = 0;
  while (n < cap && (e = readdir(d)) != NULL) {
    int pid = atoi(e->d_name);
    char buf[1024];
    if (pid <= 0 || sp_test_proc_file(pid, "stat", buf, sizeof buf) < 0)
      continue;
    /* the name in parentheses may hold spaces and parentheses itself */
    char *cp = strrchr(buf, ')');
    int ppid = 0;
    char st;
    if (cp && sscanf(cp + 2, "%c %d", &st, &ppid) == 2 && ppid == parent)
      out[n++] = pid;
  }
  closedir(d);
  return n;
}

uint64_t sp_test_proc_status_kib(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  assert_non_null(f);
  char line[256];
  uint64_t v = 0;
  size_t kl = strlen(key);
  while (fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, key, kl) == 0 && line[kl] == ':')
      v = strtoull(line + kl + 1, NULL, 10);
  fclose(f);
  return v;
}
