#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

int sp_proc_read_line(int fd, char *line, size_t cap, int timeout_ms) {
  size_t have = 0;
  line[0] = '\0';
  while (have < cap - 1) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) <= 0) return -1;
    ssize_t n = read(fd, line + have, cap - 1 - have);
    if (n <= 0) return -1;
    have += (size_t)n;
    line[have] = '\0';
    if (strchr(line, '\n') != NULL) return 0;
  }
  return -1;
}

int sp_proc_spawn(sp_proc *ch, char *const argv[], bool with_stdin,
                  bool own_group, const char *port_fmt, sp_diag *diag) {
  int in[2] = {-1, -1}, out[2];
  ch->pid = -1;
  ch->to_child = -1;
  ch->port = 0;
  /* close-on-exec everywhere: the child gets only its stdin and stdout */
  if (pipe2(out, O_CLOEXEC) != 0)
    return sp_diag_set(diag, SP_EIO, "pipe: %s", strerror(errno));
  if (with_stdin && pipe2(in, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return sp_diag_set(diag, SP_EIO, "pipe: %s", strerror(errno));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (with_stdin) posix_spawn_file_actions_adddup2(&fa, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
  posix_spawnattr_t at;
  posix_spawnattr_init(&at);
  if (own_group) {
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&at, 0);
  }
  int rc = posix_spawn(&ch->pid, argv[0], &fa, &at, argv, environ);
  posix_spawnattr_destroy(&at);
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  if (with_stdin) close(in[0]);
  ch->to_child = in[1];
  if (rc != 0) {
    close(out[0]);
    if (ch->to_child >= 0) close(ch->to_child);
    ch->to_child = -1;
    return sp_diag_set(diag, SP_EIO, "cannot start %s: %s", argv[0],
                       strerror(rc));
  }
  ch->line[0] = '\0';
  if (sp_proc_read_line(out[0], ch->line, sizeof ch->line, 20000) == 0)
    sscanf(ch->line, port_fmt, &ch->port);
  close(out[0]);
  if (ch->port <= 0) {
    if (ch->to_child >= 0) close(ch->to_child);
    ch->to_child = -1;
    kill(ch->pid, SIGKILL);
    waitpid(ch->pid, NULL, 0);
    return sp_diag_set(diag, SP_EIO, "%s did not report its port", argv[0]);
  }
  return 0;
}

int sp_proc_stop(sp_proc *ch, int wait_ms) {
  if (ch->to_child >= 0) close(ch->to_child);
  ch->to_child = -1;
  /* already reaped: kill(0) would signal our own process group */
  if (ch->pid <= 0) return -1;
  kill(ch->pid, SIGTERM);
  for (int i = 0; i < wait_ms / 10; i++) {
    int st;
    if (waitpid(ch->pid, &st, WNOHANG) == ch->pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    usleep(10 * 1000);
  }
  kill(ch->pid, SIGKILL);
  waitpid(ch->pid, NULL, 0);
  return -1;
}
