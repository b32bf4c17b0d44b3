/* Memory of the FSDP runtime: the categories its storage is counted in, the
 * caching pool that holds it, and the memory model that predicts, from the
 * plan alone, the bytes every rank holds at its peak (the rules:
 * docs/fsdp.md, "Memory").
 *
 * One pool implementation serves both: the runtime (client/lib/fsdp*.c)
 * backs it with real host or device memory, the model with a counting
 * allocator that hands out tokens, and replays the standard schedule
 * through it. So the pool's reuse (and therefore what a caching allocator
 * keeps reserved) is the same code in both, and the model is exact for the
 * runtime, not an estimate of it.
 *
 * Everything here is plain data and pure functions; a pool is used by one
 * thread at a time (the runtime's training thread).
 */
#ifndef SP_MEMORY_H
#define SP_MEMORY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/sp_error.h"
#include "plan/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a block of the runtime's storage is for. */
typedef enum sp_mem_cat {
  SP_MEM_SHARD_PARAMS = 0, /* master shards: c elements per unit, unit dtype */
  SP_MEM_SHARD_GRADS = 1,  /* reduced gradient shards: c elements per unit */
  SP_MEM_OPTIMIZER = 2,    /* optimizer state (momentum, AdamW moments) */
  SP_MEM_PARAMS = 3,       /* unsharded parameters: c * W_s elements in
                              param_dtype per unit between unshard and
                              reshard (and summoned master parameters);
                              none where they are the master (W_s = 1
                              without mixed precision) */
  SP_MEM_GRADS = 4,        /* unsharded gradients: c * W_s in param_dtype
                              from pre_backward until the reduction is
                              done; none where they are the gradient
                              shard (W_s = 1, gradient in param_dtype) */
  SP_MEM_REDUCE = 5,       /* reduce-dtype buffers of reductions in flight */
  SP_MEM_BUFFERS = 6,      /* module buffers (replicated) */
  SP_MEM_N_CATS = 7,
} sp_mem_cat;

/* "sharded_params", "sharded_grads", "optimizer", "unsharded_params",
 * "unsharded_grads", "reduce", "buffers"; "invalid" otherwise. Never NULL. */
const char *sp_mem_cat_name(sp_mem_cat c);
/* The same for people: "sharded params", ... */
const char *sp_mem_cat_label(sp_mem_cat c);

typedef struct sp_mem_bytes {
  uint64_t current;
  uint64_t peak; /* since creation or the last sp_mem_pool_reset_peaks */
} sp_mem_bytes;

typedef struct sp_mem_account {
  sp_mem_bytes cat[SP_MEM_N_CATS]; /* bytes in use, by category */
  sp_mem_bytes total;    /* bytes in use, all categories (peak of the sum) */
  sp_mem_bytes reserved; /* bytes taken from the allocator: in use plus the
                            pool's cached free blocks */
  uint64_t allocs;       /* allocator calls (a step after the first makes
                            none) */
  uint64_t reuses;       /* takes answered from the pool's cached blocks */
} sp_mem_account;

/* ---- the caching pool ----
 * Blocks come from an allocator (host calloc, cudaMalloc, or the model's
 * counter) and are handed back to it only by sp_mem_pool_destroy, except
 * the ones sp_mem_pool_alloc made, which sp_mem_pool_release returns at
 * once. A take is answered by a cached free block of exactly the bytes
 * asked for, else by a new block: in a step that repeats the one before,
 * every take finds its block, so no step after the first allocates. Exact
 * sizes (rather than any block large enough) keep the count of what is
 * in use equal to what is asked for, and units of one type share one size
 * anyway (every GPT2Block's slot is the same 28 MB). */

/* n elements of esize bytes, zero-filled; n == 0 gives a valid pointer.
 * Returns 0 or a negative SP_E* code with d filled. */
typedef int (*sp_mem_alloc_fn)(void *user, size_t n, size_t esize, void **out,
                               sp_diag *d);
typedef void (*sp_mem_release_fn)(void *user, void *p);

typedef struct sp_mem_block sp_mem_block;

typedef struct sp_mem_pool {
  sp_mem_alloc_fn alloc;
  sp_mem_release_fn release;
  void *user;
  sp_mem_block *blocks; /* every live block, own and cached */
  size_t n_blocks, cap_blocks;
  sp_mem_account acct;
} sp_mem_pool;

void sp_mem_pool_init(sp_mem_pool *p, sp_mem_alloc_fn alloc,
                      sp_mem_release_fn release, void *user);
/* Releases every block to the allocator; the pool is empty afterwards. */
void sp_mem_pool_destroy(sp_mem_pool *p);

/* A block of its own, zero-filled, counted in cat until released.
 * SP_ETOOBIG when n * esize overflows, SP_EINVAL for a bad category, the
 * allocator's error otherwise (d names the category and the size). */
int sp_mem_pool_alloc(sp_mem_pool *p, sp_mem_cat cat, size_t n, size_t esize,
                      void **out, sp_diag *d);
/* A cached block of exactly n * esize bytes, or a new one: contents
 * undefined (not zeroed). Counted in cat until released. Errors as
 * sp_mem_pool_alloc. */
int sp_mem_pool_take(sp_mem_pool *p, sp_mem_cat cat, size_t n, size_t esize,
                     void **out, sp_diag *d);
/* Ends a block's use: a taken block goes back to the cache, an own block to
 * the allocator. NULL is fine. SP_EINVAL (d says which) when ptr is no
 * block of the pool or was counted in another category; the block is
 * released all the same. */
int sp_mem_pool_release(sp_mem_pool *p, sp_mem_cat cat, void *ptr, sp_diag *d);
/* Every peak to its current value (as torch.cuda.reset_peak_memory_stats),
 * to measure one phase, e.g. a checkpoint. */
void sp_mem_pool_reset_peaks(sp_mem_pool *p);

/* ---- the memory model ---- */

/* Values equal the wire enum shardplane.v1.Optimizer. */
typedef enum sp_mem_optimizer {
  SP_MEM_OPT_INVALID = 0,
  SP_MEM_OPT_NONE = 1,         /* no optimizer state */
  SP_MEM_OPT_SGD = 2,          /* plain SGD: none either */
  SP_MEM_OPT_SGD_MOMENTUM = 3, /* one float32 buffer like the master */
  SP_MEM_OPT_ADAMW = 4,        /* two float32 moments like the master */
} sp_mem_optimizer;

/* "none", "sgd", "sgd-momentum", "adamw" (case-insensitive); 0 or
 * SP_EINVAL. */
int sp_mem_optimizer_parse(const char *s, sp_mem_optimizer *out);
const char *sp_mem_optimizer_name(sp_mem_optimizer o); /* "invalid" if bad */
/* float32 copies of a unit's shard the optimizer keeps: 0, 0, 1, 2. */
uint32_t sp_mem_optimizer_states(sp_mem_optimizer o);

/* Largest limiter the model takes: far beyond any unit count that fits a
 * machine, and small enough that nothing it sizes can overflow. */
#define SP_MEM_MAX_INFLIGHT 65536u

typedef struct sp_mem_opts {
  sp_mem_optimizer optimizer; /* SP_MEM_OPT_INVALID: sgd */
  uint32_t max_inflight;      /* the limiter (all-gathers and reductions in
                                 flight), 1..SP_MEM_MAX_INFLIGHT; 0: 2, the
                                 runtime's default */
  bool backward_prefetch;     /* sp_fsdp_opts.backward_prefetch */
  /* Gradient accumulation under no_sync: every micro-batch but the last
   * skips the reduction and keeps each unit's unsharded gradient until the
   * last one reduces it, so all of them are alive at once. */
  bool no_sync;
} sp_mem_opts;

/* sgd, limiter 2, backward prefetch on (what shardplane-worker runs), no
 * no_sync. */
void sp_mem_opts_default(sp_mem_opts *o);

typedef struct sp_mem_estimate {
  /* per rank (every rank holds c elements of every unit, so all ranks are
   * equal): peaks over creation and two steps, and current after them */
  sp_mem_account acct;
  /* The parts the bench compares against. sharded_state: shards, their
   * gradients and the optimizer state, which fall as 1/W_s.
   * in_flight_floor: what the schedule keeps unsharded however large W
   * is: the module buffers, the root unit's parameters and gradient (FSDP
   * does not reshard the root after forward, and its gradient is written
   * throughout the backward), and max_inflight times the largest other
   * unit's parameter slot, gradient slot and reduce buffers (the limiter's
   * allowance); slots that are a unit's shards themselves (W_s = 1) count
   * nothing. */
  uint64_t sharded_state;
  uint64_t in_flight_floor;
  sp_mem_opts opts; /* as used (defaults filled in) */
} sp_mem_estimate;

/* Predicts the runtime's counted bytes per rank for the plan: replays
 * sp_fsdp_new (shards, gradient shards, optimizer state, buffers; with
 * W_s = 1 the low-precision unsharded parameters of mixed precision, the
 * only unsharded storage kept), lazy init, and two steps of the standard
 * schedule (forward in module order, root_post_forward, backward in
 * reverse with BACKWARD_PRE prefetch and the limiter, post_backward(0),
 * finish_backward, the optimizer step) through a pool, taking and
 * releasing exactly what the runtime does. opts NULL: defaults. Errors:
 * SP_EINVAL (bad options: d names the field and value), SP_ETOOBIG,
 * SP_ENOMEM. */
int sp_mem_estimate_plan(const sp_plan *plan, const sp_mem_opts *opts,
                         sp_mem_estimate *out, sp_diag *d);

#ifdef __cplusplus
}
#endif
#endif
