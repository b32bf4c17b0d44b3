/* Job config: world size, wrap policy, sharding strategy, mixed precision,
 * backend. The "shardplane.job/v1" JSON form:
 *
 *   { "format": "shardplane.job/v1", "world_size": 8,
 *     "strategy": "FULL_SHARD", "shard_group_size": 4,        (HYBRID_SHARD)
 *     "wrap": {"modules": ["model.layers.0"], "types": ["LlamaDecoderLayer"]},
 *     "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32",
 *                         "buffer_dtype": "bfloat16",
 *                         "keep_low_precision_grads": false,
 *                         "full_precision_types": ["BatchNorm2d"]},
 *     "backend": "gloo", "use_orig_params": false }
 *
 * An sp_job owns its strings; sp_job_clear() frees them. Command-line flags
 * and the JSON file fill the same struct, so both go through one validator.
 */
#ifndef SP_JOB_H
#define SP_JOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"
#include "model.h"
#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SP_JOB_MAX_WORLD 1048576u
#define SP_JOB_MAX_LIST 4096u

/* Values equal PyTorch's ShardingStrategy and the proto enum. */
typedef enum sp_strategy {
  SP_STRATEGY_INVALID = 0,
  SP_FULL_SHARD = 1,
  SP_SHARD_GRAD_OP = 2,
  SP_NO_SHARD = 3,
  SP_HYBRID_SHARD = 4,
} sp_strategy;

typedef enum sp_backend {
  SP_BACKEND_INVALID = 0,
  SP_BACKEND_GLOO = 1,
  SP_BACKEND_NCCL = 2,
} sp_backend;

typedef struct sp_strlist {
  char **items;
  size_t n;
} sp_strlist;

typedef struct sp_mixed_precision {
  /* Whether a MixedPrecision policy was given at all (FSDP's
   * `mixed_precision is not None`): it enables full_precision_types. */
  bool enabled;
  sp_dtype param_dtype;  /* SP_DTYPE_INVALID: unset (keep the param dtype) */
  sp_dtype reduce_dtype; /* unset: param_dtype if set, else the param dtype */
  sp_dtype buffer_dtype; /* unset: buffers keep their dtype */
  bool keep_low_precision_grads;
  /* Module types wrapped as their own units with mixed precision off, as
   * FSDP's _module_classes_to_ignore. When not set explicitly, FSDP's default
   * (_BatchNorm: BatchNorm1d/2d/3d, SyncBatchNorm) applies. */
  sp_strlist full_precision_types;
  bool full_precision_types_set;
} sp_mixed_precision;

typedef struct sp_job {
  uint32_t world_size;
  sp_strategy strategy;
  uint32_t shard_group_size; /* HYBRID_SHARD only; 0 = unset */
  sp_strlist wrap_modules;   /* module FQNs that become units */
  sp_strlist wrap_types;     /* module types that become units */
  sp_mixed_precision mp;
  sp_backend backend;
  bool use_orig_params; /* FSDP's alignment padding in the flat parameter */
} sp_job;

/* Defaults: world 1, FULL_SHARD, no mixed precision, gloo. */
void sp_job_init(sp_job *job);
void sp_job_clear(sp_job *job);

/* Fills `job` (which the caller initialised) from JSON; fields absent from the
 * file keep their current values. Errors: SP_EIO, SP_ETOOBIG, SP_EFORMAT,
 * SP_ENOMEM with "<file>: <json path>: <problem>" in diag. A key the format
 * does not have, in any of its objects, is SP_EFORMAT naming the nearest
 * one: `J.json: unknown key "stratgy" (did you mean "strategy"?)`. */
int sp_job_load_file(const char *path, sp_job *job, sp_diag *diag);
int sp_job_load_string(const char *json, size_t len, const char *origin,
                       sp_job *job, sp_diag *diag);

/* Appends a copy of s. SP_ETOOBIG past SP_JOB_MAX_LIST, SP_ENOMEM. */
int sp_strlist_add(sp_strlist *l, const char *s);
bool sp_strlist_contains(const sp_strlist *l, const char *s);
void sp_strlist_clear(sp_strlist *l);

/* Name parsing/printing for the enums ("FULL_SHARD", "gloo"). Parsing is
 * case-insensitive; returns 0 or SP_EINVAL. */
int sp_strategy_parse(const char *s, sp_strategy *out);
const char *sp_strategy_name(sp_strategy s);
int sp_backend_parse(const char *s, sp_backend *out);
const char *sp_backend_name(sp_backend b);

/* Checks the job on its own and against a model: world size in range,
 * shard group dividing the world, floating dtypes, every wrap target present
 * in the model. Errors: SP_EINVAL with the field at fault in diag. */
int sp_job_validate(const sp_job *job, const sp_model *model, sp_diag *diag);

/* Command-line job flags shared by every tool (shardplane plan,
 * shardplane-coordinator, shardplane run). Tools apply a job file first and
 * then the flags in order, so flags override the file. */
typedef struct sp_job_flag_def {
  const char *name; /* without the leading "--" */
  bool has_arg;
  const char *help; /* one line, for --help */
} sp_job_flag_def;
/* Terminated by an entry whose name is NULL. */
extern const sp_job_flag_def sp_job_flags[];

/* Applies one flag. Returns 0, SP_ENOENT when `name` is not a job flag,
 * SP_EINVAL for a bad value (diag names the flag and the value), or
 * SP_ETOOBIG/SP_ENOMEM. */
int sp_job_apply_flag(sp_job *job, const char *name, const char *value,
                      sp_diag *diag);
/* Prints the job flags' help lines, indented, to f. */
void sp_job_flags_print_help(void *file);
/* The same without the flag named `skip` (a tool that sets it itself). */
void sp_job_flags_print_help_except(void *file, const char *skip);

/* The tools' default wrap policy, the same in shardplane run, shardplane
 * plan and shardplane-coordinator (so a checkpoint of one loads into the
 * others): a job without one (no wrap module, no wrap type) wraps every
 * module of the types of the spec's "no_split_modules" as a unit, as
 * transformer_auto_wrap_policy does with Hugging Face's
 * _no_split_modules; a spec without them, every module of type
 * SP_JOB_DEFAULT_WRAP_TYPE, when it has any. *applied (may be NULL) says
 * whether it did. 0, SP_ETOOBIG or SP_ENOMEM. */
#define SP_JOB_DEFAULT_WRAP_TYPE "Linear"
int sp_job_default_wrap(sp_job *job, const sp_model *model, bool *applied);

/* Whether modules of `type` become full-precision units under this job's
 * mixed-precision policy (false when mixed precision is off). */
bool sp_job_full_precision_type(const sp_job *job, const char *type);

#ifdef __cplusplus
}
#endif
#endif
