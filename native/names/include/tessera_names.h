/* libtessera_names: a node-name table and the one-pass resolver of a compact JSON array of
 * names (see src/names.c). */
#ifndef TESSERA_NAMES_H
#define TESSERA_NAMES_H

#include <stdint.h>

#define TN_EXPORT __attribute__((visibility("default")))

typedef struct tn_table tn_table;

/* A table of `count` distinct names: their bytes back to back in `names` (row by row),
 * `lengths[i]` bytes each, `slots[i]` the caller's value for row i, `order` every row once,
 * in the order lists are expected to follow (runs of it are resolved fastest). Copies what
 * it needs. NULL on failure (out of memory, a name given twice, `order` not a permutation,
 * a name over 65,535 bytes, a slot outside 0..2^31-1, too many names or bytes). `seed`
 * varies the hash. */
TN_EXPORT tn_table *tn_build(const unsigned char *names, const uint64_t *lengths,
			     const int64_t *slots, const int64_t *order, uint64_t count,
			     uint64_t seed);

/* The rows (and, when `slots` is not NULL, the slots) of the names of the JSON array `a` of
 * `n` bytes (`[` to `]`), in order, at most `capacity`; the number of names, or -1 unless the
 * array is `["a","b",...]` with no space, every name non-empty, free of `\` and control
 * characters, and byte for byte a name of the table; -2 when it holds more than `capacity`
 * names (and what it has read of them is a prefix of such an array). */
TN_EXPORT int64_t tn_resolve(const tn_table *t, const unsigned char *a, uint64_t n,
			     int64_t *rows, int64_t *slots, uint64_t capacity);

TN_EXPORT void tn_free(tn_table *t);

#endif
