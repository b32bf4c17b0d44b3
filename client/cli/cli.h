/* Shared pieces of the `shardplane` command. */
#ifndef SP_CLI_H
#define SP_CLI_H

#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "plan/memory.h"
#include "rpc/rpc_cred.h"
#include "lib/shardplane.h"

/* Exit codes: scripts tell these apart. */
enum {
  SP_EXIT_OK = 0,
  SP_EXIT_FAILURE = 1,     /* the operation failed (bad spec, I/O, ...) */
  SP_EXIT_USAGE = 2,       /* bad command line (or INVALID_ARGUMENT) */
  SP_EXIT_NOT_FOUND = 3,   /* the FQN, rank, unit or key asked for does not
                              exist (store get --wait: not within the wait) */
  SP_EXIT_UNREACHABLE = 4, /* no coordinator answered */
  SP_EXIT_ALERT = 5,       /* why: the job has an open alert or failed;
                              analyze: the dump shows a divergence */
};

/* `shardplane plan ...`; argv[0] is "plan". Offline with --model, else it
 * asks the coordinator (sp_remote_plan). */
int sp_cmd_plan(int argc, char **argv);

/* Subcommands that ask a running coordinator (remote.c); argv[0] is the
 * subcommand's name. */
int sp_cmd_status(int argc, char **argv);
int sp_cmd_ranks(int argc, char **argv);
int sp_cmd_where(int argc, char **argv);
int sp_cmd_buffers(int argc, char **argv);
int sp_cmd_watch(int argc, char **argv);
int sp_cmd_store(int argc, char **argv);
/* incarnations.c: the job's incarnations (restarts) and what ended each */
int sp_cmd_incarnations(int argc, char **argv);
/* Hang diagnosis: why.c, trace.c, analyze.c */
int sp_cmd_why(int argc, char **argv);
int sp_cmd_trace(int argc, char **argv);
int sp_cmd_analyze(int argc, char **argv);

/* `shardplane run` (run.c): a coordinator and N workers on this
 * machine. */
int sp_cmd_run(int argc, char **argv);
/* `shardplane agent` (agent.c): one host's workers of a job, launched and
 * supervised, their control traffic proxied over one connection. */
int sp_cmd_agent(int argc, char **argv);
/* `shardplane token create` (token_cmd.c) */
int sp_cmd_token(int argc, char **argv);

/* Prints "shardplane <cmd>: <message>" to stderr. */
void sp_cli_error(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* After a usage error's line: "try 'shardplane <cmd> --help'" (cmd NULL:
 * "try 'shardplane --help'"). */
void sp_cli_try_help(const char *cmd);

/* --rank R of a world of `world` ranks: SP_EXIT_OK, or SP_EXIT_NOT_FOUND
 * after "--rank R: the world has ranks 0-N" (the coordinator says
 * INVALID_ARGUMENT, but to the user it is a rank that is not there). */
int sp_cli_check_rank(const char *cmd, long long rank, uint32_t world);

/* A decimal in [0, max]; -1 for anything else. */
int sp_cli_parse_uint(const char *s, long long max, long long *out);

/* ---- talking to a coordinator (remote.c) ---- */

#define SP_DEFAULT_COORDINATOR "127.0.0.1:7700"
#define SP_DEFAULT_TIMEOUT_MS 5000

/* getopt_long values of the options every remote subcommand takes; put
 * SP_REMOTE_OPTIONS in the subcommand's option table. */
enum { SP_OPT_COORDINATOR = 900, SP_OPT_TIMEOUT };
#define SP_REMOTE_OPTIONS                                       \
  {"coordinator", required_argument, NULL, SP_OPT_COORDINATOR}, \
      {"timeout-ms", required_argument, NULL, SP_OPT_TIMEOUT}, SP_CRED_OPTIONS
#define SP_REMOTE_OPTIONS_HELP                                             \
  "  --coordinator HOST:PORT      the coordinator (default "               \
  "$" SP_COORDINATOR_ENV                                                   \
  ",\n"                                                                    \
  "                               then " SP_DEFAULT_COORDINATOR            \
  ")\n"                                                                    \
  "  --timeout-ms N               deadline of each call, and how long to " \
  "keep\n"                                                                 \
  "                               trying to connect (default 5000)\n" SP_CRED_OPTIONS_HELP

struct sp_rpc_sync;

/* One subcommand's session with the coordinator. */
typedef struct sp_remote {
  const char *cmd;     /* subcommand, first word of every message */
  const char *addr;    /* "host:port" */
  bool addr_from_env;  /* addr came from $SHARDPLANE_COORDINATOR */
  uint64_t timeout_ms; /* per call */
  sp_cred cred;        /* transport and token */
  bool json;
  struct sp_rpc_sync *rpc; /* open after sp_remote_connect */
} sp_remote;

/* Defaults: $SHARDPLANE_COORDINATOR or 127.0.0.1:7700, 5000 ms. */
void sp_remote_init(sp_remote *r, const char *cmd);
/* Handles SP_OPT_COORDINATOR / SP_OPT_TIMEOUT: 1 when c was one of them,
 * 0 when it was not, -1 (message printed) for a bad value. */
int sp_remote_option(sp_remote *r, int c, const char *arg);
/* `plan` without --model: the coordinator's plan, printed as the offline
 * one; rank and unit as `plan --rank/--unit` (rank < 0, unit NULL: none);
 * memory not NULL: its memory model for those options instead (`plan
 * --memory`; the trainer's activations are not counted: the plan it sends
 * carries units, not the spec). Returns an exit code and closes r. */
int sp_remote_plan(sp_remote *r, long long rank, const char *unit,
                   const sp_mem_opts *memory);

#endif
