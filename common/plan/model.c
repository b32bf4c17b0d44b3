#include "model.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "base/strmap.h"
#include "base/suggest.h"

#define SP_MODEL_FORMAT "shardplane.model/v1"

/* One namespace for every FQN, since PyTorch attribute names are unique per
 * module; the low two bits say what kind of entry an FQN names. */
enum { KIND_MODULE = 0, KIND_PARAM = 1, KIND_BUFFER = 2, KIND_TIED = 3 };

typedef struct loader {
  sp_json_reader r;
  sp_model *m;
} loader;

#define fail(L, ...) sp_json_fail(&(L)->r, __VA_ARGS__)

/* The module an FQN lives on: everything before the last '.', or "" */
static size_t module_prefix_len(const char *fqn) {
  const char *dot = strrchr(fqn, '.');
  return dot == NULL ? 0 : (size_t)(dot - fqn);
}

static const char *local_part(const char *fqn) {
  const char *dot = strrchr(fqn, '.');
  return dot == NULL ? fqn : dot + 1;
}

static int32_t lookup(const sp_model *m, const char *fqn, int kind) {
  int32_t v = sp_strmap_get(m->index_, fqn);
  if (v < 0 || (v & 3) != kind) return -1;
  return v >> 2;
}

int32_t sp_model_find_module(const sp_model *m, const char *fqn) {
  return lookup(m, fqn, KIND_MODULE);
}
int32_t sp_model_find_param(const sp_model *m, const char *fqn) {
  return lookup(m, fqn, KIND_PARAM);
}
int32_t sp_model_find_buffer(const sp_model *m, const char *fqn) {
  return lookup(m, fqn, KIND_BUFFER);
}
int32_t sp_model_find_tied(const sp_model *m, const char *fqn) {
  return lookup(m, fqn, KIND_TIED);
}

static const char *kind_name(int kind) {
  static const char *const names[] = {"module", "parameter", "buffer",
                                      "tied parameter"};
  return names[kind & 3];
}

static int register_fqn(loader *L, const char *fqn, int32_t index, int kind,
                        const char *path) {
  int32_t prev = sp_strmap_get(L->m->index_, fqn);
  if (prev >= 0)
    return fail(L, SP_EFORMAT, "%s.fqn: duplicate FQN \"%s\" (already a %s)",
                path, fqn, kind_name(prev));
  int rc = sp_strmap_put(L->m->index_, fqn, (index << 2) | kind);
  return rc == 0 ? 0 : fail(L, rc, "%s: %s", path, sp_strerror(rc));
}

static int load_modules(loader *L, json_t *arr) {
  sp_model *m = L->m;
  size_t n = json_array_size(arr);
  if (n == 0)
    return fail(L, SP_EFORMAT,
                "modules: empty; the root module \"\" must be "
                "listed first");
  m->modules = calloc(n, sizeof *m->modules);
  int32_t *stack = calloc(n, sizeof *stack);
  if (m->modules == NULL || stack == NULL) {
    free(stack);
    return fail(L, SP_ENOMEM, "modules: out of memory");
  }
  int rc = 0;
  size_t depth = 0; /* ancestors of the current module on `stack` */
  for (size_t i = 0; i < n && rc == 0; i++) {
    char path[64];
    snprintf(path, sizeof path, "modules[%zu]", i);
    json_t *o = json_array_get(arr, i);
    if (!json_is_object(o)) {
      rc = fail(L, SP_EFORMAT, "%s: expected an object", path);
      break;
    }
    const char *fqn, *type;
    if ((rc = sp_json_string(&L->r, o, "fqn", path, true, &fqn)) != 0) break;
    if ((rc = sp_json_string(&L->r, o, "type", path, true, &type)) != 0) break;
    if (type[0] == '\0') {
      rc = fail(L, SP_EFORMAT, "%s.type: empty module type", path);
      break;
    }
    sp_module *mod = &m->modules[i];
    mod->fqn = sp_strdup(fqn);
    mod->type = sp_strdup(type);
    m->n_modules = i + 1;
    if (mod->fqn == NULL || mod->type == NULL) {
      rc = fail(L, SP_ENOMEM, "%s: out of memory", path);
      break;
    }
    if (i == 0) {
      if (fqn[0] != '\0') {
        rc = fail(L, SP_EFORMAT,
                  "modules[0].fqn: the root module \"\" must come first, got "
                  "\"%s\"",
                  fqn);
        break;
      }
      mod->parent = -1;
      stack[depth++] = 0;
    } else {
      if (fqn[0] == '\0') {
        rc = fail(L, SP_EFORMAT, "%s.fqn: duplicate FQN \"\" (the root)", path);
        break;
      }
      /* named_modules() is a pre-order walk: the parent of each module is
       * one of the modules whose subtree is still open. */
      size_t plen = module_prefix_len(fqn);
      while (depth > 0) {
        const char *top = m->modules[stack[depth - 1]].fqn;
        if (strlen(top) == plen && strncmp(top, fqn, plen) == 0) break;
        depth--;
      }
      if (depth == 0) {
        char parent[SP_JSON_MAX_STRING + 1];
        snprintf(parent, sizeof parent, "%.*s", (int)plen, fqn);
        bool exists = sp_strmap_get(m->index_, parent) >= 0;
        rc = fail(L, SP_EFORMAT,
                  exists ? "%s.fqn: \"%s\" is not inside the subtree of its "
                           "parent \"%s\" (modules must be in named_modules "
                           "order)"
                         : "%s.fqn: parent module \"%s\" of \"%s\" is not "
                           "listed before it",
                  path, exists ? fqn : parent, exists ? parent : fqn);
        break;
      }
      mod->parent = stack[depth - 1];
      mod->depth = (int32_t)depth;
      stack[depth++] = (int32_t)i;
    }
    rc = register_fqn(L, mod->fqn, (int32_t)i, KIND_MODULE, path);
  }
  free(stack);
  if (rc != 0) return rc;
  /* pre-order makes every subtree a contiguous index range */
  for (size_t i = n; i-- > 0;) {
    sp_module *mod = &m->modules[i];
    if (mod->subtree_end < i + 1) mod->subtree_end = (uint32_t)(i + 1);
    if (mod->parent >= 0 &&
        m->modules[mod->parent].subtree_end < mod->subtree_end)
      m->modules[mod->parent].subtree_end = mod->subtree_end;
  }
  return 0;
}

/* The owning module of `fqn`, which must exist. */
static int owner_module(loader *L, const char *fqn, const char *path,
                        const char *what, int32_t *out) {
  if (fqn[0] == '\0')
    return fail(L, SP_EFORMAT, "%s.fqn: empty %s name", path, what);
  size_t plen = module_prefix_len(fqn);
  const char *local = local_part(fqn);
  if (local[0] == '\0')
    return fail(L, SP_EFORMAT, "%s.fqn: \"%s\" ends with '.'", path, fqn);
  char mod[SP_JSON_MAX_STRING + 1];
  snprintf(mod, sizeof mod, "%.*s", (int)plen, fqn);
  int32_t idx = sp_model_find_module(L->m, mod);
  if (idx < 0)
    return fail(L, SP_EFORMAT,
                "%s.fqn: module \"%s\" of %s \"%s\" is not in modules", path,
                mod, what, fqn);
  *out = idx;
  return 0;
}

static int load_shape(loader *L, json_t *o, const char *path,
                      sp_tensor_spec *t) {
  json_t *shape = json_object_get(o, "shape");
  if (shape == NULL)
    return fail(L, SP_EFORMAT, "%s: missing field \"shape\"", path);
  if (!json_is_array(shape))
    return fail(L, SP_EFORMAT, "%s.shape: expected an array of integers", path);
  size_t nd = json_array_size(shape);
  if (nd > SP_MAX_DIMS)
    return fail(L, SP_ETOOBIG, "%s.shape: %zu dimensions, at most %d", path, nd,
                SP_MAX_DIMS);
  int64_t numel = 1;
  for (size_t d = 0; d < nd; d++) {
    json_t *v = json_array_get(shape, d);
    if (!json_is_integer(v))
      return fail(L, SP_EFORMAT, "%s.shape[%zu]: not an integer", path, d);
    json_int_t dim = json_integer_value(v);
    if (dim < 0)
      return fail(L, SP_EFORMAT, "%s.shape[%zu]: negative dimension %lld", path,
                  d, (long long)dim);
    if (dim > SP_MODEL_MAX_NUMEL ||
        (dim > 0 && numel > SP_MODEL_MAX_NUMEL / dim))
      return fail(L, SP_ETOOBIG, "%s.shape: more than 2^50 elements", path);
    t->shape[d] = dim;
    numel *= dim;
  }
  t->ndim = (int32_t)nd;
  t->numel = numel;
  return 0;
}

static int load_tensors(loader *L, json_t *arr, const char *key, int kind,
                        sp_tensor_spec **out, size_t *n_out) {
  size_t n = arr == NULL ? 0 : json_array_size(arr);
  *out = calloc(n ? n : 1, sizeof **out);
  if (*out == NULL) return fail(L, SP_ENOMEM, "%s: out of memory", key);
  const char *what = kind == KIND_PARAM ? "parameter" : "buffer";
  for (size_t i = 0; i < n; i++) {
    char path[64];
    snprintf(path, sizeof path, "%s[%zu]", key, i);
    json_t *o = json_array_get(arr, i);
    if (!json_is_object(o))
      return fail(L, SP_EFORMAT, "%s: expected an object", path);
    sp_tensor_spec *t = &(*out)[i];
    const char *fqn, *dtype;
    int rc;
    if ((rc = sp_json_string(&L->r, o, "fqn", path, true, &fqn)) != 0)
      return rc;
    t->fqn = sp_strdup(fqn);
    *n_out = i + 1;
    if (t->fqn == NULL) return fail(L, SP_ENOMEM, "%s: out of memory", path);
    t->local_name = local_part(t->fqn);
    if ((rc = owner_module(L, t->fqn, path, what, &t->module)) != 0) return rc;
    if ((rc = load_shape(L, o, path, t)) != 0) return rc;
    if ((rc = sp_json_string(&L->r, o, "dtype", path, true, &dtype)) != 0)
      return rc;
    if (sp_dtype_parse(dtype, &t->dtype) != 0)
      return fail(L, SP_EFORMAT, "%s.dtype: unknown dtype \"%s\"", path, dtype);
    if (kind == KIND_PARAM) {
      if (!sp_dtype_is_floating(t->dtype))
        return fail(L, SP_EFORMAT,
                    "%s.dtype: parameter \"%s\" has integer dtype %s and "
                    "cannot be flattened (FSDP flattens only floating "
                    "parameters)",
                    path, t->fqn, sp_dtype_name(t->dtype));
      t->flag = true;
      rc = sp_json_bool(&L->r, o, "requires_grad", path, false, &t->flag);
    } else {
      t->flag = true;
      rc = sp_json_bool(&L->r, o, "persistent", path, false, &t->flag);
    }
    if (rc != 0) return rc;
    if ((rc = register_fqn(L, t->fqn, (int32_t)i, kind, path)) != 0) return rc;
  }
  return 0;
}

static int load_tied(loader *L, json_t *arr) {
  sp_model *m = L->m;
  size_t n = arr == NULL ? 0 : json_array_size(arr);
  m->tied = calloc(n ? n : 1, sizeof *m->tied);
  if (m->tied == NULL) return fail(L, SP_ENOMEM, "tied: out of memory");
  for (size_t i = 0; i < n; i++) {
    char path[64];
    snprintf(path, sizeof path, "tied[%zu]", i);
    json_t *o = json_array_get(arr, i);
    if (!json_is_object(o))
      return fail(L, SP_EFORMAT, "%s: expected an object", path);
    const char *fqn, *to;
    int rc;
    if ((rc = sp_json_string(&L->r, o, "fqn", path, true, &fqn)) != 0)
      return rc;
    if ((rc = sp_json_string(&L->r, o, "to", path, true, &to)) != 0) return rc;
    sp_tied *t = &m->tied[i];
    t->fqn = sp_strdup(fqn);
    m->n_tied = i + 1;
    if (t->fqn == NULL) return fail(L, SP_ENOMEM, "%s: out of memory", path);
    t->local_name = local_part(t->fqn);
    if ((rc = owner_module(L, t->fqn, path, "tied parameter", &t->module)) != 0)
      return rc;
    t->target = sp_model_find_param(m, to);
    if (t->target < 0)
      return fail(L, SP_EFORMAT, "%s.to: \"%s\" is not a parameter", path, to);
    if ((rc = register_fqn(L, t->fqn, (int32_t)i, KIND_TIED, path)) != 0)
      return rc;
  }
  return 0;
}

/* "config": integers only (a GPT-2's n_head); floats, strings and nested
 * objects of a pasted HF config.json are skipped, not errors. */
static int load_config(loader *L, json_t *cfg) {
  if (cfg == NULL) return 0;
  if (!json_is_object(cfg))
    return fail(L, SP_EFORMAT, "config: expected an object");
  if (json_object_size(cfg) > SP_MODEL_MAX_CONFIG)
    return fail(L, SP_ETOOBIG, "config: %zu entries, at most %d",
                json_object_size(cfg), SP_MODEL_MAX_CONFIG);
  L->m->config = calloc(json_object_size(cfg) + 1, sizeof *L->m->config);
  if (L->m->config == NULL) return fail(L, SP_ENOMEM, "out of memory");
  const char *key;
  json_t *v;
  json_object_foreach(cfg, key, v) {
    if (!json_is_integer(v)) continue;
    if (strlen(key) > SP_JSON_MAX_STRING)
      return fail(L, SP_EFORMAT, "config: a key of %zu bytes, at most %d",
                  strlen(key), SP_JSON_MAX_STRING);
    sp_model_config *c = &L->m->config[L->m->n_config];
    c->key = sp_strdup(key);
    if (c->key == NULL) return fail(L, SP_ENOMEM, "out of memory");
    c->value = (int64_t)json_integer_value(v);
    L->m->n_config++;
  }
  return 0;
}

/* The module type nearest to `type`, for "did you mean"; NULL when none
 * is near or memory is short (only an error path calls it). */
static const char *nearest_type(const sp_model *m, const char *type) {
  const char **types = calloc(m->n_modules + 1, sizeof *types);
  if (types == NULL) return NULL;
  for (size_t i = 0; i < m->n_modules; i++) types[i] = m->modules[i].type;
  const char *near = sp_suggest(type, types, m->n_modules);
  free(types);
  return near;
}

/* "no_split_modules": module types of the spec, each once. A type no module
 * has is an error rather than a wrap policy that silently wraps nothing
 * (a misspelt "GPT2Blok" would leave the blocks split). */
static int load_no_split(loader *L, json_t *root) {
  sp_model *m = L->m;
  json_t *arr;
  int rc = sp_json_array(&L->r, root, "no_split_modules", "", false,
                         SP_MODEL_MAX_NO_SPLIT, &arr);
  if (rc != 0 || arr == NULL) return rc;
  size_t n = json_array_size(arr);
  if (n == 0)
    return fail(L, SP_EFORMAT,
                "no_split_modules: empty; list the module types never split "
                "across units, or leave the field out");
  m->no_split_modules = calloc(n, sizeof *m->no_split_modules);
  if (m->no_split_modules == NULL)
    return fail(L, SP_ENOMEM, "no_split_modules: out of memory");
  for (size_t i = 0; i < n; i++) {
    json_t *v = json_array_get(arr, i);
    if (!json_is_string(v))
      return fail(L, SP_EFORMAT,
                  "no_split_modules[%zu]: expected a module type (a string)",
                  i);
    const char *type = json_string_value(v);
    if (json_string_length(v) > SP_JSON_MAX_STRING ||
        strlen(type) != json_string_length(v))
      return fail(L, SP_EFORMAT,
                  "no_split_modules[%zu]: a string of at most %d bytes "
                  "without NUL",
                  i, SP_JSON_MAX_STRING);
    bool found = false;
    for (size_t k = 0; k < m->n_modules && !found; k++)
      found = strcmp(m->modules[k].type, type) == 0;
    if (!found) {
      const char *near = nearest_type(m, type);
      return fail(L, SP_EFORMAT,
                  "no_split_modules: type \"%.200s\" is not the type of any "
                  "module in %s%s%s%s",
                  type, L->r.origin, near ? " (did you mean \"" : "",
                  near ? near : "", near ? "\"?)" : "");
    }
    for (size_t k = 0; k < i; k++)
      if (strcmp(m->no_split_modules[k], type) == 0)
        return fail(L, SP_EFORMAT,
                    "no_split_modules[%zu]: type \"%.200s\" is listed twice", i,
                    type);
    m->no_split_modules[i] = sp_strdup(type);
    if (m->no_split_modules[i] == NULL)
      return fail(L, SP_ENOMEM, "no_split_modules: out of memory");
    m->n_no_split_modules = i + 1;
  }
  return 0;
}

/* A number of "training" (an integer or a real), finite and >= min;
 * *has says whether the field is there. */
static int training_number(loader *L, json_t *o, const char *key, double min,
                           bool min_open, double *out, bool *has) {
  json_t *v = json_object_get(o, key);
  *has = v != NULL;
  if (v == NULL) return 0;
  if (!json_is_number(v))
    return fail(L, SP_EFORMAT, "training.%s: expected a number", key);
  double x = json_number_value(v);
  if (!isfinite(x) || x < min || (min_open && x == min))
    return fail(L, SP_EFORMAT,
                "training.%s: %g: expected a finite number %s %g", key, x,
                min_open ? ">" : ">=", min);
  *out = x;
  return 0;
}

/* One of names[0..n) by its exact name. */
static int training_choice(loader *L, json_t *o, const char *key,
                           const char *const *names, size_t n, size_t *index,
                           bool *has) {
  const char *s;
  int rc = sp_json_string(&L->r, o, key, "training", false, &s);
  *has = rc == 0 && s != NULL;
  if (rc != 0 || s == NULL) return rc;
  for (size_t i = 0; i < n; i++)
    if (strcmp(s, names[i]) == 0) {
      *index = i;
      return 0;
    }
  return fail(L, SP_EFORMAT, "training.%s: \"%.200s\": expected %s or %s", key,
              s, names[0], names[1]);
}

/* "training": the defaults of the training flags of the same names. A key
 * it does not have is an error, as in a job file: a misspelt "warmup_step"
 * must not leave the run on another schedule unnoticed. */
static int load_training(loader *L, json_t *o) {
  static const char *const keys[] = {
      "optimizer",    "lr",     "momentum",      "weight_decay",
      "betas",        "eps",    "lr_schedule",   "warmup_steps",
      "warmup_ratio", "min_lr", "clip_grad_norm"};
  static const char *const optimizers[] = {"sgd", "adamw"};
  static const char *const schedules[] = {"constant", "cosine"};
  if (o == NULL) return 0;
  if (!json_is_object(o))
    return fail(L, SP_EFORMAT, "training: expected an object");
  int rc = sp_json_known_keys(&L->r, o, "training", keys,
                              sizeof keys / sizeof keys[0]);
  if (rc != 0) return rc;
  sp_model_training *t = &L->m->training;
  bool has;
  size_t k = 0;
#define SET(bit) (t->set |= has ? (unsigned)(bit) : 0u)
  if ((rc = training_choice(L, o, "optimizer", optimizers, 2, &k, &has)) != 0)
    return rc;
  t->adamw = has && k == 1;
  SET(SP_MODEL_TRAIN_OPTIMIZER);
  if ((rc = training_choice(L, o, "lr_schedule", schedules, 2, &k, &has)) != 0)
    return rc;
  t->cosine = has && k == 1;
  SET(SP_MODEL_TRAIN_SCHEDULE);
  if ((rc = training_number(L, o, "lr", 0, false, &t->lr, &has)) != 0)
    return rc;
  SET(SP_MODEL_TRAIN_LR);
  if ((rc = training_number(L, o, "momentum", 0, false, &t->momentum, &has)) !=
      0)
    return rc;
  SET(SP_MODEL_TRAIN_MOMENTUM);
  if ((rc = training_number(L, o, "weight_decay", 0, false, &t->weight_decay,
                            &has)) != 0)
    return rc;
  SET(SP_MODEL_TRAIN_WEIGHT_DECAY);
  if ((rc = training_number(L, o, "eps", 0, true, &t->eps, &has)) != 0)
    return rc;
  SET(SP_MODEL_TRAIN_EPS);
  if ((rc = training_number(L, o, "warmup_ratio", 0, false, &t->warmup_ratio,
                            &has)) != 0)
    return rc;
  if (has && t->warmup_ratio > 1)
    return fail(L, SP_EFORMAT,
                "training.warmup_ratio: %g: expected a fraction of the run's "
                "steps, in [0, 1]",
                t->warmup_ratio);
  SET(SP_MODEL_TRAIN_WARMUP_RATIO);
  if ((rc = training_number(L, o, "min_lr", 0, false, &t->min_lr, &has)) != 0)
    return rc;
  SET(SP_MODEL_TRAIN_MIN_LR);
  if ((rc = training_number(L, o, "clip_grad_norm", 0, false,
                            &t->clip_grad_norm, &has)) != 0)
    return rc;
  SET(SP_MODEL_TRAIN_CLIP);
#undef SET
  long long w = -1;
  if ((rc = sp_json_int(&L->r, o, "warmup_steps", "training", false, 0,
                        1000000000, &w)) != 0)
    return rc;
  if (w >= 0) {
    t->warmup_steps = (uint64_t)w;
    t->set |= SP_MODEL_TRAIN_WARMUP_STEPS;
  }
  json_t *betas = json_object_get(o, "betas");
  if (betas != NULL) {
    if (!json_is_array(betas) || json_array_size(betas) != 2 ||
        !json_is_number(json_array_get(betas, 0)) ||
        !json_is_number(json_array_get(betas, 1)))
      return fail(L, SP_EFORMAT, "training.betas: expected [B1, B2]");
    t->beta1 = json_number_value(json_array_get(betas, 0));
    t->beta2 = json_number_value(json_array_get(betas, 1));
    if (!(t->beta1 >= 0 && t->beta1 < 1) || !(t->beta2 >= 0 && t->beta2 < 1))
      return fail(L, SP_EFORMAT,
                  "training.betas: [%g, %g]: expected each in [0, 1)", t->beta1,
                  t->beta2);
    t->set |= SP_MODEL_TRAIN_BETAS;
  }
  /* the fields that mean something only with another, as the flags are
   * checked (a recipe that cannot be what its author meant is refused) */
  const char *opt = t->adamw ? "adamw" : "sgd";
  if ((t->set & SP_MODEL_TRAIN_MOMENTUM) && t->adamw)
    return fail(L, SP_EFORMAT,
                "training.momentum: only with optimizer sgd (adamw has "
                "betas)");
  if ((t->set & SP_MODEL_TRAIN_BETAS) && !t->adamw)
    return fail(L, SP_EFORMAT,
                "training.betas: only with optimizer adamw (the optimizer is "
                "%s)",
                opt);
  if ((t->set & SP_MODEL_TRAIN_EPS) && !t->adamw)
    return fail(L, SP_EFORMAT,
                "training.eps: only with optimizer adamw (the optimizer is %s)",
                opt);
  static const struct {
    unsigned bit;
    const char *name;
  } cosine_only[] = {{SP_MODEL_TRAIN_WARMUP_STEPS, "warmup_steps"},
                     {SP_MODEL_TRAIN_WARMUP_RATIO, "warmup_ratio"},
                     {SP_MODEL_TRAIN_MIN_LR, "min_lr"}};
  for (size_t i = 0; i < 3; i++)
    if ((t->set & cosine_only[i].bit) && !t->cosine)
      return fail(L, SP_EFORMAT, "training.%s: only with lr_schedule cosine",
                  cosine_only[i].name);
  if ((t->set & SP_MODEL_TRAIN_WARMUP_STEPS) &&
      (t->set & SP_MODEL_TRAIN_WARMUP_RATIO))
    return fail(L, SP_EFORMAT,
                "training: warmup_steps and warmup_ratio both given; one of "
                "them");
  if ((t->set & SP_MODEL_TRAIN_MIN_LR) && !(t->set & SP_MODEL_TRAIN_LR))
    return fail(L, SP_EFORMAT,
                "training.min_lr: needs training.lr, the peak it decays "
                "from");
  if ((t->set & SP_MODEL_TRAIN_MIN_LR) && t->min_lr > t->lr)
    return fail(L, SP_EFORMAT, "training.min_lr: %g: expected at most lr %g",
                t->min_lr, t->lr);
  return 0;
}

int sp_model_config_int(const sp_model *m, const char *key, int64_t *out) {
  if (m == NULL || key == NULL) return SP_EINVAL;
  for (size_t i = 0; i < m->n_config; i++)
    if (strcmp(m->config[i].key, key) == 0) {
      if (out) *out = m->config[i].value;
      return 0;
    }
  return SP_ENOENT;
}

static int load_root(loader *L, json_t *root) {
  if (!json_is_object(root))
    return fail(L, SP_EFORMAT, "expected a JSON object at the top level");
  json_t *fmt = json_object_get(root, "format");
  if (!json_is_string(fmt) ||
      strcmp(json_string_value(fmt), SP_MODEL_FORMAT) != 0)
    return fail(L, SP_EFORMAT, "format: expected \"%s\"%s", SP_MODEL_FORMAT,
                fmt == NULL ? " (field missing)" : "");
  const char *name;
  int rc = sp_json_string(&L->r, root, "name", "", false, &name);
  if (rc != 0) return rc;
  L->m->name = sp_strdup(name != NULL ? name : "");
  if (L->m->name == NULL) return fail(L, SP_ENOMEM, "out of memory");

  json_t *modules, *params, *buffers, *tied;
  if ((rc = sp_json_array(&L->r, root, "modules", "", true,
                          SP_MODEL_MAX_ENTRIES, &modules)) != 0 ||
      (rc = sp_json_array(&L->r, root, "params", "", true, SP_MODEL_MAX_ENTRIES,
                          &params)) != 0 ||
      (rc = sp_json_array(&L->r, root, "buffers", "", false,
                          SP_MODEL_MAX_ENTRIES, &buffers)) != 0 ||
      (rc = sp_json_array(&L->r, root, "tied", "", false, SP_MODEL_MAX_ENTRIES,
                          &tied)) != 0)
    return rc;
  size_t total = json_array_size(modules) + json_array_size(params) +
                 (buffers ? json_array_size(buffers) : 0) +
                 (tied ? json_array_size(tied) : 0);
  L->m->index_ = sp_strmap_new(total);
  if (L->m->index_ == NULL) return fail(L, SP_ENOMEM, "out of memory");
  if ((rc = load_modules(L, modules)) != 0) return rc;
  if ((rc = load_tensors(L, params, "params", KIND_PARAM, &L->m->params,
                         &L->m->n_params)) != 0)
    return rc;
  if ((rc = load_tensors(L, buffers, "buffers", KIND_BUFFER, &L->m->buffers,
                         &L->m->n_buffers)) != 0)
    return rc;
  if ((rc = load_tied(L, tied)) != 0) return rc;
  if ((rc = load_config(L, json_object_get(root, "config"))) != 0) return rc;
  if ((rc = load_no_split(L, root)) != 0) return rc;
  return load_training(L, json_object_get(root, "training"));
}

int sp_model_load_string(const char *json, size_t len, const char *origin,
                         sp_model **out, sp_diag *diag) {
  if (json == NULL || out == NULL) return SP_EINVAL;
  if (origin == NULL) origin = "<string>";
  loader L = {{origin, diag}, NULL};
  json_t *root;
  int rc = sp_json_parse(&L.r, json, len, SP_MODEL_MAX_FILE_BYTES, &root);
  if (rc != 0) return rc;
  L.m = calloc(1, sizeof *L.m);
  if (L.m == NULL) rc = fail(&L, SP_ENOMEM, "out of memory");
  if (rc == 0) rc = load_root(&L, root);
  if (rc == 0 && (L.m->path = sp_strdup(origin)) == NULL)
    rc = fail(&L, SP_ENOMEM, "out of memory");
  json_decref(root);
  if (rc != 0) {
    sp_model_free(L.m);
    return rc;
  }
  *out = L.m;
  return 0;
}

int sp_model_load_file(const char *path, sp_model **out, sp_diag *diag) {
  if (path == NULL || out == NULL) return SP_EINVAL;
  char *buf;
  size_t len;
  int rc = sp_json_read_file(path, SP_MODEL_MAX_FILE_BYTES, &buf, &len, diag);
  if (rc != 0) return rc;
  rc = sp_model_load_string(buf, len, path, out, diag);
  free(buf);
  return rc;
}

static void free_tensors(sp_tensor_spec *t, size_t n) {
  for (size_t i = 0; i < n; i++) free((char *)t[i].fqn);
  free(t);
}

void sp_model_free(sp_model *m) {
  if (m == NULL) return;
  for (size_t i = 0; i < m->n_modules; i++) {
    free((char *)m->modules[i].fqn);
    free((char *)m->modules[i].type);
  }
  free(m->modules);
  free_tensors(m->params, m->n_params);
  free_tensors(m->buffers, m->n_buffers);
  for (size_t i = 0; i < m->n_tied; i++) free((char *)m->tied[i].fqn);
  free(m->tied);
  for (size_t i = 0; i < m->n_config; i++) free((char *)m->config[i].key);
  free(m->config);
  for (size_t i = 0; i < m->n_no_split_modules; i++)
    free(m->no_split_modules[i]);
  free(m->no_split_modules);
  sp_strmap_free(m->index_);
  free(m->name);
  free(m->path);
  free(m);
}
