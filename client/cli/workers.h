/* Local worker processes, as `shardplane run` and `shardplane agent` start
 * and watch them: each in its own process group with its stdout and stderr
 * on pipes, every line passed on whole and prefixed with the time and the
 * rank ("12:03:04.567 [rank1]: ..."), stdout to stdout and stderr to
 * stderr, so every rank's errors show and no two lines mix. Not installed;
 * one thread (the command's main thread) uses all of it. */
#ifndef SP_CLI_WORKERS_H
#define SP_CLI_WORKERS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

/* At most this many workers on one host (the poll set is on the stack). */
#define SP_WORKERS_MAX 256

/* One output pipe of one worker. */
typedef struct sp_out_stream {
  int fd; /* read end; -1 once closed */
  int rank;
  FILE *to;
  size_t len;
  char line[4096]; /* longer lines are passed on in pieces */
} sp_out_stream;

/* Waits up to timeout_ms for output and passes on every whole line that
 * came. Returns how many streams are still open. */
size_t sp_workers_pass_output(sp_out_stream *st, size_t n, int timeout_ms);
/* Closes the read ends left open (st may be NULL). */
void sp_workers_close_streams(sp_out_stream *st, size_t n);
/* One output line as the workers' are shown: the time, [who], text (len
 * bytes, no newline), in one write, flushed. */
void sp_workers_print_line(FILE *to, const char *who, const char *text,
                           size_t len);

/* Starts argv[0] with environment envp (NULL: this process's) in its own
 * process group (Ctrl-C reaches the launcher, which stops the workers in
 * order), its stdout and stderr on pipes whose read ends go to out and
 * err. Returns the pid, or -1 with errno set. */
pid_t sp_workers_spawn(char *const argv[], char *const envp[],
                       sp_out_stream *out, sp_out_stream *err);

/* "was killed by signal 9 (Killed)" or "exited with status 1", from a
 * waitpid status. */
void sp_workers_describe(int status, char *out, size_t cap);

/* SIGTERM to every live worker (pids[r] > 0), SIGKILL after wait_ms;
 * reaps them all and zeroes their pids. */
void sp_workers_stop(pid_t *pids, uint32_t n, int wait_ms);

#endif
