/* The reference MLP on a GPU (mlp_cuda.h), each kernel beside the CPU code
 * of client/worker/mlp.c it reproduces. Written in the C subset of CUDA
 * C++, like common/cast/cast_cuda.cu.
 *
 * Float arithmetic in kernels uses __fadd_rn / __fsub_rn / __fmul_rn /
 * __fdiv_rn (and their double forms): nvcc contracts a * b + c into an FMA
 * by default, the ISO C build of mlp.c never does, and the intrinsics are
 * never contracted. Rounding to a dtype and loading from one go through
 * common/cast/cast_scalar.h, as sp_cast does. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast_cuda.h"
#include "cast/cast_scalar.h"
#include "cublas_check.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_grid.h"
#include "mlp_cuda.h"

/* ------------------------------------------------------------------ */
/* device helpers: mlp.c's round_f32, load_f32, store_f32              */
/* ------------------------------------------------------------------ */

static __device__ float round_dt(float v, int dt) {
  switch (dt) {
    case SP_BFLOAT16: return sp_f32_round_bf16(v);
    case SP_FLOAT16: return sp_f32_round_f16(v);
    default: return v;
  }
}

static __device__ float load_dt(const void *p, int dt, size_t i) {
  switch (dt) {
    case SP_FLOAT32: return ((const float *)p)[i];
    case SP_FLOAT64:
      return sp_f32_from_bits(
          sp_f64_to_f32_bits(sp_f64_to_bits(((const double *)p)[i])));
    case SP_BFLOAT16:
      return sp_f32_from_bits(sp_bf16_to_f32_bits(((const uint16_t *)p)[i]));
    case SP_FLOAT16:
      return sp_f32_from_bits(sp_f16_to_f32_bits(((const uint16_t *)p)[i]));
    default: return 0.0f;
  }
}

/* v rounded once (RNE) to dt; float32 values widen exactly first, as
 * mlp.c's store_f32 does */
static __device__ void store_dt(void *p, int dt, size_t i, float v) {
  uint64_t u = sp_f32_to_f64_bits(sp_f32_to_bits(v));
  switch (dt) {
    case SP_FLOAT32: ((uint32_t *)p)[i] = sp_f64_to_f32_bits(u); break;
    case SP_FLOAT64: ((double *)p)[i] = sp_f64_from_bits(u); break;
    case SP_BFLOAT16: ((uint16_t *)p)[i] = sp_f64_to_bf16_bits(u); break;
    case SP_FLOAT16: ((uint16_t *)p)[i] = sp_f64_to_f16_bits(u); break;
    default: break;
  }
}

/* ------------------------------------------------------------------ */
/* kernels                                                             */
/* ------------------------------------------------------------------ */

/* k_mlp_*: the MLP's kernels, each launched by the sp_mlp_cuda_* code
 * below (launch geometry: cuda/cuda_grid.h). */

/* mlp.c round_array: the GEMM consumes its input in the compute dtype */
__global__ void k_mlp_round(float *x, size_t n, int dt) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    x[i] = round_dt(x[i], dt);
}

/* linear_forward's epilogue: acc (+ b[j]) rounded to pd */
__global__ void k_mlp_bias_round(float *y, const float *acc, const void *b,
                                 int bdt, size_t n, size_t out, int pd) {
  size_t count = n * out;
  for (size_t i = SP_GRID_TID(); i < count; i += SP_GRID_STRIDE()) {
    float a = acc[i];
    if (b) a = __fadd_rn(a, load_dt(b, bdt, i % out));
    y[i] = round_dt(a, pd);
  }
}

/* Column sums of an n x h row-major array in sample order from +0.0f, one
 * thread per column: the CPU's loop `sum[k] += x[s * h + k]` exactly
 * (norm_forward's batch sum, linear_backward's bias gradient). */
__global__ void k_mlp_colsum(const float *x, size_t n, size_t h, float *sum) {
  for (size_t k = SP_GRID_TID(); k < h; k += SP_GRID_STRIDE()) {
    float acc = 0.0f;
    for (size_t s = 0; s < n; s++) acc = __fadd_rn(acc, x[s * h + k]);
    sum[k] = acc;
  }
}

/* norm_forward after the all-reduce: running_mean <- 0.9 rm + 0.1 mean in
 * float32, stored in rm's dtype; mean_out gets the stored (rounded) value,
 * which is what the output uses. */
__global__ void k_mlp_norm_update(void *rm, int rd, const float *sum, size_t h,
                                  float gn, float *mean_out) {
  for (size_t k = SP_GRID_TID(); k < h; k += SP_GRID_STRIDE()) {
    float mean = __fdiv_rn(sum[k], gn);
    float old = load_dt(rm, rd, k);
    store_dt(rm, rd, k, __fadd_rn(__fmul_rn(0.9f, old), __fmul_rn(0.1f, mean)));
    mean_out[k] = load_dt(rm, rd, k);
  }
}

/* mlp.c int_increment (wrapping, any integer width) and `seen = true` */
__global__ void k_mlp_counters(void *nbt, int nbt_dt, unsigned char *seen) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  if (nbt) {
    switch (nbt_dt) {
      case SP_INT64: ((unsigned long long *)nbt)[0] += 1ull; break;
      case SP_INT32: ((uint32_t *)nbt)[0] += 1u; break;
      case SP_INT16:
        ((uint16_t *)nbt)[0] = (uint16_t)(((uint16_t *)nbt)[0] + 1u);
        break;
      case SP_INT8:
      case SP_UINT8:
        ((uint8_t *)nbt)[0] = (uint8_t)(((uint8_t *)nbt)[0] + 1u);
        break;
      default: break;
    }
  }
  if (seen) seen[0] = 1;
}

/* y = (x - mean) * w + b, rounded to pd */
__global__ void k_mlp_norm_out(const float *x, const float *mean, const void *w,
                               const void *b, int pd, size_t n, size_t h,
                               float *y) {
  size_t count = n * h;
  for (size_t i = SP_GRID_TID(); i < count; i += SP_GRID_STRIDE()) {
    size_t k = i % h;
    float c = __fsub_rn(x[i], mean[k]);
    y[i] = round_dt(
        __fadd_rn(__fmul_rn(c, load_dt(w, pd, k)), load_dt(b, pd, k)), pd);
  }
}

/* norm_backward's parameter gradients, per column in sample order:
 * gw += dy * (x - mean), gb += dy */
__global__ void k_mlp_norm_grads(const float *x, const float *dy,
                                 const float *mean, size_t n, size_t h,
                                 float *gw, float *gb) {
  for (size_t k = SP_GRID_TID(); k < h; k += SP_GRID_STRIDE()) {
    float aw = 0.0f, ab = 0.0f;
    for (size_t s = 0; s < n; s++) {
      float g = dy[s * h + k];
      float c = __fsub_rn(x[s * h + k], mean[k]);
      aw = __fadd_rn(aw, __fmul_rn(g, c));
      ab = __fadd_rn(ab, g);
    }
    gw[k] = aw;
    gb[k] = ab;
  }
}

/* norm_backward's input gradient: dy * w rounded to pd */
__global__ void k_mlp_norm_dx(const float *dy, const void *w, int pd, size_t n,
                              size_t h, float *dx) {
  size_t count = n * h;
  for (size_t i = SP_GRID_TID(); i < count; i += SP_GRID_STRIDE())
    dx[i] = round_dt(__fmul_rn(dy[i], load_dt(w, pd, i % h)), pd);
}

/* torch.relu: NaN passes through */
__global__ void k_mlp_relu(const float *x, float *y, size_t n) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE()) {
    float v = x[i];
    y[i] = v > 0.0f ? v : (v != v ? v : 0.0f);
  }
}

__global__ void k_mlp_relu_back(const float *x, const float *dy, float *dx,
                                size_t n) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

/* sp_mlp_loss_over, per sample: r = y - t, the sample's sum of 0.5 r^2 in
 * double (in feature order), dy = r / fn rounded to the output dtype */
__global__ void k_mlp_loss_rows(const float *y, const float *t, size_t n,
                                size_t out, float fn, int out_dt, float *dy,
                                double *partial) {
  for (size_t s = SP_GRID_TID(); s < n; s += SP_GRID_STRIDE()) {
    double acc = 0.0;
    for (size_t j = 0; j < out; j++) {
      size_t i = s * out + j;
      float r = __fsub_rn(y[i], t[i]);
      acc = __dadd_rn(acc, __dmul_rn(__dmul_rn(0.5, (double)r), (double)r));
      dy[i] = round_dt(__fdiv_rn(r, fn), out_dt);
    }
    partial[s] = acc;
  }
}

/* the sample sums in sample order, divided by denom (n, or n * k for a
 * micro-batch of k), set or added to loss[0]: one thread, so the result
 * does not depend on the launch */
__global__ void k_mlp_loss_total(const double *partial, size_t n, double denom,
                                 int add, double *loss) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double acc = 0.0;
  for (size_t s = 0; s < n; s++) acc = __dadd_rn(acc, partial[s]);
  double v = n ? __ddiv_rn(acc, denom) : 0.0;
  loss[0] = add ? __dadd_rn(loss[0], v) : v;
}

/* mlp.c write_grad: dst = rne_pd(dst + g), the sum in double */
__global__ void k_mlp_grad_add(void *dst, int pd, const float *g, size_t n) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    sp_elem_store_f64(dst, pd, i,
                      __dadd_rn(sp_elem_load_f64(dst, pd, i), (double)g[i]));
}

/* a buffer (any floating dtype) as float32 */
__global__ void k_mlp_load(const void *p, int dt, size_t n, float *out) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    out[i] = load_dt(p, dt, i);
}

/* ------------------------------------------------------------------ */
/* the object                                                          */
/* ------------------------------------------------------------------ */

struct sp_mlp_cuda {
  const sp_mlp *mlp;
  size_t n;
  cudaStream_t st;
  cublasHandle_t blas;
  float **x;            /* n_layers + 1 device arrays */
  float *dx, *dy;       /* n * max_dim */
  sp_dtype dy_dt;       /* the dtype dy's values are rounded to */
  float *t;             /* n * out_dim */
  float *acc;           /* GEMM outputs: max(n * max_dim, max weight) */
  float *vec_a, *vec_b; /* max_dim: sums, means, norm gradients */
  void *wop;            /* weight operand: max weight elements, 4 bytes each */
  void *aop, *bop;      /* activation operands: n * max_dim, 4 bytes each */
  double *loss;         /* [0] the loss, [1 .. n] per-sample sums */
  size_t act_numel, w_numel;
};

static int fail(sp_diag *d, int rc, const sp_mlp *mlp, size_t l,
                const char *what) {
  const char *fqn = mlp && l < mlp->n_layers
                        ? mlp->model->modules[mlp->layers[l].module].fqn
                        : "mlp";
  return sp_diag_prefix(d, rc, "%s: %s", fqn, what);
}

static int dmalloc(void **p, size_t count, size_t esize, sp_diag *d) {
  *p = NULL;
  if (esize && count > SIZE_MAX / esize)
    return sp_diag_set(d, SP_ETOOBIG, "%zu elements of %zu bytes overflow",
                       count, esize);
  size_t bytes = count * esize;
  if (bytes == 0) bytes = 1;
  cudaError_t e = cudaMalloc(p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    *p = NULL;
    return sp_diag_set(d, SP_ENOMEM,
                       "cudaMalloc of %zu bytes: out of device "
                       "memory",
                       bytes);
  }
  SP_CUDA_CHECK(d, e);
  return 0;
}

void sp_mlp_cuda_free(sp_mlp_cuda *g) {
  if (!g) return;
  /* kernels of the last step may still use the memory */
  (void)cudaStreamSynchronize(g->st);
  if (g->blas) (void)cublasDestroy(g->blas);
  if (g->x)
    for (size_t l = 0; l <= g->mlp->n_layers; l++) (void)cudaFree(g->x[l]);
  free(g->x);
  (void)cudaFree(g->dx);
  (void)cudaFree(g->dy);
  (void)cudaFree(g->t);
  (void)cudaFree(g->acc);
  (void)cudaFree(g->vec_a);
  (void)cudaFree(g->vec_b);
  (void)cudaFree(g->wop);
  (void)cudaFree(g->aop);
  (void)cudaFree(g->bop);
  (void)cudaFree(g->loss);
  free(g);
}

static int cuda_new(sp_mlp_cuda *g, sp_diag *d) {
  const sp_mlp *mlp = g->mlp;
  size_t n = g->n, maxd = (size_t)mlp->max_dim;
  /* cuBLAS takes int dimensions and leading dimensions */
  if (n > INT_MAX || maxd > INT_MAX || (maxd && n > SIZE_MAX / maxd))
    return sp_diag_set(d, SP_ETOOBIG,
                       "batch %zu x width %zu too large for "
                       "cuBLAS",
                       n, maxd);
  g->act_numel = n * maxd;
  g->w_numel = 1;
  for (size_t l = 0; l < mlp->n_layers; l++) {
    const sp_mlp_layer *L = &mlp->layers[l];
    if (L->kind != SP_MLP_LINEAR) continue;
    size_t w = (size_t)L->out * (size_t)L->in;
    if (w > g->w_numel) g->w_numel = w;
  }
  size_t acc = g->act_numel > g->w_numel ? g->act_numel : g->w_numel;
  g->x = (float **)calloc(mlp->n_layers + 1, sizeof *g->x);
  if (!g->x) return sp_diag_set(d, SP_ENOMEM, "no memory");
  int rc = 0;
  for (size_t l = 0; rc == 0 && l <= mlp->n_layers; l++) {
    size_t dim = (size_t)(l == 0 ? mlp->in_dim : mlp->layers[l - 1].out);
    rc = dmalloc((void **)&g->x[l], n, dim * sizeof(float), d);
  }
  if (rc == 0) rc = dmalloc((void **)&g->dx, g->act_numel, sizeof(float), d);
  if (rc == 0) rc = dmalloc((void **)&g->dy, g->act_numel, sizeof(float), d);
  if (rc == 0)
    rc = dmalloc((void **)&g->t, n, (size_t)mlp->out_dim * sizeof(float), d);
  if (rc == 0) rc = dmalloc((void **)&g->acc, acc, sizeof(float), d);
  if (rc == 0) rc = dmalloc((void **)&g->vec_a, maxd, sizeof(float), d);
  if (rc == 0) rc = dmalloc((void **)&g->vec_b, maxd, sizeof(float), d);
  if (rc == 0) rc = dmalloc(&g->wop, g->w_numel, 4, d);
  if (rc == 0) rc = dmalloc(&g->aop, g->act_numel, 4, d);
  if (rc == 0) rc = dmalloc(&g->bop, g->act_numel, 4, d);
  if (rc == 0 && n > SIZE_MAX - 1)
    rc = sp_diag_set(d, SP_ETOOBIG, "batch too large");
  if (rc == 0) rc = dmalloc((void **)&g->loss, n + 1, sizeof(double), d);
  if (rc < 0) return rc;
  SP_CUBLAS_CHECK(d, cublasCreate(&g->blas));
  SP_CUBLAS_CHECK(d, cublasSetStream(g->blas, g->st));
  /* CUBLAS_COMPUTE_32F already excludes TF32; the default math mode also
   * keeps cuBLAS from choosing reduced-precision paths on its own */
  SP_CUBLAS_CHECK(d, cublasSetMathMode(g->blas, CUBLAS_DEFAULT_MATH));
  /* device memory starts undefined; targets and losses are read before a
   * first set_batch / loss only by mistake, but then as zeros */
  SP_CUDA_CHECK(d,
                cudaMemsetAsync(g->loss, 0, (n + 1) * sizeof(double), g->st));
  g->dy_dt = SP_FLOAT32;
  return 0;
}

extern "C" int sp_mlp_cuda_new(const sp_mlp *mlp, size_t n, void *stream,
                               sp_mlp_cuda **out, sp_diag *d) {
  if (!mlp || !out)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_new: NULL argument");
  *out = NULL;
  sp_mlp_cuda *g = (sp_mlp_cuda *)calloc(1, sizeof *g);
  if (!g) return sp_diag_set(d, SP_ENOMEM, "no memory");
  g->mlp = mlp;
  g->n = n;
  g->st = (cudaStream_t)stream;
  int rc = cuda_new(g, d);
  if (rc < 0) {
    sp_mlp_cuda_free(g);
    return sp_diag_prefix(d, rc, "sp_mlp_cuda_new (batch %zu)", n);
  }
  *out = g;
  return 0;
}

extern "C" int sp_mlp_cuda_set_batch(sp_mlp_cuda *g, const float *x,
                                     const float *t, sp_diag *d) {
  if (!g) return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_set_batch: NULL");
  const sp_mlp *mlp = g->mlp;
  if (x && g->n)
    SP_CUDA_CHECK(d, cudaMemcpyAsync(g->x[0], x, g->n * (size_t)mlp->in_dim * 4,
                                     cudaMemcpyHostToDevice, g->st));
  if (t && g->n)
    SP_CUDA_CHECK(d, cudaMemcpyAsync(g->t, t, g->n * (size_t)mlp->out_dim * 4,
                                     cudaMemcpyHostToDevice, g->st));
  /* the host arrays are reused for the next batch: wait for the copies */
  SP_CUDA_CHECK(d, cudaStreamSynchronize(g->st));
  return 0;
}

/* ---- io access, with mlp.c's checks ---- */

static int param_view(const sp_mlp_cuda *g, const sp_mlp_io *io, int32_t p,
                      const void **view, sp_dtype *dt, sp_diag *d) {
  const sp_tensor_spec *t = &g->mlp->model->params[p];
  *dt = io->param_dtype(io->user, p);
  if (!sp_dtype_is_floating(*dt))
    return sp_diag_set(d, SP_EINVAL, "%s: param dtype %s is not floating",
                       t->fqn, sp_dtype_name(*dt));
  *view = io->param(io->user, p);
  if (!*view)
    return sp_diag_set(d, SP_EINVAL, "%s: no parameter view (unit sharded?)",
                       t->fqn);
  return 0;
}

static int buffer_view(const sp_mlp_cuda *g, const sp_mlp_io *io, int32_t b,
                       void **p, sp_dtype *dt, sp_diag *d) {
  const sp_tensor_spec *t = &g->mlp->model->buffers[b];
  *p = io->buffer ? io->buffer(io->user, b) : NULL;
  *dt = io->buffer_dtype ? io->buffer_dtype(io->user, b) : t->dtype;
  if (!*p) return sp_diag_set(d, SP_EINVAL, "%s: no buffer storage", t->fqn);
  bool ok = sp_dtype_is_floating(t->dtype) ? sp_dtype_is_floating(*dt)
                                           : *dt == t->dtype;
  if (!ok)
    return sp_diag_set(d, SP_EINVAL, "%s: buffer dtype %s, original %s", t->fqn,
                       sp_dtype_name(*dt), sp_dtype_name(t->dtype));
  return 0;
}

/* A float32 gradient added to the param's gradient view, the sum rounded
 * to its dtype (mlp.c write_grad). A NULL view: the param takes no
 * gradient. */
static int write_grad(sp_mlp_cuda *g, const sp_mlp_io *io, int32_t p,
                      const float *src, sp_diag *d) {
  if (!io->grad) return 0;
  void *dst = io->grad(io->user, p);
  if (!dst) return 0;
  const sp_tensor_spec *t = &g->mlp->model->params[p];
  sp_dtype pd = io->param_dtype(io->user, p);
  size_t n = (size_t)t->numel;
  if (!sp_dtype_is_floating(pd) || (uintptr_t)dst % sp_dtype_size(pd) != 0)
    return sp_diag_set(d, SP_EINVAL,
                       "%s: gradient view %p of %s (floating, "
                       "element-aligned expected)",
                       t->fqn, dst, sp_dtype_name(pd));
  if (n == 0) return 0;
  k_mlp_grad_add<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, g->st>>>(dst, (int)pd,
                                                                   src, n);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}

static int check_call(const sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                      sp_diag *d) {
  if (!g || !io || !io->param || !io->param_dtype)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_mlp_cuda: NULL argument or "
                       "callback");
  if (l >= g->mlp->n_layers)
    return sp_diag_set(d, SP_ERANGE, "sp_mlp_cuda: layer %zu of %zu", l,
                       g->mlp->n_layers);
  return 0;
}

/* ---- GEMM plumbing ---- */

/* The dtype a GEMM reads for params of dtype pd: itself, except float64,
 * which the CPU reads as float32 (cuBLAS has no float64 input with float32
 * compute). */
static sp_dtype gemm_dtype(sp_dtype pd) {
  return pd == SP_FLOAT64 ? SP_FLOAT32 : pd;
}

/* Whether every value rounded to `have` is exact in `in`. Activations are
 * float32 arrays, so "float64" values are float32 values. */
static bool holds(sp_dtype in, sp_dtype have) {
  if (have == SP_FLOAT64) have = SP_FLOAT32;
  return in == have || in == SP_FLOAT32;
}

static cudaDataType_t cuda_type(sp_dtype dt) {
  return dt == SP_BFLOAT16  ? CUDA_R_16BF
         : dt == SP_FLOAT16 ? CUDA_R_16F
                            : CUDA_R_32F;
}

/* A float32 device array as a GEMM operand in dt: itself for float32, else
 * converted into scratch (exact: the caller checked that dt holds it). */
static int act_operand(sp_mlp_cuda *g, const float *x, size_t count,
                       sp_dtype dt, void *scratch, const void **out,
                       sp_diag *d) {
  if (dt == SP_FLOAT32) {
    *out = x;
    return 0;
  }
  int rc = sp_cuda_cast(scratch, dt, x, SP_FLOAT32, count, g->st);
  if (rc < 0)
    return sp_diag_set(d, rc,
                       "%s:%d: activation cast to %s failed (the CUDA "
                       "error is logged above)",
                       __FILE__, __LINE__, sp_dtype_name(dt));
  *out = scratch;
  return 0;
}

/* A weight view (dtype pd) as a GEMM operand in dt. */
static int weight_operand(sp_mlp_cuda *g, const void *view, sp_dtype pd,
                          size_t count, sp_dtype dt, const void **out,
                          sp_diag *d) {
  if (pd == dt) {
    *out = view;
    return 0;
  }
  int rc = sp_cuda_cast(g->wop, dt, view, pd, count, g->st);
  if (rc < 0)
    return sp_diag_set(d, rc,
                       "%s:%d: weight cast %s -> %s failed (the CUDA "
                       "error is logged above)",
                       __FILE__, __LINE__, sp_dtype_name(pd),
                       sp_dtype_name(dt));
  *out = g->wop;
  return 0;
}

/* C (m x n, column-major, ld m, float32) = op(A) op(B), k inner, A and B
 * both of dtype dt, accumulated in float32 (CUBLAS_COMPUTE_32F). */
static int gemm(sp_mlp_cuda *g, cublasOperation_t ta, cublasOperation_t tb,
                size_t m, size_t n, size_t k, const void *A, size_t lda,
                const void *B, size_t ldb, sp_dtype dt, float *C, sp_diag *d) {
  if (m == 0 || n == 0) return 0;
  if (k == 0) {
    /* an empty sum: cuBLAS may leave C alone */
    SP_CUDA_CHECK(d, cudaMemsetAsync(C, 0, m * n * sizeof(float), g->st));
    return 0;
  }
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX ||
      ldb > INT_MAX)
    return sp_diag_set(d, SP_ETOOBIG,
                       "GEMM %zu x %zu x %zu beyond cuBLAS's "
                       "int",
                       m, n, k);
  const float alpha = 1.0f, beta = 0.0f;
  cudaDataType_t ty = cuda_type(dt);
  SP_CUBLAS_CHECK(
      d, cublasGemmEx(g->blas, ta, tb, (int)m, (int)n, (int)k, &alpha, A, ty,
                      (int)lda, B, ty, (int)ldb, &beta, C, CUDA_R_32F, (int)m,
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return 0;
}

/* ---- layers ---- */

static int round_inplace(sp_mlp_cuda *g, float *x, size_t count, sp_dtype dt,
                         sp_diag *d) {
  if (count == 0 || (dt != SP_BFLOAT16 && dt != SP_FLOAT16)) return 0;
  k_mlp_round<<<sp_grid_blocks(count), SP_GRID_THREADS, 0, g->st>>>(x, count,
                                                                    (int)dt);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}

/* y[n, out] = round(x[n, in] W[out, in]^T + b, pd). Row-major arrays are
 * column-major transposes: y^T (out x n) = W x^T, i.e. op(A) = W as the
 * transpose of the column-major in x out matrix it is stored as. */
static int linear_forward(sp_mlp_cuda *g, const sp_mlp_layer *L,
                          const sp_mlp_io *io, size_t l, sp_diag *d) {
  size_t n = g->n, in = (size_t)L->in, out = (size_t)L->out;
  const void *w = NULL, *b = NULL;
  sp_dtype pd, bd = SP_FLOAT32;
  int rc = param_view(g, io, L->weight, &w, &pd, d);
  if (rc == 0 && L->bias >= 0) rc = param_view(g, io, L->bias, &b, &bd, d);
  if (rc < 0) return rc;
  float *x = g->x[l], *y = g->x[l + 1];
  sp_dtype gt = gemm_dtype(pd);
  const void *A = NULL, *B = NULL;
  rc = round_inplace(g, x, n * in, pd, d);
  if (rc == 0) rc = weight_operand(g, w, pd, out * in, gt, &A, d);
  if (rc == 0) rc = act_operand(g, x, n * in, gt, g->aop, &B, d);
  if (rc == 0)
    rc = gemm(g, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, A, in, B, in, gt, g->acc,
              d);
  if (rc < 0) return rc;
  if (n * out != 0) {
    k_mlp_bias_round<<<sp_grid_blocks(n * out), SP_GRID_THREADS, 0, g->st>>>(
        y, g->acc, b, (int)bd, n, out, (int)pd);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  return 0;
}

static int linear_backward(sp_mlp_cuda *g, const sp_mlp_layer *L,
                           const sp_mlp_io *io, size_t l, sp_diag *d) {
  size_t n = g->n, in = (size_t)L->in, out = (size_t)L->out;
  const void *w = NULL;
  sp_dtype pd;
  int rc = param_view(g, io, L->weight, &w, &pd, d);
  if (rc < 0) return rc;
  const float *x = g->x[l];
  /* x[l] holds values of pd (rounded by the forward); dy those of dy_dt.
   * A GEMM in pd adds no rounding only if pd holds dy's values too. */
  sp_dtype gt = gemm_dtype(pd);
  if (!holds(gt, g->dy_dt)) gt = SP_FLOAT32;
  const void *X = NULL, *DY = NULL, *W = NULL;
  rc = act_operand(g, x, n * in, gt, g->aop, &X, d);
  if (rc == 0) rc = act_operand(g, g->dy, n * out, gt, g->bop, &DY, d);
  /* dW[out, in] = dy^T x: column-major dW^T (in x out) = x^T dy, with
   * x^T stored as in x n (ld in) and dy^T as out x n (ld out) */
  if (rc == 0)
    rc = gemm(g, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, X, in, DY, out, gt,
              g->acc, d);
  if (rc == 0) rc = write_grad(g, io, L->weight, g->acc, d);
  if (rc == 0 && L->bias >= 0) {
    if (out) {
      k_mlp_colsum<<<sp_grid_blocks(out), SP_GRID_THREADS, 0, g->st>>>(
          g->dy, n, out, g->vec_a);
      SP_CUDA_CHECK(d, cudaGetLastError());
    }
    rc = write_grad(g, io, L->bias, g->vec_a, d);
  }
  if (rc < 0 || l == 0) return rc;
  /* dx[n, in] = dy W: column-major dx^T (in x n) = W^T dy^T, with W^T
   * stored as in x out (ld in); rounded to pd */
  rc = weight_operand(g, w, pd, out * in, gt, &W, d);
  if (rc == 0)
    rc = gemm(g, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, W, in, DY, out, gt,
              g->acc, d);
  if (rc < 0) return rc;
  if (n * in != 0) {
    k_mlp_bias_round<<<sp_grid_blocks(n * in), SP_GRID_THREADS, 0, g->st>>>(
        g->dx, g->acc, NULL, (int)SP_FLOAT32, n, in, (int)pd);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  return 0;
}

static int norm_forward(sp_mlp_cuda *g, const sp_mlp_layer *L,
                        const sp_mlp_io *io, size_t l, uint64_t global_n,
                        sp_diag *d) {
  size_t n = g->n, h = (size_t)L->in;
  const void *w = NULL, *b = NULL;
  void *rm = NULL;
  sp_dtype pd, bd, rd;
  int rc = param_view(g, io, L->weight, &w, &pd, d);
  if (rc == 0) rc = param_view(g, io, L->bias, &b, &bd, d);
  if (rc == 0) rc = buffer_view(g, io, L->running_mean, &rm, &rd, d);
  if (rc < 0) return rc;
  if (bd != pd)
    return sp_diag_set(d, SP_EINVAL, "weight %s and bias %s dtypes differ",
                       sp_dtype_name(pd), sp_dtype_name(bd));
  float *x = g->x[l], *y = g->x[l + 1];
  rc = round_inplace(g, x, n * h, pd, d);
  if (rc < 0) return rc;
  if (h) {
    k_mlp_colsum<<<sp_grid_blocks(h), SP_GRID_THREADS, 0, g->st>>>(x, n, h,
                                                                   g->vec_a);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  /* every rank calls the collective, also one whose local batch is empty;
   * the sums were enqueued on the stream the runtime orders against */
  if (io->all_reduce_sum) {
    rc = io->all_reduce_sum(io->user, g->vec_a, h, d);
    if (rc < 0) return sp_diag_prefix(d, rc, "all-reduce of the batch sum");
  }
  if (h) {
    k_mlp_norm_update<<<sp_grid_blocks(h), SP_GRID_THREADS, 0, g->st>>>(
        rm, (int)rd, g->vec_a, h, (float)global_n, g->vec_b);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  void *nbt = NULL, *seen = NULL;
  sp_dtype nbt_dt = SP_INT64, seen_dt = SP_BOOL;
  if (L->num_batches_tracked >= 0)
    rc = buffer_view(g, io, L->num_batches_tracked, &nbt, &nbt_dt, d);
  if (rc == 0 && L->seen >= 0)
    rc = buffer_view(g, io, L->seen, &seen, &seen_dt, d);
  if (rc < 0) return rc;
  if (nbt || seen) {
    k_mlp_counters<<<1, 1, 0, g->st>>>(nbt, (int)nbt_dt, (unsigned char *)seen);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  if (n * h != 0) {
    k_mlp_norm_out<<<sp_grid_blocks(n * h), SP_GRID_THREADS, 0, g->st>>>(
        x, g->vec_b, w, b, (int)pd, n, h, y);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  return 0;
}

static int norm_backward(sp_mlp_cuda *g, const sp_mlp_layer *L,
                         const sp_mlp_io *io, size_t l, sp_diag *d) {
  size_t n = g->n, h = (size_t)L->in;
  const void *w = NULL;
  void *rm = NULL;
  sp_dtype pd, rd;
  int rc = param_view(g, io, L->weight, &w, &pd, d);
  if (rc == 0) rc = buffer_view(g, io, L->running_mean, &rm, &rd, d);
  if (rc < 0) return rc;
  if (h) {
    /* the stored running mean as float32: the constant the forward used */
    k_mlp_load<<<sp_grid_blocks(h), SP_GRID_THREADS, 0, g->st>>>(rm, (int)rd, h,
                                                                 g->vec_b);
    SP_CUDA_CHECK(d, cudaGetLastError());
    k_mlp_norm_grads<<<sp_grid_blocks(h), SP_GRID_THREADS, 0, g->st>>>(
        g->x[l], g->dy, g->vec_b, n, h, g->vec_a, g->acc);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  rc = write_grad(g, io, L->weight, g->vec_a, d);
  if (rc == 0) rc = write_grad(g, io, L->bias, g->acc, d);
  if (rc < 0 || l == 0) return rc;
  if (n * h != 0) {
    k_mlp_norm_dx<<<sp_grid_blocks(n * h), SP_GRID_THREADS, 0, g->st>>>(
        g->dy, w, (int)pd, n, h, g->dx);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  return 0;
}

extern "C" int sp_mlp_cuda_forward(sp_mlp_cuda *g, size_t l,
                                   const sp_mlp_io *io, uint64_t global_n,
                                   sp_diag *d) {
  int rc = check_call(g, l, io, d);
  if (rc < 0) return rc;
  const sp_mlp_layer *L = &g->mlp->layers[l];
  switch (L->kind) {
    case SP_MLP_LINEAR: rc = linear_forward(g, L, io, l, d); break;
    case SP_MLP_NORM:
      /* the mean divides by global_n in float32: exact up to 2^24 */
      if (global_n == 0 || global_n < g->n || global_n > (UINT64_C(1) << 24))
        return sp_diag_set(d, SP_EINVAL,
                           "%s: global batch %llu (local %zu) out of range",
                           g->mlp->model->modules[L->module].fqn,
                           (unsigned long long)global_n, g->n);
      rc = norm_forward(g, L, io, l, global_n, d);
      break;
    case SP_MLP_RELU: {
      size_t count = g->n * (size_t)L->in;
      if (count) {
        k_mlp_relu<<<sp_grid_blocks(count), SP_GRID_THREADS, 0, g->st>>>(
            g->x[l], g->x[l + 1], count);
        SP_CUDA_CHECK(d, cudaGetLastError());
      }
      break;
    }
    default:
      return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_forward: bad layer kind");
  }
  return rc < 0 ? fail(d, rc, g->mlp, l, "forward") : 0;
}

extern "C" int sp_mlp_cuda_loss(sp_mlp_cuda *g, sp_dtype out_dtype,
                                sp_diag *d) {
  if (!g) return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_loss: NULL");
  return sp_mlp_cuda_loss_over(g, out_dtype, g->n, false, d);
}

extern "C" int sp_mlp_cuda_loss_over(sp_mlp_cuda *g, sp_dtype out_dtype,
                                     uint64_t denom, bool add, sp_diag *d) {
  if (!g || denom == 0)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_mlp_cuda_loss_over: NULL or a zero "
                       "denominator");
  size_t n = g->n, out = (size_t)g->mlp->out_dim;
  if (n) {
    k_mlp_loss_rows<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, g->st>>>(
        g->x[g->mlp->n_layers], g->t, n, out, (float)denom, (int)out_dtype,
        g->dy, g->loss + 1);
    SP_CUDA_CHECK(d, cudaGetLastError());
  }
  k_mlp_loss_total<<<1, 1, 0, g->st>>>(g->loss + 1, n, (double)denom,
                                       add ? 1 : 0, g->loss);
  SP_CUDA_CHECK(d, cudaGetLastError());
  g->dy_dt = out_dtype;
  return 0;
}

extern "C" int sp_mlp_cuda_backward(sp_mlp_cuda *g, size_t l,
                                    const sp_mlp_io *io, sp_diag *d) {
  int rc = check_call(g, l, io, d);
  if (rc < 0) return rc;
  const sp_mlp_layer *L = &g->mlp->layers[l];
  sp_dtype next_dt = g->dy_dt;
  switch (L->kind) {
    case SP_MLP_LINEAR:
      rc = linear_backward(g, L, io, l, d);
      if (rc == 0) next_dt = io->param_dtype(io->user, L->weight);
      break;
    case SP_MLP_NORM:
      rc = norm_backward(g, L, io, l, d);
      if (rc == 0) next_dt = io->param_dtype(io->user, L->weight);
      break;
    case SP_MLP_RELU: {
      size_t count = g->n * (size_t)L->in;
      if (l > 0 && count) {
        k_mlp_relu_back<<<sp_grid_blocks(count), SP_GRID_THREADS, 0, g->st>>>(
            g->x[l], g->dy, g->dx, count);
        SP_CUDA_CHECK(d, cudaGetLastError());
      }
      break;
    }
    default:
      return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_backward: bad layer kind");
  }
  if (rc < 0) return fail(d, rc, g->mlp, l, "backward");
  if (l > 0) {
    float *tmp = g->dx;
    g->dx = g->dy;
    g->dy = tmp;
    g->dy_dt = next_dt;
  }
  return 0;
}

extern "C" int sp_mlp_cuda_count_step(sp_mlp_cuda *g, const sp_mlp_io *io,
                                      sp_diag *d) {
  if (!g || !io)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_count_step: NULL");
  if (g->mlp->step_buffer < 0 || !io->buffer) return 0;
  void *p = NULL;
  sp_dtype dt;
  int rc = buffer_view(g, io, g->mlp->step_buffer, &p, &dt, d);
  if (rc < 0) return rc;
  k_mlp_counters<<<1, 1, 0, g->st>>>(p, (int)dt, NULL);
  SP_CUDA_CHECK(d, cudaGetLastError());
  return 0;
}

extern "C" double *sp_mlp_cuda_loss_ptr(sp_mlp_cuda *g) {
  return g ? g->loss : NULL;
}

extern "C" int sp_mlp_cuda_read_loss(sp_mlp_cuda *g, double *loss, sp_diag *d) {
  if (!g || !loss)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_read_loss: NULL");
  SP_CUDA_CHECK(d, cudaMemcpyAsync(loss, g->loss, sizeof *loss,
                                   cudaMemcpyDeviceToHost, g->st));
  SP_CUDA_CHECK(d, cudaStreamSynchronize(g->st));
  return 0;
}

extern "C" int sp_mlp_cuda_read_act(sp_mlp_cuda *g, size_t l, float *host,
                                    sp_diag *d) {
  if (!g || !host || l > g->mlp->n_layers)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_read_act: bad argument");
  size_t dim = (size_t)(l == 0 ? g->mlp->in_dim : g->mlp->layers[l - 1].out);
  if (g->n * dim != 0)
    SP_CUDA_CHECK(d, cudaMemcpyAsync(host, g->x[l], g->n * dim * 4,
                                     cudaMemcpyDeviceToHost, g->st));
  SP_CUDA_CHECK(d, cudaStreamSynchronize(g->st));
  return 0;
}

extern "C" int sp_mlp_cuda_read_dy(sp_mlp_cuda *g, float *host, size_t count,
                                   sp_diag *d) {
  if (!g || (!host && count) || count > g->act_numel)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_read_dy: bad argument");
  if (count)
    SP_CUDA_CHECK(d, cudaMemcpyAsync(host, g->dy, count * 4,
                                     cudaMemcpyDeviceToHost, g->st));
  SP_CUDA_CHECK(d, cudaStreamSynchronize(g->st));
  return 0;
}

extern "C" int sp_mlp_cuda_write_act(sp_mlp_cuda *g, size_t l,
                                     const float *host, sp_diag *d) {
  if (!g || !host || l > g->mlp->n_layers)
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_write_act: bad argument");
  size_t dim = (size_t)(l == 0 ? g->mlp->in_dim : g->mlp->layers[l - 1].out);
  if (g->n * dim != 0)
    SP_CUDA_CHECK(d, cudaMemcpyAsync(g->x[l], host, g->n * dim * 4,
                                     cudaMemcpyHostToDevice, g->st));
  SP_CUDA_CHECK(d, cudaStreamSynchronize(g->st));
  return 0;
}

extern "C" int sp_mlp_cuda_write_dy(sp_mlp_cuda *g, const float *host,
                                    size_t count, sp_dtype dt, sp_diag *d) {
  if (!g || (!host && count) || count > g->act_numel ||
      !sp_dtype_is_floating(dt))
    return sp_diag_set(d, SP_EINVAL, "sp_mlp_cuda_write_dy: bad argument");
  if (count)
    SP_CUDA_CHECK(d, cudaMemcpyAsync(g->dy, host, count * 4,
                                     cudaMemcpyHostToDevice, g->st));
  SP_CUDA_CHECK(d, cudaStreamSynchronize(g->st));
  g->dy_dt = dt;
  return 0;
}
