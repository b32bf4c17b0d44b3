/* Error codes and diagnostics shared by every shardplane module.
 *
 * Every fallible function returns 0 on success or one of the negative SP_E*
 * codes below. Functions that can say more than a code (which file, which JSON
 * path, which rank) also take an optional `sp_diag *` and write one readable
 * line into it; passing NULL is always allowed.
 */
#ifndef SP_ERROR_H
#define SP_ERROR_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* X-macro so the enum and sp_strerror()/sp_err_name() cannot drift apart. */
#define SP_ERRNO_MAP(X)                                         \
  X(EINVAL, -1, "invalid argument")                             \
  X(ENOMEM, -2, "out of memory")                                \
  X(EIO, -3, "i/o error")                                       \
  X(ENOENT, -4, "not found")                                    \
  X(EEXIST, -5, "already exists")                               \
  X(ERANGE, -6, "value out of range")                           \
  X(EFORMAT, -7, "malformed input")                             \
  X(ETOOBIG, -8, "size limit exceeded")                         \
  X(ESTATE, -9, "illegal state transition")                     \
  X(EUNSUPPORTED, -10, "not supported")                         \
  X(ETIMEDOUT, -11, "timed out")                                \
  X(ECUDA, -12, "CUDA error")                                   \
  X(ENCCL, -13, "NCCL error")                                   \
  X(ENODEV, -14, "no such device")                              \
  X(EMISMATCH, -15, "mismatch")                                 \
  X(EAGAIN, -16, "resource temporarily unavailable, try again") \
  X(ECANCELED, -17, "cancelled")

typedef enum sp_errno {
#define SP_ERR_ENUM(name, val, msg) SP_##name = (val),
  SP_ERRNO_MAP(SP_ERR_ENUM)
#undef SP_ERR_ENUM
} sp_errno;

/* Static strings; never NULL (unknown codes give "unknown error"). */
const char *sp_strerror(int err);
const char *sp_err_name(int err);

#define SP_DIAG_MAX 512

/* One human-readable line describing the last failure. Owned by the caller,
 * usually on the stack. */
typedef struct sp_diag {
  char msg[SP_DIAG_MAX];
} sp_diag;

/* Formats into d->msg (truncating) and returns `err`, so callers can write
 * `return sp_diag_set(d, SP_EINVAL, "...")`. d may be NULL. */
int sp_diag_set(sp_diag *d, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefixes an existing message, e.g. with the file name, keeping the code. */
int sp_diag_prefix(sp_diag *d, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#ifdef __cplusplus
}
#endif
#endif
