/* The memory of a training rank, predicted before it starts: the FSDP
 * runtime's storage (plan/memory.h's model, exact for the runtime), the
 * reference trainer's activations and scratch for a batch shape (exact for
 * the trainer: gpt2_acts.c and mlp_acts.c lay them out for both), and the
 * worker process's own footprint (a constant, measured by bench/memory).
 *
 * `shardplane plan --memory` prints it, `shardplane run` and the worker
 * check it against the host's available memory before training (and a
 * device's free memory on a GPU), so a job that cannot fit is refused at
 * once with the figures and the flags that lower them, instead of being
 * killed by the kernel minutes in.
 *
 * Plain data and pure functions; any thread. */
#ifndef SP_TRAIN_MEMORY_H
#define SP_TRAIN_MEMORY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "plan/memory.h"
#include "plan/plan.h"
#include "train_flags.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a block of the trainer's memory is for. */
typedef enum sp_act_cat {
  SP_ACT_SAVED = 0,     /* activations kept from forward for backward (with
                           checkpointing: the blocks' inputs) */
  SP_ACT_RECOMPUTE = 1, /* with checkpointing: the one block's activations
                           the backward recomputes */
  SP_ACT_LOGITS = 2,    /* the head's B*T x V logits (then probabilities,
                           then their gradient) */
  SP_ACT_SCRATCH = 3,   /* gradients of activations, float32 copies of
                           params and their gradients, tokens, masks */
  SP_ACT_N_CATS = 4,
} sp_act_cat;

/* "activations", "recompute", "logits", "scratch"; "invalid" otherwise. */
const char *sp_act_cat_name(sp_act_cat c);
/* The same for people: "saved activations", ... */
const char *sp_act_cat_label(sp_act_cat c);

typedef struct sp_act_bytes {
  uint64_t cat[SP_ACT_N_CATS];
  uint64_t total;
} sp_act_bytes;

/* b->cat[c] and b->total += bytes. Inline, so that the activation layouts
 * (gpt2_acts.c, mlp_acts.c) call nothing of train_memory.c: the worker's
 * CUDA module links gpt2_acts.c, and train_memory.c's object would pull
 * the memory model and with it most of libshardplane into it. */
static inline void sp_act_bytes_add(sp_act_bytes *b, sp_act_cat c,
                                    uint64_t bytes) {
  if ((unsigned)c >= SP_ACT_N_CATS) return;
  b->cat[c] += bytes;
  b->total += bytes;
}

/* A worker process's resident bytes besides its runtime and model: the
 * program and its libraries, gRPC, the communicators and the BLAS's
 * buffers once touched (more of them by a larger model's products). Not
 * cuBLAS, which held some 150 MiB resident (210 MiB as the process
 * exited): the GPU models are a module loaded only to train on a GPU
 * (worker_cuda.h).
 * Measured, a CUDA build on the CPU (/usr/bin/time's maximum RSS, SGD,
 * T = 64, one micro-batch of one sequence a rank): the peak of a worker
 * training gpt2-tiny (a model of 3 MiB) was 15 MiB (13 MiB in a CPU-only
 * build), and GPT-2 124M's peak exceeded runtime plus activations by
 * 26.5, 29.2 and 33.2 MiB at W = 1, 2 and 4. */
#define SP_TRAIN_PROCESS_FOOTPRINT (UINT64_C(36) << 20)

/* The batch shape of a rank. */
typedef struct sp_train_shape {
  uint32_t global_batch; /* sequences (samples) a step over every rank */
  uint32_t grad_accum;   /* micro-batches a step, >= 1 */
  uint32_t seq_len;      /* tokens a sequence; 0: the model's context */
  bool checkpointing;    /* --activation-checkpointing */
  bool device;           /* the runtime's storage on a GPU */
} sp_train_shape;

typedef struct sp_train_mem {
  sp_mem_estimate runtime; /* the runtime's storage (plan/memory.h) */
  /* the family the trainer runs, "gpt2" or "mlp"; NULL: the spec is of
   * no family it runs, and act is zero (not counted) */
  const char *family;
  const char *not_counted; /* family NULL: why, for people */
  uint64_t micro_batch;    /* sequences (samples) a micro-batch on a rank */
  uint32_t seq_len;        /* tokens a sequence (GPT-2), as used */
  sp_act_bytes act;        /* the trainer's activations and scratch */
  uint64_t footprint;      /* SP_TRAIN_PROCESS_FOOTPRINT */
  /* A rank's peak: the runtime's reserved peak (what its pool holds at
   * most, cached blocks included) plus act (held for the whole run) plus
   * the footprint. On a GPU the device holds the runtime and act, the
   * host the footprint. */
  uint64_t peak;
} sp_train_mem;

/* Every non-empty unit's param_dtype is float32 (no mixed precision):
 * the GPT-2 step then reads and writes its params in place and lays out
 * no float32 copies (gpt2_acts.h). */
bool sp_train_mem_f32_views(const sp_plan *plan);

/* Predicts a rank's memory for the plan, the runtime's options and the
 * batch shape. For a spec the trainer does not run, only the runtime and
 * the footprint. Errors: SP_EINVAL (the shape does not divide: d names
 * the flag and values; a GPT-2 seq_len over its context), the runtime
 * model's and the layout's errors. */
int sp_train_mem_predict(const sp_plan *plan, const sp_mem_opts *opts,
                         const sp_train_shape *shape, sp_train_mem *out,
                         sp_diag *d);

/* The runtime's options and the batch shape of a job as the worker runs
 * it (limiter 2, backward prefetch): cfg the training in effect
 * (sp_train_model_check's: the optimizer, no_sync, the batch and its
 * micro-batches, flags over the spec's defaults), t for --seq-len and
 * --activation-checkpointing. */
void sp_train_mem_job(const sp_mlp_train_cfg *cfg, const sp_train_flags *t,
                      bool device, sp_mem_opts *opts, sp_train_shape *shape);

/* A "KEY N kB" line of a /proc file (/proc/meminfo, /proc/self/status) in
 * bytes; -1 when the file or the line is missing. key includes its colon
 * ("MemAvailable:", "VmHWM:"). */
long long sp_proc_bytes(const char *path, const char *key);

/* The host's available memory (MemAvailable of /proc/meminfo: what can
 * be allocated without swapping, page cache that can go included), in
 * bytes. SP_EIO when it cannot be read. */
int sp_host_mem_available(uint64_t *out, sp_diag *d);

/* Whether `ranks` ranks of m fit in `available` bytes of `where` ("this
 * host", "cuda:0"): 0, or SP_ENOMEM with one message giving the need, per
 * rank and by category, the batch shape, what is available and the flags
 * that lower it. device: available is a GPU's free memory, which holds
 * the runtime and the activations but not the process. */
int sp_train_mem_fit(const sp_train_mem *m, uint32_t ranks, uint64_t available,
                     const char *where, bool device, sp_diag *d);

/* The check shardplane run makes for the ranks it places and a worker for
 * its own: the job's rank predicted (sp_train_mem_job of cfg and t on a
 * GPU when n_gpus > 0, sp_train_mem_predict), then host_ranks of it
 * against the host's available memory (none: 0; on GPUs the host holds
 * only their processes), `host` naming it in the message, and one rank
 * against each of the GPUs first_gpu .. first_gpu + n_gpus - 1's free
 * memory. pred (NULL: not wanted) receives the prediction once it is
 * made, whether the rank then fits or not (the worker reports it). 0, or
 * sp_train_mem_fit's SP_ENOMEM, or the prediction's and the readings'
 * errors. */
int sp_train_mem_check(const sp_plan *plan, const sp_mlp_train_cfg *cfg,
                       const sp_train_flags *t, uint32_t host_ranks,
                       const char *host, int first_gpu, uint32_t n_gpus,
                       sp_train_mem *pred, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
