/* Internals shared by the remote subcommands (remote.c); not installed. */
#ifndef SP_CLI_REMOTE_H
#define SP_CLI_REMOTE_H

#include <getopt.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#include "cli.h"
#include "plan/job.h"
#include "rpc/rpc.h"
#include "shardplane/v1/coordinator.pb-c.h"

/* sp_remote_parse_args(), sp_remote_call_status(): go on with the
 * subcommand (any other value is an exit code). */
#define PROCEED (-1)

typedef struct subcmd {
  const char *synopsis; /* after "usage: shardplane " */
  const char *help;     /* what it does, then its own options */
  size_t min_args, max_args;
  /* what exit code 5 means for it, for the exit codes line; NULL: the
   * command has none */
  const char *exit5;
} subcmd;

enum { SP_ROPT_JSON = 950, SP_ROPT_HELP };

/* The subcommand's usage, help and the common options. */
void sp_remote_subcmd_help(FILE *f, const subcmd *sc);
/* Parses argv (argv[0] is the subcommand) with the subcommand's own
 * options (handed to on_opt, which returns 0 or -1 after printing why) and
 * the common ones. The positional arguments are left in argv[optind..]
 * (*first) and counted in *n. Returns PROCEED, or the exit code to stop
 * with (--help, bad usage). */
int sp_remote_parse_args(sp_remote *r, const subcmd *sc, int argc, char **argv,
                         const struct option *own, size_t n_own,
                         int (*on_opt)(void *ctx, int c, const char *arg),
                         void *ctx, int *first, size_t *n);
/* Opens the connection and asks the standard health service whether the
 * coordinator serves; returns an exit code (0: serving). */
int sp_remote_connect(sp_remote *r);
/* Connects if needed, then makes one unary call. Returns PROCEED with
 * *status set (the caller judges it; on OK *resp is the answer, which the
 * caller frees), or the exit code of a failure already printed. */
int sp_remote_call_status(sp_remote *r, const char *method,
                          const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *desc,
                          uint64_t timeout_ms, ProtobufCMessage **resp,
                          sp_rpc_status *status);
/* One unary call with the session's deadline; a failure's message is
 * printed and its exit code returned. */
int sp_remote_call(sp_remote *r, const char *method,
                   const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *desc,
                   ProtobufCMessage **resp);
/* Prints the server's message and its status name; returns the exit code. */
int sp_remote_fail_status(const sp_remote *r, const sp_rpc_status *st);
/* Ends a subcommand (closes r): stdout must have reached its reader. */
int sp_remote_finish(sp_remote *r, int exit_code);
void sp_remote_free_msg(void *m);
/* The proto name of an enum value ("RANK_ATTACHED"), "UNKNOWN" if none. */
const char *sp_remote_enum_name(const ProtobufCEnumDescriptor *d, int v);
/* "12.3s", "4m 05s", "2h 07m" */
void sp_remote_format_duration(uint64_t ms, char *buf, size_t len);
/* The coordinator stamps its events and alerts in ms since it started
 * (time_ms); its uptime (GetJob) says when that was on the wall clock:
 * start_us, in microseconds since the epoch. */
uint64_t sp_remote_coord_start_us(uint64_t uptime_ms);
/* A coordinator's time_ms on the wall clock (microseconds since the
 * epoch), which sp_flight_time prints as watch and trace print the
 * workers' own stamps: "12:03:41.123456" (UTC). */
uint64_t sp_remote_coord_wall_us(uint64_t start_us, uint64_t time_ms);
json_t *sp_remote_collective_json(const Shardplane__V1__Collective *c);
/* Hang diagnosis (the words status, why and watch share). */
const char *sp_remote_job_state_name(int v);  /* "RUNNING" */
const char *sp_remote_alert_kind_name(int v); /* "STALL", "LOST" */
/* "step 120 of 500, 3.1 steps/s, loss 2.41, about 40.0s left" */
void sp_remote_progress_words(const Shardplane__V1__Progress *p, char *buf,
                              size_t len);
json_t *sp_remote_progress_json(const Shardplane__V1__Progress *p);
/* "STALL: <message> (culprit rank 3; victims 0-2)", no newline */
void sp_remote_print_alert(FILE *f, const Shardplane__V1__Alert *a);
json_t *sp_remote_alert_json(const Shardplane__V1__Alert *a);
/* Replica groups that continue: "replica groups  1 of 2 training (epoch
 * 3)" after `label` padded to `width`, then each group ever dropped, one
 * line each in the coordinator's words; nothing for a NULL quorum (a job
 * without --on-group-failure continue). The JSON is null then. */
void sp_remote_print_quorum(FILE *f, const char *label, int width,
                            const Shardplane__V1__ReplicaQuorum *q);
json_t *sp_remote_quorum_json(const Shardplane__V1__ReplicaQuorum *q);
/* GetJob, with the job rebuilt into *job (status.c); the answer is the
 * caller's to free. Returns an exit code. */
int sp_remote_get_job(sp_remote *r, Shardplane__V1__GetJobResponse **out,
                      sp_job *job);

#endif
