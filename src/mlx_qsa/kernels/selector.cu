//// kernel: score
// Decode/short-row selector, pass 1: block scores and per-warp summaries (QSA.md §8.2).
// index_q [1, HI, S, 128] bf16 (the layer's layout), pooled [1, cap, 128] bf16, pos [S] int32
// -> adj [S, npad] float32 (only b < nb(row) written; npad = cap rounded up to 128),
//    summ [S, npad / 32, L] uint32: the L largest order keys of each 32-block chunk, descending
//    (0 = no block), nbs [S] int32: nb(row) = min((p + 1) / RATIO, cap).
// One thread per block key, looping over the rows (S * HI <= 64); CTAs of NT threads.
// A CTA's NT key rows reach shared memory by cp.async in coalesced 16-byte pieces (a thread
// reading its own 256-byte row fetches twice the sectors it uses and holds 64 registers of
// it); rows are padded to 136 bf16 so the 16-byte reads of 8 consecutive threads hit distinct
// banks. The dot products keep their order (d = 0..127), so the bits are unchanged.
// With QSA_FUSED (one launch: inputs + ctr [2] int32 of a zeroed pool, outputs + the top-k's),
// the last S CTAs to finish scoring each take one row and run the `select` section below on
// it: the selector is one MLX primitive instead of two, with the same bits.
// With QSA_SPLIT_HEADS each block key takes HI threads (see there; opt-in, selector.py).
// Template: HI, RATIO, L, NT; dynamic shared memory score_smem_bytes(NT) (selector.py).
constexpr int DI = 128, KS = DI + 8;
#ifdef QSA_SPLIT_HEADS
// HI threads per block key, one per indexer head (NB = NT / HI keys per CTA): each thread's dot
// product is one head's, d = 0..127 in order, and the first lane of the key's HI sums the heads
// in order h = 0..HI-1, so the scores are the one-thread form's bits with 1 / HI of its chain.
// The chunk summaries go through shared memory (a 32-key chunk spans HI warps). Query rows are
// padded to DI + 4 floats so the HI heads of a key read distinct banks.
constexpr int QROW = DI + 4, NB = NT / HI;
static_assert(HI == 2 || HI == 4 || HI == 8, "HI must divide a warp");
#else
constexpr int QROW = DI, NB = NT;  // one thread per block key
#endif
#ifdef QSA_STAMPS
const long long qsa_clk0 = clock64();  // diagnostics: see the `select` section's QSA_STAMP
#endif
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
float* qs = reinterpret_cast<float*>(qsa_dyn_smem);  // qs[(r * HI + h) * QROW + d], 64 rows
__nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(qsa_dyn_smem + 64 * QROW * 4);  // [NB][KS]
__shared__ int nbs_s[64];
const int tid = threadIdx.x;
const int S = index_q_shape[2];
const int cap = pooled_shape[1];
const long long npad = ((long long)cap + 127) / 128 * 128;
const int b0 = blockIdx.x * NB;
// The CTA's key rows and the queries are requested before the rows' positions are read: the
// copies do not wait for that read (Nsight Compute had two thirds of the pass's warp samples
// waiting on it, H100, 128K). Rows past the context are fetched too (at most the backing's
// spare capacity) and never scored.
const int crow = max(0, min(NB, cap - b0));
const int p_own = tid < S ? pos[tid] : -1;  // S <= 64 <= NT: one row's position a thread
for (int i = tid; i < NB * (DI / 8); i += blockDim.x) {
  const int kr = i / (DI / 8), c = i % (DI / 8);
  const bool ok = kr < crow;
  qsa::cp_async16(ks + kr * KS + c * 8, pooled + (long long)(b0 + (ok ? kr : 0)) * DI + c * 8, ok);
}
// The queries, QB loads of a thread in flight at once (a load-then-store loop would wait one
// round trip per element), overlapping the copies.
constexpr int QB = 8;
const int nq = S * HI * DI;
for (int i0 = 0; i0 < nq; i0 += QB * NT) {
  float v[QB];
#pragma unroll
  for (int j = 0; j < QB; ++j) {
    const int i = i0 + j * NT + tid;
    const int r = i / (HI * DI), h = (i / DI) % HI, d = i % DI;
    v[j] = i < nq ? qsa::bf_to_f(index_q[((long long)h * S + r) * DI + d]) : 0.f;
  }
#pragma unroll
  for (int j = 0; j < QB; ++j) {
    const int i = i0 + j * NT + tid;
    if (i < nq) qs[i + (QROW - DI) * (i / DI)] = v[j];
  }
}
if (tid < S) {
  const int nb = p_own >= 0 ? (p_own + 1) / RATIO : 0;
  nbs_s[tid] = nb < cap ? nb : cap;
  if (blockIdx.x == 0) nbs[tid] = nbs_s[tid];
}
qsa::cp_async_wait_all();  // every CTA waits for its own copies, even one past the context
__syncthreads();
int maxnb = 0;
for (int r = 0; r < S; ++r) maxnb = max(maxnb, nbs_s[r]);
if (b0 < maxnb) {  // else the whole CTA is past every row's blocks (uniform: barriers are safe)
#ifdef QSA_SPLIT_HEADS
  __shared__ unsigned keys_s[NB];
  const int kb = tid / HI, hh = tid % HI, b = b0 + kb;
  const __nv_bfloat16* krow = ks + kb * KS;
  for (int r = 0; r < S; ++r) {
    const bool ok = b < nbs_s[r];
    float acc = 0.f;
    if (ok) {
      const float* qh = qs + (r * HI + hh) * QROW;
#pragma unroll 4
      for (int c = 0; c < DI / 8; ++c) {
        float kf[8];
        qsa::unpack8(*reinterpret_cast<const uint4*>(krow + c * 8), kf);
        acc = qsa::fma8(acc, qh + c * 8, kf);
      }
    }
    float heads[HI];
#pragma unroll
    for (int h = 0; h < HI; ++h) heads[h] = __shfl_down_sync(qsa::FULL_MASK, acc, h, HI);
    unsigned key = 0u;
    if (ok && hh == 0) {
      const float a = qsa::adjusted_score(qsa::relu_head_sum<HI>(heads), b);
      adj[r * npad + b] = a;
      key = qsa::ord_key(a);
    }
    if (hh == 0) keys_s[kb] = key;
    __syncthreads();
    const int w = tid >> 5;
    if (w < NB / 32 && b0 + w * 32 < maxnb) {  // warp w: the summaries of the CTA's chunk w
      qsa::warp_top_keys<L>(keys_s[w * 32 + (tid & 31)],
                            summ + (r * (npad / 32) + (b0 >> 5) + w) * L);
    }
    __syncthreads();
  }
#else
  const int b = b0 + tid;
  if ((b & ~31) < maxnb) {  // else the whole warp is past every row's blocks
    const __nv_bfloat16* krow = ks + tid * KS;
    const int chunk = b >> 5;
    for (int r = 0; r < S; ++r) {
      const bool ok = b < nbs_s[r];
      unsigned key = 0u;
      if (ok) {
        float acc[HI];
#pragma unroll
        for (int h = 0; h < HI; ++h) acc[h] = 0.f;
        // dot products in float32, d = 0..127 in order, from bf16 operands
#pragma unroll 4
        for (int c = 0; c < DI / 8; ++c) {
          float kf[8];
          qsa::unpack8(*reinterpret_cast<const uint4*>(krow + c * 8), kf);
#pragma unroll
          for (int h = 0; h < HI; ++h) acc[h] = qsa::fma8(acc[h], qs + (r * HI + h) * DI + c * 8, kf);
        }
        const float a = qsa::adjusted_score(qsa::relu_head_sum<HI>(acc), b);
        adj[r * npad + b] = a;
        key = qsa::ord_key(a);
      }
      qsa::warp_top_keys<L>(key, summ + (r * (npad / 32) + chunk) * L);
    }
  }
#endif
}
#ifdef QSA_FUSED
// Hand-off: every CTA takes a ticket once its scores and summaries are out; the last S take one
// row each and wait for the rest (at most S - 1 < 8 CTAs spin, and only for CTAs that took
// earlier tickets or are still scoring, so they cannot starve them). The last of them past its
// wait zeroes the counter slot again for the next launch on the stream.
__shared__ int ticket_s;
#ifdef QSA_STAMPS
const long long qsa_clk1 = clock64();
#endif
__threadfence();
__syncthreads();
if (tid == 0) ticket_s = atomicAdd(const_cast<int*>(ctr), 1);
__syncthreads();
const int row = ticket_s - ((int)gridDim.x - S);
if (row < 0) return;
if (tid == 0) {
  int* c = const_cast<int*>(ctr);
  while (qsa::ld_acquire(c) < (int)gridDim.x) __nanosleep(32);
  if (atomicAdd(c + 1, 1) == S - 1) {
    c[0] = 0;
    c[1] = 0;
  }
}
__syncthreads();
const int p = pos[row];
const int nb = nbs_s[row];
const int lane = tid & 31;
#ifdef QSA_STAMPS
if (tid == 0) {
  stamps[row * 16 + 0] = qsa_clk0;  // this CTA's start, its scores out, its wait over
  stamps[row * 16 + 1] = qsa_clk1;
  stamps[row * 16 + 2] = clock64();
}
#endif
#endif

//// kernel: topk
// Decode/short-row selector, pass 2 as its own kernel: one CTA of NT threads per row, reading
// adj, summ, nbs [S] int32 from pass 1 and pos [S] int32; the body is the `select` section.
// Template: K, RATIO, L, CAP, NT; dynamic shared memory CAP * 8 + 4 * (bitmap words).
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
const int row = blockIdx.x;
const long long npad = adj_shape[1];
const int p = pos[row];
const int nb = nbs[row];
const int tid = threadIdx.x, lane = tid & 31;
#ifdef QSA_STAMPS
if (tid == 0) stamps[row * 16 + 0] = stamps[row * 16 + 1] = stamps[row * 16 + 2] = clock64();
#endif

//// kernel: select
// Exact top-K of one row in the order (adj desc, id asc), by one CTA of NT threads (a fragment:
// the `topk` kernel or the fused `score` kernel defines row, npad, p, nb and qsa_dyn_smem).
// -> ids [S, K] int32, valid [S, K] bool, scores [S, K] float32: selected ids ascending first,
//    then empty slots (0, false, -inf); with QSA_ROW_TOKENS also slots / slot_valid
//    [S, K * RATIO + RATIO] (RUNTIME.md §7 row tokens).
// Method: u = the K-th largest summary key is a lower bound of the K-th largest adj (the summaries
// are real blocks), so {adj >= u} holds the whole selection; those candidates go to shared memory
// and an exact radix select (value, then ~id for ties) runs there. Past CAP candidates the same
// select streams every block from global memory instead (slow, exact). Scores and summaries are
// read through L2 (__ldcg): in the fused kernel other CTAs wrote them moments before.
// With QSA_STAMPS (benchmarks/select_phases.py only) an extra output stamps [S, 16] int64 takes
// the SM clock at the phase ends below (slots 3..9; 0..2 are set before this section) and the
// candidate count (slot 10).
#ifdef QSA_STAMPS
#define QSA_STAMP(i, v) \
  if (tid == 0) stamps[row * 16 + (i)] = (v)
#else
#define QSA_STAMP(i, v)
#endif
constexpr int NW = NT / 32;
unsigned* cand_key = reinterpret_cast<unsigned*>(qsa_dyn_smem);
int* cand_id = reinterpret_cast<int*>(cand_key + CAP);
unsigned* bitmap = reinterpret_cast<unsigned*>(cand_id + CAP);
__shared__ unsigned hist[512];
__shared__ unsigned ctl[4];
__shared__ int scan_buf[NW + 1];
__shared__ int cand_n;

const int nb_raw = p >= 0 ? (p + 1) / RATIO : 0;
(void)nb_raw;
const float* adj_row = adj + row * npad;
const unsigned* summ_row = summ + row * (npad / 32) * L;
int* ids_row = ids + (long long)row * K;
auto* valid_row = valid + (long long)row * K;
float* sc_row = scores + (long long)row * K;
#ifdef QSA_ROW_TOKENS
constexpr int WS = K * RATIO + RATIO;
int* sl_row = slots + (long long)row * WS;
auto* sv_row = slot_valid + (long long)row * WS;
if (tid < RATIO) {
  const int t = nb_raw * RATIO + tid;
  const bool ok = t <= p;
  sl_row[K * RATIO + tid] = ok ? t : 0;
  sv_row[K * RATIO + tid] = ok;
}
#endif
auto emit_scored = [&](int i, int blk, float score) {
  ids_row[i] = blk;
  valid_row[i] = true;
  sc_row[i] = score;
#ifdef QSA_ROW_TOKENS
#pragma unroll
  for (int r = 0; r < RATIO; ++r) {
    sl_row[i * RATIO + r] = blk * RATIO + r;
    sv_row[i * RATIO + r] = true;
  }
#endif
};
auto emit = [&](int i, int blk) { emit_scored(i, blk, __ldcg(adj_row + blk)); };
auto emit_empty = [&](int i) {
  ids_row[i] = 0;
  valid_row[i] = false;
  sc_row[i] = qsa::neg_inf();
#ifdef QSA_ROW_TOKENS
#pragma unroll
  for (int r = 0; r < RATIO; ++r) {
    sl_row[i * RATIO + r] = 0;
    sv_row[i * RATIO + r] = false;
  }
#endif
};

if (nb <= K) {  // dense: every visible block, in order
  QSA_STAMP(10, 0);
  for (int i = tid; i < K; i += NT) {
    if (i < nb) emit(i, i);
    else emit_empty(i);
  }
  return;
}

const int nwords = (nb + 31) >> 5;
for (int i = tid; i < nwords; i += NT) bitmap[i] = 0u;
if (tid == 0) cand_n = 0;

// 1. Lower bound u from the first Lu summaries of each chunk (about 2K of them), staged in
// the candidate buffer (one coalesced read instead of one per radix pass). Two 8-bit passes
// suffice: the 16-bit prefix of the K-th largest summary is still a lower bound of the K-th adj.
int Lu = L;
while (Lu > 1 && nwords * (Lu / 2) >= 2 * K) Lu >>= 1;
const int nsum = nwords * Lu;
unsigned u = 0u;
if (nsum >= K) {
  if (nsum <= CAP) {
    for (int i = tid; i < nsum; i += NT) cand_key[i] = __ldcg(summ_row + (i / Lu) * L + (i % Lu));
    __syncthreads();
    auto get_s = [&](int i, unsigned& key) {
      key = cand_key[i];
      return true;
    };
    u = qsa::block_select_desc<NT>(nsum, K, get_s, hist, ctl, 16).t;
  } else {
    auto get_s = [&](int i, unsigned& key) {
      key = __ldcg(summ_row + (i / Lu) * L + (i % Lu));
      return true;
    };
    u = qsa::block_select_desc<NT>(nsum, K, get_s, hist, ctl, 16).t;
  }
}
__syncthreads();
QSA_STAMP(3, clock64());

// 2. Candidates: every block with adj >= u (all blocks when u == 0), U float4 loads of a
// thread in flight at once (one CTA reads the row's whole plane). A warp appends its round's
// candidates with one shared atomic after a warp scan of its lanes' counts (a ballot and an
// atomic per value group took this phase 8.8 µs at 128K: stamps, H100). The candidates' order
// in the buffer does not matter: the select and the writes below go by key and id.
constexpr int U = 8;
static_assert(U * 4 == 32, "a lane's round of values is one 32-bit mask");
const bool take_all = (u == 0u);
const float uf = qsa::key_float(u);
for (int base = 0; base < nb; base += NT * 4 * U) {
  float4 v[U];
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const int b0 = base + (j * NT + tid) * 4;
    v[j] = b0 < nb ? __ldcg(reinterpret_cast<const float4*>(adj_row + b0))
                  : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  unsigned take = 0u;  // bit 4 * j + e: value e of load j is a candidate
#pragma unroll
  for (int j = 0; j < U; ++j) {
    const int b0 = base + (j * NT + tid) * 4;
    const float vals[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if ((b0 + e < nb) && (take_all || vals[e] >= uf)) take |= 1u << (4 * j + e);
  }
  if (!__any_sync(qsa::FULL_MASK, take != 0u)) continue;
  const int cnt = __popc(take);
  int incl = cnt;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(qsa::FULL_MASK, incl, off);
    if (lane >= off) incl += y;
  }
  int wbase = 0;
  if (lane == 31) wbase = atomicAdd(&cand_n, incl);
  int slot = __shfl_sync(qsa::FULL_MASK, wbase, 31) + incl - cnt;
  while (take != 0u) {  // rare: ~0.7 candidates a lane a round at 128K
    const int bit = __ffs(take) - 1;
    take &= take - 1u;
    const int j = bit >> 2, e = bit & 3;
    float val = 0.f;
#pragma unroll
    for (int jj = 0; jj < U; ++jj) {
      if (jj == j) val = e == 0 ? v[jj].x : e == 1 ? v[jj].y : e == 2 ? v[jj].z : v[jj].w;
    }
    if (slot < CAP) {
      cand_key[slot] = qsa::ord_key(val);
      cand_id[slot] = base + (j * NT + tid) * 4 + e;
    }
    ++slot;
  }
}
__syncthreads();
const int ncand = cand_n;
const bool in_smem = ncand <= CAP;
QSA_STAMP(4, clock64());
QSA_STAMP(10, ncand);

// 3. Exact K-th largest key t, then the lowest ids among keys equal to t.
auto get_c = [&](int i, unsigned& key) {
  key = cand_key[i];
  return true;
};
auto get_g = [&](int i, unsigned& key) {
  key = qsa::ord_key(__ldcg(adj_row + i));
  return key >= u;
};
qsa::SelectResult r1;
if (in_smem) r1 = qsa::block_select_desc<NT>(ncand, K, get_c, hist, ctl);
else r1 = qsa::block_select_desc<NT>(nb, K, get_g, hist, ctl);
const unsigned t = r1.t;
unsigned idmax = 0xffffffffu;
QSA_STAMP(5, clock64());
if (r1.k_rem != r1.n_eq) {
  auto tie_c = [&](int i, unsigned& key) {
    key = ~(unsigned)cand_id[i];
    return cand_key[i] == t;
  };
  auto tie_g = [&](int i, unsigned& key) {
    key = ~(unsigned)i;
    return qsa::ord_key(__ldcg(adj_row + i)) == t;
  };
  unsigned t2;
  if (in_smem) t2 = qsa::block_select_desc<NT>(ncand, r1.k_rem, tie_c, hist, ctl).t;
  else t2 = qsa::block_select_desc<NT>(nb, r1.k_rem, tie_g, hist, ctl).t;
  idmax = ~t2;
}
QSA_STAMP(6, clock64());

// 4. Mark the selection in a bitmap, then write it out in ascending id order: each selected
// candidate writes its own slot (its rank among the selected ids: its word owner's offset plus
// the set bits below it) with its score from its key (key_float inverts ord_key bit for bit).
// Walking the bitmap instead, a thread wrote its selected blocks one after another, each store
// waiting on a global load of the block's score (the top-k's most sampled stall, H100 128K).
if (in_smem) {
  for (int i = tid; i < ncand; i += NT) {
    const unsigned key = cand_key[i];
    const int id = cand_id[i];
    if (key > t || (key == t && (unsigned)id <= idmax)) atomicOr(&bitmap[id >> 5], 1u << (id & 31));
  }
} else {
  for (int i = tid; i < nb; i += NT) {
    const unsigned key = qsa::ord_key(__ldcg(adj_row + i));
    if (key > t || (key == t && (unsigned)i <= idmax)) atomicOr(&bitmap[i >> 5], 1u << (i & 31));
  }
}
__syncthreads();
QSA_STAMP(7, clock64());
const int wpt = (nwords + NT - 1) / NT;
const int w0 = tid * wpt;
const int w1 = min(w0 + wpt, nwords);
int cnt = 0;
for (int w = w0; w < w1; ++w) cnt += __popc(bitmap[w]);
int total = 0;
int off = qsa::block_excl_scan<NT>(cnt, scan_buf, &total);
QSA_STAMP(8, clock64());
if (in_smem) {
  static_assert(NT <= 512, "the word owners' offsets reuse the 512-word histogram");
  unsigned* owner_off = hist;  // free once the selects are done
  owner_off[tid] = (unsigned)off;
  __syncthreads();
  for (int i = tid; i < ncand; i += NT) {
    const unsigned key = cand_key[i];
    const int id = cand_id[i];
    if (key < t || (key == t && (unsigned)id > idmax)) continue;
    const int w = id >> 5, owner = w / wpt;
    int slot = (int)owner_off[owner] + __popc(bitmap[w] & ((1u << (id & 31)) - 1u));
    for (int v = owner * wpt; v < w; ++v) slot += __popc(bitmap[v]);
    if (slot < K) emit_scored(slot, id, qsa::key_float(key));
  }
} else {
  for (int w = w0; w < w1; ++w) {
    unsigned bits = bitmap[w];
    while (bits != 0u) {
      const int bit = __ffs(bits) - 1;
      bits &= bits - 1u;
      if (off < K) emit(off, w * 32 + bit);
      ++off;
    }
  }
}
for (int i = total + tid; i < K; i += NT) emit_empty(i);  // never taken when the select is exact
#ifdef QSA_STAMPS
__syncthreads();
QSA_STAMP(9, clock64());
#endif
