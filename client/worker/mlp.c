/* The reference MLP of shardplane-worker (mlp.h): synthetic data,
 * initialisation and CPU forward/backward (its spec reader is
 * mlp_spec.c). The unsharded trainer the
 * tests compare against is tests/support/mlp_reference.c.
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

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"
#include "cast/cast_scalar.h"

/* ------------------------------------------------------------------ */
/* element helpers (conversions: cast_scalar.h)                       */
/* ------------------------------------------------------------------ */

/* float32 value rounded to a floating dtype and widened back. float32 and
 * float64 hold every float32 value, so only the 16-bit formats round. */
static float round_f32(float v, sp_dtype dt) {
  switch (dt) {
    case SP_BFLOAT16: return sp_f32_round_bf16(v);
    case SP_FLOAT16: return sp_f32_round_f16(v);
    default: return v;
  }
}

static void round_array(float *v, size_t n, sp_dtype dt) {
  if (dt != SP_BFLOAT16 && dt != SP_FLOAT16) return;
  for (size_t i = 0; i < n; i++) v[i] = round_f32(v[i], dt);
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
    default: return 0.0f;
  }
}

static void store_f32(void *p, sp_dtype dt, size_t i, float v) {
  sp_elem_store_f64(p, dt, i,
                    sp_f64_from_bits(sp_f32_to_f64_bits(sp_f32_to_bits(v))));
}

/* Adds 1 to an integer scalar of any width: a carry through its
 * little-endian bytes (the host is little-endian, as safetensors.h checks),
 * which wraps like unsigned arithmetic, so a counter past its range is
 * defined. */
static void int_increment(void *p, sp_dtype dt) {
  if (!sp_dtype_is_integer(dt)) return;
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
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001B3ull;
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
/* data and initialisation                                             */
/* ------------------------------------------------------------------ */

void sp_mlp_batch(const sp_mlp *mlp, uint64_t step, uint64_t first, size_t n,
                  float *x, float *t) {
  if (mlp == NULL) return;
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
    if (t == NULL) continue;
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
  float *f = sp_mlp_floats((size_t)t->numel, 1, &rc);
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
  if (io->grad == NULL) return 0;
  void *dst = io->grad(io->user, p);
  if (dst == NULL) return 0;
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
  while (a->x != NULL && a->x[nx] != NULL && nx <= mlp->n_layers) nx++;
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
  if (rc == 0 && L->bias >= 0) rc = read_param(mlp, io, L->bias, &b, &bd, d);
  if (rc == 0) {
    float *x = a->x[l], *y = a->x[l + 1];
    /* the GEMM consumes its input in the compute dtype */
    round_array(x, n * in, pd);
    for (size_t s = 0; s < n; s++)
      for (size_t j = 0; j < out; j++) {
        const float *xs = x + s * in, *wj = w + j * in;
        float acc = 0.0f;
        for (size_t i = 0; i < in; i++) acc += xs[i] * wj[i];
        if (b) acc += b[j];
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
    gw = sp_mlp_floats(out, L->in, &rc);
    if (gw != NULL) gb = sp_mlp_floats(out, 1, &rc);
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
        for (size_t i = 0; i < in; i++) gwj[i] += g * xs[i];
        gb[j] += g;
      }
    rc = write_grad(mlp, io, L->weight, gw, d);
    if (rc == 0 && L->bias >= 0) rc = write_grad(mlp, io, L->bias, gb, d);
  }
  if (rc == 0 && l > 0) {
    const float *dy = a->dy;
    float *dx = a->dx;
    for (size_t s = 0; s < n; s++)
      for (size_t i = 0; i < in; i++) {
        float acc = 0.0f;
        for (size_t j = 0; j < out; j++) acc += dy[s * out + j] * w[j * in + i];
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
  if (rc == 0) rc = read_param(mlp, io, L->bias, &b, &bd, d);
  if (rc == 0) rc = buffer_view(mlp, io, L->running_mean, &rm, &rd, d);
  if (rc == 0 && (sum = sp_mlp_floats(h, 1, &rc)) == NULL)
    sp_diag_set(d, rc, "%s: scratch", mlp->model->modules[L->module].fqn);
  if (rc != 0) goto out;

  float *x = a->x[l], *y = a->x[l + 1];
  round_array(x, n * h, pd);
  for (size_t s = 0; s < n; s++)
    for (size_t k = 0; k < h; k++) sum[k] += x[s * h + k];
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
    if ((rc = buffer_view(mlp, io, L->seen, &p, &dt, d)) != 0) goto out;
    *(unsigned char *)p = 1;
  }
  /* the stored (rounded) running mean is what the output uses */
  for (size_t k = 0; k < h; k++) sum[k] = load_f32(rm, rd, k);
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
  if (rc == 0) rc = buffer_view(mlp, io, L->running_mean, &rm, &rd, d);
  if (rc == 0) {
    if ((gw = sp_mlp_floats(h, 1, &rc)) == NULL ||
        (gb = sp_mlp_floats(h, 1, &rc)) == NULL ||
        (mean = sp_mlp_floats(h, 1, &rc)) == NULL)
      sp_diag_set(d, rc, "%s: scratch", mlp->model->modules[L->module].fqn);
  }
  if (rc != 0) goto out;
  for (size_t k = 0; k < h; k++) mean[k] = load_f32(rm, rd, k);
  const float *x = a->x[l], *dy = a->dy;
  for (size_t s = 0; s < n; s++)
    for (size_t k = 0; k < h; k++) {
      float g = dy[s * h + k];
      float c = x[s * h + k] - mean[k];
      gw[k] += g * c;
      gb[k] += g;
    }
  rc = write_grad(mlp, io, L->weight, gw, d);
  if (rc == 0) rc = write_grad(mlp, io, L->bias, gb, d);
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
  if (rc != 0) return rc;
  const sp_mlp_layer *L = &mlp->layers[l];
  switch (L->kind) {
    case SP_MLP_LINEAR: return linear_forward(mlp, L, io, a, l, d);
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
  if (rc != 0) return rc;
  const sp_mlp_layer *L = &mlp->layers[l];
  switch (L->kind) {
    case SP_MLP_LINEAR: rc = linear_backward(mlp, L, io, a, l, d); break;
    case SP_MLP_NORM: rc = norm_backward(mlp, L, io, a, l, d); break;
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
  if (p != NULL) int_increment(p, dt);
}
