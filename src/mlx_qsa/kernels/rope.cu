// Rotate-half RoPE (rope.py apply_rope) as one kernel. The portable routine is ~11 MLX
// primitives and ~5 launches per call (slice, cast, reshape, two fused products, split,
// reverse, fused add, cast, concatenation); a decode layer step applies it four times (q, k,
// the index queries, the staging window's block keys), so on CUDA this is one primitive each.
//// kernel: rope
// x [..., n, W] of type T, any strides (x_shape / x_strides), the row's position index on the
// second-to-last axis; cos_t, sin_t [n, RD / 2] float32, any strides
// -> out [..., n, W] of type T, row-contiguous (the logical shape of x, as apply_rope returns).
// Channels c < RD / 2: a*cos - b*sin with (a, b) = channels (c, c + RD/2); RD/2 <= c < RD:
// b*cos + a*sin; c >= RD: x unchanged. Bits: each product rounded to float32, one rounded
// add or subtract, then the cast to T (round to nearest even): apply_rope's operations (its
// split keeps the products apart, and its multiply by +-1 is exact).
// Template: T (x's dtype), RD. One thread per output element, grid-stride.
constexpr int HALF = RD / 2;
const int nd = x_ndim;
const int W = x_shape[nd - 1];
long long rows = 1;
for (int k = 0; k < nd - 1; ++k) rows *= x_shape[k];
const long long total = rows * W;
const long long cstride = x_strides[nd - 1];
for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
     e += (long long)gridDim.x * blockDim.x) {
  long long r = e / W;
  const int c = (int)(e - r * W);
  long long off = 0;
  int j = 0;
  for (int k = nd - 2; k >= 0; --k) {
    const long long idx = r % x_shape[k];
    r /= x_shape[k];
    off += idx * x_strides[k];
    if (k == nd - 2) j = (int)idx;
  }
  if (c >= RD) {
    out[e] = x[off + c * cstride];
    continue;
  }
  const int i = c < HALF ? c : c - HALF;
  const float a = static_cast<float>(x[off + i * cstride]);
  const float b = static_cast<float>(x[off + (i + HALF) * cstride]);
  const float co = cos_t[j * cos_t_strides[0] + i * cos_t_strides[1]];
  const float si = sin_t[j * sin_t_strides[0] + i * sin_t_strides[1]];
  const float v = c < HALF ? __fsub_rn(__fmul_rn(a, co), __fmul_rn(b, si))
                           : __fadd_rn(__fmul_rn(b, co), __fmul_rn(a, si));
  out[e] = T(v);
}
