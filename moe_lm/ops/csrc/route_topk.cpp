// CPU kernel of the router's expert choice, fp32: DeepSeek-V3's group-limited top-k on biased scores, per token
// in one pass (torch.topk costs ~0.7 us per row on short rows, ~2 ms per call at T = 4096; the router made three
// such calls and the sequence-wise loss one more).
//
//   c = s + b;  groups ranked by the sum of their two largest c, the best `topk_group` kept;
//   idx = the k largest c among the kept groups' experts, largest first.
//
// Ties go to the lower index (torch.topk leaves their order unspecified); NaN ranks above every number, as in
// torch.topk.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

// a ranks before b: larger, NaN above numbers, then the lower index.
inline bool ranks_before(float a, int64_t ia, float b, int64_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

// Insert (v, i) into the sorted top list of at most k entries.
inline void push_top(std::vector<float>& val, std::vector<int64_t>& idx, int64_t k, float v, int64_t i) {
  int64_t n = static_cast<int64_t>(val.size());
  if (n == k && !ranks_before(v, i, val[n - 1], idx[n - 1])) return;
  if (n < k) {
    val.push_back(v);
    idx.push_back(i);
  } else {
    n -= 1;  // the last entry drops out
  }
  int64_t p = n;
  for (; p > 0 && ranks_before(v, i, val[p - 1], idx[p - 1]); --p) {
    val[p] = val[p - 1];
    idx[p] = idx[p - 1];
  }
  val[p] = v;
  idx[p] = i;
}

}  // namespace

// scores [T, E] fp32, bias [E] fp32 or None -> idx [T, k] int64.
at::Tensor topk_experts(const at::Tensor& scores_in, const c10::optional<at::Tensor>& bias_in, int64_t k,
                        int64_t n_group, int64_t topk_group) {
  TORCH_CHECK(scores_in.device().is_cpu() && scores_in.scalar_type() == at::kFloat && scores_in.dim() == 2,
              "topk_experts: scores must be a 2-D fp32 CPU tensor");
  const at::Tensor scores = scores_in.contiguous();
  const int64_t T = scores.size(0), E = scores.size(1);
  TORCH_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group,
              "topk_experts: n_group must divide E and 1 <= topk_group <= n_group");
  const int64_t per_group = E / n_group;
  TORCH_CHECK(n_group == 1 || per_group >= 2, "topk_experts: each group needs at least 2 experts");
  TORCH_CHECK(k >= 1 && k <= topk_group * per_group, "topk_experts: k exceeds the experts of the kept groups");
  at::Tensor bias;
  if (bias_in) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == E, "topk_experts: bias must be fp32 [E]");
  }
  auto out = at::empty({T, k}, scores.options().dtype(at::kLong));
  const float* s = scores.data_ptr<float>();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> c(E), val, gval;
    std::vector<int64_t> idx, gidx;
    std::vector<char> kept(n_group);
    val.reserve(k);
    idx.reserve(k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < E; ++e) c[e] = b ? s[t * E + e] + b[e] : s[t * E + e];
      std::fill(kept.begin(), kept.end(), n_group == 1);
      if (n_group > 1) {
        gval.clear();
        gidx.clear();
        for (int64_t g = 0; g < n_group; ++g) {
          // the sum of the group's two largest; a tie for the largest counts twice, as in torch.topk(2)
          const int64_t lo = g * per_group, hi = lo + per_group;
          float first = c[lo], second = c[lo + 1];
          int64_t first_at = lo, second_at = lo + 1;
          if (ranks_before(second, second_at, first, first_at)) {
            std::swap(first, second);
            std::swap(first_at, second_at);
          }
          for (int64_t e = lo + 2; e < hi; ++e) {
            if (ranks_before(c[e], e, first, first_at)) {
              second = first;
              second_at = first_at;
              first = c[e];
              first_at = e;
            } else if (ranks_before(c[e], e, second, second_at)) {
              second = c[e];
              second_at = e;
            }
          }
          push_top(gval, gidx, topk_group, first + second, g);
        }
        for (int64_t g : gidx) kept[g] = 1;
      }
      val.clear();
      idx.clear();
      for (int64_t e = 0; e < E; ++e)
        if (kept[e / per_group]) push_top(val, idx, k, c[e], e);
      std::copy(idx.begin(), idx.end(), o + t * k);
    }
  });
  return out;
}
