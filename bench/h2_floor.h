/* The nghttp2 floor of bench/rpc: what HTTP/2 itself costs per unary gRPC
 * call when nghttp2 does it and nothing else does. One client and one
 * server session of nghttp2 exchange Echo-shaped unary calls in memory, on
 * the calling thread: the request headers our client sends, the response
 * headers and trailers our server sends, the same message bytes both ways,
 * the same SETTINGS; no sockets, no event loop, no protobuf, no per-call
 * state of an engine. An engine built on nghttp2 cannot spend less CPU per
 * call than this, so bench/rpc prints its own CPU per call against it.
 *
 * Not thread-safe: one floor per thread. */
#ifndef SP_BENCH_H2_FLOOR_H
#define SP_BENCH_H2_FLOOR_H

#include <stddef.h>
#include <stdint.h>

typedef struct sp_h2_floor sp_h2_floor;

/* Sets up both sessions and exchanges their SETTINGS. msg/len: the gRPC
 * message (without its 5-byte prefix) sent as request and as reply,
 * copied; authority: the :authority value, copied. SP_EINVAL (len over
 * 16 KiB), SP_ENOMEM, or SP_EIO when nghttp2 refuses the exchange. */
int sp_h2_floor_new(const uint8_t *msg, size_t len, const char *authority,
                    sp_h2_floor **out);

/* Keeps `in_flight` calls going (each completion starts the next) for
 * `seconds` of wall-clock time, then lets those in flight finish. Adds the
 * thread's CPU time (ns) and the completed calls to *cpu_ns and *calls.
 * 0, or SP_EIO when nghttp2 fails (then the floor is unusable). */
int sp_h2_floor_slice(sp_h2_floor *f, int in_flight, double seconds,
                      uint64_t *cpu_ns, uint64_t *calls);

void sp_h2_floor_free(sp_h2_floor *f);

#endif
