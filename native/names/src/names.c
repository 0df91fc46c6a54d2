/* Resolving kube-scheduler's `nodenames` array from the body's bytes in one pass: each name's
 * row in a table of the registered nodes' names (an open-addressing hash table, built once per
 * topology). Exact: a hash only says where to look; a name resolves to a row only when its
 * bytes equal that row's name byte for byte. Anything this cannot prove (not the compact form
 * `["a","b"]`, a backslash or control character in a name, an empty name, an unknown name)
 * returns -1 and the caller reads the array the slow way.
 *
 * The names are kept in an order (kube-scheduler's node order as the caller guesses it: by
 * name), one 32-byte record each (`tn_name`: a name of 8 to 16 bytes as its first and last 8
 * bytes, with its slot and the key of the name after it), their bytes back to back besides.
 * kube-scheduler's lists are that order's runs: the whole order from a start index, with the
 * nodes its filters refused left out, or (its parallel filters) up to 16 such runs interleaved
 * name by name, each of the order's chunks started in turn. So each name resolved sets a
 * cursor on the name after it (1,024 cursors keyed by 10 bits of a mix of that name's bytes,
 * `tn_key`; a cursor is a copy of its name's record, so the loop waits on no record), and a
 * name is first compared with the cursor its own key finds: when equal, it is that name, with
 * no lookup in the large table; the order's records are read in a few forward streams (each
 * prefetched a few names ahead), not at random. A name no cursor expected is then compared
 * with the few it is likely to be (a chunk's first name, a name after one lately looked up)
 * before the hash table is looked in. `tn_resolve_in` reads the array where it lies in a
 * request body and finds its end itself. Used by services/scheduler/native_names.py
 * (ctypes); the contract is name_table.NameTable.rows'. */
#include "tessera_names.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
	uint32_t tag;      /* the high 32 bits of the name's hash */
	uint32_t position; /* the name's position in the order + 1; 0: an empty bucket (its
			    * record, `tn_name`, says the rest) */
} tn_entry;

/* A name, by its position in the order, as a cursor expecting it holds it (`tn_aim` copies it
 * whole: no load of its bytes then): what a name of a list is compared with and what it
 * resolves to. A name of 8 to 16 bytes is compared with `head` and `tail` alone (its first
 * and last 8 bytes: together every byte of it); others with the order's bytes at `head`. One
 * 32-byte record, read in a forward stream per run of the order a list holds. */
typedef struct {
	uint64_t head;     /* the name's first 8 bytes (8 to 16 bytes long); else where its
			    * bytes start in `blob` */
	uint64_t tail;     /* its last 8 bytes (8 to 16 bytes long) */
	uint32_t position; /* in the order */
	int32_t row;       /* the caller's row */
	int32_t slot;      /* the index slot the caller gave */
	uint16_t length;   /* in bytes; 0 in a cursor: none expected there (no name is empty) */
	uint16_t next_key; /* the cursor key (`tn_key`) of the name after it in the order: where
			    * the cursor set once it is read goes, known without another load */
} tn_name;

struct tn_table {
	tn_entry *entries;
	uint64_t mask; /* buckets - 1 (a power of two at least twice the names) */
	uint64_t seed;
	unsigned char *blob; /* every name's bytes, back to back, in the order (`TN_PAD` zero
			      * bytes before and after them: any name's first and last 8 bytes
			      * can be loaded as words) */
	tn_name *at;         /* by position; `count + 1` (the last a copy of the first: a run
			      * that reaches the order's end goes on from its start) */
	uint32_t count;
	uint32_t longest;
	uint32_t chunk; /* the nodes a parallel filter of kube-scheduler's checks at a time, were
			 * the table its nodes: min(sqrt(count), count / 16 + 1) (`chunkSizeFor`) */
	int plain; /* no name holds a `"`, a backslash or a control character */
};

#define TN_PAD 8
#define TN_MUL 0x9E3779B97F4A7C15ULL
#define TN_FIN 0xD6E8FEB86659FD93ULL

static inline uint64_t tn_word(const unsigned char *p)
{
	uint64_t v;
	memcpy(&v, p, sizeof v);
	return v;
}

/* The name's length and bytes, read as 8-byte words (the last one overlapping the one before
 * it when the length is not a multiple of 8; a name shorter than 8 bytes zero-padded), mixed. */
static inline uint64_t tn_hash(uint64_t seed, const unsigned char *p, size_t n)
{
	uint64_t h = seed ^ ((uint64_t)n * TN_FIN);
	if (n >= 8) {
		size_t i = 0;
		for (; i + 8 < n; i += 8) {
			h = (h ^ tn_word(p + i)) * TN_MUL;
			h ^= h >> 29;
		}
		h = (h ^ tn_word(p + n - 8)) * TN_MUL;
	} else {
		uint64_t v = 0;
		memcpy(&v, p, n);
		h = (h ^ v) * TN_MUL;
	}
	h ^= h >> 32;
	h *= TN_FIN;
	h ^= h >> 29;
	return h;
}

#define TN_CURSOR_BITS 10 /* 1,024 cursors: 16 runs interleaved rarely share one */

/* A name's cursor key: TN_CURSOR_BITS of a mix of its length and its last 8 bytes (up to 16
 * bytes: generated names, `node-00042`, differ at the end) or of all its 8-byte words, xored
 * (longer ones: `ip-10-0-3-17.eu-west-1.compute.internal` differs in the middle); zero-padded
 * when shorter than 8. (Two names with one key only cost a lookup in the hash table.) */
static inline uint16_t tn_key(const unsigned char *p, uint64_t n)
{
	uint64_t w = 0;
	if (n > 16) {
		for (uint64_t i = 0; i + 8 < n; i += 8)
			w ^= tn_word(p + i);
		w = (w * TN_FIN) ^ tn_word(p + n - 8);
	} else if (n >= 8) {
		w = tn_word(p + n - 8);
	} else {
		memcpy(&w, p, n);
	}
	return (uint16_t)(((w ^ n) * TN_MUL) >> (64 - TN_CURSOR_BITS));
}

/* tn_key of a name of 8 to 16 bytes whose last 8 bytes are `tail`. */
static inline uint16_t tn_key_of_tail(uint64_t tail, uint64_t n)
{
	return (uint16_t)(((tail ^ n) * TN_MUL) >> (64 - TN_CURSOR_BITS));
}

/* Whether any byte of the n at p is a backslash or a control character (one pass the compiler
 * vectorises). */
static int tn_any_escape(const unsigned char *p, uint64_t n)
{
	unsigned bad = 0;
	for (uint64_t i = 0; i < n; i++)
		bad |= (p[i] < 0x20) | (p[i] == '\\');
	return bad != 0;
}

uint32_t tn_abi(void)
{
	return TN_ABI;
}

void tn_free(tn_table *t)
{
	if (t == NULL)
		return;
	free(t->entries);
	if (t->blob != NULL)
		free(t->blob - TN_PAD);
	free(t->at);
	free(t);
}

/* Whether the name at `position` of the order is the n bytes at s. */
static inline int tn_is(const tn_table *t, uint64_t position, const unsigned char *s, uint64_t n)
{
	const tn_name *r = &t->at[position];
	if (r->length != n)
		return 0;
	if (n >= 8 && n <= 16)
		return r->head == tn_word(s) && r->tail == tn_word(s + n - 8);
	return memcmp(t->blob + r->head, s, n) == 0;
}

tn_table *tn_build(const unsigned char *names, const uint64_t *lengths, const int64_t *slots,
		   const int64_t *order, uint64_t count, uint64_t seed)
{
	if (count >= (1ULL << 31))
		return NULL;
	uint64_t total = 0;
	for (uint64_t i = 0; i < count; i++)
		total += lengths[i];
	if (total >= (1ULL << 32))
		return NULL;
	for (uint64_t i = 0; i < count; i++)
		if (lengths[i] > UINT16_MAX || slots[i] < 0 || slots[i] > INT32_MAX)
			return NULL;
	tn_table *t = calloc(1, sizeof *t);
	if (t == NULL)
		return NULL;
	uint64_t buckets = 16;
	while (buckets < 2 * count)
		buckets *= 2;
	uint64_t *start = malloc((count ? count : 1) * sizeof *start); /* by row, in `names` */
	uint8_t *placed = calloc(count ? count : 1, 1);
	t->entries = calloc(buckets, sizeof *t->entries);
	unsigned char *bytes = calloc(total + 2 * TN_PAD, 1);
	t->blob = bytes != NULL ? bytes + TN_PAD : NULL;
	t->at = malloc((count + 1) * sizeof *t->at);
	if (start == NULL || placed == NULL || t->entries == NULL || t->blob == NULL
	    || t->at == NULL)
		goto fail;
	for (uint64_t i = 0, at = 0; i < count; at += lengths[i], i++)
		start[i] = at;
	t->mask = buckets - 1;
	t->seed = seed;
	t->count = (uint32_t)count;
	uint64_t root = 0; /* (count < 2^31: its square root below 2^16) */
	for (uint64_t bit = 1ULL << 16; bit != 0; bit >>= 1)
		if ((root + bit) * (root + bit) <= count)
			root += bit;
	root = root < count / 16 + 1 ? root : count / 16 + 1;
	t->chunk = (uint32_t)(root > 0 ? root : 1);
	t->plain = 1;
	uint64_t offset = 0;
	uint16_t first_key = 0;
	for (uint64_t position = 0; position < count; position++) {
		int64_t row = order[position];
		if (row < 0 || (uint64_t)row >= count || placed[row])
			goto fail; /* not an order of the rows */
		placed[row] = 1;
		uint64_t n = lengths[row];
		unsigned char *name = t->blob + offset;
		memcpy(name, names + start[row], n);
		uint64_t h = tn_hash(seed, name, n);
		int words = n >= 8 && n <= 16; /* compared as its first and last 8 bytes */
		t->at[position] = (tn_name){
			.head = words ? tn_word(name) : offset,
			.tail = words ? tn_word(name + n - 8) : 0,
			.position = (uint32_t)position, .row = (int32_t)row,
			.slot = (int32_t)slots[row], .length = (uint16_t)n,
		};
		uint32_t tag = (uint32_t)(h >> 32);
		for (uint64_t i = h & t->mask;; i = (i + 1) & t->mask) {
			tn_entry *e = &t->entries[i];
			if (e->position == 0) {
				e->tag = tag;
				e->position = (uint32_t)position + 1;
				break;
			}
			if (e->tag == tag && tn_is(t, e->position - 1, name, n))
				goto fail; /* two rows with one name: not a table of distinct names */
		}
		uint16_t key = tn_key(name, n);
		if (position > 0)
			t->at[position - 1].next_key = key;
		else
			first_key = key;
		if (n > t->longest)
			t->longest = (uint32_t)n;
		if (tn_any_escape(name, n) || memchr(name, '"', n) != NULL)
			t->plain = 0;
		offset += n;
	}
	if (count > 0) {
		t->at[count - 1].next_key = first_key; /* (the order wraps) */
		t->at[count] = t->at[0];
	}
	free(start);
	free(placed);
	return t;
fail:
	free(start);
	free(placed);
	tn_free(t);
	return NULL;
}

/* Whether the n bytes at p equal the n bytes at q (n >= 1): two overlapping words up to 16
 * bytes (node names usually are), memcmp beyond. */
static inline int tn_same(const unsigned char *p, const unsigned char *q, uint64_t n)
{
	if (n >= 8 && n <= 16)
		return tn_word(p) == tn_word(q) && tn_word(p + n - 8) == tn_word(q + n - 8);
	return memcmp(p, q, n) == 0;
}

/* Whether any byte of the word is a `"`. */
static inline int tn_has_quote(uint64_t w)
{
	uint64_t v = w ^ 0x2222222222222222ULL;
	return ((v - 0x0101010101010101ULL) & ~v & 0x8080808080808080ULL) != 0;
}

/* The first `"` at or after s, before end; NULL if none. A name as long as the last one (8-64
 * bytes) is checked in place: its closing quote where expected and none in its bytes (words,
 * the last overlapping); otherwise memchr. */
static inline const unsigned char *tn_closing(const unsigned char *s, const unsigned char *end,
					      uint64_t guess)
{
	if (guess >= 8 && guess <= 64 && guess < (uint64_t)(end - s) && s[guess] == '"') {
		int quoted = tn_has_quote(tn_word(s + guess - 8));
		for (uint64_t i = 0; i + 8 < guess && !quoted; i += 8)
			quoted = tn_has_quote(tn_word(s + i));
		if (!quoted)
			return s + guess;
	}
	return memchr(s, '"', (size_t)(end - s));
}

/* The name after the one whose closing quote is at q (its first byte, and its length in
 * `*length`), when `,"name"` follows with a name of 1 to `longest` bytes before `end`; NULL
 * otherwise (the main loop then reads it, and refuses what it must). */
static inline const unsigned char *tn_next_name(const unsigned char *q, const unsigned char *end,
						uint64_t guess, uint64_t longest,
						uint64_t *length)
{
	if (end - q < 4 || q[1] != ',' || q[2] != '"')
		return NULL;
	const unsigned char *s = q + 3;
	const unsigned char *close = tn_closing(s, end, guess);
	if (close == NULL || close == s || (uint64_t)(close - s) > longest)
		return NULL;
	*length = (uint64_t)(close - s);
	return s;
}

/* The position of the name of n bytes at s (its hash h) in the table's order; -1 if none. A
 * bucket holds a tag and a position (8 bytes: the table half the memory it took with the
 * name's offset and length), and a name is compared with its record (`tn_is`: which the caller
 * reads next; a name of 8 to 16 bytes by its words, one cache miss fewer in a cold table than
 * its bytes in `blob`). */
static inline int64_t tn_find(const tn_table *t, const unsigned char *s, uint64_t n,
			      uint64_t h)
{
	uint32_t tag = (uint32_t)(h >> 32);
	for (uint64_t i = h & t->mask;; i = (i + 1) & t->mask) {
		const tn_entry *e = &t->entries[i];
		if (e->position == 0)
			return -1; /* an empty bucket before the name: unknown */
		if (e->tag == tag && tn_is(t, e->position - 1, s, n))
			return (int64_t)e->position - 1;
	}
}

#define TN_AHEAD 8 /* records: four cache lines */
#define TN_RECENT 32 /* positions read last, for learning a list's stride */
#define TN_LEARN 512 /* names of a list among which a stride is learnt */
#define TN_AGREE 4   /* names in a row proposing a stride before it is taken */

/* A name expected next in some run of the list (a cursor: `tn_cursor`, by key) is a copy of its
 * record (`tn_name`), set when the name before it in the order is read: the copy is two
 * loads off the path a list's next name waits on, and a name a cursor expects costs no load
 * of its record or its bytes in the order (two dependent cache misses in a cold table). */
typedef tn_name tn_cursor;

/* Expect the name at `position` of the order (up to `count`: the first again) next, in the
 * cursor of its key, `key`. */
static inline void tn_aim(const tn_table *t, tn_cursor *cursor, uint64_t position, uint16_t key)
{
	cursor[key] = t->at[position];
}

/* Whether the cursor expects the name of `len` bytes at s (`w0`, `w1`: its first and last 8
 * bytes when it has 8 or more). */
static inline int tn_expects(const tn_table *t, const tn_cursor *c, const unsigned char *s,
			     uint64_t len, uint64_t w0, uint64_t w1)
{
	if (c->length != len)
		return 0;
	if (len >= 8 && len <= 16)
		return c->head == w0 && c->tail == w1;
	/* (the bytes of this run's names a few on, on their way: a record holds no bytes) */
	__builtin_prefetch(t->blob + c->head + len + 64);
	return tn_same(t->blob + c->head, s, len);
}

#define TN_WORKERS 16 /* kube-scheduler's parallel filters (its default parallelism) */

/* A list's first name at `first` in the order: were it one of kube-scheduler's parallel
 * filters' lists, that name starts one of the chunks its `TN_WORKERS` workers start with, and
 * the others start up to `TN_WORKERS - 1` chunks before or after it: cursors expect them. */
static inline void tn_aim_starts(const tn_table *t, tn_cursor *cursor, uint64_t first,
				 uint64_t chunk)
{
	const uint64_t count = t->count;
	for (uint64_t m = 1, d = chunk; m < TN_WORKERS && d < count; m++, d += chunk) {
		uint64_t later = first + d >= count ? first + d - count : first + d;
		uint64_t earlier = first >= d ? first - d : first + count - d;
		tn_aim(t, cursor, later, t->at[later == 0 ? count - 1 : later - 1].next_key);
		tn_aim(t, cursor, earlier, t->at[earlier == 0 ? count - 1 : earlier - 1].next_key);
	}
}

/* The position of the chunk after the one that starts `furthest` past `first` (a multiple of
 * `chunk`), when it is in the order before `first` again; else UINT64_MAX. */
static inline uint64_t tn_chunk_after(uint64_t first, uint64_t furthest, uint64_t chunk,
				      uint64_t count)
{
	uint64_t from_first = furthest + chunk;
	if (from_first >= count)
		return UINT64_MAX;
	return first + from_first >= count ? first + from_first - count : first + from_first;
}

#define TN_LATELY 4

/* Which of the `TN_LATELY` positions of the order (0 to `count`) at `lately` holds the name of
 * n bytes at s; `TN_LATELY` if none. */
static inline uint64_t tn_among(const tn_table *t, const uint32_t *lately,
				const unsigned char *s, uint64_t n)
{
	for (uint64_t j = 0; j < TN_LATELY; j++)
		if (tn_is(t, lately[j], s, n))
			return j;
	return TN_LATELY;
}

#define TN_ROWS 1
#define TN_SLOTS 2

/* `value` written as the k-th element of `out`: an int64 when `wide`, else an int32. */
static inline void tn_put(void *out, uint64_t k, int32_t value, int wide)
{
	if (wide)
		((int64_t *)out)[k] = value;
	else
		((int32_t *)out)[k] = value;
}

/* The two bytes at p, as one 16-bit value (`TN_COMMA_QUOTE`: `,"`). */
static inline uint16_t tn_pair(const unsigned char *p)
{
	uint16_t v;
	memcpy(&v, p, sizeof v);
	return v;
}

#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define TN_COMMA_QUOTE ((uint16_t)(',' << 8 | '"'))
#else
#define TN_COMMA_QUOTE ((uint16_t)(',' | '"' << 8))
#endif

/* tn_resolve (`prefix` 0) and tn_resolve_prefix (`prefix` 1: the array ends at the first `]`
 * after a name's closing quote; its length to `*length`). */
static inline __attribute__((always_inline)) int64_t
tn_read(const tn_table *t, const unsigned char *a, uint64_t n, void *rows, void *slots,
	uint64_t capacity, const int prefix, uint64_t *length, const int outputs, int wide)
{
	if (t == NULL || t->count == 0 || n < 4 || a[0] != '[' || a[1] != '"'
	    || (!prefix && a[n - 1] != ']'))
		return -1;
	/* No escape, no control character anywhere: every `"` bounds a name, and a name's bytes
	 * are its text. When no name of the table holds a `"`, a backslash or a control character,
	 * a name that matches one byte for byte holds none, and every byte between two names is
	 * checked to be `,"` (or the closing `]`): no pass over the array is needed first. (A
	 * prefix's end is not known before it is read: only such a table reads one.) */
	if (!t->plain && (prefix || tn_any_escape(a, n)))
		return -1;
	const unsigned char *p = a + 1;       /* a name's opening quote */
	/* the `]` (a prefix: the end of the bytes; the `]` is found after a name) */
	const unsigned char *end = prefix ? a + n : a + n - 1;
	const tn_name *at = t->at;
	const uint64_t longest = t->longest, count = t->count, seed = t->seed;
	tn_cursor cursor[1 << TN_CURSOR_BITS]; /* by key: names expected next in some run */
	for (unsigned i = 0; i < (1u << TN_CURSOR_BITS); i++)
		cursor[i].length = 0; /* (no name is empty: expects none) */
	uint64_t guess = 0; /* the last name's length: names are often all as long */
	/* `end` while the table is plain and the last name 8 to 16 bytes long (a name as long
	 * is then read before any search for its closing quote), else the array's start */
	const unsigned char *quick_end = a;
	uint64_t k = 0;
	const unsigned char *ahead = NULL; /* the next name, when its hash was computed ahead */
	uint64_t ahead_hash = 0, ahead_length = 0;
	/* The list's stride in the order, learnt: a label's nodes are often every s-th node of
	 * the order (zones, racks, pools dealt out in turn); a name found in the table whose
	 * position is a few past one read recently sets it, and each name read then also sets a
	 * cursor that far on (`TN_RECENT` positions remembered). */
	uint64_t stride = 1, proposed = 1, agreed = 0;
	uint64_t missed = 0; /* names in a row not found by a cursor (up to the last such) */
	uint64_t last_miss = UINT64_MAX; /* k of the last name no cursor found */
	uint32_t recent[TN_RECENT];
	const int plain = t->plain;
	/* kube-scheduler's parallel filters take the order's nodes in chunks (`chunk`, from the
	 * start index on, the next chunk to whichever is done first), so a list of theirs is
	 * runs that start a chunk's length apart, each first name expected by no cursor: the
	 * list's first name starts a chunk; one no cursor expected a multiple of `chunk` on
	 * starts one; and the next to start is the one after the furthest started
	 * (`chunk_next`: compared before a lookup in the hash table, its cache misses). */
	const uint64_t chunk = t->chunk;
	uint64_t first = 0, chunk_furthest = 0, chunk_next = UINT64_MAX;
	/* The names after the last `TN_LATELY` found in the hash table (0 to `count`, that the
	 * first again; the first at the start): two runs whose names differ by a constant in some
	 * bytes have keys that collide name after name (`tn_key` is linear in the bytes), and
	 * each takes the other's cursors; a name no cursor expected, after one a cursor
	 * expected, is compared with these before a lookup in the hash table. */
	uint32_t lately[TN_LATELY] = { 0 };
	uint64_t lately_next = 0, lately_at;
	for (;;) {
		const unsigned char *s = p + 1;
		const unsigned char *q = s + guess;
		uint64_t len = guess;
		uint64_t w0 = 0, w1 = 0;
		tn_cursor *c = NULL;
		/* A name as long as the last one (8 to 16 bytes), where a `"` follows it, that the
		 * cursor of its key expects: that name, with no search for its closing quote (a name
		 * of the table holds no `"`, so neither do bytes equal to it). */
		if (q < quick_end && *q == '"') {
			w0 = tn_word(s);
			w1 = tn_word(q - 8);
			c = &cursor[tn_key_of_tail(w1, len)];
			if (((c->head ^ w0) | (c->tail ^ w1) | (c->length ^ len)) != 0)
				c = NULL;
		}
		if (c == NULL) {
			q = tn_closing(s, end, guess);
			if (q == NULL)
				return -1; /* no closing quote before the `]` */
			len = (uint64_t)(q - s);
			guess = len;
			quick_end = plain && len >= 8 && len <= 16 ? end : a;
			if (len == 0 || len > longest)
				return -1;
			if (len >= 8) {
				w0 = tn_word(s);
				w1 = tn_word(s + len - 8);
			}
			c = &cursor[tn_key(s, len)];
			if (!tn_expects(t, c, s, len, w0, w1))
				c = NULL;
		}
		if (k == capacity)
			return -2; /* more names than room for them */
		uint64_t position;
		uint16_t next_key;
		if (c != NULL) {
			next_key = c->next_key;
			/* the name after one already read */
			position = c->position;
			if (outputs & TN_ROWS)
				tn_put(rows, k, c->row, wide);
			if (outputs & TN_SLOTS)
				tn_put(slots, k, c->slot, wide);
		} else if (last_miss + 1 != k && chunk_next < count
			   && tn_is(t, chunk_next, s, len)) {
			position = chunk_next; /* (the stride's learning below is for lists the
						* cursors do not follow: not one of these) */
			next_key = at[position].next_key;
			if (outputs & TN_ROWS)
				tn_put(rows, k, at[position].row, wide);
			if (outputs & TN_SLOTS)
				tn_put(slots, k, at[position].slot, wide);
			chunk_furthest += chunk;
			chunk_next = tn_chunk_after(first, chunk_furthest, chunk, count);
		} else if (last_miss + 1 != k
			   && (lately_at = tn_among(t, lately, s, len)) < TN_LATELY) {
			/* (a run whose cursors another run's keys take, name after name) */
			position = at[lately[lately_at]].position; /* (`count`: the first) */
			lately[lately_at] = (uint32_t)position + 1;
			next_key = at[position].next_key;
			if (outputs & TN_ROWS)
				tn_put(rows, k, at[position].row, wide);
			if (outputs & TN_SLOTS)
				tn_put(slots, k, at[position].slot, wide);
		} else {
			uint64_t h = ahead == s && ahead_length == len ? ahead_hash : tn_hash(seed, s, len);
			/* A list the cursors do not follow (a label's nodes, a few of the order's
			 * each, or another order) looks every name up at random in the table: once
			 * two in a row are, the next name's bucket is asked for now, so its cache
			 * miss overlaps this one's (not after a name alone no cursor expected: a
			 * run's start, its next name expected). */
			ahead = last_miss + 1 == k ? tn_next_name(q, end, guess, longest,
								  &ahead_length)
						   : NULL;
			if (ahead != NULL) {
				ahead_hash = tn_hash(seed, ahead, ahead_length);
				__builtin_prefetch(&t->entries[ahead_hash & t->mask]);
			}
			int64_t found = tn_find(t, s, len, h);
			if (found < 0)
				return -1;
			position = (uint64_t)found;
			next_key = at[position].next_key;
			if (outputs & TN_ROWS)
				tn_put(rows, k, at[position].row, wide);
			if (outputs & TN_SLOTS)
				tn_put(slots, k, at[position].slot, wide);
			if (k == 0) {
				first = position;
				tn_aim_starts(t, cursor, first, chunk);
			}
			lately[lately_next++ % TN_LATELY] = (uint32_t)position + 1;
			/* (a chunk's first name comes after names cursors expected, and is tried
			 * only then: a list in another order, every name looked up, is spared) */
			uint64_t from_first = position >= first ? position - first
								: position + count - first;
			if (last_miss + 1 != k && from_first > chunk_furthest
			    && from_first % chunk == 0) {
				chunk_furthest = from_first;
				chunk_next = tn_chunk_after(first, chunk_furthest, chunk, count);
			}
			/* Two in a row: the cursors do not follow this list. Among its first
			 * TN_LEARN names, a stride proposed by TN_AGREE such names in a row is taken
			 * (a list in another order proposes one at random); more than TN_RECENT in a
			 * row even with a stride: it is dropped. */
			missed = last_miss + 1 == k ? missed + 1 : 1;
			last_miss = k;
			if (missed > TN_RECENT + 1) {
				stride = 1;
			} else if (missed > 1 && k < TN_LEARN) {
				uint64_t best = TN_RECENT + 1, known = k < TN_RECENT ? k : TN_RECENT;
				for (uint64_t j = 0; j < known; j++) {
					/* (a position below wraps high) */
					uint64_t d = position - recent[j];
					if (d > 0 && d < best)
						best = d;
				}
				/* (1: its run was read, the cursor overwritten) */
				agreed = best == proposed ? agreed + 1 : 1;
				proposed = best;
				if (best > 1 && best <= TN_RECENT && agreed >= TN_AGREE)
					stride = best;
			}
		}
		if (k < TN_LEARN)
			recent[k % TN_RECENT] = (uint32_t)position;
		k++;
		uint64_t next = position + 1; /* (`count`: the first again; a window may wrap) */
		tn_aim(t, cursor, next, next_key);
		if (stride > 1) {
			/* (1 to `count`: a stride is below `count`, and `count` is the first again) */
			uint64_t far = position + stride > count ? position + stride - count
								  : position + stride;
			tn_aim(t, cursor, far, at[far - 1].next_key);
			/* (this run's records a few names on: `TN_AHEAD` below is too few) */
			__builtin_prefetch((const void *)((uintptr_t)at
							  + (far + TN_AHEAD * stride) * sizeof *at));
		}
		/* this run's records and bytes a few names on, on their way (16 runs interleaved
		 * are more forward streams than the hardware follows) */
		/* (a prefetch past the records' end faults on nothing: not bounded) */
		__builtin_prefetch((const void *)((uintptr_t)at + (next + TN_AHEAD) * sizeof *at));
		p = q + 1;
		if (p + 1 < end && tn_pair(p) == TN_COMMA_QUOTE) {
			p++; /* `,"`: the next name's opening quote */
			continue;
		}
		if (prefix ? p < end && *p == ']' : p == end) {
			if (prefix)
				*length = (uint64_t)(p + 1 - a);
			return (int64_t)k;
		}
		return -1; /* not `,"` between two names */
	}
}

int64_t tn_resolve(const tn_table *t, const unsigned char *a, uint64_t n, void *rows,
		   void *slots, uint32_t width, uint64_t capacity)
{
	if (width != 4 && width != 8)
		return -1;
	int wide = width == 8;
	if (rows != NULL && slots != NULL)
		return tn_read(t, a, n, rows, slots, capacity, 0, NULL, TN_ROWS | TN_SLOTS, wide);
	if (rows != NULL)
		return tn_read(t, a, n, rows, slots, capacity, 0, NULL, TN_ROWS, wide);
	if (slots != NULL)
		return tn_read(t, a, n, rows, slots, capacity, 0, NULL, TN_SLOTS, wide);
	return tn_read(t, a, n, rows, slots, capacity, 0, NULL, 0, wide);
}

int64_t tn_resolve_in(const tn_table *t, const unsigned char *body, uint64_t n, uint64_t start,
		      void *rows, void *slots, uint32_t width, uint64_t capacity, uint64_t *end)
{
	uint64_t length = 0;
	if (end == NULL || start >= n || (width != 4 && width != 8))
		return -1;
	int wide = width == 8;
	const unsigned char *a = body + start;
	int64_t k;
	/* (slots alone, as the scheduler asks: a loop built per width, no test a name) */
	if (rows == NULL && slots != NULL && !wide)
		k = tn_read(t, a, n - start, rows, slots, capacity, 1, &length, TN_SLOTS, 0);
	else if (rows == NULL && slots != NULL)
		k = tn_read(t, a, n - start, rows, slots, capacity, 1, &length, TN_SLOTS, 1);
	else
		k = tn_read(t, a, n - start, rows, slots, capacity, 1, &length,
			    (rows != NULL ? TN_ROWS : 0) | (slots != NULL ? TN_SLOTS : 0), wide);
	if (k >= 0)
		*end = start + length;
	return k;
}
