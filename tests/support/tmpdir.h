/* Scratch directories for the tests and the benchmarks. */
#ifndef SP_TEST_TMPDIR_H
#define SP_TEST_TMPDIR_H

#include <stddef.h>

/* Makes a fresh directory BASE/PREFIX-XXXXXX (mkdtemp) and writes its
 * path into out (cap bytes); base NULL: $TMPDIR, or /tmp when that is
 * unset or empty. Returns 0; SP_ETOOBIG when the path does not fit in
 * out; SP_EIO when mkdtemp failed, errno saying why (out then holds the
 * name it tried last). The directory is the caller's to remove
 * (sp_test_rmtree). */
int sp_test_tmpdir(const char *base, const char *prefix, char *out, size_t cap);

/* Removes dir and everything under it, following no link; best effort:
 * what cannot be removed stays. */
void sp_test_rmtree(const char *dir);

#endif
