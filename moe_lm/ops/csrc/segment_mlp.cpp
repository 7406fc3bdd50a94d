// CPU kernel of the "grouped" expert path, fp32, forward and backward:
//   y[token[n]] += w[n] * down_e(silu(gate_e x[token[n]]) * up_e x[token[n]])   for token-slots n sorted by expert e.
//
// why compiled: in eager PyTorch every expert costs ~10 element-wise passes over fresh buffers plus Python
// dispatch, as much time as its matmuls on a 2-core CPU. Here an expert is gather -> GEMM -> one fused SwiGLU
// pass -> GEMM -> scatter-add, on per-thread scratch that stays in cache. When the token counts split evenly,
// the threads take whole experts (each GEMM single-threaded, no fork/join per matmul); otherwise experts run
// one after another with threaded GEMMs. Results depend on the split only through float summation order.
//
// Shapes: x [M, D]; token [N] row of x of each slot (slots sorted by expert); counts [E] (CPU int64); w [N];
// gate_up [E, 2I, D] (gate rows first); down [E, D, I].
// Forward saves each expert's gate/up pre-activations [count, 2I]; backward gathers x again instead of keeping an
// [N, D] copy.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// dst[r] = src[rows[r]], rows of width D.
void gather_rows(const float* src, const int64_t* rows, float* dst, int64_t n, int64_t D) {
  at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) std::memcpy(dst + r * D, src + rows[r] * D, D * sizeof(float));
  });
}

// dst[rows[r]] += src[r]. Threads split the columns, so a row listed twice never races.
void scatter_add_rows(const float* src, const int64_t* rows, float* dst, int64_t n, int64_t D) {
  const int64_t chunk = 4 * Vec::size();
  at::parallel_for(0, (D + chunk - 1) / chunk, 1, [&](int64_t cb, int64_t ce) {
    const int64_t c0 = cb * chunk, c1 = std::min(D, ce * chunk);
    for (int64_t r = 0; r < n; ++r) {
      float* d = dst + rows[r] * D;
      const float* s = src + r * D;
      for (int64_t c = c0; c < c1; c += Vec::size()) {
        const int64_t m = std::min<int64_t>(Vec::size(), c1 - c);
        (Vec::loadu(d + c, m) + Vec::loadu(s + c, m)).store(d + c, m);
      }
    }
  });
}

inline Vec sigmoid(const Vec& x) { return Vec(1.f) / (Vec(1.f) + x.neg().exp()); }

// a[r] = silu(gate[r]) * up[r] * w[r]; the rows of h are [gate | up], width 2I.
void swiglu_forward(const float* h, const float* w, float* a, int64_t n, int64_t I) {
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float *gate = h + r * 2 * I, *up = gate + I;
      const Vec wr(w[r]);
      for (int64_t j = 0; j < I; j += Vec::size()) {
        const int64_t m = std::min<int64_t>(Vec::size(), I - j);
        const Vec x = Vec::loadu(gate + j, m);
        (x * sigmoid(x) * Vec::loadu(up + j, m) * wr).store(a + r * I + j, m);
      }
    }
  });
}

// From g = dL/d(weighted activation) [n, I] and h = [gate | up], in one pass:
//   a = silu(gate) up w (down_proj's input), dh = [g w up silu'(gate) | g w silu(gate)], dw = <g, silu(gate) up>,
// with silu'(x) = s (1 + x (1 - s)), s = sigmoid(x). dw null: not computed.
void swiglu_backward(const float* g, const float* h, const float* w, float* a, float* dh, float* dw, int64_t n,
                     int64_t I) {
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float *gate = h + r * 2 * I, *up = gate + I, *gr = g + r * I;
      float *dgate = dh + r * 2 * I, *dup = dgate + I;
      const Vec wr(w[r]);
      Vec dot(0.f);
      for (int64_t j = 0; j < I; j += Vec::size()) {
        const int64_t m = std::min<int64_t>(Vec::size(), I - j);
        const Vec x = Vec::loadu(gate + j, m), u = Vec::loadu(up + j, m), gj = Vec::loadu(gr + j, m);
        const Vec s = sigmoid(x), silu = x * s, act = silu * u, gw = gj * wr;
        dot = dot + gj * act;  // lanes past m were loaded as 0
        (act * wr).store(a + r * I + j, m);
        (gw * u * s * (Vec(1.f) + x * (Vec(1.f) - s))).store(dgate + j, m);
        (gw * silu).store(dup + j, m);
      }
      if (dw) {
        float lanes[Vec::size()];
        dot.store(lanes);
        dw[r] = std::accumulate(lanes, lanes + Vec::size(), 0.f);
      }
    }
  });
}

// One unit of work: expert `expert` over its slots [start, start + rows).
struct Item {
  int64_t expert, start, rows;
};

struct Problem {
  int64_t M, D, E, I;
  std::vector<Item> items;     // the experts that received tokens
  std::vector<int64_t> count;  // per expert
  int64_t max_rows = 0;        // scratch size: the most slots of one expert
};

Problem check_inputs(const at::Tensor& x, const at::Tensor& token, const at::Tensor& counts, const at::Tensor& w,
                     const at::Tensor& gate_up, const at::Tensor& down) {
  for (const at::Tensor* t : {&x, &w, &gate_up, &down})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "segment_mlp: x, w and the weights must be contiguous fp32 CPU tensors");
  TORCH_CHECK(token.scalar_type() == at::kLong && token.is_contiguous() && token.dim() == 1,
              "segment_mlp: token must be a contiguous int64 vector");
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong && counts.is_contiguous(),
              "segment_mlp: counts must be a contiguous CPU int64 tensor");
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3,
              "segment_mlp: x [M, D], gate_up [E, 2I, D], down [E, D, I]");
  Problem p{x.size(0), x.size(1), gate_up.size(0), down.size(2), {}, {}};
  const int64_t N = token.numel();
  TORCH_CHECK(gate_up.size(1) == 2 * p.I && gate_up.size(2) == p.D && down.size(0) == p.E && down.size(1) == p.D,
              "segment_mlp: weight shapes do not match x and each other");
  TORCH_CHECK(counts.numel() == p.E && w.numel() == N, "segment_mlp: counts must have E entries and w N entries");
  const int64_t* c = counts.data_ptr<int64_t>();
  int64_t offset = 0;
  for (int64_t e = 0; e < p.E; ++e) {
    TORCH_CHECK(c[e] >= 0, "segment_mlp: negative count");
    p.count.push_back(c[e]);
    if (c[e] > 0) p.items.push_back({e, offset, c[e]});
    p.max_rows = std::max(p.max_rows, c[e]);
    offset += c[e];
  }
  TORCH_CHECK(offset == N, "segment_mlp: counts sum to ", offset, " but there are ", N, " token-slots");
  const int64_t* tok = token.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(tok[n] >= 0 && tok[n] < p.M, "segment_mlp: token row out of range");
  return p;
}

// Which items each thread runs: longest-processing-time first on rows. A single list (every item in
// order, run with threaded GEMMs) for one thread, or when the best split leaves a thread idle for more than
// ~12% of the time.
std::vector<std::vector<Item>> plan_items(const std::vector<Item>& items) {
  const int64_t nt = at::get_num_threads();
  if (nt > 1) {
    std::vector<Item> order(items);
    std::stable_sort(order.begin(), order.end(),
                     [](const Item& p, const Item& q) { return p.rows > q.rows; });
    std::vector<std::vector<Item>> plan(nt);
    std::vector<int64_t> load(nt, 0);
    for (const Item& it : order) {
      const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
      plan[t].push_back(it);
      load[t] += it.rows;
    }
    const int64_t total = std::accumulate(load.begin(), load.end(), int64_t{0});
    if (*std::max_element(load.begin(), load.end()) * nt * 8 <= total * 9) return plan;
  }
  return {items};
}

// fn(list, item) for every planned item: the lists in parallel, or one list's items in turn.
template <typename Fn>
void run_plan(const std::vector<std::vector<Item>>& plan, const Fn& fn) {
  if (plan.size() == 1) {
    for (const Item& it : plan[0]) fn(0, it);
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t b, int64_t end) {
    at::NoGradGuard no_grad;  // grad mode is thread-local: the caller's guard does not reach worker threads
    for (int64_t t = b; t < end; ++t)
      for (const Item& it : plan[t]) fn(t, it);
  });
}

// One zeroed [M, D] accumulator per list (lists may share rows), summed into the first afterwards.
std::vector<at::Tensor> accumulators(const at::Tensor& like, const std::vector<std::vector<Item>>& plan) {
  std::vector<at::Tensor> acc;
  for (size_t t = 0; t < plan.size(); ++t) acc.push_back(at::zeros_like(like));
  return acc;
}

at::Tensor sum_accumulators(std::vector<at::Tensor>& acc) {
  for (size_t t = 1; t < acc.size(); ++t) acc[0].add_(acc[t]);
  return acc[0];
}

// Per-list scratch: a [lists, elems] buffer whose row t is viewed as [rows, width].
at::Tensor view_scratch(const at::Tensor& buf, int64_t t, int64_t rows, int64_t width) {
  return buf[t].narrow(0, 0, rows * width).view({rows, width});
}

}  // namespace

// -> (y [M, D], h: gate/up pre-activations per expert [count, 2I]).
std::tuple<at::Tensor, std::vector<at::Tensor>> segment_mlp_forward(const at::Tensor& x, const at::Tensor& token,
                                                        const at::Tensor& counts, const at::Tensor& w,
                                                        const at::Tensor& gate_up, const at::Tensor& down) {
  const Problem p = check_inputs(x, token, counts, w, gate_up, down);
  at::NoGradGuard no_grad;
  const auto plan = plan_items(p.items);
  const int64_t L = plan.size();
  // why one buffer per expert and not one [N, 2I]: glibc serves blocks of 32 MB and more with fresh mmap pages,
  // page-faulted in again at every step (~0.3 ms/MB here); per-expert blocks come from its reused heap.
  std::vector<at::Tensor> h;
  for (int64_t n : p.count) h.push_back(at::empty({n, 2 * p.I}, x.options()));
  auto rows = at::empty({L, p.max_rows, p.D}, x.options());  // an expert's x rows, then its output rows
  auto a = at::empty({L, p.max_rows * p.I}, x.options());
  auto y = accumulators(x, plan);
  const int64_t* tok = token.data_ptr<int64_t>();
  run_plan(plan, [&](int64_t t, const Item& it) {
    const int64_t s = it.start, n = it.rows;
    auto a_e = view_scratch(a, t, n, p.I);
    const int64_t e = it.expert;
    auto x_e = rows[t].narrow(0, 0, n);
    gather_rows(x.data_ptr<float>(), tok + s, x_e.data_ptr<float>(), n, p.D);
    at::mm_out(h[e], x_e, gate_up[e].t());
    swiglu_forward(h[e].data_ptr<float>(), w.data_ptr<float>() + s, a_e.data_ptr<float>(), n, p.I);
    at::mm_out(x_e, a_e, down[e].t());
    scatter_add_rows(x_e.data_ptr<float>(), tok + s, y[t].data_ptr<float>(), n, p.D);
  });
  return {sum_accumulators(y), h};
}

// -> (dx [M, D], dw [N] (undefined unless need_dw), d_gate_up, d_down).
std::vector<at::Tensor> segment_mlp_backward(const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& token,
                                 const at::Tensor& counts, const at::Tensor& w, const at::Tensor& gate_up,
                                 const at::Tensor& down, const std::vector<at::Tensor>& h, bool need_dw) {
  const at::Tensor dy = dy_in.contiguous();
  const Problem p = check_inputs(x, token, counts, w, gate_up, down);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == at::kFloat, "segment_mlp: dy must match x");
  TORCH_CHECK(static_cast<int64_t>(h.size()) == p.E, "segment_mlp: one saved block per expert");
  at::NoGradGuard no_grad;
  const auto plan = plan_items(p.items);
  const int64_t L = plan.size();
  auto d_gate_up = at::empty_like(gate_up);
  auto d_down = at::empty_like(down);
  for (int64_t e = 0; e < p.E; ++e) {
    if (p.count[e] == 0) {  // an expert that received no token has zero gradient
      d_gate_up[e].zero_();
      d_down[e].zero_();
    }
  }
  auto dw = need_dw ? at::empty_like(w) : at::Tensor();
  auto x_rows = at::empty({L, p.max_rows, p.D}, x.options());  // an expert's x rows, then its dx rows
  auto dy_rows = at::empty({L, p.max_rows, p.D}, x.options());
  auto g = at::empty({L, p.max_rows * p.I}, x.options());
  auto a = at::empty({L, p.max_rows * p.I}, x.options());
  auto dh = at::empty({L, 2 * p.max_rows * p.I}, x.options());
  auto dx = accumulators(x, plan);
  const int64_t* tok = token.data_ptr<int64_t>();
  run_plan(plan, [&](int64_t t, const Item& it) {
    const int64_t s = it.start, n = it.rows;
    auto g_e = view_scratch(g, t, n, p.I), a_e = view_scratch(a, t, n, p.I);
    auto dh_e = view_scratch(dh, t, n, 2 * p.I);
    const int64_t e = it.expert;
    auto x_e = x_rows[t].narrow(0, 0, n), dy_e = dy_rows[t].narrow(0, 0, n);
    auto d_down_e = d_down[e], d_gate_up_e = d_gate_up[e];
    gather_rows(dy.data_ptr<float>(), tok + s, dy_e.data_ptr<float>(), n, p.D);
    at::mm_out(g_e, dy_e, down[e]);
    swiglu_backward(g_e.data_ptr<float>(), h[e].data_ptr<float>(), w.data_ptr<float>() + s, a_e.data_ptr<float>(),
                    dh_e.data_ptr<float>(), need_dw ? dw.data_ptr<float>() + s : nullptr, n, p.I);
    at::mm_out(d_down_e, dy_e.t(), a_e);
    gather_rows(x.data_ptr<float>(), tok + s, x_e.data_ptr<float>(), n, p.D);
    at::mm_out(d_gate_up_e, dh_e.t(), x_e);
    at::mm_out(x_e, dh_e, gate_up[e]);
    scatter_add_rows(x_e.data_ptr<float>(), tok + s, dx[t].data_ptr<float>(), n, p.D);
  });
  return {sum_accumulators(dx), dw, d_gate_up, d_down};
}

// The split over threads for these per-expert counts: lists of experts. Exposed for tests.
std::vector<std::vector<int64_t>> segment_mlp_plan(const at::Tensor& counts) {
  const at::Tensor c = counts.contiguous();
  std::vector<Item> items;
  for (int64_t e = 0; e < c.numel(); ++e)
    if (c.data_ptr<int64_t>()[e] > 0) items.push_back({e, 0, c.data_ptr<int64_t>()[e]});
  std::vector<std::vector<int64_t>> out;
  for (const auto& list : plan_items(items)) {
    out.emplace_back();
    for (const Item& it : list) out.back().push_back(it.expert);
  }
  return out;
}
