/* The protobuf pre-scan (common/rpc/rpc_pbcheck.h): unknown fields are
 * dropped (also inside nested and repeated messages), strings with NUL or
 * invalid UTF-8 and malformed wire data are refused naming the field, and
 * a message of known fields only is used as is. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "base/clock.h"
#include "base/sp_error.h"
#include "rpc/rpc_pbcheck.h"
#include "shardplane/v1/coordinator.pb-c.h"

typedef struct bytes {
  uint8_t *p;
  size_t n;
} bytes;

static bytes B(const void *p, size_t n) {
  bytes b = {malloc(n ? n : 1), n};
  assert_non_null(b.p);
  memcpy(b.p, p, n);
  return b;
}
#define LIT(s) B(s, sizeof(s) - 1)

static bytes cat(bytes a, bytes b) {
  bytes r = {malloc(a.n + b.n + 1), a.n + b.n};
  assert_non_null(r.p);
  memcpy(r.p, a.p, a.n);
  memcpy(r.p + a.n, b.p, b.n);
  free(a.p);
  free(b.p);
  return r;
}

static bytes pack(const ProtobufCMessage *m) {
  bytes b = {malloc(protobuf_c_message_get_packed_size(m) + 1), 0};
  assert_non_null(b.p);
  b.n = protobuf_c_message_pack(m, b.p);
  return b;
}

/* Runs the check and expects it to fail with exactly `want`. */
static void expect_refused(const ProtobufCMessageDescriptor *d, bytes in,
                           const char *want) {
  uint8_t *out = (uint8_t *)1;
  size_t n = 1;
  char err[256];
  assert_int_equal(sp_rpc_pbcheck(d, in.p, in.n, 0, &out, &n, err, sizeof err),
                   SP_EFORMAT);
  assert_null(out);
  if (strstr(err, want) == NULL)
    fail_msg("error \"%s\", wanted \"%s\"", err, want);
  free(in.p);
}

/* Runs the check, which must pass; returns what protobuf-c gets. */
static bytes checked(const ProtobufCMessageDescriptor *d, bytes in,
                     bool expect_copy) {
  uint8_t *out = NULL;
  size_t n = 0;
  char err[256];
  int rc = sp_rpc_pbcheck(d, in.p, in.n, 0, &out, &n, err, sizeof err);
  if (rc != 0) fail_msg("refused: %s", err);
  if (!expect_copy) {
    assert_null(out);
    return in;
  }
  assert_non_null(out);
  free(in.p);
  return (bytes){out, n};
}

static void test_known_fields_used_as_is(void **state) {
  (void)state;
  Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  q.key = "rank/0/addr ü €";
  q.value.data = (uint8_t *)"\0\1\2";
  q.value.len = 3;
  bytes b = checked(&shardplane__v1__store_set_request__descriptor,
                    pack(&q.base), false);
  free(b.p);
  /* an empty message is fine too */
  uint8_t *out = NULL;
  size_t n = 0;
  assert_int_equal(sp_rpc_pbcheck(&shardplane__v1__get_job_request__descriptor,
                                  NULL, 0, 0, &out, &n, NULL, 0),
                   0);
  assert_null(out);
}

static void test_unknown_fields_dropped(void **state) {
  (void)state;
  Shardplane__V1__StoreSetRequest q = SHARDPLANE__V1__STORE_SET_REQUEST__INIT;
  q.key = "k";
  q.value.data = (uint8_t *)"vv";
  q.value.len = 2;
  bytes want = pack(&q.base);
  /* unknown varint, fixed64, fixed32 and length-delimited fields around
   * and between the known ones */
  bytes in = cat(LIT("\x18\x05\x21"
                     "12345678"),
                 LIT("\x0a\x01k"));
  in = cat(in, LIT("\x7d"
                   "abcd"
                   "\xfa\x01\x03xyz"));
  in = cat(in, LIT("\x12\x02vv\x80\x80\x01\x00"));
  bytes got = checked(&shardplane__v1__store_set_request__descriptor, in, true);
  assert_int_equal(got.n, want.n);
  assert_memory_equal(got.p, want.p, want.n);
  free(got.p);
  free(want.p);
  /* only unknown fields: an empty message */
  got = checked(&shardplane__v1__store_set_request__descriptor,
                LIT("\x18\x00\x18\x00"), true);
  assert_int_equal(got.n, 0);
  free(got.p);
}

static void test_nested_unknown_fields_dropped(void **state) {
  (void)state;
  Shardplane__V1__Transition t1 = SHARDPLANE__V1__TRANSITION__INIT;
  Shardplane__V1__Transition t2 = SHARDPLANE__V1__TRANSITION__INIT;
  t1.machine = SHARDPLANE__V1__MACHINE__MACHINE_HANDLE;
  t1.unit = 3;
  t1.state = 2;
  t2.step = 300; /* a two-byte varint */
  Shardplane__V1__Transition *tp[2] = {&t1, &t2};
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.rank = 1;
  up.session_id = "00112233445566778899aabbccddeeff";
  up.seq = 9;
  up.n_transitions = 2;
  up.transitions = tp;
  bytes want = pack(&up.base);
  /* the same message with unknown fields inside the first transition,
   * whose length prefix then shrinks, and at the top */
  bytes t1b = pack(&t1.base);
  bytes t1x = cat(LIT("\x78\x01\xfa\x01\x02zz"), t1b);
  uint8_t hdr[2] = {0x22, (uint8_t)t1x.n};
  bytes t2b = pack(&t2.base);
  uint8_t hdr2[2] = {0x22, (uint8_t)t2b.n};
  Shardplane__V1__SessionUp top = up;
  top.n_transitions = 0;
  bytes in = cat(pack(&top.base), B(hdr, 2));
  in = cat(in, t1x);
  in = cat(in, B(hdr2, 2));
  in = cat(in, t2b);
  in = cat(in, LIT("\xa0\x06\x01"));
  bytes got = checked(&shardplane__v1__session_up__descriptor, in, true);
  assert_int_equal(got.n, want.n);
  assert_memory_equal(got.p, want.p, want.n);
  Shardplane__V1__SessionUp *m =
      shardplane__v1__session_up__unpack(NULL, got.n, got.p);
  assert_non_null(m);
  assert_int_equal(m->n_transitions, 2);
  assert_int_equal(m->transitions[0]->unit, 3);
  assert_int_equal(m->transitions[1]->step, 300);
  shardplane__v1__session_up__free_unpacked(m, NULL);
  free(got.p);
  free(want.p);
}

static void test_strings_refused(void **state) {
  (void)state;
  const ProtobufCMessageDescriptor *d =
      &shardplane__v1__store_set_request__descriptor;
  expect_refused(d,
                 LIT("\x0a\x03"
                     "a\0b"),
                 "shardplane.v1.StoreSetRequest.key: contains a NUL byte at "
                 "offset 1");
  /* overlong, surrogate, above U+10FFFF, truncated, lone continuation */
  expect_refused(d, LIT("\x0a\x02\xc0\x80"),
                 "shardplane.v1.StoreSetRequest.key: not valid UTF-8 at "
                 "offset 0");
  expect_refused(d,
                 LIT("\x0a\x04"
                     "a\xed\xa0\x80"),
                 "not valid UTF-8 at offset 1");
  expect_refused(d, LIT("\x0a\x04\xf4\x90\x80\x80"), "not valid UTF-8");
  expect_refused(d,
                 LIT("\x0a\x03"
                     "ab\xe2"),
                 "not valid UTF-8 at offset 2");
  expect_refused(d,
                 LIT("\x0a\x02"
                     "a\x80"),
                 "not valid UTF-8 at offset 1");
  /* a bytes field may hold anything */
  bytes b = checked(d, LIT("\x12\x03\x00\xff\xc0"), false);
  free(b.p);
  /* inside a repeated string of a list, named by its own message */
  expect_refused(&shardplane__v1__store_wait_request__descriptor,
                 LIT("\x0a\x01"
                     "a\x0a\x02"
                     "b\xff"),
                 "shardplane.v1.StoreWaitRequest.keys: not valid UTF-8 at "
                 "offset 1");
  /* and inside a nested message */
  expect_refused(&shardplane__v1__list_ranks_response__descriptor,
                 LIT("\x0a\x04\x1a\x02h\x00"),
                 "shardplane.v1.RankInfo.host: contains a NUL byte");
  /* 1-4 byte forms that are fine, long enough for the 8-byte path */
  b = checked(d,
              LIT("\x0a\x13"
                  "abcdefgh\xc3\xbc\xe2\x82\xac\xf0\x9f\x98\x80"
                  "ij"),
              false);
  free(b.p);
}

static void test_malformed_refused(void **state) {
  (void)state;
  const ProtobufCMessageDescriptor *d =
      &shardplane__v1__store_set_request__descriptor;
  expect_refused(d, LIT("\x0a"), "malformed wire data at byte 1 (length)");
  expect_refused(d,
                 LIT("\x0a\x05"
                     "ab"),
                 "(length)");
  expect_refused(d, LIT("\x18\xff\xff"), "(varint)");
  expect_refused(d, LIT("\x19\x01\x02"), "(truncated)");
  expect_refused(d, LIT("\x1b"), "(wire type 3)");
  expect_refused(d, LIT("\x1e\x00"), "(wire type 6)");
  expect_refused(d, LIT("\x00\x00"), "(field 0)");
  expect_refused(d, LIT("\xff\xff\xff\xff\xff\xff\x01"), "(field tag)");
  /* a known field with a wire type protobuf-c would reject */
  expect_refused(d, LIT("\x08\x01"),
                 "shardplane.v1.StoreSetRequest.key: wire type 0 where 2 is "
                 "expected");
  /* the offset is the outer message's, also from inside a nested one */
  expect_refused(&shardplane__v1__session_up__descriptor,
                 LIT("\x08\x01\x22\x01\x08"), "at byte 5");
  /* packed repeated scalars: whole elements only */
  const ProtobufCMessageDescriptor *ri = &shardplane__v1__rank_info__descriptor;
  bytes b = checked(ri, LIT("\x42\x03\x01\x02\x03\x40\x04"), false);
  Shardplane__V1__RankInfo *m =
      shardplane__v1__rank_info__unpack(NULL, b.n, b.p);
  assert_non_null(m);
  assert_int_equal(m->n_unit_states, 4);
  shardplane__v1__rank_info__free_unpacked(m, NULL);
  free(b.p);
  expect_refused(ri, LIT("\x42\x02\x01\x80"), "unit_states: malformed packed");
}

/* The measured attack: 8 MiB of 2-byte unknown fields, which protobuf-c
 * alone decoded in 410 ms into 365 MB. */
static void test_unknown_field_flood(void **state) {
  (void)state;
  size_t n = 8u << 20;
  uint8_t *in = malloc(n);
  assert_non_null(in);
  for (size_t i = 0; i < n; i += 2) {
    in[i] = 0x78; /* field 15, varint */
    in[i + 1] = 0x00;
  }
  double t0 = sp_clock_s();
  uint8_t *out = NULL;
  size_t out_n = 1;
  assert_int_equal(
      sp_rpc_pbcheck(&shardplane__v1__store_set_request__descriptor, in, n, n,
                     &out, &out_n, NULL, 0),
      0);
  double ms = (sp_clock_s() - t0) * 1e3;
  assert_non_null(out);
  assert_int_equal(out_n, 0);
  ProtobufCMessage *m = protobuf_c_message_unpack(
      &shardplane__v1__store_set_request__descriptor, NULL, out_n, out);
  assert_non_null(m);
  protobuf_c_message_free_unpacked(m, NULL);
  printf(
      "pre-scan of 8 MiB of 2-byte unknown fields: %.1f ms, 0 bytes "
      "left to decode\n",
      ms);
  free(out);
  free(in);
}

/* Known fields can amplify too: empty nested messages of two bytes each
 * become a struct and an array slot each. The estimate refuses them over
 * the limit, and lets a real SessionUp batch through. */
static void test_decode_budget(void **state) {
  (void)state;
  const ProtobufCMessageDescriptor *d = &shardplane__v1__session_up__descriptor;
  size_t n = 2u << 20;
  uint8_t *in = malloc(n);
  assert_non_null(in);
  for (size_t i = 0; i < n; i += 2) {
    in[i] = 0x22; /* transitions, an empty Transition */
    in[i + 1] = 0x00;
  }
  uint8_t *out = NULL;
  size_t out_n = 0;
  char err[256];
  assert_int_equal(
      sp_rpc_pbcheck(d, in, n, 8u << 20, &out, &out_n, err, sizeof err),
      SP_ETOOBIG);
  assert_non_null(strstr(err,
                         "shardplane.v1.SessionUp: decoding it would "
                         "take more than 8388608 bytes"));
  free(in);
  /* 4096 transitions, as the worker batches them, fit easily */
  Shardplane__V1__Transition t = SHARDPLANE__V1__TRANSITION__INIT;
  t.machine = SHARDPLANE__V1__MACHINE__MACHINE_HANDLE;
  t.unit = 7;
  t.state = 2;
  t.step = 123456;
  Shardplane__V1__Transition *tp[4096];
  for (size_t i = 0; i < 4096; i++) tp[i] = &t;
  Shardplane__V1__SessionUp up = SHARDPLANE__V1__SESSION_UP__INIT;
  up.n_transitions = 4096;
  up.transitions = tp;
  bytes b = pack(&up.base);
  assert_int_equal(
      sp_rpc_pbcheck(d, b.p, b.n, 8u << 20, &out, &out_n, err, sizeof err), 0);
  assert_null(out);
  free(b.p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_known_fields_used_as_is),
      cmocka_unit_test(test_unknown_fields_dropped),
      cmocka_unit_test(test_nested_unknown_fields_dropped),
      cmocka_unit_test(test_strings_refused),
      cmocka_unit_test(test_malformed_refused),
      cmocka_unit_test(test_unknown_field_flood),
      cmocka_unit_test(test_decode_budget),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
