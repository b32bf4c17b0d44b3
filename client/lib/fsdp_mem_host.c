/* Host storage: the memory-ops table (fsdp_internal.h) of a runtime on the
 * CPU, and of "cpu-staged", which takes the device paths on host memory.
 * Every operation is synchronous, so lanes and marks are no-ops. The GPU's
 * table (fsdp_cuda.c) and its kernels must give these bits. */
#include <stdlib.h>
#include <string.h>

#include "cast/cast.h"
#include "fsdp_internal.h"

/* Elements per pass of the low-precision divide and of SGD: their float32
 * or float64 scratch lives on the stack (16 KiB, 32 KiB), so neither
 * allocates per step nor needs a scratch as large as the largest unit
 * (GPT-2's root is 39 M elements: 158 MB of float32). Both are
 * element-wise, so the passes give the bits of one pass over everything. */
#define SP_HOST_CHUNK 2048

/* Scales n elements of dtype dt in place by 1/div (exact rounding of the
 * quotient to dt: computed in double, rounded once). */
static int scale_div(void *buf, sp_dtype dt, size_t n, double div) {
  if (div == 1.0 || n == 0) return 0;
  if (dt == SP_FLOAT32) {
    float *p = buf;
    for (size_t i = 0; i < n; i++) p[i] = (float)((double)p[i] / div);
    return 0;
  }
  if (dt == SP_FLOAT64) {
    double *p = buf;
    for (size_t i = 0; i < n; i++) p[i] /= div;
    return 0;
  }
  /* low precision: via float32, whose quotient rounds to the same value
   * as the exact one for the power-of-two and small factors used here
   * except in rare double-rounding ties; FSDP divides in the low dtype
   * directly, which rounds once as well. */
  float tmp[2 * SP_HOST_CHUNK];
  size_t es = sp_dtype_size(dt);
  for (size_t at = 0; at < n; at += 2 * SP_HOST_CHUNK) {
    size_t k = n - at < 2 * SP_HOST_CHUNK ? n - at : 2 * SP_HOST_CHUNK;
    uint8_t *p = (uint8_t *)buf + at * es;
    int rc = sp_cast(tmp, SP_FLOAT32, p, dt, k);
    if (rc < 0) return rc;
    for (size_t i = 0; i < k; i++) tmp[i] = (float)((double)tmp[i] / div);
    rc = sp_cast(p, dt, tmp, SP_FLOAT32, k);
    if (rc < 0) return rc;
  }
  return 0;
}

static int host_alloc(sp_fsdp *f, size_t n, size_t esize, void **out,
                      sp_diag *d) {
  (void)f;
  if (esize && n > SIZE_MAX / esize)
    return sp_diag_set(d, SP_ETOOBIG, "%zu elements of %zu bytes overflow",
                       n, esize);
  *out = sp_fsdp_xcalloc(n, esize);
  if (!*out)
    return sp_diag_set(d, SP_ENOMEM, "no memory for %zu elements of %zu "
                       "bytes", n, esize);
  return 0;
}

static void host_release(sp_fsdp *f, void *p) {
  (void)f;
  free(p);
}

static int host_zero(sp_fsdp *f, sp_fsdp_lane l, void *p, size_t bytes,
                     sp_diag *d) {
  (void)f, (void)l, (void)d;
  memset(p, 0, bytes);
  return 0;
}

static int host_copy(sp_fsdp *f, sp_fsdp_lane l, void *dst, const void *src,
                     size_t bytes, sp_diag *d) {
  (void)f, (void)l, (void)d;
  if (dst != src) memcpy(dst, src, bytes);
  return 0;
}

static int host_cast(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt,
                     const void *src, sp_dtype st, size_t n, sp_diag *d) {
  (void)f, (void)l;
  int rc = sp_cast(dst, dt, src, st, n);
  if (rc < 0)
    return sp_diag_set(d, rc, "casting %s to %s", sp_dtype_name(st),
                       sp_dtype_name(dt));
  return 0;
}

static int host_scale_div(sp_fsdp *f, sp_fsdp_lane l, void *buf, sp_dtype dt,
                          size_t n, double div, sp_diag *d) {
  (void)f, (void)l;
  int rc = scale_div(buf, dt, n, div);
  if (rc < 0)
    return sp_diag_set(d, rc, "dividing %s gradients by %g",
                       sp_dtype_name(dt), div);
  return 0;
}

static int host_cast_div(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt,
                         void *src, sp_dtype st, size_t n, double div,
                         sp_diag *d) {
  int rc = host_scale_div(f, l, src, st, n, div, d);
  return rc < 0 ? rc : host_cast(f, l, dst, dt, src, st, n, d);
}

/* p -= lr * g, computed in double and rounded once to the master dtype, as
 * the reference trainer does; then zero_grad. */
static int host_sgd(sp_fsdp *f, void *shard, sp_dtype pdt, void *grad,
                    sp_dtype gdt, size_t c, double lr, sp_diag *d) {
  (void)f;
  double p[SP_HOST_CHUNK], g[SP_HOST_CHUNK];
  size_t ps = sp_dtype_size(pdt), gs = sp_dtype_size(gdt);
  int rc = 0;
  for (size_t at = 0; rc == 0 && at < c; at += SP_HOST_CHUNK) {
    size_t k = c - at < SP_HOST_CHUNK ? c - at : SP_HOST_CHUNK;
    uint8_t *sp = (uint8_t *)shard + at * ps, *gp = (uint8_t *)grad + at * gs;
    rc = sp_cast(p, SP_FLOAT64, sp, pdt, k);
    if (rc == 0) rc = sp_cast(g, SP_FLOAT64, gp, gdt, k);
    if (rc == 0) {
      for (size_t i = 0; i < k; i++) p[i] -= lr * g[i];
      rc = sp_cast(sp, pdt, p, SP_FLOAT64, k);
    }
  }
  /* zero_grad: a unit that gets no gradient next step must not be
   * moved again by this one */
  if (rc == 0) memset(grad, 0, c * gs);
  return rc < 0 ? sp_diag_set(d, rc, "%s", sp_strerror(rc)) : 0;
}

static int host_to_host(sp_fsdp *f, void *host, const void *src,
                        size_t bytes, sp_diag *d) {
  (void)f, (void)d;
  if (host != src) memcpy(host, src, bytes);
  return 0;
}

static int host_from_host(sp_fsdp *f, void *dst, const void *host,
                          size_t bytes, sp_diag *d) {
  (void)f, (void)d;
  if (dst != host) memcpy(dst, host, bytes);
  return 0;
}

static int host_slot_nop(sp_fsdp *f, size_t slot, sp_diag *d) {
  (void)f, (void)slot, (void)d;
  return 0;
}

static int host_drain(sp_fsdp *f, sp_fsdp_lane l, sp_diag *d) {
  (void)f, (void)l, (void)d;
  return 0;
}

static int host_handoff(sp_fsdp *f, void *stream, sp_diag *d) {
  (void)f, (void)stream, (void)d;
  return 0;
}

static void host_destroy(sp_fsdp *f) { (void)f; }

/* Both host tables hold the same functions; only the name and whether the
 * runtime treats the storage as a device's differ. */
#define SP_HOST_OPS(NAME, DEVICE)                                              \
  {                                                                            \
      .name = NAME,                                                            \
      .device = DEVICE,                                                        \
      .alloc = host_alloc,                                                     \
      .release = host_release,                                                 \
      .zero = host_zero,                                                       \
      .copy = host_copy,                                                       \
      .cast = host_cast,                                                       \
      .scale_div = host_scale_div,                                             \
      .cast_div = host_cast_div,                                               \
      .sgd = host_sgd,                                                         \
      .to_host = host_to_host,                                                 \
      .from_host = host_from_host,                                             \
      .mark = host_slot_nop,                                                   \
      .wait_mark = host_slot_nop,                                              \
      .drain = host_drain,                                                     \
      .handoff = host_handoff,                                                 \
      .thread_init = NULL,                                                     \
      .destroy = host_destroy,                                                 \
  }

const sp_fsdp_mem_ops sp_fsdp_host_ops = SP_HOST_OPS("cpu", false);

/* "cpu-staged": host storage that the runtime treats as a device's, so
 * every host access (initialisation, checkpoints, loads) goes through the
 * staging paths a GPU takes, and a machine without one can test them. */
const sp_fsdp_mem_ops sp_fsdp_staged_ops = SP_HOST_OPS("cpu-staged", true);
