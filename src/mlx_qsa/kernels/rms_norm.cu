// Plain-weight RMSNorm (rope.py rms_norm) as one kernel, alone or with the rotate-half RoPE that
// follows it (rope.cu's arithmetic) and, for the indexer's block keys, the 4-token mean before it
// (indexer.py pool_blocks). The portable routines are four primitives per norm, ~2 for the RoPE
// kernel and ~6 for the pooling; a decode layer step runs a norm four times (q, k, the index
// queries, the staging window's block keys), so on CUDA each becomes one primitive.
//
// Norm bits: those of rms_norm on MLX's CUDA backend (0.32):
//   p = float(x) * float(x), rounded (MLX's Multiply);
//   the row's sum in row_reduce_simple's order for D = 128 K floats, which MLX reduces on one
//   warp with 4 reads per lane: lane t adds p[128 b + 4 t + i] for b < K, i < 4, in that order,
//   onto 0; then cooperative groups' reduce, an xor butterfly over masks 16, 8, 4, 2, 1 (each
//   step out + partner: commutative, so every lane holds the same sum);
//   ms = sum / D; n = T(float(x) / sqrt(ms + eps)); y = T(float(n) * float(T(w))).
// Every operation is correctly rounded (the _rn intrinsics: no contraction), as in MLX's kernels
// (NVRTC without fast math; a product of two bf16 or two f16 is exact in float, so the last
// multiply rounds once, as MLX's bf16 / f16 multiply does).
// Template (every kernel): T, D (a multiple of 128, at most 896: MLX's one-warp case), EPS_BITS
// (eps as float32 bits); with RoPE: RD (a multiple of 8, at most 128 and D); pooling: R. One warp
// per row, grid-stride over rows; lane t holds channels 128 b + 4 t + i.
//// kernel: norm_core
constexpr int K = D / 128;
const int lane = threadIdx.x & 31;
const long long first_row = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const long long row_step = ((long long)gridDim.x * blockDim.x) >> 5;
const float eps = __int_as_float(EPS_BITS);
const long long wstride = weight_strides[0];
// v: float(T) values of the lane's channels -> float of the row's normed, weighted T values
auto norm_row = [&](float (&v)[K][4]) {
  float acc = 0.0f;
#pragma unroll
  for (int b = 0; b < K; ++b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc = __fadd_rn(acc, __fmul_rn(v[b][i], v[b][i]));
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, m));
  const float den = __fsqrt_rn(__fadd_rn(__fdiv_rn(acc, static_cast<float>(D)), eps));
#pragma unroll
  for (int b = 0; b < K; ++b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = b * 128 + 4 * lane + i;
      const T n = T(__fdiv_rn(v[b][i], den));
      const T w = T(static_cast<float>(weight[c * wstride]));
      v[b][i] = static_cast<float>(T(__fmul_rn(static_cast<float>(n), static_cast<float>(w))));
    }
  }
};
// the row's values as T into row r of the row-contiguous output
auto store_row = [&](const float (&v)[K][4], long long r) {
  T* o = out + r * D;
#pragma unroll
  for (int b = 0; b < K; ++b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[b * 128 + 4 * lane + i] = T(v[b][i]);
  }
};
//// kernel: rope_core
// Rotate-half RoPE of channels < RD of the row held in v (rope.cu's bits: each product rounded
// to float32, one rounded add or subtract), table row j. Channel c's partner c +- RD/2 sits
// RD/8 lanes away at the same i; every lane takes part in the shuffles.
auto rope_row = [&](float (&v)[K][4], long long j) {
  constexpr int HALF = RD / 2;
  const int src = 4 * lane < HALF ? lane + HALF / 4 : lane - HALF / 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float pv = __shfl_sync(0xffffffffu, v[0][i], src & 31);
    const int c = 4 * lane + i;
    if (c < RD) {
      const int h = c < HALF ? c : c - HALF;
      const float co = cos_t[j * cos_t_strides[0] + h * cos_t_strides[1]];
      const float si = sin_t[j * sin_t_strides[0] + h * sin_t_strides[1]];
      v[0][i] = c < HALF ? __fsub_rn(__fmul_rn(v[0][i], co), __fmul_rn(pv, si))
                         : __fadd_rn(__fmul_rn(v[0][i], co), __fmul_rn(pv, si));
    }
  }
};
//// kernel: rows_in
// x [..., D] of type T, any strides -> the lane's channels of row r as floats, its table row
// (the index on x's second-to-last axis) in j.
const int nd = x_ndim;
long long rows = 1;
for (int k = 0; k < nd - 1; ++k) rows *= x_shape[k];
const long long cstride = x_strides[nd - 1];
auto load_row = [&](float (&v)[K][4], long long r, long long& j) {
  long long off = 0;
  long long rest = r;
  j = nd >= 2 ? r % x_shape[nd - 2] : 0;
  for (int k = nd - 2; k >= 0; --k) {
    off += (rest % x_shape[k]) * x_strides[k];
    rest /= x_shape[k];
  }
#pragma unroll
  for (int b = 0; b < K; ++b) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      v[b][i] = static_cast<float>(x[off + (b * 128 + 4 * lane + i) * cstride]);
  }
};
//// kernel: rms_norm
// x [..., D] (any strides), weight [D] (any dtype and stride) -> out [..., D] of type T,
// row-contiguous: rms_norm(x, weight, eps).
for (long long r = first_row; r < rows; r += row_step) {
  float v[K][4];
  long long j;
  load_row(v, r, j);
  norm_row(v);
  store_row(v, r);
}
//// kernel: norm_rope
// x [..., n, D] (any strides), weight [D], cos_t / sin_t [n, RD / 2] float32 (any strides)
// -> out [..., n, D] of type T, row-contiguous: rope(rms_norm(x, weight, eps), cos, sin, RD).
for (long long r = first_row; r < rows; r += row_step) {
  float v[K][4];
  long long j;
  load_row(v, r, j);
  norm_row(v);
  rope_row(v, j);
  store_row(v, r);
}
//// kernel: pool_norm_rope
// raw [1, cap, D] of type T (any strides), start int32 [1] (the first block), weight [D],
// cos_t / sin_t [n, RD / 2] float32 -> out [1, n, D] of type T: indexer.pool_blocks, i.e. block
// j's mean T(((x0 + x1) + x2 ...) / R) over its R token rows (start + j) R + q in float32, then
// the norm and the RoPE at table row j.
const long long n_blocks = cos_t_shape[0];
const long long rs = raw_strides[1];
const long long cs = raw_strides[2];
const long long b0 = start[0];
for (long long jb = first_row; jb < n_blocks; jb += row_step) {
  float v[K][4];
  const T* rowp = raw + (b0 + jb) * R * rs;
#pragma unroll
  for (int b = 0; b < K; ++b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const long long c = b * 128 + 4 * lane + i;
      float acc = static_cast<float>(rowp[c * cs]);
#pragma unroll
      for (int q = 1; q < R; ++q) acc = __fadd_rn(acc, static_cast<float>(rowp[q * rs + c * cs]));
      v[b][i] = static_cast<float>(T(__fdiv_rn(acc, static_cast<float>(R))));
    }
  }
  norm_row(v);
  rope_row(v, jb);
  store_row(v, jb);
}
