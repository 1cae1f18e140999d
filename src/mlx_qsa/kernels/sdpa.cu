//// kernel: attend
// Dense attention of many query rows on tensor cores: the `sdpa` consumer on CUDA (RUNTIME.md
// §8) with a causal mask or a boolean keep-mask. MLX's own SDPA has no fused path at head_dim
// 256 with a mask; its fallback writes the whole [H, S, T] score matrix to memory.
// q [1, H, S, D] bf16 (last axis contiguous); keys, values [1, HKV, cap, D] bf16 read in place;
// pos [S] int32, the rows' positions; with QSA_MASK also mask [1, 1, S, T] bool (any strides)
// -> out [1, H, S, D] bf16.
// Causal (no QSA_MASK): row r sees the tokens t <= pos[r]. QSA_MASK: row r sees the tokens
// t < T with mask[r, t]; with QSA_MASK_CAUSAL the mask is known to lie within the causal bound
// (every QSA keep-mask does), so no stage past the tile's furthest position is loaded. A row
// that sees no token gives 0.
// One CTA per (KV head j, tile of RT = 8 query rows), NW = G / 2 warps: warp w holds query heads
// 2w and 2w + 1 of the tile's rows as one m16 tile (A rows 0..7: head 2w, rows 8..15: head
// 2w + 1), so a lane's two accumulator rows belong to one query row and share its mask. Every
// warp runs all STEP (32 or 64) tokens of a stage (K/V staged by cp.async through NSTAGE slots,
// tokens past the range zero-filled): S = Q K^T with mma.sync m16n8k16 (bf16 in, float32
// accumulate), an online softmax in float32 (base 2), then O += P V with P rounded to bf16. With
// QSA_KV_SPLIT a stage's K and V are separate cp.async groups, so S = Q K^T waits for K only.
// With a mask, a lane loads its row's mask bytes one stage ahead, and a stage no row of the tile
// sees is skipped.
// QSA_LIST (prefill_flash over shared tiles, PERFORMANCE.md §3): the tile's tokens are the
// blocks of its union list instead, lists [n_tiles, NE] int32 with counts [n_tiles] from
// prefill_flash.cu tile_union (entry: block | rows << 24); row r of the tile sees the RATIO
// tokens of an entry with bit r set, up to its position (tail blocks are partial). A tile whose
// union has more than LIMIT blocks was attended by the per-row kernel (prefill_flash.cu, which
// skipped the others): its CTA copies those rows from that kernel's output, rowwise [1, H, S, D].
// Row tiles run from the last (the longest causal spans) to the first, KV head fastest.
// QSA_SPLIT (few rows: too few CTAs to fill the GPU): NSPLIT CTAs share a row tile, each taking
// an even share of its token range in whole stages, and write split-K partials instead of out:
// part_o [H * S, NSPLIT, D] float32 (sum of 2^(s - m) v), part_ml [H * S, NSPLIT, 2] (m in
// natural-log units, l), which split_k_merge.cu merges (rows h * S + r, the layout of out).
// Template: D, G, HKV, SCALE_BITS, STEP, NSTAGE (+ NSPLIT; + LIMIT, RATIO, NE). G / 2 * 32
// threads; dynamic shared memory: NSTAGE x (K, V) x STEP x (D + 8) bf16, then the queries
// NW x 16 x (D + 8) bf16 (then with QSA_LIST the tile's LIMIT list entries).
constexpr int NW = G / 2, NT = NW * 32, RT = 8, VS = D + 8, NTILE = D / 8, CPT = D / 8;
static_assert(G % 2 == 0 && NW >= 1 && NW <= 8, "G must be even, 2..16");
static_assert(D % 16 == 0 && D <= 256, "D must be a multiple of 16, at most 256");
static_assert(STEP == 32 || STEP == 64, "STEP: 32 or 64 tokens a stage");
static_assert(NSTAGE >= 2 && NSTAGE <= 4, "NSTAGE: 2..4 stage slots");
#ifdef QSA_KV_SPLIT
constexpr int GPS = 2;  // cp.async groups a stage: K, then V
#else
constexpr int GPS = 1;
#endif
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
__nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(qsa_dyn_smem);
__nv_bfloat16* q_s = kv_s + NSTAGE * 2 * STEP * VS;
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int S = q_shape[2];
const int n_rt = (S + RT - 1) / RT;
#ifdef QSA_SPLIT
const int sp = blockIdx.x % NSPLIT, cta = blockIdx.x / NSPLIT;
#else
const int cta = blockIdx.x;
#endif
const int j = cta % HKV;
const int r0 = (n_rt - 1 - cta / HKV) * RT;
const int ar = lane >> 2, ak = 2 * (lane & 3);
const int row = r0 + ar;
const bool row_ok = row < S;
#ifdef QSA_LIST
const int tile = r0 / RT, n_list = counts[tile];
if (n_list > LIMIT) {  // CTA-uniform, before any barrier
  for (int c = tid; c < G * RT * CPT; c += NT) {
    const int h = j * G + c / (RT * CPT), r = r0 + c / CPT % RT, dc = c % CPT;
    if (r < S) {
      const long long at = ((long long)h * S + r) * D + dc * 8;
      *reinterpret_cast<uint4*>(out + at) = *reinterpret_cast<const uint4*>(rowwise + at);
    }
  }
  return;
}
int* list_s = reinterpret_cast<int*>(q_s + NW * 16 * VS);
for (int i = tid; i < n_list; i += NT) list_s[i] = lists[(long long)tile * NE + i];
#endif

// The tile's token range [0, kend): past the furthest row's position (causal, or a mask that
// lies within the causal bound: QSA_MASK_CAUSAL), at most the mask's width.
#ifdef QSA_MASK
const long long m_row = mask_strides[2], m_col = mask_strides[3];
// A lane reads the mask bytes STEP / 4 (lane % 4) .. + STEP / 4 - 1 of a stage in its own row,
// as NWD 4-byte words where the rows are 4-byte aligned, else byte by byte.
constexpr int NWD = STEP / 16;
const bool* mload = mask + (row_ok ? row : 0) * m_row;
const bool words = m_col == 1 && m_row % 4 == 0 &&
                   (reinterpret_cast<unsigned long long>(mask) & 3ull) == 0ull;
#endif
#ifndef QSA_MASK
const int p_row = row_ok ? pos[row * pos_strides[0]] : -1;
#endif
#if !defined(QSA_MASK) || defined(QSA_MASK_CAUSAL)
__shared__ int kend_s;
if (tid == 0) {
  int e = 0;
  for (int r = r0; r < min(r0 + RT, S); ++r) e = max(e, pos[r * pos_strides[0]] + 1);
  kend_s = e;
}
#endif

// The warps' query tiles (rows past S zero).
for (int c = tid; c < NW * 16 * CPT; c += NT) {
  const int mr = c / CPT, dc = c % CPT;
  const int w = mr >> 4, i = mr & 15;
  const int h = j * G + 2 * w + (i >> 3), r = r0 + (i & 7);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (r < S)
    v = *reinterpret_cast<const uint4*>(q + (long long)h * q_strides[1] +
                                        (long long)r * q_strides[2] + dc * 8);
  *reinterpret_cast<uint4*>(q_s + mr * VS + dc * 8) = v;
}
__syncthreads();
#if defined(QSA_LIST)
const int kend = n_list * RATIO;  // tokens in list order: entry u / RATIO, token u % RATIO
// a tail block's tokens past the tile's furthest position may not be written yet: never read
const int tok_end = kend_s;
#elif !defined(QSA_MASK)
const int kend = kend_s;
#elif defined(QSA_MASK_CAUSAL)
const int kend = min(kend_s, (int)mask_shape[3]);
#else
const int kend = mask_shape[3];
#endif

// This CTA's tokens [t_lo, t_hi): the tile's whole range, or its split's share of the stages.
#ifdef QSA_SPLIT
const int per_split = ((kend + STEP - 1) / STEP + NSPLIT - 1) / NSPLIT * STEP;
const int t_lo = min(kend, sp * per_split), t_hi = min(kend, t_lo + per_split);
#else
const int t_lo = 0, t_hi = kend;
#endif
const __nv_bfloat16* kg = keys + (long long)j * keys_strides[1];
const __nv_bfloat16* vg = values + (long long)j * values_strides[1];
const int n_steps = (t_hi - t_lo + STEP - 1) / STEP;
const unsigned kv0 = (unsigned)__cvta_generic_to_shared(kv_s);
// The STEP tokens from t0 into the stage at dk: their K (with_k) and V (with_v) rows.
auto load_kv = [&](unsigned dk, int t0, bool with_k, bool with_v) {
  const unsigned dv = dk + STEP * VS * 2;
  for (int c = tid; c < STEP * CPT; c += NT) {
    const int t = c / CPT, dc = c % CPT;
    const bool ok = t0 + t < t_hi;
#ifdef QSA_LIST
    const int lt = ok ? (list_s[(t0 + t) / RATIO] & 0xFFFFFF) * RATIO + (t0 + t) % RATIO : 0;
    const bool in = ok && lt < tok_end;
    const long long tok = in ? lt : 0;
    const unsigned nbytes = in ? 16u : 0u;  // 0: zero-fill (0 * garbage could be NaN)
#else
    const long long tok = ok ? t0 + t : 0;
    const unsigned nbytes = ok ? 16u : 0u;  // 0: zero-fill (0 * garbage could be NaN)
#endif
    const unsigned off = (t * VS + dc * 8) * 2;
    if (with_k)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dk + off),
                   "l"(kg + tok * keys_strides[2] + dc * 8), "r"(nbytes));
    if (with_v)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dv + off),
                   "l"(vg + tok * values_strides[2] + dc * 8), "r"(nbytes));
  }
};
auto commit = [] { asm volatile("cp.async.commit_group;\n" ::); };
// Stage s into slot s % NSTAGE: GPS commit groups, empty past the last stage, so that every
// wait below counts the same groups.
auto issue = [&](int s) {
  const bool any = s < n_steps;
  const unsigned dk = kv0 + (s % NSTAGE) * 2 * STEP * VS * 2;
#ifdef QSA_KV_SPLIT
  if (any) load_kv(dk, t_lo + s * STEP, true, false);
  commit();
  if (any) load_kv(dk, t_lo + s * STEP, false, true);
#else
  if (any) load_kv(dk, t_lo + s * STEP, true, true);
#endif
  commit();
};

// Which of this lane's STEP / 4 score columns of stage s its row sees: bit 2 nt + e is the token
// t_lo + s * STEP + 8 nt + ak + e (tokens from t_hi on are another split's).
#ifdef QSA_MASK
// The mask words of stage s (this lane's STEP / 4 bytes; 0 past t_hi or past the rows): loaded
// one stage ahead and only unpacked then, so no stage waits for its mask.
auto load_mask = [&](int s, unsigned (&w)[NWD]) {
  const int tb = t_lo + s * STEP + (lane & 3) * (STEP / 4);
#pragma unroll
  for (int k = 0; k < NWD; ++k) {
    const int t = tb + 4 * k;
    unsigned v = 0u;
    if (row_ok) {
      if (words && t + 4 <= t_hi) {
        v = *reinterpret_cast<const unsigned*>(mload + t);
      } else {
        for (int b = 0; b < 4; ++b)
          if (t + b < t_hi && mload[(long long)(t + b) * m_col]) v |= 1u << (8 * b);
      }
    }
    w[k] = v;
  }
};
// bool bytes (0 or 1) to bits: byte b of x lands on bit 24 + b of x * 0x01020408
auto nibble = [](unsigned x) { return ((x & 0x01010101u) * 0x01020408u) >> 24; };
auto visible = [&](const unsigned (&w)[NWD]) -> unsigned {
  unsigned mine = 0u;  // this lane's STEP / 4 tokens, one bit each
#pragma unroll
  for (int k = 0; k < NWD; ++k) mine |= nibble(w[k]) << (4 * k);
  const int q0 = lane & ~3;  // the four lanes that read this lane's row
  unsigned long long all = 0ull;  // the row's STEP tokens
#pragma unroll
  for (int i = 0; i < 4; ++i)
    all |= (unsigned long long)__shfl_sync(qsa::FULL_MASK, mine, q0 + i) << (i * (STEP / 4));
  unsigned b = 0u;
#pragma unroll
  for (int nt = 0; nt < STEP / 8; ++nt) b |= (unsigned)((all >> (nt * 8 + ak)) & 3ull) << (2 * nt);
  return b;
};
#else
auto visible = [&](int s) -> unsigned {
  unsigned b = 0u;
#pragma unroll
  for (int nt = 0; nt < STEP / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int t = t_lo + s * STEP + nt * 8 + ak + e;
#ifdef QSA_LIST
      bool ok = false;
      if (t < t_hi) {  // the entry lists this lane's row, and the token is not past it
        const unsigned en = (unsigned)list_s[t / RATIO];
        ok = ((en >> (24 + ar)) & 1u) && (int)((en & 0xFFFFFFu) * RATIO + t % RATIO) <= p_row;
      }
      b |= (unsigned)ok << (2 * nt + e);
#else
      b |= (unsigned)(t < t_hi && t <= p_row) << (2 * nt + e);
#endif
    }
  return b;
};
#endif

const float sl2 = __int_as_float(SCALE_BITS) * 1.4426950408889634f;
float o[NTILE][4];
#pragma unroll
for (int n = 0; n < NTILE; ++n)
#pragma unroll
  for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
float m0 = qsa::neg_inf(), m1 = qsa::neg_inf(), l0 = 0.f, l1 = 0.f;

#pragma unroll
for (int s = 0; s < NSTAGE - 1; ++s) issue(s);
const unsigned qa_base =
    (unsigned)__cvta_generic_to_shared(q_s + (warp * 16 + (lane & 15)) * VS + (lane >> 4) * 8);
const unsigned kb_off = (((lane >> 4) * 8 + (lane & 7)) * VS + ((lane >> 3) & 1) * 8) * 2;
const int mi = lane >> 3, li = lane & 7;
const unsigned v_off = (((mi & 1) * 8 + li) * VS + (mi >> 1) * 8) * 2;
#ifdef QSA_MASK
unsigned mw[NWD] = {};
if (n_steps > 0) load_mask(0, mw);
#endif
for (int s = 0; s < n_steps; ++s) {
  issue(s + NSTAGE - 1);
#ifdef QSA_MASK
  const unsigned vis = visible(mw);  // loaded during the previous stage
  if (s + 1 < n_steps) load_mask(s + 1, mw);  // waited for only at the next stage
#else
  const unsigned vis = visible(s);
#endif
  // stage s (its K, with QSA_KV_SPLIT) has landed: at most GPS NSTAGE - 1 newer groups pend
  asm volatile("cp.async.wait_group %0;\n" ::"n"(GPS * NSTAGE - 1));
#ifdef QSA_MASK
  const bool live = __syncthreads_or(vis != 0u);
#else
  __syncthreads();
  // every token below kend is seen by the tile's furthest row (QSA_LIST: every entry by a row)
  const bool live = true;
#endif
  if (live) {
    const unsigned ks = kv0 + (s % NSTAGE) * 2 * STEP * VS * 2;
    const unsigned vs = ks + STEP * VS * 2;
    float sc[STEP / 8][4];
#pragma unroll
    for (int nt = 0; nt < STEP / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned a[4];
      qsa::ldmatrix_x4(a, qa_base + kk * 32);
#pragma unroll
      for (int np = 0; np < STEP / 16; ++np) {
        unsigned b[4];  // n tiles 2 np, 2 np + 1 x the two k halves
        qsa::ldmatrix_x4(b, ks + kb_off + np * 16 * VS * 2 + kk * 32);
#pragma unroll
        for (int h = 0; h < 2; ++h) qsa::mma_16816(sc[2 * np + h], a, b[2 * h], b[2 * h + 1]);
      }
    }
    qsa::online_softmax<STEP / 8, NTILE>(sc, vis, sl2, m0, m1, l0, l1, o);  // sc: weights now
#ifdef QSA_KV_SPLIT
    asm volatile("cp.async.wait_group %0;\n" ::"n"(GPS * NSTAGE - 2));  // and its V
    __syncthreads();  // live is the CTA's: every thread reaches this barrier or none
#endif
#pragma unroll
    for (int c2 = 0; c2 < STEP / 16; ++c2)  // O += P V, 16 tokens a k16 step
      qsa::pv_k16<D>(o, sc[2 * c2], sc[2 * c2 + 1], vs + v_off + c2 * 16 * VS * 2);
  }
  __syncthreads();  // the next iteration refills this stage
}
asm volatile("cp.async.wait_group 0;\n" ::);

// Row sums over the quad, then O / l straight from the registers (or the split's partials).
#pragma unroll
for (int off = 1; off < 4; off <<= 1) {
  l0 += __shfl_xor_sync(qsa::FULL_MASK, l0, off);
  l1 += __shfl_xor_sync(qsa::FULL_MASK, l1, off);
}
#ifdef QSA_SPLIT
if (row_ok) {
  const long long rh0 = (long long)(j * G + 2 * warp) * S + row, rh1 = rh0 + S;
  float* po0 = part_o + (rh0 * NSPLIT + sp) * D + ak;
  float* po1 = part_o + (rh1 * NSPLIT + sp) * D + ak;
#pragma unroll
  for (int n = 0; n < NTILE; ++n) {
    *reinterpret_cast<float2*>(po0 + n * 8) = make_float2(o[n][0], o[n][1]);
    *reinterpret_cast<float2*>(po1 + n * 8) = make_float2(o[n][2], o[n][3]);
  }
  if ((lane & 3) == 0) {
    constexpr float LN2 = 0.6931471805599453f;  // base-2 maxima to the merge's natural units
    part_ml[(rh0 * NSPLIT + sp) * 2] = m0 == qsa::neg_inf() ? m0 : m0 * LN2;
    part_ml[(rh0 * NSPLIT + sp) * 2 + 1] = l0;
    part_ml[(rh1 * NSPLIT + sp) * 2] = m1 == qsa::neg_inf() ? m1 : m1 * LN2;
    part_ml[(rh1 * NSPLIT + sp) * 2 + 1] = l1;
  }
}
#else
if (row_ok) {
  const float i0 = l0 > 0.f ? 1.f / l0 : 0.f, i1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const int h0 = j * G + 2 * warp;
  __nv_bfloat16* out0 = out + ((long long)h0 * S + row) * D + ak;
  __nv_bfloat16* out1 = out0 + (long long)S * D;
#pragma unroll
  for (int n = 0; n < NTILE; ++n) {
    *reinterpret_cast<__nv_bfloat162*>(out0 + n * 8) =
        __floats2bfloat162_rn(o[n][0] * i0, o[n][1] * i0);
    *reinterpret_cast<__nv_bfloat162*>(out1 + n * 8) =
        __floats2bfloat162_rn(o[n][2] * i1, o[n][3] * i1);
  }
}
#endif
