/* shardplane: the operator's command. */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/flag.h"
#include "cli.h"

#define SP_VERSION "0.1.0"

static const struct {
  const char *name;
  int (*fn)(int, char **);
  const char *summary;
} k_commands[] = {
    {"status", sp_cmd_status,
     "the job at a glance: plan version, ranks per state, alerts"},
    {"ranks", sp_cmd_ranks, "every rank's state, step and last collective"},
    {"plan", sp_cmd_plan,
     "the sharding plan (the coordinator's, or offline with --model)"},
    {"where", sp_cmd_where, "which ranks hold which slices of a parameter"},
    {"buffers", sp_cmd_buffers, "original and compute dtype of each buffer"},
    {"watch", sp_cmd_watch, "print events as they happen"},
    {"why", sp_cmd_why, "the verdict: healthy, or who is stuck where and why"},
    {"trace", sp_cmd_trace, "a rank's recent events, from its flight recorder"},
    {"analyze", sp_cmd_analyze,
     "the first divergence in a dump (a file, or a live one)"},
    {"incarnations", sp_cmd_incarnations,
     "restarts: when each incarnation began, ended, and what ended it"},
    {"store", sp_cmd_store, "get, set, add, delete, cas in the store"},
    {"token", sp_cmd_token,
     "token create: a bearer token for a coordinator's token file"},
    {"agent", sp_cmd_agent,
     "start and supervise this host's workers of a job (as torchrun)"},
    {"run", sp_cmd_run,
     "run a whole job here: a coordinator and N CPU workers"},
};

void sp_cli_error(const char *cmd, const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* one write: stderr is unbuffered, and other processes (the workers of
   * `run`, a coordinator) may write to it between the pieces of a line */
  fprintf(stderr, "shardplane %s: %s\n", cmd, msg);
}

void sp_cli_try_help(const char *cmd) {
  char prog[64];
  snprintf(prog, sizeof prog, "shardplane%s%s", cmd ? " " : "", cmd ? cmd : "");
  sp_flag_try_help(prog);
}

int sp_cli_check_rank(const char *cmd, long long rank, uint32_t world) {
  if (rank < (long long)world) return SP_EXIT_OK;
  sp_cli_error(cmd, "--rank %lld: the world has ranks 0-%u", rank, world - 1);
  return SP_EXIT_NOT_FOUND;
}

int sp_cli_parse_uint(const char *s, long long max, long long *out) {
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (*s == '\0' || *end != '\0' || errno != 0 || v < 0 || v > max) return -1;
  *out = v;
  return 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: shardplane <command> [options]\n"
          "       (shardplane <command> --help for its options)\n"
          "\ncommands:\n");
  for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
    fprintf(f, "  %-12s %s\n", k_commands[i].name, k_commands[i].summary);
  fprintf(f,
          "\nThe remote commands ask the coordinator at --coordinator "
          "HOST:PORT,\nelse $" SP_COORDINATOR_ENV
          ", else " SP_DEFAULT_COORDINATOR
          "; all take --json.\n"
          "\nexit codes: 0 ok, 1 failure, 2 bad usage, 3 not found,\n"
          "            4 coordinator unreachable,\n"
          "            5 (why, analyze) an open alert or a divergence\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return SP_EXIT_USAGE;
  }
  const char *cmd = argv[1];
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 ||
      strcmp(cmd, "help") == 0) {
    usage(stdout);
    return SP_EXIT_OK;
  }
  if (strcmp(cmd, "--version") == 0) {
    printf("shardplane %s\n", SP_VERSION);
    return SP_EXIT_OK;
  }
  /* a reader that goes away (`shardplane watch | head`) is a failed
   * write to report, not a signal that kills the command mid-call */
  signal(SIGPIPE, SIG_IGN);
  for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
    if (strcmp(cmd, k_commands[i].name) == 0)
      return k_commands[i].fn(argc - 1, argv + 1);
  fprintf(stderr, "shardplane: unknown command \"%s\"\n", cmd);
  sp_cli_try_help(NULL);
  return SP_EXIT_USAGE;
}
