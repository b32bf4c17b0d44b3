/* The sharding plan: a pure function of (model spec, job config), computed
 * identically on every process (the rules: docs/fsdp.md).
 *
 * - Units: the root plus every module the wrap policy names (and, with mixed
 *   precision, every module of a full-precision type). A unit owns the
 *   parameters of its subtree not owned by a nested unit; units are claimed
 *   in post-order, as FSDP's recursive auto-wrap does.
 * - Per unit one flat parameter: parameters in FSDP flatten order
 *   (named_modules, then each module's own parameters), a tied parameter
 *   flattened once under its first name; with use_orig_params, FSDP's
 *   alignment padding entries.
 * - Shards: c = ceil(N / W_shard); rank r owns [r*c, min((r+1)*c, N)) of the
 *   flat parameter, zero-padded to c. NO_SHARD: every rank holds all N.
 *   HYBRID_SHARD: W_shard is the shard group size and the shard index is
 *   r % W_shard.
 * - Buffers keyed by FQN: original dtype, compute dtype (the innermost
 *   owning unit's buffer_dtype for floating buffers; integer and bool
 *   buffers never change), owner unit, persistent.
 * - A version: a 64-bit content hash, equal on every process for equal
 *   inputs, printed as 16 hex digits.
 *
 * An sp_plan borrows the sp_model it was built from (which must outlive it)
 * and owns everything else; sp_plan_free() releases it.
 */
#ifndef SP_PLAN_H
#define SP_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"
#include "job.h"
#include "model.h"
#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One slot of a flat parameter. */
typedef struct sp_flat_entry {
  int32_t param;   /* model param index; -1 for alignment padding */
  const char *fqn; /* the name FSDP flattened it under (NULL for padding) */
  int64_t offset;  /* in the unpadded flat parameter */
  int64_t numel;
} sp_flat_entry;

typedef struct sp_unit {
  int32_t module;     /* model module index of the wrapped module */
  int32_t parent;     /* enclosing unit, -1 for the root unit */
  size_t first_entry; /* entries [first_entry, first_entry + n_entries) */
  size_t n_entries;
  size_t n_params; /* real (non-padding) entries */
  sp_dtype dtype;  /* dtype of the flat parameter; INVALID when empty */
  /* any of its parameters requires grad (they all agree unless
   * use_orig_params, which allows frozen and trainable ones together) */
  bool requires_grad;
  int64_t numel;       /* N, alignment padding included */
  int64_t shard_numel; /* c: elements every rank holds, padding included */
  /* Mixed precision as this unit applies it (resolved, never INVALID for a
   * non-empty unit except buffer_dtype, where INVALID means "keep"). */
  bool full_precision;   /* a module type kept out of mixed precision */
  bool mixed_precision;  /* false: policy off, or a full-precision unit */
  sp_dtype param_dtype;  /* unsharded / all-gather dtype */
  sp_dtype reduce_dtype; /* gradient collective dtype */
  sp_dtype buffer_dtype; /* INVALID: buffers keep their dtype */
  bool keep_low_precision_grads;
} sp_unit;

typedef struct sp_plan_buffer {
  int32_t buffer; /* model buffer index; FQN: model->buffers[buffer].fqn */
  sp_dtype orig_dtype;
  sp_dtype compute_dtype;
  int32_t unit; /* innermost owning unit */
  bool persistent;
} sp_plan_buffer;

/* A parameter name that shares storage with a flattened one. */
typedef struct sp_plan_alias {
  const char *fqn;
  int32_t param; /* model param index of the shared tensor */
} sp_plan_alias;

typedef struct sp_plan {
  const sp_model *model; /* borrowed */
  uint32_t world_size;
  sp_strategy strategy; /* effective: FULL_SHARD at W=1 becomes NO_SHARD */
  uint32_t shard_world; /* ranks a flat parameter is split over */
  bool use_orig_params;
  sp_unit *units; /* index 0 is the root unit */
  size_t n_units;
  sp_flat_entry *entries;
  size_t n_entries;
  sp_plan_buffer *buffers; /* in model order */
  size_t n_buffers;
  sp_plan_alias *aliases;
  size_t n_aliases;
  int32_t *param_unit;  /* per model param: owning unit */
  int32_t *param_entry; /* per model param: index into entries */
  uint64_t version;
  char version_hex[17];
} sp_plan;

/* Builds the plan. Validates the job against the model first. Errors:
 * SP_EINVAL (bad job: the field in diag), SP_EFORMAT (the model cannot be
 * flattened: mixed dtypes or requires_grad in one unit, naming both FQNs),
 * SP_ENOMEM. */
int sp_plan_build(const sp_model *model, const sp_job *job, sp_plan **out,
                  sp_diag *diag);
void sp_plan_free(sp_plan *plan);

/* Shard index of `rank` within its shard group: r for FULL_SHARD and
 * SHARD_GRAD_OP, r % group for HYBRID_SHARD, 0 for NO_SHARD. */
uint32_t sp_plan_shard_index(const sp_plan *plan, uint32_t rank);

/* The slice of unit `unit`'s flat parameter that `rank` holds:
 * [*start, *end), clamped to N (empty when start == end), and the zero
 * padding that fills it to c. SP_ERANGE for a bad unit or rank. */
int sp_plan_rank_range(const sp_plan *plan, uint32_t unit, uint32_t rank,
                       int64_t *start, int64_t *end, int64_t *padding);

/* FSDP's _ShardParamInfo for one parameter present in a rank's shard. */
typedef struct sp_shard_param {
  size_t entry;            /* index into plan->entries */
  int64_t offset_in_shard; /* where the slice starts in the rank's shard */
  int64_t numel_in_shard;
  int64_t intra_start; /* first element of the param in the slice */
  int64_t intra_end;   /* last element, inclusive (as FSDP) */
} sp_shard_param;

/* Lists the parameters (padding skipped) overlapping rank's shard of the
 * unit, in flat order. Writes up to `cap` into out and the total count into
 * *n (call with cap 0 to size the array). SP_ERANGE for a bad unit/rank. */
int sp_plan_shard_params(const sp_plan *plan, uint32_t unit, uint32_t rank,
                         sp_shard_param *out, size_t cap, size_t *n);

/* Where a parameter lives. Aliases resolve to the flattened tensor. */
typedef struct sp_param_location {
  int32_t param; /* model param index */
  int32_t unit;
  size_t entry;
  int64_t offset; /* in the unit's flat parameter */
  int64_t numel;
  uint32_t first_shard; /* shard indices holding a part of it, inclusive */
  uint32_t last_shard;
  bool is_alias;
} sp_param_location;

/* SP_ENOENT when no parameter or alias has that FQN. */
int sp_plan_locate(const sp_plan *plan, const char *fqn,
                   sp_param_location *out);

/* Index of the buffer with that FQN in plan->buffers, or -1. */
int32_t sp_plan_find_buffer(const sp_plan *plan, const char *fqn);

/* Module FQN of a unit, "" for the root. */
const char *sp_plan_unit_fqn(const sp_plan *plan, uint32_t unit);

#ifdef __cplusplus
}
#endif
#endif
