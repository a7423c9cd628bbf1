/* The scheduler's fused passes for CPU tensors. First Triton's kernels of `fused_kernels.py`
 * (enter, look_up, evict, place, candidates, route), each a C function with the same arguments
 * in the same order (the constexpr flags last; BLOCK and STEPS are not needed), computing the
 * same values and leaving the same state: each Triton kernel was written so that its programs
 * may run in any order (every address one program writes is its own, or written by an atomic
 * add), and a loop over its entries in order is one such order. Then the passes only the CPU
 * fuses ("C only", each the torch ops or Triton kernels named beside it, the same values): the
 * batch's sort with its running count (for `_first`), the victims' selection (for `_boundary`,
 * `_ties` and `_take`), the candidates while free slots are left, a cache of every row's entry
 * and plan, a plan's end, the SGD step, the pooling into the module's output, the id checks
 * and the stager's row copies. Built and loaded by `fused_native.py`; plain C, no Python or
 * torch headers. */

#include <stdint.h>
#include <string.h>

typedef int32_t i32;
typedef int64_t i64;
typedef uint8_t u8;

/* The passes read and write maps of every row or slot at a batch's rows: each access a likely
 * cache miss, and each loop's next accesses known ahead. Prefetching them AHEAD entries early
 * keeps several misses in flight (where the compiler knows no prefetch, nothing is done). */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#define PREFETCH_W(address) __builtin_prefetch(address, 1)
#else
#define PREFETCH(address) ((void)(address))
#define PREFETCH_W(address) ((void)(address))
#endif
enum { AHEAD = 16 };

/* An engine row as the kernels that index maps by it read it: one outside [0, sentinel_row],
 * which only a caller that skips the id check can pass (the torch ops would fail on it), as the
 * sentinel row, so that no kernel addresses outside a map. */
static inline i64 row_or_sentinel(i64 id, i64 sentinel_row) {
    return id < 0 || id > sentinel_row ? sentinel_row : id;
}

/* A batch entering the window (`_enter`). */
void dc_enter(const i32 *ordered, const i64 *order, const i32 *count, const i32 *at, i32 *latest,
              i32 *next_use, const i32 *slot_of, i32 *slot_next_use, i64 *total, i64 *rows_out,
              i32 *inv_out, u8 *valid_out, i32 *pos_out, i64 n, i64 sentinel_row, i64 no_use) {
    const i32 seq = at[0], base = at[1];
    const i64 distinct = n ? count[n - 1] : 0;
    i64 counted = 0;
    for (i64 i = 0; i < n; i++) {
        if (i + 2 * AHEAD < n) {
            PREFETCH_W(&latest[ordered[i + 2 * AHEAD]]);
            PREFETCH(&slot_of[ordered[i + 2 * AHEAD]]);
        }
        if (i + AHEAD < n) { /* (their rows' entries were fetched above) */
            const i64 ahead = ordered[i + AHEAD];
            const i32 prev = latest[ahead], slot = slot_of[ahead];
            if (prev >= 0)
                PREFETCH_W(&next_use[prev]);
            if (slot >= 0)
                PREFETCH_W(&slot_next_use[slot]);
        }
        const i64 row = ordered[i];
        const int first = i == 0 || row != ordered[i - 1];
        const i32 r = count[i] - 1;
        inv_out[order[i]] = r;
        const int real = first && row != sentinel_row;
        if (real) {
            const i32 prev = latest[row];
            if (prev >= 0)
                next_use[prev] = seq;
            latest[row] = base + r;
            if (prev < 0) {
                const i32 slot = slot_of[row];
                if (slot >= 0)
                    slot_next_use[slot] = seq;
            }
        }
        if (first) {
            rows_out[r] = row;
            valid_out[r] = (u8)real;
        }
        if (i >= distinct) {
            rows_out[i] = sentinel_row;
            valid_out[i] = 0;
        }
        pos_out[i] = base + (i32)i;
        next_use[base + i] = (i32)no_use;
        const i64 after = i + 1 < n ? ordered[i + 1] : sentinel_row;
        if (row != sentinel_row && after == sentinel_row)
            counted += i + 1;
    }
    *total += counted;
}

/* A staging batch's rows leave the window and are looked up (`_look_up`). */
void dc_look_up(const i64 *rows, const i32 *positions, i32 *latest, const i32 *ring,
                const i32 *slot_of, i32 *pin, i32 *next_use_out, i32 *miss_out, i64 *hit_out,
                i64 n, i64 sentinel_slot) {
    for (i64 i = 0; i < n; i++) {
        if (i + 2 * AHEAD < n) {
            PREFETCH_W(&latest[rows[i + 2 * AHEAD]]);
            PREFETCH(&slot_of[rows[i + 2 * AHEAD]]);
        }
        if (i + AHEAD < n) {
            const i32 slot = slot_of[rows[i + AHEAD]];
            if (slot >= 0)
                PREFETCH_W(&pin[slot]);
        }
        const i64 row = rows[i];
        const i32 pos = positions[i];
        next_use_out[i] = ring[pos];
        if (latest[row] == pos)
            latest[row] = -1;
        const i64 slot = slot_of[row];
        const int miss = slot < 0;
        const i64 hit = miss ? sentinel_slot : slot;
        miss_out[i] = miss;
        hit_out[i] = hit;
        if (hit != sentinel_slot)
            pin[hit] += 1;
    }
}

/* The victims' rows evicted (`_evict`). */
void dc_evict(const i64 *victims, const i64 *row_of, i32 *slot_of, u8 *dirty, i64 *old_out,
              u8 *evicted_out, u8 *writeback_out, i64 n, i64 capacity) {
    for (i64 v = 0; v < n; v++) {
        if (v + 2 * AHEAD < n) {
            PREFETCH(&row_of[victims[v + 2 * AHEAD]]);
            PREFETCH_W(&dirty[victims[v + 2 * AHEAD]]);
        }
        if (v + AHEAD < n) {
            const i64 old = row_of[victims[v + AHEAD]];
            if (old >= 0)
                PREFETCH_W(&slot_of[old]);
        }
        const i64 victim = victims[v];
        const i64 old = row_of[victim];
        const int evicted = victim < capacity && old >= 0;
        const int writeback = evicted && dirty[victim] != 0;
        if (evicted)
            slot_of[old] = -1;
        dirty[victim] = 0;
        old_out[v] = old;
        evicted_out[v] = (u8)evicted;
        writeback_out[v] = (u8)writeback;
    }
}

/* Each row of a staging batch takes its slot (`_place`); `uses` with `use_counts` only. */
void dc_place(const i64 *rows, const i32 *miss, const i32 *count, const i64 *hit,
              const i64 *victims, const i64 *taken, const i32 *next_use, i32 *slot_of,
              i64 *row_of, i32 *pin, i32 *slot_next_use, i64 *slot_out, u8 *got_out,
              i64 *loads_out, i32 *uses, i64 n, i64 size, i64 sentinel_slot, i64 use_counts) {
    const i64 limit = *taken;
    for (i64 i = 0; i < n; i++) {
        if (i + AHEAD < n) { /* a hit's slot, or where a miss's victim is kept */
            const i64 ahead = miss[i + AHEAD] ? victims[count[i + AHEAD] - 1 < size
                                                            ? count[i + AHEAD] - 1 : size]
                                              : hit[i + AHEAD];
            PREFETCH_W(&slot_next_use[ahead]);
            PREFETCH_W(&pin[ahead]);
            PREFETCH_W(&row_of[ahead]);
            if (use_counts)
                PREFETCH_W(&uses[ahead]);
            PREFETCH_W(&slot_of[rows[i + AHEAD]]);
        }
        const i64 k = (i64)count[i] - 1;
        const int got = miss[i] != 0 && k < limit;
        const i64 slot = got ? victims[k < 0 ? 0 : (k > size ? size : k)] : hit[i];
        const i64 row = rows[i];
        if (got) {
            slot_of[row] = (i32)slot;
            row_of[slot] = row;
            pin[slot] += 1;
            loads_out[k] = row;
        }
        if (slot != sentinel_slot)
            slot_next_use[slot] = next_use[i];
        slot_out[i] = slot;
        got_out[i] = (u8)got;
        if (use_counts) {
            if (got)
                uses[slot] = 1;
            else if (slot != sentinel_slot)
                uses[slot] += 1;
        }
    }
}

/* The look-ahead policy's key of a loaded slot (`LookaheadPolicy.keys`): its next use's
 * distance from batch `seq` (at most `far`), then how rarely the cache's batches used it. */
static inline i32 lookahead_key(const i32 *next_use, const i32 *uses, i64 slot, i64 seq,
                                i64 far, i64 use_bits, i64 top) {
    i64 distance = (i64)next_use[slot] - seq;
    distance = distance < 0 ? 0 : (distance > far ? far : distance);
    const i64 used = uses[slot] < top ? uses[slot] : top;
    return (i32)((distance << use_bits) | (top - used));
}

/* The look-ahead policy's candidates once the cache is full (`_candidates`). */
void dc_candidates(const i64 *hand, const i32 *seq_at, const i32 *pin, const i32 *next_use,
                   const i32 *uses, i64 *slots_out, i32 *keys_out, i32 *hist, i64 *hand_out, i64 m,
                   i64 capacity, i64 sentinel_slot, i64 far, i64 use_bits, i64 top, i64 sweep) {
    const i64 start = sweep ? *hand : 0;
    const i64 seq = *seq_at;
    i64 slot = start;
    for (i64 c = 0; c < m; c++, slot++) {
        if (slot >= capacity)
            slot -= capacity;
        const i32 key =
            pin[slot] != 0 ? -1 : lookahead_key(next_use, uses, slot, seq, far, use_bits, top);
        keys_out[c] = key;
        slots_out[c] = slot;
        hist[key + 1] += 1;
    }
    slots_out[m] = sentinel_slot;
    if (sweep)
        *hand_out = slot >= capacity ? slot - capacity : slot;
}

/* The look-ahead policy's candidates while the cache may have free slots (C only: the torch
 * ops of `Victims.choose` with `free`, the same slots, keys and histogram). Slots [fill,
 * capacity) are free and key `top_key` (every loaded slot's at most), unless pinned. With
 * `sweep`: the next `size` free slots (past the capacity: `trash_slot`, not offered), then
 * `scan` slots swept from `hand` (moved past them), offered where loaded; else every slot.
 * `slots_out` `[m + 1]` (then the sentinel slot), `keys_out` `[m]` (-1: not offered). */
void dc_candidates_free(i64 *hand, const i64 *fill_at, const i32 *seq_at, const i32 *pin,
                        const i32 *next_use, const i32 *uses, i64 *slots_out, i32 *keys_out,
                        i32 *hist, i64 size, i64 scan, i64 capacity, i64 sentinel_slot,
                        i64 trash_slot, i64 far, i64 use_bits, i64 top, i64 sweep) {
    const i64 fill = *fill_at, seq = *seq_at;
    const i32 top_key = (i32)((far << use_bits) | top);
    i64 c = 0;
    if (!sweep) {
        for (; c < capacity; c++) {
            const i32 key = pin[c] != 0 ? -1
                            : c >= fill ? top_key
                                        : lookahead_key(next_use, uses, c, seq, far, use_bits, top);
            slots_out[c] = c;
            keys_out[c] = key;
            hist[key + 1] += 1;
        }
    } else {
        for (; c < size; c++) {
            const i64 slot = fill + c;
            const int offered = slot < capacity && pin[slot] == 0;
            slots_out[c] = slot < capacity ? slot : trash_slot;
            keys_out[c] = offered ? top_key : -1;
            hist[offered ? top_key + 1 : 0] += 1;
        }
        i64 slot = *hand;
        for (i64 k = 0; k < scan; k++, c++, slot++) {
            if (slot >= capacity)
                slot -= capacity;
            const i32 key = slot >= fill || pin[slot] != 0
                                ? -1
                                : lookahead_key(next_use, uses, slot, seq, far, use_bits, top);
            slots_out[c] = slot;
            keys_out[c] = key;
            hist[key + 1] += 1;
        }
        *hand = slot >= capacity ? slot - capacity : slot;
    }
    slots_out[c] = sentinel_slot;
}

/* A batch's routing into a cache whose one group serves every feature (`_route`). The bag of
 * id i is the number of bag ends at most i (Triton's binary search), found here by walking the
 * bags alongside the ids: offsets do not decrease, so it only moves forward. Unlike Triton's,
 * an id out of its table's range goes to the sentinel row without `check_ids` too (uncounted):
 * the later kernels index maps by the routed rows, and C has no bounds check to fail instead
 * (the torch ops raise there; a GPU's kernels fault). */
void dc_route(const i64 *values, const i64 *offsets, const i64 *rows, const i64 *row_offset,
              i64 *ids_out, i64 *bag_out, i64 *check, i64 n, i64 num_bags, i64 batch_size,
              i64 num_features, i64 sentinel_row, i64 check_ids, i64 padded) {
    i64 bag = 0, invalid = 0;
    for (i64 i = 0; i < n; i++) {
        while (bag < num_bags && offsets[bag + 1] <= i)
            bag++;
        i64 feature = bag / batch_size;
        feature = feature < num_features - 1 ? feature : num_features - 1;
        const i64 value = values[i];
        int bad = padded && bag >= num_bags;
        if (value < 0 || value >= rows[feature]) {
            invalid++;
            bad = 1;
        }
        ids_out[i] = bad ? sentinel_row : value + row_offset[feature];
        bag_out[i] = bag;
    }
    if (check_ids)
        *check += invalid;
}

/* `[n]` int32 `ids` sorted (each as `row_or_sentinel` reads it): `ordered` ascending and `order`
 * (int64) the position of each in `ids`, equal ids in the order they came (what `torch.sort`
 * returns, up to the order of equal ids, which no pass reads), and `count[i]` the distinct ids
 * among ordered[: i + 1]. A radix sort of 11-bit digits, from the lowest, skipping the digits
 * all ids share; `scratch_keys` and `scratch_order` hold n entries each. */
void dc_sort(const i32 *ids, i32 *ordered, i64 *order, i32 *count, i32 *scratch_keys,
             i64 *scratch_order, i64 n, i64 sentinel_row) {
    enum { BITS = 11, BINS = 1 << BITS };
    i64 bins[BINS];
    i32 any = 0, all = -1;
    for (i64 i = 0; i < n; i++) {
        const i32 id = (i32)row_or_sentinel(ids[i], sentinel_row);
        any |= id;
        all &= id;
        ordered[i] = id;
        order[i] = i;
    }
    i32 *keys = ordered, *other_keys = scratch_keys;
    i64 *at = order, *other_at = scratch_order;
    for (int shift = 0; shift < 31; shift += BITS) {
        const i32 mask = BINS - 1;
        if ((((any ^ all) >> shift) & mask) == 0)
            continue; /* every id has this digit */
        for (int b = 0; b < BINS; b++)
            bins[b] = 0;
        for (i64 i = 0; i < n; i++)
            bins[(keys[i] >> shift) & mask]++;
        i64 sum = 0;
        for (int b = 0; b < BINS; b++) {
            const i64 c = bins[b];
            bins[b] = sum;
            sum += c;
        }
        for (i64 i = 0; i < n; i++) {
            const i64 to = bins[(keys[i] >> shift) & mask]++;
            other_keys[to] = keys[i];
            other_at[to] = at[i];
        }
        i32 *k = keys; keys = other_keys; other_keys = k;
        i64 *a = at; at = other_at; other_at = a;
    }
    if (keys != ordered)
        for (i64 i = 0; i < n; i++) {
            ordered[i] = keys[i];
            order[i] = at[i];
        }
    i32 distinct = 0; /* `count`: Triton's `_first` and its running count, at once */
    for (i64 i = 0; i < n; i++) {
        distinct += i == 0 || ordered[i] != ordered[i - 1];
        count[i] = distinct;
    }
}

/* `select.select_counted` in one pass (C only; Triton's `_boundary`, `_ties` and `_take` with
 * the running counts and the compaction): `picked` `[size]` the first `size` selected indices,
 * then m; `line`: boundary, need, taken, candidates. The boundary is found from the top class
 * down, so only the classes above it are read: the largest class c such that fewer than `want`
 * keys lie above it (the first class whose running count exceeds candidates - want). */
void dc_select(const i32 *keys, const i32 *hist, const i64 *want, i64 *picked, i64 *line, i64 m,
               i64 classes, i64 size) {
    const i64 candidates = m - hist[0]; /* (bin 0: the keys of -1) */
    const i64 wanted = *want;
    i64 above = 0, boundary = classes - 1, need = wanted;
    for (i64 c = classes - 1; c >= 0 && above < wanted; c--) {
        boundary = c;
        need = wanted - above;
        above += hist[c + 1];
    }
    const i32 b = (i32)boundary;
    i64 ties = 0, k = 0;
    for (i64 c = 0; c < m && k < size; c++) {
        const i32 key = keys[c];
        if (key > b || (key == b && ++ties <= need))
            picked[k++] = c;
    }
    for (; k < size; k++)
        picked[k] = m;
    line[0] = boundary;
    line[1] = need;
    line[2] = wanted < candidates ? wanted : candidates;
    line[3] = candidates;
}

/* A batch entering the window of a cache of every row (`Window.distinct_device`, C only), and
 * its ids that are not the sentinel row added to `total`: each id writes its position into its
 * row's `latest` entry, in order (the last occurrence wins, as torch's scatter leaves it), and
 * the occurrence found there represents the row. */
void dc_distinct(const i64 *ids, const i32 *at, i32 *latest, i64 *total, i64 *rows_out,
                 i32 *rep_out, u8 *valid_out, i32 *pos_out, i64 n, i64 sentinel_row) {
    for (i64 i = 0; i < n; i++) {
        if (i + AHEAD < n)
            PREFETCH_W(&latest[row_or_sentinel(ids[i + AHEAD], sentinel_row)]);
        latest[row_or_sentinel(ids[i], sentinel_row)] = (i32)i;
    }
    const i32 base = at[1];
    i64 counted = 0;
    for (i64 i = 0; i < n; i++) {
        if (i + AHEAD < n)
            PREFETCH(&latest[row_or_sentinel(ids[i + AHEAD], sentinel_row)]);
        const i64 id = row_or_sentinel(ids[i], sentinel_row);
        const i32 rep = latest[id];
        const int real = id != sentinel_row;
        const int valid = real && rep == i;
        rows_out[i] = valid ? id : sentinel_row;
        rep_out[i] = rep;
        valid_out[i] = (u8)valid;
        pos_out[i] = base + (i32)i;
        counted += real;
    }
    *total += counted;
}

/* The SGD step of a batch's rows (C only; `CacheEngine.apply_gradients`'s torch ops for fp32
 * rows: each id's step, its bag's gradient times -lr, times its weight where it has one, added
 * to its slot's row in id order, as `index_add_` adds them; the same float32 operations in the
 * same order, so the same bits). `bag_of_id` is read where `pooled`, `id_weights` where
 * `weighted`; where `batch_major`, `bag_grad` is `dc_pool`'s output layout. */
void dc_sgd(float *weights, const float *bag_grad, const i64 *bag_of_id, const float *id_weights,
            const i64 *id_slots, i64 n, i64 dim, double lr, i64 batch, i64 features, i64 pooled,
            i64 weighted, i64 batch_major) {
    const float scale = (float)-lr;
    /* batch_major: bag f * batch + b's gradient is row b * features + f of `bag_grad` */
    i64 bag = -1, f = 0, b = -1;
    for (i64 i = 0; i < n; i++) {
        if (i + AHEAD < n)
            PREFETCH_W(&weights[id_slots[i + AHEAD] * dim]);
        i64 row = pooled ? bag_of_id[i] : i;
        if (pooled && batch_major) {
            if (row == bag + 1) { /* the next bag (ids come bag by bag) */
                if (++b == batch) {
                    b = 0;
                    f++;
                }
            } else if (row != bag) {
                f = row / batch;
                b = row - f * batch;
            }
            bag = row;
            row = b * features + f;
        }
        const float *g = bag_grad + row * dim;
        float *w = weights + id_slots[i] * dim;
        if (weighted) {
            const float by = id_weights[i];
            for (i64 d = 0; d < dim; d++) {
                const float step = g[d] * scale;
                w[d] += step * by;
            }
        } else {
            for (i64 d = 0; d < dim; d++)
                w[d] += g[d] * scale;
        }
    }
}

/* A staged batch's rows summed per bag straight into the module's output (C only:
 * `fused.pool`): bag j, feature f = j / batch's bag b, into row b, columns [f * dim, (f + 1) *
 * dim) of a [batch, features * dim] output; torch's `embedding_bag` ('sum', no weights: from 0,
 * the bag's rows added in order) and the transpose into the output in one pass, the same float
 * additions. Where `divide`, each bag's sum is divided by divisor[j] (mean bags). */
void dc_pool(const float *weights, const i64 *id_slots, const i64 *offsets, const float *divisor,
             float *out, i64 batch, i64 features, i64 dim, i64 divide) {
    float *dst = out; /* row by row of the output: bag f * batch + b at row b, column f * dim */
    for (i64 b = 0; b < batch; b++) {
        for (i64 f = 0; f < features; f++, dst += dim) {
            const i64 j = f * batch + b;
            for (i64 d = 0; d < dim; d++)
                dst[d] = 0.0f;
            for (i64 i = offsets[j]; i < offsets[j + 1]; i++) {
                const float *src = weights + id_slots[i] * dim;
                for (i64 d = 0; d < dim; d++)
                    dst[d] += src[d];
            }
            if (divide)
                for (i64 d = 0; d < dim; d++)
                    dst[d] = dst[d] / divisor[j];
        }
        if (b + 1 < batch) /* the next row's rows, as this one's are summed */
            for (i64 f = 0; f < features; f++) {
                const i64 j = f * batch + b + 1;
                if (offsets[j] < offsets[j + 1])
                    PREFETCH(&weights[id_slots[offsets[j]] * dim]);
            }
    }
}

/* A batch's ids checked against their tables before they are routed (C only: `fused.check`,
 * `ids.find_invalid_per_feature` and the replacement of the invalid ids by 0): `values` in
 * feature-major order, `ids_per_key[k]` of them feature k's, valid in [0, rows[k]); `checked`
 * the ids with each invalid one 0, their count added to `count`. */
void dc_check(const i64 *values, const i64 *ids_per_key, const i64 *rows, i64 *checked,
              i64 *count, i64 n, i64 keys) {
    i64 i = 0, invalid = 0;
    for (i64 k = 0; k <= keys; k++) {
        /* (past the last key: ids the lengths do not cover, which no table holds) */
        const i64 end = k < keys ? i + ids_per_key[k] : n, bound = k < keys ? rows[k] : 0;
        for (; i < end && i < n; i++) {
            const i64 value = values[i];
            const int bad = value < 0 || value >= bound;
            checked[i] = bad ? 0 : value;
            invalid += bad;
        }
    }
    *count += invalid;
}

/* A batch's lengths and ids checked at once (C only: `fused.check_batch`): the lengths
 * (int64 where `wide`, else int32) of each of `keys` keys' `stride` bags summed into
 * ids_per_key; summary[0] their total, summary[1] 1 if one is negative; then, where they add
 * up to the n ids and none is negative, the ids outside their key's rows counted into
 * summary[2] (`dc_check`'s count, none replaced: the caller does that where there are some). */
void dc_check_batch(const void *lengths, const i64 *values, const i64 *rows, i64 *ids_per_key,
                    i64 *summary, i64 wide, i64 n, i64 keys, i64 stride) {
    const i64 *lengths64 = (const i64 *)lengths;
    const i32 *lengths32 = (const i32 *)lengths;
    i64 total = 0, negative = 0, at = 0;
    for (i64 k = 0; k < keys; k++) {
        i64 sum = 0;
        for (i64 b = 0; b < stride; b++, at++) {
            const i64 length = wide ? lengths64[at] : (i64)lengths32[at];
            negative |= length < 0;
            sum += length;
        }
        ids_per_key[k] = sum;
        total += sum;
    }
    summary[0] = total;
    summary[1] = negative;
    if (total != n || negative)
        return;
    i64 i = 0, invalid = 0;
    for (i64 k = 0; k < keys; k++) {
        const i64 end = i + ids_per_key[k], bound = rows[k];
        for (; i < end; i++)
            invalid += values[i] < 0 || values[i] >= bound;
    }
    summary[2] += invalid;
}

/* Rows copied between two row-major tables of `width`-byte rows (C only: `fused.move`, the
 * stager's copies on CPU): row src_rows[k] of `src` to row dst_rows[k] of `dst`, k < count. */
void dc_move(const u8 *src, const i64 *src_rows, u8 *dst, const i64 *dst_rows, i64 count,
             i64 width) {
    for (i64 k = 0; k < count; k++) {
        if (k + AHEAD < count) {
            PREFETCH(src + src_rows[k + AHEAD] * width);
            PREFETCH_W(dst + dst_rows[k + AHEAD] * width);
        }
        memcpy(dst + dst_rows[k] * width, src + src_rows[k] * width, (size_t)width);
    }
}

enum { NUM_COUNTS = 7 }; /* a plan's counts: `scheduler.NUM_COUNTS` */

/* A plan's unique rows (its `valid` ones among `m`), and each id's slot: `slot[inv[j]]`. */
static i64 slots_of_ids(const u8 *valid, i64 m, const i64 *slot, const i32 *inv, i64 num_ids,
                        i64 *id_slots) {
    i64 unique = 0;
    for (i64 i = 0; i < m; i++)
        unique += valid[i] != 0;
    for (i64 j = 0; j < num_ids; j++)
        id_slots[j] = slot[inv[j]];
    return unique;
}

/* A plan's counts written to `counts` and added to `totals`. */
static void count_plan(const i64 *plan, i64 *counts, i64 *totals) {
    for (int c = 0; c < NUM_COUNTS; c++) {
        counts[c] = plan[c];
        totals[c] += plan[c];
    }
}

/* The end of a staging batch's plan (C only: `fused.finish`, `Scheduler._stage_device`'s last
 * torch ops): each id's slot (`slot[inv[j]]`), the dirty victims' rows and slots packed (the
 * first `size`, then the sentinel victim's, entry `size`: `nonzero_static`'s padding), and the
 * plan's counts (unique rows, misses, victims taken, write-backs, evictions, candidates, free
 * slots: `NUM_COUNTS`), which are also added to `totals`. */
void dc_finish(const u8 *valid, const i64 *slot, const i32 *inv, const u8 *writeback,
               const u8 *evicted, const i64 *old, const i64 *victims, const i64 *want,
               const i64 *taken, const i64 *candidates, const i64 *fill, i64 *id_slots,
               i64 *writeback_rows, i64 *writeback_slots, i64 *counts, i64 *totals, i64 m,
               i64 num_ids, i64 size, i64 capacity) {
    const i64 unique = slots_of_ids(valid, m, slot, inv, num_ids, id_slots);
    i64 written = 0, evictions = 0, k = 0;
    for (i64 v = 0; v <= size; v++) {
        if (writeback[v]) {
            if (k < size) {
                writeback_rows[k] = old[v];
                writeback_slots[k] = victims[v];
                k++;
            }
            written++;
        }
        evictions += evicted[v] != 0;
    }
    for (; k < size; k++) {
        writeback_rows[k] = old[size];
        writeback_slots[k] = victims[size];
    }
    const i64 plan[NUM_COUNTS] = {
        unique, *want, *taken, written, evictions, *candidates, capacity - *fill,
    };
    count_plan(plan, counts, totals);
}

/* `dc_finish` for a cache of every row (C only: `fused.finish_whole`, `Scheduler._stage_whole`):
 * each id's slot, its row (`rows[inv[j]]`), and the plan's counts, its unique rows alone, also
 * added to `totals`. */
void dc_finish_whole(const u8 *valid, const i64 *rows, const i32 *inv, i64 *id_slots,
                     i64 *counts, i64 *totals, i64 m, i64 num_ids) {
    const i64 plan[NUM_COUNTS] = {slots_of_ids(valid, m, rows, inv, num_ids, id_slots)};
    count_plan(plan, counts, totals);
}
