// The Python module of the compiled CPU kernels (built by moe_lm/ops/cpu_kernels.py).
#include <torch/extension.h>

#include <tuple>
#include <vector>

// segment_mlp.cpp
std::tuple<at::Tensor, std::vector<at::Tensor>> segment_mlp_forward(
    const at::Tensor& x, const at::Tensor& token, const at::Tensor& counts, const at::Tensor& w,
    const at::Tensor& gate_up, const at::Tensor& down);
std::vector<at::Tensor> segment_mlp_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& token,
                                             const at::Tensor& counts, const at::Tensor& w,
                                             const at::Tensor& gate_up, const at::Tensor& down,
                                             const std::vector<at::Tensor>& h, bool need_dw);
std::vector<std::vector<int64_t>> segment_mlp_plan(const at::Tensor& counts);
// route_topk.cpp
at::Tensor topk_experts(const at::Tensor& scores, const c10::optional<at::Tensor>& bias, int64_t k, int64_t n_group,
                        int64_t topk_group);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("segment_mlp_forward", &segment_mlp_forward, "routed experts forward -> (y, h per expert)");
  m.def("segment_mlp_backward", &segment_mlp_backward, "-> (dx, dw, d_gate_up, d_down)");
  m.def("segment_mlp_plan", &segment_mlp_plan, "the split of experts over threads (for tests)");
  m.def("topk_experts", &topk_experts, "group-limited top-k expert choice -> idx [T, k]");
}
