//// kernel: partial
// Flash sparse decode, pass 1 (split-K): one CTA per (KV head j, split s) attends the G query heads
// of j over the tokens of its BPS = TOK / RATIO entries of the list [selected blocks..., tail].
// q [1, H, 1, D] bf16; keys, values [1, HKV, cap, D] bf16 read in place (rows >= T never read);
// block_ids [K] or [1, K] int32, block_valid likewise bool (a selection's row, in place);
// tlen [1] int32 = T - TOFF (TOFF 0: the context length T; TOFF 1: the row's position)
// -> part_o [H, NSPLIT, D] float32 (unnormalised), part_ml [H, NSPLIT, 2] float32 (max, sum).
// With QSA_GATE, gate [1, 1, H, D] bf16 (any strides) is the last input before ctr and the merged
// output is o * sigmoid(gate) in [1, 1, H, D] (gate.cuh).
// Template: D, G, TOK, RATIO, K, NSPLIT, SCALE_BITS, NT, TOFF.
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
__shared__ int tok_s[TOK];
constexpr int BPS = TOK / RATIO;
const int s = blockIdx.x % NSPLIT, j = blockIdx.x / NSPLIT;
const long long cap = keys_shape[2];
const long long bstride = block_ids_strides[block_ids_ndim - 1];
const long long vstride = block_valid_strides[block_valid_ndim - 1];
// Slot i of this split: token r of entry pb = s * BPS + i / RATIO of [selected blocks..., tail]
// (the id and its flag are loaded together: one round trip).
auto tok_of = [&](int i) -> int {
  const int pb = s * BPS + i / RATIO, r = i % RATIO;
  if (pb < K) {
    const bool ok = block_valid[pb * vstride];
    const long long tt = (long long)block_ids[pb * bstride] * RATIO + r;
    return ok && tt >= 0 && tt < cap ? (int)tt : -1;
  }
  if (pb == K) {
    const int T = tlen[0] + TOFF;
    const int tt = (T / RATIO) * RATIO + r;
    return tt < T && tt < cap ? tt : -1;
  }
  return -1;
};
const int h0 = j * G;
qsa::partial_attention<D, G, TOK, NT>(
    q + h0 * q_strides[1], q_strides[1],
    keys + j * keys_strides[1], keys_strides[2],
    values + j * values_strides[1], values_strides[2],
    tok_of, tok_s, __int_as_float(SCALE_BITS),
    part_o + ((long long)h0 * NSPLIT + s) * D, (long long)NSPLIT * D,
    part_ml + ((long long)h0 * NSPLIT + s) * 2, (long long)NSPLIT * 2,
    qsa_dyn_smem);
#ifdef QSA_FUSED  // one launch: the last CTAs merge (ctr [2] int32, out [1, H, 1, D] bf16)
#ifdef QSA_GATE  // the output gate fused: out [1, 1, H, D] = o * sigmoid(gate) (gate.cuh)
const qsa::GatedOut<D> dst{out, gate, gate_strides[1], gate_strides[2], gate_strides[3], 1,
                           G * (int)gridDim.x / NSPLIT};
#else
const qsa::PlainOut<D> dst{out};
#endif
static_assert(qsa::merge_smem_floats<D, NSPLIT, NT>() * 4 <= qsa::Attn<D, G, TOK, NT>::BYTES,
              "the merge works in the partial's shared memory");
qsa::merge_when_done<D, NSPLIT, NT>(const_cast<int*>(ctr), gridDim.x, G * gridDim.x / NSPLIT,
                                    part_o, part_ml, dst, reinterpret_cast<float*>(qsa_dyn_smem));
#endif
