/* mlp_cuda.h in a build without CUDA: every call fails with
 * SP_EUNSUPPORTED, so callers (shardplane-worker, the GPU tests) need no
 * #ifdef of their own. With CUDA, mlp_cuda.cu defines these instead and
 * CMake leaves this file out. */
#include "mlp_cuda.h"

static int unsupported(sp_diag *d) {
  return sp_diag_set(d, SP_EUNSUPPORTED,
                     "the reference MLP on a GPU needs a CUDA build");
}

int sp_mlp_cuda_new(const sp_mlp *mlp, size_t n, void *stream,
                    sp_mlp_cuda **out, sp_diag *d) {
  (void)mlp, (void)n, (void)stream;
  if (out) *out = NULL;
  return unsupported(d);
}

void sp_mlp_cuda_free(sp_mlp_cuda *g) { (void)g; }

int sp_mlp_cuda_set_batch(sp_mlp_cuda *g, const float *x, const float *t,
                          sp_diag *d) {
  (void)g, (void)x, (void)t;
  return unsupported(d);
}

int sp_mlp_cuda_forward(sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                        uint64_t global_n, sp_diag *d) {
  (void)g, (void)l, (void)io, (void)global_n;
  return unsupported(d);
}

int sp_mlp_cuda_loss(sp_mlp_cuda *g, sp_dtype out_dtype, sp_diag *d) {
  (void)g, (void)out_dtype;
  return unsupported(d);
}

int sp_mlp_cuda_loss_over(sp_mlp_cuda *g, sp_dtype out_dtype, uint64_t denom,
                          bool add, sp_diag *d) {
  (void)g, (void)out_dtype, (void)denom, (void)add;
  return unsupported(d);
}

int sp_mlp_cuda_backward(sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                         sp_diag *d) {
  (void)g, (void)l, (void)io;
  return unsupported(d);
}

int sp_mlp_cuda_count_step(sp_mlp_cuda *g, const sp_mlp_io *io, sp_diag *d) {
  (void)g, (void)io;
  return unsupported(d);
}

double *sp_mlp_cuda_loss_ptr(sp_mlp_cuda *g) {
  (void)g;
  return NULL;
}

int sp_mlp_cuda_read_loss(sp_mlp_cuda *g, double *loss, sp_diag *d) {
  (void)g, (void)loss;
  return unsupported(d);
}

int sp_mlp_cuda_read_act(sp_mlp_cuda *g, size_t l, float *host, sp_diag *d) {
  (void)g, (void)l, (void)host;
  return unsupported(d);
}

int sp_mlp_cuda_read_dy(sp_mlp_cuda *g, float *host, size_t count, sp_diag *d) {
  (void)g, (void)host, (void)count;
  return unsupported(d);
}

int sp_mlp_cuda_write_act(sp_mlp_cuda *g, size_t l, const float *host,
                          sp_diag *d) {
  (void)g, (void)l, (void)host;
  return unsupported(d);
}

int sp_mlp_cuda_write_dy(sp_mlp_cuda *g, const float *host, size_t count,
                         sp_dtype dt, sp_diag *d) {
  (void)g, (void)host, (void)count, (void)dt;
  return unsupported(d);
}
