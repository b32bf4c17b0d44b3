/* The worker's loader of its GPU models (worker_cuda.h), with no GPU: the
 * built module has every function the loader resolves; the loader finds
 * it beside the worker; a missing module, or one lacking a function, is an
 * error naming the file (and the function) with dlerror()'s text, and
 * every forwarder then fails with it instead of crashing; and once a
 * module is loaded, each forwarder passes its arguments in place to its
 * own namesake and returns what that returned (checked against a fake
 * module that records each call, worker_cuda_fake.c).
 *
 * Linked to the loader alone: the GPU code itself (sp_worker_cuda, which
 * the other tests link) defines the same functions. The loader loads once
 * per process, so the cases run in this order. */
#include <dlfcn.h>
#include <limits.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "support/worker_cuda_fake.h"
#include "worker/gpt2_cuda.h"
#include "worker/mlp_cuda.h"
#include "worker/worker_cuda.h"

/* Every name resolves in the module the build made, loaded as the worker
 * loads it (RTLD_NOW: cuBLAS and the CUDA runtime load without a GPU). */
static void test_module_has_every_symbol(void **state) {
  (void)state;
  void *h = dlopen(SP_WORKER_CUDA_MODULE_FILE, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL)
    fail_msg("dlopen %s: %s", SP_WORKER_CUDA_MODULE_FILE, dlerror());
  /* both headers' functions, 16 of gpt2_cuda.h and 14 of mlp_cuda.h */
  assert_int_equal(sp_worker_cuda_symbol_count(), 30);
  assert_null(sp_worker_cuda_symbol(30));
  for (size_t i = 0; i < sp_worker_cuda_symbol_count(); i++) {
    const char *name = sp_worker_cuda_symbol(i);
    assert_non_null(name);
    if (dlsym(h, name) == NULL) fail_msg("%s: %s", name, dlerror());
  }
  /* left loaded: unloading cuBLAS gains the test nothing */
}

/* Without the variable, the path is the one the build gives it relative to
 * the program: this test, like the worker in bin/, sits one folder below
 * the build, so it names the same file. */
static void test_default_path(void **state) {
  (void)state;
  unsetenv(SP_WORKER_CUDA_ENV);
  char path[4096];
  sp_diag d = {{0}};
  assert_int_equal(sp_worker_cuda_module_path(path, sizeof path, &d), 0);
  char got[PATH_MAX], want[PATH_MAX];
  if (realpath(path, got) == NULL) fail_msg("%s does not exist", path);
  assert_non_null(realpath(SP_WORKER_CUDA_MODULE_FILE, want));
  assert_string_equal(got, want);
  /* too small a buffer is an error, not a cut path */
  assert_int_equal(sp_worker_cuda_module_path(path, 8, &d), SP_ETOOBIG);
}

static void test_missing_module(void **state) {
  (void)state;
  const char *missing = "/nonexistent-sp-dir/" SP_WORKER_CUDA_FILE;
  setenv(SP_WORKER_CUDA_ENV, missing, 1);
  sp_diag d = {{0}};
  assert_int_equal(sp_worker_cuda_load(&d), SP_EUNSUPPORTED);
  assert_non_null(strstr(d.msg, missing));
  assert_non_null(strstr(d.msg, "cannot open shared object file"));
  assert_non_null(strstr(d.msg, SP_WORKER_CUDA_ENV));
  /* each forwarder says the same, and leaves no object behind */
  sp_gpt2_cuda *c = (sp_gpt2_cuda *)&d;
  memset(&d, 0, sizeof d);
  assert_int_equal(sp_gpt2_cuda_new(NULL, 1, 1, NULL, &c, &d), SP_EUNSUPPORTED);
  assert_null(c);
  assert_non_null(strstr(d.msg, missing));
  sp_mlp_cuda *m = (sp_mlp_cuda *)&d;
  assert_int_equal(sp_mlp_cuda_new(NULL, 1, NULL, &m, &d), SP_EUNSUPPORTED);
  assert_null(m);
  assert_int_equal(sp_mlp_cuda_read_loss(NULL, NULL, &d), SP_EUNSUPPORTED);
  /* those that cannot fail do nothing */
  assert_null(sp_gpt2_cuda_tokens(NULL));
  assert_null(sp_mlp_cuda_loss_ptr(NULL));
  assert_int_equal(sp_gpt2_cuda_act_bytes(NULL).total, 0);
  sp_gpt2_cuda_free(NULL);
  sp_mlp_cuda_free(NULL);
}

static void test_missing_symbol(void **state) {
  (void)state;
  setenv(SP_WORKER_CUDA_ENV, SP_WORKER_CUDA_FAKE_INCOMPLETE, 1);
  sp_diag d = {{0}};
  assert_int_equal(sp_worker_cuda_load(&d), SP_EIO);
  assert_non_null(strstr(d.msg, SP_WORKER_CUDA_FAKE_INCOMPLETE));
  assert_non_null(strstr(d.msg, "lacks sp_mlp_cuda_write_dy"));
  assert_non_null(strstr(d.msg, "undefined symbol"));
  /* nothing stays loaded: the next call tries again, and fails again */
  memset(&d, 0, sizeof d);
  assert_int_equal(sp_gpt2_cuda_upload(NULL, &d), SP_EIO);
  assert_non_null(strstr(d.msg, "lacks sp_mlp_cuda_write_dy"));
}

/* The fake's record of the last call. */
static const sp_fake_call *g_last_call;
static sp_diag g_d;

/* Checks that the last call was fn's with exactly the n arguments want. */
static void expect_args(const char *fn, const uint64_t *want, size_t n) {
  const sp_fake_call *c = g_last_call;
  assert_non_null(c->fn);
  assert_string_equal(c->fn, fn);
  assert_int_equal(c->n, n);
  for (size_t i = 0; i < n; i++)
    if (c->a[i] != want[i])
      fail_msg("%s: argument %zu is 0x%llx, want 0x%llx", fn, i + 1,
               (unsigned long long)c->a[i], (unsigned long long)want[i]);
  /* the fake wrote into the caller's diag, when it took one */
  if (strncmp(g_d.msg, "fake ", 5) == 0) assert_string_equal(g_d.msg + 5, fn);
  memset(&g_d, 0, sizeof g_d);
}

/* The arguments as an array of uint64_t (each converted as by assignment),
 * and their count. */
#define EXPECT(fn, ...)                            \
  expect_args(fn, (const uint64_t[]){__VA_ARGS__}, \
              sizeof((const uint64_t[]){__VA_ARGS__}) / sizeof(uint64_t))

static uint64_t P(const void *p) { return (uint64_t)(uintptr_t)p; }
static uint64_t F(double v) {
  uint64_t u;
  memcpy(&u, &v, sizeof u);
  return u;
}
/* A distinct address per argument: never dereferenced. */
#define A(n) ((void *)(uintptr_t)(0x10000u * (n)))
#define D (&g_d)

static void test_forwarding(void **state) {
  (void)state;
  setenv(SP_WORKER_CUDA_ENV, SP_WORKER_CUDA_FAKE, 1);
  assert_int_equal(sp_worker_cuda_load(&g_d), 0);
  assert_int_equal(sp_worker_cuda_load(&g_d), 0); /* once */
  void *h = dlopen(SP_WORKER_CUDA_FAKE, RTLD_NOW | RTLD_NOLOAD);
  assert_non_null(h); /* the loader's */
  sp_fake_last_fn last = (sp_fake_last_fn)dlsym(h, "sp_fake_last");
  assert_non_null(last);
  g_last_call = last();
  const int rc = SP_FAKE_RC;
  void *off = (char *)A(1) + SP_FAKE_PTR_OFFSET;

  /* gpt2_cuda.h */
  sp_gpt2_cuda *c = NULL;
  assert_int_equal(sp_gpt2_cuda_new(A(1), 2, 3, A(4), &c, D), rc);
  EXPECT("sp_gpt2_cuda_new", P(A(1)), 2, 3, P(A(4)), P(&c), P(D));
  assert_ptr_equal(c, off);
  c = NULL;
  assert_int_equal(sp_gpt2_cuda_new_with(A(1), A(2), A(3), &c, D), rc);
  EXPECT("sp_gpt2_cuda_new_with", P(A(1)), P(A(2)), P(A(3)), P(&c), P(D));
  assert_ptr_equal(c, off);
  sp_act_bytes b = sp_gpt2_cuda_act_bytes(A(1));
  EXPECT("sp_gpt2_cuda_act_bytes", P(A(1)));
  assert_int_equal(b.cat[0], 1);
  assert_int_equal(b.cat[3], 4);
  assert_int_equal(b.total, 10);
  sp_gpt2_cuda_free(A(1));
  EXPECT("sp_gpt2_cuda_free", P(A(1)));
  assert_ptr_equal(sp_gpt2_cuda_tokens(A(1)), off);
  EXPECT("sp_gpt2_cuda_tokens", P(A(1)));
  assert_ptr_equal(sp_gpt2_cuda_targets(A(1)), off);
  EXPECT("sp_gpt2_cuda_targets", P(A(1)));
  assert_int_equal(sp_gpt2_cuda_upload(A(1), D), rc);
  EXPECT("sp_gpt2_cuda_upload", P(A(1)), P(D));
  assert_int_equal(sp_gpt2_cuda_embed_forward(A(1), A(2), D), rc);
  EXPECT("sp_gpt2_cuda_embed_forward", P(A(1)), P(A(2)), P(D));
  assert_int_equal(sp_gpt2_cuda_block_forward(A(1), 2, A(3), D), rc);
  EXPECT("sp_gpt2_cuda_block_forward", P(A(1)), 2, P(A(3)), P(D));
  assert_int_equal(sp_gpt2_cuda_head_forward(A(1), A(2), 3.5, A(4), D), rc);
  EXPECT("sp_gpt2_cuda_head_forward", P(A(1)), P(A(2)), F(3.5), P(A(4)), P(D));
  assert_int_equal(sp_gpt2_cuda_head_backward(A(1), A(2), 3.5, D), rc);
  EXPECT("sp_gpt2_cuda_head_backward", P(A(1)), P(A(2)), F(3.5), P(D));
  assert_int_equal(sp_gpt2_cuda_block_backward(A(1), 2, A(3), D), rc);
  EXPECT("sp_gpt2_cuda_block_backward", P(A(1)), 2, P(A(3)), P(D));
  assert_int_equal(sp_gpt2_cuda_embed_backward(A(1), A(2), D), rc);
  EXPECT("sp_gpt2_cuda_embed_backward", P(A(1)), P(A(2)), P(D));
  assert_ptr_equal(sp_gpt2_cuda_scalar(A(1)), off);
  EXPECT("sp_gpt2_cuda_scalar", P(A(1)));
  assert_int_equal(sp_gpt2_cuda_set_scalar(A(1), -2.25, D), rc);
  EXPECT("sp_gpt2_cuda_set_scalar", P(A(1)), F(-2.25), P(D));
  assert_int_equal(sp_gpt2_cuda_get_scalar(A(1), A(2), D), rc);
  EXPECT("sp_gpt2_cuda_get_scalar", P(A(1)), P(A(2)), P(D));

  /* mlp_cuda.h */
  sp_mlp_cuda *m = NULL;
  assert_int_equal(sp_mlp_cuda_new(A(1), 2, A(3), &m, D), rc);
  EXPECT("sp_mlp_cuda_new", P(A(1)), 2, P(A(3)), P(&m), P(D));
  assert_ptr_equal(m, off);
  sp_mlp_cuda_free(A(1));
  EXPECT("sp_mlp_cuda_free", P(A(1)));
  assert_int_equal(sp_mlp_cuda_set_batch(A(1), A(2), A(3), D), rc);
  EXPECT("sp_mlp_cuda_set_batch", P(A(1)), P(A(2)), P(A(3)), P(D));
  assert_int_equal(sp_mlp_cuda_forward(A(1), 2, A(3), 4, D), rc);
  EXPECT("sp_mlp_cuda_forward", P(A(1)), 2, P(A(3)), 4, P(D));
  assert_int_equal(sp_mlp_cuda_loss(A(1), SP_BFLOAT16, D), rc);
  EXPECT("sp_mlp_cuda_loss", P(A(1)), (uint64_t)SP_BFLOAT16, P(D));
  assert_int_equal(sp_mlp_cuda_loss_over(A(1), SP_FLOAT16, 3, true, D), rc);
  EXPECT("sp_mlp_cuda_loss_over", P(A(1)), (uint64_t)SP_FLOAT16, 3, 1, P(D));
  assert_int_equal(sp_mlp_cuda_backward(A(1), 2, A(3), D), rc);
  EXPECT("sp_mlp_cuda_backward", P(A(1)), 2, P(A(3)), P(D));
  assert_int_equal(sp_mlp_cuda_count_step(A(1), A(2), D), rc);
  EXPECT("sp_mlp_cuda_count_step", P(A(1)), P(A(2)), P(D));
  assert_ptr_equal(sp_mlp_cuda_loss_ptr(A(1)), off);
  EXPECT("sp_mlp_cuda_loss_ptr", P(A(1)));
  assert_int_equal(sp_mlp_cuda_read_loss(A(1), A(2), D), rc);
  EXPECT("sp_mlp_cuda_read_loss", P(A(1)), P(A(2)), P(D));
  assert_int_equal(sp_mlp_cuda_read_act(A(1), 2, A(3), D), rc);
  EXPECT("sp_mlp_cuda_read_act", P(A(1)), 2, P(A(3)), P(D));
  assert_int_equal(sp_mlp_cuda_read_dy(A(1), A(2), 3, D), rc);
  EXPECT("sp_mlp_cuda_read_dy", P(A(1)), P(A(2)), 3, P(D));
  assert_int_equal(sp_mlp_cuda_write_act(A(1), 2, A(3), D), rc);
  EXPECT("sp_mlp_cuda_write_act", P(A(1)), 2, P(A(3)), P(D));
  assert_int_equal(sp_mlp_cuda_write_dy(A(1), A(2), 3, SP_FLOAT64, D), rc);
  EXPECT("sp_mlp_cuda_write_dy", P(A(1)), P(A(2)), 3, (uint64_t)SP_FLOAT64,
         P(D));

  /* loaded for good: another path in the variable changes nothing */
  setenv(SP_WORKER_CUDA_ENV, "/nonexistent-sp-dir/x.so", 1);
  assert_int_equal(sp_worker_cuda_load(&g_d), 0);
  dlclose(h); /* the reference NOLOAD took */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_module_has_every_symbol),
      cmocka_unit_test(test_default_path),
      cmocka_unit_test(test_missing_module),
      cmocka_unit_test(test_missing_symbol),
      cmocka_unit_test(test_forwarding),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
