/* The reference MLP of shardplane-worker (mlp.h): spec reader, synthetic
 * data, initialisation, CPU forward/backward and the unsharded trainer.
 *
 * Numerics, shared by every caller so that a sharded run and the
 * single-process reference differ only in how the batch is split:
 *   - values live in float32 arrays; a layer's inputs, outputs and input
 *     gradients are rounded once to the layer's compute dtype (its params'
 *     param_dtype) with the scalar casts of cast_scalar.h, and parameter
 *     gradients are added to the gradient view, the sum rounded once to its
 *     dtype (onto a zeroed view: the gradient rounded once);
 *   - every sum is a float32 accumulation over samples (or features) in
 *     increasing index order, so results do not depend on threads or on the
 *     caller; only RunningNorm's batch sum crosses ranks (all_reduce_sum);
 *   - every float64 -> narrower conversion goes through cast_scalar.h (one
 *     RNE rounding, independent of the FPU rounding mode).
 */
#include "mlp.h"

#include <fnmatch.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"
#include "cast/cast_scalar.h"
#include "plan/plan.h"

/* ------------------------------------------------------------------ */
/* element helpers (conversions: cast_scalar.h)                       */
/* ------------------------------------------------------------------ */

/* float32 value rounded to a floating dtype and widened back. float32 and
 * float64 hold every float32 value, so only the 16-bit formats round. */
static float round_f32(float v, sp_dtype dt) {
  switch (dt) {
  case SP_BFLOAT16:
    return sp_f32_round_bf16(v);
  case SP_FLOAT16:
    return sp_f32_round_f16(v);
  default:
    return v;
  }
}

static void round_array(float *v, size_t n, sp_dtype dt) {
  if (dt != SP_BFLOAT16 && dt != SP_FLOAT16)
    return;
  for (size_t i = 0; i < n; i++)
    v[i] = round_f32(v[i], dt);
}

/* A double rounded once (RNE) to float32 without the C conversion, whose
 * result would depend on the thread's rounding mode. */
static float f64_to_f32(double v) {
  return sp_f32_from_bits(sp_f64_to_f32_bits(sp_f64_to_bits(v)));
}

/* Element i of a floating array of dtype dt, as float32 (float64 rounds). */
static float load_f32(const void *p, sp_dtype dt, size_t i) {
  const unsigned char *b = p;
  switch (dt) {
  case SP_FLOAT32: {
    float f;
    memcpy(&f, b + i * 4, 4);
    return f;
  }
  case SP_FLOAT64: {
    uint64_t u;
    memcpy(&u, b + i * 8, 8);
    return sp_f32_from_bits(sp_f64_to_f32_bits(u));
  }
  case SP_BFLOAT16: {
    uint16_t h;
    memcpy(&h, b + i * 2, 2);
    return sp_f32_from_bits(sp_bf16_to_f32_bits(h));
  }
  case SP_FLOAT16: {
    uint16_t h;
    memcpy(&h, b + i * 2, 2);
    return sp_f32_from_bits(sp_f16_to_f32_bits(h));
  }
  default:
    return 0.0f;
  }
}

static void store_f32(void *p, sp_dtype dt, size_t i, float v) {
  sp_elem_store_f64(p, dt, i,
                    sp_f64_from_bits(sp_f32_to_f64_bits(sp_f32_to_bits(v))));
}

static bool is_integer_dtype(sp_dtype dt) {
  return dt == SP_INT64 || dt == SP_INT32 || dt == SP_INT16 || dt == SP_INT8 ||
         dt == SP_UINT8;
}

/* Adds 1 to an integer scalar of any width: a carry through its
 * little-endian bytes (the host is little-endian, as safetensors.h checks),
 * which wraps like unsigned arithmetic, so a counter past its range is
 * defined. */
static void int_increment(void *p, sp_dtype dt) {
  if (!is_integer_dtype(dt)) return;
  uint8_t *b = p;
  for (size_t i = 0, n = sp_dtype_size(dt); i < n && ++b[i] == 0; i++) {
  }
}

/* ------------------------------------------------------------------ */
/* hashing                                                             */
/* ------------------------------------------------------------------ */

static uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t hash3(uint64_t tag, uint64_t a, uint64_t b, uint64_t c) {
  return mix64(mix64(mix64(mix64(tag) ^ a) ^ b) ^ c);
}

static uint64_t hash_str(const char *s) {
  uint64_t h = 0xCBF29CE484222325ull; /* FNV-1a */
  for (; *s; s++)
    h = (h ^ (unsigned char)*s) * 0x100000001B3ull;
  return h;
}

/* Uniform in [-1, 1) with 53 bits: exact in double. */
static double unit_f64(uint64_t h) { return (double)(h >> 11) * 0x1p-52 - 1.0; }

/* Uniform in [-1, 1) on a 2^-23 grid: exact in float32, so data does not go
 * through any rounding. */
static float unit_f32(uint64_t h) {
  return (float)((int32_t)(h >> 40) - (INT32_C(1) << 23)) * 0x1p-23f;
}

enum {
  TAG_X = 0x5831,
  TAG_A = 0x4131,
  TAG_INIT = 0x4931,
};

/* ------------------------------------------------------------------ */
/* spec reader                                                         */
/* ------------------------------------------------------------------ */

static int unsupported(sp_diag *d, const sp_model *m, const char *fmt,
                       const char *what) {
  char buf[256];
  snprintf(buf, sizeof buf, fmt, what);
  return sp_diag_set(d, SP_EUNSUPPORTED, "%s: not a sequential MLP: %s",
                     m->path ? m->path : (m->name ? m->name : "model"), buf);
}

/* "layers.<k>" with k decimal and no leading zeros; -1 otherwise. */
static long layer_index(const char *fqn) {
  if (strncmp(fqn, "layers.", 7) != 0)
    return -1;
  const char *s = fqn + 7;
  if (*s < '0' || *s > '9' || (s[0] == '0' && s[1] != '\0'))
    return -1;
  long k = 0;
  for (; *s; s++) {
    if (*s < '0' || *s > '9' || k > 100000000L)
      return -1;
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
      if (strcmp(t->local_name, "step") == 0 && is_integer_dtype(t->dtype) &&
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
               is_integer_dtype(t->dtype) && t->numel == 1) {
      L->num_batches_tracked = (int32_t)b;
    } else if (strcmp(t->local_name, "seen") == 0 && t->dtype == SP_BOOL &&
               t->numel == 1) {
      L->seen = (int32_t)b;
    } else {
      return unsupported(d, m,
                         "unexpected buffer \"%s\" (name, dtype or shape)",
                         t->fqn);
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
    if (rc != 0)
      return rc;
    if (prev >= 0 && L->in != prev)
      return unsupported(d, m,
                         "layer \"%s\": input features do not match the "
                         "previous layer's output",
                         m->modules[L->module].fqn);
    prev = L->out;
    if (l == 0)
      mlp->in_dim = L->in;
    if (L->in > mlp->max_dim)
      mlp->max_dim = L->in;
    if (L->out > mlp->max_dim)
      mlp->max_dim = L->out;
  }
  mlp->out_dim = prev;
  return 0;
}

int sp_mlp_new(const sp_model *m, sp_mlp **out, sp_diag *d) {
  if (m == NULL || out == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_new: NULL argument");
  *out = NULL;
  if (m->n_modules == 0)
    return unsupported(d, m, "%s", "no modules");
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
  for (size_t i = 0; i < m->n_modules; i++)
    layer_of[i] = -1;

  int rc = read_layers(m, mlp, layer_of, d);
  if (rc == 0)
    rc = attach_params(m, mlp, layer_of, d);
  if (rc == 0)
    rc = attach_buffers(m, mlp, layer_of, d);
  if (rc == 0)
    rc = chain_shapes(m, mlp, d);
  free(layer_of);
  if (rc != 0) {
    sp_mlp_free(mlp);
    return rc;
  }
  *out = mlp;
  return 0;
}

void sp_mlp_free(sp_mlp *mlp) {
  if (mlp == NULL)
    return;
  free(mlp->layers);
  free(mlp);
}

/* ------------------------------------------------------------------ */
/* data and initialisation                                             */
/* ------------------------------------------------------------------ */

void sp_mlp_batch(const sp_mlp *mlp, uint64_t step, uint64_t first, size_t n,
                  float *x, float *t) {
  if (mlp == NULL)
    return;
  size_t in = (size_t)mlp->in_dim, out = (size_t)mlp->out_dim;
  /* t_j = c_j + sin(a_j . x): a fixed random projection whose 2/sqrt(in)
   * scale keeps sin's argument at a standard deviation near 0.7, where sin
   * is far from linear, plus a per-output offset c_j in [-0.75, 0.75) that
   * the first steps learn quickly, so a short run shows a falling loss. */
  double scale = 2.0 / sqrt((double)in);
  for (size_t s = 0; s < n; s++) {
    uint64_t sample = first + s;
    if (x != NULL)
      for (size_t i = 0; i < in; i++)
        x[s * in + i] = unit_f32(hash3(TAG_X, step, sample, i));
    if (t == NULL)
      continue;
    for (size_t j = 0; j < out; j++) {
      double z = 0.0;
      for (size_t i = 0; i < in; i++) {
        double a = unit_f64(hash3(TAG_A, j, i, 0)) * scale;
        z += a * (double)unit_f32(hash3(TAG_X, step, sample, i));
      }
      double offset = 0.75 * unit_f64(hash3(TAG_A, j, UINT64_MAX, 1));
      t[s * out + j] = f64_to_f32(offset + sin(z));
    }
  }
}

void sp_mlp_init_param(void *user, const sp_model *m, int32_t param,
                       int64_t start, int64_t n, void *dst) {
  (void)user;
  if (m == NULL || dst == NULL || param < 0 || (size_t)param >= m->n_params ||
      start < 0 || n <= 0)
    return;
  const sp_tensor_spec *t = &m->params[param];
  size_t es = sp_dtype_size(t->dtype);
  if (!sp_dtype_is_floating(t->dtype)) {
    memset(dst, 0, (size_t)n * es);
    return;
  }
  uint64_t key = hash_str(t->fqn);
  double bound = 0.0, base = 0.0, jitter = 0.01;
  if (t->ndim >= 2) {
    int64_t fan_in = t->shape[0] > 0 ? t->numel / t->shape[0] : 1;
    bound = 1.0 / sqrt((double)(fan_in > 0 ? fan_in : 1));
    jitter = 0.0;
  } else if (strcmp(t->local_name, "weight") == 0) {
    base = 1.0;
  }
  for (int64_t k = 0; k < n; k++) {
    double u = unit_f64(hash3(TAG_INIT, key, (uint64_t)(start + k), 0));
    double v = base + (bound != 0.0 ? bound : jitter) * u;
    sp_elem_store_f64(dst, t->dtype, (size_t)k, v);
  }
}

void sp_mlp_init_buffer(void *user, const sp_model *m, int32_t buffer,
                        void *dst) {
  (void)user;
  if (m == NULL || dst == NULL || buffer < 0 || (size_t)buffer >= m->n_buffers)
    return;
  const sp_tensor_spec *t = &m->buffers[buffer];
  /* zero bytes are 0.0, 0 and false in every dtype */
  memset(dst, 0, (size_t)t->numel * sp_dtype_size(t->dtype));
}

/* ------------------------------------------------------------------ */
/* activations                                                         */
/* ------------------------------------------------------------------ */

static float *alloc_floats(size_t n, int64_t dim, int *rc) {
  if (dim < 0 || (dim > 0 && n > SIZE_MAX / sizeof(float) / (size_t)dim)) {
    *rc = SP_ETOOBIG;
    return NULL;
  }
  size_t count = n * (size_t)dim;
  float *p = calloc(count ? count : 1, sizeof(float));
  if (p == NULL)
    *rc = SP_ENOMEM;
  return p;
}

int sp_mlp_acts_new(const sp_mlp *mlp, size_t n, sp_mlp_acts **out) {
  if (mlp == NULL || out == NULL)
    return SP_EINVAL;
  *out = NULL;
  sp_mlp_acts *a = calloc(1, sizeof *a);
  if (a == NULL)
    return SP_ENOMEM;
  a->n = n;
  /* NULL-terminated, so sp_mlp_acts_free and the model check below need no
   * layer count of their own */
  a->x = calloc(mlp->n_layers + 2, sizeof *a->x);
  int rc = a->x == NULL ? SP_ENOMEM : 0;
  for (size_t l = 0; l <= mlp->n_layers && rc == 0; l++) {
    int64_t dim = l == 0 ? mlp->in_dim : mlp->layers[l - 1].out;
    a->x[l] = alloc_floats(n, dim, &rc);
  }
  if (rc == 0)
    a->dx = alloc_floats(n, mlp->max_dim, &rc);
  if (rc == 0)
    a->dy = alloc_floats(n, mlp->max_dim, &rc);
  if (rc != 0) {
    sp_mlp_acts_free(a);
    return rc;
  }
  *out = a;
  return 0;
}

void sp_mlp_acts_free(sp_mlp_acts *a) {
  if (a == NULL)
    return;
  if (a->x != NULL)
    for (size_t l = 0; a->x[l] != NULL; l++)
      free(a->x[l]);
  free(a->x);
  free(a->dx);
  free(a->dy);
  free(a);
}

/* ------------------------------------------------------------------ */
/* forward and backward                                                */
/* ------------------------------------------------------------------ */

static const char *param_fqn(const sp_mlp *mlp, int32_t p) {
  return mlp->model->params[p].fqn;
}

/* A param's view as float32 in a fresh array (*out, caller frees), and its
 * dtype. Views may be unaligned and in any floating dtype, hence the copy. */
static int read_param(const sp_mlp *mlp, const sp_mlp_io *io, int32_t p,
                      float **out, sp_dtype *dt, sp_diag *d) {
  *out = NULL;
  const sp_tensor_spec *t = &mlp->model->params[p];
  sp_dtype pd = io->param_dtype(io->user, p);
  if (!sp_dtype_is_floating(pd))
    return sp_diag_set(d, SP_EINVAL, "%s: param dtype %s is not floating",
                       t->fqn, sp_dtype_name(pd));
  const void *v = io->param(io->user, p);
  if (v == NULL)
    return sp_diag_set(d, SP_EINVAL, "%s: no parameter view (unit sharded?)",
                       t->fqn);
  int rc = 0;
  float *f = alloc_floats((size_t)t->numel, 1, &rc);
  if (f == NULL)
    return sp_diag_set(d, rc, "%s: cannot allocate %lld floats", t->fqn,
                       (long long)t->numel);
  rc = sp_cast(f, SP_FLOAT32, v, pd, (size_t)t->numel);
  if (rc != 0) {
    free(f);
    return sp_diag_set(d, rc, "%s: cast from %s failed", t->fqn,
                       sp_dtype_name(pd));
  }
  *out = f;
  *dt = pd;
  return 0;
}

/* Adds a float32 gradient to the param's gradient view, as autograd
 * accumulates into .grad: dst = rne_pd(dst + g), the sum in double (onto a
 * zero view exactly the rounded g). A NULL view means the param takes no
 * gradient. */
static int write_grad(const sp_mlp *mlp, const sp_mlp_io *io, int32_t p,
                      const float *g, sp_diag *d) {
  if (io->grad == NULL)
    return 0;
  void *dst = io->grad(io->user, p);
  if (dst == NULL)
    return 0;
  const sp_tensor_spec *t = &mlp->model->params[p];
  sp_dtype pd = io->param_dtype(io->user, p);
  if (!sp_dtype_is_floating(pd))
    return sp_diag_set(d, SP_EINVAL, "%s: gradient dtype %s is not floating",
                       t->fqn, sp_dtype_name(pd));
  for (size_t i = 0; i < (size_t)t->numel; i++)
    sp_elem_store_f64(dst, pd, i, sp_elem_load_f64(dst, pd, i) + (double)g[i]);
  return 0;
}

static int buffer_view(const sp_mlp *mlp, const sp_mlp_io *io, int32_t b,
                       void **p, sp_dtype *dt, sp_diag *d) {
  const sp_tensor_spec *t = &mlp->model->buffers[b];
  *p = io->buffer ? io->buffer(io->user, b) : NULL;
  *dt = io->buffer_dtype ? io->buffer_dtype(io->user, b) : t->dtype;
  if (*p == NULL)
    return sp_diag_set(d, SP_EINVAL, "%s: no buffer storage", t->fqn);
  /* Integer and bool buffers never change dtype (FSDP); floating ones may
   * take any floating compute dtype. */
  bool ok = sp_dtype_is_floating(t->dtype) ? sp_dtype_is_floating(*dt)
                                           : *dt == t->dtype;
  if (!ok)
    return sp_diag_set(d, SP_EINVAL, "%s: buffer dtype %s, original %s", t->fqn,
                       sp_dtype_name(*dt), sp_dtype_name(t->dtype));
  return 0;
}

static int check_call(const sp_mlp *mlp, size_t l, const sp_mlp_io *io,
                      const sp_mlp_acts *a, sp_diag *d) {
  if (mlp == NULL || io == NULL || a == NULL || io->param == NULL ||
      io->param_dtype == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp: NULL argument or callback");
  if (l >= mlp->n_layers)
    return sp_diag_set(d, SP_ERANGE, "sp_mlp: layer %zu of %zu", l,
                       mlp->n_layers);
  size_t nx = 0;
  while (a->x != NULL && a->x[nx] != NULL && nx <= mlp->n_layers)
    nx++;
  if (nx != mlp->n_layers + 1 || a->x[nx] != NULL || a->dx == NULL ||
      a->dy == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp: activations of another model");
  return 0;
}

static int linear_forward(const sp_mlp *mlp, const sp_mlp_layer *L,
                          const sp_mlp_io *io, sp_mlp_acts *a, size_t l,
                          sp_diag *d) {
  size_t n = a->n, in = (size_t)L->in, out = (size_t)L->out;
  float *w = NULL, *b = NULL;
  sp_dtype pd = SP_FLOAT32, bd = SP_FLOAT32;
  int rc = read_param(mlp, io, L->weight, &w, &pd, d);
  if (rc == 0 && L->bias >= 0)
    rc = read_param(mlp, io, L->bias, &b, &bd, d);
  if (rc == 0) {
    float *x = a->x[l], *y = a->x[l + 1];
    /* the GEMM consumes its input in the compute dtype */
    round_array(x, n * in, pd);
    for (size_t s = 0; s < n; s++)
      for (size_t j = 0; j < out; j++) {
        const float *xs = x + s * in, *wj = w + j * in;
        float acc = 0.0f;
        for (size_t i = 0; i < in; i++)
          acc += xs[i] * wj[i];
        if (b)
          acc += b[j];
        y[s * out + j] = round_f32(acc, pd);
      }
  }
  free(w);
  free(b);
  return rc;
}

static int linear_backward(const sp_mlp *mlp, const sp_mlp_layer *L,
                           const sp_mlp_io *io, sp_mlp_acts *a, size_t l,
                           sp_diag *d) {
  size_t n = a->n, in = (size_t)L->in, out = (size_t)L->out;
  float *w = NULL, *gw = NULL, *gb = NULL;
  sp_dtype pd = SP_FLOAT32;
  int rc = read_param(mlp, io, L->weight, &w, &pd, d);
  if (rc == 0) {
    gw = alloc_floats(out, L->in, &rc);
    if (gw != NULL)
      gb = alloc_floats(out, 1, &rc);
    if (rc != 0)
      sp_diag_set(d, rc, "%s: gradient scratch", param_fqn(mlp, L->weight));
  }
  if (rc == 0) {
    const float *x = a->x[l], *dy = a->dy;
    /* samples outermost: each element still sums over s in order */
    for (size_t s = 0; s < n; s++)
      for (size_t j = 0; j < out; j++) {
        float g = dy[s * out + j];
        const float *xs = x + s * in;
        float *gwj = gw + j * in;
        for (size_t i = 0; i < in; i++)
          gwj[i] += g * xs[i];
        gb[j] += g;
      }
    rc = write_grad(mlp, io, L->weight, gw, d);
    if (rc == 0 && L->bias >= 0)
      rc = write_grad(mlp, io, L->bias, gb, d);
  }
  if (rc == 0 && l > 0) {
    const float *dy = a->dy;
    float *dx = a->dx;
    for (size_t s = 0; s < n; s++)
      for (size_t i = 0; i < in; i++) {
        float acc = 0.0f;
        for (size_t j = 0; j < out; j++)
          acc += dy[s * out + j] * w[j * in + i];
        dx[s * in + i] = round_f32(acc, pd);
      }
  }
  free(w);
  free(gw);
  free(gb);
  return rc;
}

static int norm_forward(const sp_mlp *mlp, const sp_mlp_layer *L,
                        const sp_mlp_io *io, sp_mlp_acts *a, size_t l,
                        uint64_t global_n, sp_diag *d) {
  size_t n = a->n, h = (size_t)L->in;
  float *w = NULL, *b = NULL, *sum = NULL;
  sp_dtype pd = SP_FLOAT32, bd = SP_FLOAT32, rd = SP_FLOAT32;
  void *rm = NULL;
  int rc = read_param(mlp, io, L->weight, &w, &pd, d);
  if (rc == 0)
    rc = read_param(mlp, io, L->bias, &b, &bd, d);
  if (rc == 0)
    rc = buffer_view(mlp, io, L->running_mean, &rm, &rd, d);
  if (rc == 0 && (sum = alloc_floats(h, 1, &rc)) == NULL)
    sp_diag_set(d, rc, "%s: scratch", mlp->model->modules[L->module].fqn);
  if (rc != 0)
    goto out;

  float *x = a->x[l], *y = a->x[l + 1];
  round_array(x, n * h, pd);
  for (size_t s = 0; s < n; s++)
    for (size_t k = 0; k < h; k++)
      sum[k] += x[s * h + k];
  /* Every rank calls the collective, also one whose local batch is empty. */
  if (io->all_reduce_sum != NULL) {
    rc = io->all_reduce_sum(io->user, sum, h, d);
    if (rc != 0) {
      sp_diag_prefix(d, rc, "%s: all-reduce of the batch sum",
                     mlp->model->modules[L->module].fqn);
      goto out;
    }
  }
  float gn = (float)global_n;
  for (size_t k = 0; k < h; k++) {
    float mean = sum[k] / gn;
    float old = load_f32(rm, rd, k);
    store_f32(rm, rd, k, 0.9f * old + 0.1f * mean);
  }
  if (L->num_batches_tracked >= 0) {
    void *p;
    sp_dtype dt;
    if ((rc = buffer_view(mlp, io, L->num_batches_tracked, &p, &dt, d)) != 0)
      goto out;
    int_increment(p, dt);
  }
  if (L->seen >= 0) {
    void *p;
    sp_dtype dt;
    if ((rc = buffer_view(mlp, io, L->seen, &p, &dt, d)) != 0)
      goto out;
    *(unsigned char *)p = 1;
  }
  /* the stored (rounded) running mean is what the output uses */
  for (size_t k = 0; k < h; k++)
    sum[k] = load_f32(rm, rd, k);
  for (size_t s = 0; s < n; s++)
    for (size_t k = 0; k < h; k++) {
      float c = x[s * h + k] - sum[k];
      y[s * h + k] = round_f32(c * w[k] + b[k], pd);
    }
out:
  free(w);
  free(b);
  free(sum);
  return rc;
}

static int norm_backward(const sp_mlp *mlp, const sp_mlp_layer *L,
                         const sp_mlp_io *io, sp_mlp_acts *a, size_t l,
                         sp_diag *d) {
  size_t n = a->n, h = (size_t)L->in;
  float *w = NULL, *gw = NULL, *gb = NULL, *mean = NULL;
  sp_dtype pd = SP_FLOAT32, rd = SP_FLOAT32;
  void *rm = NULL;
  int rc = read_param(mlp, io, L->weight, &w, &pd, d);
  if (rc == 0)
    rc = buffer_view(mlp, io, L->running_mean, &rm, &rd, d);
  if (rc == 0) {
    if ((gw = alloc_floats(h, 1, &rc)) == NULL ||
        (gb = alloc_floats(h, 1, &rc)) == NULL ||
        (mean = alloc_floats(h, 1, &rc)) == NULL)
      sp_diag_set(d, rc, "%s: scratch", mlp->model->modules[L->module].fqn);
  }
  if (rc != 0)
    goto out;
  for (size_t k = 0; k < h; k++)
    mean[k] = load_f32(rm, rd, k);
  const float *x = a->x[l], *dy = a->dy;
  for (size_t s = 0; s < n; s++)
    for (size_t k = 0; k < h; k++) {
      float g = dy[s * h + k];
      float c = x[s * h + k] - mean[k];
      gw[k] += g * c;
      gb[k] += g;
    }
  rc = write_grad(mlp, io, L->weight, gw, d);
  if (rc == 0)
    rc = write_grad(mlp, io, L->bias, gb, d);
  if (rc == 0 && l > 0)
    for (size_t s = 0; s < n; s++)
      for (size_t k = 0; k < h; k++)
        a->dx[s * h + k] = round_f32(dy[s * h + k] * w[k], pd);
out:
  free(w);
  free(gw);
  free(gb);
  free(mean);
  return rc;
}

int sp_mlp_forward(const sp_mlp *mlp, size_t l, const sp_mlp_io *io,
                   sp_mlp_acts *a, uint64_t global_n, sp_diag *d) {
  int rc = check_call(mlp, l, io, a, d);
  if (rc != 0)
    return rc;
  const sp_mlp_layer *L = &mlp->layers[l];
  switch (L->kind) {
  case SP_MLP_LINEAR:
    return linear_forward(mlp, L, io, a, l, d);
  case SP_MLP_NORM:
    if (global_n == 0 || global_n < a->n || global_n > (UINT64_C(1) << 24))
      return sp_diag_set(d, SP_EINVAL,
                         "%s: global batch %llu (local %zu) out of range",
                         mlp->model->modules[L->module].fqn,
                         (unsigned long long)global_n, a->n);
    return norm_forward(mlp, L, io, a, l, global_n, d);
  case SP_MLP_RELU: {
    size_t count = a->n * (size_t)L->in;
    const float *x = a->x[l];
    float *y = a->x[l + 1];
    /* NaN passes through, as torch.relu, so a diverged run stays visible */
    for (size_t i = 0; i < count; i++)
      y[i] = x[i] > 0.0f ? x[i] : (x[i] != x[i] ? x[i] : 0.0f);
    return 0;
  }
  }
  return sp_diag_set(d, SP_EINVAL, "sp_mlp_forward: bad layer kind");
}

double sp_mlp_loss(const sp_mlp *mlp, sp_mlp_acts *a, const float *t,
                   sp_dtype out_dtype) {
  return sp_mlp_loss_over(mlp, a, t, out_dtype, a ? a->n : 0);
}

double sp_mlp_loss_over(const sp_mlp *mlp, sp_mlp_acts *a, const float *t,
                        sp_dtype out_dtype, uint64_t denom) {
  if (mlp == NULL || a == NULL || t == NULL || a->n == 0 || denom == 0)
    return 0.0;
  size_t n = a->n, out = (size_t)mlp->out_dim;
  const float *y = a->x[mlp->n_layers];
  float fn = (float)denom;
  double loss = 0.0;
  for (size_t s = 0; s < n; s++)
    for (size_t j = 0; j < out; j++) {
      size_t i = s * out + j;
      float r = y[i] - t[i];
      loss += 0.5 * (double)r * (double)r;
      a->dy[i] = round_f32(r / fn, out_dtype);
    }
  return loss / (double)denom;
}

int sp_mlp_backward(const sp_mlp *mlp, size_t l, const sp_mlp_io *io,
                    sp_mlp_acts *a, sp_diag *d) {
  int rc = check_call(mlp, l, io, a, d);
  if (rc != 0)
    return rc;
  const sp_mlp_layer *L = &mlp->layers[l];
  switch (L->kind) {
  case SP_MLP_LINEAR:
    rc = linear_backward(mlp, L, io, a, l, d);
    break;
  case SP_MLP_NORM:
    rc = norm_backward(mlp, L, io, a, l, d);
    break;
  case SP_MLP_RELU: {
    size_t count = a->n * (size_t)L->in;
    const float *x = a->x[l];
    if (l > 0)
      for (size_t i = 0; i < count; i++)
        a->dx[i] = x[i] > 0.0f ? a->dy[i] : 0.0f;
    break;
  }
  default:
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_backward: bad layer kind");
  }
  if (rc == 0 && l > 0) {
    float *tmp = a->dx;
    a->dx = a->dy;
    a->dy = tmp;
  }
  return rc;
}

void sp_mlp_count_step(const sp_mlp *mlp, const sp_mlp_io *io) {
  if (mlp == NULL || io == NULL || mlp->step_buffer < 0 || io->buffer == NULL)
    return;
  void *p = io->buffer(io->user, mlp->step_buffer);
  sp_dtype dt = io->buffer_dtype ? io->buffer_dtype(io->user, mlp->step_buffer)
                                 : mlp->model->buffers[mlp->step_buffer].dtype;
  if (p != NULL)
    int_increment(p, dt);
}

sp_dtype sp_mlp_out_dtype(const sp_mlp *mlp, const sp_mlp_io *io) {
  if (mlp == NULL || io == NULL || io->param_dtype == NULL)
    return SP_FLOAT32;
  for (size_t l = mlp->n_layers; l-- > 0;)
    if (mlp->layers[l].weight >= 0)
      return io->param_dtype(io->user, mlp->layers[l].weight);
  return SP_FLOAT32;
}

/* ------------------------------------------------------------------ */
/* the unsharded reference run                                         */
/* ------------------------------------------------------------------ */

typedef struct ref_ctx {
  const sp_model *m;
  unsigned char *master; /* every param, own dtype */
  unsigned char *view;   /* every param, unit param_dtype */
  unsigned char *grad;   /* every param, unit param_dtype */
  unsigned char *bufs;   /* every buffer, compute dtype */
  size_t *master_off, *view_off, *buf_off;
  sp_dtype *pdt, *bdt;
  /* the optimizer's side, per param element (elem_off), in double but
   * holding values of their stored dtype: the reduced gradient (the
   * gradient dtype gdt: the param's, or param_dtype with
   * keep_low_precision_grads), and the float32 state */
  size_t *elem_off;
  sp_dtype *gdt, *rdt;
  bool *decays;
  double *g, *m1, *m2;
} ref_ctx;

static void *ref_param(void *u, int32_t p) {
  ref_ctx *c = u;
  return c->view + c->view_off[p];
}
static void *ref_grad(void *u, int32_t p) {
  ref_ctx *c = u;
  return c->m->params[p].flag ? c->grad + c->view_off[p] : NULL;
}
static sp_dtype ref_param_dtype(void *u, int32_t p) {
  return ((ref_ctx *)u)->pdt[p];
}
static void *ref_buffer(void *u, int32_t b) {
  ref_ctx *c = u;
  return c->bufs + c->buf_off[b];
}
static sp_dtype ref_buffer_dtype(void *u, int32_t b) {
  return ((ref_ctx *)u)->bdt[b];
}

/* Byte offsets of n tensors laid end to end, each with numel[i] elements of
 * dtype dt[i]; *total gets the sum. SP_ETOOBIG on overflow. */
static int layout(const sp_tensor_spec *ts, const sp_dtype *dt, size_t n,
                  size_t *off, size_t *total) {
  size_t acc = 0;
  for (size_t i = 0; i < n; i++) {
    size_t es = sp_dtype_size(dt[i]);
    if (ts[i].numel < 0 || (uint64_t)ts[i].numel > SIZE_MAX / 8)
      return SP_ETOOBIG;
    /* packed, as the caller receives them; every access goes through
     * memcpy or sp_cast, so alignment does not matter */
    size_t bytes = (size_t)ts[i].numel * es;
    if (acc > SIZE_MAX - bytes)
      return SP_ETOOBIG;
    off[i] = acc;
    acc += bytes;
  }
  *total = acc;
  return 0;
}

/* Largest global batch the reference run takes: the norm's mean divides by
 * it in float32, exact up to 2^24. */
#define SP_MLP_MAX_BATCH (1u << 24)

/* v rounded once to dt, as a double */
static double ref_round(double v, sp_dtype dt) {
  uint64_t tmp;
  sp_elem_store_f64(&tmp, dt, 0, v);
  return sp_elem_load_f64(&tmp, dt, 0);
}

/* ---- the optimizer, written out for one process ----
 * torch.optim's formulas on whole tensors, independently of the runtime's
 * sharded implementation (client/lib/fsdp/optim.c), in the documented order of
 * double operations, so that one rank's run agrees with it bit for bit and
 * a sharded one within its summation-order differences. */

static double ref_lr(const sp_optim_opts *o, uint32_t step) {
  if (o->schedule != SP_LR_COSINE)
    return o->lr;
  double t = step, w = (double)o->warmup_steps, total = (double)o->total_steps;
  if (t < w)
    return o->lr * (t + 1) / w;
  if (t >= total)
    return o->min_lr;
  const double pi = 3.14159265358979323846;
  return o->min_lr +
         0.5 * (o->lr - o->min_lr) * (1.0 + cos(pi * (t - w) / (total - w)));
}

static bool ref_any_match(const char *const *pats, size_t n,
                          const char *fqn) {
  for (size_t i = 0; i < n; i++)
    if (fnmatch(pats[i], fqn, 0) == 0)
      return true;
  return false;
}

/* no_decay patterns, then decay patterns, then: weights (2-D and up) */
static bool ref_decays(const sp_optim_opts *o, const sp_tensor_spec *t) {
  if (ref_any_match(o->no_decay, o->n_no_decay, t->fqn))
    return false;
  if (ref_any_match(o->decay, o->n_decay, t->fqn))
    return true;
  return t->ndim >= 2;
}

/* The gradient the runtime's reduction leaves for param p from its view
 * gradient: cast to reduce_dtype and on to the gradient dtype (a no-op
 * collective in one process), added to what it holds. */
static int ref_reduce(ref_ctx *c, int32_t p, unsigned char *tmp_a,
                      unsigned char *tmp_b, sp_diag *d) {
  const sp_tensor_spec *t = &c->m->params[p];
  size_t n = (size_t)t->numel;
  int rc = sp_cast(tmp_a, c->rdt[p], c->grad + c->view_off[p], c->pdt[p], n);
  if (rc == 0)
    rc = sp_cast(tmp_b, c->gdt[p], tmp_a, c->rdt[p], n);
  if (rc != 0)
    return sp_diag_set(d, rc, "%s: gradient cast failed", t->fqn);
  double *g = c->g + c->elem_off[p];
  for (size_t i = 0; i < n; i++)
    g[i] = ref_round(g[i] + sp_elem_load_f64(tmp_b, c->gdt[p], i),
                     c->gdt[p]);
  return 0;
}

/* clip_grad_norm_ over every trainable gradient */
static void ref_clip(ref_ctx *c, double max_norm) {
  const sp_model *m = c->m;
  double sq = 0;
  for (size_t p = 0; p < m->n_params; p++) {
    if (!m->params[p].flag)
      continue;
    const double *g = c->g + c->elem_off[p];
    for (int64_t i = 0; i < m->params[p].numel; i++)
      sq += g[i] * g[i];
  }
  double coef = max_norm / (sqrt(sq) + 1e-6);
  if (!(coef < 1.0))
    return;
  for (size_t p = 0; p < m->n_params; p++) {
    if (!m->params[p].flag)
      continue;
    double *g = c->g + c->elem_off[p];
    for (int64_t i = 0; i < m->params[p].numel; i++)
      g[i] = ref_round(g[i] * coef, c->gdt[p]);
  }
}

/* One optimizer step (0-based `step`) on every trainable param. */
static void ref_update(ref_ctx *c, const sp_optim_opts *o, uint32_t step) {
  const sp_model *m = c->m;
  double lr = ref_lr(o, step), t = (double)step + 1;
  double bc1 = 1.0 - pow(o->beta1, t), bc2 = 1.0 - pow(o->beta2, t);
  for (size_t p = 0; p < m->n_params; p++) {
    const sp_tensor_spec *ts = &m->params[p];
    if (!ts->flag)
      continue;
    void *mp = c->master + c->master_off[p];
    const double *g = c->g + c->elem_off[p];
    double *m1 = c->m1 + c->elem_off[p], *m2 = c->m2 + c->elem_off[p];
    double wd = c->decays[p] ? o->weight_decay : 0.0;
    for (int64_t i = 0; i < ts->numel; i++) {
      double pv = sp_elem_load_f64(mp, ts->dtype, (size_t)i), gv = g[i];
      if (o->kind == SP_OPTIM_ADAMW) {
        pv = pv - lr * wd * pv;
        m1[i] = ref_round(o->beta1 * m1[i] + (1.0 - o->beta1) * gv,
                          SP_FLOAT32);
        m2[i] = ref_round(o->beta2 * m2[i] + (1.0 - o->beta2) * (gv * gv),
                          SP_FLOAT32);
        pv = pv - lr * (m1[i] / bc1) / (sqrt(m2[i] / bc2) + o->eps);
      } else {
        if (wd != 0)
          gv = gv + wd * pv;
        if (o->momentum != 0) {
          m1[i] = ref_round(o->momentum * m1[i] + gv, SP_FLOAT32);
          gv = m1[i];
        }
        pv = pv - lr * gv;
      }
      sp_elem_store_f64(mp, ts->dtype, (size_t)i, pv);
    }
  }
}

void sp_mlp_train_cfg_init(sp_mlp_train_cfg *cfg, uint32_t steps,
                           uint32_t global_batch, double lr) {
  memset(cfg, 0, sizeof *cfg);
  cfg->steps = steps;
  cfg->global_batch = global_batch;
  cfg->grad_accum = 1;
  sp_optim_opts_init(&cfg->optim, SP_OPTIM_SGD);
  cfg->optim.lr = lr;
}

int sp_mlp_reference_run(const sp_model *m, const sp_job *job, uint32_t steps,
                         uint32_t global_batch, double lr, double *losses,
                         void **params, void **buffers, sp_diag *d) {
  if (!isfinite(lr))
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_reference_run: lr not finite");
  sp_mlp_train_cfg cfg;
  sp_mlp_train_cfg_init(&cfg, steps, global_batch, lr);
  return sp_mlp_reference_train(m, job, &cfg, losses, params, buffers, d);
}

static int ref_check(const sp_mlp_train_cfg *cfg, sp_diag *d) {
  uint32_t k = cfg->grad_accum ? cfg->grad_accum : 1;
  if (cfg->global_batch == 0 || cfg->global_batch > SP_MLP_MAX_BATCH)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_mlp_reference_run: global batch %u not in 1..%u",
                       cfg->global_batch, SP_MLP_MAX_BATCH);
  if (cfg->global_batch % k != 0)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_reference_run: global batch %u "
                       "is not a multiple of %u micro-batches",
                       cfg->global_batch, k);
  if (cfg->clip_grad_norm < 0 || !isfinite(cfg->clip_grad_norm))
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_reference_run: clip norm %g",
                       cfg->clip_grad_norm);
  int rc = sp_optim_opts_check(&cfg->optim, d);
  if (rc != 0)
    return sp_diag_prefix(d, rc, "sp_mlp_reference_run");
  return 0;
}

int sp_mlp_reference_train(const sp_model *m, const sp_job *job,
                           const sp_mlp_train_cfg *cfg, double *losses,
                           void **params, void **buffers, sp_diag *d) {
  if (params)
    *params = NULL;
  if (buffers)
    *buffers = NULL;
  if (m == NULL || job == NULL || cfg == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_reference_run: NULL argument");
  int rc = ref_check(cfg, d);
  if (rc != 0)
    return rc;
  uint32_t k = cfg->grad_accum ? cfg->grad_accum : 1;
  uint32_t micro = cfg->global_batch / k;

  sp_mlp *mlp = NULL;
  sp_plan *plan = NULL;
  sp_mlp_acts *acts = NULL;
  float *target = NULL;
  unsigned char *tmp_a = NULL, *tmp_b = NULL;
  ref_ctx c = {.m = m};
  rc = sp_mlp_new(m, &mlp, d);
  if (rc != 0)
    return rc;

  /* Same units and dtypes as the sharded job; only the world differs. The
   * plan's dtypes do not depend on strategy, and HYBRID_SHARD's group size
   * would not divide a world of 1. */
  sp_job one = *job;
  one.world_size = 1;
  if (one.strategy == SP_HYBRID_SHARD)
    one.strategy = SP_FULL_SHARD;
  one.shard_group_size = 0;
  if ((rc = sp_plan_build(m, &one, &plan, d)) != 0)
    goto out;

  size_t np = m->n_params, nb = m->n_buffers;
  c.master_off = calloc(np + 1, sizeof *c.master_off);
  c.view_off = calloc(np + 1, sizeof *c.view_off);
  c.buf_off = calloc(nb + 1, sizeof *c.buf_off);
  c.elem_off = calloc(np + 1, sizeof *c.elem_off);
  c.pdt = calloc(np + 1, sizeof *c.pdt);
  c.gdt = calloc(np + 1, sizeof *c.gdt);
  c.rdt = calloc(np + 1, sizeof *c.rdt);
  c.decays = calloc(np + 1, sizeof *c.decays);
  c.bdt = calloc(nb + 1, sizeof *c.bdt);
  sp_dtype *mdt = calloc(np + 1, sizeof *mdt);
  if (!c.master_off || !c.view_off || !c.buf_off || !c.elem_off || !c.pdt ||
      !c.gdt || !c.rdt || !c.decays || !c.bdt || !mdt) {
    free(mdt);
    rc = sp_diag_set(d, SP_ENOMEM, "sp_mlp_reference_run: out of memory");
    goto out;
  }
  int64_t max_numel = 1;
  size_t elems = 0;
  for (size_t p = 0; p < np; p++) {
    const sp_unit *u = &plan->units[plan->param_unit[p]];
    mdt[p] = m->params[p].dtype;
    c.pdt[p] = u->param_dtype != SP_DTYPE_INVALID ? u->param_dtype : mdt[p];
    /* FSDP: the gradient goes to reduce_dtype for the collective (a no-op
     * sum at world size 1), then back to the flat parameter's dtype, or,
     * with keep_low_precision_grads, to param_dtype
     * (cast_grad_to_param_dtype_if_needed). */
    c.rdt[p] = u->reduce_dtype != SP_DTYPE_INVALID ? u->reduce_dtype
                                                   : c.pdt[p];
    c.gdt[p] = u->keep_low_precision_grads ? c.pdt[p] : mdt[p];
    c.decays[p] = ref_decays(&cfg->optim, &m->params[p]);
    c.elem_off[p] = elems;
    elems += (size_t)m->params[p].numel;
    if (m->params[p].numel > max_numel)
      max_numel = m->params[p].numel;
  }
  for (size_t b = 0; b < nb; b++)
    if (m->buffers[b].numel > max_numel)
      max_numel = m->buffers[b].numel;
  for (size_t i = 0; i < plan->n_buffers; i++)
    c.bdt[plan->buffers[i].buffer] = plan->buffers[i].compute_dtype;
  size_t master_bytes = 0, view_bytes = 0, buf_bytes = 0;
  rc = layout(m->params, mdt, np, c.master_off, &master_bytes);
  if (rc == 0)
    rc = layout(m->params, c.pdt, np, c.view_off, &view_bytes);
  if (rc == 0)
    rc = layout(m->buffers, c.bdt, nb, c.buf_off, &buf_bytes);
  free(mdt);
  if (rc != 0) {
    rc = sp_diag_set(d, rc, "sp_mlp_reference_run: model too large");
    goto out;
  }
  c.master = calloc(master_bytes ? master_bytes : 1, 1);
  c.view = calloc(view_bytes ? view_bytes : 1, 1);
  c.grad = calloc(view_bytes ? view_bytes : 1, 1);
  c.bufs = calloc(buf_bytes ? buf_bytes : 1, 1);
  c.g = calloc(elems + 1, sizeof *c.g);
  c.m1 = calloc(elems + 1, sizeof *c.m1);
  c.m2 = calloc(elems + 1, sizeof *c.m2);
  /* two scratch arrays of the largest tensor, 8 bytes an element */
  if ((uint64_t)max_numel <= SIZE_MAX / 8) {
    tmp_a = malloc((size_t)max_numel * 8);
    tmp_b = malloc((size_t)max_numel * 8);
  }
  if (!c.master || !c.view || !c.grad || !c.bufs || !c.g || !c.m1 || !c.m2 ||
      !tmp_a || !tmp_b) {
    rc = sp_diag_set(d, SP_ENOMEM, "sp_mlp_reference_run: out of memory");
    goto out;
  }
  for (size_t p = 0; p < np; p++)
    sp_mlp_init_param(NULL, m, (int32_t)p, 0, m->params[p].numel,
                      c.master + c.master_off[p]);
  /* buffers: initialised in their original dtype, cast once to the compute
   * dtype, as FSDP's lazy init does before the first forward */
  for (size_t b = 0; b < nb; b++) {
    const sp_tensor_spec *t = &m->buffers[b];
    void *dst = c.bufs + c.buf_off[b];
    if (c.bdt[b] == t->dtype || !sp_dtype_is_floating(t->dtype)) {
      sp_mlp_init_buffer(NULL, m, (int32_t)b, dst);
      continue;
    }
    sp_mlp_init_buffer(NULL, m, (int32_t)b, tmp_a);
    if ((rc = sp_cast(dst, c.bdt[b], tmp_a, t->dtype, (size_t)t->numel)) != 0) {
      rc = sp_diag_set(d, rc, "%s: buffer cast failed", t->fqn);
      goto out;
    }
  }

  if ((rc = sp_mlp_acts_new(mlp, micro, &acts)) != 0) {
    rc = sp_diag_set(d, rc, "sp_mlp_reference_run: activations");
    goto out;
  }
  target = alloc_floats(micro, mlp->out_dim, &rc);
  if (target == NULL) {
    rc = sp_diag_set(d, rc, "sp_mlp_reference_run: targets");
    goto out;
  }

  sp_mlp_io io = {
      .param = ref_param,
      .grad = ref_grad,
      .param_dtype = ref_param_dtype,
      .buffer = ref_buffer,
      .buffer_dtype = ref_buffer_dtype,
      .all_reduce_sum = NULL,
      .user = &c,
  };
  sp_dtype out_dt = sp_mlp_out_dtype(mlp, &io);

  for (uint32_t step = 0; step < cfg->steps; step++) {
    memset(c.g, 0, elems * sizeof *c.g);
    if (losses)
      losses[step] = 0;
    for (uint32_t j = 0; j < k; j++) {
      for (size_t p = 0; p < np; p++) {
        rc = sp_cast(c.view + c.view_off[p], c.pdt[p],
                     c.master + c.master_off[p], m->params[p].dtype,
                     (size_t)m->params[p].numel);
        if (rc != 0) {
          rc = sp_diag_set(d, rc, "%s: cast to param dtype failed",
                           m->params[p].fqn);
          goto out;
        }
      }
      /* without sync the view gradients add up over the micro-batches
       * and are reduced once, at the last */
      bool sync = !cfg->no_sync || j + 1 == k;
      if (!cfg->no_sync || j == 0)
        memset(c.grad, 0, view_bytes);
      sp_mlp_batch(mlp, step, (uint64_t)j * micro, micro, acts->x[0], target);
      for (size_t l = 0; l < mlp->n_layers; l++)
        if ((rc = sp_mlp_forward(mlp, l, &io, acts, micro, d)) != 0)
          goto out;
      /* each micro-batch's loss scaled by 1/k: the mean over the step */
      double loss = sp_mlp_loss_over(mlp, acts, target, out_dt,
                                     (uint64_t)micro * k);
      if (losses)
        losses[step] += loss;
      for (size_t l = mlp->n_layers; l-- > 0;)
        if ((rc = sp_mlp_backward(mlp, l, &io, acts, d)) != 0)
          goto out;
      sp_mlp_count_step(mlp, &io);
      for (size_t p = 0; sync && p < np; p++)
        if (m->params[p].flag &&
            (rc = ref_reduce(&c, (int32_t)p, tmp_a, tmp_b, d)) != 0)
          goto out;
    }
    if (cfg->clip_grad_norm > 0)
      ref_clip(&c, cfg->clip_grad_norm);
    ref_update(&c, &cfg->optim, step);
  }

  if (params) {
    *params = c.master;
    c.master = NULL;
  }
  if (buffers) {
    *buffers = c.bufs;
    c.bufs = NULL;
  }
out:
  free(c.master);
  free(c.view);
  free(c.grad);
  free(c.bufs);
  free(c.master_off);
  free(c.view_off);
  free(c.buf_off);
  free(c.elem_off);
  free(c.pdt);
  free(c.gdt);
  free(c.rdt);
  free(c.decays);
  free(c.bdt);
  free(c.g);
  free(c.m1);
  free(c.m2);
  free(tmp_a);
  free(tmp_b);
  free(target);
  sp_mlp_acts_free(acts);
  sp_plan_free(plan);
  sp_mlp_free(mlp);
  return rc;
}
