/* The fake GPU models module (worker_cuda_fake.h): every function of
 * gpt2_cuda.h and mlp_cuda.h, defined against the headers' prototypes (a
 * definition that differs fails to compile), recording its call. */
#include "worker_cuda_fake.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "worker/gpt2_cuda.h"
#include "worker/mlp_cuda.h"

static sp_fake_call g_last;

const sp_fake_call *sp_fake_last(void) { return &g_last; }

/* name, then n arguments, each already a uint64_t */
static void record(const char *fn, int n, ...) {
  va_list ap;
  va_start(ap, n);
  memset(&g_last, 0, sizeof g_last);
  g_last.fn = fn;
  g_last.n = n;
  for (int i = 0; i < n && i < 8; i++) g_last.a[i] = va_arg(ap, uint64_t);
  va_end(ap);
}

static uint64_t P(const void *p) { return (uint64_t)(uintptr_t)p; }
static uint64_t F(double v) {
  uint64_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}

/* the diag the forwarder passed is the caller's: the fake writes to it */
static int done(sp_diag *d) {
  if (d) snprintf(d->msg, sizeof d->msg, "fake %s", g_last.fn);
  return SP_FAKE_RC;
}

static void *offset(const void *c) {
  return (char *)(uintptr_t)c + SP_FAKE_PTR_OFFSET;
}

/* gpt2_cuda.h */

int sp_gpt2_cuda_new(const sp_gpt2 *g, size_t B, size_t T, void *stream,
                     sp_gpt2_cuda **out, sp_diag *d) {
  record(__func__, 6, P(g), (uint64_t)B, (uint64_t)T, P(stream), P(out), P(d));
  *out = offset(g);
  return done(d);
}

int sp_gpt2_cuda_new_with(const sp_gpt2 *g, const sp_gpt2_shape *sh,
                          void *stream, sp_gpt2_cuda **out, sp_diag *d) {
  record(__func__, 5, P(g), P(sh), P(stream), P(out), P(d));
  *out = offset(g);
  return done(d);
}

sp_act_bytes sp_gpt2_cuda_act_bytes(const sp_gpt2_cuda *c) {
  record(__func__, 1, P(c));
  return (sp_act_bytes){{1, 2, 3, 4}, 10};
}

void sp_gpt2_cuda_free(sp_gpt2_cuda *c) { record(__func__, 1, P(c)); }

int32_t *sp_gpt2_cuda_tokens(sp_gpt2_cuda *c) {
  record(__func__, 1, P(c));
  return offset(c);
}

int32_t *sp_gpt2_cuda_targets(sp_gpt2_cuda *c) {
  record(__func__, 1, P(c));
  return offset(c);
}

int sp_gpt2_cuda_upload(sp_gpt2_cuda *c, sp_diag *d) {
  record(__func__, 2, P(c), P(d));
  return done(d);
}

int sp_gpt2_cuda_embed_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               sp_diag *d) {
  record(__func__, 3, P(c), P(io), P(d));
  return done(d);
}

int sp_gpt2_cuda_block_forward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                               sp_diag *d) {
  record(__func__, 4, P(c), (uint64_t)l, P(io), P(d));
  return done(d);
}

int sp_gpt2_cuda_head_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                              double denom, double *loss, sp_diag *d) {
  record(__func__, 5, P(c), P(io), F(denom), P(loss), P(d));
  return done(d);
}

int sp_gpt2_cuda_head_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               double denom, sp_diag *d) {
  record(__func__, 4, P(c), P(io), F(denom), P(d));
  return done(d);
}

int sp_gpt2_cuda_block_backward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                                sp_diag *d) {
  record(__func__, 4, P(c), (uint64_t)l, P(io), P(d));
  return done(d);
}

int sp_gpt2_cuda_embed_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                                sp_diag *d) {
  record(__func__, 3, P(c), P(io), P(d));
  return done(d);
}

double *sp_gpt2_cuda_scalar(sp_gpt2_cuda *c) {
  record(__func__, 1, P(c));
  return offset(c);
}

int sp_gpt2_cuda_set_scalar(sp_gpt2_cuda *c, double v, sp_diag *d) {
  record(__func__, 3, P(c), F(v), P(d));
  return done(d);
}

int sp_gpt2_cuda_get_scalar(sp_gpt2_cuda *c, double *v, sp_diag *d) {
  record(__func__, 3, P(c), P(v), P(d));
  return done(d);
}

/* mlp_cuda.h */

int sp_mlp_cuda_new(const sp_mlp *mlp, size_t n, void *stream,
                    sp_mlp_cuda **out, sp_diag *d) {
  record(__func__, 5, P(mlp), (uint64_t)n, P(stream), P(out), P(d));
  *out = offset(mlp);
  return done(d);
}

void sp_mlp_cuda_free(sp_mlp_cuda *g) { record(__func__, 1, P(g)); }

int sp_mlp_cuda_set_batch(sp_mlp_cuda *g, const float *x, const float *t,
                          sp_diag *d) {
  record(__func__, 4, P(g), P(x), P(t), P(d));
  return done(d);
}

int sp_mlp_cuda_forward(sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                        uint64_t global_n, sp_diag *d) {
  record(__func__, 5, P(g), (uint64_t)l, P(io), global_n, P(d));
  return done(d);
}

int sp_mlp_cuda_loss(sp_mlp_cuda *g, sp_dtype out_dtype, sp_diag *d) {
  record(__func__, 3, P(g), (uint64_t)out_dtype, P(d));
  return done(d);
}

int sp_mlp_cuda_loss_over(sp_mlp_cuda *g, sp_dtype out_dtype, uint64_t denom,
                          bool add, sp_diag *d) {
  record(__func__, 5, P(g), (uint64_t)out_dtype, denom, (uint64_t)add, P(d));
  return done(d);
}

int sp_mlp_cuda_backward(sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                         sp_diag *d) {
  record(__func__, 4, P(g), (uint64_t)l, P(io), P(d));
  return done(d);
}

int sp_mlp_cuda_count_step(sp_mlp_cuda *g, const sp_mlp_io *io, sp_diag *d) {
  record(__func__, 3, P(g), P(io), P(d));
  return done(d);
}

double *sp_mlp_cuda_loss_ptr(sp_mlp_cuda *g) {
  record(__func__, 1, P(g));
  return offset(g);
}

int sp_mlp_cuda_read_loss(sp_mlp_cuda *g, double *loss, sp_diag *d) {
  record(__func__, 3, P(g), P(loss), P(d));
  return done(d);
}

int sp_mlp_cuda_read_act(sp_mlp_cuda *g, size_t l, float *host, sp_diag *d) {
  record(__func__, 4, P(g), (uint64_t)l, P(host), P(d));
  return done(d);
}

int sp_mlp_cuda_read_dy(sp_mlp_cuda *g, float *host, size_t count, sp_diag *d) {
  record(__func__, 4, P(g), P(host), (uint64_t)count, P(d));
  return done(d);
}

int sp_mlp_cuda_write_act(sp_mlp_cuda *g, size_t l, const float *host,
                          sp_diag *d) {
  record(__func__, 4, P(g), (uint64_t)l, P(host), P(d));
  return done(d);
}

#ifndef SP_FAKE_INCOMPLETE
int sp_mlp_cuda_write_dy(sp_mlp_cuda *g, const float *host, size_t count,
                         sp_dtype dt, sp_diag *d) {
  record(__func__, 5, P(g), P(host), (uint64_t)count, (uint64_t)dt, P(d));
  return done(d);
}
#endif
