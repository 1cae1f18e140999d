//// kernel: score
// Prefill block scores on tensor cores (QSA.md §8.2, RUNTIME.md §6.3 producer `mpp`): the reduced
// plane of one chunk of rows, never the per-head planes, plus the per-chunk summaries the top-k
// kernel of selector.cu reads.
// index_q [1, 4, C, 128] bf16 (row-contiguous), pooled [1, cap, 128] bf16, pos [C] int32
// -> adj [C, npad] float32 (npad = cap rounded up to 64; only b < nb(row) meaningful),
//    summ [C, npad / 32, L] uint32 (the L largest order keys of each 32-block chunk, descending,
//    0 = none; chunks past a row's blocks unwritten), nbs [C] int32 = min((p + 1) / RATIO, cap).
// CTA: 64 rows x 64 blocks, 4 warps; warp w owns rows 16w..16w+15. Per head, mma.sync
// m16n8k16 (bf16 in, float32 accumulate) over d = 0..127, then ReLU per head, head sum in
// order h = 0..3, float32 division by sqrt(128), minus float32(b) * 1e-12 (all rounded, no FMA).
// Grid (C / 64 row tiles) * (npad / 64 block tiles) CTAs of 128 threads, block tiles fastest.
// Dynamic shared memory: q tile 64 x 4 x (128 + 8) bf16, key tile 64 x (128 + 8) bf16, adj tile
// 64 x 65 float32. Template: RATIO, L.
constexpr int DI = 128, HI = 4, TR = 64, TB = 64, QS = HI * DI + 8, KS = DI + 8, AS = TB + 1;
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
__nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(qsa_dyn_smem);
__nv_bfloat16* k_s = q_s + TR * QS;
float* a_s = reinterpret_cast<float*>(k_s + TB * KS);
__shared__ int nb_s[TR];
const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
const int C = index_q_shape[2];
const int cap = pooled_shape[1];
const int npad = (cap + TB - 1) / TB * TB;
const int n_btiles = npad / TB;
const int rt = blockIdx.x / n_btiles, bt = blockIdx.x % n_btiles;
const int r0 = rt * TR, b0 = bt * TB;
if (tid < TR) {
  const int r = r0 + tid;
  int nb = 0;
  if (r < C) {
    const int p = pos[r];
    nb = p >= 0 ? (p + 1) / RATIO : 0;
    nb = nb < cap ? nb : cap;
    if (bt == 0) nbs[r] = nb;
  }
  nb_s[tid] = nb;
}
__syncthreads();
int maxnb = 0;
for (int i = 0; i < TR; ++i) maxnb = max(maxnb, nb_s[i]);
if (b0 >= maxnb) return;  // uniform: no row of the tile sees these blocks

// Stage the tile's queries (rows past C are zero) and block keys (blocks past cap are zero).
for (int idx = tid; idx < TR * HI * (DI / 8); idx += 128) {
  const int r = idx / (HI * DI / 8), rem = idx % (HI * DI / 8), h = rem / (DI / 8), c = rem % (DI / 8);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (r0 + r < C)
    v = *reinterpret_cast<const uint4*>(index_q + ((long long)h * C + r0 + r) * DI + c * 8);
  *reinterpret_cast<uint4*>(q_s + r * QS + h * DI + c * 8) = v;
}
for (int idx = tid; idx < TB * (DI / 8); idx += 128) {
  const int n = idx / (DI / 8), c = idx % (DI / 8);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (b0 + n < cap) v = *reinterpret_cast<const uint4*>(pooled + (long long)(b0 + n) * DI + c * 8);
  *reinterpret_cast<uint4*>(k_s + n * KS + c * 8) = v;
}
__syncthreads();

// Fragments (PTX m16n8k16): A row = lane / 4 (+8), k = 2 * (lane % 4) (+8); B n = lane / 4,
// k = 2 * (lane % 4) (+8); C row = lane / 4 (+8), col = 2 * (lane % 4) + {0, 1}.
const int ar = warp * 16 + (lane >> 2), ak = 2 * (lane & 3);
float tot[TB / 8][4];
#pragma unroll
for (int h = 0; h < HI; ++h) {
  float acc[TB / 8][4];
#pragma unroll
  for (int nt = 0; nt < TB / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < DI / 16; ++ks) {
    const __nv_bfloat16* qa = q_s + ar * QS + h * DI + ks * 16 + ak;
    const unsigned a0 = *reinterpret_cast<const unsigned*>(qa);
    const unsigned a1 = *reinterpret_cast<const unsigned*>(qa + 8 * QS);
    const unsigned a2 = *reinterpret_cast<const unsigned*>(qa + 8);
    const unsigned a3 = *reinterpret_cast<const unsigned*>(qa + 8 * QS + 8);
#pragma unroll
    for (int nt = 0; nt < TB / 8; ++nt) {
      const __nv_bfloat16* kb = k_s + (nt * 8 + (lane >> 2)) * KS + ks * 16 + ak;
      const unsigned b0r = *reinterpret_cast<const unsigned*>(kb);
      const unsigned b1r = *reinterpret_cast<const unsigned*>(kb + 8);
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(acc[nt][0]), "+f"(acc[nt][1]), "+f"(acc[nt][2]), "+f"(acc[nt][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0r), "r"(b1r));
    }
  }
#pragma unroll
  for (int nt = 0; nt < TB / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float v = acc[nt][e] > 0.f ? acc[nt][e] : 0.f;
      tot[nt][e] = h == 0 ? v : __fadd_rn(tot[nt][e], v);
    }
}
#pragma unroll
for (int nt = 0; nt < TB / 8; ++nt)
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int r = ar + (e >> 1) * 8, c = nt * 8 + ak + (e & 1);
    const float score = __fdiv_rn(tot[nt][e], 11.313708305358887f);
    a_s[r * AS + c] = __fsub_rn(score, __fmul_rn((float)(b0 + c), 1e-12f));
  }
__syncthreads();

// Write the plane and the summaries: warp w takes rows w, w + 4, ...; a lane per block.
for (int r = warp; r < TR; r += 4) {
  const int row = r0 + r;
  if (row >= C) break;
  const int nb = nb_s[r];
#pragma unroll
  for (int half = 0; half < TB / 32; ++half) {
    const int c = half * 32 + lane, b = b0 + c;
    const float a = a_s[r * AS + c];
    if (b < npad) adj[(long long)row * npad + b] = a;
    if (b0 + half * 32 >= nb) continue;  // uniform per warp: chunk past the row's blocks
    unsigned key = b < nb ? qsa::ord_key(a) : 0u;
    unsigned* srow = summ + ((long long)row * (npad / 32) + (b0 + half * 32) / 32) * L;
#pragma unroll
    for (int j = 0; j < L; ++j) {
      const unsigned m = __reduce_max_sync(qsa::FULL_MASK, key);
      if (lane == 0) srow[j] = m;
      const unsigned bal = __ballot_sync(qsa::FULL_MASK, key == m && m != 0u);
      if (bal != 0u && lane == __ffs(bal) - 1) key = 0u;
    }
  }
}
