/* shardplane-worker: one rank of a job. Attaches to the coordinator, takes
 * the job and model from it, and trains a GPT-2-family transformer
 * (gpt2_train.h) or the reference MLP (mlp.h) with the FSDP runtime, or,
 * asked with --synthetic, runs the same unshard / reduce / cast cycle on
 * synthetic gradients (train_model.h: any other spec is refused). */
#include <cblas.h>
#include <getopt.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "plan/job_cli.h"
#include "base/flag.h"
#include "gpt2.h"
#include "gpt2_generate.h"
#include "gpt2_train.h"
#include "inject.h"
#include "mlp.h"
#include "mlp_cuda.h"
#include "rpc/rpc.h"
#include "rpc/rpc_cred.h"
#include "lib/shardplane.h"
#include "worker_test_state.h"
#include "train_flags.h"
#include "train_model.h"
#include "worker_flags.h"

typedef struct worker_opts {
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
  char load_from[4096];    /* the checkpoint folder wf.load_dir names */
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
} worker_opts;

/* --inject: the faults of every rank, parsed with the flags; run() keeps
 * this rank's. */
static sp_inject g_inject;

/* SIGINT / SIGTERM: the first asks for a checkpoint and a stop at the
 * next step boundary (every rank learns it there, sp_fsdp_any); a second
 * one ends the process at once. */
static volatile sig_atomic_t g_stop_signal;

static void on_stop_signal(int sig) {
  if (g_stop_signal) {
    signal(sig, SIG_DFL);
    raise(sig); /* delivered when the handler returns */
    return;
  }
  g_stop_signal = sig;
}

/* The communicators, for the session's abort callback, which runs on the
 * session's thread: the lock keeps an abort off a communicator being
 * freed. */
static pthread_mutex_t g_comms_lock = PTHREAD_MUTEX_INITIALIZER;
static sp_comm *g_comms[3];

/* The session calls on_abort once: an ABORT that comes while the
 * communicators are still being opened must stop them too, or this rank
 * trains on and waits in its first collective for peers that stopped. */
static bool g_aborted;

static void on_abort(void *user, const char *reason) {
  const worker_opts *o = user;
  fprintf(stderr, "shardplane-worker: rank %ld: aborting collectives: %s\n",
          o->rank, reason);
  pthread_mutex_lock(&g_comms_lock);
  g_aborted = true;
  for (int i = 0; i < 3; i++)
    if (g_comms[i]) sp_comm_abort(g_comms[i]);
  pthread_mutex_unlock(&g_comms_lock);
}

static void set_comms(sp_comm *world, sp_comm *shard, sp_comm *replica) {
  pthread_mutex_lock(&g_comms_lock);
  g_comms[0] = world;
  g_comms[1] = shard;
  g_comms[2] = replica;
  for (int i = 0; i < 3 && g_aborted; i++)
    if (g_comms[i]) sp_comm_abort(g_comms[i]);
  pthread_mutex_unlock(&g_comms_lock);
}

/* ---- the MLP trainer: sp_mlp_io over the runtime's views ----
 * On the CPU the layers run as sp_mlp_forward / sp_mlp_backward on host
 * activations; on a GPU (--device cuda:N) as their mlp_cuda.h twins on
 * device activations, the views being device memory, with the runtime's
 * compute stream ordering both. The schedule around them is the same. */

typedef struct trainer {
  sp_fsdp *f;
  sp_session *s;
  const sp_plan *plan;
  sp_mlp *mlp;
  sp_mlp_acts *acts;    /* host: the batch is generated here */
  sp_mlp_cuda *gpu;     /* device activations; NULL on the CPU */
  uint32_t *layer_unit; /* per layer: the unit its module is, or 0 */
  float *t;             /* targets of the local batch */
  size_t local_n;       /* samples of a micro-batch on this rank */
  const sp_mlp_train_cfg *cfg;
  uint32_t rank;
} trainer;

static void *io_param(void *u, int32_t p) { return sp_fsdp_param(u, p); }
static void *io_grad(void *u, int32_t p) { return sp_fsdp_param_grad(u, p); }
static sp_dtype io_param_dtype(void *u, int32_t p) {
  return sp_fsdp_param_dtype(u, p);
}
static void *io_buffer(void *u, int32_t b) { return sp_fsdp_buffer(u, b); }
static sp_dtype io_buffer_dtype(void *u, int32_t b) {
  return sp_fsdp_buffer_dtype(u, b);
}
static int io_all_reduce(void *u, float *buf, size_t n, sp_diag *d) {
  return sp_fsdp_all_reduce(u, buf, n, SP_FLOAT32, d);
}

static int trainer_init(trainer *tr, sp_fsdp *f, sp_session *s, sp_mlp *mlp,
                        const sp_mlp_train_cfg *cfg, sp_diag *d) {
  memset(tr, 0, sizeof *tr);
  tr->f = f;
  tr->s = s;
  tr->plan = sp_session_plan(s);
  tr->mlp = mlp;
  tr->cfg = cfg;
  tr->rank = sp_session_rank(s);
  size_t local_n = cfg->global_batch / cfg->grad_accum /
                   sp_session_world(s);
  tr->local_n = local_n;
  tr->layer_unit = calloc(mlp->n_layers, sizeof *tr->layer_unit);
  tr->t = calloc(local_n * (size_t)mlp->out_dim, sizeof *tr->t);
  if (!tr->layer_unit || !tr->t)
    return sp_diag_set(d, SP_ENOMEM, "no memory");
  for (size_t l = 0; l < mlp->n_layers; l++)
    for (uint32_t u = 1; u < tr->plan->n_units; u++)
      if (tr->plan->units[u].module == mlp->layers[l].module)
        tr->layer_unit[l] = u;
  int rc = sp_mlp_acts_new(mlp, local_n, &tr->acts);
  if (rc < 0) return sp_diag_set(d, rc, "activations: %s", sp_strerror(rc));
  if (sp_fsdp_on_device(f))
    rc = sp_mlp_cuda_new(mlp, local_n, sp_fsdp_cuda_stream(f), &tr->gpu, d);
  return rc;
}

static void trainer_free(trainer *tr) {
  sp_mlp_cuda_free(tr->gpu);
  sp_mlp_acts_free(tr->acts);
  free(tr->layer_unit);
  free(tr->t);
}

/* The dtype activations leave the last layer in: its unit's param dtype. */
static sp_dtype output_dtype(const trainer *tr) {
  for (size_t l = tr->mlp->n_layers; l-- > 0;) {
    int32_t w = tr->mlp->layers[l].weight;
    if (w >= 0) return tr->plan->units[tr->plan->param_unit[w]].param_dtype;
  }
  return SP_FLOAT32;
}

/* A step is grad_accum micro-batches (sp_mlp_train_cfg says which
 * samples each is): forward and backward of each, the reductions adding
 * up in the shard gradients (or, with no_sync, the unsharded gradients
 * adding up until the last micro-batch reduces them), each micro-batch's
 * loss scaled by 1/K; then clipping and the optimizer step. */

/* The micro-batch's first sample on this rank, and its size over every
 * rank (the RunningNorm mean's global batch). */
static uint64_t micro_first(const trainer *tr, uint32_t j) {
  uint64_t micro = tr->cfg->global_batch / tr->cfg->grad_accum;
  return j * micro + (uint64_t)tr->rank * tr->local_n;
}

static uint64_t micro_global(const trainer *tr) {
  return tr->cfg->global_batch / tr->cfg->grad_accum;
}

/* Sync off for every micro-batch but the last (no_sync). */
static int set_sync(trainer *tr, uint32_t j, sp_diag *d) {
  if (!tr->cfg->no_sync) return 0;
  return sp_fsdp_set_requires_gradient_sync(tr->f,
                                            j + 1 == tr->cfg->grad_accum, d);
}

/* After the micro-batches: clipping, then the optimizer. */
static int optimizer_step(trainer *tr, sp_diag *d) {
  int rc = 0;
  if (tr->cfg->clip_grad_norm > 0)
    rc = sp_fsdp_clip_grad_norm(tr->f, tr->cfg->clip_grad_norm, NULL, d);
  if (rc == 0) rc = sp_fsdp_optim_step(tr->f, NULL, d);
  return rc;
}

/* One micro-batch on the GPU: micro_step's schedule with the device
 * layers. The local loss stays on the device, summed over the
 * micro-batches, for the all-reduce. */
static int micro_step_gpu(trainer *tr, uint64_t step, uint32_t j,
                          sp_diag *d) {
  sp_fsdp *f = tr->f;
  const sp_mlp *mlp = tr->mlp;
  sp_mlp_cuda *g = tr->gpu;
  sp_mlp_io io = {io_param, io_grad, io_param_dtype, io_buffer,
                  io_buffer_dtype, io_all_reduce, f};
  sp_mlp_batch(mlp, step, micro_first(tr, j), tr->local_n, tr->acts->x[0],
               tr->t);
  int rc = set_sync(tr, j, d);
  if (rc == 0) rc = sp_mlp_cuda_set_batch(g, tr->acts->x[0], tr->t, d);
  if (rc == 0) rc = sp_fsdp_root_pre_forward(f, d);
  for (size_t l = 0; rc == 0 && l < mlp->n_layers; l++) {
    uint32_t u = tr->layer_unit[l];
    if (u) rc = sp_fsdp_pre_forward(f, u, d);
    if (rc == 0) rc = sp_mlp_cuda_forward(g, l, &io, micro_global(tr), d);
    if (rc == 0 && u) rc = sp_fsdp_post_forward(f, u, d);
  }
  if (rc == 0)
    rc = sp_mlp_cuda_loss_over(g, output_dtype(tr),
                               tr->local_n * tr->cfg->grad_accum, j > 0, d);
  if (rc == 0) rc = sp_fsdp_root_post_forward(f, d);
  if (rc == 0) rc = sp_fsdp_root_pre_backward(f, d);
  for (size_t l = mlp->n_layers; rc == 0 && l-- > 0;) {
    uint32_t u = tr->layer_unit[l];
    if (u) rc = sp_fsdp_pre_backward(f, u, d);
    if (rc == 0) rc = sp_mlp_cuda_backward(g, l, &io, d);
    if (rc == 0 && u) rc = sp_fsdp_post_backward(f, u, d);
  }
  if (rc == 0) rc = sp_fsdp_post_backward(f, 0, d);
  if (rc == 0) rc = sp_fsdp_finish_backward(f, d);
  if (rc == 0) rc = sp_mlp_cuda_count_step(g, &io, d);
  return rc;
}

static int trainer_step_gpu(trainer *tr, uint64_t step, double *loss,
                            sp_diag *d) {
  sp_fsdp *f = tr->f;
  sp_session_set_step(tr->s, step + 1); /* reported from 1 */
  int rc = 0;
  for (uint32_t j = 0; rc == 0 && j < tr->cfg->grad_accum; j++)
    rc = micro_step_gpu(tr, step, j, d);
  if (rc == 0) rc = optimizer_step(tr, d);
  double sum = 0;
  if (rc == 0)
    rc = sp_fsdp_all_reduce(f, sp_mlp_cuda_loss_ptr(tr->gpu), 1, SP_FLOAT64,
                            d);
  if (rc == 0) rc = sp_mlp_cuda_read_loss(tr->gpu, &sum, d);
  *loss = sum / sp_session_world(tr->s);
  return rc;
}

/* One micro-batch; *local receives its scaled local loss. */
static int micro_step(trainer *tr, uint64_t step, uint32_t j, double *local,
                      sp_diag *d) {
  sp_fsdp *f = tr->f;
  const sp_mlp *mlp = tr->mlp;
  sp_mlp_io io = {io_param, io_grad, io_param_dtype, io_buffer,
                  io_buffer_dtype, io_all_reduce, f};
  sp_mlp_batch(mlp, step, micro_first(tr, j), tr->local_n, tr->acts->x[0],
               tr->t);
  int rc = set_sync(tr, j, d);
  if (rc == 0) rc = sp_fsdp_root_pre_forward(f, d);
  for (size_t l = 0; rc == 0 && l < mlp->n_layers; l++) {
    uint32_t u = tr->layer_unit[l];
    if (u) rc = sp_fsdp_pre_forward(f, u, d);
    if (rc == 0)
      rc = sp_mlp_forward(mlp, l, &io, tr->acts, micro_global(tr), d);
    if (rc == 0 && u) rc = sp_fsdp_post_forward(f, u, d);
  }
  if (rc == 0) {
    *local = sp_mlp_loss_over(mlp, tr->acts, tr->t, output_dtype(tr),
                              tr->local_n * tr->cfg->grad_accum);
    rc = sp_fsdp_root_post_forward(f, d);
  }
  if (rc == 0) rc = sp_fsdp_root_pre_backward(f, d);
  for (size_t l = mlp->n_layers; rc == 0 && l-- > 0;) {
    uint32_t u = tr->layer_unit[l];
    if (u) rc = sp_fsdp_pre_backward(f, u, d);
    if (rc == 0) rc = sp_mlp_backward(mlp, l, &io, tr->acts, d);
    if (rc == 0 && u) rc = sp_fsdp_post_backward(f, u, d);
  }
  if (rc == 0) rc = sp_fsdp_post_backward(f, 0, d);
  if (rc == 0) rc = sp_fsdp_finish_backward(f, d);
  if (rc == 0) sp_mlp_count_step(mlp, &io);
  return rc;
}

/* One step; *loss receives the global mean loss. */
static int trainer_step(trainer *tr, uint64_t step, double *loss,
                        sp_diag *d) {
  sp_session_set_step(tr->s, step + 1); /* reported from 1 */
  double local = 0;
  int rc = 0;
  for (uint32_t j = 0; rc == 0 && j < tr->cfg->grad_accum; j++) {
    double part = 0;
    rc = micro_step(tr, step, j, &part, d);
    local += part;
  }
  if (rc == 0) rc = optimizer_step(tr, d);
  /* the global loss: local means weighted equally (equal local batches) */
  double sum = local;
  if (rc == 0) rc = sp_fsdp_all_reduce(tr->f, &sum, 1, SP_FLOAT64, d);
  *loss = sum / sp_session_world(tr->s);
  return rc;
}

/* ---- synthetic-gradient cycle for specs the worker cannot compute ---- */

static int synthetic_step(sp_fsdp *f, sp_session *s, uint64_t step,
                          double lr, sp_diag *d) {
  const sp_plan *pl = sp_session_plan(s);
  const sp_model *m = sp_session_model(s);
  sp_session_set_step(s, step + 1); /* reported from 1 */
  int rc = sp_fsdp_root_pre_forward(f, d);
  for (uint32_t u = 1; rc == 0 && u < pl->n_units; u++) {
    rc = sp_fsdp_pre_forward(f, u, d);
    if (rc == 0) rc = sp_fsdp_post_forward(f, u, d);
  }
  if (rc == 0) rc = sp_fsdp_root_post_forward(f, d);
  if (rc == 0) rc = sp_fsdp_root_pre_backward(f, d);
  for (uint32_t u = (uint32_t)pl->n_units; rc == 0 && u-- > 0;) {
    if (u) rc = sp_fsdp_pre_backward(f, u, d);
    /* gradient = 0.01 * parameter: deterministic, rank-independent */
    for (size_t p = 0; rc == 0 && p < m->n_params; p++) {
      if (pl->param_unit[p] != (int32_t)u) continue;
      void *g = sp_fsdp_param_grad(f, (int32_t)p);
      const void *v = sp_fsdp_param(f, (int32_t)p);
      if (!g || !v) continue;
      sp_dtype dt = sp_fsdp_param_dtype(f, (int32_t)p);
      size_t n = (size_t)m->params[p].numel, es = sp_dtype_size(dt);
      /* memcpy on the CPU, a device copy on a GPU */
      rc = sp_fsdp_copy(f, g, v, n * es, d);
    }
    if (rc == 0) rc = sp_fsdp_post_backward(f, u, d);
  }
  if (rc == 0) rc = sp_fsdp_finish_backward(f, d);
  if (rc == 0) rc = sp_fsdp_sgd_step(f, lr * 0.01, d);
  /* the step's device work is part of its duration */
  if (rc == 0) rc = sp_fsdp_synchronize(f, d);
  return rc;
}

/* ---- main ---- */

static void usage(FILE *f) {
  fputs(
      "usage: shardplane-worker --coordinator HOST:PORT --rank R [options]\n"
      "\n"
      "One rank of a shardplane job: takes the job and model from the\n"
      "coordinator, trains a GPT-2-family transformer (blocks wrapped as\n"
      "units: --wrap-type GPT2Block) or the reference MLP (a sequential\n"
      "MLP) with sharded parameters, and reports every training-state\n"
      "transition. Any other spec is refused (exit 1) before the\n"
      "rendezvous, as is a job its trainer cannot take; --synthetic runs\n"
      "the synthetic-gradient cycle on it instead.\n"
      "\n"
      "  --coordinator HOST:PORT  coordinator (default $SHARDPLANE_COORDINATOR"
      ",\n"
      "                           then 127.0.0.1:7700)\n"
      "  --rank R                 this rank (default $RANK, then\n"
      "                           $SLURM_PROCID; one of them is required)\n"
      SP_CRED_OPTIONS_HELP
      "  --device DEV             cpu (default) or cuda:N: shards, parameters,\n"
      "                           gradients and buffers on GPU N, GPT-2 and\n"
      "                           the MLP on cuBLAS, collectives over NCCL\n"
      "                           (GPU build)\n"
      "  --steps N                train up to step N in all (default 20): a\n"
      "                           run resumed from a checkpoint of step K\n"
      "                           trains steps K+1..N\n"
      "  --global-batch N         samples per step over all ranks and micro-\n"
      "                           batches (default 24)\n"
      "  --lr X                   learning rate, the peak of a schedule\n"
      "                           (default 0.05)\n"
      "  --checkpoint-dir DIR     write checkpoints there after training\n"
      "  --checkpoint KIND        full, sharded or local; repeatable "
      "(default full)\n"
      "  --checkpoint-every N     also after every N-th step (needs\n"
      "                           --checkpoint-dir); each replaces the last\n"
      "                           only once it is complete\n"
      "  --load DIR               start from the checkpoint in DIR (or in its\n"
      "                           full/, sharded/ or local/ folder): its\n"
      "                           parameters, buffers, optimizer state and\n"
      "                           step, from which training continues\n"
      "  --load-kind KIND         full, sharded or local: which one, when DIR\n"
      "                           holds several\n"
      "  --load-params-only       take only the parameters and buffers: the\n"
      "                           optimizer's state and schedule start afresh\n"
      "                           (another optimizer than the checkpoint's);\n"
      "                           training still continues after its step\n"
      "  --losses FILE            rank 0 writes the loss of every step it\n"
      "                           trains (JSON)\n"
      "  --stats FILE             rank 0 writes every step's duration in s,\n"
      "                           whether it was reported, the runtime's\n"
      "                           counted memory, a GPT-2's activation\n"
      "                           bytes and the process's RSS in training\n"
      "                           and in the checkpoints (JSON)\n"
      "  --log-every N            rank 0 prints progress every N steps "
      "(default 1)\n"
      "  --comm-timeout-ms N      rendezvous and collective timeout "
      "(default 60000)\n"
      "  --call-timeout-ms N      deadline of each call to the coordinator\n"
      "                           (attach, store, detach; default 30000)\n"
      "  --coordinator-grace S    ride out a coordinator outage of up to S\n"
      "                           seconds (default 60): training goes on,\n"
      "                           the session reattaches when it is back\n"
      "                           (a coordinator with --state-dir); after S\n"
      "                           the rank fails naming the coordinator\n"
      "  --flight-events N        events the flight recorder keeps for\n"
      "                           `shardplane trace` (default 2000, at most\n"
      "                           100000)\n"
      "  --inject FAULT           (tests, drills) make a fault on purpose,\n"
      "                           repeatable, off by default; steps count\n"
      "                           from 1, only faults naming this rank act:\n"
      "      stall:rank=R,step=S[,unit=U,phase=forward|backward]\n"
      "                           block before that collective, heartbeats\n"
      "                           going on, until killed or aborted\n"
      "      skip-collective:rank=R,step=S[,unit=U]\n"
      "                           skip one all-gather (peers hang)\n"
      "      wrong-count:rank=R,step=S\n"
      "                           one reduction with one element fewer\n"
      "      slow:rank=R,factor=F every step F times slower (a straggler)\n"
      "      exit:rank=R,step=S   die (_exit(1)) as step S begins\n"
      "  --synthetic              run the synthetic-gradient cycle whatever\n"
      "                           the spec, instead of training (the\n"
      "                           runtime's memory and collectives without a\n"
      "                           model: bench/memory); the only way to run\n"
      "                           a spec that is neither a GPT-2 nor a\n"
      "                           sequential MLP\n"
      "  --no-report              check transitions locally, send none\n"
      "  --report-toggle K        switch reporting off and on every K steps\n"
      "                           (starting on; for bench/step)\n"
      "  --test-state NAME        (tests) register a float32 state NAME\n"
      "                           sharded like the parameters, s = 0.5 s + p\n"
      "                           after each step, which checkpoints carry\n"
      "                           as an optimizer's (host storage only)\n",
      f);
  sp_train_flags_help(f, 27);
  fputs(
      "  --help                   this text\n"
      "\n"
      "shardplane-worker --generate --load DIR --model SPEC [--prompt TEXT]\n"
      "    [--tokens N] [--temperature X] [--seed N]\n"
      "  text from a GPT-2 checkpoint, without a job: DIR's FULL checkpoint\n"
      "  and the spec it was trained from continue TEXT (default a newline)\n"
      "  by N bytes (default 400), sampled at temperature X (default 0.8;\n"
      "  0: greedy, the likeliest byte every time) with seed N (default 0)\n"
      "\n"
      "Environment, as launchers set it (flags win): RANK or SLURM_PROCID\n"
      "(the rank), WORLD_SIZE or SLURM_NTASKS (must equal the job's world\n"
      "size), SHARDPLANE_COORDINATOR (the address),\n"
      "SHARDPLANE_COORDINATOR_GRACE (as --coordinator-grace; `shardplane\n"
      "agent` sets it). Gloo binds and\n"
      "advertises the address of the interface that reaches the\n"
      "coordinator; SHARDPLANE_GLOO_HOST=ADDR overrides it.\n"
      "\n"
      "SIGINT or SIGTERM: every rank stops after the same step (they agree\n"
      "at each step boundary), writes the checkpoints and exits 128 + the\n"
      "signal (143 on a rank stopped by another's); a second signal ends\n"
      "the process at once.\n"
      "\n"
      "exit codes: 0 done, 1 failed (message names the rank; also a spec\n"
      "it cannot train without --synthetic, or a job its trainer refuses,\n"
      "before the rendezvous), 2 bad usage, 130 / 143 stopped by SIGINT /\n"
      "SIGTERM after the checkpoint\n",
      f);
}

enum { O_COORD = 256, O_RANK, O_DEVICE, O_LOSSES, O_STATS, O_CTO, O_CALLTO,
       O_GRACE, O_NOREP, O_TOGGLE, O_TSTATE, O_FLIGHT, O_INJECT, O_GEN,
       O_GMODEL, O_PROMPT, O_TOKENS, O_TEMP, O_SEED, O_SYNTH, O_HELP };

/* One option with its value: 0, or SP_EINVAL with the flag, the value and
 * what is allowed in d. */
static int parse_option(worker_opts *o, int c, const char *flag,
                        const char *v, sp_diag *d) {
  long long n = 0;
  int rc;
  if (c >= SP_WORKER_OPT_BASE && c < SP_WORKER_OPT_END)
    return sp_worker_flag(&o->wf, c, flag, v, d);
  if (c >= SP_TRAIN_OPT_BASE) return sp_train_flag(&o->train, c, v, d);
  switch (c) {
    case O_COORD:
      o->coordinator = v;
      o->coordinator_flag = true;
      return 0; /* checked with the environment's value, in parse_args */
    case O_RANK:
      rc = sp_flag_int(flag, v, 0, SP_JOB_MAX_WORLD - 1, &n, d);
      o->rank = rc == 0 ? (long)n : o->rank;
      return rc;
    case O_DEVICE:
      o->device = v;
      return sp_flag_text(flag, v, "cpu or cuda:N", d);
    case O_LOSSES:
      o->losses_path = v;
      return sp_flag_text(flag, v, "a file name", d);
    case O_STATS:
      o->stats_path = v;
      return sp_flag_text(flag, v, "a file name", d);
    case O_CTO:
      rc = sp_flag_int(flag, v, 1, 86400000, &n, d);
      o->comm_timeout_ms = (uint64_t)n;
      return rc;
    case O_CALLTO:
      rc = sp_flag_int(flag, v, 1, 86400000, &n, d);
      o->call_timeout_ms = (uint64_t)n;
      return rc;
    case O_GRACE:
      return sp_coordinator_grace_parse(flag, v, &o->coordinator_grace_ms, d);
    case O_TOGGLE:
      rc = sp_flag_int(flag, v, 1, 1000000000, &n, d);
      o->report_toggle = (uint32_t)n;
      return rc;
    case O_NOREP: o->no_report = true; return 0;
    case O_TSTATE:
      o->test_state = v;
      return sp_flag_text(flag, v, "a state name", d);
    case O_FLIGHT:
      rc = sp_flag_int(flag, v, 1, 100000, &n, d);
      o->flight_events = (uint32_t)n;
      return rc;
    case O_INJECT: return sp_inject_parse(&g_inject, v, d);
    case O_GEN: o->generate = true; return 0;
    case O_SYNTH: o->synthetic = true; return 0;
    case O_GMODEL:
      o->gen.model_path = v;
      return sp_flag_text(flag, v, "a model spec (JSON file)", d);
    case O_PROMPT: o->gen.prompt = v; return 0;
    case O_TOKENS:
      rc = sp_flag_int(flag, v, 1, 1000000, &n, d);
      o->gen.tokens = (uint32_t)n;
      return rc;
    case O_TEMP:
      if (sp_flag_number(flag, v, 0, &o->gen.temperature, d) != 0)
        return sp_flag_fail(d, flag, v, SP_GPT2_TEMPERATURE_RULE);
      return 0;
    case O_SEED:
      rc = sp_flag_int(flag, v, 0, INT64_MAX, &n, d);
      o->gen.seed = (uint64_t)n;
      return rc;
  }
  return SP_ENOENT;
}

/* 0 to run, 1 after --help, 2 for bad usage (message printed). */
static int parse_args(int argc, char **argv, worker_opts *o) {
  static const struct option own[] = {
      {"coordinator", required_argument, NULL, O_COORD},
      {"rank", required_argument, NULL, O_RANK},
      {"device", required_argument, NULL, O_DEVICE},
      SP_WORKER_OPTIONS_RUN_AND_SAVE,
      SP_WORKER_OPTIONS_LOAD,
      {"losses", required_argument, NULL, O_LOSSES},
      {"stats", required_argument, NULL, O_STATS},
      SP_WORKER_OPTION_LOG_EVERY,
      {"comm-timeout-ms", required_argument, NULL, O_CTO},
      {"call-timeout-ms", required_argument, NULL, O_CALLTO},
      {"coordinator-grace", required_argument, NULL, O_GRACE},
      {"no-report", no_argument, NULL, O_NOREP},
      {"report-toggle", required_argument, NULL, O_TOGGLE},
      SP_WORKER_OPTION_CKPT_EVERY,
      {"test-state", required_argument, NULL, O_TSTATE},
      {"flight-events", required_argument, NULL, O_FLIGHT},
      {"inject", required_argument, NULL, O_INJECT},
      {"generate", no_argument, NULL, O_GEN},
      {"synthetic", no_argument, NULL, O_SYNTH},
      {"model", required_argument, NULL, O_GMODEL},
      {"prompt", required_argument, NULL, O_PROMPT},
      {"tokens", required_argument, NULL, O_TOKENS},
      {"temperature", required_argument, NULL, O_TEMP},
      {"seed", required_argument, NULL, O_SEED},
      {"help", no_argument, NULL, O_HELP},
      SP_CRED_OPTIONS};
  /* the worker's own options, then the training flags */
  struct option opts[64];
  size_t n_own = sizeof own / sizeof own[0];
  memcpy(opts, own, sizeof own);
  size_t n_train = sp_train_options(opts + n_own, 63 - n_own);
  opts[n_own + n_train] = (struct option){NULL, 0, NULL, 0};
  memset(o, 0, sizeof *o);
  sp_train_flags_init(&o->train);
  /* what a launcher said (torchrun's or Slurm's variables); flags win */
  sp_diag ed = {{0}};
  if (sp_launch_env_read(&o->env, &ed) != 0) {
    fprintf(stderr, "shardplane-worker: %s\n", ed.msg);
    return 2;
  }
  o->coordinator = o->env.coordinator ? o->env.coordinator : "127.0.0.1:7700";
  o->coordinator_grace_ms = o->env.coordinator_grace_ms;
  o->rank = o->env.rank;
  o->device = "cpu";
  sp_worker_flags_init(&o->wf, 0);
  o->gen.tokens = 400;
  o->gen.temperature = 0.8;
  int c, index = -1;
  while ((c = getopt_long(argc, argv, "", opts, &index)) != -1) {
    if (c == O_HELP) {
      usage(stdout);
      return 1;
    }
    if (c == '?' || index < 0) { /* getopt said what */
      sp_flag_try_help("shardplane-worker");
      return 2;
    }
    char flag[64];
    snprintf(flag, sizeof flag, "--%s", opts[index].name);
    sp_diag d = {{0}};
    int cred = sp_cred_option(&o->cred, c, optarg, &d);
    if (cred < 0) {
      fprintf(stderr, "shardplane-worker: %s\n", d.msg);
      return 2;
    }
    if (cred == 0 && parse_option(o, c, flag, optarg, &d) < 0) {
      fprintf(stderr, "shardplane-worker: %s\n", d.msg);
      return 2;
    }
    index = -1;
  }
  if (o->generate) { /* no job: the checkpoint and its spec */
    if (optind < argc || !o->wf.load_dir || !o->gen.model_path) {
      fprintf(stderr, "shardplane-worker: --generate needs --load DIR (a "
              "FULL checkpoint) and --model SPEC (the spec it was trained "
              "from)\n");
      return 2;
    }
    return 0;
  }
  if (optind < argc || o->rank < 0) {
    if (optind < argc)
      fprintf(stderr, "shardplane-worker: unexpected argument \"%s\"\n",
              argv[optind]);
    else
      fprintf(stderr, "shardplane-worker: --rank is required (or $RANK or "
              "$SLURM_PROCID, as launchers set them)\n");
    sp_flag_try_help("shardplane-worker");
    return 2;
  }
  char host[256];
  int port;
  /* unix:PATH is a host agent's socket (shardplane agent) */
  bool via_agent = strncmp(o->coordinator, SP_RPC_UNIX_PREFIX,
                           strlen(SP_RPC_UNIX_PREFIX)) == 0;
  if (!via_agent &&
      (sp_rpc_split_addr(o->coordinator, host, sizeof host, &port) != 0 ||
       port == 0)) {
    sp_diag d = {{0}};
    sp_flag_fail(&d, o->coordinator_flag ? "--coordinator"
                                         : "$SHARDPLANE_COORDINATOR",
                 o->coordinator, "HOST:PORT or [v6]:PORT, port in [1, "
                 "65535], or unix:PATH");
    fprintf(stderr, "shardplane-worker: %s\n", d.msg);
    return 2;
  }
  sp_diag cd = {{0}};
  if (sp_cred_finish(&o->cred, &cd) != 0) {
    fprintf(stderr, "shardplane-worker: %s\n", cd.msg);
    return 2;
  }
  sp_diag fd = {{0}};
  if (sp_worker_flags_finish(&o->wf, &fd) < 0) {
    fprintf(stderr, "shardplane-worker: %s\n", fd.msg);
    return 2;
  }
  if (o->wf.ckpt_every && (!o->wf.ckpt_dir || !o->wf.any_kind)) {
    fprintf(stderr, "shardplane-worker: --checkpoint-every %u needs "
            "--checkpoint-dir DIR and a --checkpoint kind other than none\n",
            o->wf.ckpt_every);
    return 2;
  }
  /* the flags that combine (the world size's share of the batch is
   * checked once the job says it) */
  sp_diag d = {{0}};
  sp_mlp_train_cfg cfg;
  if (sp_train_flags_finish(&o->train, o->wf.steps, o->wf.lr,
                            o->wf.global_batch, 0, NULL, &cfg, &d) < 0) {
    fprintf(stderr, "shardplane-worker: %s\n", d.msg);
    return 2;
  }
  return 0;
}

/* A JSON array of doubles, exact (%.17g). */
static void put_doubles(FILE *fp, const double *l, uint32_t n) {
  fputc('[', fp);
  for (uint32_t i = 0; i < n; i++)
    fprintf(fp, "%s%.17g", i ? ", " : "", l[i]);
  fputc(']', fp);
}

static int write_doubles(const char *path, const double *l, uint32_t n) {
  FILE *fp = fopen(path, "w");
  if (!fp) return SP_EIO;
  put_doubles(fp, l, n);
  fputc('\n', fp);
  return fclose(fp) == 0 ? 0 : SP_EIO;
}

/* ---- memory, for --stats (bench/memory) ---- */

/* A "VmRSS:" / "VmHWM:" line of /proc/self/status in bytes; -1 when the
 * file or the line is missing (not Linux). */
static long long proc_status_bytes(const char *key) {
  FILE *fp = fopen("/proc/self/status", "r");
  if (!fp) return -1;
  char line[256];
  long long kb = -1;
  size_t kl = strlen(key);
  while (fgets(line, sizeof line, fp))
    if (strncmp(line, key, kl) == 0) {
      kb = strtoll(line + kl, NULL, 10);
      break;
    }
  fclose(fp);
  return kb < 0 ? -1 : kb * 1024;
}

/* Sets VmHWM back to VmRSS, to measure the peak of one phase; false when
 * the kernel does not allow it. */
static bool reset_rss_peak(void) {
  FILE *fp = fopen("/proc/self/clear_refs", "w");
  if (!fp) return false;
  bool ok = fputs("5", fp) >= 0;
  return fclose(fp) == 0 && ok;
}

typedef struct mem_phase {
  bool have;
  long long rss_start, rss_hwm; /* bytes, -1: unknown */
  sp_mem_account counted;
} mem_phase;

typedef struct mem_report {
  long long rss_before; /* before sp_fsdp_new */
  uint64_t allocs_after_first_step;
  uint64_t activations; /* a GPT-2's activations and scratch, else 0 */
  mem_phase train, ckpt;
} mem_report;

static void put_account(FILE *fp, const sp_mem_account *a) {
  fputc('{', fp);
  for (int c = 0; c < SP_MEM_N_CATS; c++)
    fprintf(fp, "\"%s\": {\"current\": %llu, \"peak\": %llu}, ",
            sp_mem_cat_name((sp_mem_cat)c),
            (unsigned long long)a->cat[c].current,
            (unsigned long long)a->cat[c].peak);
  fprintf(fp, "\"total\": {\"current\": %llu, \"peak\": %llu}, "
          "\"reserved\": {\"current\": %llu, \"peak\": %llu}, "
          "\"allocs\": %llu}",
          (unsigned long long)a->total.current,
          (unsigned long long)a->total.peak,
          (unsigned long long)a->reserved.current,
          (unsigned long long)a->reserved.peak,
          (unsigned long long)a->allocs);
}

static void put_phase(FILE *fp, const char *name, const mem_phase *p) {
  fprintf(fp, ", \"%s\": {\"rss_start\": %lld, \"rss_hwm\": %lld, "
          "\"counted\": ", name, p->rss_start, p->rss_hwm);
  put_account(fp, &p->counted);
  fputc('}', fp);
}

/* {"step_seconds": [...], "reported": [true, ...], "memory": {...}}: the
 * n steps trained from step index `first` on; a GPT-2's also where each
 * step's time went (gt: sp_gpt2_times per step, or NULL) as
 * "compute_seconds", "wait_seconds", "optim_seconds" and "comm_seconds" */
static int write_stats(const worker_opts *o, const double *step_s,
                       const sp_gpt2_times *gt, uint32_t first, uint32_t n,
                       const mem_report *m) {
  FILE *fp = fopen(o->stats_path, "w");
  if (!fp) return SP_EIO;
  fputs("{\"step_seconds\": ", fp);
  put_doubles(fp, step_s, n);
  static const char *const parts[] = {"compute_seconds", "wait_seconds",
                                      "optim_seconds", "comm_seconds"};
  for (int k = 0; gt && k < 4; k++) {
    fprintf(fp, ", \"%s\": [", parts[k]);
    for (uint32_t i = 0; i < n; i++) {
      double v = k == 0   ? gt[i].compute_s
                 : k == 1 ? gt[i].wait_s
                 : k == 2 ? gt[i].optim_s
                          : gt[i].comm_s;
      fprintf(fp, "%s%.9g", i ? ", " : "", v);
    }
    fputc(']', fp);
  }
  fputs(", \"reported\": [", fp);
  for (uint32_t k = 0; k < n; k++) {
    uint32_t i = first + k;
    bool on = o->report_toggle ? (i / o->report_toggle) % 2 == 0
                               : !o->no_report;
    fprintf(fp, "%s%s", k ? ", " : "", on ? "true" : "false");
  }
  fprintf(fp, "], \"memory\": {\"rss_before\": %lld, "
          "\"allocs_after_first_step\": %llu, \"activations\": %llu",
          m->rss_before, (unsigned long long)m->allocs_after_first_step,
          (unsigned long long)m->activations);
  if (m->train.have) put_phase(fp, "train", &m->train);
  if (m->ckpt.have) put_phase(fp, "checkpoint", &m->ckpt);
  fputs("}}\n", fp);
  return fclose(fp) == 0 ? 0 : SP_EIO;
}

/* Every kind asked for, into --checkpoint-dir/<kind>; each replaces the
 * previous one of its kind only once complete (sp_ckpt_save). */
static int save_checkpoints(const worker_opts *o, sp_fsdp *f, uint32_t rank,
                            uint64_t step, sp_diag *d) {
  for (int k = SP_CKPT_FULL; o->wf.ckpt_dir && k <= SP_CKPT_LOCAL; k++) {
    if (!o->wf.kinds[k]) continue;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", o->wf.ckpt_dir,
             sp_ckpt_kind_dir((sp_ckpt_kind)k));
    int rc = sp_ckpt_save(f, (sp_ckpt_kind)k, dir, d);
    if (rc < 0) return rc;
    if (rank == 0) {
      printf("checkpoint (%s) of step %llu: %s\n",
             sp_ckpt_kind_name((sp_ckpt_kind)k), (unsigned long long)step,
             dir);
      fflush(stdout);
    }
  }
  return 0;
}

/* --load, with --load-params-only or the checkpoint's optimizer state and
 * step; a state mismatch names the flag that loads anyway. */
static int load(const worker_opts *o, sp_fsdp *f, sp_ckpt_info *info,
                sp_diag *d) {
  sp_ckpt_load_opts lo = {.params_only = o->wf.load_params_only};
  int rc = sp_ckpt_load_with(f, o->wf.load_kind, o->load_from, &lo, info, d);
  if (rc == SP_ESTATE && !o->wf.load_params_only &&
      strstr(d->msg, "state \"")) {
    sp_diag why = *d; /* the message is formatted into d */
    sp_diag_set(d, rc, "%.900s; --load-params-only starts the optimizer "
                "afresh", why.msg);
  }
  return rc;
}

/* *stopped: 0 when training ran to --steps; else the signal that stopped
 * this rank, or -1 when another rank's did. */
static int run(const worker_opts *o, int *stopped, sp_diag *d) {
  sp_session_opts so = {.coordinator = o->coordinator,
                        .rank = (uint32_t)o->rank,
                        .device = o->device,
                        .call_timeout_ms = o->call_timeout_ms,
                        .coordinator_grace_ms = o->coordinator_grace_ms,
                        .no_report = o->no_report,
                        .flight_events = o->flight_events,
                        .on_abort = on_abort,
                        .user = (void *)o,
                        .tls = !o->cred.insecure,
                        .tls_ca_file = o->cred.tls.ca_file,
                        .tls_cert_file = o->cred.tls.cert_file,
                        .tls_key_file = o->cred.tls.key_file,
                        .tls_server_name = o->cred.tls.server_name,
                        .token = o->cred.has_token ? o->cred.token : NULL};
  sp_session *s = NULL;
  sp_comm *world = NULL, *shard = NULL, *replica = NULL;
  sp_fsdp *f = NULL;
  sp_test_state *ts = NULL;
  sp_train_model tm = {0};
  sp_gpt2_trainer *gtr = NULL;
  double eval_s = 0; /* time in validation, left out of tokens/s */
  double eval_all_s = 0; /* and in all of the run's validations */
  uint64_t eval_tokens = 0;
  trainer tr;
  bool have_tr = false;
  double *losses = NULL, *step_s = NULL;
  sp_gpt2_times *gtimes = NULL;
  int rc = sp_session_open(&so, &s, d);
  if (rc < 0) return rc;
  uint32_t rank = sp_session_rank(s), w = sp_session_world(s);
  sp_inject_start(&g_inject, s, rank);
  /* a launcher started as many processes as it was told: if that is not
   * the job's world size, some ranks will never come (or are too many) */
  if (o->env.world_size > 0 && (uint32_t)o->env.world_size != w)
    rc = sp_diag_set(d, SP_EINVAL,
                     "rank %u: $%s=%ld but the coordinator's job has world "
                     "size %u", rank, o->env.world_size_var,
                     o->env.world_size, w);
  /* every rank checks before the rendezvous, so before any rank writes */
  if (rc == 0 && o->wf.ckpt_dir && o->wf.any_kind)
    rc = sp_ckpt_check_dir(o->wf.ckpt_dir, sp_session_plan(s)->version_hex, d);
  /* what to train, and the job as its trainer takes it, checked as
   * shardplane run checks them before starting the workers; every rank
   * takes an equal share of every micro-batch */
  sp_mlp_train_cfg cfg;
  if (rc == 0)
    rc = sp_train_model_pick(sp_session_model(s), o->synthetic, &tm, d);
  if (rc == 0)
    rc = sp_train_model_check(&tm, sp_session_plan(s), &o->train, o->wf.steps,
                              o->wf.lr, o->wf.global_batch, w, "the world size",
                              &cfg, d);
  sp_gpt2 *gpt = tm.gpt;
  sp_mlp *mlp = tm.mlp;
  bool is_gpt2 = gpt != NULL, is_mlp = mlp != NULL;
  if (rc == 0)
    rc = sp_fsdp_comms_open(s, o->comm_timeout_ms, &world, &shard, &replica,
                            d);
  set_comms(world, shard, replica);
  sp_fsdp_opts fo = {.session = s, .world = world, .shard_group = shard,
                     .replica_group = replica, .backward_prefetch = true,
                     .init_param = sp_mlp_init_param,
                     .init_buffer = sp_mlp_init_buffer,
                     .device = o->device};
  /* no hook at all unless a fault of this rank needs one */
  if (sp_inject_wants_hook(&g_inject)) {
    fo.before_collective = sp_inject_before_collective;
    fo.inject_user = &g_inject;
  }
  mem_report mem = {.rss_before = proc_status_bytes("VmRSS:")};
  if (is_gpt2) {
    fo.init_param = sp_gpt2_init_param;
    fo.init_buffer = sp_gpt2_init_buffer;
  }
  if (rc == 0) rc = sp_fsdp_new(&fo, &f, d);
  /* the optimizer (the synthetic cycle runs plain SGD) and any stand-in
   * state registered before a load, which fills them with the step count */
  if (rc == 0 && (is_mlp || is_gpt2))
    rc = sp_fsdp_optim_init(f, &cfg.optim, d);
  if (rc == 0 && o->test_state)
    rc = sp_test_state_new(f, o->test_state, &ts, d);
  /* --steps counts all steps: a resumed run starts after the
   * checkpoint's, with its data and schedule (both by step index) */
  uint32_t first = 0;
  sp_ckpt_info info = {0};
  if (rc == 0 && o->wf.load_dir)
    rc = load(o, f, &info, d);
  if (rc == 0 && o->wf.load_dir) {
    first = info.optim_steps < o->wf.steps ? (uint32_t)info.optim_steps
                                        : o->wf.steps;
    if (rank == 0 && first < o->wf.steps)
      printf("resuming after step %llu of %u (%s)\n",
             (unsigned long long)info.optim_steps, o->wf.steps, o->load_from);
    else if (rank == 0)
      printf("loaded the checkpoint of step %llu (%s): nothing to train up "
             "to --steps %u\n", (unsigned long long)info.optim_steps,
             o->load_from, o->wf.steps);
    fflush(stdout);
  }
  if (rc == 0 && is_mlp) {
    rc = trainer_init(&tr, f, s, mlp, &cfg, d);
    have_tr = true;
  }
  if (rc == 0 && is_gpt2)
    rc = sp_gpt2_trainer_new(gpt, f, s, &cfg, &o->train, tm.data, &gtr, d);
  if (rc == 0 && rank == 0 && is_gpt2) {
    printf("rank 0: GPT-2, %lld layers, d_model %lld, %lld heads, context "
           "%lld; %llu tokens a step; data %s\n", (long long)gpt->n_layer,
           (long long)gpt->C, (long long)gpt->n_head, (long long)gpt->ctx,
           (unsigned long long)sp_gpt2_trainer_tokens_per_step(gtr),
           sp_gpt2_trainer_data_source(gtr));
    fflush(stdout);
  }
  if (rc == 0 && rank == 0 && !is_mlp && !is_gpt2)
    printf("rank 0: --synthetic: running the synthetic-gradient cycle\n");
  uint32_t todo = o->wf.steps - first;
  losses = calloc(todo ? todo : 1, sizeof *losses);
  step_s = calloc(todo ? todo : 1, sizeof *step_s);
  gtimes = calloc(todo ? todo : 1, sizeof *gtimes);
  if ((!losses || !step_s || !gtimes) && rc == 0)
    rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  /* One numbering of steps everywhere: step indexes 0..steps-1 pick the
   * data; steps are reported (progress lines "step K/N", the session's
   * step, so `shardplane ranks` and watch) numbered from 1: step K is the
   * K-th, and after the last one every report says N. */
  double tlast = sp_clock_s();
  uint32_t logged = first; /* steps up to the last progress line */
  uint32_t step = first;
  uint64_t saved = UINT64_MAX; /* the step of the last checkpoint written */
  for (; rc == 0 && step < o->wf.steps; step++) {
    sp_inject_step(&g_inject, step + 1);
    /* every rank asks, so all stop after the same step, whichever got
     * the signal */
    bool stop = false;
    rc = sp_fsdp_any(f, g_stop_signal != 0, &stop, d);
    if (rc < 0 || stop) {
      *stopped = g_stop_signal ? g_stop_signal : -1;
      break;
    }
    if (o->report_toggle && step % o->report_toggle == 0)
      rc = sp_session_set_report(s, (step / o->report_toggle) % 2 == 0, d);
    double ts0 = sp_clock_s();
    double *loss = &losses[step - first];
    if (rc < 0)
      break;
    else if (is_gpt2)
      rc = sp_gpt2_trainer_step(gtr, step, loss, d);
    else if (is_mlp && tr.gpu)
      rc = trainer_step_gpu(&tr, step, loss, d);
    else if (is_mlp)
      rc = trainer_step(&tr, step, loss, d);
    else
      rc = synthetic_step(f, s, step, o->wf.lr, d);
    if (rc == 0 && ts) rc = sp_test_state_step(ts, d);
    /* a slowed rank's sleep is part of its step, as slow compute is */
    if (rc == 0) sp_inject_after_step(&g_inject, sp_clock_s() - ts0);
    step_s[step - first] = sp_clock_s() - ts0;
    if (rc == 0 && is_gpt2) gtimes[step - first] = sp_gpt2_trainer_times(gtr);
    if (rc == 0)
      sp_session_set_progress(s, is_mlp || is_gpt2 ? *loss : NAN, o->wf.steps);
    /* the held-out loss every --eval-every steps and after the last */
    double val = NAN;
    if (rc == 0 && is_gpt2 && o->train.eval_every &&
        ((step + 1) % o->train.eval_every == 0 || step + 1 == o->wf.steps)) {
      double te = sp_clock_s();
      rc = sp_gpt2_trainer_eval(gtr, &val, d);
      eval_s += sp_clock_s() - te;
      eval_all_s += sp_clock_s() - te;
      eval_tokens += sp_gpt2_trainer_eval_tokens(gtr);
    }
    if (rc == 0 && step == first) {
      sp_fsdp_stats st;
      sp_fsdp_get_stats(f, &st);
      mem.allocs_after_first_step = st.mem.allocs;
    }
    if (rc == 0 && rank == 0 && o->wf.log_every &&
        ((step + 1) % o->wf.log_every == 0 || step + 1 == o->wf.steps)) {
      double t = sp_clock_s();
      double per_s = (step + 1 - logged) * (double)o->wf.global_batch /
                     (t - tlast);
      double tok_s = is_gpt2 ? (step + 1 - logged) *
                                   (double)sp_gpt2_trainer_tokens_per_step(gtr) /
                                   (t - tlast - eval_s)
                             : 0;
      tlast = t;
      eval_s = 0;
      logged = step + 1;
      if (is_gpt2) {
        char vs[48] = "";
        if (!isnan(val)) snprintf(vs, sizeof vs, "  val loss %.4f", val);
        printf("step %u/%u  loss %.4f%s  %.0f tokens/s\n", step + 1,
               o->wf.steps, *loss, vs, tok_s);
      } else if (is_mlp)
        printf("step %u/%u  loss %.6f  %.0f samples/s\n", step + 1, o->wf.steps,
               *loss, per_s);
      else
        printf("step %u/%u  %.0f samples/s (synthetic gradients)\n",
               step + 1, o->wf.steps, per_s);
      fflush(stdout);
    }
    if (rc == 0 && o->wf.ckpt_every && (step + 1) % o->wf.ckpt_every == 0 &&
        step + 1 < o->wf.steps) {
      rc = save_checkpoints(o, f, rank, step + 1, d);
      saved = step + 1;
    }
  }
  uint32_t ran = step - first;
  if (rc == 0 && *stopped && rank == 0) {
    printf("stopping after step %u of %u: %s\n", step, o->wf.steps,
           *stopped > 0 ? strsignal(*stopped)
                        : "another rank was signalled");
    fflush(stdout);
  }
  /* the forward-only rate beside the training's (bench/gpu_check.sh
   * compares them): validation is the model's forward alone */
  if (rc == 0 && rank == 0 && eval_tokens > 0 && eval_all_s > 0) {
    printf("validation: %llu tokens forward only, %.0f tokens/s\n",
           (unsigned long long)eval_tokens, (double)eval_tokens / eval_all_s);
    fflush(stdout);
  }
  if (rc == 0 && rank == 0 && o->losses_path && (is_mlp || is_gpt2) &&
      write_doubles(o->losses_path, losses, ran) < 0)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot write", o->losses_path);
  if (rc == 0) {
    sp_fsdp_stats st;
    sp_fsdp_get_stats(f, &st);
    if (gtr) mem.activations = sp_gpt2_trainer_act_bytes(gtr);
    mem.train = (mem_phase){.have = true, .rss_start = mem.rss_before,
                            .rss_hwm = proc_status_bytes("VmHWM:"),
                            .counted = st.mem};
  }
  /* the final checkpoint; a stop before any step trained here has
   * nothing new to keep (the loaded checkpoint, if any, stays) */
  if (rc == 0 && saved != step && !(*stopped && ran == 0)) {
    /* the checkpoints' own peak, from here (both counters restart at what
     * is held now) */
    sp_fsdp_reset_peak_memory(f);
    mem.ckpt.have = true;
    mem.ckpt.rss_start = reset_rss_peak() ? proc_status_bytes("VmRSS:") : -1;
    rc = save_checkpoints(o, f, rank, step, d);
    sp_fsdp_stats st;
    sp_fsdp_get_stats(f, &st);
    mem.ckpt.counted = st.mem;
    mem.ckpt.rss_hwm =
        mem.ckpt.rss_start < 0 ? -1 : proc_status_bytes("VmHWM:");
  }
  if (rc == 0 && rank == 0 && o->stats_path &&
      write_stats(o, step_s, is_gpt2 ? gtimes : NULL, first, ran, &mem) < 0)
    rc = sp_diag_set(d, SP_EIO, "%s: cannot write", o->stats_path);
  /* a rank failed by another's fault says whose: its own error (a
   * collective cancelled) is only the consequence */
  uint32_t culprit;
  if (rc < 0 && sp_session_culprit(s, &culprit) && culprit != rank) {
    char why[SP_DIAG_MAX];
    sp_session_aborted(s, why, sizeof why);
    sp_diag_set(d, rc, "%s", why);
  }
  if (have_tr) trainer_free(&tr);
  sp_gpt2_trainer_free(gtr);
  sp_train_model_clear(&tm);
  free(losses);
  free(step_s);
  free(gtimes);
  /* the state's storage is the runtime's: it goes first */
  sp_test_state_free(ts);
  sp_fsdp_free(f);
  /* leave together, still abortable, then free */
  sp_comm *comms[3] = {world, shard, replica};
  for (int i = 0; i < 3; i++) {
    sp_diag ld = {{0}};
    int lrc = comms[i] ? sp_comm_leave(comms[i], &ld) : 0;
    if (rc == 0 && lrc < 0) {
      *d = ld;
      rc = lrc;
    }
  }
  set_comms(NULL, NULL, NULL);
  sp_comm_free(replica);
  sp_comm_free(shard);
  sp_comm_free(world);
  sp_diag cd = {{0}};
  int crc = sp_session_close(s, 5000, &cd);
  if (rc == 0 && crc < 0) {
    *d = cd;
    rc = crc;
  }
  return rc;
}

/* Debian's OpenBLAS picks its kernels from the CPU's cpuid family and
 * model; a virtual CPU that hides them falls back to the Prescott (SSE3)
 * kernels, whatever AVX it has: on a 2-core VM reporting "Intel Xeon
 * Processor" gpt2-mini's step took 6.5 s instead of 2.7 s with the
 * SkylakeX kernels. The library reads OPENBLAS_CORETYPE once, as it is
 * loaded, so the fix is to run again with it set. Nothing happens when
 * the variable is set already (the user's choice), or the detection was
 * not the fallback. */
static void blas_kernels(char **argv) {
  const char *core = openblas_get_corename();
  if (getenv("OPENBLAS_CORETYPE") || !core || strcasecmp(core, "prescott"))
    return;
  __builtin_cpu_init();
  const char *want = __builtin_cpu_supports("avx512f")  ? "SkylakeX"
                     : __builtin_cpu_supports("avx2")   ? "Haswell"
                     : __builtin_cpu_supports("avx")    ? "Sandybridge"
                                                        : NULL;
  if (!want) return;
  /* by its own path, not /proc/self/exe: the process's name (ps, pgrep,
   * the thread names tests check) is the file's */
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  setenv("OPENBLAS_CORETYPE", want, 1);
  execv(self, argv); /* on failure: on with the slow kernels */
}

int main(int argc, char **argv) {
  blas_kernels(argv);
  /* The training thread is the main thread, and keeps the program's name:
   * renaming it would rename the process for ps, pgrep and killall. */
  worker_opts o;
  int prc = parse_args(argc, argv, &o);
  if (prc) return prc == 1 ? 0 : prc;
  sp_diag d = {{0}};
  /* generation reads a FULL checkpoint, whatever else DIR holds */
  if (o.generate && !o.wf.load_kind) o.wf.load_kind = SP_CKPT_FULL;
  /* --load DIR may also be the folder shardplane run wrote (its full/,
   * sharded/ or local/ subfolder is found) */
  if (o.wf.load_dir &&
      sp_ckpt_resolve(o.wf.load_dir, o.wf.load_kind, o.load_from,
                      sizeof o.load_from, &o.wf.load_kind, &d) < 0) {
    fprintf(stderr, "shardplane-worker: %s\n", d.msg);
    return 2;
  }
  if (o.generate) {
    if (o.wf.load_kind != SP_CKPT_FULL) {
      fprintf(stderr, "shardplane-worker: --generate: %s holds no FULL "
              "checkpoint\n", o.wf.load_dir);
      return 2;
    }
    char file[4200];
    snprintf(file, sizeof file, "%s/model.safetensors", o.load_from);
    o.gen.ckpt_file = file;
    if (sp_gpt2_generate(&o.gen, stdout, &d) < 0) {
      fprintf(stderr, "shardplane-worker: --generate: %s\n", d.msg);
      return 1;
    }
    return 0;
  }
  /* before attaching: a rank that cannot run on its device says so at once
   * instead of after the rendezvous */
  int ordinal;
  int drc = sp_device_parse(o.device, &ordinal, &d);
  if (drc == SP_EINVAL) {
    fprintf(stderr, "shardplane-worker: --device \"%s\": expected cpu or "
            "cuda:N\n", o.device);
    return 2;
  }
  if (drc < 0) {
    fprintf(stderr, "shardplane-worker: rank %ld: --device %s\n", o.rank,
            d.msg);
    return 1;
  }
  struct sigaction sa = {.sa_handler = on_stop_signal, .sa_flags = SA_RESTART};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  int stopped = 0;
  int rc = run(&o, &stopped, &d);
  if (rc < 0) {
    fprintf(stderr, "shardplane-worker: rank %ld: %s\n", o.rank,
            d.msg[0] ? d.msg : sp_strerror(rc));
    return 1;
  }
  return stopped ? 128 + (stopped > 0 ? stopped : SIGTERM) : 0;
}
