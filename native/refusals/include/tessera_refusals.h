/* libtessera_refusals: a refused pod's container steps for every candidate row at once (see
 * src/steps.c and services/scheduler/refusal_steps.py, whose numpy path it mirrors). */
#ifndef TESSERA_REFUSALS_H
#define TESSERA_REFUSALS_H

#include <stdint.h>

#define TR_EXPORT __attribute__((visibility("default")))

/* The index's per-card arrays (`ClusterIndex`: `rows` rows of `width` cards each, row-major)
 * and its per-row signature of the cards that take no pod. */
typedef struct {
	int64_t rows, width;
	const int32_t *card_class; /* -1: no card */
	const int64_t *card_mem;   /* free memory, MiB */
	const int32_t *card_cores; /* free cores, % */
	const int32_t *card_slots; /* used slots */
	const uint8_t *card_computing;
	const uint8_t *card_idle;
	const int16_t *card_pct; /* free memory, % */
	const int64_t *unusable_sig;
} tr_cards;

/* By card class (`classes` of them): memory MiB, cores, split count, a number equal for
 * classes that differ only in their NUMA node. */
typedef struct {
	int64_t classes;
	const int64_t *memory, *cores, *split, *kind;
} tr_classes;

/* The pod: `containers` app containers in fit order, each as 4 numbers (count, memory MiB,
 * memory % or -1, cores), `statics` by container then class (0: a card of the class passes
 * the checks that read only what it is, else 1 + the reason's id), the options. */
typedef struct {
	int64_t containers;
	const int64_t *requests;
	const int64_t *statics;
	int64_t mutex;
	int64_t sign; /* the first binpack (-1) or spread (1) GPU policy, 0 if none */
	int64_t w_slot, w_core, w_mem;
	/* 1: one container, its codes written for every row, refused or not, grouped or not
	 * (`refusal_shapes._group`'s of a single container) */
	int64_t all_codes;
} tr_pod;

/* For each of the `n` candidate rows `slots`: the step it fails at (-1: it takes every
 * container), that step's signature (-1), its cards' codes then (`width` each; -1 for no
 * card, and for a row that fails at no step), whether it is refused, and, where `ties` is
 * not NULL, set to 1 where a pick chose by card index between cards that stand differently.
 * 0, or -1 when an argument is out of range (nothing is then read past it). */
TR_EXPORT int64_t tr_steps(const tr_cards *cards, const tr_classes *classes, const tr_pod *pod,
			   const int64_t *slots, int64_t n, int64_t *failed_at,
			   int64_t *failed_sig, int64_t *codes, uint8_t *refused, uint8_t *ties);

/* The `n` rows where `where[i]` grouped by their `hw` head values and the multiset of their
 * `w` codes (int64, row-major): `groups[i]` the group of row i (-1 where not `where`),
 * numbered by first row, `first[g]` group g's first row. `table` is scratch of `table_size`
 * entries (a power of two, at least 2n) and `sorted` of n * w. The number of groups, or -1
 * when an argument is out of range. */
TR_EXPORT int64_t tr_group(const int64_t *head, int64_t hw, const int64_t *codes, int64_t w,
			   const uint8_t *where, int64_t n, int64_t *groups, int64_t *first,
			   int64_t *table, int64_t table_size, int64_t *sorted);

/* Each candidate row's number (`numbers[slots[i]]`, valid where `at[slots[i]]` equals
 * `versions[slots[i]]`) read once: `reps` the candidates whose number's first candidate they
 * are, in order, `rank[i]` the place of candidate i's number among them. `first_of` is scratch
 * of `top` entries, every one -1 (left so), numbers below `top`. The number of reps; -2 when
 * some rows' numbers are stale: `reps` then holds those candidates (`*stale_count` of them),
 * nothing else written; -1 when an argument is out of range. */
TR_EXPORT int64_t tr_distinct(const int64_t *numbers, const int64_t *at, const int64_t *versions,
			      int64_t rows, const int64_t *slots, int64_t n, int64_t *first_of,
			      int64_t top, int64_t *reps, int64_t *rank, int64_t *stale_count);

/* A refused pod's failedNodes JSON object (`{"name":"text",...}`, `{}` for none) written to
 * `out`: for each of the `count` pairs, the key of row `rows[i]` (`keys[key_at[row] ..
 * key_at[row + 1]]`, `"name":` as JSON writes it) and the text of id `ids[i]` (`texts[text_at[id]
 * .. text_at[id + 1]]`, a JSON string), comma-separated; `keys` and `texts` must be readable
 * 64 bytes past their last entry (zero padding). The bytes written (with `out` NULL:
 * its size, nothing written), or -1 (nothing written) when a row or id is out of range or the
 * object would not fit in `capacity`. */
TR_EXPORT int64_t tr_reasons_json(const uint8_t *keys, const int64_t *key_at, int64_t key_count,
				  const int64_t *rows, const uint8_t *texts,
				  const int64_t *text_at, int64_t text_count, const int64_t *ids,
				  int64_t count, uint8_t *out, int64_t capacity);

#endif
