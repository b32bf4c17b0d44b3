/* Local worker processes: spawning, their output, stopping (workers.h). */
#include "workers.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"

extern char **environ;

void sp_workers_print_line(FILE *to, const char *who, const char *text,
                           size_t len) {
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  localtime_r(&ts.tv_sec, &tm);
  /* one write per line (stderr is unbuffered, stdout is flushed) */
  fprintf(to, "%02d:%02d:%02d.%03ld [%s]: %.*s\n", tm.tm_hour, tm.tm_min,
          tm.tm_sec, ts.tv_nsec / 1000000, who, (int)len, text);
  fflush(to);
}

static void emit_line(const sp_out_stream *s) {
  char who[24];
  snprintf(who, sizeof who, "rank%d", s->rank);
  sp_workers_print_line(s->to, who, s->line, s->len);
}

/* Reads what the pipe has and passes on every whole line; at the end of
 * the stream the rest goes out as a line and the stream closes. */
static void drain(sp_out_stream *s) {
  char chunk[4096];
  ssize_t n = read(s->fd, chunk, sizeof chunk);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n <= 0) {
    if (s->len > 0) emit_line(s);
    s->len = 0;
    close(s->fd);
    s->fd = -1;
    return;
  }
  for (ssize_t i = 0; i < n; i++) {
    if (chunk[i] == '\n' || s->len == sizeof s->line) {
      emit_line(s);
      s->len = 0;
      if (chunk[i] == '\n') continue;
    }
    s->line[s->len++] = chunk[i];
  }
}

size_t sp_workers_pass_output(sp_out_stream *st, size_t n, int timeout_ms) {
  struct pollfd fds[2 * SP_WORKERS_MAX];
  size_t idx[2 * SP_WORKERS_MAX], k = 0;
  for (size_t i = 0; i < n && k < 2 * SP_WORKERS_MAX; i++)
    if (st[i].fd >= 0) {
      fds[k] = (struct pollfd){st[i].fd, POLLIN, 0};
      idx[k++] = i;
    }
  if (k == 0) {
    if (timeout_ms > 0) usleep((useconds_t)timeout_ms * 1000);
    return 0;
  }
  if (poll(fds, k, timeout_ms) > 0)
    for (size_t i = 0; i < k; i++)
      if (fds[i].revents) drain(&st[idx[i]]);
  size_t open = 0;
  for (size_t i = 0; i < n; i++) open += st[i].fd >= 0;
  return open;
}

void sp_workers_close_streams(sp_out_stream *st, size_t n) {
  for (size_t i = 0; st && i < n; i++)
    if (st[i].fd >= 0) {
      close(st[i].fd);
      st[i].fd = -1;
    }
}

pid_t sp_workers_spawn(char *const argv[], char *const envp[],
                       sp_out_stream *out, sp_out_stream *err) {
  int po[2], pe[2];
  if (pipe2(po, O_CLOEXEC) != 0) return -1;
  if (pipe2(pe, O_CLOEXEC) != 0) {
    close(po[0]);
    close(po[1]);
    return -1;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, po[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, pe[1], STDERR_FILENO);
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  /* the launcher ignores SIGPIPE (its sockets say EPIPE instead); the
   * trainer starts with the default, as from a shell */
  sigset_t def;
  sigemptyset(&def);
  sigaddset(&def, SIGPIPE);
  posix_spawnattr_setsigdefault(&at, &def);
  posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&at, 0);
  pid_t pid;
  /* a trainer named without a slash is looked up on PATH, as torchrun */
  int rc =
      strchr(argv[0], '/')
          ? posix_spawn(&pid, argv[0], &fa, &at, argv, envp ? envp : environ)
          : posix_spawnp(&pid, argv[0], &fa, &at, argv, envp ? envp : environ);
  posix_spawnattr_destroy(&at);
  posix_spawn_file_actions_destroy(&fa);
  close(po[1]);
  close(pe[1]);
  if (rc != 0) {
    close(po[0]);
    close(pe[0]);
    errno = rc;
    return -1;
  }
  fcntl(po[0], F_SETFL, O_NONBLOCK);
  fcntl(pe[0], F_SETFL, O_NONBLOCK);
  out->fd = po[0];
  err->fd = pe[0];
  return pid;
}

void sp_workers_describe(int st, char *out, size_t cap) {
  if (WIFSIGNALED(st))
    snprintf(out, cap, "was killed by signal %d (%s)", WTERMSIG(st),
             strsignal(WTERMSIG(st)));
  else
    snprintf(out, cap, "exited with status %d", WEXITSTATUS(st));
}

void sp_workers_stop(pid_t *pids, uint32_t n, int wait_ms) {
  for (uint32_t r = 0; r < n; r++)
    if (pids[r] > 0) kill(pids[r], SIGTERM);
  double end = sp_clock_s() + wait_ms / 1000.0;
  for (;;) {
    bool live = false;
    for (uint32_t r = 0; r < n; r++) {
      if (pids[r] <= 0) continue;
      if (waitpid(pids[r], NULL, WNOHANG) == pids[r])
        pids[r] = 0;
      else
        live = true;
    }
    if (!live) return;
    if (sp_clock_s() > end) break;
    usleep(10000);
  }
  for (uint32_t r = 0; r < n; r++)
    if (pids[r] > 0) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], NULL, 0);
      pids[r] = 0;
    }
}
