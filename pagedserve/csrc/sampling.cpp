// Sampling of logit rows (CPU, float32): the temperature, min-p, top-k and top-p filters and the draw
// fused, a few vectorized passes over each row; and the repetition, frequency and presence penalties
// in place.
//
// The distribution and the draw rule are defined in pagedserve/layers/sampling_rule.py, whose torch
// path draws the same tokens (the tests hold the two token for token): one uniform number per try,
// inverting the running sum of the kept weights in vocabulary order. The numbers are counter-based
// (Philox-4x32-10 keyed by the row's seed, counted by the token's position), so a seeded request draws
// the same numbers whatever else is in the batch, with no generator to keep. The penalties touch only
// the tokens a row has seen, not its vocabulary. Structured outputs' token bitmasks are applied to the
// rows they constrain in place.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "ops.h"

namespace {

using Vec = at::vec::Vectorized<float>;

// ---- Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) ---------

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

// A uniform double in [0, 1) from (key, counter, stream): 53 bits of Philox's output block. A row's draw
// is (key, counter); the stream numbers the tries of one draw (rejection, below).
double philox_uniform(uint64_t key64, uint64_t counter, uint32_t stream) {
  uint32_t c[4] = {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), stream, 0u};
  uint32_t k[2] = {static_cast<uint32_t>(key64), static_cast<uint32_t>(key64 >> 32)};
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c[2];
    const uint32_t next[4] = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
                              static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
    std::copy(next, next + 4, c);
    k[0] += kPhiloxW0;
    k[1] += kPhiloxW1;
  }
  const uint64_t bits = ((static_cast<uint64_t>(c[0]) << 32) | c[1]) >> 11;
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);  // 2^-53
}

// ---- one row -----------------------------------------------------------------------------------
//
// Weights w = exp((x - max) / t), so the most likely token weighs 1. min-p keeps w >= min_p; top-k
// keeps w >= the k-th largest weight; both are thresholds. top-p keeps the smallest set of heaviest
// kept tokens whose weight reaches p of the kept total: a token belongs to it exactly when the kept
// tokens strictly heavier than it weigh less than that. So the draw is by rejection: draw from the
// thresholded weights, accept when the drawn token belongs, else draw again. This is exact (accepted
// draws follow the weights restricted to the set) and needs no sort; a try costs two vectorized passes,
// and a draw takes 1 / (the set's share of the kept weight) tries, at most 1 / p on average. The set of
// a top_p near 1 over a large vocabulary can hold thousands of tokens, which is why no sort or
// selection over it is done.

constexpr int64_t kBlock = 16;  // the draw finds its block of this many weights by their sums first (_BLOCK in sampling_rule.py)
constexpr uint32_t kMaxTries = 1000;  // MAX_TRIES in sampling_rule.py

float row_max(const float* x, int64_t n) {
  Vec best(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) best = at::vec::maximum(best, Vec::loadu(x + i));
  float top = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, best);
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// The weight of the k-th heaviest token (k < n): a min-heap of the k heaviest seen, skipping whole vectors
// that hold nothing heavier than its lightest (most do, once it has filled).
float kth_heaviest(const float* w, int64_t n, int64_t k, std::vector<float>& heap) {
  heap.assign(w, w + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  int64_t i = k;
  auto offer = [&](float v) {
    if (v > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = v;
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  };
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(w + i);
    if ((v > Vec(heap.front())).zero_mask() == (1 << Vec::size()) - 1) continue;  // no lane heavier
    for (int64_t j = 0; j < Vec::size(); ++j) offer(w[i + j]);
  }
  for (; i < n; ++i) offer(w[i]);
  return heap.front();
}

// The sum of w[i] over w[i] >= threshold (inclusive) or over w[i] > threshold (not: "strictly heavier").
double masked_sum(const float* w, int64_t n, float threshold, bool inclusive) {
  const Vec vt(threshold), zero(0.f);
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(w + i);
    acc = acc + Vec::blendv(zero, v, inclusive ? (v >= vt) : (v > vt));
  }
  double sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i)
    if (inclusive ? w[i] >= threshold : w[i] > threshold) sum += w[i];
  return sum;
}

struct RowSampling {
  float temperature;  // > 0
  int64_t top_k;      // 0: off
  float top_p;        // 1: off
  float min_p;        // 0: off
  uint64_t key, counter;
};

class RowSampler {
 public:
  int64_t sample(const float* x, int64_t n, const RowSampling& p) {
    const float top = row_max(x, n);
    if (!std::isfinite(top)) return argmax_row(x, n);  // nothing finite to weigh: as greedy
    weights_.resize(n);
    float* w = weights_.data();
    const Vec vtop(top), vscale(1.f / p.temperature);
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) ((Vec::loadu(x + i) - vtop) * vscale).exp().store(w + i);
    for (; i < n; ++i) w[i] = std::exp((x[i] - top) / p.temperature);
    float threshold = std::max(p.min_p, 0.f);
    if (p.top_k > 0 && p.top_k < n) threshold = std::max(threshold, kth_heaviest(w, n, p.top_k, heap_));
    const double kept = block_sums(w, n, threshold);
    const double needed = static_cast<double>(p.top_p) * kept;
    for (uint32_t tries = 0; tries < kMaxTries; ++tries) {
      const int64_t token = draw(w, n, threshold, kept, philox_uniform(p.key, p.counter, tries));
      if (p.top_p >= 1.f || masked_sum(w, n, w[token], false) < needed) return token;
    }
    return argmax_row(x, n);  // not reached unless top_p is vanishingly small: its set is the heaviest token
  }

 private:
  // Each block's weight of kept tokens; returns their total.
  double block_sums(const float* w, int64_t n, float threshold) {
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    sums_.resize(blocks);
    double total = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t end = std::min(n, (b + 1) * kBlock);
      float sum = 0.f;
      for (int64_t j = b * kBlock; j < end; ++j) sum += w[j] >= threshold ? w[j] : 0.f;
      sums_[b] = sum;
      total += sum;
    }
    return total;
  }

  // The first kept token, in vocabulary order, where the kept weights' running sum passes u * total.
  int64_t draw(const float* w, int64_t n, float threshold, double total, double u) const {
    const double target = u * total;
    double acc = 0.0;
    int64_t b = 0;
    const int64_t blocks = static_cast<int64_t>(sums_.size());
    for (; b + 1 < blocks && acc + sums_[b] <= target; ++b) acc += sums_[b];
    int64_t last = -1;
    for (int64_t j = b * kBlock; j < std::min(n, (b + 1) * kBlock); ++j) {
      if (w[j] < threshold || w[j] == 0.f) continue;
      acc += w[j];
      last = j;
      if (acc > target) return j;
    }
    if (last >= 0) return last;
    for (int64_t j = n - 1; j >= 0; --j)  // rounding ran past the end: the last kept token
      if (w[j] >= threshold && w[j] > 0.f) return j;
    return 0;
  }

  std::vector<float> weights_, sums_, heap_;
};

void check_column(const at::Tensor& t, at::ScalarType type, int64_t rows, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.size(0) == rows && t.is_contiguous(), name,
              " must be a contiguous CPU vector of ", rows, " ", c10::toString(type));
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p, const at::Tensor& seeds, const at::Tensor& counters) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logits must be a contiguous float32 CPU tensor [rows, n > 0]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  check_column(temperature, at::kFloat, rows, "temperature");
  check_column(top_k, at::kLong, rows, "top_k");
  check_column(top_p, at::kFloat, rows, "top_p");
  check_column(min_p, at::kFloat, rows, "min_p");
  check_column(seeds, at::kLong, rows, "seeds");
  check_column(counters, at::kLong, rows, "counters");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float *t = temperature.data_ptr<float>(), *tp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t *tk = top_k.data_ptr<int64_t>(), *seed = seeds.data_ptr<int64_t>(), *counter = counters.data_ptr<int64_t>();
  int64_t* chosen = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    RowSampler sampler;
    for (int64_t r = begin; r < end; ++r) {
      if (t[r] <= 0.f) {  // a greedy row
        chosen[r] = argmax_row(x + r * n, n);
        continue;
      }
      const RowSampling p{t[r], tk[r], tp[r], mp[r], static_cast<uint64_t>(seed[r]), static_cast<uint64_t>(counter[r])};
      chosen[r] = sampler.sample(x + r * n, n, p);
    }
  });
  return out;
}

void apply_penalties_(at::Tensor logits, const at::Tensor& token_ids, const at::Tensor& offsets, const at::Tensor& prompt_lens,
                      const at::Tensor& presence, const at::Tensor& frequency, const at::Tensor& repetition) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous float32 CPU tensor [rows, n]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && token_ids.is_contiguous(), "token_ids must be contiguous int64");
  check_column(offsets, at::kLong, rows + 1, "offsets");
  check_column(prompt_lens, at::kLong, rows, "prompt_lens");
  check_column(presence, at::kFloat, rows, "presence");
  check_column(frequency, at::kFloat, rows, "frequency");
  check_column(repetition, at::kFloat, rows, "repetition");
  float* x = logits.data_ptr<float>();
  const int64_t *ids = token_ids.data_ptr<int64_t>(), *start = offsets.data_ptr<int64_t>(), *prompt = prompt_lens.data_ptr<int64_t>();
  TORCH_CHECK(start[rows] == token_ids.numel(), "offsets must end at the number of token ids");
  const float *pres = presence.data_ptr<float>(), *freq = frequency.data_ptr<float>(), *rep = repetition.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    // Per vocabulary entry; only the entries a row touched are reset after it.
    std::vector<int32_t> output_count(n, 0);
    std::vector<uint8_t> seen(n, 0);
    for (int64_t r = begin; r < end; ++r) {
      float* row = x + r * n;
      for (int64_t j = start[r]; j < start[r + 1]; ++j) {
        const int64_t id = ids[j];
        TORCH_CHECK(id >= 0 && id < n, "row ", r, ": token id ", id, " outside the vocabulary of ", n);
        seen[id] = 1;
        if (j - start[r] >= prompt[r]) ++output_count[id];
      }
      // As the reference: the repetition penalty (prompt and output), then frequency and presence (output).
      for (int64_t j = start[r]; j < start[r + 1]; ++j) {
        const int64_t id = ids[j];
        if (seen[id] != 1) continue;  // once per distinct token
        seen[id] = 2;
        float v = row[id];
        if (rep[r] != 1.f) v = v > 0.f ? v / rep[r] : v * rep[r];
        const int32_t count = output_count[id];
        if (count > 0) v -= freq[r] * static_cast<float>(count) + pres[r];
        row[id] = v;
      }
      for (int64_t j = start[r]; j < start[r + 1]; ++j) output_count[ids[j]] = seen[ids[j]] = 0;
    }
  });
}

// -inf at every token a row's bitmask forbids (bit j % 32 of word j / 32 clear), in the logits rows given: the
// rows of constrained requests. A word of all ones (32 allowed tokens) is skipped, and one of all zeros filled.
void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous float32 CPU tensor [rows, n]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 tensor [masked rows, words]");
  const int64_t num_masked = bitmask.size(0), words = bitmask.size(1), n = logits.size(1);
  check_column(rows, at::kLong, num_masked, "rows");
  TORCH_CHECK(words * 32 >= n, "bitmask must cover the logits' ", n, " columns");
  const int64_t* row_index = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_masked; ++i)
    TORCH_CHECK(row_index[i] >= 0 && row_index[i] < logits.size(0), "row ", row_index[i], " is out of the logits' rows");
  float* x = logits.data_ptr<float>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, num_masked, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = x + row_index[i] * n;
      const uint32_t* mask = masks + i * words;
      for (int64_t word = 0; word * 32 < n; ++word) {
        const uint32_t bits = mask[word];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t base = word * 32, count = std::min<int64_t>(32, n - base);
        if (bits == 0u) {
          std::fill(row + base, row + base + count, kMinusInf);
          continue;
        }
        for (int64_t b = 0; b < count; ++b)
          if (!((bits >> b) & 1u)) row[base + b] = kMinusInf;
      }
    }
  });
}
