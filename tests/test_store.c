/* Tests for the coordinator's key-value store (server/kvstore.c): every
 * operation, versions, limits, waits (several keys, many waiters, cancel,
 * re-entrant callbacks), random sequences against a reference model, and a
 * leak check under AddressSanitizer. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/kvstore.h"
#include "support/testutil.h"

#ifdef SP_TEST_ASAN
#include <sanitizer/lsan_interface.h>
#endif

#define K(s) (s), strlen(s)

/* For waits whose callback must never run. */
static void never(void *arg) {
  (void)arg;
  fail_msg("a waiter that must not fire fired");
}

static sp_kvstore *new_store(const sp_kvstore_limits *l) {
  sp_kvstore *s = NULL;
  assert_int_equal(sp_kvstore_new(l, &s), 0);
  assert_non_null(s);
  return s;
}

static sp_kvstore_stats stats(const sp_kvstore *s) {
  sp_kvstore_stats st;
  sp_kvstore_get_stats(s, &st);
  return st;
}

static void set_ok(sp_kvstore *s, const char *k, const char *v, uint64_t ver) {
  uint64_t got = 0;
  assert_int_equal(sp_kvstore_set(s, K(k), v, strlen(v), &got), 0);
  assert_int_equal(got, ver);
}

static void check_value(const sp_kvstore *s, const char *k, const char *v,
                        uint64_t ver) {
  const uint8_t *p = NULL;
  size_t n = 0;
  uint64_t got = 0;
  assert_int_equal(sp_kvstore_get(s, K(k), &p, &n, &got), 0);
  assert_int_equal(n, strlen(v));
  assert_memory_equal(p, v, n);
  assert_int_equal(p[n], 0); /* NUL-terminated, as kvstore.h promises */
  assert_int_equal(got, ver);
}

static void check_absent(const sp_kvstore *s, const char *k) {
  const uint8_t *p = (const uint8_t *)"x";
  assert_int_equal(sp_kvstore_get(s, K(k), &p, NULL, NULL), SP_ENOENT);
}

/* ---- basic operations ------------------------------------------------- */

static void test_set_get_versions(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  check_absent(s, "a");
  set_ok(s, "a", "1", 1);
  check_value(s, "a", "1", 1);
  set_ok(s, "a", "22", 2);
  set_ok(s, "a", "22", 3); /* same value is still a write */
  check_value(s, "a", "22", 3);
  set_ok(s, "b", "", 1); /* empty values are values */
  check_value(s, "b", "", 1);
  /* Keys are byte strings: embedded NULs, prefixes and case all differ. */
  const char bin1[] = {'k', 0, 'x'}, bin2[] = {'k', 0, 'y'};
  assert_int_equal(sp_kvstore_set(s, bin1, 3, "one", 3, NULL), 0);
  assert_int_equal(sp_kvstore_set(s, bin2, 3, "two", 3, NULL), 0);
  const uint8_t *p;
  size_t n;
  assert_int_equal(sp_kvstore_get(s, bin1, 3, &p, &n, NULL), 0);
  assert_memory_equal(p, "one", 3);
  assert_int_equal(sp_kvstore_get(s, bin2, 3, &p, &n, NULL), 0);
  assert_memory_equal(p, "two", 3);
  assert_int_equal(sp_kvstore_get(s, "k", 1, &p, &n, NULL), SP_ENOENT);
  check_absent(s, "A");
  /* Binary values with NULs come back whole. */
  const uint8_t bv[] = {0, 1, 2, 0, 255};
  assert_int_equal(sp_kvstore_set(s, K("bin"), bv, sizeof bv, NULL), 0);
  assert_int_equal(sp_kvstore_get(s, K("bin"), &p, &n, NULL), 0);
  assert_int_equal(n, sizeof bv);
  assert_memory_equal(p, bv, sizeof bv);
  sp_kvstore_stats st = stats(s);
  assert_int_equal(st.keys, 5);
  assert_int_equal(st.bytes, (1 + 2) + (1 + 0) + (3 + 3) * 2 + (3 + 5));
  assert_int_equal(st.sets, 7);
  assert_int_equal(st.waiters, 0);
  assert_int_equal(st.wakes, 0);
  sp_kvstore_free(s);
}

static void test_bad_arguments(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  assert_int_equal(sp_kvstore_new(NULL, NULL), SP_EINVAL);
  assert_int_equal(sp_kvstore_set(NULL, K("a"), "1", 1, NULL), SP_EINVAL);
  assert_int_equal(sp_kvstore_set(s, "", 0, "1", 1, NULL), SP_EINVAL);
  assert_int_equal(sp_kvstore_set(s, NULL, 3, "1", 1, NULL), SP_EINVAL);
  assert_int_equal(sp_kvstore_set(s, K("a"), NULL, 1, NULL), SP_EINVAL);
  assert_int_equal(sp_kvstore_set(s, K("a"), NULL, 0, NULL), 0);
  assert_int_equal(sp_kvstore_get(NULL, K("a"), NULL, NULL, NULL), SP_EINVAL);
  assert_int_equal(sp_kvstore_get(s, "", 0, NULL, NULL, NULL), SP_EINVAL);
  assert_int_equal(sp_kvstore_add(s, "", 0, 1, NULL, NULL), SP_EINVAL);
  assert_int_equal(sp_kvstore_delete(s, "", 0, NULL), SP_EINVAL);
  bool sw;
  assert_int_equal(sp_kvstore_compare_set(s, "", 0, "", 0, false, "", 0, &sw,
                                          NULL, NULL, NULL, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_kvstore_compare_set(s, K("a"), NULL, 2, false, "", 0, &sw,
                                          NULL, NULL, NULL, NULL),
                   SP_EINVAL);
  assert_int_equal(sp_kvstore_compare_set(s, K("a"), "", 0, false, NULL, 2, &sw,
                                          NULL, NULL, NULL, NULL),
                   SP_EINVAL);
  const void *keys[] = {"x", ""};
  size_t klens[] = {1, 0};
  sp_kvstore_waiter *w = (sp_kvstore_waiter *)&w;
  assert_int_equal(sp_kvstore_wait(s, keys, klens, 1, NULL, NULL, &w),
                   SP_EINVAL);
  assert_null(w);
  /* One bad key refuses the whole wait, before registering anything. */
  assert_int_equal(sp_kvstore_wait(s, keys, klens, 2, never, NULL, &w),
                   SP_EINVAL);
  assert_int_equal(stats(s).waiters, 0);
  assert_int_equal(sp_kvstore_wait(s, NULL, NULL, 1, never, NULL, &w),
                   SP_EINVAL);
  sp_kvstore_cancel_wait(s, NULL);
  sp_kvstore_cancel_wait(NULL, NULL);
  sp_kvstore_get_stats(NULL, NULL);
  sp_kvstore_free(NULL);
  assert_int_equal(stats(s).keys, 1);
  sp_kvstore_free(s);
}

static void test_delete_and_reset(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  bool del = true;
  assert_int_equal(sp_kvstore_delete(s, K("a"), &del), 0);
  assert_false(del);
  set_ok(s, "a", "x", 1);
  set_ok(s, "a", "y", 2);
  assert_int_equal(sp_kvstore_delete(s, K("a"), &del), 0);
  assert_true(del);
  check_absent(s, "a");
  assert_int_equal(stats(s).keys, 0);
  assert_int_equal(stats(s).bytes, 0);
  assert_int_equal(sp_kvstore_delete(s, K("a"), &del), 0);
  assert_false(del);
  /* A re-created key starts its versions over. */
  set_ok(s, "a", "z", 1);
  check_value(s, "a", "z", 1);
  assert_int_equal(sp_kvstore_delete(s, K("a"), NULL), 0);
  int64_t r;
  uint64_t v;
  assert_int_equal(sp_kvstore_add(s, K("a"), 5, &r, &v), 0);
  assert_int_equal(r, 5);
  assert_int_equal(v, 1);
  sp_kvstore_free(s);
}

/* ---- limits ------------------------------------------------------------ */

static void test_default_limits(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  size_t kmax = 8u << 10, vmax = 8u << 20;
  char *key = malloc(kmax + 1);
  uint8_t *val = malloc(vmax);
  assert_non_null(key);
  assert_non_null(val);
  memset(key, 'k', kmax + 1);
  memset(val, 0xab, vmax);
  assert_int_equal(sp_kvstore_set(s, key, kmax, val, vmax, NULL), 0);
  const uint8_t *p;
  size_t n;
  assert_int_equal(sp_kvstore_get(s, key, kmax, &p, &n, NULL), 0);
  assert_int_equal(n, vmax);
  assert_int_equal(p[vmax - 1], 0xab);
  assert_int_equal(sp_kvstore_set(s, key, kmax + 1, "v", 1, NULL), SP_ETOOBIG);
  assert_int_equal(sp_kvstore_get(s, key, kmax + 1, &p, &n, NULL), SP_ETOOBIG);
  assert_int_equal(sp_kvstore_add(s, key, kmax + 1, 1, NULL, NULL), SP_ETOOBIG);
  assert_int_equal(sp_kvstore_delete(s, key, kmax + 1, NULL), SP_ETOOBIG);
  const void *keys[] = {key};
  size_t klens[] = {kmax + 1};
  assert_int_equal(sp_kvstore_wait(s, keys, klens, 1, never, NULL, NULL),
                   SP_ETOOBIG);
  /* "Before allocating": the sizes are refused before the buffers are
   * read. These pointers reach one byte; a store that copied first would
   * read far out of bounds (AddressSanitizer would stop it), and a store
   * that allocated first would ask for the whole size. */
  static const uint8_t one = 1;
  assert_int_equal(sp_kvstore_set(s, K("big"), &one, vmax + 1, NULL),
                   SP_ETOOBIG);
  assert_int_equal(sp_kvstore_set(s, K("big"), &one, SIZE_MAX, NULL),
                   SP_ETOOBIG);
  assert_int_equal(sp_kvstore_set(s, &one, SIZE_MAX, "v", 1, NULL), SP_ETOOBIG);
  bool sw = true;
  assert_int_equal(
      sp_kvstore_compare_set(s, K("big"), "", 0, true, &one, vmax + 1, &sw,
                             NULL, NULL, NULL, NULL),
      SP_ETOOBIG);
  assert_int_equal(sp_kvstore_compare_set(s, K("big"), &one, vmax + 1, false,
                                          "", 0, &sw, NULL, NULL, NULL, NULL),
                   SP_ETOOBIG);
  sp_kvstore_stats st = stats(s);
  assert_int_equal(st.keys, 1);
  assert_int_equal(st.bytes, kmax + vmax);
  assert_int_equal(st.waiters, 0);
  assert_int_equal(sp_kvstore_get(s, K("big"), &p, &n, NULL), SP_ENOENT);
  free(key);
  free(val);
  sp_kvstore_free(s);
}

static void test_custom_limits(void **state) {
  (void)state;
  sp_kvstore_limits l = {.max_key = 4,
                         .max_value = 8,
                         .max_keys = 3,
                         .max_bytes = 30,
                         .max_waiters = 2};
  sp_kvstore *s = new_store(&l);
  assert_int_equal(sp_kvstore_set(s, K("abcde"), "v", 1, NULL), SP_ETOOBIG);
  assert_int_equal(sp_kvstore_set(s, K("a"), "123456789", 9, NULL), SP_ETOOBIG);
  set_ok(s, "a", "12345678", 1);
  set_ok(s, "b", "", 1);
  set_ok(s, "c", "", 1);
  assert_int_equal(sp_kvstore_set(s, K("d"), "", 0, NULL), SP_ETOOBIG);
  /* Overwrites do not add keys. */
  set_ok(s, "c", "1", 2);
  /* Total bytes: a(1+8) b(1) c(1+1) = 12; the room left is 18. */
  assert_int_equal(stats(s).bytes, 12);
  assert_int_equal(sp_kvstore_delete(s, K("b"), NULL), 0);
  set_ok(s, "dddd", "12345678", 1); /* 12 + 12 - 1 = 23 */
  assert_int_equal(stats(s).bytes, 23);
  /* c grows from 1 to 8 bytes: 30, exactly the limit. */
  set_ok(s, "c", "12345678", 3);
  assert_int_equal(stats(s).bytes, 30);
  assert_int_equal(sp_kvstore_set(s, K("c"), "123456789", 9, NULL), SP_ETOOBIG);
  /* Over max_bytes with a key to spare: 21 + 4 + 8 = 33 > 30. */
  assert_int_equal(sp_kvstore_delete(s, K("a"), NULL), 0);
  assert_int_equal(sp_kvstore_set(s, K("aaaa"), "12345678", 8, NULL),
                   SP_ETOOBIG);
  check_absent(s, "aaaa");
  set_ok(s, "aaaa", "12345", 1); /* 30 */
  assert_int_equal(sp_kvstore_delete(s, K("aaaa"), NULL), 0);
  set_ok(s, "a", "12345678", 1); /* 30 again */
  /* ADD's result must fit in max_value too: 9 digits do not. */
  assert_int_equal(sp_kvstore_delete(s, K("c"), NULL), 0);
  set_ok(s, "c", "99999999", 1);
  assert_int_equal(sp_kvstore_add(s, K("c"), 1, NULL, NULL), SP_ETOOBIG);
  check_value(s, "c", "99999999", 1);
  assert_int_equal(sp_kvstore_delete(s, K("a"), NULL), 0);
  assert_int_equal(sp_kvstore_delete(s, K("c"), NULL), 0);
  /* Waits: an absent key waited for holds a table entry, charged to
   * max_keys (one key, dddd, exists). */
  const void *keys[] = {"w1", "w2", "w3"};
  size_t klens[] = {2, 2, 2};
  sp_kvstore_waiter *w1 = NULL, *w2 = NULL, *w3 = NULL;
  assert_int_equal(sp_kvstore_wait(s, keys, klens, 3, never, NULL, &w1),
                   SP_ETOOBIG);
  assert_null(w1);
  /* The failed wait left nothing behind: two keys still fit. */
  set_ok(s, "x", "", 1);
  set_ok(s, "y", "", 1);
  assert_int_equal(sp_kvstore_delete(s, K("x"), NULL), 0);
  assert_int_equal(sp_kvstore_delete(s, K("y"), NULL), 0);
  assert_int_equal(sp_kvstore_wait(s, keys, klens, 2, never, NULL, &w1), 0);
  assert_int_equal(sp_kvstore_set(s, K("z"), "", 0, NULL), SP_ETOOBIG);
  /* The same keys again need no more entries. */
  assert_int_equal(sp_kvstore_wait(s, keys, klens, 2, never, NULL, &w2), 0);
  /* max_waiters = 2 */
  assert_int_equal(sp_kvstore_wait(s, keys, klens, 1, never, NULL, &w3),
                   SP_ETOOBIG);
  /* More keys in one wait than the store may hold. */
  const void *many[] = {"dddd", "dddd", "dddd", "dddd"};
  size_t mlens[] = {4, 4, 4, 4};
  assert_int_equal(sp_kvstore_wait(s, many, mlens, 4, never, NULL, &w3),
                   1); /* all exist: no waiter, no limit */
  sp_kvstore_cancel_wait(s, w1);
  sp_kvstore_cancel_wait(s, w2);
  assert_int_equal(stats(s).waiters, 0);
  /* Cancelling the last waiters freed their entries. */
  set_ok(s, "x", "", 1);
  set_ok(s, "y", "", 1);
  sp_kvstore_free(s);
}

/* ---- ADD --------------------------------------------------------------- */

static void add_ok(sp_kvstore *s, const char *k, int64_t d, int64_t want,
                   uint64_t ver) {
  int64_t r = 0;
  uint64_t v = 0;
  assert_int_equal(sp_kvstore_add(s, K(k), d, &r, &v), 0);
  assert_int_equal(r, want);
  assert_int_equal(v, ver);
}

static void test_add(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  add_ok(s, "n", 5, 5, 1);
  check_value(s, "n", "5", 1);
  add_ok(s, "n", -7, -2, 2);
  check_value(s, "n", "-2", 2);
  add_ok(s, "n", 0, -2, 3);
  set_ok(s, "p", "+41", 1);
  add_ok(s, "p", 1, 42, 2);
  set_ok(s, "z", "-0", 1);
  add_ok(s, "z", 0, 0, 2);
  check_value(s, "z", "0", 2);
  set_ok(s, "lz", "007", 1);
  add_ok(s, "lz", 1, 8, 2);
  /* Not integers: nothing changes. */
  const char *bad[] = {"",
                       "abc",
                       " 1",
                       "1 ",
                       "1a",
                       "-",
                       "+",
                       "0x10",
                       "1.5",
                       "--1",
                       "99999999999999999999x"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    set_ok(s, "bad", bad[i], i + 1);
    int64_t r = 123;
    assert_int_equal(sp_kvstore_add(s, K("bad"), 1, &r, NULL), SP_EFORMAT);
    assert_int_equal(r, 123);
    check_value(s, "bad", bad[i], i + 1);
  }
  /* A value with a NUL inside is not an integer either. */
  assert_int_equal(sp_kvstore_set(s, K("nul"), "1\0002", 3, NULL), 0);
  assert_int_equal(sp_kvstore_add(s, K("nul"), 1, NULL, NULL), SP_EFORMAT);
  /* Range. */
  set_ok(s, "max", "9223372036854775807", 1);
  assert_int_equal(sp_kvstore_add(s, K("max"), 1, NULL, NULL), SP_ERANGE);
  check_value(s, "max", "9223372036854775807", 1);
  add_ok(s, "max", -1, INT64_MAX - 1, 2);
  set_ok(s, "min", "-9223372036854775808", 1);
  add_ok(s, "min", 0, INT64_MIN, 2);
  check_value(s, "min", "-9223372036854775808", 2);
  assert_int_equal(sp_kvstore_add(s, K("min"), -1, NULL, NULL), SP_ERANGE);
  add_ok(s, "min", INT64_MAX, -1, 3);
  set_ok(s, "over", "9223372036854775808", 1);
  assert_int_equal(sp_kvstore_add(s, K("over"), 0, NULL, NULL), SP_ERANGE);
  set_ok(s, "under", "-9223372036854775809", 1);
  assert_int_equal(sp_kvstore_add(s, K("under"), 0, NULL, NULL), SP_ERANGE);
  set_ok(s, "huge", "123456789012345678901234567890", 1);
  assert_int_equal(sp_kvstore_add(s, K("huge"), 0, NULL, NULL), SP_ERANGE);
  add_ok(s, "fresh", INT64_MIN, INT64_MIN, 1);
  assert_int_equal(sp_kvstore_add(s, K("fresh"), -1, NULL, NULL), SP_ERANGE);
  sp_kvstore_free(s);
}

/* ---- compare-and-set --------------------------------------------------- */

typedef struct cas_out {
  bool swapped, found;
  const uint8_t *value;
  size_t vlen;
  uint64_t version;
} cas_out;

static cas_out cas(sp_kvstore *s, const char *k, const char *expected,
                   bool expect_absent, const char *desired) {
  cas_out o = {true, true, (const uint8_t *)"junk", 99, 99};
  assert_int_equal(sp_kvstore_compare_set(
                       s, K(k), expected, expected ? strlen(expected) : 0,
                       expect_absent, desired, strlen(desired), &o.swapped,
                       &o.value, &o.vlen, &o.found, &o.version),
                   0);
  return o;
}

static void test_compare_set(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  /* Absent key, plain compare: never matches, not even "". */
  cas_out o = cas(s, "k", "", false, "v1");
  assert_false(o.swapped);
  assert_false(o.found);
  assert_null(o.value);
  assert_int_equal(o.vlen, 0);
  assert_int_equal(o.version, 0);
  check_absent(s, "k");
  /* expect_absent creates. */
  o = cas(s, "k", NULL, true, "v1");
  assert_true(o.swapped);
  assert_true(o.found);
  assert_int_equal(o.vlen, 2);
  assert_memory_equal(o.value, "v1", 2);
  assert_int_equal(o.version, 1);
  /* expect_absent on a present key fails and reports the value. */
  o = cas(s, "k", "ignored", true, "v2");
  assert_false(o.swapped);
  assert_true(o.found);
  assert_memory_equal(o.value, "v1", 2);
  assert_int_equal(o.version, 1);
  /* Mismatch: shorter, longer, same length. */
  const char *wrong[] = {"v", "v12", "v2", ""};
  for (size_t i = 0; i < 4; i++) {
    o = cas(s, "k", wrong[i], false, "v3");
    assert_false(o.swapped);
    assert_memory_equal(o.value, "v1", 2);
    assert_int_equal(o.version, 1);
  }
  /* Match. */
  o = cas(s, "k", "v1", false, "v3");
  assert_true(o.swapped);
  assert_int_equal(o.vlen, 2);
  assert_memory_equal(o.value, "v3", 2);
  assert_int_equal(o.version, 2);
  check_value(s, "k", "v3", 2);
  /* Empty value matches empty expected. */
  set_ok(s, "e", "", 1);
  o = cas(s, "e", "", false, "");
  assert_true(o.swapped);
  assert_int_equal(o.vlen, 0);
  assert_int_equal(o.version, 2);
  /* Outputs are optional. */
  assert_int_equal(sp_kvstore_compare_set(s, K("k"), "v3", 2, false, "v4", 2,
                                          NULL, NULL, NULL, NULL, NULL),
                   0);
  check_value(s, "k", "v4", 3);
  assert_int_equal(stats(s).sets, 5);
  sp_kvstore_free(s);
}

/* ---- waits ------------------------------------------------------------- */

typedef struct rec {
  int fired;
  int order;    /* global fire order, 1-based */
  int *counter; /* shared across recs */
} rec;

static void on_wake(void *arg) {
  rec *r = arg;
  r->fired++;
  if (r->counter != NULL) r->order = ++*r->counter;
}

static int wait_keys(sp_kvstore *s, const char *const *names, size_t n,
                     sp_kvstore_wake_fn fn, void *arg, sp_kvstore_waiter **w) {
  const void *keys[16];
  size_t klens[16];
  assert_true(n <= 16);
  for (size_t i = 0; i < n; i++) {
    keys[i] = names[i];
    klens[i] = strlen(names[i]);
  }
  return sp_kvstore_wait(s, keys, klens, n, fn, arg, w);
}

static void test_wait_several_keys(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  int counter = 0;
  rec r1 = {0, 0, &counter}, r2 = {0, 0, &counter}, r3 = {0, 0, &counter};
  const char *abc[] = {"a", "b", "c"};
  const char *cb[] = {"c", "b"};
  const char *c_only[] = {"c"};
  sp_kvstore_waiter *w1, *w2, *w3;
  set_ok(s, "b", "present", 1);
  assert_int_equal(wait_keys(s, abc, 3, on_wake, &r1, &w1), 0);
  assert_int_equal(wait_keys(s, cb, 2, on_wake, &r2, &w2), 0);
  assert_int_equal(wait_keys(s, c_only, 1, on_wake, &r3, &w3), 0);
  assert_int_equal(stats(s).waiters, 3);
  /* Keys that do not exist yet are not keys. */
  assert_int_equal(stats(s).keys, 1);
  check_absent(s, "a");
  bool del = true;
  assert_int_equal(sp_kvstore_delete(s, K("c"), &del), 0);
  assert_false(del);
  set_ok(s, "a", "1", 1);
  assert_int_equal(r1.fired + r2.fired + r3.fired, 0);
  /* One set of c releases all three together, in registration order. */
  set_ok(s, "c", "1", 1);
  assert_int_equal(r1.fired, 1);
  assert_int_equal(r2.fired, 1);
  assert_int_equal(r3.fired, 1);
  assert_int_equal(r1.order, 1);
  assert_int_equal(r2.order, 2);
  assert_int_equal(r3.order, 3);
  sp_kvstore_stats st = stats(s);
  assert_int_equal(st.waiters, 0);
  assert_int_equal(st.wakes, 3);
  /* Further sets fire nothing. */
  set_ok(s, "c", "2", 2);
  assert_int_equal(r1.fired, 1);
  /* Everything present: 1, nothing registered, no callback. */
  sp_kvstore_waiter *w = (sp_kvstore_waiter *)&w;
  assert_int_equal(wait_keys(s, abc, 3, on_wake, &r1, &w), 1);
  assert_null(w);
  assert_int_equal(sp_kvstore_wait(s, NULL, NULL, 0, on_wake, &r1, &w), 1);
  assert_int_equal(r1.fired, 1);
  /* Repeated keys count once each and are released together. */
  rec r4 = {0, 0, NULL};
  const char *dup[] = {"d", "d", "a", "d"};
  assert_int_equal(wait_keys(s, dup, 4, on_wake, &r4, &w), 0);
  set_ok(s, "d", "", 1);
  assert_int_equal(r4.fired, 1);
  /* ADD and a creating CAS wake too. */
  rec r5 = {0, 0, NULL}, r6 = {0, 0, NULL};
  const char *n1[] = {"n1"}, *n2[] = {"n2"};
  assert_int_equal(wait_keys(s, n1, 1, on_wake, &r5, NULL), 0);
  assert_int_equal(wait_keys(s, n2, 1, on_wake, &r6, NULL), 0);
  assert_int_equal(sp_kvstore_add(s, K("n1"), 1, NULL, NULL), 0);
  assert_int_equal(r5.fired, 1);
  cas_out o = cas(s, "n2", "", false, "x"); /* absent: no swap, no wake */
  assert_false(o.swapped);
  assert_int_equal(r6.fired, 0);
  o = cas(s, "n2", NULL, true, "x");
  assert_true(o.swapped);
  assert_int_equal(r6.fired, 1);
  /* A failed write wakes nobody. */
  sp_kvstore_limits l = {.max_value = 2};
  sp_kvstore *s2 = new_store(&l);
  rec r7 = {0, 0, NULL};
  assert_int_equal(wait_keys(s2, n1, 1, on_wake, &r7, NULL), 0);
  assert_int_equal(sp_kvstore_set(s2, K("n1"), "abc", 3, NULL), SP_ETOOBIG);
  assert_int_equal(r7.fired, 0);
  assert_int_equal(stats(s2).waiters, 1);
  sp_kvstore_free(s2); /* drops r7's waiter without calling it */
  assert_int_equal(r7.fired, 0);
  sp_kvstore_free(s);
}

/* TCPStore's WAIT only needs each key to have existed: a key counted and
 * then deleted is not waited for again. */
static void test_wait_key_deleted_after_counted(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  rec r = {0, 0, NULL};
  const char *ab[] = {"a", "b"};
  assert_int_equal(wait_keys(s, ab, 2, on_wake, &r, NULL), 0);
  set_ok(s, "a", "1", 1);
  assert_int_equal(sp_kvstore_delete(s, K("a"), NULL), 0);
  set_ok(s, "b", "1", 1);
  assert_int_equal(r.fired, 1);
  check_absent(s, "a");
  sp_kvstore_free(s);
}

enum { N_MANY = 10000 };

static void count_wake(void *arg) { ++*(int *)arg; }

static void test_many_waiters_one_set(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  int count = 0;
  const char *k[] = {"nccl_id"};
  for (int i = 0; i < N_MANY; i++)
    assert_int_equal(wait_keys(s, k, 1, count_wake, &count, NULL), 0);
  /* Plus waiters that need the id and a key of their own, already set. */
  char name[32];
  for (int i = 0; i < N_MANY; i++) {
    snprintf(name, sizeof name, "rank/%d", i);
    set_ok(s, name, "up", 1);
    const char *two[] = {name, "nccl_id"};
    assert_int_equal(wait_keys(s, two, 2, count_wake, &count, NULL), 0);
  }
  assert_int_equal(stats(s).waiters, 2 * N_MANY);
  assert_int_equal(count, 0);
  /* One set: every waiter runs before it returns, in that one pass. */
  set_ok(s, "nccl_id", "0123456789abcdef", 1);
  assert_int_equal(count, 2 * N_MANY);
  sp_kvstore_stats st = stats(s);
  assert_int_equal(st.waiters, 0);
  assert_int_equal(st.wakes, 2 * N_MANY);
  set_ok(s, "nccl_id", "again", 2);
  assert_int_equal(count, 2 * N_MANY);
  /* Many distinct keys each with a waiter, all cancelled. */
  sp_kvstore_waiter **ws = calloc(N_MANY, sizeof *ws);
  assert_non_null(ws);
  for (int i = 0; i < N_MANY; i++) {
    snprintf(name, sizeof name, "absent/%d", i);
    const char *one[] = {name};
    assert_int_equal(wait_keys(s, one, 1, count_wake, &count, &ws[i]), 0);
  }
  for (int i = N_MANY; i-- > 0;) sp_kvstore_cancel_wait(s, ws[i]);
  free(ws);
  assert_int_equal(stats(s).waiters, 0);
  assert_int_equal(count, 2 * N_MANY);
  sp_kvstore_free(s);
}

static void test_cancel(void **state) {
  (void)state;
  sp_kvstore_limits l = {.max_keys = 2};
  sp_kvstore *s = new_store(&l);
  rec r1 = {0, 0, NULL}, r2 = {0, 0, NULL};
  sp_kvstore_waiter *w1, *w2;
  const char *ab[] = {"a", "b"};
  const char *a[] = {"a"};
  assert_int_equal(wait_keys(s, ab, 2, on_wake, &r1, &w1), 0);
  assert_int_equal(wait_keys(s, a, 1, on_wake, &r2, &w2), 0);
  /* Both entries are taken by placeholders. */
  assert_int_equal(sp_kvstore_set(s, K("c"), "", 0, NULL), SP_ETOOBIG);
  set_ok(s, "a", "", 1); /* fires w2, counts a for w1 */
  assert_int_equal(r2.fired, 1);
  sp_kvstore_cancel_wait(s, w1); /* partly satisfied */
  set_ok(s, "b", "", 1);
  assert_int_equal(r1.fired, 0);
  assert_int_equal(stats(s).waiters, 0);
  /* The placeholder of b went with w1's cancel: a and b are the keys. */
  assert_int_equal(stats(s).keys, 2);
  assert_int_equal(sp_kvstore_delete(s, K("b"), NULL), 0);
  /* Cancel before anything appeared frees the placeholders. */
  const char *cd[] = {"c", "c"};
  assert_int_equal(wait_keys(s, cd, 2, on_wake, &r1, &w1), 0);
  sp_kvstore_cancel_wait(s, w1);
  set_ok(s, "c", "", 1);
  assert_int_equal(r1.fired, 0);
  sp_kvstore_free(s);
}

/* ---- re-entrant callbacks --------------------------------------------- */

typedef struct reent {
  sp_kvstore *s;
  int fired;
  int action;
  sp_kvstore_waiter *other; /* for A_CANCEL_OTHER */
  rec nested;               /* waiter registered from the callback */
  sp_kvstore_waiter *self;
} reent;

enum {
  A_NONE,
  A_SET_OTHER,    /* sets "y", waking a nested waiter */
  A_WAIT,         /* registers a new waiter on "later" */
  A_CANCEL_OTHER, /* cancels a sibling woken by the same set */
  A_CANCEL_SELF,
  A_DELETE,    /* deletes the key that woke it */
  A_SET_SAME,  /* sets the key that woke it again */
  A_WAIT_SAME, /* waits on the key that woke it (present: returns 1) */
};

static void on_reent(void *arg) {
  reent *r = arg;
  r->fired++;
  switch (r->action) {
    case A_SET_OTHER:
      assert_int_equal(sp_kvstore_set(r->s, K("y"), "from-callback", 13, NULL),
                       0);
      break;
    case A_WAIT: {
      const char *k[] = {"later"};
      assert_int_equal(wait_keys(r->s, k, 1, on_wake, &r->nested, NULL), 0);
      break;
    }
    case A_CANCEL_OTHER: sp_kvstore_cancel_wait(r->s, r->other); break;
    case A_CANCEL_SELF: sp_kvstore_cancel_wait(r->s, r->self); break;
    case A_DELETE:
      assert_int_equal(sp_kvstore_delete(r->s, K("x"), NULL), 0);
      break;
    case A_SET_SAME:
      assert_int_equal(sp_kvstore_set(r->s, K("x"), "again", 5, NULL), 0);
      break;
    case A_WAIT_SAME: {
      const char *k[] = {"x"};
      assert_int_equal(wait_keys(r->s, k, 1, on_wake, &r->nested, NULL), 1);
      break;
    }
    default: break;
  }
}

static void test_reentrant_callbacks(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  const char *x[] = {"x"};
  const char *y[] = {"y"};
  reent ry = {.s = s};
  /* r[i] does action i; r[8] is the sibling r[3] cancels. */
  reent r[9];
  memset(r, 0, sizeof r);
  for (int i = 0; i < 9; i++) {
    r[i].s = s;
    r[i].action = i < 8 ? i : A_NONE;
  }
  assert_int_equal(wait_keys(s, y, 1, on_reent, &ry, NULL), 0);
  /* r[3] cancels r[8], woken by the same set but not run yet; r[4]
   * cancels itself while running. */
  for (int i = 0; i < 9; i++)
    assert_int_equal(wait_keys(s, x, 1, on_reent, &r[i], &r[i].self), 0);
  r[3].other = r[8].self;
  set_ok(s, "x", "first", 1);
  for (int i = 0; i < 8; i++) assert_int_equal(r[i].fired, 1);
  assert_int_equal(r[8].fired, 0);
  assert_int_equal(ry.fired, 1); /* nested wake from r[1]'s set */
  check_value(s, "y", "from-callback", 1);
  /* r[5] deleted x, then r[6] set it again. */
  check_value(s, "x", "again", 1);
  assert_int_equal(r[7].nested.fired, 0); /* x existed: returned 1 */
  /* The waiter registered from r[2]'s callback works like any other. */
  assert_int_equal(stats(s).waiters, 1);
  set_ok(s, "later", "", 1);
  assert_int_equal(r[2].nested.fired, 1);
  assert_int_equal(stats(s).waiters, 0);
  assert_int_equal(stats(s).wakes, 1 + 8 + 1);

  /* A CAS whose callback deletes the key reports the key as it is on
   * return: absent, though the swap happened. */
  reent rd = {.s = s, .action = A_DELETE};
  assert_int_equal(sp_kvstore_delete(s, K("x"), NULL), 0);
  assert_int_equal(wait_keys(s, x, 1, on_reent, &rd, NULL), 0);
  cas_out o = cas(s, "x", NULL, true, "v");
  assert_true(o.swapped);
  assert_false(o.found);
  assert_null(o.value);
  assert_int_equal(rd.fired, 1);
  sp_kvstore_free(s);
}

/* ---- random sequences against a reference model ------------------------ */

/* The model: a linear list of (key, value, version) and a list of waiters
 * with the keys each still misses. Slow and obviously right. */
enum { M_KEYS = 6, M_MAXW = 64 };

typedef struct mkey {
  bool present;
  char value[32];
  size_t vlen;
  uint64_t version;
} mkey;

typedef struct mwaiter {
  bool live;         /* registered and not yet fired or cancelled */
  bool need[M_KEYS]; /* keys still missing */
  int fired;         /* real callback count */
  bool model_fired;
  sp_kvstore_waiter *w;
} mwaiter;

static const char *const k_mkeys[M_KEYS] = {"a",          "b",          "c",
                                            "long/key/1", "long/key/2", "n"};

static void model_appear(mwaiter *ws, size_t nw, size_t k) {
  for (size_t i = 0; i < nw; i++) {
    if (!ws[i].live || !ws[i].need[k]) continue;
    ws[i].need[k] = false;
    bool done = true;
    for (size_t j = 0; j < M_KEYS; j++) done = done && !ws[i].need[j];
    if (done) {
      ws[i].live = false;
      ws[i].model_fired = true;
    }
  }
}

static void model_write(mkey *m, mwaiter *ws, size_t nw, size_t k,
                        const char *v, size_t n) {
  bool was = m[k].present;
  memcpy(m[k].value, v, n);
  m[k].vlen = n;
  m[k].version = was ? m[k].version + 1 : 1;
  m[k].present = true;
  if (!was) model_appear(ws, nw, k);
}

static void on_model_wake(void *arg) { ((mwaiter *)arg)->fired++; }

static void check_model(const sp_kvstore *s, const mkey *m, const mwaiter *ws,
                        size_t nw) {
  size_t keys = 0, bytes = 0, live = 0;
  for (size_t k = 0; k < M_KEYS; k++) {
    const uint8_t *p;
    size_t n;
    uint64_t v;
    int rc = sp_kvstore_get(s, K(k_mkeys[k]), &p, &n, &v);
    if (!m[k].present) {
      assert_int_equal(rc, SP_ENOENT);
      continue;
    }
    assert_int_equal(rc, 0);
    assert_int_equal(n, m[k].vlen);
    assert_memory_equal(p, m[k].value, n);
    assert_int_equal(v, m[k].version);
    keys++;
    bytes += strlen(k_mkeys[k]) + n;
  }
  for (size_t i = 0; i < nw; i++) {
    assert_int_equal(ws[i].fired, ws[i].model_fired ? 1 : 0);
    live += ws[i].live;
  }
  sp_kvstore_stats st = stats(s);
  assert_int_equal(st.keys, keys);
  assert_int_equal(st.bytes, bytes);
  assert_int_equal(st.waiters, live);
}

static void test_random_vs_model(void **state) {
  (void)state;
  sp_test_rng rng = {0x5707e};
  for (int round = 0; round < 40; round++) {
    sp_kvstore *s = new_store(NULL);
    mkey m[M_KEYS];
    mwaiter ws[M_MAXW];
    size_t nw = 0;
    memset(m, 0, sizeof m);
    memset(ws, 0, sizeof ws);
    for (int step = 0; step < 2000; step++) {
      size_t k = (size_t)sp_test_rng_below(&rng, M_KEYS);
      const char *key = k_mkeys[k];
      char v[32];
      size_t vn;
      /* Values: small integers (so ADD mostly works), or junk. */
      if (sp_test_rng_below(&rng, 4) != 0)
        vn = (size_t)snprintf(v, sizeof v, "%d",
                              (int)sp_test_rng_below(&rng, 21) - 10);
      else
        vn = (size_t)snprintf(v, sizeof v, "x%u",
                              (unsigned)sp_test_rng_below(&rng, 3));
      int op = (int)sp_test_rng_below(&rng, 8);
      switch (op) {
        case 0: { /* set */
          uint64_t ver;
          assert_int_equal(sp_kvstore_set(s, K(key), v, vn, &ver), 0);
          model_write(m, ws, nw, k, v, vn);
          assert_int_equal(ver, m[k].version);
          break;
        }
        case 1: { /* add */
          int64_t d = (int64_t)sp_test_rng_below(&rng, 7) - 3;
          int64_t r;
          uint64_t ver;
          int rc = sp_kvstore_add(s, K(key), d, &r, &ver);
          long long cur = 0;
          bool num = true;
          if (m[k].present) {
            char buf[40];
            memcpy(buf, m[k].value, m[k].vlen);
            buf[m[k].vlen] = 0;
            char *end;
            cur = strtoll(buf, &end, 10);
            num = m[k].vlen > 0 && *end == 0;
          }
          if (!num) {
            assert_int_equal(rc, SP_EFORMAT);
            break;
          }
          assert_int_equal(rc, 0);
          assert_int_equal(r, cur + d);
          char out[32];
          size_t on = (size_t)snprintf(out, sizeof out, "%lld", cur + d);
          model_write(m, ws, nw, k, out, on);
          assert_int_equal(ver, m[k].version);
          break;
        }
        case 2: { /* compare-and-set */
          bool absent = sp_test_rng_below(&rng, 3) == 0;
          const char *exp =
              m[k].present && sp_test_rng_below(&rng, 2) ? m[k].value : v;
          size_t en = exp == m[k].value ? m[k].vlen : vn;
          char des[32];
          size_t dn = (size_t)snprintf(des, sizeof des, "%d", step % 17);
          bool sw, found;
          const uint8_t *p;
          size_t pn;
          uint64_t ver;
          bool match = absent ? !m[k].present
                              : m[k].present && m[k].vlen == en &&
                                    memcmp(m[k].value, exp, en) == 0;
          char expcopy[32];
          memcpy(expcopy, exp, en);
          assert_int_equal(
              sp_kvstore_compare_set(s, K(key), expcopy, en, absent, des, dn,
                                     &sw, &p, &pn, &found, &ver),
              0);
          assert_int_equal(sw, match);
          if (match) model_write(m, ws, nw, k, des, dn);
          assert_int_equal(found, m[k].present);
          if (found) {
            assert_int_equal(pn, m[k].vlen);
            assert_memory_equal(p, m[k].value, pn);
            assert_int_equal(ver, m[k].version);
          }
          break;
        }
        case 3: { /* delete */
          bool del;
          assert_int_equal(sp_kvstore_delete(s, K(key), &del), 0);
          assert_int_equal(del, m[k].present);
          m[k].present = false;
          break;
        }
        case 4:
        case 5: { /* wait on 1..3 keys */
          if (nw == M_MAXW) break;
          mwaiter *mw = &ws[nw];
          const char *names[3];
          size_t n = 1 + (size_t)sp_test_rng_below(&rng, 3);
          bool any = false;
          for (size_t i = 0; i < n; i++) {
            size_t kk = (size_t)sp_test_rng_below(&rng, M_KEYS);
            names[i] = k_mkeys[kk];
            if (!m[kk].present) {
              mw->need[kk] = true;
              any = true;
            }
          }
          int rc = wait_keys(s, names, n, on_model_wake, mw, &mw->w);
          assert_int_equal(rc, any ? 0 : 1);
          if (any) {
            mw->live = true;
            nw++;
          } else {
            memset(mw, 0, sizeof *mw);
          }
          break;
        }
        case 6: { /* cancel a live waiter */
          if (nw == 0) break;
          size_t i = (size_t)sp_test_rng_below(&rng, nw);
          if (!ws[i].live) break;
          sp_kvstore_cancel_wait(s, ws[i].w);
          ws[i].live = false;
          break;
        }
        default: { /* get */
          const uint8_t *p;
          size_t n;
          uint64_t ver;
          int rc = sp_kvstore_get(s, K(key), &p, &n, &ver);
          assert_int_equal(rc, m[k].present ? 0 : SP_ENOENT);
          break;
        }
      }
      check_model(s, m, ws, nw);
    }
    sp_kvstore_free(s); /* with live waiters left: dropped, no callbacks */
  }
}

/* Growth and shrink of the table across many keys. */
static void test_many_keys(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  enum { N = 100000 };
  char name[32];
  for (int i = 0; i < N; i++) {
    int n = snprintf(name, sizeof name, "key%d", i);
    assert_int_equal(sp_kvstore_set(s, name, (size_t)n, name, (size_t)n, NULL),
                     0);
  }
  assert_int_equal(stats(s).keys, N);
  for (int i = 0; i < N; i++) {
    int n = snprintf(name, sizeof name, "key%d", i);
    const uint8_t *p;
    size_t vn;
    assert_int_equal(sp_kvstore_get(s, name, (size_t)n, &p, &vn, NULL), 0);
    assert_int_equal(vn, (size_t)n);
    assert_memory_equal(p, name, vn);
  }
  for (int i = 0; i < N; i += 2) {
    int n = snprintf(name, sizeof name, "key%d", i);
    assert_int_equal(sp_kvstore_delete(s, name, (size_t)n, NULL), 0);
  }
  for (int i = 1; i < N; i += 2) {
    int n = snprintf(name, sizeof name, "key%d", i);
    assert_int_equal(sp_kvstore_get(s, name, (size_t)n, NULL, NULL, NULL), 0);
    assert_int_equal(sp_kvstore_delete(s, name, (size_t)n, NULL), 0);
  }
  sp_kvstore_stats st = stats(s);
  assert_int_equal(st.keys, 0);
  assert_int_equal(st.bytes, 0);
  set_ok(s, "after", "shrink", 1);
  sp_kvstore_free(s);
}

/* Pending waiters, placeholders and values are all freed by
 * sp_kvstore_free; under AddressSanitizer the leak checker confirms it here
 * (and again at exit). */
static void test_no_leaks(void **state) {
  (void)state;
  sp_kvstore *s = new_store(NULL);
  rec r = {0, 0, NULL};
  const char *ab[] = {"a", "b"};
  set_ok(s, "k", "v", 1);
  assert_int_equal(wait_keys(s, ab, 2, on_wake, &r, NULL), 0);
  set_ok(s, "a", "", 1);
  sp_kvstore_waiter *w;
  assert_int_equal(wait_keys(s, ab, 2, on_wake, &r, &w), 0);
  sp_kvstore_free(s);
  assert_int_equal(r.fired, 0);
#ifdef SP_TEST_ASAN
  assert_int_equal(__lsan_do_recoverable_leak_check(), 0);
#else
  print_message("(leak check runs only in the AddressSanitizer build)\n");
#endif
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_set_get_versions),
      cmocka_unit_test(test_bad_arguments),
      cmocka_unit_test(test_delete_and_reset),
      cmocka_unit_test(test_default_limits),
      cmocka_unit_test(test_custom_limits),
      cmocka_unit_test(test_add),
      cmocka_unit_test(test_compare_set),
      cmocka_unit_test(test_wait_several_keys),
      cmocka_unit_test(test_wait_key_deleted_after_counted),
      cmocka_unit_test(test_many_waiters_one_set),
      cmocka_unit_test(test_cancel),
      cmocka_unit_test(test_reentrant_callbacks),
      cmocka_unit_test(test_random_vs_model),
      cmocka_unit_test(test_many_keys),
      cmocka_unit_test(test_no_leaks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
