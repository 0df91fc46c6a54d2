/* Rows grouped by their head and the multiset of their codes (`refusal_steps.grouped`'s
 * partition): each row's codes sorted, hashed with its head into an open-addressing table,
 * and compared in full with the first row of the group the hash finds, so no collision merges
 * two groups. Groups are numbered by their first row. */
#include "tessera_refusals.h"

#include <string.h>

#define MAX_WIDTH 64

static uint64_t mix(uint64_t h, uint64_t v)
{
	h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
	h *= 0xBF58476D1CE4E5B9ull;
	return h ^ (h >> 31);
}

static void sort_row(int64_t *row, int64_t w)
{
	for (int64_t i = 1; i < w; i++) {
		int64_t v = row[i], j = i - 1;
		while (j >= 0 && row[j] > v) {
			row[j + 1] = row[j];
			j--;
		}
		row[j + 1] = v;
	}
}

int64_t tr_group(const int64_t *head, int64_t hw, const int64_t *codes, int64_t w,
		 const uint8_t *where, int64_t n, int64_t *groups, int64_t *first, int64_t *table,
		 int64_t table_size, int64_t *sorted)
{
	if (n < 0 || hw < 0 || w < 0 || w > MAX_WIDTH || table_size < 2 * n || table_size < 1 ||
	    (table_size & (table_size - 1)) != 0)
		return -1;
	uint64_t mask = (uint64_t)table_size - 1;
	for (int64_t t = 0; t < table_size; t++)
		table[t] = -1;
	int64_t count = 0;
	for (int64_t i = 0; i < n; i++) {
		groups[i] = -1;
		if (!where[i])
			continue;
		int64_t *row = sorted + i * w;
		memcpy(row, codes + i * w, (size_t)w * sizeof(int64_t));
		sort_row(row, w);
		uint64_t h = 0x243F6A8885A308D3ull;
		for (int64_t c = 0; c < hw; c++)
			h = mix(h, (uint64_t)head[i * hw + c]);
		for (int64_t c = 0; c < w; c++)
			h = mix(h, (uint64_t)row[c]);
		for (uint64_t t = h & mask;; t = (t + 1) & mask) {
			int64_t g = table[t];
			if (g < 0) {
				table[t] = count;
				first[count] = i;
				groups[i] = count++;
				break;
			}
			int64_t at = first[g];
			if (memcmp(head + at * hw, head + i * hw, (size_t)hw * sizeof(int64_t)) == 0 &&
			    memcmp(sorted + at * w, row, (size_t)w * sizeof(int64_t)) == 0) {
				groups[i] = g;
				break;
			}
		}
	}
	return count;
}
