/* Entry points of the fuzz harnesses, shared by the libFuzzer targets and
 * the corpus replay test (tests/test_rpc_fuzz_replay.c), which runs the same
 * code with any compiler. */
#ifndef SP_FUZZ_TARGETS_H
#define SP_FUZZ_TARGETS_H

#include <stddef.h>
#include <stdint.h>

/* Server input: data[0] is a mode byte, the rest is what one client sends
 * on one connection.
 *   bit 0: prepend the client connection preface
 *   bit 1: prepend an empty SETTINGS frame (after the preface)
 *   bits 4-7 = k: feed the bytes 2^(k+1) at a time (k = 0: all at once)
 * Aborts when the server leaks a call, a connection or a loop handle, or
 * writes output that is not well-formed HTTP/2. */
#define SP_FUZZ_PREFACE 0x01
#define SP_FUZZ_SETTINGS 0x02
#define SP_FUZZ_CHUNK(k) ((uint8_t)((k) << 4))

/* Runs one input; everything the server writes is also handed to sink
 * (may be NULL). Returns what sp_rpc_server_feed_bytes returned. */
int sp_fuzz_rpc_server_run(const uint8_t *data, size_t size,
                           int (*sink)(void *arg, const uint8_t *out, size_t n),
                           void *arg);
int sp_fuzz_rpc_server_one(const uint8_t *data, size_t size);
/* Frees the server and loop the harness keeps between inputs. */
void sp_fuzz_rpc_server_teardown(void);

/* Wire helpers: data[0] picks the deframer limit, data[1] how the bytes are
 * split; the rest goes through the deframer, percent decoding, grpc-timeout
 * parsing, base64 and metadata checks, with round-trip assertions. */
int sp_fuzz_rpc_wire_one(const uint8_t *data, size_t size);

#endif
