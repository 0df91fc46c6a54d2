/* A refused pod's `failedNodes` JSON object, written in one pass (services/scheduler/
 * failed_nodes_json.py; its Python join stays the fallback and the reference).
 *
 * kube-scheduler lists every node of a refused call in the reply's failedNodes map: at 20,000
 * nodes ~0.8 MB of `"name":"reason",` pairs, a few distinct reasons. Joined in Python from
 * 40,000 bytes objects, sliced and concatenated, that is ~0.6 ms and several megabytes
 * written, which evicts what the next call needs (its p99 was made of calls right after a
 * refusal, bench/RESULTS.md "reply"). Here each pair is copied from two pre-encoded byte
 * tables (the name table's keys, `"name":`, by row; the request's texts, `"text"`, by id)
 * straight into the output: ~1 write of the reply's bytes. */
#include "tessera_refusals.h"

#include <string.h>

#define TR_SPAN 64 /* a key or a text this long or shorter is copied in 16-byte moves */

/* The n bytes at src written at `at` (`end`: the output's end); returns the byte after
 * them. A short one is copied 16 bytes at a time, up to 15 bytes past it written (the next
 * pair's bytes overwrite them) and read (the tables are padded: `tr_reasons_json`), where
 * the output has room for the overshoot: ~2 moves, not a call to memcpy, a pair. */
static inline uint8_t *tr_put(uint8_t *at, const uint8_t *src, size_t n, const uint8_t *end)
{
	if (n <= TR_SPAN && (size_t)(end - at) >= TR_SPAN) {
		for (size_t i = 0; i < n; i += 16)
			memcpy(at + i, src + i, 16);
		return at + n;
	}
	memcpy(at, src, n);
	return at + n;
}

int64_t tr_reasons_json(const uint8_t *keys, const int64_t *key_at, int64_t key_count,
			const int64_t *rows, const uint8_t *texts, const int64_t *text_at,
			int64_t text_count, const int64_t *ids, int64_t count, uint8_t *out,
			int64_t capacity)
{
	if (count < 0 || key_count < 0 || text_count < 0 || (out != NULL && capacity < 2))
		return -1;
	if (out == NULL)
		capacity = INT64_MAX; /* the size alone asked */
	/* The size first (every row and id checked in range): nothing is written for a call
	 * whose output would not fit. */
	int64_t size = count ? count + 1 : 2; /* `{`, a `,` between pairs / `}`; or `{}` */
	for (int64_t i = 0; i < count; i++) {
		int64_t row = rows[i], id = ids[i];
		if (row < 0 || row >= key_count || id < 0 || id >= text_count)
			return -1;
		int64_t key = key_at[row + 1] - key_at[row], text = text_at[id + 1] - text_at[id];
		if (key < 0 || text < 0 || key + text > capacity - size)
			return -1; /* (checked per pair: the sum never overflows) */
		size += key + text;
	}
	if (out == NULL)
		return size;
	if (size > capacity)
		return -1;
	uint8_t *at = out;
	const uint8_t *end = out + size;
	*at++ = '{';
	for (int64_t i = 0; i < count; i++) {
		int64_t row = rows[i], id = ids[i];
		at = tr_put(at, keys + key_at[row], (size_t)(key_at[row + 1] - key_at[row]), end);
		at = tr_put(at, texts + text_at[id], (size_t)(text_at[id + 1] - text_at[id]), end);
		*at++ = ',';
	}
	if (count)
		at[-1] = '}';
	else
		*at++ = '}';
	return (int64_t)(at - out);
}
