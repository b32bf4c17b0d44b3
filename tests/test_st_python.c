/* safetensors interop: files written by sp_safetensors_write are read back by
 * an independent reader (tests/interop/st_reader.py: Python's standard library
 * and numpy), which must see the same names, dtypes, shapes, offsets, bytes
 * and values: every dtype, a scalar, an empty tensor, non-finite values and
 * float16/bfloat16 subnormals. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>
#include <math.h>
#include <unistd.h>

#include "cast/cast_scalar.h"
#include "cast/dtype.h"
#include "safetensors/safetensors.h"
#include "support/testutil.h"

#define PYTHON "/usr/bin/python3"
#define ST_READER SP_TEST_DATA "/../interop/st_reader.py"

/* Runs the reader on path; returns its exit status and, on 0, its stdout
 * parsed as JSON (*out). stderr goes to a file whose text is in *err. */
static int run_reader(const char *path, json_t **out, char **err) {
  char *errf = sp_test_path(sp_test_dir, "reader.err");
  size_t cap =
      strlen(path) + strlen(errf) + sizeof PYTHON + sizeof ST_READER + 64;
  char *cmd = malloc(cap);
  assert_non_null(cmd);
  snprintf(cmd, cap, "'%s' '%s' '%s' 2>'%s'", PYTHON, ST_READER, path, errf);
  char *buf;
  int rc = sp_test_shell(cmd, &buf);
  *err = sp_test_read_file(errf);
  *out = NULL;
  if (rc == 0) {
    json_error_t je;
    *out = json_loads(buf, 0, &je);
    if (*out == NULL) fail_msg("reader output is not JSON: %s", je.text);
  }
  free(buf);
  free(cmd);
  free(errf);
  return rc;
}

static double value_as_f64(sp_dtype dt, const uint8_t *data, size_t i) {
  switch (dt) {
    case SP_FLOAT64: {
      double v;
      memcpy(&v, data + 8 * i, 8);
      return v;
    }
    case SP_FLOAT32: {
      float v;
      memcpy(&v, data + 4 * i, 4);
      return (double)v;
    }
    case SP_FLOAT16:
    case SP_BFLOAT16: {
      uint16_t h;
      memcpy(&h, data + 2 * i, 2);
      uint32_t u =
          dt == SP_FLOAT16 ? sp_f16_to_f32_bits(h) : sp_bf16_to_f32_bits(h);
      float f;
      memcpy(&f, &u, 4);
      return (double)f;
    }
    default: return 0;
  }
}

static long long value_as_int(sp_dtype dt, const uint8_t *data, size_t i) {
  switch (dt) {
    case SP_INT64: {
      int64_t v;
      memcpy(&v, data + 8 * i, 8);
      return v;
    }
    case SP_INT32: {
      int32_t v;
      memcpy(&v, data + 4 * i, 4);
      return v;
    }
    case SP_INT16: {
      int16_t v;
      memcpy(&v, data + 2 * i, 2);
      return v;
    }
    case SP_INT8: return (int8_t)data[i];
    default: return data[i];
  }
}

/* Checks one tensor of the reader's summary against what the C side
 * wrote; returns how many values were compared. */
static size_t check_tensor(const sp_safetensors_entry *e,
                           const sp_safetensors_tensor *ct, json_t *t,
                           bool want_hex) {
  assert_non_null(t);
  assert_string_equal(json_string_value(json_object_get(t, "dtype")),
                      sp_dtype_st_name(e->dtype));
  json_t *shape = json_object_get(t, "shape");
  assert_int_equal(json_array_size(shape), e->ndim);
  size_t numel = 1;
  for (size_t k = 0; k < e->ndim; k++) {
    assert_int_equal(json_integer_value(json_array_get(shape, k)), e->shape[k]);
    numel *= (size_t)e->shape[k];
  }
  json_t *off = json_object_get(t, "data_offsets");
  assert_int_equal(json_integer_value(json_array_get(off, 0)), ct->begin);
  assert_int_equal(json_integer_value(json_array_get(off, 1)), ct->end);

  const uint8_t *data = e->data;
  size_t nbytes = numel * sp_dtype_size(e->dtype);
  json_t *hex = json_object_get(t, "hex");
  if (want_hex) {
    assert_non_null(hex);
    const char *h = json_string_value(hex);
    assert_int_equal(strlen(h), 2 * nbytes);
    for (size_t i = 0; i < nbytes; i++) {
      char two[3];
      snprintf(two, sizeof two, "%02x", data[i]);
      if (memcmp(two, h + 2 * i, 2) != 0)
        fail_msg("%s: byte %zu: reader %.2s, written %s", e->name, i, h + 2 * i,
                 two);
    }
  } else {
    assert_null(hex);
  }
  assert_int_equal(strlen(json_string_value(json_object_get(t, "sha256"))), 64);

  json_t *vals = json_object_get(t, "values");
  assert_int_equal(json_array_size(vals), numel);
  for (size_t i = 0; i < numel; i++) {
    json_t *v = json_array_get(vals, i);
    if (sp_dtype_is_floating(e->dtype)) {
      const char *s = json_string_value(v);
      assert_non_null(s);
      char *end;
      double got = strtod(s, &end);
      assert_true(*end == '\0');
      double want = value_as_f64(e->dtype, data, i);
      /* repr carries no NaN sign or payload; the bytes above do */
      bool same = isnan(want) ? isnan(got) : memcmp(&got, &want, 8) == 0;
      if (!same)
        fail_msg("%s[%zu]: reader %s, written %.17g", e->name, i, s, want);
    } else if (e->dtype == SP_BOOL) {
      assert_true(json_is_boolean(v));
      assert_int_equal(json_is_true(v), data[i]);
    } else {
      assert_true(json_is_integer(v));
      assert_int_equal(json_integer_value(v), value_as_int(e->dtype, data, i));
    }
  }
  return numel;
}

static void test_every_dtype(void **state) {
  (void)state;
  uint64_t nan_bits = 0x7FF8000000000123ull; /* a NaN with a payload */
  double nan_payload;
  memcpy(&nan_payload, &nan_bits, 8);
  const double f64[10] = {0.0,
                          -0.0,
                          1.5,
                          nan_payload,
                          INFINITY,
                          -INFINITY,
                          2.2250738585072014e-308,
                          4.9e-324,
                          1.0 / 3.0,
                          -1e300};
  const float f32[12] = {0.0f,          -0.0f,     0.1f,        NAN,
                         INFINITY,      -INFINITY, 1e-45f,      1.1754942e-38f,
                         3.4028235e38f, -2.5f,     1.0f / 3.0f, 123456.789f};
  /* float16: zero, -0, smallest and largest subnormal, smallest normal,
   * 65504, +-inf, NaN, 1, -2, ~1/3 */
  const uint16_t f16[12] = {0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF,
                            0x7C00, 0xFC00, 0x7E00, 0x3C00, 0xC000, 0x3555};
  /* bfloat16: smallest and largest subnormal (also negative), smallest
   * normal, largest finite, +-inf, NaNs, 1, -0, ~-1/3 */
  const uint16_t bf16[12] = {0x0001, 0x007F, 0x8001, 0x0080, 0x7F7F, 0x7F80,
                             0xFF80, 0x7FC0, 0xFFC1, 0x3F80, 0x8000, 0xBEAB};
  const int64_t i64[5] = {INT64_MIN, INT64_MAX, -1, 0, 42};
  const int32_t i32[4] = {INT32_MIN, INT32_MAX, -7, 0};
  const int16_t i16[3] = {INT16_MIN, INT16_MAX, -3};
  const int8_t i8[3] = {INT8_MIN, INT8_MAX, -1};
  const uint8_t u8[6] = {0, 1, 127, 128, 255, 7};
  const uint8_t bools[3] = {1, 0, 1};
  const float scalar_f32 = 3.25f;
  const int64_t scalar_i64 = -5;
  const uint8_t scalar_bool = 1;

  /* a tensor too large for the hex dump: values only */
  enum { BIG = 10000 };
  float *big = malloc(BIG * sizeof *big);
  assert_non_null(big);
  sp_test_rng rng = {12345};
  for (size_t i = 0; i < BIG; i++) {
    uint32_t u = (uint32_t)sp_test_rng_next(&rng);
    memcpy(&big[i], &u, 4);
  }

  const sp_safetensors_entry entries[] = {
      {"f64", SP_FLOAT64, 2, {2, 5}, f64},
      {"f32", SP_FLOAT32, 2, {3, 4}, f32},
      {"f16", SP_FLOAT16, 1, {12}, f16},
      {"layer.bf16", SP_BFLOAT16, 3, {2, 2, 3}, bf16},
      {"i64", SP_INT64, 1, {5}, i64},
      {"i32", SP_INT32, 2, {2, 2}, i32},
      {"i16", SP_INT16, 1, {3}, i16},
      {"i8", SP_INT8, 1, {3}, i8},
      {"u8", SP_UINT8, 2, {3, 2}, u8},
      {"bool", SP_BOOL, 1, {3}, bools},
      {"step", SP_INT64, 0, {0}, &scalar_i64},
      {"scale", SP_FLOAT32, 0, {0}, &scalar_f32},
      {"seen", SP_BOOL, 0, {0}, &scalar_bool},
      {"empty", SP_FLOAT32, 2, {0, 3}, NULL},
      {"big", SP_FLOAT32, 2, {100, BIG / 100}, big},
  };
  const size_t n = sizeof entries / sizeof entries[0];
  const sp_safetensors_kv meta[] = {{"producer", "shardplane test_st_python"}};
  char *path = sp_test_path(sp_test_dir, "all.safetensors");
  sp_diag d = {""};
  if (sp_safetensors_write(path, entries, n, meta, 1, &d) != 0)
    fail_msg("sp_safetensors_write: %s", d.msg);

  /* the C reader's view of the same file: offsets and order */
  sp_safetensors_file *cf = NULL;
  if (sp_safetensors_open(path, &cf, &d) != 0)
    fail_msg("sp_safetensors_open: %s", d.msg);

  json_t *out = NULL;
  char *err = NULL;
  int rc = run_reader(path, &out, &err);
  if (rc != 0) fail_msg("st_reader.py exited %d: %s", rc, err);
  free(err);

  assert_int_equal(json_integer_value(json_object_get(out, "header_len")),
                   sp_safetensors_header_len(cf));
  assert_int_equal(json_integer_value(json_object_get(out, "data_len")),
                   sp_safetensors_data_len(cf));
  json_t *md = json_object_get(out, "metadata");
  assert_string_equal(json_string_value(json_object_get(md, "format")), "pt");
  assert_string_equal(json_string_value(json_object_get(md, "producer")),
                      "shardplane test_st_python");
  json_t *order = json_object_get(out, "order");
  json_t *tensors = json_object_get(out, "tensors");
  assert_int_equal(json_array_size(order), n);
  assert_int_equal(json_object_size(tensors), n);
  for (size_t i = 0; i < n; i++)
    assert_string_equal(json_string_value(json_array_get(order, i)),
                        sp_safetensors_tensor_at(cf, i)->name);
  size_t values = 0;
  for (size_t i = 0; i < n; i++) {
    const sp_safetensors_tensor *ct = sp_safetensors_find(cf, entries[i].name);
    assert_non_null(ct);
    bool want_hex = ct->nbytes <= 4096;
    values += check_tensor(&entries[i], ct,
                           json_object_get(tensors, entries[i].name), want_hex);
  }
  printf("st_reader.py agreed on %zu tensors, %zu values\n", n, values);
  json_decref(out);
  sp_safetensors_close(cf);

  /* The reader is not a rubber stamp: a truncated copy and a header whose
   * length points past the end are refused. */
  char *text = NULL;
  {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    text = malloc((size_t)sz);
    assert_non_null(text);
    assert_int_equal(fread(text, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    char *bad = sp_test_path(sp_test_dir, "bad.safetensors");
    sp_test_write_file(bad, text, (size_t)sz - 1);
    assert_int_equal(run_reader(bad, &out, &err), 2);
    assert_non_null(strstr(err, "data section"));
    free(err);
    uint64_t huge = (uint64_t)sz;
    memcpy(text, &huge, 8);
    sp_test_write_file(bad, text, (size_t)sz);
    assert_int_equal(run_reader(bad, &out, &err), 2);
    assert_non_null(strstr(err, "beyond the file"));
    free(err);
    free(bad);
  }
  free(text);
  free(big);
  free(path);
}

int main(void) {
  if (access(PYTHON, X_OK) != 0)
    return sp_test_skip(PYTHON " is not installed");
  if (system("'" PYTHON "' -c 'import numpy' >/dev/null 2>&1") != 0)
    return sp_test_skip("numpy is not available to " PYTHON
                        " (Debian: python3-numpy)");
  if (access(ST_READER, R_OK) != 0)
    return sp_test_skip(ST_READER " is missing");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_dtype),
  };
  return cmocka_run_group_tests(tests, sp_test_dir_setup, sp_test_dir_teardown);
}
