/* libtessera_names: a node-name table and the one-pass resolver of a compact JSON array of
 * names (see src/names.c). */
#ifndef TESSERA_NAMES_H
#define TESSERA_NAMES_H

#include <stdint.h>

#define TN_EXPORT __attribute__((visibility("default")))

typedef struct tn_table tn_table;

/* The interface's version: 2 since the resolver writes rows and slots as int32 or int64
 * (`tn_resolve`'s `width`) and the walk reads either (`tn_walk_round`'s). A library without
 * this symbol is older (int64 only, no width): native_names.py does not load it. */
#define TN_ABI 2
TN_EXPORT uint32_t tn_abi(void);

/* A table of `count` distinct names: their bytes back to back in `names` (row by row),
 * `lengths[i]` bytes each, `slots[i]` the caller's value for row i, `order` every row once,
 * in the order lists are expected to follow (runs of it are resolved fastest). Copies what
 * it needs. NULL on failure (out of memory, a name given twice, `order` not a permutation,
 * a name over 65,535 bytes, a slot outside 0..2^31-1, too many names or bytes). `seed`
 * varies the hash. */
TN_EXPORT tn_table *tn_build(const unsigned char *names, const uint64_t *lengths,
			     const int64_t *slots, const int64_t *order, uint64_t count,
			     uint64_t seed);

/* The rows (when `rows` is not NULL) and the slots (when `slots` is not NULL), each an
 * integer of `width` bytes (4: int32, half the memory written and read again of int64's, a
 * table's rows and slots being below 2^31, `tn_build` refuses others; 8: int64; any other
 * width is -1), of the names of the JSON array `a` of `n` bytes (`[` to `]`), in order, at
 * most `capacity`; the number of names, or -1 unless the array is `["a","b",...]` with no
 * space, every name non-empty, free of `\` and control characters, and byte for byte a name
 * of the table; -2 when it holds more than `capacity` names (and what it has read of them is
 * a prefix of such an array). */
TN_EXPORT int64_t tn_resolve(const tn_table *t, const unsigned char *a, uint64_t n, void *rows,
			     void *slots, uint32_t width, uint64_t capacity);

/* tn_resolve for the array that starts at `body[start]` (its `[`) among the `n` bytes of
 * `body` (a request body: what follows the array is not read): it ends at the first `]` after
 * a name's closing quote, and where it ends (just past that `]`) is written to `*end`. -1
 * also when a name of the table holds a `"`, a backslash or a control character (the array's
 * end is then not known before a pass over it: tn_resolve reads it). */
TN_EXPORT int64_t tn_resolve_in(const tn_table *t, const unsigned char *body, uint64_t n,
				uint64_t start, void *rows, void *slots, uint32_t width,
				uint64_t capacity, uint64_t *end);

TN_EXPORT void tn_free(tn_table *t);

/* One round of a candidate list's walk in the node policy's order (src/walk.c): the positions
 * 0..n-1 of `slots` (each `width` bytes: 4, int32, or 8, int64; any other width is -1)
 * ordered by (group, key, position), keeping those whose slot has
 * `column[slot] >= minimum` for every bound (`spec`: `bounds` triples of the address of a
 * signed integer column by slot, its width in bytes, 1, 2, 4 or 8, and the minimum); written
 * to `out`: the `cap` first positions of group `group` (busy or not; every position when
 * `busy_at` is NULL) after (`after_key`, `after_position`) when `resume`, ascending.
 * The first round gives `scores` (by slot; key = sign x score): every position's key is
 * written to `keys` and, unless `busy_at` is NULL, its group (`busy[slot]` != 0) to
 * `busy_at`, and the number of busy positions to `*busy_count` (none of `busy[0..limit)` set:
 * `busy_at` is not written, the count is 0); later rounds give `scores`
 * NULL and read `keys` and `busy_at` as written. Every slot must be below `limit` (the
 * length of `scores`, `busy` and every column). The number of positions written, or -1 (a
 * slot out of range, a NaN key, a width not 1/2/4/8, no memory). */
TN_EXPORT int64_t tn_walk_round(const void *slots, uint32_t width, uint64_t n, uint64_t limit,
				const double *scores, double sign, const uint8_t *busy,
				double *keys, uint8_t *busy_at, int32_t group, const int64_t *spec,
				uint32_t bounds, int32_t resume, double after_key,
				int64_t after_position, int64_t *out, uint64_t cap,
				uint64_t *busy_count);

/* The first round of a walk (tn_walk_round's with `scores`, group 0 where `busy` is given, no
 * resume) in six arguments, the list's and the request's apart: `plan` holds the scores'
 * address, the busy flags' (0: not grouped), `limit`, the spec's address, `bounds`, `cap`
 * and `checked`; `block` is where the walk writes: `n` keys, then `checked` + 1 positions
 * (the round's from the first, the busy count at `checked`), then `n` busy flags. */
TN_EXPORT int64_t tn_walk_first(const int64_t *plan, const void *slots, uint32_t width,
				uint64_t n, double sign, void *block);

#endif
