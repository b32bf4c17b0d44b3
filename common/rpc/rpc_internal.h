/* Pieces shared by the files of common/rpc; not part of the public API. */
#ifndef SP_RPC_INTERNAL_H
#define SP_RPC_INTERNAL_H

#include <nghttp2/nghttp2.h>
#include <sys/socket.h>

#include "rpc.h"

/* A header field to submit: the name a lowercase string literal, which
 * nghttp2 then neither copies nor lowercases; the value copied. Copying
 * and lowercasing every field of the header blocks cost a client 980 of
 * its 11,600 instructions per unary call and a server 570; with these, 290
 * and 200 (callgrind over bench/rpc's calls, 8 in flight). */
#define SP_NV(n, v, vl)                                  \
  {                                                      \
    (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, (vl), \
        NGHTTP2_NV_FLAG_NO_COPY_NAME                     \
  }
/* The same with a value in static storage: not copied either (nghttp2
 * reads it until the frame is sent; its header table keeps copies). */
#define SP_NV_STATIC(n, v, vl)                                       \
  {                                                                  \
    (uint8_t *)(n), (uint8_t *)(v), sizeof(n) - 1, (vl),             \
        NGHTTP2_NV_FLAG_NO_COPY_NAME | NGHTTP2_NV_FLAG_NO_COPY_VALUE \
  }

/* Health service state, embedded in the server. */
typedef struct sp_rpc_health_state {
  struct sp_rpc_health_ent {
    char *name;
    int status;
  } * e;
  size_t n, cap;
  struct sp_rpc_health_watch *watchers;
  sp_rpc_method methods[2];
} sp_rpc_health_state;

int sp_rpc_health_init(sp_rpc_server *srv, sp_rpc_health_state *h);
int sp_rpc_health_set(sp_rpc_health_state *h, const char *service,
                      sp_rpc_health status);
/* Marks everything NOT_SERVING and ends the Watch streams. */
void sp_rpc_health_shutdown(sp_rpc_health_state *h);
void sp_rpc_health_free(sp_rpc_health_state *h);

/* A listener or connection handle finished closing. */
void sp_rpc_server_handle_closed(sp_rpc_server *srv);

/* Test and fuzzing seam: runs one server connection over `len` bytes held
 * in memory, as if a client had sent them on a socket. The bytes go in
 * `chunk` at a time (0: all at once), with a non-blocking loop iteration
 * after each so handlers that defer work can act; everything the server
 * writes goes to sink (may be NULL; non-zero from it fails the connection
 * like a broken socket). Then the connection is closed, which cancels the
 * calls it still has, and the function returns once it is freed. Handles
 * the handlers were closing may still need one more loop iteration to be
 * released. Call it on the loop thread, outside loop callbacks (it runs the
 * loop). Returns 0, SP_EINVAL, SP_ESTATE (shutting down) or SP_ENOMEM. */
int sp_rpc_server_feed_bytes(
    sp_rpc_server *srv, const uint8_t *data, size_t len, size_t chunk,
    int (*sink)(void *arg, const uint8_t *out, size_t n), void *arg);

/* "1.2.3.4:5" or "[::1]:5". */
void sp_rpc_format_sockaddr(const struct sockaddr *sa, char *out, size_t cap);

#endif
