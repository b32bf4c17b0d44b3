#include "dtype.h"

#include <string.h>

#include "base/sp_error.h"

/* Indexed by sp_dtype; entry 0 is the invalid slot. */
static const sp_dtype_info k_dtypes[SP_DTYPE_COUNT] = {
    [SP_DTYPE_INVALID] = {SP_DTYPE_INVALID, "invalid", "INVALID", 0, false},
    [SP_FLOAT32] = {SP_FLOAT32, "float32", "F32", 4, true},
    [SP_FLOAT64] = {SP_FLOAT64, "float64", "F64", 8, true},
    [SP_FLOAT16] = {SP_FLOAT16, "float16", "F16", 2, true},
    [SP_BFLOAT16] = {SP_BFLOAT16, "bfloat16", "BF16", 2, true},
    [SP_INT64] = {SP_INT64, "int64", "I64", 8, false},
    [SP_INT32] = {SP_INT32, "int32", "I32", 4, false},
    [SP_INT16] = {SP_INT16, "int16", "I16", 2, false},
    [SP_INT8] = {SP_INT8, "int8", "I8", 1, false},
    [SP_UINT8] = {SP_UINT8, "uint8", "U8", 1, false},
    [SP_BOOL] = {SP_BOOL, "bool", "BOOL", 1, false},
};

static const struct {
  const char *alias;
  sp_dtype dtype;
} k_aliases[] = {
    {"float", SP_FLOAT32}, {"double", SP_FLOAT64}, {"half", SP_FLOAT16},
    {"long", SP_INT64},    {"int", SP_INT32},      {"short", SP_INT16},
};

/* safetensors dtypes that exist but that shardplane does not compute with. */
static const char *const k_st_unsupported[] = {
    "U16",     "U32", "U64",     "F8_E5M2", "F8_E4M3",
    "F8_E8M0", "F4",  "F6_E2M3", "F6_E3M2", "C64",
};

bool sp_dtype_valid(sp_dtype t) {
  return t > SP_DTYPE_INVALID && t < SP_DTYPE_COUNT;
}

const sp_dtype_info *sp_dtype_get_info(sp_dtype t) {
  return sp_dtype_valid(t) ? &k_dtypes[t] : NULL;
}

const char *sp_dtype_name(sp_dtype t) {
  return sp_dtype_valid(t) ? k_dtypes[t].name : "invalid";
}

const char *sp_dtype_st_name(sp_dtype t) {
  return sp_dtype_valid(t) ? k_dtypes[t].st_name : "INVALID";
}

size_t sp_dtype_size(sp_dtype t) {
  return sp_dtype_valid(t) ? k_dtypes[t].size : 0;
}

bool sp_dtype_is_floating(sp_dtype t) {
  return sp_dtype_valid(t) && k_dtypes[t].is_floating;
}

bool sp_dtype_is_integer(sp_dtype t) {
  return t == SP_INT64 || t == SP_INT32 || t == SP_INT16 || t == SP_INT8 ||
         t == SP_UINT8;
}

int sp_dtype_parse(const char *name, sp_dtype *out) {
  if (name == NULL || out == NULL) return SP_EINVAL;
  if (strncmp(name, "torch.", 6) == 0) name += 6;
  for (int t = 1; t < SP_DTYPE_COUNT; t++) {
    if (strcmp(name, k_dtypes[t].name) == 0) {
      *out = (sp_dtype)t;
      return 0;
    }
  }
  for (size_t i = 0; i < sizeof k_aliases / sizeof k_aliases[0]; i++) {
    if (strcmp(name, k_aliases[i].alias) == 0) {
      *out = k_aliases[i].dtype;
      return 0;
    }
  }
  return SP_EINVAL;
}

int sp_dtype_parse_st(const char *name, sp_dtype *out) {
  if (name == NULL || out == NULL) return SP_EINVAL;
  for (int t = 1; t < SP_DTYPE_COUNT; t++) {
    if (strcmp(name, k_dtypes[t].st_name) == 0) {
      *out = (sp_dtype)t;
      return 0;
    }
  }
  for (size_t i = 0; i < sizeof k_st_unsupported / sizeof k_st_unsupported[0];
       i++) {
    if (strcmp(name, k_st_unsupported[i]) == 0) return SP_EUNSUPPORTED;
  }
  return SP_EINVAL;
}
