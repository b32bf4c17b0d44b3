/* The GPT-2 model on a GPU (gpt2_cuda.h): gpt2_step.c's pieces over the
 * GPU's kernel table, which holds device memory, the stream and the
 * kernels of gpt2_gpu.h. Plain C over the CUDA runtime API; the kernels
 * are in gpt2_gpu.cu. */
#include "gpt2_cuda.h"

#include <cuda_runtime_api.h>
#include <limits.h>
#include <stdlib.h>

#include "cast/cast_cuda.h"
#include "gpt2_gpu.h"
#include "cuda/cuda_check.h"
#include "gpt2_step.h"

struct sp_gpt2_cuda {
  sp_gpt2_acts a; /* device arrays, tokens and targets included */
  sp_gpt2_step step;
  cudaStream_t st;
  sp_gpt2_dev *k;
  /* host */
  int32_t *htok, *htgt;
  double hscalar;
};

/* ------------------------------------------------------------------ */
/* the GPU's kernel table: device memory, gpt2_gpu.h's kernels         */
/* ------------------------------------------------------------------ */

static int dev_alloc(size_t bytes, void **out, sp_diag *d) {
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return sp_diag_set(d, SP_ENOMEM,
                       "cudaMalloc of %zu bytes: out of device "
                       "memory",
                       bytes);
  }
  if (e != cudaSuccess)
    return sp_cuda_diag(d, (int)e, "cudaMalloc", __FILE__, __LINE__);
  *out = p;
  return 0;
}

static void dev_release(void *p) { (void)cudaFree(p); }

static cudaStream_t stream_of(sp_gpt2_dev *k) {
  return (cudaStream_t)sp_gpt2_gpu_stream(k);
}

static int dev_zero(sp_gpt2_dev *k, void *p, size_t bytes, sp_diag *d) {
  SP_CUDA_CHECK(d, cudaMemsetAsync(p, 0, bytes, stream_of(k)));
  return 0;
}

static int dev_to_f32(sp_gpt2_dev *k, float *dst, const void *src, sp_dtype st,
                      size_t n, const char *fqn, sp_diag *d) {
  int rc = sp_cuda_cast(dst, SP_FLOAT32, src, st, n, stream_of(k));
  if (rc != 0)
    return sp_diag_set(d, rc,
                       "%s:%d: %s: cast from %s failed (the CUDA "
                       "error is logged above)",
                       __FILE__, __LINE__, fqn, sp_dtype_name(st));
  return 0;
}

/* The kernel leaves the sum on the device: it is read back here. */
static int dev_softmax_xent_fwd(sp_gpt2_dev *k, float *probs,
                                const int32_t *tgt, int N, int V, double *rows,
                                double *total, double *sum, sp_diag *d) {
  int rc = sp_gpt2_gpu_softmax_xent_fwd(k, probs, tgt, N, V, rows, total, d);
  if (rc != 0) return rc;
  SP_CUDA_CHECK(d, cudaMemcpyAsync(sum, total, sizeof *sum,
                                   cudaMemcpyDeviceToHost, stream_of(k)));
  SP_CUDA_CHECK(d, cudaStreamSynchronize(stream_of(k)));
  return 0;
}

static const sp_gpt2_ops cuda_ops = {
    .layout = &sp_gpt2_cuda_layout,
    .alloc = dev_alloc,
    .release = dev_release,
    .zero = dev_zero,
    .to_f32 = dev_to_f32,
    .grad_add = sp_gpt2_gpu_grad_add,
    .mask = sp_gpt2_gpu_mask,
    .embed_fwd = sp_gpt2_gpu_embed_fwd,
    .layernorm_fwd = sp_gpt2_gpu_layernorm_fwd,
    .matmul_fwd = sp_gpt2_gpu_matmul_fwd,
    .attention_fwd = sp_gpt2_gpu_attention_fwd,
    .gelu_fwd = sp_gpt2_gpu_gelu_fwd,
    .add = sp_gpt2_gpu_add,
    .round = sp_gpt2_gpu_round,
    .logits_fwd = sp_gpt2_gpu_logits_fwd,
    .softmax_xent_fwd = dev_softmax_xent_fwd,
    .softmax_xent_bwd = sp_gpt2_gpu_softmax_xent_bwd,
    .logits_bwd = sp_gpt2_gpu_logits_bwd,
    .layernorm_bwd = sp_gpt2_gpu_layernorm_bwd,
    .matmul_bwd = sp_gpt2_gpu_matmul_bwd,
    .attention_bwd = sp_gpt2_gpu_attention_bwd,
    .gelu_bwd = sp_gpt2_gpu_gelu_bwd,
    .wte_bwd = sp_gpt2_gpu_wte_bwd,
    .wte_bwd_rows = NULL,
    .wpe_bwd = sp_gpt2_gpu_wpe_bwd,
};

/* ------------------------------------------------------------------ */
/* memory                                                              */
/* ------------------------------------------------------------------ */

void sp_gpt2_cuda_free(sp_gpt2_cuda *c) {
  if (c == NULL) return;
  /* kernels of the last step may still use the memory */
  (void)cudaStreamSynchronize(c->st);
  sp_gpt2_acts_release(dev_release, &c->a);
  sp_gpt2_gpu_free(c->k);
  free(c->htok);
  free(c->htgt);
  free(c);
}

static int cuda_new(sp_gpt2_cuda *c, const sp_gpt2 *g, const sp_gpt2_shape *sh,
                    sp_diag *d) {
  int rc = sp_gpt2_acts_alloc(&sp_gpt2_cuda_layout, dev_alloc, g, sh, &c->a, d);
  if (rc != 0) return rc;
  size_t N = sh->B * sh->T;
  c->htok = calloc(N, sizeof *c->htok);
  c->htgt = calloc(N, sizeof *c->htgt);
  if (!c->htok || !c->htgt) return sp_diag_set(d, SP_ENOMEM, "no memory");
  rc = sp_gpt2_gpu_new(c->st, &c->k, d);
  if (rc != 0) return rc;
  c->step = (sp_gpt2_step){g, &cuda_ops, c->k, &c->a};
  /* device memory starts undefined; the uploads and the forward write
   * everything before it is read, but a mistake then reads zeros */
  SP_CUDA_CHECK(d, cudaMemsetAsync(c->a.tok, 0, N * 4, c->st));
  SP_CUDA_CHECK(d, cudaMemsetAsync(c->a.tgt, 0, N * 4, c->st));
  return 0;
}

int sp_gpt2_cuda_new_with(const sp_gpt2 *g, const sp_gpt2_shape *sh,
                          void *stream, sp_gpt2_cuda **out, sp_diag *d) {
  if (g == NULL || sh == NULL || out == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda_new: NULL argument");
  *out = NULL;
  sp_gpt2_cuda *c = calloc(1, sizeof *c);
  if (c == NULL) return sp_diag_set(d, SP_ENOMEM, "no memory");
  c->st = (cudaStream_t)stream;
  int rc = cuda_new(c, g, sh, d);
  if (rc != 0) {
    sp_gpt2_cuda_free(c);
    return sp_diag_prefix(d, rc, "GPT-2 on the GPU (%zu x %zu tokens)", sh->B,
                          sh->T);
  }
  *out = c;
  return 0;
}

int sp_gpt2_cuda_new(const sp_gpt2 *g, size_t B, size_t T, void *stream,
                     sp_gpt2_cuda **out, sp_diag *d) {
  sp_gpt2_shape sh = {B, T, false, false};
  return sp_gpt2_cuda_new_with(g, &sh, stream, out, d);
}

sp_act_bytes sp_gpt2_cuda_act_bytes(const sp_gpt2_cuda *c) {
  return c ? c->a.mem : (sp_act_bytes){{0}, 0};
}

int32_t *sp_gpt2_cuda_tokens(sp_gpt2_cuda *c) { return c ? c->htok : NULL; }
int32_t *sp_gpt2_cuda_targets(sp_gpt2_cuda *c) { return c ? c->htgt : NULL; }

int sp_gpt2_cuda_upload(sp_gpt2_cuda *c, sp_diag *d) {
  if (c == NULL) return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda_upload: NULL");
  const sp_gpt2 *g = c->step.g;
  size_t N = c->a.B * c->a.T;
  /* the CPU checks tokens in embed_forward and targets in head_forward */
  for (size_t i = 0; i < N; i++) {
    if (c->htok[i] < 0 || c->htok[i] >= g->V)
      return sp_diag_set(d, SP_ERANGE, "token %d at %zu: vocabulary of %lld",
                         c->htok[i], i, (long long)g->V);
    if (c->htgt[i] < 0 || c->htgt[i] >= g->V)
      return sp_diag_set(d, SP_ERANGE, "target %d at %zu: vocabulary of %lld",
                         c->htgt[i], i, (long long)g->V);
  }
  SP_CUDA_CHECK(d, cudaMemcpyAsync(c->a.tok, c->htok, N * 4,
                                   cudaMemcpyHostToDevice, c->st));
  SP_CUDA_CHECK(d, cudaMemcpyAsync(c->a.tgt, c->htgt, N * 4,
                                   cudaMemcpyHostToDevice, c->st));
  /* the host arrays take the next micro-batch right after */
  SP_CUDA_CHECK(d, cudaStreamSynchronize(c->st));
  return 0;
}

double *sp_gpt2_cuda_scalar(sp_gpt2_cuda *c) { return c ? c->a.scalar : NULL; }

int sp_gpt2_cuda_set_scalar(sp_gpt2_cuda *c, double v, sp_diag *d) {
  if (c == NULL) return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda: NULL");
  c->hscalar = v;
  SP_CUDA_CHECK(d, cudaMemcpyAsync(c->a.scalar, &c->hscalar, sizeof v,
                                   cudaMemcpyHostToDevice, c->st));
  return 0;
}

int sp_gpt2_cuda_get_scalar(sp_gpt2_cuda *c, double *v, sp_diag *d) {
  if (c == NULL || v == NULL)
    return sp_diag_set(d, SP_EINVAL, "sp_gpt2_cuda: NULL");
  SP_CUDA_CHECK(d, cudaMemcpyAsync(&c->hscalar, c->a.scalar, sizeof *v,
                                   cudaMemcpyDeviceToHost, c->st));
  SP_CUDA_CHECK(d, cudaStreamSynchronize(c->st));
  *v = c->hscalar;
  return 0;
}

/* ------------------------------------------------------------------ */
/* the step's pieces (gpt2_step.c's, on the GPU)                       */
/* ------------------------------------------------------------------ */

static int check(const sp_gpt2_cuda *c, const sp_gpt2_io *io, sp_diag *d) {
  if (c == NULL || io == NULL || io->param == NULL || io->param_dtype == NULL)
    return sp_diag_set(d, SP_EINVAL,
                       "sp_gpt2_cuda: NULL argument or "
                       "callback");
  return 0;
}

int sp_gpt2_cuda_embed_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               sp_diag *d) {
  int rc = check(c, io, d);
  return rc ? rc : sp_gpt2_step_embed_forward(&c->step, io, d);
}

int sp_gpt2_cuda_block_forward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                               sp_diag *d) {
  int rc = check(c, io, d);
  return rc ? rc : sp_gpt2_step_block_forward(&c->step, l, io, d);
}

int sp_gpt2_cuda_head_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                              double denom, double *loss, sp_diag *d) {
  int rc = check(c, io, d);
  if (rc == 0) rc = sp_gpt2_step_check_denom(denom, d);
  return rc ? rc : sp_gpt2_step_head_forward(&c->step, io, denom, loss, d);
}

int sp_gpt2_cuda_head_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               double denom, sp_diag *d) {
  int rc = check(c, io, d);
  if (rc == 0) rc = sp_gpt2_step_check_denom(denom, d);
  return rc ? rc : sp_gpt2_step_head_backward(&c->step, io, denom, d);
}

int sp_gpt2_cuda_block_backward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                                sp_diag *d) {
  int rc = check(c, io, d);
  return rc ? rc : sp_gpt2_step_block_backward(&c->step, l, io, d);
}

int sp_gpt2_cuda_embed_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                                sp_diag *d) {
  int rc = check(c, io, d);
  return rc ? rc : sp_gpt2_step_embed_backward(&c->step, io, d);
}
