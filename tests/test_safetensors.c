/* Tests for the safetensors reader and writer. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <dirent.h>
#include <jansson.h>
#include <sys/stat.h>
#include <unistd.h>

#include "safetensors/safetensors.h"
#include "support/testutil.h"

/* ---- helpers ------------------------------------------------------------ */

static void put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* [le64 strlen(json)][json][data_len bytes 0xAB], malloc'd to exactly the
 * image size so ASan sees any over-read. */
static uint8_t *mk(const char *json, size_t data_len, size_t *len) {
  size_t n = strlen(json);
  *len = 8 + n + data_len;
  uint8_t *b = malloc(*len);
  assert_non_null(b);
  put_le64(b, n);
  memcpy(b + 8, json, n);
  memset(b + 8 + n, 0xAB, data_len);
  return b;
}

/* Parses json + data_len bytes and expects err with msg_part in the diag
 * (which must also name the source). */
static void expect_bad(const char *json, size_t data_len, int err,
                       const char *msg_part) {
  size_t len;
  uint8_t *b = mk(json, data_len, &len);
  sp_safetensors_file *f = (sp_safetensors_file *)(uintptr_t)1;
  sp_diag d = {{0}};
  int rc = sp_safetensors_parse(b, len, "bad.safetensors", &f, &d);
  if (rc != err || strstr(d.msg, msg_part) == NULL ||
      strstr(d.msg, "bad.safetensors") == NULL) {
    fail_msg("header %s: got %s \"%s\", want %s containing \"%s\"", json,
             sp_err_name(rc), d.msg, sp_err_name(err), msg_part);
  }
  assert_null(f);
  assert_null(strchr(d.msg, '\n'));
  free(b);
}

static uint8_t *read_file(const char *path, size_t *len) {
  FILE *fp = fopen(path, "rb");
  assert_non_null(fp);
  assert_int_equal(fseek(fp, 0, SEEK_END), 0);
  long n = ftell(fp);
  assert_true(n >= 0);
  rewind(fp);
  uint8_t *b = malloc((size_t)n + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, (size_t)n, fp), (size_t)n);
  fclose(fp);
  *len = (size_t)n;
  return b;
}

static size_t count_dir_entries(const char *dir) {
  DIR *dp = opendir(dir);
  assert_non_null(dp);
  size_t n = 0;
  struct dirent *e;
  while ((e = readdir(dp)) != NULL) {
    if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) n++;
  }
  closedir(dp);
  return n;
}

static const float k_f6[6] = {0, 1, 2, 3, 4, 5};

/* ---- reader: valid inputs ---------------------------------------------- */

static void test_reference_vector(void **state) {
  (void)state;
  const char *json =
      "{\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,"
      "24]}}";
  assert_int_equal(strlen(json), 64);
  uint8_t img[8 + 64 + 24];
  put_le64(img, 64);
  memcpy(img + 8, json, 64);
  memcpy(img + 72, k_f6, sizeof k_f6);
  /* byte-level check of the first float after the header: 1.0f */
  assert_int_equal(img[76], 0);
  assert_int_equal(img[78], 128);
  assert_int_equal(img[79], 63);

  sp_safetensors_file *f = NULL;
  sp_diag d = {{0}};
  assert_int_equal(sp_safetensors_parse(img, sizeof img, "vec", &f, &d), 0);
  assert_int_equal(sp_safetensors_header_len(f), 64);
  assert_int_equal(sp_safetensors_data_len(f), 24);
  assert_int_equal(sp_safetensors_tensor_count(f), 1);
  assert_int_equal(sp_safetensors_metadata_count(f), 0);
  const sp_safetensors_tensor *t = sp_safetensors_find(f, "attn.0");
  assert_non_null(t);
  assert_ptr_equal(t, sp_safetensors_tensor_at(f, 0));
  assert_string_equal(t->name, "attn.0");
  assert_int_equal(t->dtype, SP_FLOAT32);
  assert_int_equal(t->ndim, 3);
  assert_int_equal(t->shape[0], 1);
  assert_int_equal(t->shape[1], 2);
  assert_int_equal(t->shape[2], 3);
  assert_int_equal(t->numel, 6);
  assert_int_equal(t->begin, 0);
  assert_int_equal(t->end, 24);
  assert_int_equal(t->nbytes, 24);
  assert_ptr_equal(t->data, img + 72);
  float got[6];
  assert_int_equal(sp_safetensors_tensor_read(t, got, sizeof got), 0);
  assert_memory_equal(got, k_f6, sizeof got);
  assert_int_equal(sp_safetensors_tensor_read(t, got, 20), SP_ERANGE);
  assert_null(sp_safetensors_find(f, "attn"));
  assert_null(sp_safetensors_tensor_at(f, 1));
  const sp_safetensors_tensor *g = NULL;
  assert_int_equal(sp_safetensors_get(f, "attn.1", &g, &d), SP_ENOENT);
  assert_non_null(strstr(d.msg, "tensor 'attn.1' not found"));
  assert_int_equal(sp_safetensors_get(f, "attn.0", &g, &d), 0);
  assert_ptr_equal(g, t);
  sp_safetensors_close(f);

  /* the same bytes through a file */
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "vec.safetensors");
  sp_test_write_file(path, img, sizeof img);
  assert_int_equal(sp_safetensors_open(path, &f, &d), 0);
  t = sp_safetensors_find(f, "attn.0");
  assert_non_null(t);
  assert_memory_equal(t->data, k_f6, sizeof k_f6);
  /* sp_safetensors_open puts the data section on a 64-byte boundary */
  assert_int_equal((uintptr_t)t->data % 64, 0);
  sp_safetensors_close(f);
  sp_test_rmtree(dir);
  free(path);
  free(dir);
}

static void test_empty_header(void **state) {
  (void)state;
  const uint8_t img[16] = {8,   0,   0,   0,   0,   0,   0,   0,
                           '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
  sp_safetensors_file *f = NULL;
  assert_int_equal(sp_safetensors_parse(img, sizeof img, NULL, &f, NULL), 0);
  assert_int_equal(sp_safetensors_tensor_count(f), 0);
  assert_int_equal(sp_safetensors_metadata_count(f), 0);
  assert_int_equal(sp_safetensors_data_len(f), 0);
  assert_null(sp_safetensors_find(f, ""));
  assert_null(sp_safetensors_metadata_get(f, "format"));
  sp_safetensors_close(f);

  /* metadata only: {"__metadata__":{"framework":"pt"}} padded to 40 */
  const char *json = "{\"__metadata__\":{\"framework\":\"pt\"}}     ";
  assert_int_equal(strlen(json), 40);
  size_t len;
  uint8_t *b = mk(json, 0, &len);
  assert_int_equal(sp_safetensors_parse(b, len, NULL, &f, NULL), 0);
  assert_int_equal(sp_safetensors_tensor_count(f), 0);
  assert_int_equal(sp_safetensors_metadata_count(f), 1);
  assert_string_equal(sp_safetensors_metadata_get(f, "framework"), "pt");
  assert_string_equal(sp_safetensors_metadata_at(f, 0)->key, "framework");
  assert_null(sp_safetensors_metadata_at(f, 1));
  sp_safetensors_close(f);
  free(b);
}

static void test_scalar_and_zero_size(void **state) {
  (void)state;
  /* Listed out of offset order on purpose: the reader sorts. Zero-size
   * tensors may sit at any boundary, including beside each other. */
  const char *json =
      "{\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[4,12]},"
      "\"z0\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[0,0]},"
      "\"i\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"z1\":{\"dtype\":\"BF16\",\"shape\":[2,0],\"data_offsets\":[12,12]},"
      "\"z2\":{\"dtype\":\"BOOL\",\"shape\":[0],\"data_offsets\":[12,12]}}";
  size_t len;
  uint8_t *b = mk(json, 12, &len);
  sp_safetensors_file *f = NULL;
  sp_diag d = {{0}};
  assert_int_equal(sp_safetensors_parse(b, len, "x", &f, &d), 0);
  assert_int_equal(sp_safetensors_tensor_count(f), 5);
  const char *order[] = {"z0", "i", "s", "z1", "z2"};
  for (size_t i = 0; i < 5; i++) {
    assert_string_equal(sp_safetensors_tensor_at(f, i)->name, order[i]);
  }
  const sp_safetensors_tensor *s = sp_safetensors_find(f, "s");
  assert_int_equal(s->ndim, 0);
  assert_int_equal(s->numel, 1);
  assert_int_equal(s->nbytes, 8);
  const sp_safetensors_tensor *z = sp_safetensors_find(f, "z1");
  assert_int_equal(z->ndim, 2);
  assert_int_equal(z->numel, 0);
  assert_int_equal(z->nbytes, 0);
  assert_int_equal(sp_safetensors_tensor_read(z, NULL, 0), 0);
  sp_safetensors_close(f);
  free(b);
}

/* The data section of a hand-built image is rarely aligned; reads must go
 * through memcpy (UBSan checks the library never casts). */
static void test_unaligned_data(void **state) {
  (void)state;
  const char *json =
      "{\"d\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]}} ";
  size_t n = strlen(json);
  uint8_t *raw = malloc(1 + 8 + n + 16);
  assert_non_null(raw);
  uint8_t *img = raw + 1;
  put_le64(img, n);
  memcpy(img + 8, json, n);
  const double vals[2] = {3.25, -1.5};
  memcpy(img + 8 + n, vals, sizeof vals);
  sp_safetensors_file *f = NULL;
  assert_int_equal(sp_safetensors_parse(img, 8 + n + 16, NULL, &f, NULL), 0);
  const sp_safetensors_tensor *t = sp_safetensors_find(f, "d");
  assert_true((uintptr_t)t->data % 8 != 0);
  double got[2];
  assert_int_equal(sp_safetensors_tensor_read(t, got, sizeof got), 0);
  assert_true(got[0] == 3.25 && got[1] == -1.5);
  sp_safetensors_close(f);
  free(raw);
}

/* ---- reader: one test per rejection rule -------------------------------- */

static void test_reject_length(void **state) {
  (void)state;
  sp_safetensors_file *f = NULL;
  sp_diag d = {{0}};
  const uint8_t short_buf[7] = {0};
  assert_int_equal(
      sp_safetensors_parse(short_buf, 7, "bad.safetensors", &f, &d),
      SP_EFORMAT);
  assert_non_null(strstr(d.msg, "too short"));
  assert_int_equal(sp_safetensors_parse(NULL, 0, "bad.safetensors", &f, &d),
                   SP_EFORMAT);
  assert_int_equal(sp_safetensors_parse(NULL, 5, NULL, &f, &d), SP_EINVAL);
  assert_int_equal(sp_safetensors_parse(short_buf, 7, NULL, NULL, &d),
                   SP_EINVAL);

  uint8_t img[16];
  memcpy(img + 8, "{}      ", 8);
  put_le64(img, 100000001ull);
  assert_int_equal(
      sp_safetensors_parse(img, sizeof img, "bad.safetensors", &f, &d),
      SP_ETOOBIG);
  assert_non_null(strstr(d.msg, "exceeds the limit"));
  put_le64(img, UINT64_MAX);
  assert_int_equal(
      sp_safetensors_parse(img, sizeof img, "bad.safetensors", &f, &d),
      SP_ETOOBIG);
  put_le64(img, 9);
  assert_int_equal(
      sp_safetensors_parse(img, sizeof img, "bad.safetensors", &f, &d),
      SP_ETOOBIG);
  assert_non_null(strstr(d.msg, "runs past the end"));
  assert_null(f);

  expect_bad("", 0, SP_EFORMAT, "does not start with '{'");
  expect_bad(" {}", 0, SP_EFORMAT, "does not start with '{'");
  expect_bad("[]", 0, SP_EFORMAT, "does not start with '{'");
}

static void test_reject_json(void **state) {
  (void)state;
  expect_bad("{\"a\":", 0, SP_EFORMAT, "invalid JSON header");
  expect_bad("{} x", 0, SP_EFORMAT, "invalid JSON header");
  expect_bad("{\"a\xff\":{}}", 0, SP_EFORMAT, "invalid JSON header");
  expect_bad("{\"\xc0\xaf\":{}}", 0, SP_EFORMAT, "invalid JSON header");
  /* NUL inside the header length: jansson stops at nothing, reports it */
  size_t len;
  uint8_t *b = mk("{}      ", 0, &len);
  b[10] = 0;
  sp_safetensors_file *f = NULL;
  sp_diag d = {{0}};
  assert_int_equal(sp_safetensors_parse(b, len, "bad.safetensors", &f, &d),
                   SP_EFORMAT);
  free(b);
}

static void test_reject_duplicates(void **state) {
  (void)state;
  expect_bad(
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
      "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
      2, SP_EFORMAT, "duplicate object key");
  /* same key after unescaping */
  expect_bad(
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
      "\"\\u0061\":{\"dtype\":\"U8\",\"shape\":[1],"
      "\"data_offsets\":[1,2]}}",
      2, SP_EFORMAT, "duplicate object key");
  expect_bad("{\"__metadata__\":{},\"__metadata__\":{}}", 0, SP_EFORMAT,
             "duplicate object key");
}

static void test_reject_entry_not_object(void **state) {
  (void)state;
  expect_bad("{\"w\":[1]}", 0, SP_EFORMAT,
             "tensor 'w': entry is not an object");
  expect_bad("{\"w\":null}", 0, SP_EFORMAT,
             "tensor 'w': entry is not an object");
}

static void test_reject_dtype(void **state) {
  (void)state;
  expect_bad("{\"w\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}",
             4, SP_EFORMAT, "tensor 'w': unknown dtype \"F33\"");
  expect_bad("{\"w\":{\"dtype\":\"f32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
             4, SP_EFORMAT, "unknown dtype \"f32\"");
  expect_bad("{\"w\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
             SP_EFORMAT, "\"dtype\" is missing or not a string");
  expect_bad("{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, SP_EFORMAT,
             "\"dtype\" is missing");
  expect_bad(
      "{\"w\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
      SP_EUNSUPPORTED, "tensor 'w': dtype F8_E4M3 is not supported");
  expect_bad("{\"w\":{\"dtype\":\"U64\",\"shape\":[1],\"data_offsets\":[0,8]}}",
             8, SP_EUNSUPPORTED, "dtype U64 is not supported");
}

static void test_reject_shape(void **state) {
  (void)state;
  const char *msg = "tensor 'w': \"shape\" is not a list of non-negative";
  expect_bad("{\"w\":{\"dtype\":\"U8\",\"shape\":3,\"data_offsets\":[0,3]}}", 3,
             SP_EFORMAT, msg);
  expect_bad("{\"w\":{\"dtype\":\"U8\",\"data_offsets\":[0,3]}}", 3, SP_EFORMAT,
             msg);
  expect_bad("{\"w\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,0]}}",
             0, SP_EFORMAT, msg);
  expect_bad(
      "{\"w\":{\"dtype\":\"U8\",\"shape\":[1.0],\"data_offsets\":[0,1]}}", 1,
      SP_EFORMAT, msg);
  expect_bad(
      "{\"w\":{\"dtype\":\"U8\",\"shape\":[\"2\"],\"data_offsets\":[0,2]}}", 2,
      SP_EFORMAT, msg);
  expect_bad(
      "{\"w\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],"
      "\"data_offsets\":[0,1]}}",
      1, SP_ETOOBIG, "9 dimensions exceed the limit of 8");
  /* 2^32 * 2^32 elements: the product wraps in 64 bits */
  expect_bad(
      "{\"w\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296],"
      "\"data_offsets\":[0,0]}}",
      0, SP_EFORMAT, "shape overflows");
  /* 2^62 elements fit, 2^62 * 4 bytes do not */
  expect_bad(
      "{\"w\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904],"
      "\"data_offsets\":[0,0]}}",
      0, SP_EFORMAT, "shape overflows");
  /* too big for jansson's integer: a JSON error */
  expect_bad(
      "{\"w\":{\"dtype\":\"U8\",\"shape\":[18446744073709551616],"
      "\"data_offsets\":[0,0]}}",
      0, SP_EFORMAT, "invalid JSON header");
}

static void test_reject_offsets(void **state) {
  (void)state;
  const char *msg = "tensor 'w': \"data_offsets\" must be [begin, end]";
  expect_bad("{\"w\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, SP_EFORMAT, msg);
  expect_bad("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1]}}", 1,
             SP_EFORMAT, msg);
  expect_bad(
      "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 2,
      SP_EFORMAT, msg);
  expect_bad("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,0]}}",
             1, SP_EFORMAT, msg);
  expect_bad("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}",
             1, SP_EFORMAT, msg);
  expect_bad(
      "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":{\"a\":1}}}", 1,
      SP_EFORMAT, msg);

  /* size disagrees with shape * dtype size */
  expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}",
             4, SP_EFORMAT,
             "tensor 'w': data_offsets [0, 4] hold 4 bytes but 2 elements of "
             "F32 need 8");
  /* not starting at 0 */
  expect_bad("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
             8, SP_EFORMAT, "tensor 'w': data_offsets [4, 8] leave a gap");
  /* gap between tensors */
  expect_bad(
      "{\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
      12, SP_EFORMAT, "tensor 'w': data_offsets [8, 12] leave a gap");
  /* overlap */
  expect_bad(
      "{\"v\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
      8, SP_EFORMAT, "tensor 'w': data_offsets [4, 8] overlap");
  /* the very same range twice */
  expect_bad(
      "{\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
      "\"w\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
      4, SP_EFORMAT, "overlap");
}

static void test_reject_buffer_end(void **state) {
  (void)state;
  const char *json =
      "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
  expect_bad(json, 8, SP_EFORMAT,
             "tensors cover 4 bytes but the data section has 8");
  expect_bad(json, 0, SP_EFORMAT,
             "tensors cover 4 bytes but the data section has 0");
  expect_bad("{}", 1, SP_EFORMAT, "tensors cover 0 bytes");
}

static void test_reject_metadata(void **state) {
  (void)state;
  expect_bad("{\"__metadata__\":{\"step\":7}}", 0, SP_EFORMAT,
             "__metadata__ value of \"step\" is not a string");
  expect_bad("{\"__metadata__\":{\"a\":\"x\",\"b\":null}}", 0, SP_EFORMAT,
             "__metadata__ value of \"b\" is not a string");
  expect_bad("{\"__metadata__\":[\"a\"]}", 0, SP_EFORMAT,
             "__metadata__ is not an object");
  expect_bad("{\"__metadata__\":\"pt\"}", 0, SP_EFORMAT,
             "__metadata__ is not an object");
}

/* Quoted names stay one readable line, whatever bytes they hold. */
static void test_diag_sanitized(void **state) {
  (void)state;
  expect_bad("{\"a\\nb\\u0007\":[]}", 0, SP_EFORMAT, "tensor 'a?b?'");
  /* a 4096-byte name is allowed but quoted only in part */
  char *json = malloc(5000);
  assert_non_null(json);
  strcpy(json, "{\"");
  memset(json + 2, 'n', 4096);
  strcpy(json + 2 + 4096, "\":[]}");
  expect_bad(json, 0, SP_EFORMAT, "entry is not an object");
  /* 4097 is over the limit */
  strcpy(json, "{\"");
  memset(json + 2, 'n', 4097);
  strcpy(json + 2 + 4097, "\":[]}");
  expect_bad(json, 0, SP_ETOOBIG, "name of 4097 bytes exceeds");
  free(json);
}

static void test_open_errors(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  sp_safetensors_file *f = NULL;
  sp_diag d = {{0}};
  char *missing = sp_test_path(dir, "missing.safetensors");
  assert_int_equal(sp_safetensors_open(missing, &f, &d), SP_ENOENT);
  assert_non_null(strstr(d.msg, "missing.safetensors"));
  assert_int_equal(sp_safetensors_open(dir, &f, &d), SP_EIO);
  assert_non_null(strstr(d.msg, "not a regular file"));

  char *path = sp_test_path(dir, "bad.safetensors");
  uint8_t img[16] = {0};
  put_le64(img, 1000);
  sp_test_write_file(path, img, sizeof img);
  assert_int_equal(sp_safetensors_open(path, &f, &d), SP_ETOOBIG);
  assert_non_null(strstr(d.msg, path));
  assert_non_null(strstr(d.msg, "runs past the end"));
  sp_test_write_file(path, img, 3);
  assert_int_equal(sp_safetensors_open(path, &f, &d), SP_EFORMAT);
  assert_non_null(strstr(d.msg, "too short"));
  sp_test_write_file(path, img, 0);
  assert_int_equal(sp_safetensors_open(path, &f, &d), SP_EFORMAT);
  const char *json =
      "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,8]}}";
  size_t len;
  uint8_t *b = mk(json, 8, &len);
  sp_test_write_file(path, b, len);
  assert_int_equal(sp_safetensors_open(path, &f, &d), SP_EFORMAT);
  assert_non_null(strstr(d.msg, path));
  assert_non_null(strstr(d.msg, "tensor 'w'"));
  assert_null(f);
  free(b);
  free(path);
  free(missing);
  sp_test_rmtree(dir);
  free(dir);
}

/* ---- writer ------------------------------------------------------------- */

static void test_write_reference_vector(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "model.safetensors");
  sp_safetensors_entry e = {.name = "attn.0",
                            .dtype = SP_FLOAT32,
                            .ndim = 3,
                            .shape = {1, 2, 3},
                            .data = k_f6};
  sp_diag d = {{0}};
  assert_int_equal(sp_safetensors_write(path, &e, 1, NULL, 0, &d), 0);
  size_t len;
  uint8_t *b = read_file(path, &len);
  const char *want =
      "{\"__metadata__\":{\"format\":\"pt\"},\"attn.0\":{"
      "\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,"
      "24]}}";
  size_t wl = strlen(want);
  size_t padded = (wl + 7) / 8 * 8;
  assert_int_equal(len, 8 + padded + 24);
  uint8_t le[8];
  put_le64(le, padded);
  assert_memory_equal(b, le, 8);
  assert_memory_equal(b + 8, want, wl);
  for (size_t i = wl; i < padded; i++) assert_int_equal(b[8 + i], ' ');
  assert_memory_equal(b + 8 + padded, k_f6, 24);
  free(b);
  /* only the file itself: the temporary was renamed */
  assert_int_equal(count_dir_entries(dir), 1);

  /* no tensors at all */
  assert_int_equal(sp_safetensors_write(path, NULL, 0, NULL, 0, &d), 0);
  b = read_file(path, &len);
  assert_int_equal(len, 8 + 32);
  assert_memory_equal(b + 8, "{\"__metadata__\":{\"format\":\"pt\"}} ", 32);
  free(b);
  sp_safetensors_file *f = NULL;
  assert_int_equal(sp_safetensors_open(path, &f, &d), 0);
  assert_int_equal(sp_safetensors_tensor_count(f), 0);
  assert_string_equal(sp_safetensors_metadata_get(f, "format"), "pt");
  sp_safetensors_close(f);

  sp_test_rmtree(dir);
  free(path);
  free(dir);
}

static void test_write_layout_order(void **state) {
  (void)state;
  static const uint8_t bytes[64] = {1};
  /* given scrambled; expected order: I64, F64, F32, I32, BF16, F16, I16,
   * I8, U8, BOOL, names ascending within a dtype */
  sp_safetensors_entry es[] = {
      {.name = "u8", .dtype = SP_UINT8, .ndim = 1, .shape = {3}, .data = bytes},
      {.name = "b",
       .dtype = SP_FLOAT32,
       .ndim = 1,
       .shape = {1},
       .data = bytes},
      {.name = "flag",
       .dtype = SP_BOOL,
       .ndim = 1,
       .shape = {1},
       .data = bytes},
      {.name = "a",
       .dtype = SP_FLOAT32,
       .ndim = 1,
       .shape = {1},
       .data = bytes},
      {.name = "h",
       .dtype = SP_FLOAT16,
       .ndim = 1,
       .shape = {1},
       .data = bytes},
      {.name = "bf",
       .dtype = SP_BFLOAT16,
       .ndim = 1,
       .shape = {1},
       .data = bytes},
      {.name = "step", .dtype = SP_INT64, .ndim = 0, .data = bytes},
      {.name = "i8", .dtype = SP_INT8, .ndim = 1, .shape = {1}, .data = bytes},
      {.name = "d",
       .dtype = SP_FLOAT64,
       .ndim = 1,
       .shape = {1},
       .data = bytes},
      {.name = "i16",
       .dtype = SP_INT16,
       .ndim = 1,
       .shape = {1},
       .data = bytes},
      {.name = "i32",
       .dtype = SP_INT32,
       .ndim = 1,
       .shape = {1},
       .data = bytes},
      {.name = "empty",
       .dtype = SP_FLOAT64,
       .ndim = 2,
       .shape = {0, 4},
       .data = NULL},
  };
  const char *want_order[] = {"step", "d", "empty", "a",  "b",  "i32",
                              "bf",   "h", "i16",   "i8", "u8", "flag"};
  size_t n = sizeof es / sizeof es[0];
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "order.safetensors");
  sp_safetensors_kv meta[] = {
      {"step", "12"}, {"format", "pt"}, {"note", "h\xc3\xa9"}};
  sp_diag d = {{0}};
  int rc = sp_safetensors_write(path, es, n, meta, 3, &d);
  if (rc != 0) fail_msg("%s", d.msg);

  size_t len;
  uint8_t *b = read_file(path, &len);
  uint64_t hn = 0;
  for (int i = 7; i >= 0; i--) hn = (hn << 8) | b[i];
  assert_int_equal(hn % 8, 0);
  assert_true(8 + hn <= len);
  /* padding: only spaces after the closing brace, fewer than 8 */
  size_t end = 8 + (size_t)hn;
  size_t sp = 0;
  while (b[end - 1 - sp] == ' ') sp++;
  assert_true(sp < 8);
  assert_int_equal(b[end - 1 - sp], '}');

  json_error_t jerr;
  json_t *root = json_loadb((const char *)b + 8, (size_t)hn, 0, &jerr);
  assert_non_null(root);
  const char *key;
  json_t *val;
  size_t i = 0;
  uint64_t prev_end = 0;
  json_object_foreach(root, key, val) {
    if (i == 0) {
      assert_string_equal(key, "__metadata__");
      const char *mk;
      json_t *mv;
      const char *want_meta[][2] = {
          {"format", "pt"}, {"step", "12"}, {"note", "h\xc3\xa9"}};
      size_t j = 0;
      json_object_foreach(val, mk, mv) {
        assert_true(j < 3);
        assert_string_equal(mk, want_meta[j][0]);
        assert_string_equal(json_string_value(mv), want_meta[j][1]);
        j++;
      }
      assert_int_equal(j, 3);
    } else {
      assert_true(i - 1 < n);
      assert_string_equal(key, want_order[i - 1]);
      json_t *offs = json_object_get(val, "data_offsets");
      uint64_t beg = (uint64_t)json_integer_value(json_array_get(offs, 0));
      uint64_t fin = (uint64_t)json_integer_value(json_array_get(offs, 1));
      assert_int_equal(beg, prev_end);
      sp_dtype dt;
      assert_int_equal(
          sp_dtype_parse_st(json_string_value(json_object_get(val, "dtype")),
                            &dt),
          0);
      /* the point of the order: natural alignment in the data section */
      assert_int_equal(beg % sp_dtype_size(dt), 0);
      prev_end = fin;
    }
    i++;
  }
  assert_int_equal(i, n + 1);
  assert_int_equal(8 + hn + prev_end, len);
  json_decref(root);
  free(b);

  sp_safetensors_file *f = NULL;
  assert_int_equal(sp_safetensors_open(path, &f, &d), 0);
  for (size_t k = 0; k < n; k++) {
    assert_string_equal(sp_safetensors_tensor_at(f, k)->name, want_order[k]);
  }
  assert_string_equal(sp_safetensors_metadata_get(f, "note"), "h\xc3\xa9");
  assert_string_equal(sp_safetensors_metadata_get(f, "step"), "12");
  assert_int_equal(sp_safetensors_metadata_count(f), 3);
  sp_safetensors_close(f);
  sp_test_rmtree(dir);
  free(path);
  free(dir);
}

static void fill_random(sp_test_rng *rng, sp_dtype dt, uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)sp_test_rng_next(rng);
  /* bool bytes must be 0 or 1 to be valid torch.bool */
  if (dt == SP_BOOL) {
    for (size_t i = 0; i < n; i++) p[i] &= 1;
  }
}

static void test_round_trip_all_dtypes(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "rt.safetensors");
  sp_test_rng rng = {12345};
  for (int iter = 0; iter < 25; iter++) {
    enum { PER = 2 };
    sp_safetensors_entry es[(SP_DTYPE_COUNT - 1) * PER];
    char names[(SP_DTYPE_COUNT - 1) * PER][48];
    uint8_t *bufs[(SP_DTYPE_COUNT - 1) * PER];
    size_t sizes[(SP_DTYPE_COUNT - 1) * PER];
    size_t n = 0;
    for (int t = 1; t < SP_DTYPE_COUNT; t++) {
      for (int k = 0; k < PER; k++, n++) {
        sp_safetensors_entry *e = &es[n];
        memset(e, 0, sizeof *e);
        snprintf(names[n], sizeof names[n], "layers.%d.%s.%d",
                 (int)sp_test_rng_below(&rng, 100), sp_dtype_name((sp_dtype)t),
                 k);
        e->name = names[n];
        e->dtype = (sp_dtype)t;
        e->ndim = (size_t)sp_test_rng_below(&rng, 5);
        uint64_t numel = 1;
        for (size_t j = 0; j < e->ndim; j++) {
          /* mostly non-empty, sometimes a 0 dimension */
          e->shape[j] = sp_test_rng_below(&rng, 10) == 0
                            ? 0
                            : 1 + sp_test_rng_below(&rng, 6);
          numel *= e->shape[j];
        }
        sizes[n] = (size_t)numel * sp_dtype_size((sp_dtype)t);
        bufs[n] = malloc(sizes[n] + 1);
        assert_non_null(bufs[n]);
        fill_random(&rng, (sp_dtype)t, bufs[n], sizes[n]);
        e->data = sizes[n] > 0 ? bufs[n] : NULL;
      }
    }
    char step[16];
    snprintf(step, sizeof step, "%d", iter);
    sp_safetensors_kv meta[] = {{"step", step}};
    sp_diag d = {{0}};
    int rc = sp_safetensors_write(path, es, n, meta, 1, &d);
    if (rc != 0) fail_msg("write: %s", d.msg);

    sp_safetensors_file *f = NULL;
    rc = sp_safetensors_open(path, &f, &d);
    if (rc != 0) fail_msg("open: %s", d.msg);
    assert_int_equal(sp_safetensors_tensor_count(f), n);
    assert_string_equal(sp_safetensors_metadata_get(f, "format"), "pt");
    assert_string_equal(sp_safetensors_metadata_get(f, "step"), step);
    for (size_t i = 0; i < n; i++) {
      const sp_safetensors_tensor *t = sp_safetensors_find(f, es[i].name);
      assert_non_null(t);
      assert_int_equal(t->dtype, es[i].dtype);
      assert_int_equal(t->ndim, es[i].ndim);
      for (size_t j = 0; j < SP_SAFETENSORS_MAX_NDIM; j++) {
        assert_int_equal(t->shape[j], j < es[i].ndim ? es[i].shape[j] : 0);
      }
      assert_int_equal(t->nbytes, sizes[i]);
      assert_int_equal((uintptr_t)t->data % sp_dtype_size(t->dtype), 0);
      uint8_t *got = malloc(sizes[i] + 1);
      assert_non_null(got);
      assert_int_equal(sp_safetensors_tensor_read(t, got, sizes[i]), 0);
      assert_memory_equal(got, bufs[i], sizes[i]);
      free(got);
      free(bufs[i]);
    }
    sp_safetensors_close(f);
  }
  assert_int_equal(count_dir_entries(dir), 1);
  sp_test_rmtree(dir);
  free(path);
  free(dir);
}

static void expect_write_err(const char *path, const sp_safetensors_entry *es,
                             size_t n, const sp_safetensors_kv *meta,
                             size_t n_meta, int err, const char *part) {
  sp_diag d = {{0}};
  int rc = sp_safetensors_write(path, es, n, meta, n_meta, &d);
  if (rc != err || strstr(d.msg, part) == NULL) {
    fail_msg("got %s \"%s\", want %s containing \"%s\"", sp_err_name(rc), d.msg,
             sp_err_name(err), part);
  }
}

static void test_write_rejects(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "w.safetensors");
  const float x[4] = {1, 2, 3, 4};
  sp_safetensors_entry good = {
      .name = "x", .dtype = SP_FLOAT32, .ndim = 1, .shape = {4}, .data = x};
  sp_diag d = {{0}};
  assert_int_equal(sp_safetensors_write(path, &good, 1, NULL, 0, &d), 0);
  size_t len0;
  uint8_t *before = read_file(path, &len0);

  sp_safetensors_entry two[2] = {good, good};
  expect_write_err(path, two, 2, NULL, 0, SP_EINVAL, "tensor 'x' given twice");
  sp_safetensors_entry e = good;
  e.name = "__metadata__";
  expect_write_err(path, &e, 1, NULL, 0, SP_EINVAL, "cannot be named");
  e = good;
  e.name = "";
  expect_write_err(path, &e, 1, NULL, 0, SP_EINVAL, "empty name");
  e.name = NULL;
  expect_write_err(path, &e, 1, NULL, 0, SP_EINVAL, "NULL name");
  e = good;
  e.name = "bad\xff";
  expect_write_err(path, &e, 1, NULL, 0, SP_EINVAL, "not valid UTF-8");
  e = good;
  e.dtype = SP_DTYPE_INVALID;
  expect_write_err(path, &e, 1, NULL, 0, SP_EINVAL, "invalid dtype");
  e = good;
  e.ndim = 9;
  expect_write_err(path, &e, 1, NULL, 0, SP_ETOOBIG, "9 dimensions");
  e = good;
  e.data = NULL;
  expect_write_err(path, &e, 1, NULL, 0, SP_EINVAL, "data is NULL");
  e = good;
  e.ndim = 2;
  e.shape[0] = (uint64_t)1 << 62;
  e.shape[1] = 8;
  expect_write_err(path, &e, 1, NULL, 0, SP_ETOOBIG, "overflows");
  char *longname = malloc(SP_SAFETENSORS_MAX_NAME + 2);
  assert_non_null(longname);
  memset(longname, 'a', SP_SAFETENSORS_MAX_NAME + 1);
  longname[SP_SAFETENSORS_MAX_NAME + 1] = '\0';
  e = good;
  e.name = longname;
  expect_write_err(path, &e, 1, NULL, 0, SP_ETOOBIG, "exceeds the limit");
  free(longname);
  expect_write_err(path, NULL, 1, NULL, 0, SP_EINVAL, "entries is NULL");
  expect_write_err(path, &good, SP_SAFETENSORS_MAX_TENSORS + 1, NULL, 0,
                   SP_ETOOBIG, "tensors exceed");

  sp_safetensors_kv fmt[] = {{"format", "tf"}};
  expect_write_err(path, &good, 1, fmt, 1, SP_EINVAL, "\"format\" must be");
  sp_safetensors_kv dup[] = {{"a", "1"}, {"a", "2"}};
  expect_write_err(path, &good, 1, dup, 2, SP_EINVAL, "given twice");
  sp_safetensors_kv nul[] = {{"a", NULL}};
  expect_write_err(path, &good, 1, nul, 1, SP_EINVAL, "NULL key or value");
  sp_safetensors_kv bad8[] = {{"a", "\xc3"}};
  expect_write_err(path, &good, 1, bad8, 1, SP_EINVAL, "not valid UTF-8");

  /* none of the failures touched the existing checkpoint */
  size_t len1;
  uint8_t *after = read_file(path, &len1);
  assert_int_equal(len0, len1);
  assert_memory_equal(before, after, len0);
  free(before);
  free(after);
  assert_int_equal(count_dir_entries(dir), 1);

  /* a directory that does not exist */
  char *nodir = sp_test_path(dir, "no/such/dir.safetensors");
  expect_write_err(nodir, &good, 1, NULL, 0, SP_EIO,
                   "cannot create temporary file");
  free(nodir);
  expect_write_err(NULL, &good, 1, NULL, 0, SP_EINVAL, "path is NULL");

  sp_test_rmtree(dir);
  free(path);
  free(dir);
}

/* ---- robustness --------------------------------------------------------- */

/* Touches every byte of every tensor so ASan catches a bad pointer. */
static unsigned walk(const sp_safetensors_file *f) {
  unsigned sum = 0;
  for (size_t i = 0; i < sp_safetensors_tensor_count(f); i++) {
    const sp_safetensors_tensor *t = sp_safetensors_tensor_at(f, i);
    for (size_t k = 0; k < t->nbytes; k++) sum += t->data[k];
    assert_ptr_equal(sp_safetensors_find(f, t->name), t);
  }
  for (size_t i = 0; i < sp_safetensors_metadata_count(f); i++) {
    const sp_safetensors_kv *kv = sp_safetensors_metadata_at(f, i);
    sum += (unsigned)strlen(kv->key) + (unsigned)strlen(kv->value);
  }
  return sum;
}

static void test_mutations_never_crash(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "seed.safetensors");
  const double dv[3] = {1, 2, 3};
  const uint16_t hv[5] = {1, 2, 3, 4, 5};
  const uint8_t bv[2] = {0, 1};
  sp_safetensors_entry es[] = {
      {.name = "w",
       .dtype = SP_FLOAT64,
       .ndim = 2,
       .shape = {1, 3},
       .data = dv},
      {.name = "h", .dtype = SP_BFLOAT16, .ndim = 1, .shape = {5}, .data = hv},
      {.name = "m", .dtype = SP_BOOL, .ndim = 1, .shape = {2}, .data = bv},
      {.name = "z", .dtype = SP_INT32, .ndim = 1, .shape = {0}, .data = NULL},
      {.name = "s", .dtype = SP_INT64, .ndim = 0, .data = dv},
  };
  sp_safetensors_kv meta[] = {{"k", "v"}};
  assert_int_equal(sp_safetensors_write(path, es, 5, meta, 1, NULL), 0);
  size_t len;
  uint8_t *seed = read_file(path, &len);
  sp_safetensors_file *f = NULL;
  assert_int_equal(sp_safetensors_parse(seed, len, NULL, &f, NULL), 0);
  walk(f);
  sp_safetensors_close(f);

  sp_test_rng rng = {0xC0FFEE};
  size_t ok = 0, bad = 0;
  unsigned sink = 0;
  for (int iter = 0; iter < 40000; iter++) {
    size_t mlen = len;
    uint8_t *m = malloc(len);
    assert_non_null(m);
    memcpy(m, seed, len);
    int kind = (int)sp_test_rng_below(&rng, 5);
    if (kind == 0) {
      mlen = (size_t)sp_test_rng_below(&rng, len + 1);
    } else {
      int flips = 1 + (int)sp_test_rng_below(&rng, 4);
      for (int k = 0; k < flips; k++) {
        /* bias towards the header, where the structure is */
        size_t at =
            kind == 1 ? (size_t)sp_test_rng_below(&rng, len)
                      : (size_t)sp_test_rng_below(&rng, len < 120 ? len : 120);
        if (kind == 4) {
          m[at] = (uint8_t) "{}[],:\"0123456789-e. \\u"[sp_test_rng_below(&rng,
                                                                          24)];
        } else {
          m[at] ^= (uint8_t)(1u << sp_test_rng_below(&rng, 8));
        }
      }
      if (kind == 3) mlen = (size_t)sp_test_rng_below(&rng, len + 1);
    }
    /* exact-size copy so any over-read is outside the allocation */
    uint8_t *img = malloc(mlen ? mlen : 1);
    assert_non_null(img);
    memcpy(img, m, mlen);
    sp_diag d = {{0}};
    f = NULL;
    int rc = sp_safetensors_parse(mlen ? img : NULL, mlen, "fuzz", &f, &d);
    if (rc == 0) {
      sink += walk(f);
      sp_safetensors_close(f);
      ok++;
    } else {
      assert_null(f);
      assert_true(d.msg[0] != '\0');
      assert_null(strchr(d.msg, '\n'));
      bad++;
    }
    free(img);
    free(m);
  }
  (void)sink;
  assert_true(ok > 0);
  assert_true(bad > 0);
  free(seed);
  sp_test_rmtree(dir);
  free(path);
  free(dir);
}

/* ---- writing and reading in pieces --------------------------------------- */

static const sp_safetensors_entry k_piece_entries[] = {
    {.name = "b.weight", .dtype = SP_FLOAT32, .ndim = 2, .shape = {3, 4}},
    {.name = "a.weight", .dtype = SP_BFLOAT16, .ndim = 1, .shape = {5}},
    {.name = "step", .dtype = SP_INT64, .ndim = 0},
    {.name = "empty", .dtype = SP_FLOAT16, .ndim = 2, .shape = {0, 2}},
    {.name = "mask", .dtype = SP_BOOL, .ndim = 1, .shape = {3}},
};
#define N_PIECES (sizeof k_piece_entries / sizeof k_piece_entries[0])

/* tensor i's bytes: a pattern that differs per tensor and per byte */
static void piece_bytes(size_t i, uint8_t *dst, size_t n) {
  for (size_t k = 0; k < n; k++) dst[k] = (uint8_t)(17 * i + 3 * k + 1);
}

static size_t piece_nbytes(size_t i) {
  const sp_safetensors_entry *e = &k_piece_entries[i];
  size_t n = sp_dtype_size(e->dtype);
  for (size_t k = 0; k < e->ndim; k++) n *= e->shape[k];
  return n;
}

/* The streaming writer gives sp_safetensors_write's file byte for byte,
 * whatever the order of the tensors and however a tensor is cut into pieces; it
 * refuses pieces out of order and an incomplete file, leaving nothing behind.
 */
static void test_writer_pieces(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *whole = sp_test_path(dir, "whole.safetensors");
  char *parts = sp_test_path(dir, "parts.safetensors");
  uint8_t data[N_PIECES][64];
  sp_safetensors_entry es[N_PIECES];
  for (size_t i = 0; i < N_PIECES; i++) {
    es[i] = k_piece_entries[i];
    piece_bytes(i, data[i], piece_nbytes(i));
    es[i].data = data[i];
  }
  sp_safetensors_kv meta[] = {{"shardplane.kind", "FULL"},
                              {"optim_steps", "7"}};
  sp_diag d = {{0}};
  assert_int_equal(sp_safetensors_write(whole, es, N_PIECES, meta, 2, &d), 0);

  /* no data pointers at open: only names, dtypes and shapes are read */
  sp_safetensors_entry shapes[N_PIECES];
  memcpy(shapes, k_piece_entries, sizeof shapes);
  sp_safetensors_writer *w;
  assert_int_equal(
      sp_safetensors_writer_open(parts, shapes, N_PIECES, meta, 2, &w, &d), 0);
  /* backwards, each tensor in pieces of 3 bytes */
  for (size_t i = N_PIECES; i-- > 0;) {
    size_t nb = piece_nbytes(i);
    for (size_t off = 0; off < nb; off += 3) {
      size_t len = nb - off < 3 ? nb - off : 3;
      if (off == 3) {
        /* a gap, a repeat and a piece past the end are refused */
        assert_int_equal(
            sp_safetensors_writer_put(w, i, off + 1, data[i] + off + 1, 1, &d),
            SP_ERANGE);
        assert_non_null(strstr(d.msg, k_piece_entries[i].name));
        assert_int_equal(sp_safetensors_writer_put(w, i, 0, data[i], 1, &d),
                         SP_ERANGE);
        assert_int_equal(
            sp_safetensors_writer_put(w, i, off, data[i] + off, nb, &d),
            SP_ERANGE);
      }
      assert_int_equal(
          sp_safetensors_writer_put(w, i, off, data[i] + off, len, &d), 0);
    }
  }
  assert_int_equal(sp_safetensors_writer_put(w, N_PIECES, 0, data[0], 1, &d),
                   SP_ERANGE);
  assert_int_equal(sp_safetensors_writer_commit(w, &d), 0);
  size_t la, lb;
  uint8_t *a = read_file(whole, &la), *b = read_file(parts, &lb);
  assert_int_equal(la, lb);
  assert_memory_equal(a, b, la);
  free(a);
  free(b);
  assert_int_equal(count_dir_entries(dir), 2);

  /* incomplete: commit fails naming the tensor; the old file stays */
  assert_int_equal(
      sp_safetensors_writer_open(parts, shapes, N_PIECES, NULL, 0, &w, &d), 0);
  assert_int_equal(sp_safetensors_writer_put(w, 0, 0, data[0], 8, &d), 0);
  assert_int_equal(sp_safetensors_writer_commit(w, &d), SP_EINVAL);
  assert_non_null(strstr(d.msg, "b.weight"));
  assert_non_null(strstr(d.msg, "8 of its 48 bytes"));
  b = read_file(parts, &lb);
  assert_int_equal(lb, la);
  free(b);
  assert_int_equal(count_dir_entries(dir), 2);
  /* abort: nothing left */
  assert_int_equal(
      sp_safetensors_writer_open(parts, shapes, N_PIECES, NULL, 0, &w, &d), 0);
  assert_int_equal(count_dir_entries(dir), 3);
  sp_safetensors_writer_abort(w);
  sp_safetensors_writer_abort(NULL);
  assert_int_equal(count_dir_entries(dir), 2);
  /* the arguments are checked as sp_safetensors_write checks them */
  shapes[1].name = "b.weight";
  assert_int_equal(
      sp_safetensors_writer_open(parts, shapes, N_PIECES, NULL, 0, &w, &d),
      SP_EINVAL);
  assert_non_null(strstr(d.msg, "given twice"));
  assert_int_equal(count_dir_entries(dir), 2);
  free(whole);
  free(parts);
  sp_test_rmtree(dir);
  free(dir);
}

/* sp_safetensors_open_header keeps only the header in memory and reads ranges
 * of a tensor from disk; a range outside the tensor is refused, a file cut
 * short after opening reads as an error, and a bad header fails as in
 * sp_safetensors_open. */
static void test_open_header_ranges(void **state) {
  (void)state;
  char *dir = sp_test_mkdtemp();
  char *path = sp_test_path(dir, "m.safetensors");
  uint8_t data[N_PIECES][64];
  sp_safetensors_entry es[N_PIECES];
  for (size_t i = 0; i < N_PIECES; i++) {
    es[i] = k_piece_entries[i];
    piece_bytes(i, data[i], piece_nbytes(i));
    es[i].data = data[i];
  }
  sp_safetensors_kv meta[] = {{"optim_steps", "7"}};
  sp_diag d = {{0}};
  assert_int_equal(sp_safetensors_write(path, es, N_PIECES, meta, 1, &d), 0);
  sp_safetensors_file *h, *full;
  assert_int_equal(sp_safetensors_open_header(path, &h, &d), 0);
  assert_int_equal(sp_safetensors_open(path, &full, &d), 0);
  assert_int_equal(sp_safetensors_tensor_count(h), N_PIECES);
  assert_string_equal(sp_safetensors_metadata_get(h, "optim_steps"), "7");
  assert_int_equal(sp_safetensors_header_len(h),
                   sp_safetensors_header_len(full));
  assert_int_equal(sp_safetensors_data_len(h), sp_safetensors_data_len(full));
  for (size_t i = 0; i < N_PIECES; i++) {
    const sp_safetensors_tensor *t =
        sp_safetensors_find(h, k_piece_entries[i].name);
    const sp_safetensors_tensor *tf =
        sp_safetensors_find(full, k_piece_entries[i].name);
    assert_non_null(t);
    assert_null(t->data);
    assert_int_equal(t->nbytes, piece_nbytes(i));
    assert_int_equal(t->begin, tf->begin);
    /* every range, from the disk and from memory */
    for (size_t off = 0; off <= t->nbytes; off++)
      for (size_t len = 0; off + len <= t->nbytes; len++) {
        uint8_t got[64], mem[64];
        assert_int_equal(sp_safetensors_read_range(h, t, off, got, len, &d), 0);
        assert_int_equal(sp_safetensors_read_range(full, tf, off, mem, len, &d),
                         0);
        assert_memory_equal(got, data[i] + off, len);
        assert_memory_equal(mem, data[i] + off, len);
      }
    uint8_t one[64];
    assert_int_equal(sp_safetensors_read_range(h, t, t->nbytes, one, 1, &d),
                     SP_ERANGE);
    assert_non_null(strstr(d.msg, k_piece_entries[i].name));
    assert_int_equal(sp_safetensors_read_range(h, t, UINT64_MAX, one, 1, &d),
                     SP_ERANGE);
  }
  sp_safetensors_close(full);
  /* cut short under the open file: the last tensor's bytes are gone */
  const sp_safetensors_tensor *last = sp_safetensors_tensor_at(h, N_PIECES - 1);
  size_t keep = 8 + sp_safetensors_header_len(h) + (size_t)last->begin;
  assert_int_equal(truncate(path, (off_t)keep), 0);
  uint8_t got[64];
  int rc = sp_safetensors_read_range(h, last, 0, got, last->nbytes, &d);
  if (last->nbytes > 0) {
    assert_int_equal(rc, SP_EIO);
    assert_non_null(strstr(d.msg, path));
  }
  sp_safetensors_close(h);
  /* the same header checks as sp_safetensors_open */
  assert_int_equal(sp_safetensors_open_header(path, &h, &d), SP_EFORMAT);
  assert_null(h);
  assert_non_null(strstr(d.msg, path));
  uint8_t img[16] = {0};
  put_le64(img, 1000);
  sp_test_write_file(path, img, sizeof img);
  assert_int_equal(sp_safetensors_open_header(path, &h, &d), SP_ETOOBIG);
  assert_non_null(strstr(d.msg, "runs past the end"));
  assert_int_equal(sp_safetensors_open_header(dir, &h, &d), SP_EIO);
  char *missing = sp_test_path(dir, "missing.safetensors");
  assert_int_equal(sp_safetensors_open_header(missing, &h, &d), SP_ENOENT);
  free(missing);
  free(path);
  sp_test_rmtree(dir);
  free(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reference_vector),
      cmocka_unit_test(test_empty_header),
      cmocka_unit_test(test_scalar_and_zero_size),
      cmocka_unit_test(test_unaligned_data),
      cmocka_unit_test(test_reject_length),
      cmocka_unit_test(test_reject_json),
      cmocka_unit_test(test_reject_duplicates),
      cmocka_unit_test(test_reject_entry_not_object),
      cmocka_unit_test(test_reject_dtype),
      cmocka_unit_test(test_reject_shape),
      cmocka_unit_test(test_reject_offsets),
      cmocka_unit_test(test_reject_buffer_end),
      cmocka_unit_test(test_reject_metadata),
      cmocka_unit_test(test_diag_sanitized),
      cmocka_unit_test(test_open_errors),
      cmocka_unit_test(test_write_reference_vector),
      cmocka_unit_test(test_write_layout_order),
      cmocka_unit_test(test_round_trip_all_dtypes),
      cmocka_unit_test(test_write_rejects),
      cmocka_unit_test(test_mutations_never_crash),
      cmocka_unit_test(test_writer_pieces),
      cmocka_unit_test(test_open_header_ranges),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
