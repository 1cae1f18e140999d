//// kernel: partial
// Rows-gather attention, pass 1 (split-K): one CTA per (row, KV head j, split s) attends the G
// query heads of j over slots [s * TOK, (s + 1) * TOK) of the row's slot list.
// q [1, H, S, D] bf16; keys, values [1, HKV, cap, D] bf16 read in place; slots [S, W] int32,
// slot_valid [S, W] bool (invalid slots contribute nothing)
// -> part_o [H * S, NSPLIT, D] float32, part_ml [H * S, NSPLIT, 2] float32 (head-major rows).
// With QSA_GATE, gate [1, S, H, D] bf16 (any strides) is the last input before ctr and the merged
// output is o * sigmoid(gate) in [1, S, H, D] (gate.cuh).
// Template: D, G, TOK, HKV, W, NSPLIT, SCALE_BITS, NT (S from q's shape).
extern __shared__ __align__(16) unsigned char qsa_dyn_smem[];
__shared__ int tok_s[TOK];
const int S = q_shape[2];
const int s = blockIdx.x % NSPLIT;
const int rj = blockIdx.x / NSPLIT;
const int j = rj % HKV, row = rj / HKV;
const long long cap = keys_shape[2];
auto tok_of = [&](int i) -> int {  // slot s * TOK + i of the row (id and flag in one round trip)
  const int slot = s * TOK + i;
  if (slot >= W) return -1;
  const bool ok = slot_valid[row * slot_valid_strides[0] + slot * slot_valid_strides[1]];
  const long long tt = slots[row * slots_strides[0] + slot * slots_strides[1]];
  return ok && tt >= 0 && tt < cap ? (int)tt : -1;
};
const int h0 = j * G;
qsa::partial_attention<D, G, TOK, NT>(
    q + h0 * q_strides[1] + row * q_strides[2], q_strides[1],
    keys + j * keys_strides[1], keys_strides[2],
    values + j * values_strides[1], values_strides[2],
    tok_of, tok_s, __int_as_float(SCALE_BITS),
    part_o + (((long long)h0 * S + row) * NSPLIT + s) * D, (long long)S * NSPLIT * D,
    part_ml + (((long long)h0 * S + row) * NSPLIT + s) * 2, (long long)S * NSPLIT * 2,
    qsa_dyn_smem);
#ifdef QSA_FUSED  // one launch: the last CTAs merge (ctr [2] int32, out [1, H, S, D] bf16)
#ifdef QSA_GATE  // the output gate fused: out [1, S, H, D] = o * sigmoid(gate) (gate.cuh)
const qsa::GatedOut<D> dst{out, gate, gate_strides[1], gate_strides[2], gate_strides[3], S,
                           G * HKV};
#else
const qsa::PlainOut<D> dst{out};
#endif
static_assert(qsa::merge_smem_floats<D, NSPLIT, NT>() * 4 <= qsa::Attn<D, G, TOK, NT>::BYTES,
              "the merge works in the partial's shared memory");
qsa::merge_when_done<D, NSPLIT, NT>(const_cast<int*>(ctr), gridDim.x, G * HKV * S,
                                    part_o, part_ml, dst, reinterpret_cast<float*>(qsa_dyn_smem));
#endif
