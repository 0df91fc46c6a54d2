/* A candidate list seen for the first time, walked in the node policy's order a round at a
 * time (services/scheduler/native_walk.py; the numpy walk it stands in for is
 * candidate_order.fresh_walk, which stays the fallback and the reference).
 *
 * The order: the positions of the list by (group, key, position), ascending, where key =
 * sign x score of the position's slot and group = whether the node has a bind in flight (the
 * non-busy first); only the positions whose per-node bounds reach the request's
 * (`column[slot] >= minimum` for every bound given) are walked. A round returns the `cap`
 * first positions strictly after the previous round's last (key, position), found in one pass
 * over the list with a max-heap of `cap` entries: a position is read further (its bounds) only
 * when its key would enter the heap. So a decision that fits on one of the first nodes costs
 * one pass over the list, no sort and no array per candidate. */
#include "tessera_names.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifndef TN_AHEAD
#define TN_AHEAD 16 /* positions ahead whose key is prefetched in the first round */
#endif

typedef struct {
	double key;
	int64_t position;
} tn_pick;

/* The slot at position i of a list of `width`-byte slots (4: int32, as the resolver writes
 * them; 8: int64, as numpy's paths give them). Inlined with `width` a constant: one load. */
static inline __attribute__((always_inline)) int64_t tn_slot(const void *slots, uint64_t i,
							      const uint32_t width)
{
	return width == 4 ? (int64_t)((const int32_t *)slots)[i] : ((const int64_t *)slots)[i];
}

/* (a.key, a.position) < (b.key, b.position) */
static inline int tn_before(double key, int64_t position, const tn_pick *b)
{
	return key < b->key || (key == b->key && position < b->position);
}

/* `spec`: (column address, width in bytes, minimum) per bound */
static inline int tn_reaches(int64_t slot, const int64_t *spec, uint32_t bounds)
{
	for (uint32_t b = 0; b < bounds; b++) {
		const void *column = (const void *)(uintptr_t)spec[3 * b];
		int64_t value;
		switch (spec[3 * b + 1]) {
		case 1:
			value = ((const int8_t *)column)[slot];
			break;
		case 2:
			value = ((const int16_t *)column)[slot];
			break;
		case 4:
			value = ((const int32_t *)column)[slot];
			break;
		default:
			value = ((const int64_t *)column)[slot];
			break;
		}
		if (value < spec[3 * b + 2])
			return 0;
	}
	return 1;
}

static inline void tn_prefetch_bounds(uint64_t slot, const int64_t *spec, uint32_t bounds)
{
	for (uint32_t b = 0; b < bounds; b++)
		__builtin_prefetch((const char *)(uintptr_t)spec[3 * b] +
				   (uint64_t)spec[3 * b + 1] * slot);
}

/* The heap's entry at `at` moved down to where it belongs (the largest at 0). */
static void tn_sift_down(tn_pick *heap, uint64_t count, uint64_t at)
{
	tn_pick moving = heap[at];
	for (;;) {
		uint64_t child = 2 * at + 1;
		if (child >= count)
			break;
		if (child + 1 < count && tn_before(heap[child].key, heap[child].position,
						   &heap[child + 1]))
			child++;
		if (!tn_before(moving.key, moving.position, &heap[child]))
			break;
		heap[at] = heap[child];
		at = child;
	}
	heap[at] = moving;
}

static void tn_sift_up(tn_pick *heap, uint64_t at)
{
	tn_pick moving = heap[at];
	while (at) {
		uint64_t parent = (at - 1) / 2;
		if (!tn_before(heap[parent].key, heap[parent].position, &moving))
			break;
		heap[at] = heap[parent];
		at = parent;
	}
	heap[at] = moving;
}

/* One round's selection: a heap of the `cap` first, its largest (`top`) kept in registers; a
 * position is read further (its bounds) only when its key would enter. */
typedef struct {
	tn_pick *heap;
	uint64_t cap, count;
	double top_key;
	int64_t top_position;
} tn_round;

/* The entry `(key, position)` added to the round's heap (its bounds reached). */
static inline void tn_take(tn_round *r, double key, uint64_t position)
{
	if (r->count < r->cap) {
		r->heap[r->count] = (tn_pick){key, (int64_t)position};
		tn_sift_up(r->heap, r->count++);
	} else {
		r->heap[0] = (tn_pick){key, (int64_t)position};
		tn_sift_down(r->heap, r->count, 0);
	}
	if (r->count == r->cap) {
		r->top_key = r->heap[0].key;
		r->top_position = r->heap[0].position;
	}
}

/* Position `i` (its `key`, in the group `flag` when the round is by group) offered to the
 * round: 0, or -1 for a slot past the arrays (`check`: the first round checked it already). */
static inline int
tn_offer(tn_round *r, uint64_t i, double key, int by_group, uint8_t flag, uint8_t wanted,
	 const void *slots, const uint32_t width, uint64_t n, uint64_t limit, int check,
	 const int64_t *spec, uint32_t bounds, int32_t resume, double after_key,
	 int64_t after_position)
{
	if (r->count < r->cap && i + TN_AHEAD < n) {
		/* (a heap not full yet reads the bounds of every position of its group, a random
		 * gather: their cache lines asked for ahead, as the first round's keys) */
		uint64_t ahead = (uint64_t)tn_slot(slots, i + TN_AHEAD, width);
		if (ahead < limit)
			tn_prefetch_bounds(ahead, spec, bounds);
	}
	if (by_group && flag != wanted)
		return 0;
	if (r->count == r->cap &&
	    !(key < r->top_key || (key == r->top_key && (int64_t)i < r->top_position)))
		return 0;
	if (resume && !(after_key < key || (after_key == key && after_position < (int64_t)i)))
		return 0;
	int64_t slot = tn_slot(slots, i, width);
	if (check && (slot < 0 || (uint64_t)slot >= limit))
		return -1;
	if (tn_reaches(slot, spec, bounds))
		tn_take(r, key, i);
	return 0;
}

/* One position of a first round (`tn_first_round`): its key and group written, and offered
 * to the round; `ahead`: the slot TN_AHEAD positions on (`limit`: none). 0, or -1. */
static inline __attribute__((always_inline)) int
tn_first_step(tn_round *r, uint64_t i, int64_t slot, uint64_t ahead, uint64_t limit,
	      const double *scores, double sign, const uint8_t *busy, double *keys,
	      uint8_t *busy_at, const int grouped, uint8_t wanted, const int64_t *spec,
	      uint32_t bounds, uint64_t *seen)
{
	if (slot < 0 || (uint64_t)slot >= limit)
		return -1;
	if (ahead < limit) /* (a gather: its cache lines asked for ahead) */
		__builtin_prefetch(&scores[ahead]);
	double key = sign * scores[slot];
	if (key != key)
		return -1; /* NaN: no order to give (the caller walks in numpy) */
	keys[i] = key;
	uint8_t flag = 0;
	if (grouped) {
		flag = busy[slot] ? 1 : 0;
		busy_at[i] = flag;
		*seen += flag;
	}
	if (r->count == r->cap) {
		if (r->cap == 0 || !(key < r->top_key))
			return 0;
	} else if (ahead < limit) {
		/* (a heap not full yet reads the bounds of every position of its group, a random
		 * gather: their cache lines asked for ahead, as the keys) */
		tn_prefetch_bounds(ahead, spec, bounds);
	}
	if (grouped && flag != wanted)
		return 0;
	if (tn_reaches(slot, spec, bounds))
		tn_take(r, key, i);
	return 0;
}

/* The first round of a walk that resumes after nothing (`tn_offer`'s, for that case, with
 * `grouped` and `width` constants where it is inlined): the positions are offered in
 * increasing order, so the heap's largest entry always has an earlier position than the one
 * offered, and a position enters a full heap exactly when its key is below the largest's.
 * Most positions of a long list cost that one comparison after their key and group are
 * written. 0, or -1 for a slot past the arrays or a NaN key. */
static inline __attribute__((always_inline)) int
tn_first_round(tn_round *r, const void *slots, const uint32_t width, uint64_t n, uint64_t limit,
	       const double *scores, double sign, const uint8_t *busy, double *keys,
	       uint8_t *busy_at, const int grouped, uint8_t wanted, const int64_t *spec,
	       uint32_t bounds, uint64_t *busy_seen)
{
	uint64_t seen = 0, i = 0;
	for (; i + TN_AHEAD < n; i++) /* (a slot TN_AHEAD on: prefetched) */
		if (tn_first_step(r, i, tn_slot(slots, i, width),
				  (uint64_t)tn_slot(slots, i + TN_AHEAD, width), limit, scores, sign,
				  busy, keys, busy_at, grouped, wanted, spec, bounds, &seen) < 0)
			return -1;
	for (; i < n; i++)
		if (tn_first_step(r, i, tn_slot(slots, i, width), limit, limit, scores, sign, busy,
				  keys, busy_at, grouped, wanted, spec, bounds, &seen) < 0)
			return -1;
	*busy_seen = seen;
	return 0;
}

#if defined(__x86_64__)
/* `tn_first_round` of an ungrouped walk of int32 slots with AVX2, four positions at a time once
 * the heap is full (before, the scalar steps: every position is offered). Per four: the slots
 * checked in range (none read before), their scores gathered, the keys written, and only the
 * lanes whose key is below the heap's largest offered, in position order, each checked again
 * against the largest as it is then (it only falls): the same positions taken in the same
 * order as the scalar round, the same keys (sign x score, one rounding either way); -1 for a
 * slot out of range or a NaN key anywhere, as the scalar round. */
__attribute__((target("avx2"))) static int
tn_first_round_avx2(tn_round *r, const int32_t *slots, uint64_t n, uint64_t limit,
		    const double *scores, double sign, double *keys, const int64_t *spec,
		    uint32_t bounds)
{
	uint64_t seen = 0, i = 0;
	for (; i < n && r->count < r->cap; i++)
		if (tn_first_step(r, i, slots[i],
				  i + TN_AHEAD < n ? (uint64_t)(int64_t)slots[i + TN_AHEAD] : limit,
				  limit, scores, sign, NULL, keys, NULL, 0, 0, spec, bounds,
				  &seen) < 0)
			return -1;
	const __m256d times = _mm256_set1_pd(sign);
	const __m128i zero = _mm_setzero_si128();
	/* (a slot is in range when 0 <= slot <= last; every int32 slot is below a larger limit) */
	const int capped = limit <= (uint64_t)INT32_MAX;
	const __m128i last = _mm_set1_epi32(!capped ? INT32_MAX : limit ? (int32_t)(limit - 1) : -1);
	for (; i + 4 <= n; i += 4) {
		__m128i four = _mm_loadu_si128((const __m128i *)(const void *)(slots + i));
		__m128i out = _mm_cmpgt_epi32(zero, four);
		if (capped)
			out = _mm_or_si128(out, _mm_cmpgt_epi32(four, last));
		if (_mm_movemask_epi8(out))
			return -1;
		if (i + TN_AHEAD + 4 <= n) /* (a gather: its cache lines asked for ahead) */
			for (uint64_t k = i + TN_AHEAD; k < i + TN_AHEAD + 4; k++)
				if ((uint64_t)(int64_t)slots[k] < limit)
					__builtin_prefetch(&scores[slots[k]]);
		__m256d key = _mm256_mul_pd(_mm256_i32gather_pd(scores, four, 8), times);
		_mm256_storeu_pd(keys + i, key);
		if (_mm256_movemask_pd(_mm256_cmp_pd(key, key, _CMP_UNORD_Q)))
			return -1; /* NaN: no order to give (the caller walks in numpy) */
		if (!r->cap)
			continue;
		int below = _mm256_movemask_pd(
			_mm256_cmp_pd(key, _mm256_set1_pd(r->top_key), _CMP_LT_OQ));
		while (below) {
			uint64_t at = i + (uint64_t)__builtin_ctz((unsigned)below);
			below &= below - 1;
			double one = keys[at];
			if (one < r->top_key && tn_reaches(slots[at], spec, bounds))
				tn_take(r, one, at);
		}
	}
	for (; i < n; i++)
		if (tn_first_step(r, i, slots[i], limit, limit, scores, sign, NULL, keys, NULL, 0, 0,
				  spec, bounds, &seen) < 0)
			return -1;
	return 0;
}
#endif

/* Whether AVX2 can be used here (the CPU's, read by libgcc once per process), unless the
 * environment says `TESSERA_WALK_SCALAR` (not empty, not 0) when first asked: the scalar round
 * everywhere, so that its tests reach it on an AVX2 machine too
 * (tests/scheduler/test_native_walk.py). */
static int tn_avx2(void)
{
#if defined(__x86_64__)
	static int known = -1;
	int usable = __atomic_load_n(&known, __ATOMIC_RELAXED);
	if (usable < 0) {
		const char *scalar = getenv("TESSERA_WALK_SCALAR");
		__builtin_cpu_init();
		usable = !(scalar && *scalar && strcmp(scalar, "0") != 0)
			 && __builtin_cpu_supports("avx2");
		__atomic_store_n(&known, usable, __ATOMIC_RELAXED);
	}
	return usable;
#else
	return 0;
#endif
}

/* Whether any of the `n` flags is set (an OR of every byte: vectorised by the compiler). */
static int tn_any_set(const uint8_t *flags, uint64_t n)
{
	uint8_t any = 0;
	for (uint64_t i = 0; i < n; i++)
		any |= flags[i];
	return any != 0;
}

/* tn_walk_round for slots of `width` bytes (a constant where it is inlined). */
static inline __attribute__((always_inline)) int64_t
tn_walk(const void *slots, const uint32_t width, uint64_t n, uint64_t limit, const double *scores,
	double sign, const uint8_t *busy, double *keys, uint8_t *busy_at, int32_t group,
	const int64_t *spec, uint32_t bounds, int32_t resume, double after_key,
	int64_t after_position, int64_t *out, uint64_t cap, uint64_t *busy_count)
{
	tn_pick *heap = cap ? malloc(cap * sizeof *heap) : NULL;
	if (cap && !heap)
		return -1;
	tn_round r = {heap, cap, 0, 0.0, 0};
	const uint8_t wanted = (uint8_t)(group != 0);
	const int by_group = busy_at != NULL;
	if (scores && !resume) {
		/* The first round: every key and group read from the index (kept), each position
		 * offered to the round as it is read (one pass over the list). No node of the index
		 * busy (most calls: a flag is set only while a bind is in flight): one group, so the
		 * round is the ungrouped one and `busy_at` is not written (busy count 0); a sequential
		 * pass over `busy` instead of a gather, a store and a test a position. */
		uint64_t busy_seen = 0;
		int read;
		if (by_group && tn_any_set(busy, limit))
			read = tn_first_round(&r, slots, width, n, limit, scores, sign, busy, keys,
					      busy_at, 1, wanted, spec, bounds, &busy_seen);
#if defined(__x86_64__)
		else if (width == 4 && tn_avx2())
			read = tn_first_round_avx2(&r, slots, n, limit, scores, sign, keys, spec,
						   bounds);
#endif
		else
			read = tn_first_round(&r, slots, width, n, limit, scores, sign, busy, keys,
					      NULL, 0, wanted, spec, bounds, &busy_seen);
		if (read < 0) {
			free(heap);
			return -1;
		}
		if (busy_count)
			*busy_count = busy_seen;
	} else if (scores) {
		/* (a first round that resumes: every position offered as in later rounds) */
		uint64_t busy_seen = 0;
		for (uint64_t i = 0; i < n; i++) {
			int64_t slot = tn_slot(slots, i, width);
			if (slot < 0 || (uint64_t)slot >= limit) {
				free(heap);
				return -1;
			}
			if (i + TN_AHEAD < n) { /* (a gather: its cache lines asked for ahead) */
				uint64_t ahead = (uint64_t)tn_slot(slots, i + TN_AHEAD, width);
				if (ahead < limit)
					__builtin_prefetch(&scores[ahead]);
			}
			double key = sign * scores[slot];
			if (key != key) { /* NaN: no order to give (the caller walks in numpy) */
				free(heap);
				return -1;
			}
			keys[i] = key;
			uint8_t flag = 0;
			if (busy_at) {
				flag = busy[slot] ? 1 : 0;
				busy_at[i] = flag;
				busy_seen += flag;
			}
			if (cap)
				(void)tn_offer(&r, i, key, by_group, flag, wanted, slots, width, n,
					       limit, 0, spec, bounds, resume, after_key,
					       after_position);
		}
		if (busy_count)
			*busy_count = busy_seen;
	} else {
		for (uint64_t i = 0; i < n && cap; i++) {
			if (tn_offer(&r, i, keys[i], by_group, by_group ? busy_at[i] : 0, wanted,
				     slots, width, n, limit, 1, spec, bounds, resume, after_key,
				     after_position) < 0) {
				free(heap);
				return -1;
			}
		}
	}
	/* ascending: the largest taken off the heap into the end, one at a time */
	for (uint64_t left = r.count; left > 0; left--) {
		tn_pick largest = heap[0];
		heap[0] = heap[left - 1];
		tn_sift_down(heap, left - 1, 0);
		out[left - 1] = largest.position;
	}
	free(heap);
	return (int64_t)r.count;
}

TN_EXPORT int64_t tn_walk_round(const void *slots, uint32_t width, uint64_t n, uint64_t limit,
				const double *scores, double sign, const uint8_t *busy,
				double *keys, uint8_t *busy_at, int32_t group, const int64_t *spec,
				uint32_t bounds, int32_t resume, double after_key,
				int64_t after_position, int64_t *out, uint64_t cap,
				uint64_t *busy_count)
{
	if (!slots || !keys || !out || (bounds && !spec))
		return -1;
	for (uint32_t b = 0; b < bounds; b++) {
		int64_t column_width = spec[3 * b + 1];
		if (!spec[3 * b] || (column_width != 1 && column_width != 2 && column_width != 4
				     && column_width != 8))
			return -1;
	}
	if (width == 4)
		return tn_walk(slots, 4, n, limit, scores, sign, busy, keys, busy_at, group, spec,
			       bounds, resume, after_key, after_position, out, cap, busy_count);
	if (width == 8)
		return tn_walk(slots, 8, n, limit, scores, sign, busy, keys, busy_at, group, spec,
			       bounds, resume, after_key, after_position, out, cap, busy_count);
	return -1;
}

TN_EXPORT int64_t tn_walk_first(const int64_t *plan, const void *slots, uint32_t width,
				uint64_t n, double sign, void *block)
{
	if (!plan || !block || !plan[0])
		return -1;
	const uint64_t checked = (uint64_t)plan[6];
	const uint8_t *busy = (const uint8_t *)(uintptr_t)plan[1];
	int64_t *out = (int64_t *)(void *)((char *)block + 8 * n);
	uint8_t *busy_at = busy ? (uint8_t *)block + 8 * (n + checked + 1) : NULL;
	return tn_walk_round(slots, width, n, (uint64_t)plan[2],
			     (const double *)(uintptr_t)plan[0], sign, busy, (double *)block,
			     busy_at, 0, (const int64_t *)(uintptr_t)plan[3], (uint32_t)plan[4], 0,
			     0.0, 0, out, (uint64_t)plan[5], (uint64_t *)(void *)(out + checked));
}
