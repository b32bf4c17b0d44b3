/* The dtype table: PyTorch names, element sizes, safetensors names.
 *
 * The numeric values of sp_dtype are part of the wire protocol (they equal the
 * `shardplane.v1.DType` enum in proto/) and must never be renumbered.
 */
#ifndef SP_DTYPE_H
#define SP_DTYPE_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum sp_dtype {
  SP_DTYPE_INVALID = 0,
  SP_FLOAT32 = 1,
  SP_FLOAT64 = 2,
  SP_FLOAT16 = 3,
  SP_BFLOAT16 = 4,
  SP_INT64 = 5,
  SP_INT32 = 6,
  SP_INT16 = 7,
  SP_INT8 = 8,
  SP_UINT8 = 9,
  SP_BOOL = 10,
  SP_DTYPE_COUNT
} sp_dtype;

typedef struct sp_dtype_info {
  sp_dtype dtype;
  const char *name;    /* PyTorch name: "float32", "bfloat16", ... */
  const char *st_name; /* safetensors name: "F32", "BF16", ... */
  size_t size;         /* bytes per element */
  bool is_floating;
} sp_dtype_info;

/* NULL for SP_DTYPE_INVALID or out-of-range values. Static storage. */
const sp_dtype_info *sp_dtype_get_info(sp_dtype t);

bool sp_dtype_valid(sp_dtype t);
/* "invalid" for invalid values; never NULL. */
const char *sp_dtype_name(sp_dtype t);
const char *sp_dtype_st_name(sp_dtype t);
/* 0 for invalid values. */
size_t sp_dtype_size(sp_dtype t);
bool sp_dtype_is_floating(sp_dtype t);
/* int64, int32, int16, int8 and uint8 (bool is neither). */
bool sp_dtype_is_integer(sp_dtype t);

/* Parses a PyTorch dtype name. Accepts the canonical names, the "torch."
 * prefix, and PyTorch's aliases (float, double, half, long, int, short).
 * Returns 0 or SP_EINVAL; *out is untouched on error. */
int sp_dtype_parse(const char *name, sp_dtype *out);

/* Parses a safetensors dtype name ("F32", "BF16", ...). Returns 0,
 * or SP_EUNSUPPORTED for a valid safetensors dtype shardplane does not
 * handle (F8_*, U16, ...), or SP_EINVAL for anything else. */
int sp_dtype_parse_st(const char *name, sp_dtype *out);

#ifdef __cplusplus
}
#endif
#endif
