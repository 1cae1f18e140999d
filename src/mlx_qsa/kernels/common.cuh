// Device helpers shared by the QSA decode and prefill kernels. Everything lives in namespace
// qsa; a kernel that uses it gets this file as an `#include` line in `header=` (_launch.include).

namespace qsa {

constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// Order-preserving map of float32 onto uint32 (larger float -> larger key; -0 < +0).
__device__ __forceinline__ unsigned ord_key(float f) {
  unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_float(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Two bf16 packed in a 32-bit word: the lower address is the low half.
__device__ __forceinline__ float bf_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  f[0] = bf_lo(v.x); f[1] = bf_hi(v.x);
  f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
  f[4] = bf_lo(v.z); f[5] = bf_hi(v.z);
  f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
}

__device__ __forceinline__ float bf_to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// a + q[0..7] . k[0..7] as eight fmaf in order d = 0..7 (q: 16-byte aligned float32).
__device__ __forceinline__ float fma8(float a, const float* q, const float (&k)[8]) {
  const float4 qa = *reinterpret_cast<const float4*>(q);
  const float4 qb = *reinterpret_cast<const float4*>(q + 4);
  a = fmaf(qa.x, k[0], a); a = fmaf(qa.y, k[1], a);
  a = fmaf(qa.z, k[2], a); a = fmaf(qa.w, k[3], a);
  a = fmaf(qb.x, k[4], a); a = fmaf(qb.y, k[5], a);
  a = fmaf(qb.z, k[6], a); a = fmaf(qb.w, k[7], a);
  return a;
}

// x / sqrt(128) rounded to nearest, the bits of __fdiv_rn(x, 11.313708305358887f) (C below),
// without its division routine: q = x * R with R = 1 / C rounded, then one correction from the
// exact residual x - q C (an FMA). __fdiv_rn called that routine for most scores: a third of the
// prefill score producer's warp samples (Nsight Compute, H100, 2026-12-07). Checked bit for bit
// against __fdiv_rn over every float32 (exact_div.cu, tests/test_cuda_exact_div.py). +0 (a sum
// of ReLUs that are all zero: a warp nearly always has one) takes the fast form too, so that
// the warp does not also run __fdiv_rn; outside +0 and [2^-100, 2^100] (tiny and huge sums,
// -0, inf, NaN) __fdiv_rn itself runs. QSA_IEEE_DIV keeps __fdiv_rn everywhere (A/B timing).
__device__ __forceinline__ float div_sqrt128(float x) {
  constexpr float C = 11.313708305358887f, R = 0.0883883461356163f;  // 0x413504f3, 0x3db504f3
#ifndef QSA_IEEE_DIV
  if ((x >= 0x1p-100f && x <= 0x1p100f) || __float_as_uint(x) == 0u) {
    const float q = __fmul_rn(x, R);
    return __fmaf_rn(__fmaf_rn(-q, C, x), R, q);
  }
#endif
  return __fdiv_rn(x, C);
}

// The indexer's block score from its heads' dot products (QSA.md §8.2): ReLU per head, head
// sum in order h = 0..HI-1, over sqrt(d_I = 128), minus the id adjustment b * 1e-12, each step
// a float32 operation rounded to nearest (no contraction), as the portable twin computes it.
__device__ __forceinline__ float adjusted_score(float relu_sum, int b) {
  return __fsub_rn(div_sqrt128(relu_sum), __fmul_rn((float)b, 1e-12f));
}

template <int HI>
__device__ __forceinline__ float relu_head_sum(const float (&acc)[HI]) {
  float tot = acc[0] > 0.f ? acc[0] : 0.f;
#pragma unroll
  for (int h = 1; h < HI; ++h) tot = __fadd_rn(tot, acc[h] > 0.f ? acc[h] : 0.f);
  return tot;
}

// The L largest keys of a warp's 32 (one a lane; 0 = no block), descending with duplicates kept
// and 0 past the last: lane 0 writes them to srow[0..L). Every lane of the warp must call it.
template <int L>
__device__ __forceinline__ void warp_top_keys(unsigned key, unsigned* srow) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int j = 0; j < L; ++j) {
    const unsigned m = __reduce_max_sync(FULL_MASK, key);
    if (lane == 0) srow[j] = m;
    const unsigned bal = __ballot_sync(FULL_MASK, key == m && m != 0u);
    if (bal != 0u && lane == __ffs(bal) - 1) key = 0u;
  }
}

// Asynchronous 16-byte global -> shared copy (sm_80+); `valid` false zero-fills the destination.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes)
               : "memory");
}

// Waits for every cp.async this thread issued (the caller then syncs the block).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Two floats rounded to bf16 in one 32-bit word, `lo` in the low half (an mma operand pair).
// Tensor-core fragments (sm_80+): four 8x8 b16 matrices from shared memory (each lane gives the
// address of one matrix row: lanes 8i..8i+7 the rows of matrix i), plain or transposed, and
// d += a b by mma.sync m16n8k16 with bf16 operands and float32 accumulation.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// O += P V over one k16 step of 16 tokens, for an m16 tile of query rows and D value columns:
// p0, p1 are the softmax weights of the step's two n8 score tiles in the mma C layout, rounded to
// bf16 as the A operand (the C layout of two n8 tiles is the A layout of one k16 step); vrow is
// this lane's ldmatrix.trans row address in the V tile (tokens (lane / 8 % 2) * 8 + lane % 8,
// dims (lane / 16) * 8: b0, b1 of n tile 2c, then of n tile 2c + 1), 16 dims every 32 bytes.
template <int D>
__device__ __forceinline__ void pv_k16(float (&o)[D / 8][4], const float (&p0)[4],
                                       const float (&p1)[4], unsigned vrow) {
  const unsigned pa[4] = {pack_bf2(p0[0], p0[1]), pack_bf2(p0[2], p0[3]), pack_bf2(p1[0], p1[1]),
                          pack_bf2(p1[2], p1[3])};
#pragma unroll
  for (int c = 0; c < D / 16; ++c) {
    unsigned v[4];
    ldmatrix_x4_trans(v, vrow + c * 32);
    mma_16816(o[2 * c], pa, v[0], v[1]);
    mma_16816(o[2 * c + 1], pa, v[2], v[3]);
  }
}

// One online-softmax step (base 2) of an m16 tile's scores sc over N8 n8 column tiles, in the
// mma C layout (a lane holds row lane / 4 in e = 0, 1 and row lane / 4 + 8 in e = 2, 3). Bit
// 2 nt + e % 2 of vis says whether the lane's column of tile nt is seen; the others score -inf.
// Scales the seen scores by sl2 (the softmax scale times log2 e), moves the rows' running maxima
// m0, m1 (over the quad of lanes sharing a row) and sums l0, l1, rescales O, and leaves the
// weights 2^(s - m) in sc. A row that has seen nothing keeps m = -inf and weights 0.
template <int N8, int NTILE>
__device__ __forceinline__ void online_softmax(float (&sc)[N8][4], unsigned vis, float sl2,
                                               float& m0, float& m1, float& l0, float& l1,
                                               float (&o)[NTILE][4]) {
  float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
  for (int nt = 0; nt < N8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool ok = (vis >> (2 * nt + (e & 1))) & 1u;
      sc[nt][e] = ok ? sc[nt][e] * sl2 : neg_inf();
      if (e < 2) mx0 = fmaxf(mx0, sc[nt][e]);
      else mx1 = fmaxf(mx1, sc[nt][e]);
    }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, off));
  }
  const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
  // a row that has seen nothing yet keeps max -inf: measure from 0 (its weights are all 0)
  const float b0 = n0 == neg_inf() ? 0.f : n0, b1 = n1 == neg_inf() ? 0.f : n1;
  const float al0 = exp2f(m0 - b0), al1 = exp2f(m1 - b1);
  m0 = n0;
  m1 = n1;
#pragma unroll
  for (int nt = 0; nt < N8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[nt][e] = exp2f(sc[nt][e] - (e < 2 ? b0 : b1));
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < N8; ++nt) {
    s0 += sc[nt][0] + sc[nt][1];
    s1 += sc[nt][2] + sc[nt][3];
  }
  l0 = l0 * al0 + s0;
  l1 = l1 * al1 + s1;
  if (__any_sync(FULL_MASK, al0 != 1.f || al1 != 1.f)) {  // x * 1 is exact: skip it
#pragma unroll
    for (int n = 0; n < NTILE; ++n) {
      o[n][0] *= al0;
      o[n][1] *= al0;
      o[n][2] *= al1;
      o[n][3] *= al1;
    }
  }
}

// Adds 1 to hist[digit] for every active lane; lanes sharing a digit add once together
// (radix digits of similar floats collide heavily). Every lane of the warp must call it.
__device__ __forceinline__ void hist_add(unsigned* hist, unsigned digit, bool active) {
  unsigned act = __ballot_sync(FULL_MASK, active);
  if (active) {
    unsigned peers = __match_any_sync(act, digit);
    if ((int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[digit], (unsigned)__popc(peers));
  }
}

struct SelectResult {
  unsigned t;  // the k-th largest key
  int k_rem;   // how many keys equal to t are needed (k - #keys > t), >= 1
  int n_eq;    // how many keys equal t
};

// Exact k-th largest of the keys that get(i, key) marks as participating, i in [0, n),
// by up to four 8-bit radix passes. 1 <= k <= number of participants. All NT threads call it.
// With last_shift 8 or 16 it stops early: t is then the k-th largest key with its low
// last_shift bits cleared (a lower bound of it; k_rem and n_eq refer to that prefix).
// It also stops as soon as every key sharing the k-th largest's prefix is needed (k_rem ==
// n_eq): t is then that prefix with its low bits cleared, and {key >= t} is exactly the k
// largest, as a caller that takes key > t and every key == t (k_rem == n_eq) expects.
// hist: 512 words (two histograms: a pass fills one while the other is cleared, so a pass
// costs two block barriers), ctl: 4 words of shared memory.
template <int NT, typename Get>
__device__ SelectResult block_select_desc(int n, int k, Get get, unsigned* hist, unsigned* ctl,
                                          int last_shift = 0) {
  const int tid = threadIdx.x;
  unsigned prefix = 0, mask = 0;
  int krem = k, neq = 0;
  for (int i = tid; i < 256; i += NT) hist[i] = 0;
  __syncthreads();
  int buf = 0;
  for (int shift = 24; shift >= last_shift; shift -= 8, buf ^= 1) {
    unsigned* h = hist + 256 * buf;
    for (int i = tid; i < 256; i += NT) hist[256 * (buf ^ 1) + i] = 0;  // the next pass's
    for (int base = 0; base < n; base += NT) {
      int i = base + tid;
      unsigned key = 0;
      bool act = false;
      if (i < n) act = get(i, key) && ((key & mask) == prefix);
      hist_add(h, (key >> shift) & 255u, act);
    }
    __syncthreads();
    if (tid < 32) {
      const int lane = tid;
      unsigned c[8];
      unsigned local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = h[255 - 8 * lane - j];
        local += c[j];
      }
      unsigned incl = local;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        unsigned v = __shfl_up_sync(FULL_MASK, incl, off);
        if (lane >= off) incl += v;
      }
      unsigned excl = incl - local;
      unsigned kr = (unsigned)krem;
      if (excl < kr && kr <= incl) {
        unsigned acc = excl;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (acc < kr && kr <= acc + c[j]) {
            ctl[0] = (unsigned)(255 - 8 * lane - j);
            ctl[1] = kr - acc;
            ctl[2] = c[j];
          }
          acc += c[j];
        }
      }
    }
    __syncthreads();
    unsigned digit = ctl[0];
    krem = (int)ctl[1];
    neq = (int)ctl[2];
    prefix |= digit << shift;
    mask |= 255u << shift;
    if (krem == neq) break;  // uniform: every thread read the same ctl
  }
  __syncthreads();
  return SelectResult{prefix, krem, neq};
}

// Exclusive prefix sum over the block; buf holds NT/32 + 1 ints of shared memory.
template <int NT>
__device__ int block_excl_scan(int v, int* buf, int* total) {
  constexpr int NW = NT / 32;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  int x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    int y = __shfl_up_sync(FULL_MASK, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) buf[w] = x;
  __syncthreads();
  if (w == 0) {
    int s = lane < NW ? buf[lane] : 0;
    int si = s;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      int y = __shfl_up_sync(FULL_MASK, si, off);
      if (lane >= off) si += y;
    }
    if (lane < NW) buf[lane] = si - s;
    if (lane == NW - 1) buf[NW] = si;
  }
  __syncthreads();
  int res = buf[w] + x - v;
  *total = buf[NW];
  __syncthreads();
  return res;
}

// ---------------------------------------------------------------------------------------------
// Split-K partial attention of G query heads (one KV head) over up to TOK tokens.
// tok_of(i) gives the token row of slot i, or -1 for an empty slot; it is called once per slot
// and its result kept in tok_s (shared, TOK ints). Writes, per head hh,
// the unnormalised float32 output o[hh * o_hstride + d] = sum_i exp(s_i - m) v_i and
// ml[hh * ml_hstride + {0, 1}] = (m, l) with m = max_i s_i (-inf when no token), l = sum exp.
// Shared memory: attn_smem_bytes<D, G, TOK, NT>() bytes at smem (16-byte aligned).
template <int D, int G, int TOK, int NT>
struct Attn {
  static constexpr int KPAD = D + 8;        // bf16 per K row in shared memory (bank spread)
  static constexpr int NG = NT / TOK;       // threads per token in the QK phase
  static constexpr int CPL = D / (8 * NG);  // 8-wide chunks per thread in the QK phase
  static constexpr int TG = NT / D;         // token groups in the PV phase
  static constexpr int TPG = TOK / TG;      // tokens per PV group
  static constexpr int NW = NT / 32;
  static constexpr int SPW = TOK / NW;      // slots a warp stages
  static constexpr int QPT = (G * D + NT - 1) / NT;  // query elements a thread stages
  static_assert(NT % TOK == 0 && 32 % NG == 0 && NG >= 1, "TOK must divide NT, NT/TOK divide 32");
  static_assert(D % (8 * NG) == 0 && CPL >= 1, "D must be a multiple of 8 * NT / TOK");
  static_assert(NT % D == 0 && TOK % TG == 0 && TPG % 4 == 0, "PV split");
  static_assert(TOK % NW == 0 && SPW <= 32, "whole slots per warp");
  static constexpr int K_BYTES = TOK * KPAD * 2;
  static constexpr int V_BYTES = TOK * D * 2;
  static constexpr int Q_BYTES = G * D * 4;
  static constexpr int S_BYTES = G * TOK * 4;
  static constexpr int R_BYTES = TG > 1 ? TG * G * D * 4 : 0;
  static constexpr int BYTES = K_BYTES + V_BYTES + Q_BYTES + S_BYTES + R_BYTES;
};

template <int D, int G, int TOK, int NT, typename TokOf>
__device__ void partial_attention(
    const __nv_bfloat16* q, long long q_hstride,
    const __nv_bfloat16* kbase, long long k_rstride,
    const __nv_bfloat16* vbase, long long v_rstride,
    TokOf tok_of, int* tok_s, float scale,
    float* o, long long o_hstride,
    float* ml, long long ml_hstride,
    unsigned char* smem) {
  using A = Attn<D, G, TOK, NT>;
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* Vs = reinterpret_cast<__nv_bfloat16*>(smem + A::K_BYTES);
  float* qs = reinterpret_cast<float*>(smem + A::K_BYTES + A::V_BYTES);
  float* sc = reinterpret_cast<float*>(smem + A::K_BYTES + A::V_BYTES + A::Q_BYTES);
  float* red = reinterpret_cast<float*>(smem + A::K_BYTES + A::V_BYTES + A::Q_BYTES + A::S_BYTES);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  constexpr int C8 = D / 8;

  // Stage: the query loads, the slot lookups and then the K/V copies are all in flight at once
  // (one dependent round trip: slot -> rows). Warp w looks up its SPW slots itself and copies
  // their K and V rows by cp.async, zero-filling empty slots, with no block barrier between.
  float qv[A::QPT];
#pragma unroll
  for (int j = 0; j < A::QPT; ++j) {
    const int idx = j * NT + tid;
    const int hh = idx / D, d = idx - (idx / D) * D;
    qv[j] = idx < G * D ? bf_to_f(q[hh * q_hstride + d]) : 0.f;
  }
  int my_t = -1;
  if (lane < A::SPW) {
    my_t = tok_of(w * A::SPW + lane);
    tok_s[w * A::SPW + lane] = my_t;
  }
#pragma unroll
  for (int j = 0; j < A::SPW; ++j) {
    const int i = w * A::SPW + j;
    const int t = __shfl_sync(FULL_MASK, my_t, j);
    const bool ok = t >= 0;
    const long long toff = ok ? (long long)t : 0;
#pragma unroll
    for (int c = lane; c < C8; c += 32) {
      cp_async16(Ks + i * A::KPAD + c * 8, kbase + toff * k_rstride + c * 8, ok);
      cp_async16(Vs + i * D + c * 8, vbase + toff * v_rstride + c * 8, ok);
    }
  }
#pragma unroll
  for (int j = 0; j < A::QPT; ++j) {
    const int idx = j * NT + tid;
    if (idx < G * D) qs[idx] = qv[j];
  }
  cp_async_wait_all();
  __syncthreads();

  // QK: thread (i, g) sums its chunks, the NG lanes of a token reduce by shuffles.
  {
    const int i = tid / A::NG, g = tid - (tid / A::NG) * A::NG;
    float acc[G];
#pragma unroll
    for (int h = 0; h < G; ++h) acc[h] = 0.f;
#pragma unroll
    for (int c = 0; c < A::CPL; ++c) {
      const int ch = c * A::NG + g;
      float kf[8];
      unpack8(*reinterpret_cast<const uint4*>(Ks + i * A::KPAD + ch * 8), kf);
#pragma unroll
      for (int h = 0; h < G; ++h) acc[h] = fma8(acc[h], qs + h * D + ch * 8, kf);
    }
#pragma unroll
    for (int off = A::NG / 2; off >= 1; off >>= 1) {
#pragma unroll
      for (int h = 0; h < G; ++h) acc[h] += __shfl_xor_sync(FULL_MASK, acc[h], off);
    }
    if (g == 0) {
      const bool ok = tok_s[i] >= 0;
#pragma unroll
      for (int h = 0; h < G; ++h) sc[h * TOK + i] = ok ? acc[h] * scale : neg_inf();
    }
  }
  __syncthreads();

  // Softmax statistics per head (one warp per head), probabilities back into sc.
  {
    constexpr int NW = NT / 32;
    const int lane = tid & 31, w = tid >> 5;
    for (int h = w; h < G; h += NW) {
      float m = neg_inf();
      for (int i = lane; i < TOK; i += 32) m = fmaxf(m, sc[h * TOK + i]);
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
      float l = 0.f;
      for (int i = lane; i < TOK; i += 32) {
        float s = sc[h * TOK + i];
        float p = (m == neg_inf() || s == neg_inf()) ? 0.f : expf(s - m);
        sc[h * TOK + i] = p;
        l += p;
      }
#pragma unroll
      for (int off = 16; off >= 1; off >>= 1) l += __shfl_xor_sync(FULL_MASK, l, off);
      if (lane == 0) {
        ml[h * ml_hstride] = m;
        ml[h * ml_hstride + 1] = l;
      }
    }
  }
  __syncthreads();

  // PV: thread (d, token group) accumulates its tokens for every head.
  {
    const int d = tid % D, tg = tid / D;
    float acc[G];
#pragma unroll
    for (int h = 0; h < G; ++h) acc[h] = 0.f;
    const int i0 = tg * A::TPG;
#pragma unroll 2
    for (int i = i0; i < i0 + A::TPG; i += 4) {
      float v0 = bf_to_f(Vs[(i + 0) * D + d]);
      float v1 = bf_to_f(Vs[(i + 1) * D + d]);
      float v2 = bf_to_f(Vs[(i + 2) * D + d]);
      float v3 = bf_to_f(Vs[(i + 3) * D + d]);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float4 p = *reinterpret_cast<const float4*>(sc + h * TOK + i);
        float a = acc[h];
        a = fmaf(p.x, v0, a); a = fmaf(p.y, v1, a);
        a = fmaf(p.z, v2, a); a = fmaf(p.w, v3, a);
        acc[h] = a;
      }
    }
    if constexpr (A::TG == 1) {
#pragma unroll
      for (int h = 0; h < G; ++h) o[h * o_hstride + d] = acc[h];
    } else {
#pragma unroll
      for (int h = 0; h < G; ++h) red[(tg * G + h) * D + d] = acc[h];
      __syncthreads();
      for (int idx = tid; idx < G * D; idx += NT) {
        int h = idx / D, dd = idx - (idx / D) * D;
        float s = 0.f;
#pragma unroll
        for (int gg = 0; gg < A::TG; ++gg) s += red[(gg * G + h) * D + dd];
        o[h * o_hstride + dd] = s;
      }
    }
  }
}

// Columns of one merge tile (_launch.merge_cols): a head row of D is D / merge_cols tiles.
template <int D>
__host__ __device__ constexpr int merge_cols() { return D < 128 ? D : 128; }

// Floats of the shared buffer merge_tile works in: (m, l) and weights of the splits, M and L,
// then (16-byte aligned) the sums of the split ranges.
template <int NSPLIT>
__host__ __device__ constexpr int merge_red_offset() { return (3 * NSPLIT + 2 + 3) / 4 * 4; }
template <int D, int NSPLIT, int NT>
__host__ __device__ constexpr int merge_smem_floats() {
  return merge_red_offset<NSPLIT>() + NT / (merge_cols<D>() / 4) * merge_cols<D>();
}

// Where a merged row goes without the output gate: bf16 out[rh * D + c], the layout [1, H, S, D]
// (rh = h * S + row). The gated form is gate.cuh's GatedOut.
template <int D>
struct PlainOut {
  __nv_bfloat16* out;
  __device__ __forceinline__ void store(int rh, int c, float v) const {
    out[(long long)rh * D + c] = __float2bfloat16(v);
  }
};

// Log-sum-exp merge of NSPLIT partials of row rh, columns [c0, c0 + COLS), by a block of NT
// threads: the row's partials are o[rh][NSPLIT][D] and ml[rh][NSPLIT][2]; `dst.store(rh, c, v)`
// writes column c (PlainOut above, or gate.cuh's GatedOut). No token at all -> 0. The order of
// every sum is fixed, so the bits do not depend on who merges:
// - the row's (m, l) are staged in shared memory; one warp takes their maximum M, the weights
//   w_s = exp(m_s - M) and L = sum w_s l_s (lane-strided, then a fixed shuffle tree);
// - thread (g, q) owns columns 4q..4q+3 (float4) of the g-th of SG = NT / (COLS / 4) contiguous
//   split ranges, so it has only a few loads, all issued before its sum (the merge is a
//   latency problem: one thread per column walking every split was ~16-deep load windows one
//   after another); it sums w_s o_s in split order, and the ranges' sums add in range order.
// buf: merge_smem_floats<D, NSPLIT, NT>() floats of shared memory, 16-byte aligned (a one-launch
// kernel lends its dynamic shared memory: static arrays here would push the partial kernels past
// the 48 KB a launch gets without opting in).
// CG: read the partials through L2 only (__ldcg), for a merge inside the kernel that wrote them.
// Every thread of the block must call it (it has block barriers).
template <int D, int NSPLIT, int NT, bool CG = false, class Out>
__device__ void merge_tile(const float* part_o, const float* part_ml, const Out& dst, int rh,
                           int c0, float* buf) {
  constexpr int COLS = merge_cols<D>();
  constexpr int CQ = COLS / 4;            // column quads
  constexpr int SG = NT / CQ;             // split ranges
  constexpr int SPG = (NSPLIT + SG - 1) / SG;  // splits of a range
  static_assert(NT % CQ == 0 && COLS % 4 == 0 && D % COLS == 0 && NT >= COLS, "merge tile");
  float(*ml_s)[2] = reinterpret_cast<float(*)[2]>(buf);
  float* w_s = buf + 2 * NSPLIT;
  float* stat_s = buf + 3 * NSPLIT;  // M, L
  float(*red_s)[COLS] = reinterpret_cast<float(*)[COLS]>(buf + merge_red_offset<NSPLIT>());
  const int tid = threadIdx.x, lane = tid & 31;
  for (int i = tid; i < NSPLIT * 2; i += NT) {
    const float* p = part_ml + (long long)rh * NSPLIT * 2 + i;
    (&ml_s[0][0])[i] = CG ? __ldcg(p) : *p;
  }
  __syncthreads();
  if (tid < 32) {
    float M = neg_inf();
    for (int s = lane; s < NSPLIT; s += 32) M = fmaxf(M, ml_s[s][0]);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL_MASK, M, off));
    float L = 0.f;
    for (int s = lane; s < NSPLIT; s += 32) {
      const float m = ml_s[s][0];
      const float wgt = (m == neg_inf() || M == neg_inf()) ? 0.f : expf(m - M);
      w_s[s] = wgt;
      L = fmaf(wgt, ml_s[s][1], L);
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) L += __shfl_xor_sync(FULL_MASK, L, off);
    if (lane == 0) {
      stat_s[0] = M;
      stat_s[1] = L;
    }
  }
  __syncthreads();
  const int g = tid / CQ, cq = tid - g * CQ;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (stat_s[0] != neg_inf()) {
    const float* po = part_o + (long long)rh * NSPLIT * D + c0 + 4 * cq;
    const int sb = g * SPG;
    float4 ov[SPG];
#pragma unroll
    for (int k = 0; k < SPG; ++k) {  // unconditional loads (clamped index): all in flight
      const float4* p = reinterpret_cast<const float4*>(po + (long long)min(sb + k, NSPLIT - 1) * D);
      ov[k] = CG ? __ldcg(p) : *p;
    }
#pragma unroll
    for (int k = 0; k < SPG; ++k) {
      if (sb + k < NSPLIT) {
        const float wgt = w_s[sb + k];
        acc.x = fmaf(wgt, ov[k].x, acc.x);
        acc.y = fmaf(wgt, ov[k].y, acc.y);
        acc.z = fmaf(wgt, ov[k].z, acc.z);
        acc.w = fmaf(wgt, ov[k].w, acc.w);
      }
    }
  }
  *reinterpret_cast<float4*>(&red_s[g][4 * cq]) = acc;
  __syncthreads();
  if (tid < COLS) {
    float res = 0.f;
    if (stat_s[0] != neg_inf()) {
      float sum = red_s[0][tid];
#pragma unroll
      for (int gg = 1; gg < SG; ++gg) sum += red_s[gg][tid];
      res = sum / stat_s[1];
    }
    dst.store(rh, c0 + tid, res);
  }
  __syncthreads();  // the shared arrays may be staged again by the caller's next tile
}

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The hand-off of a one-launch split-K kernel: every CTA calls it after writing its partials.
// ctr: two ints of a persistent zeroed pool (_launch.counter_slot), left zeroed again on exit.
// Each CTA takes a ticket; the last M to arrive (M = the merge tiles of R = H * S rows, at most
// 64) wait until all n_cta have arrived and merge a tile each (merge_tile: bits
// equal to the separate merge kernel's). The last merger to finish resets the counter,
// so the next launch on the stream finds it zeroed. Spinning is safe: a CTA waits only for
// CTAs that took earlier tickets or have yet to finish, and at most 64 wait (fewer than the SMs).
template <int D, int NSPLIT, int NT, class Out>
__device__ void merge_when_done(int* ctr, int n_cta, int R, const float* part_o,
                                const float* part_ml, const Out& dst, float* buf) {
  __shared__ int ticket_s;
  __threadfence();  // this thread's partials visible device-wide before the ticket
  __syncthreads();
  if (threadIdx.x == 0) ticket_s = atomicAdd(ctr, 1);
  __syncthreads();
  constexpr int TPR = D / merge_cols<D>();  // merge tiles per row
  const int tiles = R * TPR;
  const int M = min(min(n_cta, tiles), 64);  // 64: _launch.MERGERS_MAX
  const int mi = ticket_s - (n_cta - M);
  if (mi < 0) return;
  if (threadIdx.x == 0) {
    while (ld_acquire(ctr) < n_cta) __nanosleep(64);
  }
  __syncthreads();
  for (int tile = mi; tile < tiles; tile += M) {
    merge_tile<D, NSPLIT, NT, true>(part_o, part_ml, dst, tile / TPR,
                                    (tile % TPR) * merge_cols<D>(), buf);
  }
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(ctr + 1, 1) == M - 1) {  // every merger is past its wait
    ctr[0] = 0;
    ctr[1] = 0;
  }
}

// Compare-exchange putting the larger key first.
__device__ __forceinline__ void ce_desc(unsigned& a, unsigned& b) {
  const unsigned hi = max(a, b), lo = min(a, b);
  a = hi;
  b = lo;
}

// The 8 largest of the 32 keys a lane quad holds (lanes 4q..4q+3, 8 each), descending, left in
// every lane of the quad, duplicates kept: a 19-comparator sort of 8 in registers, then two
// bitonic merges with lanes ^1 and ^2. Every lane of the warp must call it.
__device__ __forceinline__ void top8_of_quad(unsigned (&k)[8]) {
  ce_desc(k[0], k[2]); ce_desc(k[1], k[3]); ce_desc(k[4], k[6]); ce_desc(k[5], k[7]);
  ce_desc(k[0], k[4]); ce_desc(k[1], k[5]); ce_desc(k[2], k[6]); ce_desc(k[3], k[7]);
  ce_desc(k[0], k[1]); ce_desc(k[2], k[3]); ce_desc(k[4], k[5]); ce_desc(k[6], k[7]);
  ce_desc(k[2], k[4]); ce_desc(k[3], k[5]);
  ce_desc(k[1], k[4]); ce_desc(k[3], k[6]);
  ce_desc(k[1], k[2]); ce_desc(k[3], k[4]); ce_desc(k[5], k[6]);
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    unsigned p[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = __shfl_xor_sync(FULL_MASK, k[i], m);
    // max(k[i], p[7 - i]) holds the 8 largest of both lists as a bitonic sequence
#pragma unroll
    for (int i = 0; i < 8; ++i) k[i] = max(k[i], p[7 - i]);
#pragma unroll
    for (int d = 4; d >= 1; d >>= 1)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if ((i & d) == 0) ce_desc(k[i], k[i + d]);
  }
}

}  // namespace qsa
