#include "job.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/flag.h"
#include "base/json.h"
#include "base/strmap.h"

#define SP_JOB_FORMAT "shardplane.job/v1"
#define SP_JOB_MAX_FILE_BYTES (16u << 20)

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

static const char *const k_strategies[] = {
    [SP_FULL_SHARD] = "FULL_SHARD",
    [SP_SHARD_GRAD_OP] = "SHARD_GRAD_OP",
    [SP_NO_SHARD] = "NO_SHARD",
    [SP_HYBRID_SHARD] = "HYBRID_SHARD",
};

static const char *const k_backends[] = {
    [SP_BACKEND_GLOO] = "gloo",
    [SP_BACKEND_NCCL] = "nccl",
};

/* The keys of each object of a job file: any other is refused, naming
 * the nearest of these. */
static const char *const k_root_keys[] = {
    "format", "world_size",      "strategy", "shard_group_size",
    "wrap",   "mixed_precision", "backend",  "use_orig_params"};
static const char *const k_wrap_keys[] = {"modules", "types"};
static const char *const k_mp_keys[] = {
    "param_dtype", "reduce_dtype", "buffer_dtype", "keep_low_precision_grads",
    "full_precision_types"};

/* FSDP's default _module_classes_to_ignore is (_BatchNorm,). */
static const char *const k_default_full_precision[] = {
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"};

void sp_job_init(sp_job *job) {
  memset(job, 0, sizeof *job);
  job->world_size = 1;
  job->strategy = SP_FULL_SHARD;
  job->backend = SP_BACKEND_GLOO;
}

void sp_strlist_clear(sp_strlist *l) {
  for (size_t i = 0; i < l->n; i++) free(l->items[i]);
  free(l->items);
  l->items = NULL;
  l->n = 0;
}

void sp_job_clear(sp_job *job) {
  sp_strlist_clear(&job->wrap_modules);
  sp_strlist_clear(&job->wrap_types);
  sp_strlist_clear(&job->mp.full_precision_types);
  sp_job_init(job);
}

int sp_strlist_add(sp_strlist *l, const char *s) {
  if (l->n >= SP_JOB_MAX_LIST) return SP_ETOOBIG;
  char *copy = sp_strdup(s);
  if (copy == NULL) return SP_ENOMEM;
  char **items = realloc(l->items, (l->n + 1) * sizeof *items);
  if (items == NULL) {
    free(copy);
    return SP_ENOMEM;
  }
  items[l->n++] = copy;
  l->items = items;
  return 0;
}

bool sp_strlist_contains(const sp_strlist *l, const char *s) {
  for (size_t i = 0; i < l->n; i++)
    if (strcmp(l->items[i], s) == 0) return true;
  return false;
}

static int parse_name(const char *s, const char *const *names, int n,
                      int *out) {
  if (s == NULL) return SP_EINVAL;
  for (int i = 1; i < n; i++) {
    if (names[i] != NULL && strcasecmp(s, names[i]) == 0) {
      *out = i;
      return 0;
    }
  }
  return SP_EINVAL;
}

int sp_strategy_parse(const char *s, sp_strategy *out) {
  int v;
  int rc = parse_name(s, k_strategies, COUNT(k_strategies), &v);
  if (rc == 0) *out = (sp_strategy)v;
  return rc;
}

const char *sp_strategy_name(sp_strategy s) {
  return s > 0 && (int)s < COUNT(k_strategies) ? k_strategies[s] : "invalid";
}

int sp_backend_parse(const char *s, sp_backend *out) {
  int v;
  int rc = parse_name(s, k_backends, COUNT(k_backends), &v);
  if (rc == 0) *out = (sp_backend)v;
  return rc;
}

const char *sp_backend_name(sp_backend b) {
  return b > 0 && (int)b < COUNT(k_backends) ? k_backends[b] : "invalid";
}

static int read_strlist(const sp_json_reader *r, json_t *obj, const char *key,
                        const char *path, sp_strlist *l, bool *was_set) {
  json_t *arr;
  int rc = sp_json_array(r, obj, key, path, false, SP_JOB_MAX_LIST, &arr);
  if (rc != 0 || arr == NULL) return rc;
  sp_strlist_clear(l);
  if (was_set != NULL) *was_set = true;
  for (size_t i = 0; i < json_array_size(arr); i++) {
    json_t *v = json_array_get(arr, i);
    if (!json_is_string(v) || json_string_length(v) > SP_JSON_MAX_STRING ||
        strlen(json_string_value(v)) != json_string_length(v))
      return sp_json_fail(r, SP_EFORMAT, "%s.%s[%zu]: expected a name", path,
                          key, i);
    if ((rc = sp_strlist_add(l, json_string_value(v))) != 0)
      return sp_json_fail(r, rc, "%s.%s[%zu]: %s", path, key, i,
                          sp_strerror(rc));
  }
  return 0;
}

static int read_dtype(const sp_json_reader *r, json_t *obj, const char *key,
                      sp_dtype *out) {
  json_t *v = json_object_get(obj, key);
  if (v == NULL || json_is_null(v)) return 0; /* null = unset, as in FSDP */
  const char *name;
  int rc = sp_json_string(r, obj, key, "mixed_precision", true, &name);
  if (rc != 0) return rc;
  sp_dtype t;
  if (sp_dtype_parse(name, &t) != 0 || !sp_dtype_is_floating(t))
    return sp_json_fail(r, SP_EFORMAT,
                        "mixed_precision.%s: \"%s\" is not a floating dtype "
                        "(float32, bfloat16, float16, float64)",
                        key, name);
  *out = t;
  return 0;
}

static int read_enum(const sp_json_reader *r, json_t *root, const char *key,
                     int (*parse)(const char *, int *), int *out,
                     const char *expected) {
  const char *s;
  int rc = sp_json_string(r, root, key, "", false, &s);
  if (rc != 0 || s == NULL) return rc;
  if (parse(s, out) != 0)
    return sp_json_fail(r, SP_EFORMAT, "%s: unknown value \"%s\" (expected %s)",
                        key, s, expected);
  return 0;
}

static int parse_strategy_int(const char *s, int *out) {
  sp_strategy v = SP_STRATEGY_INVALID;
  int rc = sp_strategy_parse(s, &v);
  if (rc == 0) *out = (int)v;
  return rc;
}

static int parse_backend_int(const char *s, int *out) {
  sp_backend v = SP_BACKEND_INVALID;
  int rc = sp_backend_parse(s, &v);
  if (rc == 0) *out = (int)v;
  return rc;
}

static int load_mp(const sp_json_reader *r, json_t *mp,
                   sp_mixed_precision *out) {
  if (!json_is_object(mp))
    return sp_json_fail(r, SP_EFORMAT, "mixed_precision: expected an object");
  out->enabled = true;
  int rc = sp_json_known_keys(r, mp, "mixed_precision", k_mp_keys,
                              (size_t)COUNT(k_mp_keys));
  if (rc != 0 ||
      (rc = read_dtype(r, mp, "param_dtype", &out->param_dtype)) != 0 ||
      (rc = read_dtype(r, mp, "reduce_dtype", &out->reduce_dtype)) != 0 ||
      (rc = read_dtype(r, mp, "buffer_dtype", &out->buffer_dtype)) != 0 ||
      (rc = sp_json_bool(r, mp, "keep_low_precision_grads", "mixed_precision",
                         false, &out->keep_low_precision_grads)) != 0)
    return rc;
  return read_strlist(r, mp, "full_precision_types", "mixed_precision",
                      &out->full_precision_types,
                      &out->full_precision_types_set);
}

static int load_root(const sp_json_reader *r, json_t *root, sp_job *job) {
  if (!json_is_object(root))
    return sp_json_fail(r, SP_EFORMAT,
                        "expected a JSON object at the top level");
  int rc =
      sp_json_known_keys(r, root, "", k_root_keys, (size_t)COUNT(k_root_keys));
  if (rc != 0) return rc;
  json_t *fmt = json_object_get(root, "format");
  if (fmt != NULL && (!json_is_string(fmt) ||
                      strcmp(json_string_value(fmt), SP_JOB_FORMAT) != 0))
    return sp_json_fail(r, SP_EFORMAT, "format: expected \"%s\"",
                        SP_JOB_FORMAT);
  long long v;
  int e;
  v = job->world_size;
  if ((rc = sp_json_int(r, root, "world_size", "", false, 1, SP_JOB_MAX_WORLD,
                        &v)) != 0)
    return rc;
  job->world_size = (uint32_t)v;
  v = job->shard_group_size;
  if ((rc = sp_json_int(r, root, "shard_group_size", "", false, 1,
                        SP_JOB_MAX_WORLD, &v)) != 0)
    return rc;
  job->shard_group_size = (uint32_t)v;
  e = (int)job->strategy;
  if ((rc = read_enum(r, root, "strategy", parse_strategy_int, &e,
                      "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD")) !=
      0)
    return rc;
  job->strategy = (sp_strategy)e;
  e = (int)job->backend;
  if ((rc = read_enum(r, root, "backend", parse_backend_int, &e,
                      "gloo or nccl")) != 0)
    return rc;
  job->backend = (sp_backend)e;
  if ((rc = sp_json_bool(r, root, "use_orig_params", "", false,
                         &job->use_orig_params)) != 0)
    return rc;
  json_t *wrap = json_object_get(root, "wrap");
  if (wrap != NULL) {
    if (!json_is_object(wrap))
      return sp_json_fail(r, SP_EFORMAT, "wrap: expected an object");
    if ((rc = sp_json_known_keys(r, wrap, "wrap", k_wrap_keys,
                                 (size_t)COUNT(k_wrap_keys))) != 0 ||
        (rc = read_strlist(r, wrap, "modules", "wrap", &job->wrap_modules,
                           NULL)) != 0 ||
        (rc = read_strlist(r, wrap, "types", "wrap", &job->wrap_types, NULL)) !=
            0)
      return rc;
  }
  json_t *mp = json_object_get(root, "mixed_precision");
  if (mp != NULL && !json_is_null(mp)) return load_mp(r, mp, &job->mp);
  return 0;
}

int sp_job_load_string(const char *json, size_t len, const char *origin,
                       sp_job *job, sp_diag *diag) {
  if (json == NULL || job == NULL) return SP_EINVAL;
  sp_json_reader r = {origin != NULL ? origin : "<string>", diag};
  json_t *root;
  int rc = sp_json_parse(&r, json, len, SP_JOB_MAX_FILE_BYTES, &root);
  if (rc != 0) return rc;
  rc = load_root(&r, root, job);
  json_decref(root);
  return rc;
}

int sp_job_load_file(const char *path, sp_job *job, sp_diag *diag) {
  if (path == NULL || job == NULL) return SP_EINVAL;
  char *buf;
  size_t len;
  int rc = sp_json_read_file(path, SP_JOB_MAX_FILE_BYTES, &buf, &len, diag);
  if (rc != 0) return rc;
  rc = sp_job_load_string(buf, len, path, job, diag);
  free(buf);
  return rc;
}

static bool model_has_type(const sp_model *m, const char *type) {
  for (size_t i = 0; i < m->n_modules; i++)
    if (strcmp(m->modules[i].type, type) == 0) return true;
  return false;
}

int sp_job_validate(const sp_job *job, const sp_model *model, sp_diag *diag) {
  if (job->world_size < 1 || job->world_size > SP_JOB_MAX_WORLD)
    return sp_diag_set(diag, SP_EINVAL,
                       "world_size (--world-size): %u is outside [1, %u]",
                       job->world_size, SP_JOB_MAX_WORLD);
  if (job->strategy < SP_FULL_SHARD || job->strategy > SP_HYBRID_SHARD)
    return sp_diag_set(diag, SP_EINVAL, "strategy: invalid");
  if (job->backend != SP_BACKEND_GLOO && job->backend != SP_BACKEND_NCCL)
    return sp_diag_set(diag, SP_EINVAL, "backend: invalid");
  if (job->strategy == SP_HYBRID_SHARD) {
    uint32_t g = job->shard_group_size;
    if (g == 0)
      return sp_diag_set(diag, SP_EINVAL,
                         "shard_group_size (--shard-group-size): HYBRID_SHARD "
                         "needs the size of the shard group (ranks per "
                         "replica)");
    if (g > job->world_size || job->world_size % g != 0)
      return sp_diag_set(diag, SP_EINVAL,
                         "shard_group_size (--shard-group-size): %u does not "
                         "divide world_size %u",
                         g, job->world_size);
  }
  const sp_dtype mpd[] = {job->mp.param_dtype, job->mp.reduce_dtype,
                          job->mp.buffer_dtype};
  const char *mpn[] = {"param_dtype", "reduce_dtype", "buffer_dtype"};
  for (int i = 0; i < 3; i++) {
    if (mpd[i] != SP_DTYPE_INVALID && !sp_dtype_is_floating(mpd[i]))
      return sp_diag_set(diag, SP_EINVAL,
                         "mixed_precision.%s: %s is not a floating dtype",
                         mpn[i], sp_dtype_name(mpd[i]));
  }
  if (model == NULL) return 0;
  for (size_t i = 0; i < job->wrap_modules.n; i++) {
    if (sp_model_find_module(model, job->wrap_modules.items[i]) < 0)
      return sp_diag_set(diag, SP_EINVAL,
                         "wrap.modules[%zu]: no module \"%s\" in model %s", i,
                         job->wrap_modules.items[i], model->name);
  }
  for (size_t i = 0; i < job->wrap_types.n; i++) {
    if (!model_has_type(model, job->wrap_types.items[i]))
      return sp_diag_set(diag, SP_EINVAL,
                         "wrap.types[%zu]: no module of type \"%s\" in model "
                         "%s",
                         i, job->wrap_types.items[i], model->name);
  }
  return 0;
}

int sp_job_default_wrap(sp_job *job, const sp_model *model, bool *applied) {
  bool none = job->wrap_modules.n == 0 && job->wrap_types.n == 0;
  /* the spec's no_split_modules, when it has them: the model's author
   * said which modules hold together (a GPT-2's blocks), which "every
   * Linear" cannot know */
  bool from_spec = none && model->n_no_split_modules > 0;
  bool apply =
      from_spec || (none && model_has_type(model, SP_JOB_DEFAULT_WRAP_TYPE));
  if (applied != NULL) *applied = apply;
  if (!from_spec)
    return apply ? sp_strlist_add(&job->wrap_types, SP_JOB_DEFAULT_WRAP_TYPE)
                 : 0;
  for (size_t i = 0; i < model->n_no_split_modules; i++) {
    int rc = sp_strlist_add(&job->wrap_types, model->no_split_modules[i]);
    if (rc != 0) return rc;
  }
  return 0;
}

bool sp_job_full_precision_type(const sp_job *job, const char *type) {
  if (!job->mp.enabled) return false;
  if (job->mp.full_precision_types_set)
    return sp_strlist_contains(&job->mp.full_precision_types, type);
  for (int i = 0; i < COUNT(k_default_full_precision); i++)
    if (strcmp(k_default_full_precision[i], type) == 0) return true;
  return false;
}

const sp_job_flag_def sp_job_flags[] = {
    {"world-size", true, "number of ranks (default 1)"},
    {"strategy", true, "FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD"},
    {"shard-group-size", true, "ranks per shard group (HYBRID_SHARD)"},
    {"wrap-type", true, "module type that becomes a unit (repeatable)"},
    {"wrap-module", true, "module FQN that becomes a unit (repeatable)"},
    {"param-dtype", true, "mixed precision: unsharded parameter dtype"},
    {"reduce-dtype", true, "mixed precision: gradient reduction dtype"},
    {"buffer-dtype", true, "mixed precision: buffer compute dtype"},
    {"keep-low-precision-grads", false,
     "mixed precision: do not cast reduced gradients back"},
    {"full-precision-type", true,
     "module type kept in full precision (repeatable; default BatchNorm*)"},
    {"use-orig-params", false, "FSDP's aligned flat-parameter layout"},
    {"backend", true, "gloo | nccl"},
    {NULL, false, NULL},
};

void sp_job_flags_print_help(void *file) {
  sp_job_flags_print_help_except(file, NULL);
}

void sp_job_flags_print_help_except(void *file, const char *skip) {
  FILE *f = file;
  for (const sp_job_flag_def *d = sp_job_flags; d->name; d++) {
    if (skip != NULL && strcmp(d->name, skip) == 0) continue;
    char left[64];
    snprintf(left, sizeof left, "--%s%s", d->name, d->has_arg ? " V" : "");
    fprintf(f, "  %-28s %s\n", left, d->help);
  }
}

static int parse_u32_flag(const char *flag, const char *v, uint32_t *out,
                          sp_diag *diag) {
  long long x;
  int rc = sp_flag_int(flag, v, 1, SP_JOB_MAX_WORLD, &x, diag);
  if (rc == 0) *out = (uint32_t)x;
  return rc;
}

static int parse_fp_flag(const char *flag, const char *v, sp_dtype *out,
                         sp_diag *diag) {
  if (v == NULL || sp_dtype_parse(v, out) != 0 || !sp_dtype_is_floating(*out))
    return sp_flag_fail(diag, flag, v,
                        "a floating dtype: one of float32, "
                        "bfloat16, float16, float64");
  return 0;
}

int sp_job_apply_flag(sp_job *job, const char *name, const char *v,
                      sp_diag *diag) {
  sp_mixed_precision *mp = &job->mp;
  char flag[64];
  snprintf(flag, sizeof flag, "--%s", name);
  size_t k;
  if (strcmp(name, "world-size") == 0)
    return parse_u32_flag(flag, v, &job->world_size, diag);
  if (strcmp(name, "shard-group-size") == 0)
    return parse_u32_flag(flag, v, &job->shard_group_size, diag);
  if (strcmp(name, "strategy") == 0) {
    int rc =
        sp_flag_choice(flag, v, k_strategies, COUNT(k_strategies), &k, diag);
    if (rc == 0) job->strategy = (sp_strategy)k;
    return rc;
  }
  if (strcmp(name, "backend") == 0) {
    int rc = sp_flag_choice(flag, v, k_backends, COUNT(k_backends), &k, diag);
    if (rc == 0) job->backend = (sp_backend)k;
    return rc;
  }
  sp_dtype *dt = strcmp(name, "param-dtype") == 0    ? &mp->param_dtype
                 : strcmp(name, "reduce-dtype") == 0 ? &mp->reduce_dtype
                 : strcmp(name, "buffer-dtype") == 0 ? &mp->buffer_dtype
                                                     : NULL;
  if (dt != NULL) {
    int rc = parse_fp_flag(flag, v, dt, diag);
    if (rc == 0) mp->enabled = true;
    return rc;
  }
  if (strcmp(name, "keep-low-precision-grads") == 0) {
    mp->enabled = mp->keep_low_precision_grads = true;
    return 0;
  }
  if (strcmp(name, "use-orig-params") == 0) {
    job->use_orig_params = true;
    return 0;
  }
  sp_strlist *list = strcmp(name, "wrap-type") == 0     ? &job->wrap_types
                     : strcmp(name, "wrap-module") == 0 ? &job->wrap_modules
                     : strcmp(name, "full-precision-type") == 0
                         ? &mp->full_precision_types
                         : NULL;
  if (list == NULL) return SP_ENOENT;
  int rc = sp_flag_text(
      flag, v,
      list == &job->wrap_modules ? "a module FQN" : "a module type name", diag);
  if (rc != 0) return rc;
  rc = sp_strlist_add(list, v);
  if (rc != 0) return sp_diag_set(diag, rc, "%s: %s", flag, sp_strerror(rc));
  if (list == &mp->full_precision_types) mp->full_precision_types_set = true;
  return 0;
}
