/* Host storage: the memory-ops table (fsdp_internal.h) of a runtime on the
 * CPU, and of "cpu-staged", which takes the device paths on host memory.
 * Every operation is synchronous, so lanes and marks are no-ops. The GPU's
 * table (fsdp_cuda.c) and its kernels must give these bits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/vec_clones.h"
#include "cast/cast.h"
#include "cast/cast_scalar.h"
#include "fsdp_internal.h"

/* Elements per pass of the low-precision divide: its float32 scratch lives
 * on the stack (16 KiB), so it neither allocates per step nor needs a
 * scratch as large as the largest unit (GPT-2's root is 39 M elements:
 * 158 MB of float32). It is element-wise, so the passes give the bits of
 * one pass over everything. The optimizer's kernels below need no scratch
 * (one element at a time, through cast_scalar.h). */
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
    return sp_diag_set(d, SP_ETOOBIG, "%zu elements of %zu bytes overflow", n,
                       esize);
  *out = sp_fsdp_xcalloc(n, esize);
  if (!*out)
    return sp_diag_set(d, SP_ENOMEM,
                       "no memory for %zu elements of %zu "
                       "bytes",
                       n, esize);
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
    return sp_diag_set(d, rc, "dividing %s gradients by %g", sp_dtype_name(dt),
                       div);
  return 0;
}

static bool floating(sp_dtype dt) {
  return dt == SP_FLOAT64 || dt == SP_FLOAT32 || dt == SP_BFLOAT16 ||
         dt == SP_FLOAT16;
}

/* v rounded once to dt, as a double (exact): what an element of dt holds */
static double round_to(double v, sp_dtype dt) {
  uint64_t tmp;
  sp_elem_store_f64(&tmp, dt, 0, v);
  return sp_elem_load_f64(&tmp, dt, 0);
}

/* The kernels below are the CPU references of fsdp_cuda_kernels.cu's:
 * the same element helpers (cast_scalar.h), the same double operations in
 * the same order. ISO C (no FMA contraction), like the kernels' explicitly
 * rounded intrinsics. */

static int host_acc_div(sp_fsdp *f, sp_fsdp_lane l, void *dst, sp_dtype dt,
                        void *src, sp_dtype st, size_t n, double div,
                        sp_diag *d) {
  if (!floating(dt) || !floating(st))
    return sp_diag_set(d, SP_EINVAL, "accumulating %s into %s gradients",
                       sp_dtype_name(st), sp_dtype_name(dt));
  int rc = host_scale_div(f, l, src, st, n, div, d);
  if (rc < 0) return rc;
  if (dt == SP_FLOAT32 && st == SP_FLOAT32) {
    /* the loop below for float32 (round_to is the identity), with the
     * hardware's conversions, which round as the helpers do: through the
     * helpers this was 4 % of a gpt2-mini step at W = 1 */
    float *restrict o = dst;
    const float *restrict s = src;
    for (size_t i = 0; i < n; i++) o[i] = (float)((double)o[i] + (double)s[i]);
    return 0;
  }
  for (size_t i = 0; i < n; i++) {
    double v = round_to(sp_elem_load_f64(src, st, i), dt);
    sp_elem_store_f64(dst, dt, i, sp_elem_load_f64(dst, dt, i) + v);
  }
  return 0;
}

static int host_scale(sp_fsdp *f, sp_fsdp_lane l, void *g, sp_dtype gdt,
                      size_t n, double k, sp_diag *d) {
  (void)f, (void)l;
  if (!floating(gdt))
    return sp_diag_set(d, SP_EINVAL, "scaling %s gradients",
                       sp_dtype_name(gdt));
  for (size_t i = 0; i < n; i++)
    sp_elem_store_f64(g, gdt, i, sp_elem_load_f64(g, gdt, i) * k);
  return 0;
}

size_t sp_fsdp_sqsum_chunks(size_t n) {
  return n / SP_FSDP_SQ_CHUNK + (n % SP_FSDP_SQ_CHUNK != 0);
}

double sp_fsdp_sqsum_ref(const void *g, sp_dtype gdt, size_t n) {
  double total = 0;
  for (size_t base = 0; base < n; base += SP_FSDP_SQ_CHUNK) {
    double lane[SP_FSDP_SQ_LANES] = {0};
    for (size_t j = 0; j < SP_FSDP_SQ_CHUNK; j += SP_FSDP_SQ_LANES)
      for (size_t t = 0; t < SP_FSDP_SQ_LANES; t++) {
        size_t i = base + j + t;
        if (i >= n) continue;
        double v = sp_elem_load_f64(g, gdt, i);
        lane[t] += v * v;
      }
    for (size_t s = SP_FSDP_SQ_LANES / 2; s > 0; s /= 2)
      for (size_t t = 0; t < s; t++) lane[t] += lane[t + s];
    total += lane[0];
  }
  return total;
}

static int host_sqsum(sp_fsdp *f, const void *g, sp_dtype gdt, size_t n,
                      double *partial, double *out, sp_diag *d) {
  (void)f, (void)partial;
  if (!floating(gdt))
    return sp_diag_set(d, SP_EINVAL, "norm of %s gradients",
                       sp_dtype_name(gdt));
  *out = sp_fsdp_sqsum_ref(g, gdt, n);
  return 0;
}

static int host_sgd(sp_fsdp *f, void *p, sp_dtype pdt, const void *g,
                    sp_dtype gdt, float *buf, size_t n, double lr,
                    double momentum, double wd, sp_diag *d) {
  (void)f;
  if (!floating(pdt) || !floating(gdt))
    return sp_diag_set(d, SP_EINVAL, "SGD on %s with %s gradients",
                       sp_dtype_name(pdt), sp_dtype_name(gdt));
  for (size_t i = 0; i < n; i++) {
    double pv = sp_elem_load_f64(p, pdt, i);
    double gv = sp_elem_load_f64(g, gdt, i);
    if (wd != 0) gv = gv + wd * pv;
    if (buf) {
      sp_elem_store_f64(buf, SP_FLOAT32, i, momentum * (double)buf[i] + gv);
      gv = (double)buf[i];
    }
    sp_elem_store_f64(p, pdt, i, pv - lr * gv);
  }
  return 0;
}

/* host_adamw's loop for float32 parameters and gradients: the same double
 * operations in the same order, with the hardware's float/double
 * conversions (IEEE round-to-nearest-even, as the helpers round: the same
 * bits for every value but a NaN's payload) and the arguments in locals,
 * so that it vectorizes, at the CPU's widest (SP_VEC_CLONES: the same
 * bits). Through the helpers, element by element, AdamW was 8 % of a
 * gpt2-mini step at W = 1 (0.2 s of 2.4); in SSE2's two double lanes 11 %
 * of a GPT-2 124M one (1.4 s of 13). */
SP_VEC_CLONES
static void adamw_f32(float *restrict p, const float *restrict g,
                      float *restrict m, float *restrict v, size_t n,
                      const sp_fsdp_adamw_args *a) {
  const double lrwd = a->lrwd, beta1 = a->beta1, omb1 = a->omb1,
               beta2 = a->beta2, omb2 = a->omb2, bc1 = a->bc1, bc2 = a->bc2,
               lr = a->lr, eps = a->eps;
  for (size_t i = 0; i < n; i++) {
    double pv = (double)p[i], gv = (double)g[i];
    pv = pv - lrwd * pv;
    float mi = (float)(beta1 * (double)m[i] + omb1 * gv);
    float vi = (float)(beta2 * (double)v[i] + omb2 * (gv * gv));
    m[i] = mi;
    v[i] = vi;
    double mh = (double)mi / bc1, vh = (double)vi / bc2;
    p[i] = (float)(pv - (lr * mh) / (sqrt(vh) + eps));
  }
}

static int host_adamw(sp_fsdp *f, void *p, sp_dtype pdt, const void *g,
                      sp_dtype gdt, float *m, float *v, size_t n,
                      const sp_fsdp_adamw_args *a, sp_diag *d) {
  (void)f;
  if (!floating(pdt) || !floating(gdt))
    return sp_diag_set(d, SP_EINVAL, "AdamW on %s with %s gradients",
                       sp_dtype_name(pdt), sp_dtype_name(gdt));
  if (pdt == SP_FLOAT32 && gdt == SP_FLOAT32) {
    adamw_f32(p, g, m, v, n, a);
    return 0;
  }
  for (size_t i = 0; i < n; i++) {
    double pv = sp_elem_load_f64(p, pdt, i);
    double gv = sp_elem_load_f64(g, gdt, i);
    pv = pv - a->lrwd * pv;
    sp_elem_store_f64(m, SP_FLOAT32, i, a->beta1 * (double)m[i] + a->omb1 * gv);
    sp_elem_store_f64(v, SP_FLOAT32, i,
                      a->beta2 * (double)v[i] + a->omb2 * (gv * gv));
    double mh = (double)m[i] / a->bc1, vh = (double)v[i] / a->bc2;
    sp_elem_store_f64(p, pdt, i, pv - (a->lr * mh) / (sqrt(vh) + a->eps));
  }
  return 0;
}

static int host_to_host(sp_fsdp *f, void *host, const void *src, size_t bytes,
                        sp_diag *d) {
  (void)f, (void)d;
  if (host != src) memcpy(host, src, bytes);
  return 0;
}

static int host_from_host(sp_fsdp *f, void *dst, const void *host, size_t bytes,
                          sp_diag *d) {
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
    .name = NAME, .device = DEVICE, .alloc = host_alloc,                       \
    .release = host_release, .zero = host_zero, .copy = host_copy,             \
    .cast = host_cast, .scale_div = host_scale_div, .acc_div = host_acc_div,   \
    .scale = host_scale, .sqsum = host_sqsum, .sgd = host_sgd,                 \
    .adamw = host_adamw, .to_host = host_to_host, .from_host = host_from_host, \
    .mark = host_slot_nop, .wait_mark = host_slot_nop, .drain = host_drain,    \
    .handoff = host_handoff, .thread_init = NULL, .destroy = host_destroy,     \
  }

const sp_fsdp_mem_ops sp_fsdp_host_ops = SP_HOST_OPS("cpu", false);

/* "cpu-staged": host storage that the runtime treats as a device's, so
 * every host access (initialisation, checkpoints, loads) goes through the
 * staging paths a GPU takes, and a machine without one can test them. */
const sp_fsdp_mem_ops sp_fsdp_staged_ops = SP_HOST_OPS("cpu-staged", true);
