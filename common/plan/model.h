/* Model spec loader: the "shardplane.model/v1" JSON format.
 *
 *   { "format": "shardplane.model/v1", "name": "...",
 *     "modules": [{"fqn": "", "type": "ResNet"}, ...],      named_modules order
 *     "params":  [{"fqn", "shape", "dtype", "requires_grad"}, ...],
 *     "buffers": [{"fqn", "shape", "dtype", "persistent"}, ...],
 *     "tied":    [{"fqn": "lm_head.weight", "to": "transformer.wte.weight"}],
 *     "config":  {"n_head": 12, ...},
 *     "no_split_modules": ["GPT2Block"],
 *     "training": {"optimizer": "adamw", "lr": 6e-4, ...} }
 *
 * "config" (optional) holds the integer hyper-parameters the shapes do not
 * say, as a Hugging Face config.json does (a transformer's head count);
 * other value types there are ignored, so an HF config can be pasted in.
 *
 * "no_split_modules" (optional) names module types never split across units,
 * as Hugging Face's `_no_split_modules`, which PyTorch FSDP users pass to
 * transformer_auto_wrap_policy: the tools' default wrap policy wraps each
 * module of these types (sp_job_default_wrap). Every entry must be the type
 * of some module, once.
 *
 * "training" (optional) holds the defaults of the training flags of the
 * same names (--optimizer, --lr, ...; client/worker/train_flags.h), the
 * recipe the model is known to train with; flags win over it. Only the
 * values are checked here, and the fields that need one another (betas only
 * with adamw, warmup only with cosine, min_lr at most lr); how a run
 * combines them with its flags is the worker's (sp_train_flags_finish_spec).
 *
 * Every error names the file, the JSON path ("params[17].shape[1]") and what is
 * wrong. A loaded model is immutable; all strings and arrays are owned by the
 * sp_model and freed by sp_model_free().
 */
#ifndef SP_MODEL_H
#define SP_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"
#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SP_MAX_DIMS 8
/* Bounds checked before allocating: a spec beyond them is rejected. */
#define SP_MODEL_MAX_FILE_BYTES (256u << 20)
#define SP_MODEL_MAX_ENTRIES 1000000
/* numel and byte sizes stay below this so sums over a model cannot overflow */
#define SP_MODEL_MAX_NUMEL (INT64_C(1) << 50)

typedef struct sp_module {
  const char *fqn;      /* "" for the root */
  const char *type;     /* class name, e.g. "BatchNorm2d" */
  int32_t parent;       /* index into modules; -1 for the root */
  int32_t depth;        /* root 0 */
  uint32_t subtree_end; /* modules [index, subtree_end) are this subtree */
} sp_module;

typedef struct sp_tensor_spec {
  const char *fqn;
  const char *local_name; /* points into fqn, after the last '.' */
  int32_t module;         /* owning module index */
  int32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  int64_t numel;
  sp_dtype dtype;
  bool flag; /* params: requires_grad; buffers: persistent */
} sp_tensor_spec;

/* A parameter registered under a second name (weight tying). */
typedef struct sp_tied {
  const char *fqn;        /* the alias, e.g. "lm_head.weight" */
  const char *local_name; /* points into fqn */
  int32_t module;         /* module the alias is registered on */
  int32_t target;         /* index into params */
} sp_tied;

/* One integer of the spec's "config". */
typedef struct sp_model_config {
  const char *key;
  int64_t value;
} sp_model_config;

/* Most "config" entries kept. */
#define SP_MODEL_MAX_CONFIG 256
/* Most "no_split_modules" entries (Hugging Face's lists hold one or two). */
#define SP_MODEL_MAX_NO_SPLIT 64

/* Which fields of "training" the spec has (sp_model_training.set). */
enum {
  SP_MODEL_TRAIN_OPTIMIZER = 1u << 0,
  SP_MODEL_TRAIN_LR = 1u << 1,
  SP_MODEL_TRAIN_MOMENTUM = 1u << 2,
  SP_MODEL_TRAIN_WEIGHT_DECAY = 1u << 3,
  SP_MODEL_TRAIN_BETAS = 1u << 4,
  SP_MODEL_TRAIN_EPS = 1u << 5,
  SP_MODEL_TRAIN_SCHEDULE = 1u << 6,
  SP_MODEL_TRAIN_WARMUP_STEPS = 1u << 7,
  SP_MODEL_TRAIN_WARMUP_RATIO = 1u << 8,
  SP_MODEL_TRAIN_MIN_LR = 1u << 9,
  SP_MODEL_TRAIN_CLIP = 1u << 10,
};

/* The spec's "training", checked: each field as the flag of its name takes
 * it. warmup_ratio, a fraction of the run's steps (Hugging Face's
 * TrainingArguments.warmup_ratio), stands for --warmup-steps where the
 * spec cannot know the run's length. */
typedef struct sp_model_training {
  unsigned set;          /* SP_MODEL_TRAIN_* of the fields present */
  bool adamw;            /* "optimizer": "adamw" (false: "sgd") */
  bool cosine;           /* "lr_schedule": "cosine" (false: "constant") */
  double lr;             /* >= 0 */
  double momentum;       /* >= 0; sgd only */
  double weight_decay;   /* >= 0 */
  double beta1, beta2;   /* "betas": [B1, B2], each in [0, 1); adamw only */
  double eps;            /* > 0; adamw only */
  uint64_t warmup_steps; /* cosine only; a run shorter takes its length */
  double warmup_ratio;   /* in [0, 1]; cosine only; not with warmup_steps */
  double min_lr;         /* in [0, lr]; cosine only; needs lr */
  double clip_grad_norm; /* >= 0; 0: off */
} sp_model_training;

typedef struct sp_model {
  char *name;
  char *path; /* file it came from, or the name given to the string loader */
  sp_module *modules;
  size_t n_modules;
  sp_tensor_spec *params;
  size_t n_params;
  sp_tensor_spec *buffers;
  size_t n_buffers;
  sp_tied *tied;
  size_t n_tied;
  sp_model_config *config;
  size_t n_config;
  char **no_split_modules; /* "no_split_modules": module types, each once */
  size_t n_no_split_modules;
  sp_model_training training; /* "training"; .set 0 when absent */
  struct sp_strmap *index_;   /* private: FQN -> entry, for the lookups below */
} sp_model;

/* Loads and validates a spec. On success *out is a new model the caller frees
 * with sp_model_free(). Errors: SP_EIO (cannot read), SP_ETOOBIG (file or
 * array over the limits above), SP_EFORMAT (anything invalid), SP_ENOMEM.
 * diag, when given, gets "<file>: <json path>: <what is wrong>". */
int sp_model_load_file(const char *path, sp_model **out, sp_diag *diag);
/* Same from memory; `origin` names the source in messages. */
int sp_model_load_string(const char *json, size_t len, const char *origin,
                         sp_model **out, sp_diag *diag);
void sp_model_free(sp_model *m);

/* Index lookups by exact FQN; -1 when absent. Constant time. */
int32_t sp_model_find_module(const sp_model *m, const char *fqn);
int32_t sp_model_find_param(const sp_model *m, const char *fqn);
int32_t sp_model_find_buffer(const sp_model *m, const char *fqn);
/* The integer "config" entry `key`: 0 with *out set, SP_ENOENT when the
 * spec has none. */
int sp_model_config_int(const sp_model *m, const char *key, int64_t *out);
/* Index into m->tied of a tied-parameter name, or -1. */
int32_t sp_model_find_tied(const sp_model *m, const char *fqn);

#ifdef __cplusplus
}
#endif
#endif
