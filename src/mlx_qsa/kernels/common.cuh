// Device helpers shared by the QSA decode kernels (passed to MLX through `header=`).
// Everything lives in namespace qsa; MLX pastes this file before the generated kernel.

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

// The indexer's block score from its heads' dot products (QSA.md §8.2): ReLU per head, head
// sum in order h = 0..HI-1, over sqrt(d_I = 128), minus the id adjustment b * 1e-12, each step
// a float32 operation rounded to nearest (no contraction), as the portable twin computes it.
__device__ __forceinline__ float adjusted_score(float relu_sum, int b) {
  const float score = __fdiv_rn(relu_sum, 11.313708305358887f);
  return __fsub_rn(score, __fmul_rn((float)b, 1e-12f));
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
__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
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
// by four 8-bit radix passes. 1 <= k <= number of participants. All NT threads call it.
// With last_shift 8 or 16 it stops early: t is then the k-th largest key with its low
// last_shift bits cleared (a lower bound of it; k_rem and n_eq refer to that prefix).
// hist: 256 words, ctl: 4 words of shared memory.
template <int NT, typename Get>
__device__ SelectResult block_select_desc(int n, int k, Get get, unsigned* hist, unsigned* ctl,
                                          int last_shift = 0) {
  const int tid = threadIdx.x;
  unsigned prefix = 0, mask = 0;
  int krem = k, neq = 0;
  for (int shift = 24; shift >= last_shift; shift -= 8) {
    for (int i = tid; i < 256; i += NT) hist[i] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += NT) {
      int i = base + tid;
      unsigned key = 0;
      bool act = false;
      if (i < n) act = get(i, key) && ((key & mask) == prefix);
      hist_add(hist, (key >> shift) & 255u, act);
    }
    __syncthreads();
    if (tid < 32) {
      const int lane = tid;
      unsigned c[8];
      unsigned local = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[255 - 8 * lane - j];
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
// tok_s[i] (shared) is the token row of slot i, or -1 for an empty slot. Writes, per head hh,
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
  static_assert(NT % TOK == 0 && 32 % NG == 0 && NG >= 1, "TOK must divide NT, NT/TOK divide 32");
  static_assert(D % (8 * NG) == 0 && CPL >= 1, "D must be a multiple of 8 * NT / TOK");
  static_assert(NT % D == 0 && TOK % TG == 0 && TPG % 4 == 0, "PV split");
  static constexpr int K_BYTES = TOK * KPAD * 2;
  static constexpr int V_BYTES = TOK * D * 2;
  static constexpr int Q_BYTES = G * D * 4;
  static constexpr int S_BYTES = G * TOK * 4;
  static constexpr int R_BYTES = TG > 1 ? TG * G * D * 4 : 0;
  static constexpr int BYTES = K_BYTES + V_BYTES + Q_BYTES + S_BYTES + R_BYTES;
};

template <int D, int G, int TOK, int NT>
__device__ void partial_attention(
    const __nv_bfloat16* q, long long q_hstride,
    const __nv_bfloat16* kbase, long long k_rstride,
    const __nv_bfloat16* vbase, long long v_rstride,
    const int* tok_s, float scale,
    float* o, long long o_hstride,
    float* ml, long long ml_hstride,
    unsigned char* smem) {
  using A = Attn<D, G, TOK, NT>;
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* Vs = reinterpret_cast<__nv_bfloat16*>(smem + A::K_BYTES);
  float* qs = reinterpret_cast<float*>(smem + A::K_BYTES + A::V_BYTES);
  float* sc = reinterpret_cast<float*>(smem + A::K_BYTES + A::V_BYTES + A::Q_BYTES);
  float* red = reinterpret_cast<float*>(smem + A::K_BYTES + A::V_BYTES + A::Q_BYTES + A::S_BYTES);
  const int tid = threadIdx.x;
  constexpr int C8 = D / 8;

  // Stage K and V rows of the slots (zeros for empty slots) and the queries.
  for (int idx = tid; idx < TOK * C8; idx += NT) {
    int i = idx / C8, c = idx - (idx / C8) * C8;
    int t = tok_s[i];
    uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = make_uint4(0u, 0u, 0u, 0u);
    if (t >= 0) {
      kv = *reinterpret_cast<const uint4*>(kbase + (long long)t * k_rstride + c * 8);
      vv = *reinterpret_cast<const uint4*>(vbase + (long long)t * v_rstride + c * 8);
    }
    *reinterpret_cast<uint4*>(Ks + i * A::KPAD + c * 8) = kv;
    *reinterpret_cast<uint4*>(Vs + i * D + c * 8) = vv;
  }
  for (int idx = tid; idx < G * D; idx += NT) {
    int hh = idx / D, d = idx - (idx / D) * D;
    qs[idx] = bf_to_f(q[hh * q_hstride + d]);
  }
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

// Log-sum-exp merge of NSPLIT partials of one (head, row): thread d of D.
// o: [NSPLIT, D] partial outputs, ml: [NSPLIT, 2]; writes bf16 out[d]. No token at all -> 0.
// CG: read the partials through L2 only (__ldcg), for a merge inside the kernel that wrote them.
template <int D, int NSPLIT, bool CG = false>
__device__ void merge_splits(const float* o, const float* ml, int d, __nv_bfloat16* out) {
  auto ld = [](const float* p) { return CG ? __ldcg(p) : *p; };
  float M = neg_inf();
#pragma unroll 16
  for (int s = 0; s < NSPLIT; ++s) M = fmaxf(M, ld(ml + 2 * s));  // independent loads in flight
  float res = 0.f;
  if (M != neg_inf()) {
    float L = 0.f, acc = 0.f;
#pragma unroll 16
    for (int s = 0; s < NSPLIT; ++s) {
      float m = ld(ml + 2 * s);
      float w = (m == neg_inf()) ? 0.f : expf(m - M);
      L = fmaf(w, ld(ml + 2 * s + 1), L);
      acc = fmaf(w, ld(o + (long long)s * D + d), acc);
    }
    res = acc / L;
  }
  out[d] = __float2bfloat16(res);
}

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The hand-off of a one-launch split-K kernel: every CTA calls it after writing its partials.
// ctr: two ints of a persistent zeroed pool (_launch.counter_slot), left zeroed again on exit.
// Each CTA takes a ticket; the last M to arrive (M = CTAs needed for one output element per
// thread, at most 64) wait until all n_cta have arrived and merge R = H * S rows of D in the split order
// (bits equal to the separate merge kernel's). The last merger to finish resets the counter,
// so the next launch on the stream finds it zeroed. Spinning is safe: a CTA waits only for
// CTAs that took earlier tickets or have yet to finish, and at most 64 wait (fewer than the SMs).
template <int D, int NSPLIT, int NT>
__device__ void merge_when_done(int* ctr, int n_cta, int R, const float* part_o,
                                const float* part_ml, __nv_bfloat16* out) {
  __shared__ int ticket_s;
  __threadfence();  // this thread's partials visible device-wide before the ticket
  __syncthreads();
  if (threadIdx.x == 0) ticket_s = atomicAdd(ctr, 1);
  __syncthreads();
  const int total = R * D;
  const int M = min(min(n_cta, (total + NT - 1) / NT), 64);  // 64: _launch.MERGERS_MAX
  const int mi = ticket_s - (n_cta - M);
  if (mi < 0) return;
  if (threadIdx.x == 0) {
    while (ld_acquire(ctr) < n_cta) __nanosleep(64);
  }
  __syncthreads();
  for (int e = mi * NT + threadIdx.x; e < total; e += M * NT) {
    const int rh = e / D, d = e - (e / D) * D;
    merge_splits<D, NSPLIT, true>(part_o + (long long)rh * NSPLIT * D,
                                  part_ml + (long long)rh * NSPLIT * 2, d, out + (long long)rh * D);
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
