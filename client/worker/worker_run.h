/* One rank of a shardplane job, as shardplane-worker runs it once its
 * command line is read (worker_main.c): attach to the coordinator, take
 * the job and model from it, train the model with the FSDP runtime (the
 * trainer train_model.h picks: gpt2_train.h, mlp_train.h, or with
 * --synthetic synthetic_train.h), report, checkpoint, stop when a signal
 * or the coordinator says so. */
#ifndef SP_WORKER_RUN_H
#define SP_WORKER_RUN_H

#include <stdbool.h>
#include <stdint.h>

#include "gpt2_generate.h"
#include "inject.h"
#include "lib/shardplane.h"
#include "rpc/rpc_cred.h"
#include "train_flags.h"
#include "worker_flags.h"

/* The worker's options, from its command line and the environment. */
typedef struct sp_worker_opts {
  sp_cred cred; /* --insecure, --tls-*, --token-file, $SHARDPLANE_TOKEN */
  const char *coordinator;
  bool coordinator_flag; /* from --coordinator, not the environment */
  long rank;
  sp_launch_env env; /* RANK, WORLD_SIZE, ... as a launcher set them */
  const char *device;
  /* --steps, --global-batch, --lr, --log-every, the checkpoints written
   * (also every --checkpoint-every N steps; 0: only at the end) and
   * loaded */
  sp_worker_flags wf;
  const char *test_state; /* --test-state NAME */
  char load_from[4096];   /* the checkpoint folder wf.load_dir names */
  const char *losses_path;
  const char *stats_path;
  bool no_report;
  uint32_t report_toggle;
  uint64_t comm_timeout_ms;
  uint64_t call_timeout_ms;
  uint64_t coordinator_grace_ms; /* --coordinator-grace; 0: the default */
  uint32_t flight_events;        /* --flight-events; 0: the default */
  sp_train_flags train; /* optimizer, schedule, clipping, accumulation */
  /* --generate: text from a GPT-2 checkpoint, no job */
  bool generate;
  sp_gpt2_gen_opts gen;
  bool synthetic; /* --synthetic: the cycle on synthetic gradients always */
  /* --inject: the faults of every rank, parsed with the flags;
   * sp_worker_run keeps this rank's */
  sp_inject inject;
} sp_worker_opts;

/* SIGINT and SIGTERM, from here on: the first asks every rank for a
 * checkpoint and a stop at the next step boundary; a second one ends the
 * process at once. */
void sp_worker_catch_stop_signals(void);

/* The job, o->wf.steps steps in all. *stopped: 0 when training ran to
 * them; else the signal that stopped this rank, or -1 when another rank's
 * did. A failure's message names its cause, another rank's when that
 * rank's fault failed this one. */
int sp_worker_run(sp_worker_opts *o, int *stopped, sp_diag *d);

#endif
