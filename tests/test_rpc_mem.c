/* The engine's small-block cache (common/rpc/rpc_mem.h): blocks of a size
 * class come back from its free list, contents survive a realloc across
 * classes and into and out of a large block, calloc zeroes and refuses an
 * overflowing size, the free lists stay within their byte bound, its
 * blocks and malloc's are interchangeable, and no cache (NULL) is plain
 * malloc. Under AddressSanitizer the cache passes
 * everything to malloc, so the reuse and bound checks are skipped there
 * (they say so). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "rpc/rpc_mem.h"

#if defined(__SANITIZE_ADDRESS__)
#define CACHE_ON 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CACHE_ON 0
#endif
#endif
#ifndef CACHE_ON
#define CACHE_ON 1
#endif

static void fill(uint8_t *p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(seed + i * 31);
}

static bool same(const uint8_t *p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != (uint8_t)(seed + i * 31)) return false;
  return true;
}

static void test_reuse_by_class(void **state) {
  (void)state;
  sp_rpc_mem m;
  sp_rpc_mem_init(&m);
  void *a = sp_rpc_mem_alloc(&m, 100); /* the 104-byte class */
  assert_non_null(a);
  assert_int_equal((uintptr_t)a % 16, 0);
  fill(a, 100, 1);
  sp_rpc_mem_free(&m, a);
  void *b = sp_rpc_mem_alloc(&m, 104); /* same class: the same block */
  void *c = sp_rpc_mem_alloc(&m, 100); /* none left: a new one */
  assert_non_null(b);
  assert_non_null(c);
  assert_ptr_not_equal(b, c);
  if (CACHE_ON)
    assert_ptr_equal(a, b);
  else
    print_message("skipped: block reuse (AddressSanitizer: no cache)\n");
  void *big = sp_rpc_mem_alloc(&m, SP_RPC_MEM_MAX + 1); /* no class */
  assert_non_null(big);
  memset(big, 7, SP_RPC_MEM_MAX + 1);
  sp_rpc_mem_free(&m, big);
  sp_rpc_mem_free(&m, b);
  sp_rpc_mem_free(&m, c);
  sp_rpc_mem_free(&m, NULL);
  sp_rpc_mem_release(&m);
}

static void test_realloc_keeps_contents(void **state) {
  (void)state;
  sp_rpc_mem m;
  sp_rpc_mem_init(&m);
  uint8_t *p = sp_rpc_mem_realloc(&m, NULL, 40);
  assert_non_null(p);
  fill(p, 40, 3);
  /* within its class, then to a larger class, then to a large block */
  p = sp_rpc_mem_realloc(&m, p, 64);
  assert_non_null(p);
  assert_true(same(p, 40, 3));
  fill(p, 64, 4);
  p = sp_rpc_mem_realloc(&m, p, 1500);
  assert_non_null(p);
  assert_true(same(p, 64, 4));
  fill(p, 1500, 5);
  p = sp_rpc_mem_realloc(&m, p, 100000);
  assert_non_null(p);
  assert_true(same(p, 1500, 5));
  fill(p, 100000, 6);
  p = sp_rpc_mem_realloc(&m, p, 200000); /* large to large */
  assert_non_null(p);
  assert_true(same(p, 100000, 6));
  p = sp_rpc_mem_realloc(&m, p, 30); /* back into a class */
  assert_non_null(p);
  assert_true(same(p, 30, 6));
  sp_rpc_mem_free(&m, p);
  sp_rpc_mem_release(&m);
}

static void test_zeroed_alloc(void **state) {
  (void)state;
  sp_rpc_mem m;
  sp_rpc_mem_init(&m);
  uint8_t *p = sp_rpc_mem_alloc(&m, 200);
  assert_non_null(p);
  memset(p, 0xAB, 200);
  sp_rpc_mem_free(&m, p); /* a dirty block on the free list */
  uint8_t *z = sp_rpc_mem_calloc(&m, 25, 8);
  assert_non_null(z);
  for (size_t i = 0; i < 200; i++) assert_int_equal(z[i], 0);
  sp_rpc_mem_free(&m, z);
  assert_null(sp_rpc_mem_calloc(&m, SIZE_MAX / 2, 3));
  sp_rpc_mem_release(&m);
}

static void test_free_lists_bounded(void **state) {
  (void)state;
  if (!CACHE_ON) {
    print_message("skipped: free list bound (AddressSanitizer: no cache)\n");
    return;
  }
  sp_rpc_mem m;
  sp_rpc_mem_init(&m);
  enum { N = 3000 };
  void **v = calloc(N, sizeof *v);
  assert_non_null(v);
  for (size_t sz = 24; sz <= SP_RPC_MEM_MAX; sz = sz * 2 + 8) {
    for (int i = 0; i < N; i++) {
      v[i] = sp_rpc_mem_alloc(&m, sz);
      assert_non_null(v[i]);
    }
    for (int i = 0; i < N; i++) sp_rpc_mem_free(&m, v[i]);
    assert_true(m.kept > 0);
    assert_true(m.kept <= SP_RPC_MEM_KEEP_BYTES);
  }
  /* what the lists hold adds up to what they say they keep */
  size_t sum = 0;
  for (int c = 0; c < SP_RPC_MEM_CLASSES; c++) {
    void *b = m.free[c];
    while (b != NULL) {
      sum += (size_t)24 + (size_t)16 * (size_t)c;
      memcpy(&b, b, sizeof b);
    }
  }
  assert_int_equal(sum, m.kept);
  free(v);
  sp_rpc_mem_release(&m);
  assert_int_equal(m.kept, 0);
  for (int c = 0; c < SP_RPC_MEM_CLASSES; c++) assert_null(m.free[c]);
}

/* The blocks are malloc's: either side may free the other's. */
static void test_blocks_are_malloc_blocks(void **state) {
  (void)state;
  sp_rpc_mem m;
  sp_rpc_mem_init(&m);
  void *a = malloc(300);
  assert_non_null(a);
  sp_rpc_mem_free(&m, a); /* onto a free list (or freed) */
  uint8_t *b = sp_rpc_mem_alloc(&m, 290);
  assert_non_null(b);
  fill(b, 290, 8);
  free(b); /* a cached block handed to free() */
  uint8_t *r = sp_rpc_mem_alloc(&m, 50);
  assert_non_null(r);
  fill(r, 50, 2);
  r = realloc(r, 4000); /* and to realloc() */
  assert_non_null(r);
  assert_true(same(r, 50, 2));
  sp_rpc_mem_free(&m, r); /* too large for a list: freed */
  sp_rpc_mem_release(&m);
}

static void test_no_cache_is_malloc(void **state) {
  (void)state;
  uint8_t *p = sp_rpc_mem_alloc(NULL, 10);
  assert_non_null(p);
  fill(p, 10, 9);
  p = sp_rpc_mem_realloc(NULL, p, 5000);
  assert_non_null(p);
  assert_true(same(p, 10, 9));
  free(p); /* a plain malloc block */
  uint8_t *z = sp_rpc_mem_calloc(NULL, 4, 4);
  assert_non_null(z);
  for (int i = 0; i < 16; i++) assert_int_equal(z[i], 0);
  sp_rpc_mem_free(NULL, z);
  assert_null(sp_rpc_mem_calloc(NULL, SIZE_MAX / 2, 3));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reuse_by_class),
      cmocka_unit_test(test_realloc_keeps_contents),
      cmocka_unit_test(test_zeroed_alloc),
      cmocka_unit_test(test_free_lists_bounded),
      cmocka_unit_test(test_blocks_are_malloc_blocks),
      cmocka_unit_test(test_no_cache_is_malloc),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
