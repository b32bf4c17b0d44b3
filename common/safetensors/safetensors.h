/* safetensors reader and writer.
 *
 * The format (huggingface/safetensors): a u64 little-endian header length N,
 * N bytes of UTF-8 JSON, then the data section. The JSON maps each tensor
 * name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
 * to the data section, end exclusive) plus an optional "__metadata__" object
 * of string values. Tensor data is little-endian, row-major and dense.
 *
 * Reading: everything in a file is untrusted. The reader checks the whole
 * header before returning anything: header length, JSON (via jansson:
 * syntax, UTF-8, duplicate names), each entry's dtype, shape and offsets,
 * that the tensors tile the data section exactly (contiguous from 0, no gaps
 * or overlaps, last end == data length), and the limits below. After a
 * successful parse every sp_safetensors_tensor's bytes lie inside the buffer.
 *
 * Alignment: a tensor's `data` pointer is only byte-aligned in general (the
 * data section starts at 8+N, and a file may order tensors any way it
 * likes). Read elements with memcpy or sp_safetensors_tensor_read, or check
 * `(uintptr_t)t->data % sp_dtype_size(t->dtype) == 0` before casting.
 * sp_safetensors_open places the data section on a 64-byte boundary, so files
 * written in the standard order (sp_safetensors_write, the reference writer) do
 * give every tensor its natural alignment there; sp_safetensors_parse uses the
 * caller's buffer as is.
 *
 * Writing: sp_safetensors_write writes the standard layout (see its comment)
 * through a temporary file in the same directory, fsync and rename, so a crash
 * leaves either the old file or the complete new one. sp_safetensors_writer_*
 * write the same file in pieces (header first, from the known shapes; then each
 * tensor's bytes as the caller produces them), for files larger than the memory
 * a writer wants to hold: a checkpoint written unit by unit.
 *
 * Reading in pieces: sp_safetensors_open_header reads and checks only the
 * header and keeps the file open; sp_safetensors_read_range then reads any byte
 * range of one tensor (pread), so a rank loads its slice of a large checkpoint
 * without the rest.
 *
 * Only the dtypes of dtype.h are handled; F8_*, U16/U32/U64 and newer
 * safetensors dtypes are rejected with SP_EUNSUPPORTED. The host must be
 * little-endian (checked at compile time).
 */
#ifndef SP_SAFETENSORS_H
#define SP_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "cast/dtype.h"
#include "base/sp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest JSON header, as the reference reader (MAX_HEADER_SIZE). */
#define SP_SAFETENSORS_MAX_HEADER 100000000u
/* Most tensors in one file, checked before allocating per-tensor state. */
#define SP_SAFETENSORS_MAX_TENSORS 1000000u
/* Longest tensor name or metadata key, in bytes. */
#define SP_SAFETENSORS_MAX_NAME 4096u
/* Most dimensions of one tensor. */
#define SP_SAFETENSORS_MAX_NDIM 8u
/* Most "__metadata__" entries (the writer adds "format" to the caller's). */
#define SP_SAFETENSORS_MAX_METADATA 4096u

/* A key/value string pair of "__metadata__". */
typedef struct sp_safetensors_kv {
  const char *key;
  const char *value;
} sp_safetensors_kv;

/* One tensor of a parsed file. All pointers are owned by the
 * sp_safetensors_file and valid until sp_safetensors_close (and, for
 * sp_safetensors_parse, while the caller's buffer lives). */
typedef struct sp_safetensors_tensor {
  const char *name; /* NUL-terminated UTF-8 */
  sp_dtype dtype;
  size_t ndim;                             /* 0 for a scalar */
  uint64_t shape[SP_SAFETENSORS_MAX_NDIM]; /* shape[ndim..] are 0 */
  uint64_t numel;      /* product of shape; 1 for a scalar */
  uint64_t begin, end; /* data_offsets, relative to the data */
  const uint8_t *data; /* end-begin bytes; see Alignment above */
  size_t nbytes;       /* end - begin */
} sp_safetensors_tensor;

/* A parsed file. Opaque; release with sp_safetensors_close. */
typedef struct sp_safetensors_file sp_safetensors_file;

/* Parses a complete safetensors image buf[0..len). `source` names it in
 * messages (a path, "<stdin>"; NULL gives "<buffer>"). The result borrows
 * buf: the caller keeps buf alive and unchanged until
 * sp_safetensors_close(*out). Never reads outside buf; safe on any input.
 * Returns 0 and sets *out (the caller closes it with sp_safetensors_close), or
 * on error leaves *out NULL and returns: SP_EINVAL       NULL out, or NULL buf
 * with len > 0; SP_EFORMAT      malformed header, entry, offsets or metadata;
 * SP_ETOOBIG N > SP_SAFETENSORS_MAX_HEADER, 8+N beyond len, or another limit;
 *   SP_EUNSUPPORTED a valid safetensors dtype shardplane does not handle;
 *   SP_ENOMEM.
 * The diag names the source, and the tensor where there is one. */
int sp_safetensors_parse(const uint8_t *buf, size_t len, const char *source,
                         sp_safetensors_file **out, sp_diag *diag);

/* Reads the regular file at path (size checked against the header before
 * the bulk read) and parses it; the result owns the contents. Errors as
 * sp_safetensors_parse, plus SP_ENOENT (no such file), SP_EIO (open/read
 * failure, not a regular file, or the file changed while being read). */
int sp_safetensors_open(const char *path, sp_safetensors_file **out,
                        sp_diag *diag);

/* Opens the regular file at path and reads only its header: the 8-byte
 * length (checked against the file's size before the header is allocated)
 * and the JSON, checked exactly as sp_safetensors_open checks them, the data
 * section being the rest of the file. The file stays open (one descriptor)
 * until sp_safetensors_close; tensors have `data` NULL: read them with
 * sp_safetensors_read_range. Memory: the header's, whatever the file's size.
 * Errors as sp_safetensors_open. */
int sp_safetensors_open_header(const char *path, sp_safetensors_file **out,
                               sp_diag *diag);

/* Copies bytes [offset, offset + len) of tensor t of f into dst (any
 * alignment): memcpy for a file in memory (sp_safetensors_parse,
 * sp_safetensors_open), pread for one from sp_safetensors_open_header. Safe
 * from several threads at once on one file. Errors: SP_EINVAL (NULL arguments),
 * SP_ERANGE (the range is not inside the tensor; the diag names it), SP_EIO
 * (read failure, or the file was cut short after it was opened). */
int sp_safetensors_read_range(const sp_safetensors_file *f,
                              const sp_safetensors_tensor *t, uint64_t offset,
                              void *dst, size_t len, sp_diag *diag);

/* Frees a result of sp_safetensors_parse, sp_safetensors_open or
 * sp_safetensors_open_header (closing its file); NULL is allowed. */
void sp_safetensors_close(sp_safetensors_file *f);

/* Tensors in data order (ascending data_offsets). Index i < count, else
 * NULL. */
size_t sp_safetensors_tensor_count(const sp_safetensors_file *f);
const sp_safetensors_tensor *sp_safetensors_tensor_at(
    const sp_safetensors_file *f, size_t i);

/* The tensor called name (exact bytes), or NULL. O(log n). */
const sp_safetensors_tensor *sp_safetensors_find(const sp_safetensors_file *f,
                                                 const char *name);

/* As sp_safetensors_find, but returns SP_ENOENT with a diag naming the file and
 * the tensor when it is absent. */
int sp_safetensors_get(const sp_safetensors_file *f, const char *name,
                       const sp_safetensors_tensor **out, sp_diag *diag);

/* Copies the tensor's bytes into dst, which has dst_len bytes and any
 * alignment the caller needs. Returns 0, or SP_ERANGE when dst_len !=
 * t->nbytes, or SP_EINVAL for NULL arguments (dst may be NULL when nbytes is
 * 0). */
int sp_safetensors_tensor_read(const sp_safetensors_tensor *t, void *dst,
                               size_t dst_len);

/* "__metadata__" entries in file order; the value of key, or NULL. */
size_t sp_safetensors_metadata_count(const sp_safetensors_file *f);
const sp_safetensors_kv *sp_safetensors_metadata_at(
    const sp_safetensors_file *f, size_t i);
const char *sp_safetensors_metadata_get(const sp_safetensors_file *f,
                                        const char *key);

/* Size N of the JSON header and of the data section, in bytes. */
size_t sp_safetensors_header_len(const sp_safetensors_file *f);
size_t sp_safetensors_data_len(const sp_safetensors_file *f);

/* One tensor to write. The writer only reads it. */
typedef struct sp_safetensors_entry {
  const char *name; /* UTF-8, 1..SP_SAFETENSORS_MAX_NAME bytes */
  sp_dtype dtype;
  size_t ndim; /* <= SP_SAFETENSORS_MAX_NDIM; 0 for a scalar */
  uint64_t shape[SP_SAFETENSORS_MAX_NDIM];
  const void *data; /* prod(shape)*size bytes, little-endian, row-major, any
                       alignment; may be NULL when that is 0 */
} sp_safetensors_entry;

/* Writes entries[0..n) to path, replacing it atomically.
 *
 * Layout, as the reference writer's prepare(): "__metadata__" first, holding
 * {"format":"pt"} (which Transformers requires) then meta[0..n_meta) in the
 * given order; tensors ordered by descending dtype alignment (the reference
 * Dtype order, so the tie-break between same-size dtypes matches too), then
 * by name bytewise, packed from offset 0; compact JSON padded with spaces to
 * a multiple of 8 bytes, so every tensor is aligned to its element size
 * within the data section.
 *
 * The file is written as "<path>.tmp.<pid>.<n>" in the same directory,
 * fsync'd, renamed over path, and the directory fsync'd. On error the
 * temporary file is removed and path is untouched.
 *
 * meta may be NULL when n_meta is 0; a caller "format" key must have the
 * value "pt". Returns 0, or SP_EINVAL (NULL or duplicate names/keys, a name
 * "__metadata__", empty name, invalid dtype, invalid UTF-8, NULL data for a
 * non-empty tensor, meta "format" other than "pt"), SP_ETOOBIG (a limit
 * above, a shape whose byte size overflows, or a header over
 * SP_SAFETENSORS_MAX_HEADER), SP_ENOMEM, SP_EIO (with the system error in the
 * diag). */
int sp_safetensors_write(const char *path, const sp_safetensors_entry *entries,
                         size_t n, const sp_safetensors_kv *meta, size_t n_meta,
                         sp_diag *diag);

/* A file written in pieces: sp_safetensors_write's layout and bytes, with the
 * tensors' data handed in after the header is on disk. Opaque. One thread
 * at a time. */
typedef struct sp_safetensors_writer sp_safetensors_writer;

/* Checks the arguments as sp_safetensors_write does (except that every entry's
 * data is ignored and may be NULL: only names, dtypes and shapes are read, and
 * only during the call), creates "<path>.tmp.<pid>.<n>" in path's
 * directory and writes the header there. Errors as sp_safetensors_write; on
 * error nothing is left behind. */
int sp_safetensors_writer_open(const char *path,
                               const sp_safetensors_entry *entries, size_t n,
                               const sp_safetensors_kv *meta, size_t n_meta,
                               sp_safetensors_writer **out, sp_diag *diag);

/* Writes len bytes of entry i (its index in the array given to
 * sp_safetensors_writer_open) starting at byte `offset` of that tensor. Tensors
 * may come in any order and a tensor in several pieces, but the pieces of one
 * tensor in order: offset must be where its previous piece ended (0 for the
 * first). Errors: SP_ERANGE (i out of range, a piece out of order or past
 * the tensor's end; nothing is written), SP_EIO (the write failed; the
 * writer is still valid for abort), SP_EINVAL (NULL src with len > 0). */
int sp_safetensors_writer_put(sp_safetensors_writer *w, size_t i,
                              uint64_t offset, const void *src, size_t len,
                              sp_diag *diag);

/* Finishes the file: checks that every tensor is complete (SP_EINVAL
 * naming the first that is not), fsyncs, renames over path and fsyncs the
 * directory, as sp_safetensors_write. Frees w whatever the result; on error the
 * temporary file is removed and path is untouched. */
int sp_safetensors_writer_commit(sp_safetensors_writer *w, sp_diag *diag);

/* Drops an unfinished file: removes the temporary file, frees w. NULL is
 * allowed. */
void sp_safetensors_writer_abort(sp_safetensors_writer *w);

#ifdef __cplusplus
}
#endif
#endif
