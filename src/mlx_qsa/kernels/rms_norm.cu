// Plain-weight RMSNorm (rope.py rms_norm) as one kernel. The portable routine is four MLX
// primitives and four launches per call (cast, square, row sum, a fused divide / add / sqrt /
// divide / cast / multiply); a decode layer step applies it four times (q, k, the index queries,
// the staging window's block keys), so on CUDA this is one primitive each.
//// kernel: rms_norm
// x [..., D] of type T, any strides (x_shape / x_strides); weight [D], any dtype and stride
// -> out [..., D] of type T, row-contiguous. The bits of rms_norm on MLX's CUDA backend (0.32):
//   p = float(x) * float(x), rounded (MLX's Multiply);
//   the row's sum in row_reduce_simple's order for D = 128 K floats, which MLX reduces on one
//   warp with 4 reads per lane: lane t adds p[128 b + 4 t + i] for b < K, i < 4, in that
//   order, onto 0; then cooperative groups' reduce, an xor butterfly over masks 16, 8, 4, 2, 1
//   (each step out + partner: commutative, so every lane holds the same sum);
//   ms = sum / D; n = T(float(x) / sqrt(ms + eps)); out = T(float(n) * float(T(w))).
// Every operation is a correctly rounded one (no contraction: the _rn intrinsics), as in
// MLX's kernels (NVRTC without fast math; a product of two bf16 or two f16 is exact in float,
// so the last multiply rounds once, as MLX's bf16 / f16 multiply does).
// Template: T, D (a multiple of 128, at most 896: MLX's one-warp case), EPS_BITS (eps as
// float32 bits). One warp per row, grid-stride over rows.
constexpr int K = D / 128;
const int nd = x_ndim;
long long rows = 1;
for (int k = 0; k < nd - 1; ++k) rows *= x_shape[k];
const int lane = threadIdx.x & 31;
const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
const long long step = ((long long)gridDim.x * blockDim.x) >> 5;
const long long cstride = x_strides[nd - 1];
const long long wstride = weight_strides[0];
const float eps = __int_as_float(EPS_BITS);
for (long long r = first; r < rows; r += step) {
  long long off = 0;
  long long rest = r;
  for (int k = nd - 2; k >= 0; --k) {
    off += (rest % x_shape[k]) * x_strides[k];
    rest /= x_shape[k];
  }
  float v[K][4];
  float acc = 0.0f;
#pragma unroll
  for (int b = 0; b < K; ++b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[b][i] = static_cast<float>(x[off + (b * 128 + 4 * lane + i) * cstride]);
      acc = __fadd_rn(acc, __fmul_rn(v[b][i], v[b][i]));
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, m));
  }
  const float den = __fsqrt_rn(__fadd_rn(__fdiv_rn(acc, static_cast<float>(D)), eps));
  T* o = out + r * D;
#pragma unroll
  for (int b = 0; b < K; ++b) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = b * 128 + 4 * lane + i;
      const T n = T(__fdiv_rn(v[b][i], den));
      const T w = T(static_cast<float>(weight[c * wstride]));
      o[c] = T(__fmul_rn(static_cast<float>(n), static_cast<float>(w)));
    }
  }
}
