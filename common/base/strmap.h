/* A small open-addressing hash map from strings to int32 values.
 *
 * Keys are borrowed: the caller keeps each key alive and unchanged for as long
 * as the map holds it (typically the strings of an sp_model). Used for FQN
 * lookups, which must stay constant-time for models with thousands of
 * modules.
 */
#ifndef SP_STRMAP_H
#define SP_STRMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct sp_strmap sp_strmap;

/* Creates a map sized for about `expected` keys. Returns NULL on ENOMEM. */
sp_strmap *sp_strmap_new(size_t expected);
void sp_strmap_free(sp_strmap *m);

/* Inserts key -> value. Returns 0, SP_EEXIST if the key is present (the old
 * value is kept), or SP_ENOMEM. */
int sp_strmap_put(sp_strmap *m, const char *key, int32_t value);
/* Value for key, or -1 when absent. */
int32_t sp_strmap_get(const sp_strmap *m, const char *key);
size_t sp_strmap_size(const sp_strmap *m);

/* malloc'd copy of s, or NULL on ENOMEM. */
char *sp_strdup(const char *s);

/* 64-bit FNV-1a, also used to fingerprint plans. */
uint64_t sp_fnv1a64(uint64_t h, const void *data, size_t len);
#define SP_FNV1A64_INIT UINT64_C(0xcbf29ce484222325)

#endif
