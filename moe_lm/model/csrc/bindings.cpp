// The Python module of the compiled CPU kernels (built by moe_lm/model/cpu_kernels.py).
#include <torch/extension.h>

#include <tuple>
#include <vector>

// segment_mlp.cpp
std::tuple<at::Tensor, std::vector<at::Tensor>> segment_mlp_forward(
    const at::Tensor& x, const at::Tensor& token, const at::Tensor& counts, const at::Tensor& w,
    const at::Tensor& gate_up, const at::Tensor& down, const c10::optional<at::Tensor>& shared_gate_up,
    const c10::optional<at::Tensor>& shared_down);
std::vector<at::Tensor> segment_mlp_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& token,
                                             const at::Tensor& counts, const at::Tensor& w,
                                             const at::Tensor& gate_up, const at::Tensor& down,
                                             const c10::optional<at::Tensor>& shared_gate_up,
                                             const c10::optional<at::Tensor>& shared_down,
                                             const std::vector<at::Tensor>& h, bool need_dw);
std::vector<std::vector<int64_t>> segment_mlp_plan(const at::Tensor& counts, int64_t width, int64_t shared_rows,
                                                   int64_t shared_width);
// route_topk.cpp
at::Tensor topk_experts(const at::Tensor& scores, const c10::optional<at::Tensor>& bias, int64_t k, int64_t n_group,
                        int64_t topk_group);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("segment_mlp_forward", &segment_mlp_forward, "routed (+ shared) experts forward -> (y, h per item)");
  m.def("segment_mlp_backward", &segment_mlp_backward,
        "-> (dx, dw, d_gate_up, d_down, d_shared_gate_up, d_shared_down)");
  m.def("segment_mlp_plan", &segment_mlp_plan, "the split of work items over threads (for tests)");
  m.def("topk_experts", &topk_experts, "group-limited top-k expert choice -> idx [T, k]");
}
