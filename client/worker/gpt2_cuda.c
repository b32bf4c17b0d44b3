/* The GPT-2 model on a GPU (gpt2_cuda.h): gpt2.c's step pieces with device
 * activations and the kernels of gpt2_gpu.h. Each function follows
 * its gpt2.c twin statement for statement, so that a change to one shows
 * in the other. Plain C over the CUDA runtime API; the kernels are in
 * gpt2_gpu.cu. */
#include "gpt2_cuda.h"

#include <cuda_runtime_api.h>
#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "cast/cast_cuda.h"
#include "gpt2_gpu.h"
#include "lib/cuda_internal.h"

/* per tensor, as gpt2.c: the kernels index with int */
#define MAX_ELEMS ((int64_t)INT_MAX)

struct sp_gpt2_cuda {
  const sp_gpt2 *g;
  size_t B, T;
  cudaStream_t st;
  sp_gpt2_dev *k;
  /* device: sp_gpt2_acts' arrays, per layer [n_layer] (res: n_layer + 1) */
  float **res, **ln1, **ln1_mean, **ln1_rstd, **qkv, **att, **atty, **res2;
  float **ln2, **ln2_mean, **ln2_rstd, **fch, **fch_gelu;
  float *lnf, *lnf_mean, *lnf_rstd, *probs;
  float *dres, *dbuf, *dbig, *dqkv, *datt;
  float *w, *w2, *gw, *lnw, *lnb, *gb, *gb2;
  int32_t *tok, *tgt;
  uint8_t *allow;
  double *rows, *total, *scalar;
  /* host */
  int32_t *htok, *htgt;
  double hscalar;
};

/* ------------------------------------------------------------------ */
/* memory                                                              */
/* ------------------------------------------------------------------ */

/* n * k elements of es bytes on the device, or NULL with *rc set. */
static void *dalloc(int64_t n, int64_t k, size_t es, int *rc, sp_diag *d) {
  if (*rc != 0) return NULL;
  if (n < 0 || k < 0 || (k > 0 && n > MAX_ELEMS / k)) {
    *rc = sp_diag_set(d, SP_ETOOBIG, "%lld x %lld elements: over 2^31 a "
                      "tensor", (long long)n, (long long)k);
    return NULL;
  }
  size_t bytes = (size_t)(n * k) * es;
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    *rc = sp_diag_set(d, SP_ENOMEM, "cudaMalloc of %zu bytes: out of device "
                      "memory", bytes);
    return NULL;
  }
  if (e != cudaSuccess) {
    *rc = sp_cuda_diag(d, (int)e, "cudaMalloc", __FILE__, __LINE__);
    return NULL;
  }
  return p;
}

static float **per_layer(size_t n, int *rc, sp_diag *d) {
  if (*rc != 0) return NULL;
  float **p = calloc(n, sizeof *p);
  if (p == NULL) *rc = sp_diag_set(d, SP_ENOMEM, "no memory");
  return p;
}

/* the per-layer lists, for allocation and freeing alike */
#define N_LISTS 13
static float ***lists(sp_gpt2_cuda *c, size_t i) {
  float ***all[N_LISTS] = {&c->res,      &c->ln1,  &c->ln1_mean, &c->ln1_rstd,
                           &c->qkv,      &c->att,  &c->atty,     &c->res2,
                           &c->ln2,      &c->ln2_mean, &c->ln2_rstd, &c->fch,
                           &c->fch_gelu};
  return all[i];
}

void sp_gpt2_cuda_free(sp_gpt2_cuda *c) {
  if (c == NULL) return;
  /* kernels of the last step may still use the memory */
  (void)cudaStreamSynchronize(c->st);
  for (size_t i = 0; i < N_LISTS; i++) {
    float **l = *lists(c, i);
    for (size_t j = 0; l && l[j]; j++) (void)cudaFree(l[j]);
    free(l);
  }
  void *single[] = {c->lnf, c->lnf_mean, c->lnf_rstd, c->probs, c->dres,
                    c->dbuf, c->dbig, c->dqkv, c->datt, c->w, c->w2, c->gw,
                    c->lnw, c->lnb, c->gb, c->gb2, c->tok, c->tgt, c->allow,
                    c->rows, c->total, c->scalar};
  for (size_t i = 0; i < sizeof single / sizeof single[0]; i++)
    (void)cudaFree(single[i]);
  sp_gpt2_gpu_free(c->k);
  free(c->htok);
  free(c->htgt);
  free(c);
}

static int cuda_new(sp_gpt2_cuda *c, sp_diag *d) {
  const sp_gpt2 *g = c->g;
  int64_t B = (int64_t)c->B, T = (int64_t)c->T, N = B * T, C = g->C;
  int64_t L = g->n_layer, NH = g->n_head;
  int rc = 0;
  if (B > MAX_ELEMS / T || B * NH > MAX_ELEMS / T / T)
    return sp_diag_set(d, SP_ETOOBIG, "activations of %lld x %lld tokens: "
                       "over 2^31 elements", (long long)B, (long long)T);
  for (size_t i = 0; i < N_LISTS; i++)
    *lists(c, i) = per_layer((size_t)L + 2, &rc, d); /* NULL-terminated */
  for (int64_t l = 0; l < L && rc == 0; l++) {
    c->res[l] = dalloc(N, C, 4, &rc, d);
    c->ln1[l] = dalloc(N, C, 4, &rc, d);
    c->ln1_mean[l] = dalloc(N, 1, 4, &rc, d);
    c->ln1_rstd[l] = dalloc(N, 1, 4, &rc, d);
    c->qkv[l] = dalloc(N, 3 * C, 4, &rc, d);
    c->att[l] = dalloc(B * NH * T, T, 4, &rc, d);
    c->atty[l] = dalloc(N, C, 4, &rc, d);
    c->res2[l] = dalloc(N, C, 4, &rc, d);
    c->ln2[l] = dalloc(N, C, 4, &rc, d);
    c->ln2_mean[l] = dalloc(N, 1, 4, &rc, d);
    c->ln2_rstd[l] = dalloc(N, 1, 4, &rc, d);
    c->fch[l] = dalloc(N, 4 * C, 4, &rc, d);
    c->fch_gelu[l] = dalloc(N, 4 * C, 4, &rc, d);
  }
  if (rc == 0) c->res[L] = dalloc(N, C, 4, &rc, d);
  c->lnf = dalloc(N, C, 4, &rc, d);
  c->lnf_mean = dalloc(N, 1, 4, &rc, d);
  c->lnf_rstd = dalloc(N, 1, 4, &rc, d);
  c->probs = dalloc(N, g->V, 4, &rc, d);
  c->dres = dalloc(N, C, 4, &rc, d);
  c->dbuf = dalloc(N, C, 4, &rc, d);
  c->dbig = dalloc(N, 4 * C, 4, &rc, d);
  c->dqkv = dalloc(N, 3 * C, 4, &rc, d);
  c->datt = dalloc(NH * T, T, 4, &rc, d);
  /* the largest param: wte [V, C], wpe [ctx, C] or a [4C, C] matrix; the
   * embedding reads wte and wpe at once (w and w2) */
  int64_t wmax = g->V * C;
  if (g->ctx * C > wmax) wmax = g->ctx * C;
  if (4 * C * C > wmax) wmax = 4 * C * C;
  c->w = dalloc(wmax, 1, 4, &rc, d);
  c->w2 = dalloc(g->ctx, C, 4, &rc, d);
  c->gw = dalloc(wmax, 1, 4, &rc, d);
  c->lnw = dalloc(C, 1, 4, &rc, d);
  c->lnb = dalloc(C, 1, 4, &rc, d);
  c->gb = dalloc(4 * C, 1, 4, &rc, d);
  c->gb2 = dalloc(4 * C, 1, 4, &rc, d);
  c->tok = dalloc(N, 1, sizeof(int32_t), &rc, d);
  c->tgt = dalloc(N, 1, sizeof(int32_t), &rc, d);
  c->allow = dalloc(T, T, 1, &rc, d);
  c->rows = dalloc(N, 1, sizeof(double), &rc, d);
  c->total = dalloc(1, 1, sizeof(double), &rc, d);
  c->scalar = dalloc(1, 1, sizeof(double), &rc, d);
  if (rc != 0) return rc;
  c->htok = calloc((size_t)N, sizeof *c->htok);
  c->htgt = calloc((size_t)N, sizeof *c->htgt);
  if (!c->htok || !c->htgt) return sp_diag_set(d, SP_ENOMEM, "no memory");
  rc = sp_gpt2_gpu_new(c->st, &c->k, d);
  if (rc != 0) return rc;
  /* device memory starts undefined; the uploads and the forward write
   * everything before it is read, but a mistake then reads zeros */
  SP_CUDA_CHECK_D(d, cudaMemsetAsync(c->tok, 0, (size_t)N * 4, c->st));
  SP_CUDA_CHECK_D(d, cudaMemsetAsync(c->tgt, 0, (size_t)N * 4, c->st));
  return 0;
}

int sp_gpt2_cuda_new(const sp_gpt2 *g, size_t B, size_t T, void *stream,
                     sp_gpt2_cuda **out, sp_diag *d) {
  if (g == NULL || out == NULL || B == 0 || T == 0 || T > (size_t)g->ctx)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda_new: %zu x %zu tokens "
                       "(context %lld)", B, T, g ? (long long)g->ctx : 0LL);
  *out = NULL;
  sp_gpt2_cuda *c = calloc(1, sizeof *c);
  if (c == NULL) return sp_diag_set(d, SP_ENOMEM, "no memory");
  c->g = g;
  c->B = B;
  c->T = T;
  c->st = (cudaStream_t)stream;
  int rc = cuda_new(c, d);
  if (rc != 0) {
    sp_gpt2_cuda_free(c);
    return sp_diag_prefix(d, rc, "GPT-2 on the GPU (%zu x %zu tokens)", B, T);
  }
  *out = c;
  return 0;
}

int32_t *sp_gpt2_cuda_tokens(sp_gpt2_cuda *c) { return c ? c->htok : NULL; }
int32_t *sp_gpt2_cuda_targets(sp_gpt2_cuda *c) { return c ? c->htgt : NULL; }

int sp_gpt2_cuda_upload(sp_gpt2_cuda *c, sp_diag *d) {
  if (c == NULL) return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda_upload: NULL");
  size_t N = c->B * c->T;
  /* the CPU checks tokens in embed_forward and targets in head_forward */
  for (size_t i = 0; i < N; i++) {
    if (c->htok[i] < 0 || c->htok[i] >= c->g->V)
      return sp_diag_set(d, SP_ERANGE, "token %d at %zu: vocabulary of %lld",
                         c->htok[i], i, (long long)c->g->V);
    if (c->htgt[i] < 0 || c->htgt[i] >= c->g->V)
      return sp_diag_set(d, SP_ERANGE, "target %d at %zu: vocabulary of %lld",
                         c->htgt[i], i, (long long)c->g->V);
  }
  SP_CUDA_CHECK_D(d, cudaMemcpyAsync(c->tok, c->htok, N * 4,
                                     cudaMemcpyHostToDevice, c->st));
  SP_CUDA_CHECK_D(d, cudaMemcpyAsync(c->tgt, c->htgt, N * 4,
                                     cudaMemcpyHostToDevice, c->st));
  /* the host arrays take the next micro-batch right after */
  SP_CUDA_CHECK_D(d, cudaStreamSynchronize(c->st));
  return 0;
}

double *sp_gpt2_cuda_scalar(sp_gpt2_cuda *c) { return c ? c->scalar : NULL; }

int sp_gpt2_cuda_set_scalar(sp_gpt2_cuda *c, double v, sp_diag *d) {
  if (c == NULL) return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda: NULL");
  c->hscalar = v;
  SP_CUDA_CHECK_D(d, cudaMemcpyAsync(c->scalar, &c->hscalar, sizeof v,
                                     cudaMemcpyHostToDevice, c->st));
  return 0;
}

int sp_gpt2_cuda_get_scalar(sp_gpt2_cuda *c, double *v, sp_diag *d) {
  if (c == NULL || v == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda: NULL");
  SP_CUDA_CHECK_D(d, cudaMemcpyAsync(&c->hscalar, c->scalar, sizeof *v,
                                     cudaMemcpyDeviceToHost, c->st));
  SP_CUDA_CHECK_D(d, cudaStreamSynchronize(c->st));
  *v = c->hscalar;
  return 0;
}

/* ------------------------------------------------------------------ */
/* views (gpt2.c's load, view_f32, grad_f32, add_grad, block_mask)     */
/* ------------------------------------------------------------------ */

static const char *fqn_of(const sp_gpt2 *g, int32_t p) {
  return g->model->params[p].fqn;
}

/* A param's device view as float32: the view itself when it is float32
 * (and float-aligned), else cast into scratch; *dt its dtype. */
static int view(sp_gpt2_cuda *c, const sp_gpt2_io *io, int32_t p,
                float *scratch, const float **out, sp_dtype *dt, sp_diag *d) {
  const sp_tensor_spec *t = &c->g->model->params[p];
  sp_dtype pd = io->param_dtype(io->user, p);
  if (!sp_dtype_is_floating(pd))
    return sp_diag_set(d, SP_EINVAL, "%s: param dtype %s is not floating",
                       t->fqn, sp_dtype_name(pd));
  void *v = io->param(io->user, p);
  if (v == NULL)
    return sp_diag_set(d, SP_EINVAL, "%s: no parameter view (unit sharded?)",
                       t->fqn);
  if (dt) *dt = pd;
  if (pd == SP_FLOAT32 && (uintptr_t)v % _Alignof(float) == 0) {
    *out = v;
    return 0;
  }
  int rc = sp_cuda_cast(scratch, SP_FLOAT32, v, pd, (size_t)t->numel, c->st);
  if (rc != 0)
    return sp_diag_set(d, rc, "%s:%d: %s: cast from %s failed (the CUDA "
                       "error is logged above)", __FILE__, __LINE__, t->fqn,
                       sp_dtype_name(pd));
  *out = scratch;
  return 0;
}

static float *grad_f32(const sp_gpt2_io *io, int32_t p) {
  void *v = io->grad ? io->grad(io->user, p) : NULL;
  return v && io->param_dtype(io->user, p) == SP_FLOAT32 &&
                 (uintptr_t)v % _Alignof(float) == 0
             ? v
             : NULL;
}

static int add_grad(sp_gpt2_cuda *c, const sp_gpt2_io *io, int32_t p,
                    const float *gr, sp_diag *d) {
  void *dst = io->grad ? io->grad(io->user, p) : NULL;
  if (dst == NULL) return 0;
  sp_dtype pd = io->param_dtype(io->user, p);
  int rc = sp_gpt2_gpu_grad_add(c->k, dst, pd, gr,
                                (size_t)c->g->model->params[p].numel, d);
  return rc ? sp_diag_prefix(d, rc, "%s", fqn_of(c->g, p)) : 0;
}

static int check(const sp_gpt2_cuda *c, const sp_gpt2_io *io, sp_diag *d) {
  if (c == NULL || io == NULL || io->param == NULL || io->param_dtype == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda: NULL argument or "
                       "callback");
  return 0;
}

static int check_block(const sp_gpt2_cuda *c, size_t l,
                       const sp_gpt2_io *io, sp_diag *d) {
  int rc = check(c, io, d);
  if (rc == 0 && l >= (size_t)c->g->n_layer)
    rc = sp_diag_set(d, SP_ERANGE, "sp_gpt2_cuda: block %zu of %lld", l,
                     (long long)c->g->n_layer);
  return rc;
}

static int block_mask(sp_gpt2_cuda *c, const sp_gpt2_block *b,
                      const sp_gpt2_io *io, bool *have, sp_diag *d) {
  const sp_gpt2 *g = c->g;
  *have = false;
  if (b->mask < 0 || io->buffer == NULL) return 0;
  const void *v = io->buffer(io->user, b->mask);
  if (v == NULL)
    return sp_diag_set(d, SP_EINVAL, "%s: no buffer storage",
                       g->model->buffers[b->mask].fqn);
  sp_dtype dt = io->buffer_dtype ? io->buffer_dtype(io->user, b->mask)
                                 : g->model->buffers[b->mask].dtype;
  int rc = sp_gpt2_gpu_mask(c->k, c->allow, v, dt, (int)c->T, (int)g->ctx, d);
  if (rc != 0) return rc;
  *have = true;
  return 0;
}

/* every kernel call below: return on failure */
#define K(call)                   \
  do {                            \
    int rc_ = (call);             \
    if (rc_ != 0) return rc_;     \
  } while (0)

/* ------------------------------------------------------------------ */
/* forward                                                             */
/* ------------------------------------------------------------------ */

int sp_gpt2_cuda_embed_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               sp_diag *d) {
  K(check(c, io, d));
  const sp_gpt2 *g = c->g;
  int C = (int)g->C, T = (int)c->T, N = (int)(c->B * c->T);
  sp_dtype pd = SP_FLOAT32;
  const float *wte, *wpe;
  K(view(c, io, g->wte, c->w, &wte, &pd, d));
  K(view(c, io, g->wpe, c->w2, &wpe, NULL, d));
  K(sp_gpt2_gpu_embed_fwd(c->k, c->res[0], c->tok, wte, wpe, N, T, C, d));
  K(sp_gpt2_gpu_round(c->k, c->res[0], (size_t)N * C, pd, d));
  return 0;
}

int sp_gpt2_cuda_block_forward(sp_gpt2_cuda *c, size_t l,
                               const sp_gpt2_io *io, sp_diag *d) {
  K(check_block(c, l, io, d));
  const sp_gpt2 *g = c->g;
  const sp_gpt2_block *b = &g->blocks[l];
  sp_gpt2_dev *k = c->k;
  int N = (int)(c->B * c->T), C = (int)g->C, NH = (int)g->n_head;
  size_t NC = (size_t)N * (size_t)C;
  sp_dtype pd = SP_FLOAT32;
  bool have_mask = false;
  K(block_mask(c, b, io, &have_mask, d));
  float *x = c->res[l], *tmp = c->dbuf;
  const float *w, *bias, *lw, *lb;
  /* the unit's input cast (FSDP casts a unit's inputs to param_dtype) */
  K(view(c, io, b->ln1_w, c->lnw, &lw, &pd, d));
  K(view(c, io, b->ln1_b, c->lnb, &lb, NULL, d));
  K(sp_gpt2_gpu_round(k, x, NC, pd, d));
  K(sp_gpt2_gpu_layernorm_fwd(k, c->ln1[l], c->ln1_mean[l], c->ln1_rstd[l], x,
                              lw, lb, N, C, d));
  K(sp_gpt2_gpu_round(k, c->ln1[l], NC, pd, d));
  /* attention */
  K(view(c, io, b->attn_w, c->w, &w, NULL, d));
  K(view(c, io, b->attn_b, c->gb, &bias, NULL, d));
  K(sp_gpt2_gpu_matmul_fwd(k, c->qkv[l], c->ln1[l], w, bias, N, C, 3 * C, d));
  K(sp_gpt2_gpu_round(k, c->qkv[l], 3 * NC, pd, d));
  K(sp_gpt2_gpu_attention_fwd(k, c->atty[l], c->att[l], c->qkv[l],
                              have_mask ? c->allow : NULL, (int)c->B, (int)c->T,
                              C, NH, d));
  K(sp_gpt2_gpu_round(k, c->atty[l], NC, pd, d));
  K(view(c, io, b->proj_w, c->w, &w, NULL, d));
  K(view(c, io, b->proj_b, c->gb, &bias, NULL, d));
  K(sp_gpt2_gpu_matmul_fwd(k, tmp, c->atty[l], w, bias, N, C, C, d));
  K(sp_gpt2_gpu_round(k, tmp, NC, pd, d));
  K(sp_gpt2_gpu_add(k, c->res2[l], x, tmp, NC, d));
  K(sp_gpt2_gpu_round(k, c->res2[l], NC, pd, d));
  /* MLP */
  K(view(c, io, b->ln2_w, c->lnw, &lw, NULL, d));
  K(view(c, io, b->ln2_b, c->lnb, &lb, NULL, d));
  K(sp_gpt2_gpu_layernorm_fwd(k, c->ln2[l], c->ln2_mean[l], c->ln2_rstd[l],
                              c->res2[l], lw, lb, N, C, d));
  K(sp_gpt2_gpu_round(k, c->ln2[l], NC, pd, d));
  K(view(c, io, b->fc_w, c->w, &w, NULL, d));
  K(view(c, io, b->fc_b, c->gb, &bias, NULL, d));
  K(sp_gpt2_gpu_matmul_fwd(k, c->fch[l], c->ln2[l], w, bias, N, C, 4 * C, d));
  K(sp_gpt2_gpu_round(k, c->fch[l], 4 * NC, pd, d));
  K(sp_gpt2_gpu_gelu_fwd(k, c->fch_gelu[l], c->fch[l], 4 * NC, d));
  K(sp_gpt2_gpu_round(k, c->fch_gelu[l], 4 * NC, pd, d));
  K(view(c, io, b->fcproj_w, c->w, &w, NULL, d));
  K(view(c, io, b->fcproj_b, c->gb, &bias, NULL, d));
  K(sp_gpt2_gpu_matmul_fwd(k, tmp, c->fch_gelu[l], w, bias, N, 4 * C, C, d));
  K(sp_gpt2_gpu_round(k, tmp, NC, pd, d));
  float *y = c->res[l + 1];
  K(sp_gpt2_gpu_add(k, y, c->res2[l], tmp, NC, d));
  K(sp_gpt2_gpu_round(k, y, NC, pd, d));
  return 0;
}

int sp_gpt2_cuda_head_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                              double denom, double *loss, sp_diag *d) {
  K(check(c, io, d));
  if (!(denom >= 1.0))
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2: loss denominator %g", denom);
  const sp_gpt2 *g = c->g;
  sp_gpt2_dev *k = c->k;
  int N = (int)(c->B * c->T), C = (int)g->C, V = (int)g->V;
  sp_dtype pd = SP_FLOAT32;
  const float *lw, *lb, *wte;
  K(view(c, io, g->lnf_w, c->lnw, &lw, &pd, d));
  K(view(c, io, g->lnf_b, c->lnb, &lb, NULL, d));
  K(view(c, io, g->wte, c->w, &wte, NULL, d));
  float *x = c->res[g->n_layer];
  size_t NC = (size_t)N * (size_t)C;
  K(sp_gpt2_gpu_round(k, x, NC, pd, d));
  K(sp_gpt2_gpu_layernorm_fwd(k, c->lnf, c->lnf_mean, c->lnf_rstd, x, lw, lb, N,
                              C, d));
  K(sp_gpt2_gpu_round(k, c->lnf, NC, pd, d));
  K(sp_gpt2_gpu_logits_fwd(k, c->probs, c->lnf, wte, N, C, V, d));
  K(sp_gpt2_gpu_round(k, c->probs, (size_t)N * (size_t)V, pd, d));
  K(sp_gpt2_gpu_softmax_xent_fwd(k, c->probs, c->tgt, N, V, c->rows, c->total,
                                 d));
  double sum = 0;
  SP_CUDA_CHECK_D(d, cudaMemcpyAsync(&c->hscalar, c->total, sizeof sum,
                                     cudaMemcpyDeviceToHost, c->st));
  SP_CUDA_CHECK_D(d, cudaStreamSynchronize(c->st));
  sum = c->hscalar;
  if (loss) *loss = sum / denom;
  return 0;
}

/* ------------------------------------------------------------------ */
/* backward                                                            */
/* ------------------------------------------------------------------ */

int sp_gpt2_cuda_head_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               double denom, sp_diag *d) {
  K(check(c, io, d));
  if (!(denom >= 1.0))
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2: loss denominator %g", denom);
  const sp_gpt2 *g = c->g;
  sp_gpt2_dev *k = c->k;
  int N = (int)(c->B * c->T), C = (int)g->C, V = (int)g->V;
  sp_dtype pd = SP_FLOAT32;
  const float *wte, *lw;
  K(view(c, io, g->wte, c->w, &wte, &pd, d));
  K(view(c, io, g->lnf_w, c->lnw, &lw, NULL, d));
  size_t NC = (size_t)N * (size_t)C;
  K(sp_gpt2_gpu_softmax_xent_bwd(k, c->probs, c->tgt, N, V,
                                 (float)(1.0 / denom), d));
  K(sp_gpt2_gpu_round(k, c->probs, (size_t)N * (size_t)V, pd, d));
  /* dlnf = dlogits wte; dwte = dlogits^T lnf */
  K(sp_gpt2_gpu_logits_bwd(k, c->dbuf, c->gw, c->probs, c->lnf, wte, N, C, V,
                           d));
  K(sp_gpt2_gpu_round(k, c->dbuf, NC, pd, d));
  K(add_grad(c, io, g->wte, c->gw, d));
  SP_CUDA_CHECK_D(d, cudaMemsetAsync(c->dres, 0, NC * sizeof(float), c->st));
  K(sp_gpt2_gpu_layernorm_bwd(k, c->dres, c->gb, c->gb2, c->dbuf,
                              c->res[g->n_layer], lw, c->lnf_mean, c->lnf_rstd,
                              N, C, d));
  K(sp_gpt2_gpu_round(k, c->dres, NC, pd, d));
  K(add_grad(c, io, g->lnf_w, c->gb, d));
  K(add_grad(c, io, g->lnf_b, c->gb2, d));
  return 0;
}

/* gpt2.c's conv_bwd */
static int conv_bwd(sp_gpt2_cuda *c, const sp_gpt2_io *io, int32_t w,
                    int32_t b, float *dinp, const float *dout,
                    const float *inp, int N, int IC, int OC, sp_diag *d) {
  const float *wv = NULL; /* -O3 cannot see view() set it */
  K(view(c, io, w, c->w, &wv, NULL, d));
  float *gw = grad_f32(io, w), *gbv = grad_f32(io, b);
  if (gw && gbv)
    return sp_gpt2_gpu_matmul_bwd(c->k, dinp, gw, gbv, dout, inp, wv, N, IC, OC,
                                  1, d);
  K(sp_gpt2_gpu_matmul_bwd(c->k, dinp, c->gw, c->gb, dout, inp, wv, N, IC, OC,
                           0, d));
  K(add_grad(c, io, w, c->gw, d));
  return add_grad(c, io, b, c->gb, d);
}

/* gpt2.c's ln_bwd */
static int ln_bwd(sp_gpt2_cuda *c, const sp_gpt2_io *io, int32_t w,
                  int32_t b, float *dinp, const float *dout, const float *inp,
                  const float *mean, const float *rstd, int N, int C,
                  sp_diag *d) {
  const float *lw = NULL; /* -O3 cannot see view() set it */
  K(view(c, io, w, c->lnw, &lw, NULL, d));
  K(sp_gpt2_gpu_layernorm_bwd(c->k, dinp, c->gb, c->gb2, dout, inp, lw, mean,
                              rstd, N, C, d));
  K(add_grad(c, io, w, c->gb, d));
  return add_grad(c, io, b, c->gb2, d);
}

int sp_gpt2_cuda_block_backward(sp_gpt2_cuda *c, size_t l,
                                const sp_gpt2_io *io, sp_diag *d) {
  K(check_block(c, l, io, d));
  const sp_gpt2 *g = c->g;
  const sp_gpt2_block *b = &g->blocks[l];
  sp_gpt2_dev *k = c->k;
  int N = (int)(c->B * c->T), C = (int)g->C, NH = (int)g->n_head;
  size_t NC = (size_t)N * (size_t)C;
  sp_dtype pd = io->param_dtype(io->user, b->attn_w);
  /* c->dres: the gradient of the block's output, which the residual
   * passes on unchanged; each branch adds its input gradient to it */
  K(conv_bwd(c, io, b->fcproj_w, b->fcproj_b, c->dbig, c->dres,
             c->fch_gelu[l], N, 4 * C, C, d));
  K(sp_gpt2_gpu_round(k, c->dbig, 4 * NC, pd, d));
  K(sp_gpt2_gpu_gelu_bwd(k, c->dbig, c->fch[l], c->dbig, 4 * NC, d));
  K(sp_gpt2_gpu_round(k, c->dbig, 4 * NC, pd, d));
  K(conv_bwd(c, io, b->fc_w, b->fc_b, c->dbuf, c->dbig, c->ln2[l], N, C,
             4 * C, d));
  K(sp_gpt2_gpu_round(k, c->dbuf, NC, pd, d));
  K(ln_bwd(c, io, b->ln2_w, b->ln2_b, c->dres, c->dbuf, c->res2[l],
           c->ln2_mean[l], c->ln2_rstd[l], N, C, d));
  K(sp_gpt2_gpu_round(k, c->dres, NC, pd, d));
  /* attention branch */
  K(conv_bwd(c, io, b->proj_w, b->proj_b, c->dbuf, c->dres, c->atty[l], N, C,
             C, d));
  K(sp_gpt2_gpu_round(k, c->dbuf, NC, pd, d));
  K(sp_gpt2_gpu_attention_bwd(k, c->dqkv, c->datt, c->dbuf, c->qkv[l],
                              c->att[l], (int)c->B, (int)c->T, C, NH, d));
  K(sp_gpt2_gpu_round(k, c->dqkv, 3 * NC, pd, d));
  K(conv_bwd(c, io, b->attn_w, b->attn_b, c->dbuf, c->dqkv, c->ln1[l], N, C,
             3 * C, d));
  K(sp_gpt2_gpu_round(k, c->dbuf, NC, pd, d));
  K(ln_bwd(c, io, b->ln1_w, b->ln1_b, c->dres, c->dbuf, c->res[l],
           c->ln1_mean[l], c->ln1_rstd[l], N, C, d));
  K(sp_gpt2_gpu_round(k, c->dres, NC, pd, d));
  return 0;
}

int sp_gpt2_cuda_embed_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                                sp_diag *d) {
  K(check(c, io, d));
  const sp_gpt2 *g = c->g;
  int C = (int)g->C, T = (int)c->T, N = (int)(c->B * c->T);
  /* wte: rows by token, tokens in order */
  K(sp_gpt2_gpu_wte_bwd(c->k, c->gw, c->dres, c->tok, N, C, (int)g->V, d));
  K(add_grad(c, io, g->wte, c->gw, d));
  K(sp_gpt2_gpu_wpe_bwd(c->k, c->gw, c->dres, N, T, C, (int)g->ctx, d));
  return add_grad(c, io, g->wpe, c->gw, d);
}
