// CPU kernel of the "grouped" expert path, fp32, forward and backward:
//   y[token[n]] += w[n] * down_e(silu(gate_e x[token[n]]) * up_e x[token[n]])   for token-slots n sorted by expert e.
//
// why compiled: in eager PyTorch every expert costs ~10 element-wise passes over fresh buffers plus Python
// dispatch, as much time as its matmuls on a 2-core CPU. Here an expert is gather -> GEMM -> one fused SwiGLU
// pass -> GEMM -> scatter-add, on per-thread scratch that stays in cache. When the token counts split evenly,
// the threads take whole experts (each GEMM single-threaded, no fork/join per matmul); otherwise experts run
// one after another with threaded GEMMs. The results do not depend on the split beyond float summation order.
//
// Shapes: x [M, D]; token [N] row of x of each slot (slots sorted by expert); counts [E] (CPU int64); w [N];
// gate_up [E, 2I, D] (gate rows first); down [E, D, I]. Forward saves h [N, 2I], the gate/up pre-activations;
// backward gathers x again instead of keeping an [N, D] copy.
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
// with silu'(x) = s (1 + x (1 - s)), s = sigmoid(x). dw is skipped when null.
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

struct Segments {
  std::vector<int64_t> start, count;
  int64_t max_count = 0;
};

// Which experts each thread runs: longest-processing-time first on the token counts. A single list (every
// expert, in order, to run with threaded GEMMs) for one thread, or when the best split leaves a thread idle
// for more than ~12% of the time.
std::vector<std::vector<int64_t>> plan_experts(const Segments& seg) {
  const int64_t E = seg.count.size(), nt = at::get_num_threads();
  if (nt > 1) {
    std::vector<int64_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return seg.count[p] > seg.count[q]; });
    std::vector<std::vector<int64_t>> plan(nt);
    std::vector<int64_t> load(nt, 0);
    for (int64_t e : order) {
      if (seg.count[e] == 0) continue;
      const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
      plan[t].push_back(e);
      load[t] += seg.count[e];
    }
    const int64_t total = std::accumulate(load.begin(), load.end(), int64_t{0});
    if (*std::max_element(load.begin(), load.end()) * nt * 8 <= total * 9) return plan;
  }
  std::vector<int64_t> all;
  for (int64_t e = 0; e < E; ++e)
    if (seg.count[e] > 0) all.push_back(e);
  return {all};
}

// fn(list, expert) for every planned expert: the lists in parallel, or one list's experts in turn.
template <typename Fn>
void run_plan(const std::vector<std::vector<int64_t>>& plan, const Fn& fn) {
  if (plan.size() == 1) {
    for (int64_t e : plan[0]) fn(0, e);
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(plan.size()), 1, [&](int64_t b, int64_t end) {
    at::NoGradGuard no_grad;  // grad mode is thread-local: the caller's guard does not reach worker threads
    for (int64_t t = b; t < end; ++t)
      for (int64_t e : plan[t]) fn(t, e);
  });
}

// One zeroed [M, D] accumulator per list (lists may share rows); summed into the first afterwards.
std::vector<at::Tensor> accumulators(const at::Tensor& like, size_t lists) {
  std::vector<at::Tensor> acc;
  for (size_t t = 0; t < lists; ++t) acc.push_back(at::zeros_like(like));
  return acc;
}

at::Tensor sum_accumulators(std::vector<at::Tensor>& acc) {
  for (size_t t = 1; t < acc.size(); ++t) acc[0].add_(acc[t]);
  return acc[0];
}

Segments check_and_segment(const at::Tensor& x, const at::Tensor& token, const at::Tensor& counts,
                           const at::Tensor& w, const at::Tensor& gate_up, const at::Tensor& down) {
  for (const at::Tensor* t : {&x, &w, &gate_up, &down})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "segment_mlp: x, w and the weights must be contiguous fp32 CPU tensors");
  TORCH_CHECK(token.scalar_type() == at::kLong && token.is_contiguous() && token.dim() == 1,
              "segment_mlp: token must be a contiguous int64 vector");
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong && counts.is_contiguous(),
              "segment_mlp: counts must be a contiguous CPU int64 tensor");
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3, "segment_mlp: x [M, D], gate_up [E, 2I, D], down [E, D, I]");
  const int64_t M = x.size(0), D = x.size(1), E = gate_up.size(0), I = down.size(2), N = token.numel();
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == D && down.size(0) == E && down.size(1) == D,
              "segment_mlp: weight shapes do not match x and each other");
  TORCH_CHECK(counts.numel() == E && w.numel() == N, "segment_mlp: counts must have E entries and w N entries");
  Segments seg;
  const int64_t* c = counts.data_ptr<int64_t>();
  int64_t offset = 0;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(c[e] >= 0, "segment_mlp: negative count");
    seg.start.push_back(offset);
    seg.count.push_back(c[e]);
    seg.max_count = std::max(seg.max_count, c[e]);
    offset += c[e];
  }
  TORCH_CHECK(offset == N, "segment_mlp: counts sum to ", offset, " but there are ", N, " token-slots");
  const int64_t* tok = token.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(tok[n] >= 0 && tok[n] < M, "segment_mlp: token row out of range");
  return seg;
}

}  // namespace

// -> (y [M, D], h [N, 2I]).
std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& token, const at::Tensor& counts,
                                const at::Tensor& w, const at::Tensor& gate_up, const at::Tensor& down) {
  const Segments seg = check_and_segment(x, token, counts, w, gate_up, down);
  at::NoGradGuard no_grad;
  const int64_t D = x.size(1), I = down.size(2), N = token.numel();
  const auto plan = plan_experts(seg);
  const int64_t L = plan.size();
  auto h = at::empty({N, 2 * I}, x.options());
  auto rows = at::empty({L, seg.max_count, D}, x.options());  // an expert's x rows, then its output rows
  auto a = at::empty({L, seg.max_count, I}, x.options());
  auto y = accumulators(x, L);
  const int64_t* tok = token.data_ptr<int64_t>();
  run_plan(plan, [&](int64_t t, int64_t e) {
    const int64_t s = seg.start[e], n = seg.count[e];
    auto x_e = rows[t].narrow(0, 0, n), a_e = a[t].narrow(0, 0, n), h_e = h.narrow(0, s, n);
    gather_rows(x.data_ptr<float>(), tok + s, x_e.data_ptr<float>(), n, D);
    at::mm_out(h_e, x_e, gate_up[e].t());
    swiglu_forward(h_e.data_ptr<float>(), w.data_ptr<float>() + s, a_e.data_ptr<float>(), n, I);
    at::mm_out(x_e, a_e, down[e].t());
    scatter_add_rows(x_e.data_ptr<float>(), tok + s, y[t].data_ptr<float>(), n, D);
  });
  return {sum_accumulators(y), h};
}

// -> (dx [M, D], dw [N] (undefined unless need_dw), d_gate_up, d_down).
std::vector<at::Tensor> backward(const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& token,
                                 const at::Tensor& counts, const at::Tensor& w, const at::Tensor& gate_up,
                                 const at::Tensor& down, const at::Tensor& h, bool need_dw) {
  const at::Tensor dy = dy_in.contiguous();
  const Segments seg = check_and_segment(x, token, counts, w, gate_up, down);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == at::kFloat, "segment_mlp: dy must match x");
  at::NoGradGuard no_grad;
  const int64_t D = x.size(1), I = down.size(2);
  const auto plan = plan_experts(seg);
  const int64_t L = plan.size();
  auto d_gate_up = at::empty_like(gate_up);
  auto d_down = at::empty_like(down);
  for (size_t e = 0; e < seg.count.size(); ++e) {
    if (seg.count[e] == 0) {  // an expert that received no token has zero gradient
      d_gate_up[e].zero_();
      d_down[e].zero_();
    }
  }
  auto dw = need_dw ? at::empty_like(w) : at::Tensor();
  auto x_rows = at::empty({L, seg.max_count, D}, x.options());  // an expert's x rows, then its dx rows
  auto dy_rows = at::empty({L, seg.max_count, D}, x.options());
  auto g = at::empty({L, seg.max_count, I}, x.options());
  auto a = at::empty({L, seg.max_count, I}, x.options());
  auto dh = at::empty({L, seg.max_count, 2 * I}, x.options());
  auto dx = accumulators(x, L);
  const int64_t* tok = token.data_ptr<int64_t>();
  run_plan(plan, [&](int64_t t, int64_t e) {
    const int64_t s = seg.start[e], n = seg.count[e];
    auto x_e = x_rows[t].narrow(0, 0, n), dy_e = dy_rows[t].narrow(0, 0, n), g_e = g[t].narrow(0, 0, n);
    auto a_e = a[t].narrow(0, 0, n), dh_e = dh[t].narrow(0, 0, n);
    auto d_down_e = d_down[e], d_gate_up_e = d_gate_up[e];
    gather_rows(dy.data_ptr<float>(), tok + s, dy_e.data_ptr<float>(), n, D);
    at::mm_out(g_e, dy_e, down[e]);
    swiglu_backward(g_e.data_ptr<float>(), h.data_ptr<float>() + s * 2 * I, w.data_ptr<float>() + s,
                    a_e.data_ptr<float>(), dh_e.data_ptr<float>(), need_dw ? dw.data_ptr<float>() + s : nullptr, n, I);
    at::mm_out(d_down_e, dy_e.t(), a_e);
    gather_rows(x.data_ptr<float>(), tok + s, x_e.data_ptr<float>(), n, D);
    at::mm_out(d_gate_up_e, dh_e.t(), x_e);
    at::mm_out(x_e, dh_e, gate_up[e]);
    scatter_add_rows(x_e.data_ptr<float>(), tok + s, dx[t].data_ptr<float>(), n, D);
  });
  return {sum_accumulators(dx), dw, d_gate_up, d_down};
}

// Which experts each thread would take for these counts (one list: experts in turn with threaded GEMMs).
std::vector<std::vector<int64_t>> plan(const at::Tensor& counts) {
  TORCH_CHECK(counts.device().is_cpu() && counts.scalar_type() == at::kLong, "plan: counts must be CPU int64");
  const at::Tensor c = counts.contiguous();
  Segments seg;
  seg.count.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  return plan_experts(seg);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("plan", &plan, "the expert split over threads for these counts");
  m.def("forward", &forward, "segment MLP forward -> (y, h)");
  m.def("backward", &backward, "segment MLP backward -> (dx, dw, d_gate_up, d_down)");
}
