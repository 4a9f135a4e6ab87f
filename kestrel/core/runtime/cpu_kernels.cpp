// Kestrel's CPU kernels for AVX-512 VNNI machines (core/runtime/cpu_kernels.py): a 4-bit matvec,
// a float32 matvec and decode attention over the compiled steps' mirrors.
//
// The 4-bit matvec (layers/int4_cpu.py): each row of activations is held as integers with a
// scale per group of 32 columns (the group's largest magnitude -> 127 * 128), each integer as
// two int8 digits (high * 128 + low),
// so that two vpdpbusd multiply 64 unsigned 4-bit codes by 64 activations and sum them by fours
// into int32 lanes: a few instructions per 128 weights, where widening every code to a float
// costs more than reading it from memory. One int8 digit alone (llama.cpp's Q8 blocks) is
// cheaper still, but an outlier channel coarsens its whole group: on the demo model it moved
// decode logprobs 0.078 nats on average against float32 (bfloat16 activations: 0.018).
//
// Codes, per row, per block of 128 columns: byte j holds column j in its low nibble and column
// 64 + j in its high one; a last block of 64 columns holds column j low and 32 + j high. A
// weight is (code - 8) * scale + zero with a bfloat16 scale and zero per group of 32 columns,
// so a row's output is sum over groups of scale * xscale * (codes . xq) + (zero - 8 * scale) *
// (the group's sum of x).
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int kRowsAtOnce = 4;  // output rows that share each load of the activations
// Codes are prefetched this many rows ahead (a prefetch past the weight's end is harmless).
// Without it a core streams about 11 GB/s, bound by the misses it keeps in flight; with it the
// demo model's matvecs read 22 GB/s (4 rows ahead: 18, 16: 21, 32: 20; scripts/int4_cpu_bench.py).
constexpr int64_t kPrefetchRows = 8;
constexpr float kLargest = 127.f * 128.f;  // an activation group's largest magnitude, as an integer

// One row of x as integers up to 127 * 128 in magnitude, with a scale per group (its largest
// magnitude -> 16256) and each group's sum; each integer held as two int8 digits, high * 128 +
// low, so that two vpdpbusd give its products with the codes.
void quantize_activations(const float* x, int64_t in, int8_t* high, int8_t* low, float* scales, float* sums) {
  const __m512i half = _mm512_set1_epi32(64);
  for (int64_t group = 0; group < in / kGroup; ++group) {
    const float* xg = x + group * kGroup;
    const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float scale = largest / kLargest;
    scales[group] = scale;
    sums[group] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    const __m512 inverse = _mm512_set1_ps(scale > 0 ? 1.f / scale : 0.f);
    for (int half_group = 0; half_group < 2; ++half_group) {
      // Rounded to nearest, ties to even (the default rounding mode), as torch.round.
      const __m512i value = _mm512_cvtps_epi32(_mm512_mul_ps(half_group ? b : a, inverse));
      const __m512i upper = _mm512_srai_epi32(_mm512_add_epi32(value, half), 7);
      const __m512i lower = _mm512_sub_epi32(value, _mm512_slli_epi32(upper, 7));
      const int64_t at = group * kGroup + half_group * 16;
      _mm_storeu_si128((__m128i*)(high + at), _mm512_cvtsepi32_epi8(upper));
      _mm_storeu_si128((__m128i*)(low + at), _mm512_cvtsepi32_epi8(lower));
    }
  }
}

// The int32 products of unsigned codes with the activations' two digits, summed by fours.
inline __m512i digit_dots(__m512i codes, const int8_t* high, const int8_t* low) {
  const __m512i upper = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(high));
  return _mm512_dpbusd_epi32(_mm512_slli_epi32(upper, 7), codes, _mm512_loadu_si512(low));
}

inline __m256i digit_dots(__m256i codes, const int8_t* high, const int8_t* low) {
  const __m256i upper = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, _mm256_loadu_si256((const __m256i*)high));
  return _mm256_dpbusd_epi32(_mm256_slli_epi32(upper, 7), codes, _mm256_loadu_si256((const __m256i*)low));
}

// Four bfloat16 values (scales or zeros of consecutive groups) as floats.
inline __m128 load_bf16x4(const uint16_t* values) {
  const __m128i words = _mm_loadl_epi64((const __m128i*)values);
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(words), 16));
}

// Two of them, the other lanes zero.
inline __m128 load_bf16x2(const uint16_t* values) {
  const __m128i words = _mm_cvtsi32_si128(*(const int32_t*)values);
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(words), 16));
}

// acc + the int8 dots of a 128-column block, lanes 0-7 scaled by group_scales[0], 8-15 by [1]
// (low nibbles), then by [2] and [3] (high nibbles).
inline __m512 block128(const uint8_t* codes, const int8_t* high, const int8_t* low, __m128 group_scales, __m512 acc) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i first_two = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i last_two = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m512i packed = _mm512_loadu_si512(codes);
  const __m512i low_codes = _mm512_and_si512(packed, nibble);
  const __m512i high_codes = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  const __m512i dot_low = digit_dots(low_codes, high, low);
  const __m512i dot_high = digit_dots(high_codes, high + 64, low + 64);
  const __m512 scales = _mm512_castps128_ps512(group_scales);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_low), _mm512_permutexvar_ps(first_two, scales), acc);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_high), _mm512_permutexvar_ps(last_two, scales), acc);
}

// The same for a last block of 64 columns (two groups).
inline __m512 block64(const uint8_t* codes, const int8_t* high, const int8_t* low, __m128 group_scales, __m512 acc) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m256i packed = _mm256_loadu_si256((const __m256i*)codes);
  const __m256i low_codes = _mm256_and_si256(packed, nibble);
  const __m256i high_codes = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
  const __m256i dot_low = digit_dots(low_codes, high, low);
  const __m256i dot_high = digit_dots(high_codes, high + 32, low + 32);
  const __m512i dots = _mm512_inserti64x4(_mm512_castsi256_si512(dot_low), dot_high, 1);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(group_scales)), acc);
}

struct Weight {
  const uint8_t* codes;  // [out, in / 2]
  const uint16_t* scales;  // [out, groups] bfloat16
  const uint16_t* zeros;  // [out, groups] bfloat16
  int64_t in;
};

struct Activations {  // one row of x, quantized
  const int8_t* high;  // [in]
  const int8_t* low;  // [in]
  const float* scales;  // [groups]
  const float* sums;  // [groups]
};

// Outputs first_row .. first_row + kRowsAtOnce - 1 for one row of activations.
void output_rows(const Weight& w, const Activations& x, int64_t first_row, float* out) {
  const int64_t groups = w.in / kGroup;
  const __m128 eight = _mm_set1_ps(8.f);
  __m512 dots[kRowsAtOnce];
  __m128 offsets[kRowsAtOnce];  // (zero - 8 * scale) * the group's sum of x
  for (int r = 0; r < kRowsAtOnce; ++r) dots[r] = _mm512_setzero_ps(), offsets[r] = _mm_setzero_ps();
  int64_t column = 0;
  for (; column + 128 <= w.in; column += 128) {
    const int64_t group = column / kGroup;
    const __m128 x_scales = _mm_loadu_ps(x.scales + group), x_sums = _mm_loadu_ps(x.sums + group);
    for (int r = 0; r < kRowsAtOnce; ++r) {
      const int64_t row = first_row + r, at = row * groups + group;
      _mm_prefetch((const char*)(w.codes + (row + kPrefetchRows) * w.in / 2 + column / 2), _MM_HINT_T0);
      const __m128 scales = load_bf16x4(w.scales + at);
      dots[r] = block128(w.codes + row * w.in / 2 + column / 2, x.high + column, x.low + column, _mm_mul_ps(scales, x_scales), dots[r]);
      const __m128 offset = _mm_fnmadd_ps(eight, scales, load_bf16x4(w.zeros + at));
      offsets[r] = _mm_fmadd_ps(offset, x_sums, offsets[r]);
    }
  }
  if (column < w.in) {
    const int64_t group = column / kGroup;
    const __m128 x_scales = _mm_castpd_ps(_mm_load_sd((const double*)(x.scales + group)));
    const __m128 x_sums = _mm_castpd_ps(_mm_load_sd((const double*)(x.sums + group)));
    for (int r = 0; r < kRowsAtOnce; ++r) {
      const int64_t row = first_row + r, at = row * groups + group;
      const __m128 scales = load_bf16x2(w.scales + at);
      dots[r] = block64(w.codes + row * w.in / 2 + column / 2, x.high + column, x.low + column, _mm_mul_ps(scales, x_scales), dots[r]);
      const __m128 offset = _mm_fnmadd_ps(eight, scales, load_bf16x2(w.zeros + at));
      offsets[r] = _mm_fmadd_ps(offset, x_sums, offsets[r]);
    }
  }
  for (int r = 0; r < kRowsAtOnce; ++r) {
    const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(dots[r]),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dots[r]), 1)));
    __m128 quarter = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1)), offsets[r]);
    quarter = _mm_hadd_ps(quarter, quarter);
    out[r] = _mm_cvtss_f32(_mm_hadd_ps(quarter, quarter));
  }
}

at::Tensor int4_matvec(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales_and_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_matvec: x must be 2-D float32");
  const int64_t rows = x.size(0), in = x.size(1), out = codes.size(0), groups = in / kGroup;
  TORCH_CHECK(in % 64 == 0 && out % kRowsAtOnce == 0 && codes.size(1) * 2 == in, "int4_matvec: shapes do not match");
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty({rows, out}, x.options());
  std::vector<int8_t> x_high(rows * in), x_low(rows * in);
  std::vector<float> x_scales(rows * groups), x_sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    quantize_activations(input.data_ptr<float>() + r * in, in, &x_high[r * in], &x_low[r * in], &x_scales[r * groups], &x_sums[r * groups]);
  const auto* halves = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr());
  const Weight weight{codes.data_ptr<uint8_t>(), halves, halves + out * groups, in};
  float* y_data = y.data_ptr<float>();
  // At least 64 output rows per thread: fewer cost more in waking threads than they save.
  at::parallel_for(0, out / kRowsAtOnce, 16, [&](int64_t begin, int64_t end) {
    float part[kRowsAtOnce];
    for (int64_t r = 0; r < rows; ++r) {
      const Activations activations{&x_high[r * in], &x_low[r * in], &x_scales[r * groups], &x_sums[r * groups]};
      for (int64_t block = begin; block < end; ++block) {
        output_rows(weight, activations, block * kRowsAtOnce, part);
        for (int k = 0; k < kRowsAtOnce; ++k) y_data[r * out + block * kRowsAtOnce + k] = part[k];
      }
    }
  });
  return y;
}

// ---- Float32 matvec: one row of x times a weight, streamed with prefetching ---------------
//
// The demo model's tied LM head (49,152 x 576 float32, 113 MB) is a third of a 4-bit decode
// step; the BLAS's one-row product reads it at about 25 GB/s, this loop at about 27.5.

at::Tensor float_matvec(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "float_matvec: float32, a contiguous weight");
  const int64_t in = x.size(1), out = weight.size(0);
  TORCH_CHECK(x.size(0) == 1 && in % 16 == 0 && out % kRowsAtOnce == 0 && weight.size(1) == in,
              "float_matvec: shapes not taken");
  const at::Tensor input = x.contiguous();
  at::Tensor y = at::empty({1, out}, x.options());
  const float* x_data = input.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  at::parallel_for(0, out / kRowsAtOnce, 16, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first_row = block * kRowsAtOnce;
      __m512 acc[kRowsAtOnce];
      for (int r = 0; r < kRowsAtOnce; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t column = 0; column < in; column += 16) {
        const __m512 xv = _mm512_loadu_ps(x_data + column);
        for (int r = 0; r < kRowsAtOnce; ++r) {
          const float* row = w_data + (first_row + r) * in + column;
          _mm_prefetch((const char*)(row + kPrefetchRows * in), _MM_HINT_T0);
          acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(row), xv, acc[r]);
        }
      }
      for (int r = 0; r < kRowsAtOnce; ++r) y_data[first_row + r] = _mm512_reduce_add_ps(acc[r]);
    }
  });
  return y;
}

// ---- Decode attention: one query row per sequence over its mirrored keys and values ----------
//
// F.scaled_dot_product_attention costs about 45 us a call on the demo model's decode step (9
// heads, 64 dims, a few hundred keys), nearly all of it set-up around a few microseconds of
// arithmetic; a decode step calls it once per layer.

struct AttentionShape {
  int64_t kv_heads, group, dim, capacity;
};

// One query head [VECTORS * 16 dims] over keys first .. last - 1 of its KV head, the running
// output held in registers.
template <int VECTORS>
void attend(const float* query, const float* keys, const float* values, int64_t first, int64_t last, float scale,
            const float* sink, float* scores, float* out) {
  constexpr int64_t dim = VECTORS * 16;
  __m512 q[VECTORS];
  for (int v = 0; v < VECTORS; ++v) q[v] = _mm512_mul_ps(_mm512_loadu_ps(query + 16 * v), _mm512_set1_ps(scale));
  float largest = sink ? *sink : -INFINITY;
  for (int64_t j = first; j < last; ++j) {
    const float* key = keys + j * dim;
    __m512 dot = _mm512_mul_ps(q[0], _mm512_loadu_ps(key));
    for (int v = 1; v < VECTORS; ++v) dot = _mm512_fmadd_ps(q[v], _mm512_loadu_ps(key + 16 * v), dot);
    scores[j - first] = _mm512_reduce_add_ps(dot);
    largest = std::max(largest, scores[j - first]);
  }
  float total = sink ? std::exp(*sink - largest) : 0.f;  // a sink: one more logit, a zero value
  __m512 acc[VECTORS];
  for (int v = 0; v < VECTORS; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t j = first; j < last; ++j) {
    const float weight = std::exp(scores[j - first] - largest);
    total += weight;
    const float* value = values + j * dim;
    const __m512 w = _mm512_set1_ps(weight);
    for (int v = 0; v < VECTORS; ++v) acc[v] = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 16 * v), acc[v]);
  }
  const __m512 inverse = _mm512_set1_ps(total > 0 ? 1.f / total : 0.f);
  for (int v = 0; v < VECTORS; ++v) _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(acc[v], inverse));
}

using AttendFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, float, const float*, float*, float*);

// query [rows, kv_heads, group, dim]; keys, values [>= rows, kv_heads, capacity, dim]; row r
// attends over positions first[r] .. last[r] - 1; sinks [kv_heads, group] or empty.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& first, const at::Tensor& last, double scale, const at::Tensor& sinks) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(query.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "decode_attention: contiguous tensors only");
  const int64_t dim = query.size(3);
  static const AttendFn by_vectors[] = {nullptr, attend<1>, attend<2>, attend<3>, attend<4>, attend<5>, attend<6>,
                                        attend<7>, attend<8>, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                        nullptr, attend<16>};
  TORCH_CHECK(dim % 16 == 0 && dim <= 256 && by_vectors[dim / 16], "decode_attention: head_dim ", dim, " not taken");
  const AttendFn attend_head = by_vectors[dim / 16];
  const int64_t rows = query.size(0), kv_heads = query.size(1), group = query.size(2), capacity = keys.size(2);
  at::Tensor out = at::empty_like(query);
  const at::Tensor first_keys = first.to(at::kLong).contiguous(), last_keys = last.to(at::kLong).contiguous();
  const int64_t* first_data = first_keys.data_ptr<int64_t>();
  const int64_t* last_data = last_keys.data_ptr<int64_t>();
  const float* sink_data = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  const float* query_data = query.data_ptr<float>();
  const float* key_data = keys.data_ptr<float>();
  const float* value_data = values.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  // One item per query head, so that a step of one sequence still spreads over the threads.
  at::parallel_for(0, rows * kv_heads * group, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(capacity);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / (kv_heads * group), head = item / group % kv_heads;
      const int64_t first_key = std::max<int64_t>(first_data[row], 0);
      const int64_t last_key = std::min<int64_t>(last_data[row], capacity);
      const int64_t kv_offset = (row * kv_heads + head) * capacity * dim;
      attend_head(query_data + item * dim, key_data + kv_offset, value_data + kv_offset, first_key, last_key,
                  static_cast<float>(scale), sink_data ? sink_data + item % (kv_heads * group) : nullptr,
                  scores.data(), out_data + item * dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kestrel_cpu, m) {
  m.def("int4_matvec(Tensor x, Tensor codes, Tensor scales_and_zeros) -> Tensor");
  m.impl("int4_matvec", c10::DispatchKey::CPU, &int4_matvec);
  m.def("float_matvec(Tensor x, Tensor weight) -> Tensor");
  m.impl("float_matvec", c10::DispatchKey::CPU, &float_matvec);
  m.def("decode_attention(Tensor query, Tensor keys, Tensor values, Tensor first, Tensor last, float scale, Tensor sinks) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
