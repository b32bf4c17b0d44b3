/* A pre-scan of protobuf wire bytes, run by the server before protobuf-c
 * unpacks a request. protobuf-c keeps every unknown field as its own
 * allocation (an 8 MiB message of 2-byte unknown fields cost 365 MB and
 * 410 ms to decode), accepts strings with NUL bytes (which C then cuts
 * short) and invalid UTF-8. One linear scan driven by the message
 * descriptor (recursing into message-typed fields) finds all three, so the
 * decode that follows costs memory in proportion to the known fields only.
 * Private to common/rpc; unit-tested and fuzzed directly.
 *
 * Thread-safe: no state. */
#ifndef SP_RPC_PBCHECK_H
#define SP_RPC_PBCHECK_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

/* Messages nested deeper than this are refused (protobuf-c recurses once
 * per level while unpacking). */
#define SP_PBCHECK_MAX_DEPTH 32

/* Checks `len` bytes as a message of type `desc`:
 * - every string field (also inside nested messages and repeated) is valid
 *   UTF-8 without a NUL byte;
 * - the wire data is well formed: tags, varints and lengths within the
 *   bytes, known fields with a wire type protobuf-c accepts for them, no
 *   groups, nesting at most SP_PBCHECK_MAX_DEPTH.
 * Unknown fields are dropped: when there are any, *out gets a malloc'd
 * copy of the message without them (*out_len its size, the caller frees
 * it); when there are none *out is NULL and the input is used as is, so a
 * message of known fields only costs one scan.
 *
 * What protobuf-c will allocate to decode the known fields (each message,
 * string, bytes value and repeated array slot, with malloc's overhead) is
 * estimated on the way; over max_decoded (0: no limit) the message is
 * refused, so known fields cannot amplify either (a million empty nested
 * messages in 2 MiB would otherwise cost about 70 MB).
 *
 * Returns 0, SP_EFORMAT with one line in err naming the field (e.g.
 * "shardplane.v1.StoreSetRequest.key: contains a NUL byte at offset 1";
 * err may be NULL), SP_ETOOBIG (over max_decoded, err says so) or
 * SP_ENOMEM (for the copy). */
int sp_rpc_pbcheck(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                   size_t len, size_t max_decoded, uint8_t **out,
                   size_t *out_len, char *err, size_t err_cap);

/* Whether s[0..n) is valid UTF-8 (no overlong forms, no surrogates, at most
 * U+10FFFF); if not, *bad (when given) is the offset of the first bad
 * byte. NUL bytes are valid UTF-8 here. */
int sp_rpc_utf8_valid(const uint8_t *s, size_t n, size_t *bad);

#endif
