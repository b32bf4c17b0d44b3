/* Whole jobs for end-to-end tests: a real shardplane-coordinator and N
 * shardplane-worker processes (the programs in SP_BIN_DIR) on loopback,
 * and readers for what the workers leave behind: the loss curve
 * (--losses) and safetensors checkpoints (--checkpoint-dir), compared with
 * the single-process reference run. Every function fails the cmocka test
 * on error; call them from the test's own thread. */
#ifndef SP_JOB_FIXTURE_H
#define SP_JOB_FIXTURE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "plan/model.h"
#include "auth_fixture.h"
#include "base/proc.h"
#include "safetensors/safetensors.h"

#define SP_TJOB_MAX_RANKS 8
/* a worker flag value that becomes rank r's "cuda:r" */
#define SP_TJOB_RANK_GPU "cuda:%r"

/* One coordinator and n worker processes. */
typedef struct sp_tjob {
  sp_proc coord;
  pid_t w[SP_TJOB_MAX_RANKS];
  /* after sp_tjob_wait, per rank: the exit status, 128 + the signal that
   * ended it, or -1 when it was still running at the deadline (killed) */
  int status[SP_TJOB_MAX_RANKS];
  int n;
  char addr[64]; /* the coordinator's, "127.0.0.1:port" */
  /* the job's tokens: the coordinator has the token file, the workers the
   * worker token; tests may use the others (removed by sp_tjob_wait) */
  sp_tauth auth;
} sp_tjob;

/* Starts a coordinator for `model` (--listen 127.0.0.1:0 --world-size n
 * --quiet --insecure --token-file, then cflags) and n workers attached to
 * it (--rank r --log-every 0 --insecure and the worker token, then
 * wflags, where SP_TJOB_RANK_GPU stands for "cuda:r"); cflags and wflags
 * are NULL-terminated, or NULL for none. errdir: when given, worker r's stderr goes to
 * errdir/rank-r.err; otherwise it stays the test's. */
void sp_tjob_start(sp_tjob *j, const char *model, const char *const *cflags,
                   int n, const char *const *wflags, const char *errdir);

/* SIGKILLs the job's coordinator and starts it again on the same port,
 * with the model and cflags it was started with (a --state-dir among them
 * makes it continue the job). */
void sp_tjob_restart_coord(sp_tjob *j, const char *model,
                           const char *const *cflags);

/* Waits up to timeout_s for every worker (killing those still running at
 * the deadline), then stops the coordinator. Returns how many exited 0;
 * j->status says how each ended. */
int sp_tjob_wait(sp_tjob *j, double timeout_s);

/* Starts a job and waits up to timeout_s; fails the test, printing every
 * rank's status, unless every worker exits 0. */
void sp_tjob_run(const char *model, const char *const *cflags, int n,
                 const char *const *wflags, double timeout_s);

/* The loss curve a worker wrote with --losses (a JSON array of numbers):
 * a malloc'd array (the caller frees) of *n values. */
double *sp_tjob_read_losses(const char *path, size_t *n);

/* Opens dir/name, a safetensors file; sp_safetensors_close it. */
sp_safetensors_file *sp_tjob_open_st(const char *dir, const char *name);

/* Element i of a tensor (floating, int64, int32, or one-byte) as a
 * double. */
double sp_tjob_elem(const sp_safetensors_tensor *t, size_t i);

/* Fails unless a_dir/a and b_dir/b hold the same tensors: the same names,
 * dtypes and bytes. */
void sp_tjob_same_tensors(const char *a_dir, const char *a, const char *b_dir,
                          const char *b);

/* One configuration of the parity test. */
typedef struct sp_tjob_parity_cfg {
  const char *model;
  const char *strategy; /* --strategy */
  int group;            /* --shard-group-size, for HYBRID_SHARD */
  bool mp;              /* --param-dtype bfloat16 --reduce-dtype float32 */
  int n;                /* workers */
  uint32_t steps, batch;
  const char *lr;
  /* more coordinator and worker flags (NULL-terminated), or NULL; the
   * training flags among wflags (train_flags.h: optimizer, schedule,
   * clipping, accumulation) configure the reference run as well */
  const char *const *cflags, *const *wflags;
  double tol, timeout_s;
  double loss_tol; /* the loss curve's bound; 0: tol */
  /* ||params - reference|| / ||reference||'s bound; 0: not checked */
  double rms_tol;
} sp_tjob_parity_cfg;

/* The largest errors seen by sp_tjob_parity since the caller pointed
 * g_parity_worst at a record (NULL: none kept). */
typedef struct sp_tjob_errors {
  double loss, params, rms;
} sp_tjob_errors;
extern sp_tjob_errors *g_parity_worst;

/* The parity test of one configuration: a job (wrap type Linear) trains
 * c->model for c->steps steps of global batch c->batch at c->lr, writing
 * its loss curve and a FULL checkpoint; then the unsharded single-process
 * run of the same settings (sp_mlp_reference_train, configured by the
 * training flags among c->wflags) does too. Prints both
 * errors after `label`, then fails unless every worker succeeded within
 * c->timeout_s, the loss curve has c->steps entries and went down, the
 * checkpoint holds every parameter in its dtype, and the largest relative
 * errors of the loss curve and of the final parameters (max |job -
 * reference| / max |reference|, so values near zero do not dominate; a NaN
 * fails) are within c->tol (the loss curve's within c->loss_tol when set,
 * the parameters' rms error within c->rms_tol when set). */
void sp_tjob_parity(const char *label, const sp_tjob_parity_cfg *c);
/* sp_tjob_parity of n configurations, `parallel` jobs at a time (a job
 * spends most of its time waiting on its rendezvous and timers, so a few
 * at once cost little more than one), each next one starting as soon as
 * one ends; the checks, in order, once every job has ended (their
 * directories stay until then); labels[i] names cs[i]. */
void sp_tjob_parity_many(const sp_tjob_parity_cfg *cs,
                         const char *const *labels, size_t n, size_t parallel);

/* The buffer test (SP_TEST_DATA/mlp_buffers.json: running means in
 * float64, float16 and bfloat16 submodules, step counters in int64 and
 * int32, bools, non-persistent buffers) after a job of `world` ranks with
 * wrap type Linear, param dtype bfloat16, reduce dtype float32 and buffer
 * dtype bfloat16 trained it for `steps` steps of global batch `batch` at
 * lr. Checks the buffers of its checkpoints in dir (FULL; `sharded`, the
 * SHARDED file that holds them; `local`, a LOCAL file; paths relative to
 * dir) against the single-process reference run: non-persistent ones in no
 * file; FULL and SHARDED in the original dtype, LOCAL in the compute dtype
 * (bfloat16 for floating buffers, integers and bools unchanged, counting
 * the steps); floating values bfloat16 values, equal in all three files and
 * within one bfloat16 step, twice, of the tensor's largest reference
 * value. `vs` names the runs compared in the printout. */
void sp_tjob_check_buffers(const char *model, uint32_t world, uint32_t steps,
                           uint32_t batch, double lr, const char *dir,
                           const char *sharded, const char *local,
                           const char *vs);

#endif
