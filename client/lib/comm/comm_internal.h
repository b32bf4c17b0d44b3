/* Communicator internals: the backend table that sp_comm dispatches through.
 *
 * comm.c owns everything backend-independent: argument checks, the abort
 * flag, the "broken" state after a failure, diagnostics naming the
 * communicator. The deterministic host-side sum, which comm.c and the Gloo
 * backend share, is comm_sum.c's. A backend only moves bytes between
 * members and reports why it failed. Backends: Gloo
 * (comm_gloo.cc, host memory) and NCCL (comm_nccl.c, device memory, built
 * with CUDA and NCCL only).
 *
 * This header is included by C and by the Gloo bridge (C++), so it holds
 * only plain C types.
 */
#ifndef SP_COMM_INTERNAL_H
#define SP_COMM_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"
#include "lib/shardplane.h"
#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most members a communicator may have. Every member holds a socket per
 * peer, so far fewer are practical; the cap keeps rank arithmetic in int. */
#define SP_COMM_MAX_SIZE 65536u
/* Longest store prefix accepted (bytes, without the NUL). */
#define SP_COMM_MAX_PREFIX 1024u
/* Timeouts above this are clamped: std::chrono deadlines computed from
 * "now + timeout" must not overflow, and a week is forever for a job. */
#define SP_COMM_MAX_TIMEOUT_MS (7ull * 24 * 3600 * 1000)
#define SP_COMM_DEFAULT_TIMEOUT_MS 60000ull

/* What a backend learns at creation. Strings are borrowed for the life of
 * the communicator (comm.c keeps them). */
typedef struct sp_comm_info {
  const char *prefix;
  uint32_t rank;
  /* >= 2 for a host-memory backend (comm.c handles a single member itself,
   * on the host); any size for a device_buffers backend. */
  uint32_t size;
  uint64_t timeout_ms; /* already defaulted and clamped */
  const char *device;  /* opts.device, may be NULL */
  const char *host;    /* opts.host, may be NULL */
  /* opts.cancel / opts.cancel_user: polled during the rendezvous; may be
   * NULL. */
  bool (*cancel)(void *user);
  void *cancel_user;
} sp_comm_info;

/* A backend. Every function returns 0 or a negative SP_E* code and, on
 * error, writes the cause (not the communicator name: comm.c prefixes it)
 * into d, which is never NULL here. Arguments are already checked: pointers
 * are non-NULL, counts are > 0, byte sizes times the member count fit in
 * size_t, dtypes are valid (and summable where a sum is taken).
 *
 * After an operation fails the backend must leave no transfer that could
 * still touch the caller's buffers (Gloo: every connection is closed), so
 * that comm.c can mark the communicator broken and the caller may free its
 * memory. An operation woken by abort returns SP_ECANCELED. */
typedef struct sp_comm_backend {
  const char *name;
  /* Rendezvous through store; *impl receives the backend state. */
  int (*create)(const sp_comm_info *info, const sp_comm_store *store,
                void **impl, sp_diag *d);
  void (*destroy)(void *impl);
  /* nbytes per member; send may equal recv + rank * nbytes. */
  int (*all_gather)(void *impl, const void *send, void *recv, size_t nbytes,
                    sp_diag *d);
  int (*reduce_scatter)(void *impl, const void *send, void *recv, size_t count,
                        sp_dtype dt, sp_diag *d);
  int (*all_reduce)(void *impl, void *buf, size_t count, sp_dtype dt,
                    sp_diag *d);
  int (*broadcast)(void *impl, void *buf, size_t nbytes, uint32_t root,
                   sp_diag *d);
  int (*barrier)(void *impl, sp_diag *d);
  /* Any thread, any time between create and destroy: wakes the operation
   * in progress (it returns SP_ECANCELED) and makes later ones fail. */
  void (*abort)(void *impl);
  /* Members below are optional (a positional initializer that stops at
   * abort leaves them NULL / 0). */
  /* The stream operations are enqueued on (sp_comm_cuda_stream); NULL for a
   * backend without one. Never fails once created. */
  void *(*cuda_stream)(void *impl);
  /* Non-zero: buffers are device memory. Then comm.c never touches them on
   * the host, and a single member goes through the backend too. */
  int device_buffers;
} sp_comm_backend;

/* The Gloo backend (comm_gloo.cc). */
const sp_comm_backend *sp_comm_gloo_backend(void);

#if SHARDPLANE_HAVE_NCCL
/* The NCCL backend (comm_nccl.c), built only with CUDA and NCCL. */
const sp_comm_backend *sp_comm_nccl_backend(void);
#endif

#ifdef __cplusplus
}
#endif
#endif
