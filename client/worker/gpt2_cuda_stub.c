/* gpt2_cuda.h in a build without CUDA: every call fails with
 * SP_EUNSUPPORTED, so the trainer needs no #ifdef of its own. With CUDA,
 * gpt2_cuda.c defines these instead and CMake leaves this file out. */
#include "gpt2_cuda.h"

static int unsupported(sp_diag *d) {
  return sp_diag_set(d, SP_EUNSUPPORTED,
                     "GPT-2 on a GPU needs a CUDA build (--device cpu)");
}

int sp_gpt2_cuda_new(const sp_gpt2 *g, size_t B, size_t T, void *stream,
                     sp_gpt2_cuda **out, sp_diag *d) {
  (void)g, (void)B, (void)T, (void)stream;
  if (out) *out = NULL;
  return unsupported(d);
}

int sp_gpt2_cuda_new_with(const sp_gpt2 *g, const sp_gpt2_shape *sh,
                          void *stream, sp_gpt2_cuda **out, sp_diag *d) {
  (void)g, (void)sh, (void)stream;
  if (out) *out = NULL;
  return unsupported(d);
}

sp_act_bytes sp_gpt2_cuda_act_bytes(const sp_gpt2_cuda *c) {
  (void)c;
  return (sp_act_bytes){{0}, 0};
}

void sp_gpt2_cuda_free(sp_gpt2_cuda *c) { (void)c; }

int32_t *sp_gpt2_cuda_tokens(sp_gpt2_cuda *c) {
  (void)c;
  return NULL;
}

int32_t *sp_gpt2_cuda_targets(sp_gpt2_cuda *c) {
  (void)c;
  return NULL;
}

int sp_gpt2_cuda_upload(sp_gpt2_cuda *c, sp_diag *d) {
  (void)c;
  return unsupported(d);
}

int sp_gpt2_cuda_embed_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               sp_diag *d) {
  (void)c, (void)io;
  return unsupported(d);
}

int sp_gpt2_cuda_block_forward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                               sp_diag *d) {
  (void)c, (void)l, (void)io;
  return unsupported(d);
}

int sp_gpt2_cuda_head_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                              double denom, double *loss, sp_diag *d) {
  (void)c, (void)io, (void)denom, (void)loss;
  return unsupported(d);
}

int sp_gpt2_cuda_head_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               double denom, sp_diag *d) {
  (void)c, (void)io, (void)denom;
  return unsupported(d);
}

int sp_gpt2_cuda_block_backward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                                sp_diag *d) {
  (void)c, (void)l, (void)io;
  return unsupported(d);
}

int sp_gpt2_cuda_embed_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                                sp_diag *d) {
  (void)c, (void)io;
  return unsupported(d);
}

double *sp_gpt2_cuda_scalar(sp_gpt2_cuda *c) {
  (void)c;
  return NULL;
}

int sp_gpt2_cuda_set_scalar(sp_gpt2_cuda *c, double v, sp_diag *d) {
  (void)c, (void)v;
  return unsupported(d);
}

int sp_gpt2_cuda_get_scalar(sp_gpt2_cuda *c, double *v, sp_diag *d) {
  (void)c, (void)v;
  return unsupported(d);
}
