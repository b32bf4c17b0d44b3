/* The reference MLP's spec reader (mlp.h, sp_mlp_new): which specs are a
 * sequential MLP, and their layer chain. It computes nothing, so the
 * `shardplane run` command can ask it before it starts a worker without
 * linking the model's kernels. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast/dtype.h"
#include "mlp.h"

static int unsupported(sp_diag *d, const sp_model *m, const char *fmt,
                       const char *what) {
  char buf[256];
  snprintf(buf, sizeof buf, fmt, what);
  return sp_diag_set(d, SP_EUNSUPPORTED, "%s: not a sequential MLP: %s",
                     m->path ? m->path : (m->name ? m->name : "model"), buf);
}

/* "layers.<k>" with k decimal and no leading zeros; -1 otherwise. */
static long layer_index(const char *fqn) {
  if (strncmp(fqn, "layers.", 7) != 0) return -1;
  const char *s = fqn + 7;
  if (*s < '0' || *s > '9' || (s[0] == '0' && s[1] != '\0')) return -1;
  long k = 0;
  for (; *s; s++) {
    if (*s < '0' || *s > '9' || k > 100000000L) return -1;
    k = k * 10 + (*s - '0');
  }
  return k;
}

/* The layers.<k> modules, in order, each a Linear, RunningNorm or ReLU
 * without submodules; layer_of maps a module index to its layer. */
static int read_layers(const sp_model *m, sp_mlp *mlp, int32_t *layer_of,
                       sp_diag *d) {
  int32_t container = -1;
  for (size_t i = 1; i < m->n_modules; i++) {
    const sp_module *mod = &m->modules[i];
    if (strcmp(mod->fqn, "layers") == 0 && mod->parent == 0) {
      container = (int32_t)i;
      continue;
    }
    long k = layer_index(mod->fqn);
    if (k < 0 || mod->parent != container || container < 0)
      return unsupported(d, m, "module \"%s\" is not layers.<k>", mod->fqn);
    if ((size_t)k != mlp->n_layers)
      return unsupported(d, m, "module \"%s\" out of order", mod->fqn);
    if (mod->subtree_end != i + 1)
      return unsupported(d, m, "module \"%s\" has submodules", mod->fqn);
    sp_mlp_layer *L = &mlp->layers[mlp->n_layers];
    if (strcmp(mod->type, "Linear") == 0) {
      L->kind = SP_MLP_LINEAR;
    } else if (strcmp(mod->type, "RunningNorm") == 0) {
      L->kind = SP_MLP_NORM;
    } else if (strcmp(mod->type, "ReLU") == 0) {
      L->kind = SP_MLP_RELU;
    } else {
      return unsupported(d, m, "module \"%s\": unsupported type", mod->fqn);
    }
    L->module = (int32_t)i;
    L->weight = L->bias = -1;
    L->running_mean = L->num_batches_tracked = L->seen = -1;
    layer_of[i] = (int32_t)mlp->n_layers;
    mlp->n_layers++;
  }
  if (mlp->n_layers == 0)
    return unsupported(d, m, "%s", "no layers.<k> modules");
  return 0;
}

/* Every parameter is the weight or bias of a Linear or RunningNorm. */
static int attach_params(const sp_model *m, sp_mlp *mlp,
                         const int32_t *layer_of, sp_diag *d) {
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_tensor_spec *t = &m->params[p];
    int32_t li = layer_of[t->module];
    if (li < 0 || mlp->layers[li].kind == SP_MLP_RELU)
      return unsupported(d, m, "parameter \"%s\" outside a Linear/RunningNorm",
                         t->fqn);
    if (!sp_dtype_is_floating(t->dtype))
      return unsupported(d, m, "parameter \"%s\" is not floating", t->fqn);
    sp_mlp_layer *L = &mlp->layers[li];
    if (strcmp(t->local_name, "weight") == 0 && L->weight < 0) {
      L->weight = (int32_t)p;
    } else if (strcmp(t->local_name, "bias") == 0 && L->bias < 0) {
      L->bias = (int32_t)p;
    } else {
      return unsupported(d, m, "unexpected parameter \"%s\"", t->fqn);
    }
  }
  return 0;
}

/* Buffers: the root's integer step counter, and a RunningNorm's
 * running_mean, num_batches_tracked and seen. */
static int attach_buffers(const sp_model *m, sp_mlp *mlp,
                          const int32_t *layer_of, sp_diag *d) {
  for (size_t b = 0; b < m->n_buffers; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    if (t->module == 0) {
      if (strcmp(t->local_name, "step") == 0 && sp_dtype_is_integer(t->dtype) &&
          t->numel == 1) {
        mlp->step_buffer = (int32_t)b;
        continue;
      }
      return unsupported(d, m, "unexpected root buffer \"%s\"", t->fqn);
    }
    int32_t li = layer_of[t->module];
    if (li < 0 || mlp->layers[li].kind != SP_MLP_NORM)
      return unsupported(d, m, "buffer \"%s\" outside a RunningNorm", t->fqn);
    sp_mlp_layer *L = &mlp->layers[li];
    if (strcmp(t->local_name, "running_mean") == 0 &&
        sp_dtype_is_floating(t->dtype) && t->ndim == 1) {
      L->running_mean = (int32_t)b;
    } else if (strcmp(t->local_name, "num_batches_tracked") == 0 &&
               sp_dtype_is_integer(t->dtype) && t->numel == 1) {
      L->num_batches_tracked = (int32_t)b;
    } else if (strcmp(t->local_name, "seen") == 0 && t->dtype == SP_BOOL &&
               t->numel == 1) {
      L->seen = (int32_t)b;
    } else {
      return unsupported(
          d, m, "unexpected buffer \"%s\" (name, dtype or shape)", t->fqn);
    }
  }
  return 0;
}

/* L's features in and out, from its tensors' shapes; a ReLU keeps those of
 * the layer before it (prev out features, -1 for none). */
static int layer_shape(const sp_model *m, sp_mlp_layer *L, int64_t prev,
                       sp_diag *d) {
  const char *fqn = m->modules[L->module].fqn;
  const sp_tensor_spec *w = L->weight >= 0 ? &m->params[L->weight] : NULL;
  const sp_tensor_spec *bi = L->bias >= 0 ? &m->params[L->bias] : NULL;
  switch (L->kind) {
    case SP_MLP_LINEAR:
      if (w == NULL || w->ndim != 2 || w->shape[0] <= 0 || w->shape[1] <= 0)
        return unsupported(d, m, "Linear \"%s\" needs a weight [out, in]", fqn);
      L->out = w->shape[0];
      L->in = w->shape[1];
      if (bi != NULL && (bi->ndim != 1 || bi->shape[0] != L->out))
        return unsupported(d, m, "Linear \"%s\": bias shape", fqn);
      if (bi != NULL && bi->dtype != w->dtype)
        return unsupported(d, m, "Linear \"%s\": weight and bias dtypes", fqn);
      return 0;
    case SP_MLP_NORM: {
      const sp_tensor_spec *rm =
          L->running_mean >= 0 ? &m->buffers[L->running_mean] : NULL;
      if (w == NULL || bi == NULL || rm == NULL || w->ndim != 1 ||
          w->shape[0] <= 0)
        return unsupported(d, m,
                           "RunningNorm \"%s\" needs weight, bias and "
                           "running_mean",
                           fqn);
      L->in = L->out = w->shape[0];
      if (bi->ndim != 1 || bi->shape[0] != L->in || rm->shape[0] != L->in)
        return unsupported(d, m, "RunningNorm \"%s\": shapes differ", fqn);
      if (bi->dtype != w->dtype)
        return unsupported(d, m, "RunningNorm \"%s\": weight and bias dtypes",
                           fqn);
      return 0;
    }
    case SP_MLP_RELU:
      if (prev < 0)
        return unsupported(d, m, "ReLU \"%s\" cannot come first", fqn);
      L->in = L->out = prev;
      return 0;
  }
  return 0;
}

/* Shapes, and the chain of feature counts from in_dim to out_dim. */
static int chain_shapes(const sp_model *m, sp_mlp *mlp, sp_diag *d) {
  int64_t prev = -1;
  for (size_t l = 0; l < mlp->n_layers; l++) {
    sp_mlp_layer *L = &mlp->layers[l];
    int rc = layer_shape(m, L, prev, d);
    if (rc != 0) return rc;
    if (prev >= 0 && L->in != prev)
      return unsupported(d, m,
                         "layer \"%s\": input features do not match the "
                         "previous layer's output",
                         m->modules[L->module].fqn);
    prev = L->out;
    if (l == 0) mlp->in_dim = L->in;
    if (L->in > mlp->max_dim) mlp->max_dim = L->in;
    if (L->out > mlp->max_dim) mlp->max_dim = L->out;
  }
  mlp->out_dim = prev;
  return 0;
}

int sp_mlp_new(const sp_model *m, sp_mlp **out, sp_diag *d) {
  if (m == NULL || out == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_new: NULL argument");
  *out = NULL;
  if (m->n_modules == 0) return unsupported(d, m, "%s", "no modules");
  if (m->n_tied > 0)
    return unsupported(d, m, "tied parameter \"%s\"", m->tied[0].fqn);

  sp_mlp *mlp = calloc(1, sizeof *mlp);
  if (mlp == NULL)
    return sp_diag_set(d, SP_ENOMEM, "sp_mlp_new: out of memory");
  mlp->model = m;
  mlp->step_buffer = -1;
  if (m->n_modules > 1) {
    mlp->layers = calloc(m->n_modules, sizeof *mlp->layers);
    if (mlp->layers == NULL) {
      free(mlp);
      return sp_diag_set(d, SP_ENOMEM, "sp_mlp_new: out of memory");
    }
  }
  /* module index -> layer index, to attach tensors to their layers */
  int32_t *layer_of = calloc(m->n_modules, sizeof *layer_of);
  if (layer_of == NULL) {
    sp_mlp_free(mlp);
    return sp_diag_set(d, SP_ENOMEM, "sp_mlp_new: out of memory");
  }
  for (size_t i = 0; i < m->n_modules; i++) layer_of[i] = -1;

  int rc = read_layers(m, mlp, layer_of, d);
  if (rc == 0) rc = attach_params(m, mlp, layer_of, d);
  if (rc == 0) rc = attach_buffers(m, mlp, layer_of, d);
  if (rc == 0) rc = chain_shapes(m, mlp, d);
  free(layer_of);
  if (rc != 0) {
    sp_mlp_free(mlp);
    return rc;
  }
  *out = mlp;
  return 0;
}

void sp_mlp_free(sp_mlp *mlp) {
  if (mlp == NULL) return;
  free(mlp->layers);
  free(mlp);
}
