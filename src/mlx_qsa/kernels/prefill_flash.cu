//// kernel: attend
// Block-sparse prefill attention on tensor cores (RUNTIME.md §8 `prefill_flash`): one CTA per
// (KV head j, row) attends the G <= 16 query heads of j (one m16 tile, rows past G are zero)
// over the row's valid selected blocks (each RATIO tokens) plus its own 0..RATIO-1 tail tokens.
// q [1, H, S, D] bf16 (last axis contiguous); keys, values [1, HKV, cap, D] bf16 read in place;
// ids [S, K] int32, valid [S, K] bool, pos [S] int32 -> out [1, H, S, D] bf16.
// The row's tokens are listed in selection order, then streamed through shared memory 64 at a
// time (cp.async, NSTAGE = 3 stages, tokens past the list zero-filled). CTAs run KV head by KV
// head (j-major grid) so that one head's K/V working set can stay in L2. Warp w owns tokens
// 16w..16w+15 of each stage: S = Q K^T with mma.sync m16n8k16 (bf16 in, float32 accumulate),
// an online softmax in float32 (base 2), then O += P V with P rounded to bf16 and V fragments
// from ldmatrix.trans (Q and K fragments from ldmatrix too; O is rescaled only when a row's
// running max moved). The four warps' (m, l, O) are merged in a fixed order at the end.
// QSA_TILE_SKIP (with counts and LIMIT): rows of shared tiles are left to the tile kernel.
// QSA_PART_STREAM / QSA_PART_MATH (benchmarks only, `prefill_flash_form_cuda`): the K/V loads
// without the math, or the math over zeroed stages without the loads; both write zeros. Their
// times bound what the per-row kernel can gain from faster math or faster loads.
// Template: D, G, HKV, K, RATIO, SCALE_BITS (+ LIMIT). 128 threads; dynamic shared memory:
// 3 stages x (K, V) x 64 x (D + 8) bf16, q 16 x (D + 8) bf16, token list K * RATIO + RATIO int.
constexpr int NT = 128, STEP = 64, VS = D + 8, NTILE = D / 8, NSTAGE = 3;
constexpr int EPT = (K + NT - 1) / NT;
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
__nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(qsa_dyn_smem);
__nv_bfloat16* q_s = kv_s + NSTAGE * 2 * STEP * VS;
int* tok_s = reinterpret_cast<int*>(q_s + 16 * VS);
__shared__ int scan_s[NT / 32 + 1];
__shared__ float ml_s[4][16][2];
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int S = q_shape[2];
const int j = blockIdx.x / S, row = blockIdx.x % S;
#ifdef QSA_TILE_SKIP
// counts [n_tiles] (tile_union): a row whose 8-row tile has at most LIMIT blocks in its union is
// attended by the shared-tile kernel (sdpa.cu, QSA_LIST) instead; this CTA has nothing to do.
if (counts[row / 8] <= LIMIT) return;
#endif
const long long cap = keys_shape[2];
const int p = pos[row * pos_strides[0]];

// 1. The token list: valid selected blocks in selection order (block-wide scan), then the tail.
// The selector writes each row's valid ids ascending (RUNTIME §7), so the blocks stream in
// context order; a form that sorted them measured 1-2 % slower (2026-12-08).
int bid[EPT];
int cnt = 0;
#pragma unroll
for (int e = 0; e < EPT; ++e) {
  const int i = tid * EPT + e;
  int b = -1;
  if (i < K && valid[row * valid_strides[0] + i * valid_strides[1]]) {
    const int id = ids[row * ids_strides[0] + i * ids_strides[1]];
    if (id >= 0 && (long long)(id + 1) * RATIO <= cap) b = id;
  }
  bid[e] = b;
  cnt += b >= 0;
}
int n_blk;
int at = qsa::block_excl_scan<NT>(cnt, scan_s, &n_blk);
#pragma unroll
for (int e = 0; e < EPT; ++e)
  if (bid[e] >= 0) {
#pragma unroll
    for (int t = 0; t < RATIO; ++t) tok_s[at * RATIO + t] = bid[e] * RATIO + t;
    ++at;
  }
const int tail0 = p >= 0 ? (p + 1) / RATIO * RATIO : 0;
const int n_tail = p >= 0 ? p + 1 - tail0 : 0;
if (tid < n_tail) tok_s[n_blk * RATIO + tid] = tail0 + tid;
const int n_tok = n_blk * RATIO + n_tail;

// The G query rows of the tile (rows G..15 zero).
for (int c = tid; c < 16 * (D / 8); c += NT) {
  const int h = c / (D / 8), dc = c % (D / 8);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (h < G)
    v = *reinterpret_cast<const uint4*>(q + (long long)(j * G + h) * q_strides[1] +
                                        (long long)row * q_strides[2] + dc * 8);
  *reinterpret_cast<uint4*>(q_s + h * VS + dc * 8) = v;
}
__syncthreads();

const __nv_bfloat16* kg = keys + (long long)j * keys_strides[1];
const __nv_bfloat16* vg = values + (long long)j * values_strides[1];
// A thread always copies the same 16-byte column dc of the tokens t = tid / (D / 8) + i * TPI,
// so its source columns and shared-memory addresses are set up once, not per copy.
constexpr int CPT = D / 8, TPI = NT / CPT;  // 16-byte chunks per token, tokens per pass
static_assert(NT % CPT == 0, "a token's chunks split evenly over the threads");
const int dc = tid % CPT, t_first = tid / CPT;
const __nv_bfloat16* kcol = kg + dc * 8;
const __nv_bfloat16* vcol = vg + dc * 8;
const unsigned dst0 = (unsigned)__cvta_generic_to_shared(kv_s + t_first * VS + dc * 8);
#ifdef QSA_PART_MATH
// no loads: the stages are zeroed once (zero K and V give weights 1 and an output of 0)
for (int i = tid; i < NSTAGE * 2 * STEP * VS / 8; i += NT)
  reinterpret_cast<uint4*>(kv_s)[i] = make_uint4(0u, 0u, 0u, 0u);
__syncthreads();
auto load_stage = [&](int, int) {};
#else
auto load_stage = [&](int st, int t0) {
  const unsigned dk0 = dst0 + st * 2 * STEP * VS * 2, dv0 = dk0 + STEP * VS * 2;
#pragma unroll
  for (int i = 0; i < STEP / TPI; ++i) {
    const int t = t_first + i * TPI;
    const bool ok = t0 + t < n_tok;
    const long long tok = ok ? tok_s[t0 + t] : 0;
    const unsigned nbytes = ok ? 16u : 0u;  // 0: zero-fill (masked tokens must not be NaN)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dk0 + i * TPI * VS * 2),
                 "l"(kcol + tok * keys_strides[2]), "r"(nbytes));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dv0 + i * TPI * VS * 2),
                 "l"(vcol + tok * values_strides[2]), "r"(nbytes));
  }
};
#endif
// one commit group per stage slot, empty past the list, so the wait count is uniform
auto commit = [] { asm volatile("cp.async.commit_group;\n" ::); };

// Per-thread state: rows r0 = lane / 4 and r1 = r0 + 8 of the m16 tile.
const float sl2 = __int_as_float(SCALE_BITS) * 1.4426950408889634f;
float o[NTILE][4];
#pragma unroll
for (int n = 0; n < NTILE; ++n)
#pragma unroll
  for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
float m0 = qsa::neg_inf(), m1 = qsa::neg_inf(), l0 = 0.f, l1 = 0.f;
const int ar = lane >> 2, ak = 2 * (lane & 3);

const int n_steps = (n_tok + STEP - 1) / STEP;
#pragma unroll
for (int st = 0; st < NSTAGE - 1; ++st) {
  if (st < n_steps) load_stage(st, st * STEP);
  commit();
}
const unsigned qa_base =
    (unsigned)__cvta_generic_to_shared(q_s + (lane & 15) * VS + (lane >> 4) * 8);
const unsigned kb_off = (((lane >> 4) * 8 + (lane & 7)) * VS + ((lane >> 3) & 1) * 8) * 2;
for (int s = 0; s < n_steps; ++s) {
  if (s + NSTAGE - 1 < n_steps) load_stage((s + NSTAGE - 1) % NSTAGE, (s + NSTAGE - 1) * STEP);
  commit();
  asm volatile("cp.async.wait_group %0;\n" ::"n"(NSTAGE - 1));  // stage s has landed
  __syncthreads();
  const int tb = s * STEP + 16 * warp;  // the warp's first token of this stage
#ifdef QSA_PART_STREAM
  if (false) {  // the loads alone: no math (every row ends empty, its output 0)
#else
  if (tb < n_tok) {  // warp-uniform
#endif
    const __nv_bfloat16* ks = kv_s + (s % NSTAGE) * 2 * STEP * VS + 16 * warp * VS;
    const __nv_bfloat16* vs = ks + STEP * VS;
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const unsigned kb_base = (unsigned)__cvta_generic_to_shared(ks) + kb_off;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned a[4], b[4];  // A: rows lane % 16, k half lane / 16; B: n tiles 0, 1 x k halves
      qsa::ldmatrix_x4(a, qa_base + kk * 32);
      qsa::ldmatrix_x4(b, kb_base + kk * 32);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) qsa::mma_16816(sc[nt], a, b[2 * nt], b[2 * nt + 1]);
    }
    // tokens past the list are masked; the warp's first token is always listed
    unsigned vis = 0u;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) vis |= (unsigned)(tb + nt * 8 + ak + e < n_tok) << (2 * nt + e);
    qsa::online_softmax<2, NTILE>(sc, vis, sl2, m0, m1, l0, l1, o);  // sc: weights now
    // O += P V over the warp's 16 tokens
    const int mi = lane >> 3, li = lane & 7;
    const unsigned vrow = (unsigned)__cvta_generic_to_shared(vs + ((mi & 1) * 8 + li) * VS +
                                                            (mi >> 1) * 8);
    qsa::pv_k16<D>(o, sc[0], sc[1], vrow);
  }
  __syncthreads();  // a later iteration refills this stage
}
asm volatile("cp.async.wait_group 0;\n" ::);  // only empty groups can remain; drain anyway
__syncthreads();

// 2. Merge the warps: row sums over the quad, then M = max_w m_w, L = sum_w l_w 2^(m_w - M).
#pragma unroll
for (int off = 1; off < 4; off <<= 1) {
  l0 += __shfl_xor_sync(qsa::FULL_MASK, l0, off);
  l1 += __shfl_xor_sync(qsa::FULL_MASK, l1, off);
}
if ((lane & 3) == 0) {
  ml_s[warp][ar][0] = m0;
  ml_s[warp][ar][1] = l0;
  ml_s[warp][ar + 8][0] = m1;
  ml_s[warp][ar + 8][1] = l1;
}
__syncthreads();
float f0, f1;  // this warp's weight for rows r0, r1: 2^(m_w - M) / L (0 for an empty row)
#pragma unroll
for (int h = 0; h < 2; ++h) {
  const int r = ar + 8 * h;
  float M = qsa::neg_inf();
#pragma unroll
  for (int w = 0; w < 4; ++w) M = fmaxf(M, ml_s[w][r][0]);
  float L = 0.f, mine = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float mw = ml_s[w][r][0];
    const float fw = mw == qsa::neg_inf() ? 0.f : exp2f(mw - M);
    L += ml_s[w][r][1] * fw;
    if (w == warp) mine = fw;
  }
  const float f = L > 0.f ? mine / L : 0.f;
  if (h == 0) f0 = f;
  else f1 = f;
}
float* o_s = reinterpret_cast<float*>(kv_s);  // [4 warps][16][D], over the drained stages
#pragma unroll
for (int n = 0; n < NTILE; ++n) {
  const int c = n * 8 + ak;
  o_s[(warp * 16 + ar) * D + c] = o[n][0] * f0;
  o_s[(warp * 16 + ar) * D + c + 1] = o[n][1] * f0;
  o_s[(warp * 16 + ar + 8) * D + c] = o[n][2] * f1;
  o_s[(warp * 16 + ar + 8) * D + c + 1] = o[n][3] * f1;
}
__syncthreads();
for (int i = tid; i < G * D; i += NT) {
  const int h = i / D, c = i % D;
  const float v = o_s[h * D + c] + o_s[(16 + h) * D + c] + o_s[(32 + h) * D + c] +
                  o_s[(48 + h) * D + c];
  out[((long long)(j * G + h) * S + row) * D + c] = __float2bfloat16(v);
}

//// kernel: union_pre
// The shared tiles of `prefill_flash` (PERFORMANCE.md §3: rows of a query tile share K/V tiles):
// for each tile of RT = 8 consecutive rows, the union of the rows' valid selected blocks and of
// their tail blocks, in ascending block order, each entry packed as block | rows << 24 (bit r:
// row r of the tile attends that block; a tail block only up to the row's position, which the
// attention applies). ids [S, K] int32, valid [S, K] bool, pos [S] int32, keys (its shape only:
// the backing's length) -> lists [n_tiles, NE] int32 (NE = K * RT + RT; entries past the count
// are not written), counts [n_tiles] int32. One CTA of NT threads a tile.
// This part: key_of(i), the tile's i-th (block << 3 | row) key, i < NE (NONE where the slot is
// invalid, out of range, or the row has no tail); tile_union or tile_union_bitmap follows.
// Template: K, RATIO, NT (+ NKEYS or NBMAX).
constexpr int RT = 8, NE = K * RT + RT;
constexpr unsigned NONE = 0xFFFFFFFFu, MAX_BLOCK = 1u << 24;
const int tid = threadIdx.x, tile = blockIdx.x, S = pos_shape[0];
const long long cap = keys_shape[2];
auto key_of = [&](int i) -> unsigned {
  if (i < K * RT) {
    const int r = i / K, e = i % K, row = tile * RT + r;
    if (row < S && valid[row * valid_strides[0] + e * valid_strides[1]]) {
      const int id = ids[row * ids_strides[0] + e * ids_strides[1]];
      if (id >= 0 && (unsigned)id < MAX_BLOCK && (long long)(id + 1) * RATIO <= cap)
        return (unsigned)id << 3 | r;
    }
  } else if (i < NE) {
    const int r = i - K * RT, row = tile * RT + r;
    if (row < S) {
      const int p = pos[row * pos_strides[0]];
      const int tail0 = (p + 1) / RATIO * RATIO;
      if (p >= 0 && p + 1 > tail0 && (unsigned)(tail0 / RATIO) < MAX_BLOCK)
        return (unsigned)(tail0 / RATIO) << 3 | r;
    }
  }
  return NONE;
};
__shared__ int scan_s[NT / 32 + 1];

//// kernel: tile_union
// The union by sorting: the tile's keys in shared memory, a bitonic sort, then the first key of
// each block's run becomes an entry (a block-wide scan places it) with the OR of its run's rows.
// Any context. Template NKEYS: a power of two >= NE.
constexpr int EPT = NKEYS / NT;
static_assert((NKEYS & (NKEYS - 1)) == 0 && NKEYS >= NE, "NKEYS: a power of two >= K RT + RT");
static_assert(NKEYS % NT == 0, "the keys split evenly over the threads");
__shared__ unsigned key_s[NKEYS];
for (int i = tid; i < NKEYS; i += NT) key_s[i] = key_of(i);
__syncthreads();
for (int size = 2; size <= NKEYS; size <<= 1)
  for (int stride = size >> 1; stride > 0; stride >>= 1) {
    for (int i = tid; i < NKEYS / 2; i += NT) {
      const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
      const unsigned a = key_s[lo], b = key_s[hi];
      if ((a > b) == ((lo & size) == 0)) {  // ascending where bit `size` of lo is clear
        key_s[lo] = b;
        key_s[hi] = a;
      }
    }
    __syncthreads();
  }
// Thread tid owns keys tid * EPT .. + EPT - 1: a key starts an entry where its block differs
// from the previous key's.
const int i0 = tid * EPT;
int heads = 0;
#pragma unroll
for (int e = 0; e < EPT; ++e) {
  const int i = i0 + e;
  const unsigned k = key_s[i];
  heads += k != NONE && (i == 0 || key_s[i - 1] >> 3 != k >> 3);
}
int total;
int at = qsa::block_excl_scan<NT>(heads, scan_s, &total);
#pragma unroll
for (int e = 0; e < EPT; ++e) {
  const int i = i0 + e;
  const unsigned k = key_s[i];
  if (k != NONE && (i == 0 || key_s[i - 1] >> 3 != k >> 3)) {
    unsigned rows = 0u;
    for (int j = i; j < NKEYS && key_s[j] != NONE && key_s[j] >> 3 == k >> 3; ++j)
      rows |= 1u << (key_s[j] & 7u);
    lists[(long long)tile * NE + at] = (int)((k >> 3) | rows << 24);
    ++at;
  }
}
if (tid == 0) counts[tile] = total;

//// kernel: tile_union_bitmap
// The union by a table: byte b of word w of the dynamic shared memory holds the rows of block
// 4 w + b. Every key ORs its row in (shared atomics), then a block-wide scan over the table's
// nonzero bytes writes the entries in block order: the sort's lists exactly, without sorting.
// For contexts of fewer than NBMAX blocks (the launcher checks). Template NBMAX: the table's
// bytes, a multiple of 4 NT.
static_assert(NBMAX % (4 * NT) == 0, "the table splits evenly over the threads");
extern __shared__ unsigned rows_s[];
const int nw = min((int)((cap / RATIO + 1 + 3) / 4), NBMAX / 4);  // blocks <= cap / RATIO
for (int w = tid; w < nw; w += NT) rows_s[w] = 0u;
__syncthreads();
for (int i = tid; i < NE; i += NT) {
  const unsigned k = key_of(i);
  if (k != NONE && (k >> 3) < 4u * nw)
    atomicOr(&rows_s[k >> 5], 1u << (((k >> 3) & 3u) * 8 + (k & 7u)));
}
__syncthreads();
const int per = (nw + NT - 1) / NT, w0 = min(nw, tid * per), w1 = min(nw, w0 + per);
int cnt = 0;
for (int w = w0; w < w1; ++w) {
  const unsigned v = rows_s[w];
#pragma unroll
  for (int b = 0; b < 4; ++b) cnt += ((v >> (8 * b)) & 0xFFu) != 0u;
}
int total;
int at = qsa::block_excl_scan<NT>(cnt, scan_s, &total);
for (int w = w0; w < w1; ++w) {
  const unsigned v = rows_s[w];
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const unsigned rows = (v >> (8 * b)) & 0xFFu;
    if (rows != 0u) lists[(long long)tile * NE + at++] = (int)((4u * w + b) | rows << 24);
  }
}
if (tid == 0) counts[tile] = total;
