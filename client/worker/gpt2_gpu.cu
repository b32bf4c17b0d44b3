/* The GPT-2 kernels on a GPU (gpt2_gpu.h), each beside the CPU function
 * of gpt2_cpu.c it reproduces, named in its comment: the host launchers
 * are sp_gpt2_gpu_X (the CPU's sp_gpt2_cpu_X), the __global__ kernels they
 * launch k_gpt2_Y. Written in the C subset of CUDA C++, like mlp_cuda.cu.
 * Compiled with --fmad=false (CMakeLists.txt): the shared element
 * definitions of gpt2_elem.h then round as the ISO C build does.
 *
 * Products are cuBLAS's: cblas_sgemm's row-major calls become column-major
 * ones on the transposes (row-major X is column-major X^T), so
 * C = op(A) op(B) is computed as C^T = op(B)^T op(A)^T, the operands
 * swapped and the op flags kept. Row reductions run one thread block of
 * ROW_THREADS a row, each thread summing a strided slice, then a tree in
 * shared memory; column sums run one thread a column over the rows in
 * index order, the CPU's order, so they give its bits. */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cast/cast_scalar.h"
#include "cublas_check.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_grid.h"
#include "gpt2_elem.h"
#include "gpt2_gpu.h"

/* a power of two (the tree halves it); 256 keeps a 768-wide LayerNorm row
 * at 3 elements a thread and a 1024-token softmax row at 4 */
#define ROW_THREADS 256

struct sp_gpt2_dev {
  cudaStream_t st;
  cublasHandle_t blas;
};

#define LAUNCHED(d) SP_CUDA_CHECK(d, cudaGetLastError())

extern "C" int sp_gpt2_gpu_new(void *stream, sp_gpt2_dev **out, sp_diag *d) {
  if (!out) return sp_diag_set(d, SP_EINVAL, "sp_gpt2_gpu_new: NULL");
  *out = NULL;
  sp_gpt2_dev *k = (sp_gpt2_dev *)calloc(1, sizeof *k);
  if (!k) return sp_diag_set(d, SP_ENOMEM, "no memory");
  k->st = (cudaStream_t)stream;
  int rc = 0;
  cublasStatus_t s = cublasCreate(&k->blas);
  if (s != CUBLAS_STATUS_SUCCESS) {
    k->blas = NULL;
    rc = sp_cublas_diag(d, (int)s, "cublasCreate", __FILE__, __LINE__);
  }
  if (rc == 0 && (s = cublasSetStream(k->blas, k->st)) != CUBLAS_STATUS_SUCCESS)
    rc = sp_cublas_diag(d, (int)s, "cublasSetStream", __FILE__, __LINE__);
  /* float32 products in float32: the default math mode never picks TF32 */
  if (rc == 0 && (s = cublasSetMathMode(k->blas, CUBLAS_DEFAULT_MATH)) !=
                     CUBLAS_STATUS_SUCCESS)
    rc = sp_cublas_diag(d, (int)s, "cublasSetMathMode", __FILE__, __LINE__);
  if (rc < 0) {
    sp_gpt2_gpu_free(k);
    return rc;
  }
  *out = k;
  return 0;
}

extern "C" void sp_gpt2_gpu_free(sp_gpt2_dev *k) {
  if (!k) return;
  (void)cudaStreamSynchronize(k->st);
  if (k->blas) (void)cublasDestroy(k->blas);
  free(k);
}

extern "C" void *sp_gpt2_gpu_stream(const sp_gpt2_dev *k) {
  return k ? (void *)k->st : NULL;
}

/* cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta,
 * C, ldc), `batch` times with the element strides sA, sB, sC. */
static int rm_gemm(sp_gpt2_dev *k, bool ta, bool tb, int M, int N, int K,
                   float alpha, const float *A, int lda, long long sA,
                   const float *B, int ldb, long long sB, float beta, float *C,
                   int ldc, long long sC, int batch, sp_diag *d) {
  if (M == 0 || N == 0 || batch == 0) return 0;
  cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch == 1)
    SP_CUBLAS_CHECK(d, cublasSgemm(k->blas, ob, oa, N, M, K, &alpha, B, ldb, A,
                                   lda, &beta, C, ldc));
  else
    SP_CUBLAS_CHECK(
        d, cublasSgemmStridedBatched(k->blas, ob, oa, N, M, K, &alpha, B, ldb,
                                     sB, A, lda, sA, &beta, C, ldc, sC, batch));
  return 0;
}

/* ---- block reductions (blockDim.x == ROW_THREADS) ---- */

#define SP_BLOCK_SUM(T, name)                                 \
  static __device__ T name(T v, T *sh) {                      \
    unsigned t = threadIdx.x;                                 \
    sh[t] = v;                                                \
    __syncthreads();                                          \
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {       \
      if (t < s) sh[t] = sh[t] + sh[t + s];                   \
      __syncthreads();                                        \
    }                                                         \
    T r = sh[0];                                              \
    __syncthreads(); /* sh is reused by the next reduction */ \
    return r;                                                 \
  }
SP_BLOCK_SUM(float, block_sum)
SP_BLOCK_SUM(double, block_sum_d)

/* the CPU's `if (r > mx) mx = r` over the row: the largest value */
static __device__ float block_max(float v, float *sh) {
  unsigned t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s && sh[t + s] > sh[t]) sh[t] = sh[t + s];
    __syncthreads();
  }
  float r = sh[0];
  __syncthreads();
  return r;
}

/* ------------------------------------------------------------------ */
/* products: sp_gpt2_cpu_{matmul,logits}_fwd / _bwd                   */
/* ------------------------------------------------------------------ */

/* matmul_fwd's `o[j] += b[j]` */
__global__ void k_gpt2_bias(float *out, const float *b, size_t n, int OC) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    out[i] = out[i] + b[i % (size_t)OC];
}

/* matmul_bwd's db: column sums of dout in row order, from db (acc) or 0 */
__global__ void k_gpt2_colsum(float *db, const float *dout, int N, int OC,
                              int acc) {
  for (size_t c = SP_GRID_TID(); c < (size_t)OC; c += SP_GRID_STRIDE()) {
    float a = acc ? db[c] : 0.0f;
#pragma unroll 8
    for (int i = 0; i < N; i++) a = a + dout[(size_t)i * OC + c];
    db[c] = a;
  }
}

extern "C" int sp_gpt2_gpu_matmul_fwd(sp_gpt2_dev *k, float *out,
                                      const float *inp, const float *w,
                                      const float *b, int N, int IC, int OC,
                                      sp_diag *d) {
  int rc = rm_gemm(k, false, false, N, OC, IC, 1.0f, inp, IC, 0, w, OC, 0, 0.0f,
                   out, OC, 0, 1, d);
  if (rc < 0 || b == NULL) return rc;
  size_t n = (size_t)N * (size_t)OC;
  k_gpt2_bias<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(out, b, n, OC);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_matmul_bwd(sp_gpt2_dev *k, float *dinp, float *dw,
                                      float *db, const float *dout,
                                      const float *inp, const float *w, int N,
                                      int IC, int OC, int acc, sp_diag *d) {
  int rc = 0;
  if (dinp)
    rc = rm_gemm(k, false, true, N, IC, OC, 1.0f, dout, OC, 0, w, OC, 0, 0.0f,
                 dinp, IC, 0, 1, d);
  if (rc == 0)
    rc = rm_gemm(k, true, false, IC, OC, N, 1.0f, inp, IC, 0, dout, OC, 0,
                 acc ? 1.0f : 0.0f, dw, OC, 0, 1, d);
  if (rc < 0 || db == NULL) return rc;
  k_gpt2_colsum<<<sp_grid_blocks((size_t)OC), SP_GRID_THREADS, 0, k->st>>>(
      db, dout, N, OC, acc);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_logits_fwd(sp_gpt2_dev *k, float *logits,
                                      const float *x, const float *wte, int N,
                                      int C, int V, sp_diag *d) {
  return rm_gemm(k, false, true, N, V, C, 1.0f, x, C, 0, wte, C, 0, 0.0f,
                 logits, V, 0, 1, d);
}

extern "C" int sp_gpt2_gpu_logits_bwd(sp_gpt2_dev *k, float *dx, float *dwte,
                                      const float *dlogits, const float *x,
                                      const float *wte, int N, int C, int V,
                                      int acc, sp_diag *d) {
  int rc = rm_gemm(k, false, false, N, C, V, 1.0f, dlogits, V, 0, wte, C, 0,
                   0.0f, dx, C, 0, 1, d);
  if (rc == 0 && dwte != NULL)
    rc = rm_gemm(k, true, false, V, C, N, 1.0f, dlogits, V, 0, x, C, 0,
                 acc ? 1.0f : 0.0f, dwte, C, 0, 1, d);
  return rc;
}

/* ------------------------------------------------------------------ */
/* sp_gpt2_cpu_layernorm_fwd / _bwd                                   */
/* ------------------------------------------------------------------ */

/* one block a row: mean, biased variance, output */
__global__ void k_gpt2_ln_fwd(float *out, float *mean, float *rstd,
                              const float *inp, const float *w, const float *b,
                              int C) {
  __shared__ float sh[ROW_THREADS];
  size_t row = blockIdx.x;
  const float *x = inp + row * (size_t)C;
  float acc = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) acc = acc + x[c];
  float m = block_sum(acc, sh) / (float)C;
  acc = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float dx = x[c] - m;
    acc = acc + dx * dx;
  }
  float v = block_sum(acc, sh) / (float)C;
  float s = sp_gpt2_elem_ln_rstd(v);
  float *o = out + row * (size_t)C;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    o[c] = sp_gpt2_elem_ln_out(x[c], m, s, w[c], b[c]);
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

/* one block a row: the means of g*w and g*w*xhat, then dinp += */
__global__ void k_gpt2_ln_bwd_dx(float *dinp, const float *dout,
                                 const float *inp, const float *w,
                                 const float *mean, const float *rstd, int C) {
  __shared__ float sh[ROW_THREADS];
  size_t row = blockIdx.x;
  const float *g = dout + row * (size_t)C, *x = inp + row * (size_t)C;
  float *dx = dinp + row * (size_t)C;
  float m = mean[row], s = rstd[row];
  float a = 0.0f, bn = 0.0f;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float xh = (x[c] - m) * s, gw = g[c] * w[c];
    a = a + gw;
    bn = bn + gw * xh;
  }
  float gm = block_sum(a, sh) / (float)C;
  float gnm = block_sum(bn, sh) / (float)C;
  for (int c = threadIdx.x; c < C; c += blockDim.x)
    dx[c] = dx[c] + sp_gpt2_elem_ln_dx(g[c], w[c], x[c], m, s, gm, gnm);
}

/* dw, db: one thread a column, rows in order (the CPU's bits) */
__global__ void k_gpt2_ln_bwd_params(float *dw, float *db, const float *dout,
                                     const float *inp, const float *mean,
                                     const float *rstd, int N, int C) {
  for (size_t c = SP_GRID_TID(); c < (size_t)C; c += SP_GRID_STRIDE()) {
    float aw = 0.0f, ab = 0.0f;
#pragma unroll 8
    for (int i = 0; i < N; i++) {
      size_t j = (size_t)i * C + c;
      float xh = (inp[j] - mean[i]) * rstd[i];
      ab = ab + dout[j];
      aw = aw + xh * dout[j];
    }
    dw[c] = aw;
    db[c] = ab;
  }
}

extern "C" int sp_gpt2_gpu_layernorm_fwd(sp_gpt2_dev *k, float *out,
                                         float *mean, float *rstd,
                                         const float *inp, const float *w,
                                         const float *b, int N, int C,
                                         sp_diag *d) {
  if (N == 0) return 0;
  k_gpt2_ln_fwd<<<(unsigned)N, ROW_THREADS, 0, k->st>>>(out, mean, rstd, inp, w,
                                                        b, C);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_layernorm_bwd(sp_gpt2_dev *k, float *dinp, float *dw,
                                         float *db, const float *dout,
                                         const float *inp, const float *w,
                                         const float *mean, const float *rstd,
                                         int N, int C, sp_diag *d) {
  if (N > 0) {
    k_gpt2_ln_bwd_dx<<<(unsigned)N, ROW_THREADS, 0, k->st>>>(dinp, dout, inp, w,
                                                             mean, rstd, C);
    LAUNCHED(d);
  }
  k_gpt2_ln_bwd_params<<<sp_grid_blocks((size_t)C), SP_GRID_THREADS, 0,
                         k->st>>>(dw, db, dout, inp, mean, rstd, N, C);
  LAUNCHED(d);
  return 0;
}

/* ------------------------------------------------------------------ */
/* sp_gpt2_cpu_attention_fwd / _bwd                                   */
/* ------------------------------------------------------------------ */

/* The causal softmax of one row t of a T x T score matrix per block (rows
 * of all sequences and heads: row index r, t = r mod T), in place:
 * probabilities where u <= t and allowed, 0 elsewhere. */
__global__ void k_gpt2_att_softmax(float *att, const uint8_t *allow, int T) {
  __shared__ float sh[ROW_THREADS];
  size_t row = blockIdx.x;
  int t = (int)(row % (size_t)T);
  float *r = att + row * (size_t)T;
  const uint8_t *al = allow ? allow + (size_t)t * T : NULL;
  float mx = -INFINITY;
  for (int u = threadIdx.x; u <= t; u += blockDim.x)
    if ((!al || al[u]) && r[u] > mx) mx = r[u];
  mx = block_max(mx, sh);
  float sum = 0.0f;
  for (int u = threadIdx.x; u < T; u += blockDim.x) {
    bool on = u <= t && (!al || al[u]);
    float e = on ? expf(r[u] - mx) : 0.0f;
    r[u] = e;
    sum = sum + e;
  }
  sum = block_sum(sum, sh);
  float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int u = threadIdx.x; u <= t; u += blockDim.x) r[u] = r[u] * inv;
}

/* through the softmax, one row per block: g = p (g - sum_{u<=t} p g) */
__global__ void k_gpt2_att_softmax_bwd(float *datt, const float *att, int T) {
  __shared__ float sh[ROW_THREADS];
  size_t row = blockIdx.x;
  int t = (int)(row % (size_t)T);
  const float *p = att + row * (size_t)T;
  float *g = datt + row * (size_t)T;
  float dot = 0.0f;
  for (int u = threadIdx.x; u <= t; u += blockDim.x) dot = dot + p[u] * g[u];
  dot = block_sum(dot, sh);
  for (int u = threadIdx.x; u < T; u += blockDim.x)
    g[u] = sp_gpt2_elem_softmax_bwd(p[u], g[u], dot, u <= t);
}

extern "C" int sp_gpt2_gpu_attention_fwd(sp_gpt2_dev *k, float *out, float *att,
                                         const float *qkv, const uint8_t *allow,
                                         int B, int T, int C, int NH,
                                         sp_diag *d) {
  int hs = C / NH, C3 = 3 * C;
  float scale = 1.0f / sqrtf((float)hs);
  long long TT = (long long)T * T;
  int rc = 0;
  /* scores of sequence b, all heads at once: head h's q, k start hs
   * columns after head h-1's, its T x T scores T*T floats after */
  for (int b = 0; rc == 0 && b < B; b++) {
    const float *q = qkv + (size_t)b * T * C3, *kk = q + C;
    rc = rm_gemm(k, false, true, T, T, hs, scale, q, C3, hs, kk, C3, hs, 0.0f,
                 att + (size_t)b * NH * TT, T, TT, NH, d);
  }
  if (rc < 0) return rc;
  size_t rows = (size_t)B * NH * T;
  if (rows) {
    k_gpt2_att_softmax<<<(unsigned)rows, ROW_THREADS, 0, k->st>>>(att, allow,
                                                                  T);
    LAUNCHED(d);
  }
  for (int b = 0; rc == 0 && b < B; b++) {
    const float *v = qkv + (size_t)b * T * C3 + 2 * C;
    rc = rm_gemm(k, false, false, T, hs, T, 1.0f, att + (size_t)b * NH * TT, T,
                 TT, v, C3, hs, 0.0f, out + (size_t)b * T * C, C, hs, NH, d);
  }
  return rc;
}

extern "C" int sp_gpt2_gpu_attention_bwd(sp_gpt2_dev *k, float *dqkv,
                                         float *datt, const float *dout,
                                         const float *qkv, const float *att,
                                         int B, int T, int C, int NH,
                                         sp_diag *d) {
  int hs = C / NH, C3 = 3 * C;
  float scale = 1.0f / sqrtf((float)hs);
  long long TT = (long long)T * T;
  int rc = 0;
  for (int b = 0; rc == 0 && b < B; b++) {
    size_t off = (size_t)b * T * C3;
    const float *q = qkv + off, *kk = q + C, *v = q + 2 * C;
    float *dq = dqkv + off, *dk = dq + C, *dv = dq + 2 * C;
    const float *s = att + (size_t)b * NH * TT;
    const float *dy = dout + (size_t)b * T * C;
    /* datt = dy v^T; dv = att^T dy */
    rc = rm_gemm(k, false, true, T, T, hs, 1.0f, dy, C, hs, v, C3, hs, 0.0f,
                 datt, T, TT, NH, d);
    if (rc == 0)
      rc = rm_gemm(k, true, false, T, hs, T, 1.0f, s, T, TT, dy, C, hs, 0.0f,
                   dv, C3, hs, NH, d);
    if (rc < 0) return rc;
    size_t rows = (size_t)NH * T;
    if (rows) {
      k_gpt2_att_softmax_bwd<<<(unsigned)rows, ROW_THREADS, 0, k->st>>>(datt, s,
                                                                        T);
      LAUNCHED(d);
    }
    /* dq = scale ds k; dk = scale ds^T q */
    rc = rm_gemm(k, false, false, T, hs, T, scale, datt, T, TT, kk, C3, hs,
                 0.0f, dq, C3, hs, NH, d);
    if (rc == 0)
      rc = rm_gemm(k, true, false, T, hs, T, scale, datt, T, TT, q, C3, hs,
                   0.0f, dk, C3, hs, NH, d);
  }
  return rc;
}

/* ------------------------------------------------------------------ */
/* sp_gpt2_cpu_gelu_fwd / _bwd, sp_gpt2_cpu_add, sp_gpt2_cpu_round    */
/* ------------------------------------------------------------------ */

__global__ void k_gpt2_gelu_fwd(float *out, const float *inp, size_t n) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    out[i] = sp_gpt2_elem_gelu(inp[i]);
}

__global__ void k_gpt2_gelu_bwd(float *dinp, const float *inp,
                                const float *dout, size_t n) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    dinp[i] = sp_gpt2_elem_gelu_bwd(inp[i], dout[i]);
}

__global__ void k_gpt2_add(float *y, const float *a, const float *b, size_t n) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    y[i] = a[i] + b[i];
}

__global__ void k_gpt2_round(float *v, size_t n, int dt) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    v[i] = dt == SP_BFLOAT16 ? sp_f32_round_bf16(v[i]) : sp_f32_round_f16(v[i]);
}

extern "C" int sp_gpt2_gpu_gelu_fwd(sp_gpt2_dev *k, float *out,
                                    const float *inp, size_t n, sp_diag *d) {
  if (n == 0) return 0;
  k_gpt2_gelu_fwd<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(out, inp,
                                                                    n);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_gelu_bwd(sp_gpt2_dev *k, float *dinp,
                                    const float *inp, const float *dout,
                                    size_t n, sp_diag *d) {
  if (n == 0) return 0;
  k_gpt2_gelu_bwd<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(dinp, inp,
                                                                    dout, n);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_add(sp_gpt2_dev *k, float *y, const float *a,
                               const float *b, size_t n, sp_diag *d) {
  if (n == 0) return 0;
  k_gpt2_add<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(y, a, b, n);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_round(sp_gpt2_dev *k, float *v, size_t n,
                                 sp_dtype dt, sp_diag *d) {
  /* other dtypes hold every float32: nothing to do, as on the CPU */
  if (n == 0 || (dt != SP_BFLOAT16 && dt != SP_FLOAT16)) return 0;
  k_gpt2_round<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(v, n, (int)dt);
  LAUNCHED(d);
  return 0;
}

/* ------------------------------------------------------------------ */
/* sp_gpt2_cpu_softmax_xent_fwd / _bwd                                */
/* ------------------------------------------------------------------ */

/* one block a row: the largest logit, the sum of exp in double, the row's
 * loss and its probabilities */
__global__ void k_gpt2_xent_fwd(float *probs, const int32_t *tgt, int V,
                                double *rows) {
  __shared__ float sh[ROW_THREADS];
  __shared__ double shd[ROW_THREADS];
  size_t row = blockIdx.x;
  float *r = probs + row * (size_t)V;
  /* read before any thread overwrites the row below */
  float rt = r[tgt[row]];
  float mx = r[0];
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    if (r[j] > mx) mx = r[j];
  mx = block_max(mx, sh);
  double sum = 0.0;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    sum = sum + exp((double)r[j] - (double)mx);
  sum = block_sum_d(sum, shd);
  if (threadIdx.x == 0) rows[row] = (double)mx + log(sum) - (double)rt;
  for (int j = threadIdx.x; j < V; j += blockDim.x)
    r[j] = (float)(exp((double)r[j] - (double)mx) / sum);
}

/* the rows' losses summed in row order */
__global__ void k_gpt2_sum_rows(const double *rows, int N, double *total) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double acc = 0.0;
  for (int i = 0; i < N; i++) acc = acc + rows[i];
  total[0] = acc;
}

__global__ void k_gpt2_xent_bwd(float *probs, const int32_t *tgt, size_t n,
                                int V, float scale) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE()) {
    size_t row = i / (size_t)V, j = i % (size_t)V;
    probs[i] = sp_gpt2_elem_xent_bwd(probs[i], (size_t)tgt[row] == j, scale);
  }
}

extern "C" int sp_gpt2_gpu_softmax_xent_fwd(sp_gpt2_dev *k, float *probs,
                                            const int32_t *tgt, int N, int V,
                                            double *rows, double *total,
                                            sp_diag *d) {
  if (N > 0) {
    k_gpt2_xent_fwd<<<(unsigned)N, ROW_THREADS, 0, k->st>>>(probs, tgt, V,
                                                            rows);
    LAUNCHED(d);
  }
  k_gpt2_sum_rows<<<1, 1, 0, k->st>>>(rows, N, total);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_softmax_xent_bwd(sp_gpt2_dev *k, float *probs,
                                            const int32_t *tgt, int N, int V,
                                            float scale, sp_diag *d) {
  size_t n = (size_t)N * (size_t)V;
  if (n == 0) return 0;
  k_gpt2_xent_bwd<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(
      probs, tgt, n, V, scale);
  LAUNCHED(d);
  return 0;
}

/* ------------------------------------------------------------------ */
/* sp_gpt2_cpu_embed_fwd, sp_gpt2_cpu_wte_bwd, sp_gpt2_cpu_wpe_bwd    */
/* ------------------------------------------------------------------ */

__global__ void k_gpt2_embed_fwd(float *x, const int32_t *tok, const float *wte,
                                 const float *wpe, size_t n, int T, int C) {
  for (size_t e = SP_GRID_TID(); e < n; e += SP_GRID_STRIDE()) {
    size_t i = e / (size_t)C, c = e % (size_t)C;
    x[e] = wte[(size_t)tok[i] * C + c] + wpe[(i % (size_t)T) * C + c];
  }
}

/* one thread a column, the tokens in index order (the CPU's bits); the
 * rows start zeroed */
__global__ void k_gpt2_wte_bwd(float *dwte, const float *dx, const int32_t *tok,
                               int N, int C) {
  for (size_t c = SP_GRID_TID(); c < (size_t)C; c += SP_GRID_STRIDE())
    for (int i = 0; i < N; i++) {
      float *r = dwte + (size_t)tok[i] * C + c;
      *r = *r + dx[(size_t)i * C + c];
    }
}

/* one thread an element of rows [0, T), positions t, t + T, ... in order */
__global__ void k_gpt2_wpe_bwd(float *dwpe, const float *dx, int N, int T,
                               int C) {
  size_t n = (size_t)T * C;
  for (size_t e = SP_GRID_TID(); e < n; e += SP_GRID_STRIDE()) {
    size_t t = e / (size_t)C, c = e % (size_t)C;
    float a = 0.0f;
    for (size_t i = t; i < (size_t)N; i += (size_t)T) a = a + dx[i * C + c];
    dwpe[e] = a;
  }
}

extern "C" int sp_gpt2_gpu_embed_fwd(sp_gpt2_dev *k, float *x,
                                     const int32_t *tok, const float *wte,
                                     const float *wpe, int N, int T, int C,
                                     sp_diag *d) {
  size_t n = (size_t)N * (size_t)C;
  if (n == 0) return 0;
  k_gpt2_embed_fwd<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(
      x, tok, wte, wpe, n, T, C);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_wte_bwd(sp_gpt2_dev *k, float *dwte, const float *dx,
                                   const int32_t *tok, int N, int C, int V,
                                   sp_diag *d) {
  SP_CUDA_CHECK(d, cudaMemsetAsync(
                       dwte, 0, (size_t)V * (size_t)C * sizeof(float), k->st));
  k_gpt2_wte_bwd<<<sp_grid_blocks((size_t)C), SP_GRID_THREADS, 0, k->st>>>(
      dwte, dx, tok, N, C);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_wpe_bwd(sp_gpt2_dev *k, float *dwpe, const float *dx,
                                   int N, int T, int C, int ctx, sp_diag *d) {
  SP_CUDA_CHECK(
      d,
      cudaMemsetAsync(dwpe, 0, (size_t)ctx * (size_t)C * sizeof(float), k->st));
  size_t n = (size_t)T * (size_t)C;
  if (n == 0) return 0;
  k_gpt2_wpe_bwd<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(dwpe, dx, N,
                                                                   T, C);
  LAUNCHED(d);
  return 0;
}

/* ------------------------------------------------------------------ */
/* gpt2.c's host_grad_add and host_mask                               */
/* ------------------------------------------------------------------ */

__global__ void k_gpt2_grad_add(void *dst, int dt, const float *g, size_t n) {
  for (size_t i = SP_GRID_TID(); i < n; i += SP_GRID_STRIDE())
    sp_elem_store_f64(dst, dt, i, sp_elem_load_f64(dst, dt, i) + (double)g[i]);
}

__global__ void k_gpt2_mask(uint8_t *allow, const void *buf, int dt,
                            int floating, size_t es, int T, int ctx) {
  size_t n = (size_t)T * T;
  for (size_t e = SP_GRID_TID(); e < n; e += SP_GRID_STRIDE()) {
    size_t i = (e / (size_t)T) * (size_t)ctx + e % (size_t)T;
    bool on = false;
    if (floating) {
      on = sp_elem_load_f64(buf, dt, i) != 0.0;
    } else {
      for (size_t b = 0; b < es; b++)
        on |= ((const unsigned char *)buf)[i * es + b] != 0;
    }
    allow[e] = on;
  }
}

extern "C" int sp_gpt2_gpu_grad_add(sp_gpt2_dev *k, void *dst, sp_dtype dt,
                                    const float *g, size_t n, sp_diag *d) {
  if (!sp_dtype_is_floating(dt))
    return sp_diag_set(d, SP_EINVAL, "gradient dtype %s is not floating",
                       sp_dtype_name(dt));
  if (n == 0) return 0;
  k_gpt2_grad_add<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(
      dst, (int)dt, g, n);
  LAUNCHED(d);
  return 0;
}

extern "C" int sp_gpt2_gpu_mask(sp_gpt2_dev *k, uint8_t *allow, const void *buf,
                                sp_dtype dt, int T, int ctx, sp_diag *d) {
  size_t n = (size_t)T * (size_t)T;
  if (n == 0) return 0;
  k_gpt2_mask<<<sp_grid_blocks(n), SP_GRID_THREADS, 0, k->st>>>(
      allow, buf, (int)dt, sp_dtype_is_floating(dt) ? 1 : 0, sp_dtype_size(dt),
      T, ctx);
  LAUNCHED(d);
  return 0;
}
