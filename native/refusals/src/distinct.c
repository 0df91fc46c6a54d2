/* The distinct rows of a refusal's candidates (`refusal_states.RowStates.distinct`): each
 * candidate's row number read once, the first candidate of each number kept, in order. */
#include "tessera_refusals.h"

int64_t tr_distinct(const int64_t *numbers, const int64_t *at, const int64_t *versions,
		    int64_t rows, const int64_t *slots, int64_t n, int64_t *first_of, int64_t top,
		    int64_t *reps, int64_t *rank, int64_t *stale_count)
{
	if (n < 0 || rows < 0 || top < 0)
		return -1;
	int64_t stale = 0;
	for (int64_t i = 0; i < n; i++) {
		int64_t slot = slots[i];
		if (slot < 0 || slot >= rows)
			return -1;
		if (at[slot] != versions[slot])
			reps[stale++] = i; /* (renumbered by the caller) */
		else if (numbers[slot] < 0 || numbers[slot] >= top)
			return -1;
	}
	if (stale) {
		*stale_count = stale;
		return -2;
	}
	int64_t count = 0;
	for (int64_t i = 0; i < n; i++) {
		int64_t number = numbers[slots[i]];
		if (first_of[number] < 0) {
			first_of[number] = count;
			reps[count++] = i;
		}
		rank[i] = first_of[number];
	}
	for (int64_t k = 0; k < count; k++) /* (the scratch left all -1 again) */
		first_of[numbers[slots[reps[k]]]] = -1;
	return count;
}
