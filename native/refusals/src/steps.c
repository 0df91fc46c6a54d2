/* A refused pod's container steps, for every candidate row at once, as
 * `refusal_steps.group_steps` computes them in numpy (libvgpu-slices cards only: the caller
 * checks): each container in order checks every card of the row (HAMi's checks, first failed
 * wins: its class's static checks, slots, mutex, memory, cores, exclusive use, compute left),
 * and the first with fewer passing cards than its count refuses the row with those codes;
 * otherwise it takes the first `count` passing cards by the GPU policy's device score (ties
 * by card index), and they are charged as `placement._take` charges them. Every double is
 * computed in numpy's order of operations (built with -ffp-contract=off), so the picks are
 * the same. Row by row, no allocation. */
#include "tessera_refusals.h"

#include <math.h>
#include <string.h>

#define MAX_WIDTH 64

/* a card's verdict against a container (`refusal_steps.py`: 0 takes it) */
enum { V_SLOTS = 1, V_MUTEX, V_MEMORY, V_CORES, V_EXCLUSIVE, V_COMPUTE, V_STATIC };

/* Python's floor division (a divisor > 0) */
static int64_t floor_div(int64_t a, int64_t b)
{
	int64_t q = a / b;
	return (a % b != 0 && a < 0) ? q - 1 : q;
}

/* numpy's int64 arithmetic wraps; so does this (no signed overflow) */
static int64_t mul_wrap(int64_t a, int64_t b)
{
	return (int64_t)((uint64_t)a * (uint64_t)b);
}

static int64_t add_wrap(int64_t a, int64_t b)
{
	return (int64_t)((uint64_t)a + (uint64_t)b);
}

static int64_t sub_wrap(int64_t a, int64_t b)
{
	return (int64_t)((uint64_t)a - (uint64_t)b);
}

/* one row's cards as the steps leave them */
typedef struct {
	int64_t cls[MAX_WIDTH], total_mem[MAX_WIDTH], total_cores[MAX_WIDTH], split[MAX_WIDTH];
	int64_t kind[MAX_WIDTH], free_mem[MAX_WIDTH];
	int32_t free_cores[MAX_WIDTH], used[MAX_WIDTH];
	int16_t pct[MAX_WIDTH];
	uint8_t carded[MAX_WIDTH], computing[MAX_WIDTH], idle[MAX_WIDTH], exhausted[MAX_WIDTH];
	int16_t verdict[MAX_WIDTH];
	double key[MAX_WIDTH];
	uint8_t taken[MAX_WIDTH];
} row_state;

static void load_row(row_state *s, const tr_cards *c, const tr_classes *k, int64_t row)
{
	int64_t w = c->width, at = row * w;
	for (int64_t i = 0; i < w; i++) {
		int32_t cl = c->card_class[at + i];
		int64_t cls = cl >= 0 ? cl : 0;
		s->carded[i] = cl >= 0;
		s->cls[i] = cls;
		s->total_mem[i] = k->memory[cls];
		s->total_cores[i] = k->cores[cls];
		s->split[i] = k->split[cls];
		s->kind[i] = k->kind[cls];
		s->free_mem[i] = c->card_mem[at + i];
		s->free_cores[i] = c->card_cores[at + i];
		s->used[i] = c->card_slots[at + i];
		s->computing[i] = c->card_computing[at + i] != 0;
		s->idle[i] = c->card_idle[at + i] != 0;
		s->pct[i] = c->card_pct[at + i];
		s->exhausted[i] = 0;
	}
}

/* each card's verdict on container `r` (`card_codes`, later checks overwritten by earlier
 * ones); the number of cards that take it */
static int64_t verdicts(row_state *s, int64_t w, const int64_t *r, const int64_t *statics,
			const tr_pod *pod)
{
	int64_t mib = r[1], percentage = r[2], cores = r[3], passing = 0;
	for (int64_t i = 0; i < w; i++) {
		int16_t v = 0;
		if (cores == 0 && s->total_cores[i] > 0 && !s->computing[i])
			v = V_COMPUTE;
		if (cores >= 100 && !s->idle[i])
			v = V_EXCLUSIVE;
		if (!((int64_t)s->free_cores[i] >= cores))
			v = V_CORES;
		if (!(percentage >= 0 ? (int64_t)s->pct[i] >= percentage : s->free_mem[i] >= mib))
			v = V_MEMORY;
		if (pod->mutex && !s->idle[i])
			v = V_MUTEX;
		if (s->exhausted[i])
			v = V_SLOTS;
		int64_t st = statics[s->cls[i]];
		if (st > 0)
			v = (int16_t)(V_STATIC + st);
		s->verdict[i] = v;
		passing += s->carded[i] && v == 0 && !s->exhausted[i];
	}
	return passing;
}

/* the pick's key of each card (`group_steps`: HAMi's device score, signed; +inf where the
 * card does not take the container) */
static void keys(row_state *s, int64_t w, const int64_t *r, const tr_pod *pod)
{
	for (int64_t i = 0; i < w; i++) {
		if (!(s->carded[i] && s->verdict[i] == 0 && !s->exhausted[i])) {
			s->key[i] = INFINITY;
			continue;
		}
		if (!pod->sign) {
			s->key[i] = 0.0;
			continue;
		}
		double score = 0.0;
		if (s->split[i] != 0)
			score = ((double)s->used[i] + 1.0) * (double)pod->w_slot / (double)s->split[i];
		double term = 0.0;
		if (s->total_cores[i] != 0)
			term = (double)mul_wrap(pod->w_core,
						add_wrap(r[3], sub_wrap(s->total_cores[i],
									s->free_cores[i]))) /
			       (double)s->total_cores[i];
		score += term;
		int64_t on_card = r[2] >= 0 ? floor_div(mul_wrap(s->total_mem[i], r[2]), 100) : r[1];
		term = 0.0;
		if (s->total_mem[i] != 0)
			term = (double)mul_wrap(pod->w_mem,
						add_wrap(on_card, sub_wrap(s->total_mem[i],
									   s->free_mem[i]))) /
			       (double)s->total_mem[i];
		score += term;
		s->key[i] = score * (10.0 * (double)pod->sign);
	}
}

/* the first `count` smallest keys, ties by index (a stable sort's first `count`) */
static void pick(row_state *s, int64_t w, int64_t count)
{
	memset(s->taken, 0, (size_t)w);
	if (count >= w) {
		memset(s->taken, 1, (size_t)w);
		return;
	}
	for (int64_t k = 0; k < count; k++) {
		int64_t best = -1;
		for (int64_t i = 0; i < w; i++)
			if (!s->taken[i] && (best < 0 || s->key[i] < s->key[best]))
				best = i;
		s->taken[best] = 1;
	}
}

/* whether the pick chose by index between cards that stand differently (`_mark_ties`): a
 * passing card left out with the key of the last card taken, while the cards of that key
 * differ in free memory, free cores, used slots (as the later steps read them), computing,
 * idle or class */
static int tied(const row_state *s, int64_t w, int64_t step, int64_t last, const tr_pod *pod)
{
	double top = -INFINITY;
	for (int64_t i = 0; i < w; i++)
		if (s->taken[i] && s->key[i] > top)
			top = s->key[i];
	int left_out = 0;
	int64_t first = -1;
	for (int64_t i = 0; i < w; i++) {
		if (s->key[i] != top)
			continue;
		if (first < 0)
			first = i;
		if (s->carded[i] && s->verdict[i] == 0 && !s->exhausted[i] && !s->taken[i])
			left_out = 1;
	}
	if (!left_out)
		return 0;
	int slot_term = pod->w_slot != 0 && pod->sign != 0;
	for (int64_t i = first + 1; i < w; i++) {
		if (s->key[i] != top)
			continue;
		int64_t ui = s->used[i], uf = s->used[first];
		if (!slot_term) {
			ui = ui + (last - step + 1) >= s->split[i] ? ui : -1;
			uf = uf + (last - step + 1) >= s->split[first] ? uf : -1;
		}
		if (s->free_mem[i] != s->free_mem[first] || s->free_cores[i] != s->free_cores[first] ||
		    ui != uf || s->computing[i] != s->computing[first] ||
		    s->idle[i] != s->idle[first] || s->kind[i] != s->kind[first])
			return 1;
	}
	return 0;
}

/* the cards taken charged as `placement._take` charges them */
static void charge(row_state *s, int64_t w, const int64_t *r, int compute_later,
		   int percent_later)
{
	for (int64_t i = 0; i < w; i++) {
		if (!s->taken[i])
			continue;
		int64_t amount = r[2] >= 0 ? floor_div(mul_wrap(s->total_mem[i], r[2]), 100) : r[1];
		s->free_mem[i] = sub_wrap(s->free_mem[i], amount);
		s->free_cores[i] = (int32_t)sub_wrap(s->free_cores[i], r[3]);
		s->used[i] += 1;
		s->idle[i] = 0;
		if (compute_later)
			s->computing[i] = s->total_cores[i] == 0 || s->free_cores[i] > 0;
		if (percent_later && s->total_mem[i] > 0) {
			int64_t p = floor_div(sub_wrap(mul_wrap(100, add_wrap(s->free_mem[i], 1)), 1),
					      s->total_mem[i]);
			s->pct[i] = (int16_t)(p < 32767 ? p : 32767);
		}
		if (s->used[i] >= s->split[i])
			s->exhausted[i] = 1;
	}
}

int64_t tr_steps(const tr_cards *cards, const tr_classes *classes, const tr_pod *pod,
		 const int64_t *slots, int64_t n, int64_t *failed_at, int64_t *failed_sig,
		 int64_t *codes, uint8_t *refused, uint8_t *ties)
{
	int64_t w = cards->width, steps = pod->containers;
	if (w < 1 || w > MAX_WIDTH || n < 0 || steps < 1 || classes->classes < 1 ||
	    (pod->all_codes && steps != 1))
		return -1;
	for (int64_t i = 0; i < n; i++) { /* (checked before anything is written) */
		if (slots[i] < 0 || slots[i] >= cards->rows)
			return -1;
		for (int64_t c = 0; c < w; c++)
			if (cards->card_class[slots[i] * w + c] >= classes->classes)
				return -1;
	}
	row_state s;
	for (int64_t i = 0; i < n; i++) {
		int64_t row = slots[i], *out = codes + i * w;
		failed_at[i] = -1;
		failed_sig[i] = -1;
		refused[i] = 0;
		for (int64_t c = 0; c < w; c++)
			out[c] = -1;
		int64_t sig = cards->unusable_sig[row];
		if (pod->all_codes) { /* (one container: every row's codes, refused or not) */
			load_row(&s, cards, classes, row);
			int64_t passing = verdicts(&s, w, pod->requests, pod->statics, pod);
			for (int64_t c = 0; c < w; c++)
				out[c] = s.carded[c] ? s.verdict[c] : -1;
			if (sig >= 0 && passing < pod->requests[0]) {
				failed_at[i] = 0;
				failed_sig[i] = sig;
				refused[i] = 1;
			}
			continue;
		}
		if (sig < 0)
			continue; /* (its refusals are not grouped) */
		load_row(&s, cards, classes, row);
		for (int64_t j = 0; j < steps; j++) {
			const int64_t *r = pod->requests + 4 * j;
			int64_t passing = verdicts(&s, w, r, pod->statics + j * classes->classes, pod);
			if (passing < r[0]) {
				failed_at[i] = j;
				failed_sig[i] = sig;
				refused[i] = 1;
				for (int64_t c = 0; c < w; c++)
					out[c] = s.carded[c] ? s.verdict[c] : -1;
				break;
			}
			if (j == steps - 1)
				break;
			if (passing == r[0]) { /* every passing card taken: no pick, no tie */
				for (int64_t c = 0; c < w; c++)
					s.taken[c] = s.carded[c] && s.verdict[c] == 0 &&
						     !s.exhausted[c];
			} else {
				keys(&s, w, r, pod);
				pick(&s, w, r[0]);
				if (ties != NULL && !ties[i] && tied(&s, w, j, steps - 1, pod))
					ties[i] = 1;
			}
			int compute_later = 0, percent_later = 0;
			for (int64_t k = j + 1; k < steps; k++) {
				compute_later |= pod->requests[4 * k + 3] == 0;
				percent_later |= pod->requests[4 * k + 2] >= 0;
			}
			charge(&s, w, r, compute_later, percent_later);
		}
	}
	return 0;
}
