/* gpt2_cuda.h and mlp_cuda.h in shardplane-worker: each function forwards
 * to its namesake in libshardplane-worker-cuda.so, loaded at the first
 * call (worker_cuda.h says why and where from). */
#include "worker_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpt2_cuda.h"
#include "mlp_cuda.h"

/* Every function of gpt2_cuda.h and mlp_cuda.h: the names resolved in the
 * module and the forwarders below are this one list. */
#define SP_WORKER_CUDA_FNS(X)    \
  X(sp_gpt2_cuda_new)            \
  X(sp_gpt2_cuda_new_with)       \
  X(sp_gpt2_cuda_act_bytes)      \
  X(sp_gpt2_cuda_free)           \
  X(sp_gpt2_cuda_tokens)         \
  X(sp_gpt2_cuda_targets)        \
  X(sp_gpt2_cuda_upload)         \
  X(sp_gpt2_cuda_embed_forward)  \
  X(sp_gpt2_cuda_block_forward)  \
  X(sp_gpt2_cuda_head_forward)   \
  X(sp_gpt2_cuda_head_backward)  \
  X(sp_gpt2_cuda_block_backward) \
  X(sp_gpt2_cuda_embed_backward) \
  X(sp_gpt2_cuda_scalar)         \
  X(sp_gpt2_cuda_set_scalar)     \
  X(sp_gpt2_cuda_get_scalar)     \
  X(sp_mlp_cuda_new)             \
  X(sp_mlp_cuda_free)            \
  X(sp_mlp_cuda_set_batch)       \
  X(sp_mlp_cuda_forward)         \
  X(sp_mlp_cuda_loss)            \
  X(sp_mlp_cuda_loss_over)       \
  X(sp_mlp_cuda_backward)        \
  X(sp_mlp_cuda_count_step)      \
  X(sp_mlp_cuda_loss_ptr)        \
  X(sp_mlp_cuda_read_loss)       \
  X(sp_mlp_cuda_read_act)        \
  X(sp_mlp_cuda_read_dy)         \
  X(sp_mlp_cuda_write_act)       \
  X(sp_mlp_cuda_write_dy)

/* The module's functions. Each pointer's type is taken from the header's
 * prototype (__typeof__, a GNU C keyword gcc and clang accept in C11
 * mode), not written again here: a call below with the wrong arguments
 * fails to compile instead of passing them on through dlsym's void *. */
static struct {
#define SP_FN_FIELD(name) __typeof__(name) *name;
  SP_WORKER_CUDA_FNS(SP_FN_FIELD)
#undef SP_FN_FIELD
} fn;

static const char *const fn_names[] = {
#define SP_FN_NAME(name) #name,
    SP_WORKER_CUDA_FNS(SP_FN_NAME)
#undef SP_FN_NAME
};

/* Set, with release order, once fn is complete; never cleared: the module
 * stays loaded for the life of the process (its objects are in use). */
static atomic_bool g_loaded;
static pthread_mutex_t g_load_lock = PTHREAD_MUTEX_INITIALIZER;

size_t sp_worker_cuda_symbol_count(void) {
  return sizeof fn_names / sizeof fn_names[0];
}

const char *sp_worker_cuda_symbol(size_t i) {
  return i < sp_worker_cuda_symbol_count() ? fn_names[i] : NULL;
}

int sp_worker_cuda_module_path(char *out, size_t cap, sp_diag *d) {
  const char *env = getenv(SP_WORKER_CUDA_ENV);
  int n;
  if (env && *env) {
    n = snprintf(out, cap, "%s", env);
  } else {
    /* the executable's own folder, as `shardplane run` finds the other
     * programs: the build and the install keep the module at the same
     * place relative to it */
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0)
      return sp_diag_set(d, SP_EIO,
                         "the GPU models' module: cannot read "
                         "/proc/self/exe to find it (set " SP_WORKER_CUDA_ENV
                         " to its path)");
    self[len] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) *slash = '\0';
    n = snprintf(out, cap, "%s/%s/%s", slash ? self : ".", SP_WORKER_CUDA_REL,
                 SP_WORKER_CUDA_FILE);
  }
  if (n < 0 || (size_t)n >= cap)
    return sp_diag_set(d, SP_ETOOBIG,
                       "the GPU models' module: its path is over %zu bytes",
                       cap);
  return 0;
}

/* Resolves every name in h into fn; on a missing one, SP_EIO and fn is
 * left partly filled (g_loaded stays false, so it is never read). */
static int resolve_all(void *h, const char *path, sp_diag *d) {
#define SP_FN_RESOLVE(name)                                            \
  {                                                                    \
    (void)dlerror();                                                   \
    void *p = dlsym(h, #name);                                         \
    if (p == NULL) {                                                   \
      const char *why = dlerror();                                     \
      return sp_diag_set(d, SP_EIO,                                    \
                         "the GPU models' module %s lacks %s (%s): a " \
                         "module of another build?",                   \
                         path, #name, why ? why : "a NULL symbol");    \
    }                                                                  \
    /* POSIX: a function's address from dlsym converts to its type */  \
    fn.name = (__typeof__(fn.name))p;                                  \
  }
  SP_WORKER_CUDA_FNS(SP_FN_RESOLVE)
#undef SP_FN_RESOLVE
  return 0;
}

int sp_worker_cuda_load(sp_diag *d) {
  if (atomic_load_explicit(&g_loaded, memory_order_acquire)) return 0;
  pthread_mutex_lock(&g_load_lock);
  int rc = 0;
  if (!atomic_load_explicit(&g_loaded, memory_order_relaxed)) {
    char path[4096];
    rc = sp_worker_cuda_module_path(path, sizeof path, d);
    void *h = NULL;
    if (rc == 0) {
      /* RTLD_NOW: a library or symbol the module lacks fails here, with
       * its name, not at some later call; RTLD_LOCAL: its symbols (and
       * cuBLAS's) stay out of the process's global scope */
      h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
      if (h == NULL) {
        const char *why = dlerror();
        rc = sp_diag_set(d, SP_EUNSUPPORTED,
                         "training on a GPU needs the worker's GPU models, "
                         "%s: %s (set " SP_WORKER_CUDA_ENV " to its path)",
                         path, why ? why : "dlopen failed");
      }
    }
    if (rc == 0) rc = resolve_all(h, path, d);
    if (rc == 0)
      atomic_store_explicit(&g_loaded, true, memory_order_release);
    else if (h)
      dlclose(h);
  }
  pthread_mutex_unlock(&g_load_lock);
  return rc;
}

/* For the functions that cannot report an error: they are only given an
 * object one of the _new functions made, so the module is loaded. */
static bool loaded(void) {
  return atomic_load_explicit(&g_loaded, memory_order_acquire);
}

/* ------------------------------------------------------------------ */
/* gpt2_cuda.h                                                         */
/* ------------------------------------------------------------------ */

int sp_gpt2_cuda_new(const sp_gpt2 *g, size_t B, size_t T, void *stream,
                     sp_gpt2_cuda **out, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  if (rc < 0) {
    if (out) *out = NULL;
    return rc;
  }
  return fn.sp_gpt2_cuda_new(g, B, T, stream, out, d);
}

int sp_gpt2_cuda_new_with(const sp_gpt2 *g, const sp_gpt2_shape *sh,
                          void *stream, sp_gpt2_cuda **out, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  if (rc < 0) {
    if (out) *out = NULL;
    return rc;
  }
  return fn.sp_gpt2_cuda_new_with(g, sh, stream, out, d);
}

sp_act_bytes sp_gpt2_cuda_act_bytes(const sp_gpt2_cuda *c) {
  if (!loaded()) return (sp_act_bytes){{0}, 0};
  return fn.sp_gpt2_cuda_act_bytes(c);
}

void sp_gpt2_cuda_free(sp_gpt2_cuda *c) {
  if (c && loaded()) fn.sp_gpt2_cuda_free(c);
}

int32_t *sp_gpt2_cuda_tokens(sp_gpt2_cuda *c) {
  return loaded() ? fn.sp_gpt2_cuda_tokens(c) : NULL;
}

int32_t *sp_gpt2_cuda_targets(sp_gpt2_cuda *c) {
  return loaded() ? fn.sp_gpt2_cuda_targets(c) : NULL;
}

int sp_gpt2_cuda_upload(sp_gpt2_cuda *c, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_upload(c, d);
}

int sp_gpt2_cuda_embed_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_embed_forward(c, io, d);
}

int sp_gpt2_cuda_block_forward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                               sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_block_forward(c, l, io, d);
}

int sp_gpt2_cuda_head_forward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                              double denom, double *loss, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_head_forward(c, io, denom, loss, d);
}

int sp_gpt2_cuda_head_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                               double denom, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_head_backward(c, io, denom, d);
}

int sp_gpt2_cuda_block_backward(sp_gpt2_cuda *c, size_t l, const sp_gpt2_io *io,
                                sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_block_backward(c, l, io, d);
}

int sp_gpt2_cuda_embed_backward(sp_gpt2_cuda *c, const sp_gpt2_io *io,
                                sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_embed_backward(c, io, d);
}

double *sp_gpt2_cuda_scalar(sp_gpt2_cuda *c) {
  return loaded() ? fn.sp_gpt2_cuda_scalar(c) : NULL;
}

int sp_gpt2_cuda_set_scalar(sp_gpt2_cuda *c, double v, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_set_scalar(c, v, d);
}

int sp_gpt2_cuda_get_scalar(sp_gpt2_cuda *c, double *v, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_gpt2_cuda_get_scalar(c, v, d);
}

/* ------------------------------------------------------------------ */
/* mlp_cuda.h                                                          */
/* ------------------------------------------------------------------ */

int sp_mlp_cuda_new(const sp_mlp *mlp, size_t n, void *stream,
                    sp_mlp_cuda **out, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  if (rc < 0) {
    if (out) *out = NULL;
    return rc;
  }
  return fn.sp_mlp_cuda_new(mlp, n, stream, out, d);
}

void sp_mlp_cuda_free(sp_mlp_cuda *g) {
  if (g && loaded()) fn.sp_mlp_cuda_free(g);
}

int sp_mlp_cuda_set_batch(sp_mlp_cuda *g, const float *x, const float *t,
                          sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_set_batch(g, x, t, d);
}

int sp_mlp_cuda_forward(sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                        uint64_t global_n, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_forward(g, l, io, global_n, d);
}

int sp_mlp_cuda_loss(sp_mlp_cuda *g, sp_dtype out_dtype, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_loss(g, out_dtype, d);
}

int sp_mlp_cuda_loss_over(sp_mlp_cuda *g, sp_dtype out_dtype, uint64_t denom,
                          bool add, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_loss_over(g, out_dtype, denom, add, d);
}

int sp_mlp_cuda_backward(sp_mlp_cuda *g, size_t l, const sp_mlp_io *io,
                         sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_backward(g, l, io, d);
}

int sp_mlp_cuda_count_step(sp_mlp_cuda *g, const sp_mlp_io *io, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_count_step(g, io, d);
}

double *sp_mlp_cuda_loss_ptr(sp_mlp_cuda *g) {
  return loaded() ? fn.sp_mlp_cuda_loss_ptr(g) : NULL;
}

int sp_mlp_cuda_read_loss(sp_mlp_cuda *g, double *loss, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_read_loss(g, loss, d);
}

int sp_mlp_cuda_read_act(sp_mlp_cuda *g, size_t l, float *host, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_read_act(g, l, host, d);
}

int sp_mlp_cuda_read_dy(sp_mlp_cuda *g, float *host, size_t count, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_read_dy(g, host, count, d);
}

int sp_mlp_cuda_write_act(sp_mlp_cuda *g, size_t l, const float *host,
                          sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_write_act(g, l, host, d);
}

int sp_mlp_cuda_write_dy(sp_mlp_cuda *g, const float *host, size_t count,
                         sp_dtype dt, sp_diag *d) {
  int rc = sp_worker_cuda_load(d);
  return rc < 0 ? rc : fn.sp_mlp_cuda_write_dy(g, host, count, dt, d);
}
