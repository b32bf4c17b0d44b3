/* dtype table, error strings, and the proto enums that mirror them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "cast/dtype.h"
#include "plan/job.h"
#include "shardplane/v1/coordinator.pb-c.h"
#include "base/sp_error.h"
#include "base/strmap.h"

static void test_table(void **state) {
  (void)state;
  const struct {
    const char *name, *st;
    size_t size;
    bool fp;
  } want[] = {
      {"float32", "F32", 4, true}, {"bfloat16", "BF16", 2, true},
      {"float16", "F16", 2, true}, {"float64", "F64", 8, true},
      {"int64", "I64", 8, false},  {"int32", "I32", 4, false},
      {"int16", "I16", 2, false},  {"int8", "I8", 1, false},
      {"uint8", "U8", 1, false},   {"bool", "BOOL", 1, false},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    sp_dtype t = SP_DTYPE_INVALID, t2 = SP_DTYPE_INVALID;
    assert_int_equal(sp_dtype_parse(want[i].name, &t), 0);
    assert_string_equal(sp_dtype_name(t), want[i].name);
    assert_string_equal(sp_dtype_st_name(t), want[i].st);
    assert_int_equal(sp_dtype_size(t), want[i].size);
    assert_int_equal(sp_dtype_is_floating(t), want[i].fp);
    assert_int_equal(sp_dtype_parse_st(want[i].st, &t2), 0);
    assert_int_equal(t, t2);
    assert_ptr_equal(sp_dtype_get_info(t)->name, sp_dtype_name(t));
  }
}

static void test_parse_errors_and_aliases(void **state) {
  (void)state;
  sp_dtype t = SP_FLOAT32;
  assert_int_equal(sp_dtype_parse("float33", &t), SP_EINVAL);
  assert_int_equal(t, SP_FLOAT32); /* untouched on error */
  assert_int_equal(sp_dtype_parse("", &t), SP_EINVAL);
  assert_int_equal(sp_dtype_parse(NULL, &t), SP_EINVAL);
  assert_int_equal(sp_dtype_parse("torch.bfloat16", &t), 0);
  assert_int_equal(t, SP_BFLOAT16);
  assert_int_equal(sp_dtype_parse("half", &t), 0);
  assert_int_equal(t, SP_FLOAT16);
  assert_int_equal(sp_dtype_parse("long", &t), 0);
  assert_int_equal(t, SP_INT64);
  assert_int_equal(sp_dtype_parse_st("F8_E4M3", &t), SP_EUNSUPPORTED);
  assert_int_equal(sp_dtype_parse_st("f32", &t), SP_EINVAL);
  assert_int_equal(sp_dtype_size(SP_DTYPE_INVALID), 0);
  assert_int_equal(sp_dtype_size((sp_dtype)99), 0);
  assert_string_equal(sp_dtype_name((sp_dtype)99), "invalid");
  assert_null(sp_dtype_get_info(SP_DTYPE_INVALID));
  assert_false(sp_dtype_is_floating(SP_BOOL));
}

static void test_errors(void **state) {
  (void)state;
  assert_string_equal(sp_strerror(0), "success");
  assert_string_equal(sp_strerror(SP_ENOENT), "not found");
  assert_string_equal(sp_err_name(SP_ESTATE), "SP_ESTATE");
  assert_string_equal(sp_strerror(-12345), "unknown error");
  sp_diag d;
  assert_int_equal(sp_diag_set(&d, SP_EIO, "x %d", 1), SP_EIO);
  assert_int_equal(sp_diag_prefix(&d, SP_EIO, "file.json"), SP_EIO);
  assert_string_equal(d.msg, "file.json: x 1");
  assert_int_equal(sp_diag_set(NULL, SP_EIO, "x"), SP_EIO);
}

/* The wire enums must carry the same numbers as the C enums. */
static void test_proto_enums_match(void **state) {
  (void)state;
  const ProtobufCEnumDescriptor *dd = &shardplane__v1__dtype__descriptor;
  for (int t = 1; t < SP_DTYPE_COUNT; t++) {
    char upper[16];
    const char *n = sp_dtype_name((sp_dtype)t);
    size_t i = 0;
    for (; n[i] && i < sizeof upper - 1; i++)
      upper[i] = (char)(n[i] >= 'a' && n[i] <= 'z' ? n[i] - 32 : n[i]);
    upper[i] = '\0';
    const ProtobufCEnumValue *v =
        protobuf_c_enum_descriptor_get_value_by_name(dd, upper);
    assert_non_null(v);
    assert_int_equal(v->value, t);
  }
  assert_int_equal(dd->n_values, SP_DTYPE_COUNT);
  const ProtobufCEnumDescriptor *sd =
      &shardplane__v1__sharding_strategy__descriptor;
  for (int s = SP_FULL_SHARD; s <= SP_HYBRID_SHARD; s++) {
    const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value_by_name(
        sd, sp_strategy_name((sp_strategy)s));
    assert_non_null(v);
    assert_int_equal(v->value, s);
  }
}

/* A plan message survives a pack/unpack round trip through the generated
 * code, so the build-time protoc-c step produces working code. */
static void test_proto_roundtrip(void **state) {
  (void)state;
  Shardplane__V1__Unit unit = SHARDPLANE__V1__UNIT__INIT;
  unit.module_fqn = "model.layers.0";
  unit.dtype = SHARDPLANE__V1__DTYPE__FLOAT32;
  unit.param_dtype = SHARDPLANE__V1__DTYPE__BFLOAT16;
  unit.numel = 855654400;
  unit.shard_numel = 835600;
  Shardplane__V1__Unit *units[1] = {&unit};
  Shardplane__V1__Plan plan = SHARDPLANE__V1__PLAN__INIT;
  plan.version = "0123456789abcdef";
  plan.n_units = 1;
  plan.units = units;
  size_t len = shardplane__v1__plan__get_packed_size(&plan);
  uint8_t buf[256];
  assert_true(len < sizeof buf);
  assert_int_equal(shardplane__v1__plan__pack(&plan, buf), len);
  Shardplane__V1__Plan *back = shardplane__v1__plan__unpack(NULL, len, buf);
  assert_non_null(back);
  assert_string_equal(back->version, "0123456789abcdef");
  assert_int_equal(back->n_units, 1);
  assert_string_equal(back->units[0]->module_fqn, "model.layers.0");
  assert_int_equal(back->units[0]->param_dtype, SP_BFLOAT16);
  assert_int_equal(back->units[0]->shard_numel, 835600);
  shardplane__v1__plan__free_unpacked(back, NULL);
  /* garbage does not decode into a plan */
  uint8_t junk[4] = {0x0a, 0xff, 0xff, 0xff};
  assert_null(shardplane__v1__plan__unpack(NULL, sizeof junk, junk));
}

static void test_strmap(void **state) {
  (void)state;
  sp_strmap *m = sp_strmap_new(1);
  char keys[2000][16];
  for (int i = 0; i < 2000; i++) {
    snprintf(keys[i], sizeof keys[i], "k%d", i);
    assert_int_equal(sp_strmap_put(m, keys[i], i), 0);
  }
  assert_int_equal(sp_strmap_put(m, "k7", 1), SP_EEXIST);
  for (int i = 0; i < 2000; i++) assert_int_equal(sp_strmap_get(m, keys[i]), i);
  assert_int_equal(sp_strmap_get(m, "k2000"), -1);
  assert_int_equal(sp_strmap_size(m), 2000);
  sp_strmap_free(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_table),
      cmocka_unit_test(test_parse_errors_and_aliases),
      cmocka_unit_test(test_errors),
      cmocka_unit_test(test_proto_enums_match),
      cmocka_unit_test(test_proto_roundtrip),
      cmocka_unit_test(test_strmap),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
