/* Child processes that announce themselves on stdout: the benchmarks'
 * servers and the coordinator `shardplane run` starts. */
#ifndef SP_PROC_H
#define SP_PROC_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "sp_error.h"

/* Reads from fd until a newline, at most cap-1 bytes, waiting at most
 * timeout_ms for each read; line is NUL-terminated. Returns 0 when a whole
 * line arrived, -1 otherwise (timeout, EOF, error). */
int sp_proc_read_line(int fd, char *line, size_t cap, int timeout_ms);

/* A server process that prints the port it listens on. */
typedef struct sp_proc {
  pid_t pid;
  int to_child; /* its stdin when asked for (closing it stops some
                   servers), else -1 */
  int port;
  char line[160]; /* its first line, whatever else it says */
} sp_proc;

/* Starts argv[0] with its stdout on a pipe (and its stdin too when
 * with_stdin; in a process group of its own when own_group, so a terminal's
 * Ctrl-C reaches only the parent, which then stops it), then waits up to 20 s for its first line, from which
 * sscanf(line, port_fmt, &port) takes the port. On failure the child is
 * killed and reaped, and diag says why (SP_EIO). */
int sp_proc_spawn(sp_proc *ch, char *const argv[], bool with_stdin,
                  bool own_group, const char *port_fmt, sp_diag *diag);

/* Closes its stdin, sends SIGTERM, waits up to wait_ms, then SIGKILL.
 * Returns the exit status, 128 + signal, or -1 when it had to be killed
 * or was reaped already (pid 0). */
int sp_proc_stop(sp_proc *ch, int wait_ms);

#endif
