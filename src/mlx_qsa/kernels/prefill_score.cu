//// kernel: score
// Prefill block scores on tensor cores (QSA.md §8.2, RUNTIME.md §6.3 producer `mpp`): the reduced
// plane of one chunk of rows, never the per-head planes, plus the per-chunk summaries the top-k
// kernel of selector.cu reads.
// index_q [1, 4, C, 128] bf16 (row-contiguous), pooled [1, cap, 128] bf16, pos [C] int32
// -> adj [C, npad] float32 (npad = cap rounded up to 64; only b < nb(row) meaningful),
//    summ [C, npad / 32, L] uint32 (the L largest order keys of each 32-block chunk, descending,
//    0 = none; chunks past a row's blocks unwritten), nbs [C] int32 = min((p + 1) / RATIO, cap).
// CTA: 64 rows x a run of GB tiles of 64 blocks, NW warps (4 or 8); warp w owns rows
// 16 (w % 4)..+15 and, with 8 warps, half w / 4 of each tile (4 warps run both halves). The
// rows' queries stay in shared memory for the run (loaded once, not once per tile) while the key
// tiles stream through two cp.async buffers. Per 32-block half tile a warp runs mma.sync
// m16n8k16 (bf16 in, float32 accumulate) over d = 0..127 for the 4 heads, sharing each k-step's
// key fragments between heads; then ReLU per head, head sum in order h = 0..3, float32 division
// by sqrt(128), minus float32(b) * 1e-12 (all rounded, no FMA). The plane goes out from
// registers; a row's 32 scores of the half sit in 4 lanes (8 each), so its summary is a sort of
// 8 in registers and two merges with the other lanes (shuffles), not 8 warp-wide reductions.
// Grid (C / 64 row tiles) * ceil(npad / 64 / GB) CTAs of 32 NW threads, runs fastest. With 8
// warps an SM holds twice the warps in the same shared memory (two CTAs of ~101 KB), which
// hides more of the ldmatrix -> mma chains and the epilogue; the scores are the same bits.
// Dynamic shared memory: q tile 64 x (4 x 128 + 8) bf16, 2 key tiles 64 x (128 + 8) bf16.
// Template: RATIO, L (8), GB, NW.
constexpr int DI = 128, HI = 4, TR = 64, TB = 64, QS = HI * DI + 8, KS = DI + 8;
static_assert(L == 8, "the summary sort keeps 8 keys per chunk");
static_assert(NW == 4 || NW == 8, "4 row groups of 16, one or both tile halves a warp");
constexpr int NTH = 32 * NW;
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
__nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(qsa_dyn_smem);
__nv_bfloat16* k_s = q_s + TR * QS;  // two buffers of TB * KS
__shared__ int nb_s[TR];
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int C = index_q_shape[2];
const int cap = pooled_shape[1];
const int npad = (cap + TB - 1) / TB * TB;
const int n_btiles = npad / TB;
const int n_runs = (n_btiles + GB - 1) / GB;
const int rt = blockIdx.x / n_runs, run = blockIdx.x % n_runs;
const int r0 = rt * TR;
if (tid < TR) {
  const int r = r0 + tid;
  int nb = 0;
  if (r < C) {
    const int p = pos[r];
    nb = p >= 0 ? (p + 1) / RATIO : 0;
    nb = nb < cap ? nb : cap;
    if (run == 0) nbs[r] = nb;
  }
  nb_s[tid] = nb;
}
__syncthreads();
int maxnb = 0;
for (int i = 0; i < TR; ++i) maxnb = max(maxnb, nb_s[i]);
const int t_begin = run * GB;
const int t_end = min(min(t_begin + GB, n_btiles), (maxnb + TB - 1) / TB);
if (t_begin >= t_end) return;  // uniform: no row of the tile sees these blocks

// 16-byte cp.async, zero-filled when !ok (rows past C, blocks past cap are zero)
auto cp16 = [](void* dst, const void* src, bool ok) {
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(ok ? 16u : 0u));
};
auto commit = [] { asm volatile("cp.async.commit_group;\n" ::); };
for (int idx = tid; idx < TR * HI * (DI / 8); idx += NTH) {
  const int r = idx / (HI * DI / 8), rem = idx % (HI * DI / 8), h = rem / (DI / 8), c = rem % (DI / 8);
  const bool ok = r0 + r < C;
  cp16(q_s + r * QS + h * DI + c * 8, index_q + ((long long)h * C + (ok ? r0 + r : 0)) * DI + c * 8, ok);
}
auto load_keys = [&](int buf, int t) {
  for (int idx = tid; idx < TB * (DI / 8); idx += NTH) {
    const int n = idx / (DI / 8), c = idx % (DI / 8), b = t * TB + n;
    const bool ok = b < cap;
    cp16(k_s + buf * TB * KS + n * KS + c * 8, pooled + (long long)(ok ? b : 0) * DI + c * 8, ok);
  }
};
load_keys(0, t_begin);
commit();

// Fragments (PTX m16n8k16): C row = lane / 4 (+8), col = 2 * (lane % 4) + {0, 1}. ldmatrix.x4
// addresses: A (q) rows lane % 16, k half lane / 16; B (keys, stored [n][k]) n-tile lane / 16,
// n lane % 8, k half lane / 8 % 2 -> {b0, b1} of two consecutive n-tiles.
const int wr = (warp & 3) * 16, qr = lane >> 2, ak = 2 * (lane & 3);
const unsigned qa_base =
    (unsigned)__cvta_generic_to_shared(q_s + (wr + (lane & 15)) * QS + (lane >> 4) * 8);
const int rowA = r0 + wr + qr, rowB = rowA + 8;
const int nbA = nb_s[wr + qr], nbB = nb_s[wr + qr + 8];
for (int t = t_begin; t < t_end; ++t) {
  const int buf = (t - t_begin) & 1;
  if (t + 1 < t_end) load_keys(buf ^ 1, t + 1);
  commit();
  asm volatile("cp.async.wait_group 1;\n" ::);  // the queries and tile t have landed
  __syncthreads();
  const unsigned kb_base = (unsigned)__cvta_generic_to_shared(
      k_s + buf * TB * KS + ((lane >> 4) * 8 + (lane & 7)) * KS + ((lane >> 3) & 1) * 8);
#pragma unroll
  for (int j = 0; j < 8 / NW; ++j) {  // the tile halves this warp runs
    const int hf = NW == 8 ? warp >> 2 : j;
    const int c0 = t * TB + hf * 32;  // first block of this half
    float acc[HI][4][4];
#pragma unroll
    for (int h = 0; h < HI; ++h)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[h][nt][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DI / 16; ++ks) {
      unsigned bf[4][2];
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {
        const unsigned addr = kb_base + ((hf * 4 + pr * 2) * 8 * KS + ks * 16) * 2;
        unsigned r[4];
        qsa::ldmatrix_x4(r, addr);
        bf[2 * pr][0] = r[0];
        bf[2 * pr][1] = r[1];
        bf[2 * pr + 1][0] = r[2];
        bf[2 * pr + 1][1] = r[3];
      }
#pragma unroll
      for (int h = 0; h < HI; ++h) {
        unsigned a[4];
        qsa::ldmatrix_x4(a, qa_base + (h * DI + ks * 16) * 2);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) qsa::mma_16816(acc[h][nt], a, bf[nt][0], bf[nt][1]);
      }
    }
    // scores of rows A (e = 0, 1) and B (e = 2, 3); keys[i], i = 2 * nt + (e & 1), of this lane
    unsigned keyA[8], keyB[8];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float tot = acc[0][nt][e] > 0.f ? acc[0][nt][e] : 0.f;
#pragma unroll
        for (int h = 1; h < HI; ++h) tot = __fadd_rn(tot, acc[h][nt][e] > 0.f ? acc[h][nt][e] : 0.f);
        const int b = c0 + nt * 8 + ak + (e & 1);
        v[e] = qsa::adjusted_score(tot, b);
        const unsigned key = b < ((e >> 1) ? nbB : nbA) ? qsa::ord_key(v[e]) : 0u;
        ((e >> 1) ? keyB : keyA)[2 * nt + (e & 1)] = key;
      }
      const int col = c0 + nt * 8 + ak;
      if (rowA < C) *reinterpret_cast<float2*>(adj + (long long)rowA * npad + col) = make_float2(v[0], v[1]);
      if (rowB < C) *reinterpret_cast<float2*>(adj + (long long)rowB * npad + col) = make_float2(v[2], v[3]);
    }
    qsa::top8_of_quad(keyA);
    qsa::top8_of_quad(keyB);
    if ((lane & 3) == 0) {
      const long long chunk = c0 / 32;
      if (rowA < C && c0 < nbA) {
        uint4* d = reinterpret_cast<uint4*>(summ + ((long long)rowA * (npad / 32) + chunk) * L);
        d[0] = make_uint4(keyA[0], keyA[1], keyA[2], keyA[3]);
        d[1] = make_uint4(keyA[4], keyA[5], keyA[6], keyA[7]);
      }
      if (rowB < C && c0 < nbB) {
        uint4* d = reinterpret_cast<uint4*>(summ + ((long long)rowB * (npad / 32) + chunk) * L);
        d[0] = make_uint4(keyB[0], keyB[1], keyB[2], keyB[3]);
        d[1] = make_uint4(keyB[4], keyB[5], keyB[6], keyB[7]);
      }
    }
  }
  __syncthreads();  // every warp is done with this buffer before it is refilled
}
asm volatile("cp.async.wait_group 0;\n" ::);
